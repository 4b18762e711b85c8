//! Build information for `--version`, the start-up log line, `/status` and the
//! `turnstile_build_info` metric: the git revision when built from a checkout, else
//! "unknown" (a published package has no `.git`).

use std::path::Path;
use std::process::Command;

fn main() {
    let revision = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_hexdigit()))
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=TURNSTILE_REVISION={revision}");
    // Re-run when the checked-out commit changes (only for paths that exist: a missing one
    // would make the script run on every build).
    let mut watched = false;
    for p in [".git/HEAD", ".git/logs/HEAD"] {
        if Path::new(p).exists() {
            println!("cargo:rerun-if-changed={p}");
            watched = true;
        }
    }
    if !watched {
        println!("cargo:rerun-if-changed=build.rs");
    }
}
