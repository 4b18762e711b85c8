//! The documentation's checks: docs/configuration.md is what the binary's clap definitions
//! render (`turnstile config-reference`), and every relative link of the markdown pages
//! (README.md, BENCHMARKS.md, CHANGELOG.md, docs/) names a file that exists and, with a
//! `#fragment`, a heading of that file.

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Stale: regenerate with `TURNSTILE_BLESS=1 cargo test --test docs`.
#[test]
fn the_configuration_reference_is_generated_from_the_flags() {
    let out = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .arg("config-reference")
        .output()
        .expect("run turnstile config-reference");
    assert!(out.status.success(), "{out:?}");
    let rendered = String::from_utf8(out.stdout).expect("utf-8");
    let path = root().join("docs/configuration.md");
    if std::env::var_os("TURNSTILE_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&path, &rendered).expect("write docs/configuration.md");
        return;
    }
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    if on_disk != rendered {
        let line = on_disk
            .lines()
            .zip(rendered.lines())
            .position(|(a, b)| a != b)
            .map_or(on_disk.lines().count().min(rendered.lines().count()), |i| i);
        panic!(
            "docs/configuration.md is stale (first difference at line {}: {:?} is now {:?}); \
             regenerate it with:\n\n    TURNSTILE_BLESS=1 cargo test --test docs\n",
            line + 1,
            on_disk.lines().nth(line).unwrap_or("<end of file>"),
            rendered.lines().nth(line).unwrap_or("<end of file>"),
        );
    }
    for line in rendered.lines().filter(|l| l.starts_with("| `")) {
        assert_eq!(line.matches(" | ").count(), 2, "not three cells: {line}");
    }
}

/// Every markdown page the repository's documentation is made of.
fn pages() -> Vec<PathBuf> {
    let mut pages: Vec<PathBuf> = ["README.md", "BENCHMARKS.md", "CHANGELOG.md"]
        .iter()
        .map(|p| root().join(p))
        .collect();
    let mut dirs = vec![root().join("docs")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read docs/") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                pages.push(path);
            }
        }
    }
    pages
}

/// The targets of a page's inline links, `](target)`, outside fenced code blocks.
fn links(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let end = rest.find(')').unwrap_or(rest.len());
            found.push(rest[..end].to_owned());
            rest = &rest[end..];
        }
    }
    found
}

/// GitHub's anchor of a heading: lower case, spaces to `-`, punctuation dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn anchors(page: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(page).unwrap_or_default();
    let mut fenced = false;
    let mut found = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            found.push(anchor(line.trim_start_matches('#')));
        }
    }
    found
}

#[test]
fn every_relative_link_resolves() {
    let mut broken = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("read page");
        let dir = page.parent().expect("a directory");
        for target in links(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (file, fragment) = target.split_once('#').unwrap_or((&target, ""));
            let file = if file.is_empty() {
                page.clone()
            } else {
                dir.join(file)
            };
            let shown = page.strip_prefix(root()).unwrap_or(&page).display();
            if !file.exists() {
                broken.push(format!("{shown}: {target} (no such file)"));
            } else if !fragment.is_empty()
                && file.extension().is_some_and(|e| e == "md")
                && !anchors(&file).iter().any(|a| a == fragment)
            {
                broken.push(format!("{shown}: {target} (no such heading)"));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}
