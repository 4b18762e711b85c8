use std::collections::HashSet;
use std::path::PathBuf;

use super::*;

const SHA: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

/// A spool (canonical, as the gateway names it) holding `a.txt` of 5 bytes.
fn spool() -> (tempfile::TempDir, AttachmentLimits) {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = open_spool(&dir.path().join("spool")).expect("spool");
    std::fs::write(root.join("a.txt"), b"hello").expect("write");
    let limits = AttachmentLimits {
        dir: Some(root),
        ..AttachmentLimits::default()
    };
    (dir, limits)
}

fn file(path: &str, size: u64) -> Attachment {
    Attachment {
        name: "a.txt".into(),
        mime: "text/plain".into(),
        size,
        sha256: Some(SHA.into()),
        path: Some(path.into()),
        skipped: None,
    }
}

fn inside(limits: &AttachmentLimits, name: &str) -> String {
    let root = limits.dir.as_ref().expect("dir");
    root.join(name).to_string_lossy().into_owned()
}

#[test]
fn a_regular_file_inside_the_spool_is_admitted() {
    let (_tmp, limits) = spool();
    let a = file(&inside(&limits, "a.txt"), 5);
    assert_eq!(limits.check(&[a]), Ok(()));
}

/// A hostile bridge must not make an agent read a file outside the spool: not by naming
/// it, not through `..`, not through a link inside the spool, not as a directory.
#[test]
fn paths_outside_the_spool_or_not_regular_files_are_refused() {
    let (tmp, limits) = spool();
    let root = limits.dir.clone().expect("dir");
    // A secret of the test's own beside the spool: a check that failed must never reach a
    // file of the machine's (a mutant or a revert would hand it to the janitor to delete).
    let secret = tmp.path().join("secret.txt");
    std::fs::write(&secret, b"not for the agent").expect("secret");
    let secret = secret.to_string_lossy().into_owned();
    std::os::unix::fs::symlink(&secret, root.join("link")).expect("symlink");
    std::fs::create_dir(root.join("sub")).expect("mkdir");
    let dotdot = format!("{}/../spool/a.txt", root.display());
    for (path, why) in [
        (secret.as_str(), "not inside"),
        (dotdot.as_str(), "without '..'"),
        (&inside(&limits, "link"), "not inside"),
        (&inside(&limits, "sub"), "not a regular file"),
        (&inside(&limits, "missing"), "does not exist"),
        ("a.txt", "must be absolute"),
    ] {
        let err = limits.check(&[file(path, 5)]).expect_err(path);
        assert!(err.contains(why), "{path}: {err}");
        assert!(err.starts_with("attachments[0]: "), "{err}");
    }
    let none = AttachmentLimits::default();
    let err = none.check(&[file("/tmp/x", 5)]).expect_err("no spool");
    assert!(err.contains("no attachments directory"), "{err}");
}

#[test]
fn the_count_the_size_and_the_entry_are_bounded() {
    let (_tmp, mut limits) = spool();
    let ok = file(&inside(&limits, "a.txt"), 5);
    limits.max_files = 2;
    assert_eq!(limits.check(&[ok.clone(), ok.clone()]), Ok(()));
    let err = limits.check(&[ok.clone(), ok.clone(), ok.clone()]);
    assert_eq!(
        err,
        Err("attachments: more than --max-attachments 2".to_owned())
    );
    limits.max_file_bytes = 4;
    let err = limits
        .check(std::slice::from_ref(&ok))
        .expect_err("too big");
    assert!(
        err.contains("larger than --max-attachment-bytes 4"),
        "{err}"
    );
    limits.max_file_bytes = 5;
    let err = limits.check(&[file(&inside(&limits, "a.txt"), 6)]);
    assert!(err.expect_err("size").contains("size says 6"));
    for (broken, why) in [
        (
            Attachment {
                sha256: Some("AB".into()),
                ..ok.clone()
            },
            "sha256",
        ),
        (
            Attachment {
                sha256: None,
                ..ok.clone()
            },
            "needs its sha256",
        ),
        (
            Attachment {
                name: "a\nb".into(),
                ..ok.clone()
            },
            "name",
        ),
        (
            Attachment {
                skipped: Some("too big".into()),
                ..ok.clone()
            },
            "not both",
        ),
        (
            Attachment {
                path: None,
                ..ok.clone()
            },
            "needs a path",
        ),
    ] {
        let err = limits.check(&[broken]).expect_err(why);
        assert!(err.contains(why), "{why}: {err}");
    }
    let skipped = Attachment {
        path: None,
        sha256: None,
        skipped: Some("larger than 20 MiB".into()),
        ..ok
    };
    assert_eq!(limits.check(&[skipped]), Ok(()));
}

#[test]
fn the_sweep_removes_orphans_and_keeps_named_and_partial_files() {
    let (_tmp, limits) = spool();
    let root = limits.dir.clone().expect("dir");
    std::fs::write(root.join("b.png"), b"png").expect("write");
    std::fs::write(root.join("c.part"), b"half").expect("write");
    let keep: HashSet<PathBuf> = [root.join("b.png")].into();
    assert_eq!(sweep(&root, &keep).expect("sweep"), 1);
    assert!(!root.join("a.txt").exists());
    assert!(root.join("b.png").exists() && root.join("c.part").exists());
    assert_eq!(spool_used(&root).expect("used"), 7);
}

#[test]
fn entries_round_trip_through_json_without_their_absent_fields() {
    let a = file("/s/a.txt", 5);
    let text = to_json(std::slice::from_ref(&a));
    assert!(!text.contains("skipped"), "{text}");
    let back = parse_list(serde_json::from_str(&text).expect("json")).expect("list");
    assert_eq!(back, vec![a]);
    let err = parse_list(serde_json::json!([{"name": "x", "evil": 1}])).expect_err("unknown");
    assert!(err.starts_with("attachments must be a list"), "{err}");
}
