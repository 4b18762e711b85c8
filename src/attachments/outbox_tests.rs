//! The outbox's rules (issue 36 row 3): what is attached, what is refused, the bounds.

use super::*;

/// A spool (canonical) with `limits`' bounds, and a fresh outbox in it.
fn outbox_with(
    max_files: usize,
    max_file_bytes: u64,
    spool_bytes: u64,
) -> (tempfile::TempDir, Outbox) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let spool = super::super::open_spool(&tmp.path().join("spool")).expect("spool");
    let limits = AttachmentLimits {
        dir: Some(spool),
        max_files,
        max_file_bytes,
        spool_bytes,
    };
    let outbox = Outbox::create(&limits).expect("create").expect("a spool");
    (tmp, outbox)
}

fn spool_of(outbox: &Outbox) -> PathBuf {
    outbox.limits.dir.clone().expect("dir")
}

/// sha256("hello").
const HELLO: &str = "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824";

/// The exec rule: every regular file at the top level, by name, moved flat into the spool
/// with its sha256; a directory is ignored; a link (here to a secret outside) is refused,
/// said; the outbox is gone afterwards.
#[test]
fn every_regular_file_left_is_attached_and_a_link_is_refused() {
    let (tmp, outbox) = outbox_with(10, 1 << 20, 1 << 30);
    let dir = outbox.path().to_path_buf();
    let spool = spool_of(&outbox);
    std::fs::write(dir.join("b.png"), b"hello").expect("write");
    std::fs::write(dir.join("a.txt"), b"hello").expect("write");
    std::fs::create_dir(dir.join("sub")).expect("mkdir");
    std::fs::write(dir.join("sub/deep.txt"), b"x").expect("write");
    let secret = tmp.path().join("secret-c.txt");
    std::fs::write(&secret, b"not for the chat").expect("secret");
    std::os::unix::fs::symlink(&secret, dir.join("c.txt")).expect("symlink");
    let taken = outbox.take_all();
    let names: Vec<_> = taken.files.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, ["a.txt", "b.png"]);
    assert_eq!(taken.files[0].mime, "text/plain");
    assert_eq!(taken.files[1].mime, "image/png");
    for f in &taken.files {
        assert_eq!((f.size, f.sha256.as_deref()), (5, Some(HELLO)));
        let path = Path::new(f.path.as_deref().expect("path"));
        assert_eq!(path.parent(), Some(spool.as_path()), "flat in the spool");
        assert_eq!(std::fs::read(path).expect("moved"), b"hello");
        assert_eq!(
            crate::attachments::AttachmentLimits {
                dir: Some(spool.clone()),
                ..AttachmentLimits::default()
            }
            .check(std::slice::from_ref(f)),
            Ok(()),
            "an entry the gateway's own check admits"
        );
    }
    assert_eq!(
        taken.notes,
        ["(file left out: c.txt: refused: not a regular file)"]
    );
    assert!(
        !dir.exists(),
        "the outbox is removed with what it still held"
    );
}

/// The process rule: a path relative to the outbox or absolute inside it is attached;
/// `..`, a path outside, or a directory linked out of the outbox is refused with a clear
/// line, and nothing outside is read or moved.
#[test]
fn a_path_outside_the_outbox_is_refused() {
    let (tmp, outbox) = outbox_with(10, 1 << 20, 1 << 30);
    let dir = outbox.path().to_path_buf();
    let secret = tmp.path().join("secret.txt");
    std::fs::write(&secret, b"secret").expect("write");
    std::fs::write(dir.join("ok.txt"), b"hello").expect("write");
    std::fs::create_dir(dir.join("in")).expect("mkdir");
    std::fs::write(dir.join("in/two.txt"), b"hello").expect("write");
    std::os::unix::fs::symlink(tmp.path(), dir.join("out")).expect("symlink");
    let ask = |path: &str| Requested {
        path: path.into(),
        name: None,
        mime: None,
    };
    let absolute = dir.join("in/two.txt").to_string_lossy().into_owned();
    let taken = outbox.take_named(&[
        ask("ok.txt"),
        ask(&absolute),
        ask(&secret.to_string_lossy()),
        ask("../secret.txt"),
        ask("out/secret.txt"),
        ask("missing.txt"),
    ]);
    let names: Vec<_> = taken.files.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, ["ok.txt", "two.txt"]);
    let outside = "refused: the path is not inside this turn's outbox ($TURNSTILE_OUTBOX)";
    assert_eq!(
        taken.notes,
        [
            format!("(file left out: secret.txt: {outside})"),
            format!("(file left out: secret.txt: {outside})"),
            format!("(file left out: secret.txt: {outside})"),
            "(file left out: missing.txt: refused: no such file in the outbox)".to_owned(),
        ]
    );
    assert_eq!(std::fs::read(&secret).expect("still there"), b"secret");
}

/// Past `--max-attachments`, `--max-attachment-bytes` or the spool's room a file is left
/// out and the reply says which and why; the name an agent gives is what the chat shows.
#[test]
fn past_a_bound_a_file_is_left_out_and_said() {
    // Room for 8 bytes in all; files of at most 6; 2 per reply.
    let (_tmp, outbox) = outbox_with(2, 6, 8);
    let dir = outbox.path().to_path_buf();
    std::fs::write(dir.join("big"), b"1234567").expect("write");
    std::fs::write(dir.join("one"), b"hello").expect("write");
    std::fs::write(dir.join("two"), b"hello").expect("write");
    std::fs::write(dir.join("three"), b"x").expect("write");
    std::fs::write(dir.join("four"), b"x").expect("write");
    let ask = |path: &str, name: Option<&str>| Requested {
        path: path.into(),
        name: name.map(str::to_owned),
        mime: Some("text/x-custom".into()),
    };
    let taken = outbox.take_named(&[
        ask("big", Some("report.pdf")),
        ask("one", None),
        ask("two", None),
        ask("three", None),
        ask("four", None),
    ]);
    let names: Vec<_> = taken
        .files
        .iter()
        .map(|f| (f.name.as_str(), f.mime.as_str()))
        .collect();
    assert_eq!(
        names,
        [("one", "text/x-custom"), ("three", "text/x-custom")]
    );
    assert_eq!(
        taken.notes,
        [
            "(file left out: report.pdf, 7 B: larger than --max-attachment-bytes 6)",
            "(file left out: two, 5 B: the attachments spool is full (--attachments-bytes 8))",
            "(file left out: four, 1 B: more than --max-attachments 2)",
        ]
    );
    assert_eq!(
        taken.annotate("here".into()),
        format!("here\n{}", taken.notes.join("\n"))
    );
}

/// Without a spool the agent gets no outbox, and files its reply names are said left out.
#[test]
fn without_a_spool_there_is_no_outbox_and_named_files_are_said_left_out() {
    assert!(
        Outbox::create(&AttachmentLimits::default())
            .expect("create")
            .is_none()
    );
    let taken = take_requested(
        None,
        &[Requested {
            path: "a.png".into(),
            name: None,
            mime: None,
        }],
    );
    assert!(taken.files.is_empty());
    assert_eq!(
        taken.notes,
        ["(file left out: a.png: this gateway has no attachments directory)"]
    );
}

/// An outbox a crash left is removed by the start-up sweep; a reply's file kept by the
/// journal stays.
#[test]
fn the_start_up_sweep_removes_an_outbox_left_behind() {
    let (_tmp, outbox) = outbox_with(10, 1 << 20, 1 << 30);
    let spool = spool_of(&outbox);
    let dir = outbox.path().to_path_buf();
    std::fs::write(dir.join("a.txt"), b"hello").expect("write");
    std::mem::forget(outbox); // a crash: the outbox stays
    let kept = spool.join("out-kept-0");
    std::fs::write(&kept, b"x").expect("write");
    let keep = std::collections::HashSet::from([kept.clone()]);
    assert_eq!(super::super::sweep(&spool, &keep).expect("sweep"), 1);
    assert!(!dir.exists());
    assert!(kept.exists());
}

#[test]
fn sizes_read_as_people_read_them() {
    assert_eq!(human_size(0), "0 B");
    assert_eq!(human_size(1023), "1023 B");
    assert_eq!(human_size(1536), "1.5 KiB");
    assert_eq!(human_size(20 << 20), "20.0 MiB");
}
