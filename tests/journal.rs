//! The journal's store: a proptest against its model (random appends, starts, outcomes,
//! deliveries, refusals, and a crash after any batch), a torn or scribbled file, and the
//! journal thread under an injected write fault.

use std::sync::atomic::Ordering;
use std::time::Duration;

use proptest::prelude::*;
use turnstile::internal::journal::{FaultyStore, Journal, JournalConfig, Model, now_ms};
use turnstile::{
    Attachment, ChatType, MemStore, MessageFields, Record, SqliteStore, Store, StoredMessage,
    StoredOutcome,
};

fn message(seq: u64, text: &str) -> StoredMessage {
    StoredMessage::new(
        seq,
        &format!("p{}", seq % 3),
        MessageFields {
            user_id: Some(format!("u{seq}")),
            user_name: seq.is_multiple_of(2).then(|| "Ann".to_string()),
            thread_id: seq.is_multiple_of(4).then(|| "t".to_string()),
            meta: seq.is_multiple_of(3).then(|| "{\"k\":1}".to_string()),
            // Some messages carry files (issue 36): the store keeps their entries.
            attachments: if seq.is_multiple_of(5) {
                attachments(seq)
            } else {
                Vec::new()
            },
            ..MessageFields::new(&format!("m-{seq}"), &format!("c{}", seq % 5), text)
        }, // In the future: the store's housekeeping expires ids by the wall clock.
        now_ms() + 3_600_000 + seq,
    )
}

/// A file in the spool and one a bound skipped.
fn attachments(seq: u64) -> Vec<Attachment> {
    vec![
        Attachment {
            name: format!("photo-{seq}.png"),
            mime: "image/png".into(),
            size: seq,
            sha256: Some("ab".repeat(32)),
            path: Some(format!("/spool/{seq}.png")),
            skipped: None,
        },
        Attachment {
            name: "big.bin".into(),
            mime: String::new(),
            size: 1 << 40,
            sha256: None,
            path: None,
            skipped: Some("larger than --max-attachment-bytes".into()),
        },
    ]
}

fn outcome(seq: u64, text: &str) -> StoredOutcome {
    if seq.is_multiple_of(2) {
        StoredOutcome {
            head: format!("{{\"op\":\"reply\",\"id\":\"m-{seq}\",\"text\":\"").into_bytes(),
            text: text.into(),
            tail: b"\"}\n".to_vec(),
            memory: None,
        }
    } else {
        StoredOutcome {
            head: format!("{{\"op\":\"cancelled\",\"id\":\"m-{seq}\"}}\n").into_bytes(),
            ..StoredOutcome::default()
        }
    }
}

fn record() -> impl Strategy<Value = Record> {
    let seq = 1u64..24;
    prop_oneof![
        3 => (seq.clone(), "[a-z\u{e9}\"\\\\ ]{0,12}").prop_map(|(s, t)| Record::Accepted(message(s, &t))),
        2 => (seq.clone(), 1u32..4).prop_map(|(seq, attempt)| Record::Started { seq, attempt }),
        2 => (seq.clone(), "[a-z ]{0,8}").prop_map(|(s, t)| Record::Outcome { seq: s, outcome: outcome(s, &t) }),
        2 => seq.clone().prop_map(|seq| Record::Delivered { seq }),
        1 => seq.prop_map(|seq| Record::Forget { seq }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// Batches are written and the process "crashes" after any of them (the store is dropped
    /// and opened again; a batch never written is lost whole): what is recovered equals the
    /// model of the batches that were written, and writing goes on after the restart.
    #[test]
    fn recovered_state_equals_the_model(
        batches in prop::collection::vec(prop::collection::vec(record(), 1..6), 1..12),
        crash_after in 0usize..12,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let mut model = Model::default();
        let mut mem = MemStore::new();
        let crash_after = crash_after.min(batches.len());
        {
            let mut store = SqliteStore::open(dir.path()).unwrap();
            for b in &batches[..crash_after] {
                store.write(b).unwrap();
                mem.write(b).unwrap();
                for r in b {
                    model.apply(r);
                }
            }
            // Crash: the store goes without a clean shutdown of the process' state.
        }
        let now = now_ms();
        let mut store = SqliteStore::open(dir.path()).unwrap();
        prop_assert_eq!(store.load(now).unwrap(), model.recovered(now));
        prop_assert_eq!(mem.load(now).unwrap(), model.recovered(now));
        // The rest after the restart.
        for b in &batches[crash_after..] {
            store.write(b).unwrap();
            for r in b {
                model.apply(r);
            }
        }
        drop(store);
        let mut store = SqliteStore::open(dir.path()).unwrap();
        prop_assert_eq!(store.load(now).unwrap(), model.recovered(now));
    }
}

#[test]
fn delivered_messages_leave_the_store_and_their_ids_stay_in_the_window() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = SqliteStore::open(dir.path()).unwrap();
    let batch: Vec<Record> = (1..=100)
        .map(|s| Record::Accepted(message(s, "x")))
        .collect();
    store.write(&batch).unwrap();
    let done: Vec<Record> = (1..=100).map(|seq| Record::Delivered { seq }).collect();
    store.write(&done).unwrap();
    let r = store.load(now_ms()).unwrap();
    assert!(r.messages.is_empty());
    assert_eq!(r.dedup.len(), 100);
    assert_eq!(r.max_seq, 100);
    // After the window, the ids go too.
    let r = store.load(now_ms() + 7_200_000).unwrap();
    assert!(r.dedup.is_empty());
}

#[test]
fn a_second_gateway_on_the_same_data_dir_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut first = SqliteStore::open(dir.path()).unwrap();
    first.write(&[Record::Accepted(message(1, "a"))]).unwrap();
    let second = SqliteStore::open(dir.path()).and_then(|mut s| s.load(0));
    let e = second.expect_err("the journal is locked by the first");
    assert!(e.message.contains("locked"), "{e}");
}

/// A journal written and closed cleanly, then truncated or scribbled at many offsets: opening
/// and loading it either refuses with a clear error or returns messages that were all
/// written (a valid prefix, never an invented one), and never panics.
#[test]
fn a_torn_or_scribbled_store_is_refused_or_yields_only_written_messages() {
    let dir = tempfile::tempdir().unwrap();
    let mut written = Vec::new();
    {
        let mut store = SqliteStore::open(dir.path()).unwrap();
        for s in 1..=60u64 {
            let m = message(s, &"text ".repeat(s as usize));
            written.push(m.clone());
            let mut b = vec![Record::Accepted(m)];
            if s % 3 == 0 {
                b.push(Record::Outcome {
                    seq: s,
                    outcome: outcome(s, "done"),
                });
            }
            store.write(&b).unwrap();
        }
    }
    let file = dir.path().join("journal.sqlite3");
    let original = std::fs::read(&file).unwrap();
    let mark = std::fs::read(dir.path().join("journal.mark")).unwrap();
    assert!(original.len() > 8192, "the test needs a multi-page file");
    let (mut refused, mut loaded) = (0, 0);
    let offsets: Vec<usize> = (0..original.len()).step_by(331).collect();
    for (n, &at) in offsets.iter().enumerate() {
        for scribble in [false, true] {
            let case = tempfile::tempdir().unwrap();
            let mut bytes = original.clone();
            if scribble {
                for (i, b) in bytes.iter_mut().skip(at).take(16).enumerate() {
                    *b ^= 0x5a ^ (i as u8).wrapping_mul(31) ^ (n as u8);
                }
            } else {
                bytes.truncate(at);
            }
            std::fs::write(case.path().join("journal.sqlite3"), &bytes).unwrap();
            std::fs::write(case.path().join("journal.mark"), &mark).unwrap();
            match SqliteStore::open(case.path()).and_then(|mut s| s.load(0)) {
                Err(e) => {
                    assert!(!e.message.is_empty());
                    refused += 1;
                }
                Ok(r) => {
                    loaded += 1;
                    for m in &r.messages {
                        assert!(
                            written.contains(&m.message),
                            "offset {at} (scribble {scribble}): a message nobody wrote: {:?}",
                            m.message
                        );
                        if let Some(o) = &m.outcome {
                            assert_eq!(o, &outcome(m.message.seq, "done"), "offset {at}");
                        }
                    }
                }
            }
        }
    }
    assert!(
        refused > 0 && loaded > 0,
        "refused {refused}, loaded {loaded}"
    );
}

/// The journal thread with a store that fails on command: accepted messages of a failed
/// batch are reported failed, other records are kept and written once the store works again.
#[test]
fn a_failing_store_fails_new_messages_and_keeps_the_other_records() {
    let mem = MemStore::new();
    let (store, failing) = FaultyStore::new(mem.clone());
    let (wake_tx, wake_rx) = crossbeam_channel::unbounded();
    let cfg = JournalConfig {
        max_batch: 64,
        retry_every: Duration::from_millis(10),
        ..JournalConfig::default()
    };
    let mut j = Journal::start(store, cfg, move || {
        let _ = wake_tx.send(());
    })
    .unwrap();
    let next = || {
        wake_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    };
    j.send(Record::Accepted(message(1, "a")));
    next();
    let c: Vec<_> = j.completions().collect();
    assert_eq!(c[0].durable, vec![1]);
    failing.store(true, Ordering::SeqCst);
    j.send(Record::Outcome {
        seq: 1,
        outcome: outcome(1, "x"),
    });
    j.send(Record::Accepted(message(2, "b")));
    let mut failed = Vec::new();
    while failed.is_empty() {
        next();
        for c in j.completions() {
            failed.extend(c.failed);
        }
    }
    assert_eq!(failed, vec![2]);
    assert!(mem.clone().load(0).unwrap().messages[0].outcome.is_none());
    failing.store(false, Ordering::SeqCst);
    // The kept outcome is written by a retry, with nothing new sent.
    loop {
        next();
        if j.completions().any(|c| c.error.is_none()) {
            break;
        }
    }
    let r = mem.clone().load(0).unwrap();
    assert_eq!(r.messages.len(), 1);
    assert_eq!(r.messages[0].outcome, Some(outcome(1, "x")));
    let (_, finished) = j.finish(Duration::from_secs(10));
    assert!(finished);
}

/// The store behind a `Box<dyn Store>` (as the server holds it) and behind the fault
/// wrapper reads and writes the same; an error says what failed.
#[test]
fn boxed_and_wrapped_stores_pass_reads_and_writes_through() {
    let mem = MemStore::new();
    let mut boxed: Box<dyn Store> = Box::new(mem.clone());
    boxed.write(&[Record::Accepted(message(7, "x"))]).unwrap();
    assert_eq!(boxed.load(0).unwrap().messages.len(), 1);
    let (mut faulty, failing) = FaultyStore::new(mem.clone());
    assert_eq!(faulty.load(0).unwrap().max_seq, 7);
    failing.store(true, Ordering::SeqCst);
    let e = faulty.write(&[Record::Delivered { seq: 7 }]).unwrap_err();
    assert_eq!(e.to_string(), "injected fault: no space left on device");
    let mut boxed: Box<dyn Store> = Box::new(faulty);
    assert!(boxed.write(&[Record::Delivered { seq: 7 }]).is_err());
    assert_eq!(mem.clone().load(0).unwrap().messages.len(), 1);
    assert_eq!(Record::Delivered { seq: 7 }.seq(), 7);
    assert_eq!(Record::Accepted(message(9, "x")).seq(), 9);
}

/// An id is a duplicate until its window's end, exclusive, in the model as in SQLite.
#[test]
fn a_window_ending_now_has_expired_in_the_model_and_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = SqliteStore::open(dir.path()).unwrap();
    let mut model = Model::default();
    let m = message(1, "x");
    let until = m.dedup_until_ms;
    let batch = [Record::Accepted(m)];
    store.write(&batch).unwrap();
    model.apply(&batch[0]);
    for now in [until - 1, until, until + 1] {
        assert_eq!(store.load(now).unwrap(), model.recovered(now), "at {now}");
    }
    assert_eq!(model.recovered(until - 1).dedup.len(), 1);
    assert!(model.recovered(until).dedup.is_empty());
    // The wall clock is the real one (ms since the epoch, after 2020).
    assert!(now_ms() > 1_577_836_800_000);
}

#[path = "common/mod.rs"]
mod common;

/// One scribbled row (its text changed behind the journal's back, so it fails its checksum)
/// is moved to the quarantine with an ERROR naming its id and platform, and every other row
/// is recovered; the next start finds nothing left to quarantine, and the mark agrees.
#[test]
fn a_scribbled_row_is_quarantined_and_the_others_recovered() {
    let logs = common::capture_logs();
    let dir = tempfile::tempdir().unwrap();
    {
        let mut store = SqliteStore::open(dir.path()).unwrap();
        for s in 1..=20u64 {
            store
                .write(&[Record::Accepted(message(s, "hello"))])
                .unwrap();
        }
    }
    {
        let c = rusqlite::Connection::open(dir.path().join("journal.sqlite3")).unwrap();
        let n = c
            .execute("UPDATE messages SET text = 'forged' WHERE seq = 7", [])
            .unwrap();
        assert_eq!(n, 1);
    }
    let mut store = SqliteStore::open(dir.path()).unwrap();
    let r = store.load(now_ms()).unwrap();
    let seqs: Vec<u64> = r.messages.iter().map(|m| m.message.seq).collect();
    let expected: Vec<u64> = (1..=20).filter(|s| *s != 7).collect();
    assert_eq!(seqs, expected);
    assert_eq!(store.quarantined(), 1);
    let errors = logs.find(log::Level::Error, &["m-7", "p1", "quarantine"]);
    assert_eq!(errors.len(), 1, "{errors:?}");
    drop(store);
    let mut store = SqliteStore::open(dir.path()).unwrap();
    assert_eq!(store.load(now_ms()).unwrap().messages.len(), 19);
    assert_eq!(store.quarantined(), 0);
}

/// Acknowledged commits lost behind the journal's back (the database restored to a copy
/// taken earlier, which is what a lost write-ahead log amounts to) are refused as
/// untrusted, naming the mark and the database; truncating the mark accepts it as it is.
#[test]
fn a_database_older_than_its_mark_is_refused_until_the_mark_is_reset() {
    use turnstile::StoreErrorKind;
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("journal.sqlite3");
    {
        let mut store = SqliteStore::open(dir.path()).unwrap();
        store.write(&[Record::Accepted(message(1, "a"))]).unwrap();
    }
    // Closed cleanly: the write-ahead log is folded into the database.
    let old = std::fs::read(&db).unwrap();
    {
        let mut store = SqliteStore::open(dir.path()).unwrap();
        store.write(&[Record::Accepted(message(2, "b"))]).unwrap();
        store.write(&[Record::Accepted(message(3, "c"))]).unwrap();
    }
    std::fs::write(&db, &old).unwrap();
    let _ = std::fs::remove_file(dir.path().join("journal.sqlite3-wal"));
    let e = SqliteStore::open(dir.path()).err().expect("refused");
    assert_eq!(e.kind, StoreErrorKind::Untrusted, "{e}");
    assert!(!e.is_transient());
    assert!(
        e.message.contains("journal.mark")
            && e.message.contains("journal.sqlite3")
            && e.message.contains("2 acknowledged message(s) are missing"),
        "{e}"
    );
    // Refused again on the next try (nothing was rewritten).
    assert!(SqliteStore::open(dir.path()).is_err());
    // The mark removed: still refused (the database counts commits, so it had one).
    let mark = dir.path().join("journal.mark");
    std::fs::remove_file(&mark).unwrap();
    let e = SqliteStore::open(dir.path()).err().expect("refused");
    assert!(e.message.contains("is missing"), "{e}");
    // The operator's reset: an empty mark accepts the database as it is.
    std::fs::write(&mark, b"").unwrap();
    let mut store = SqliteStore::open(dir.path()).unwrap();
    assert_eq!(store.load(now_ms()).unwrap().messages.len(), 1);
}

/// A journal from before marks existed (a schema version, no commit count, no mark) opens,
/// and gets its mark; the same database with its version gone too (a file that says
/// nothing of what it held) is refused.
#[test]
fn a_journal_older_than_marks_opens_and_an_unversioned_file_without_its_mark_does_not() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut store = SqliteStore::open(dir.path()).unwrap();
        store.write(&[Record::Accepted(message(1, "a"))]).unwrap();
    }
    let db = dir.path().join("journal.sqlite3");
    let mark = dir.path().join("journal.mark");
    let forget = |keys: &str| {
        let conn = rusqlite::Connection::open(&db).unwrap();
        conn.execute(&format!("DELETE FROM meta WHERE k IN ({keys})"), [])
            .unwrap();
    };
    forget("'commits'");
    std::fs::remove_file(&mark).unwrap();
    let mut store = SqliteStore::open(dir.path()).expect("a journal older than marks");
    assert_eq!(store.load(now_ms()).unwrap().messages.len(), 1);
    drop(store);
    assert!(
        std::fs::metadata(&mark).unwrap().len() > 0,
        "its mark written"
    );
    forget("'commits', 'version'");
    std::fs::remove_file(&mark).unwrap();
    let e = SqliteStore::open(dir.path()).err().expect("refused");
    assert_eq!(e.kind, turnstile::StoreErrorKind::Untrusted, "{e}");
    assert!(e.message.contains("is missing"), "{e}");
}

/// A tmpfs of `size` (e.g. "4m") for the test's data directory, unmounted when dropped; None
/// when the test does not run as root (the caller then says what it ran instead).
struct SmallVolume {
    dir: tempfile::TempDir,
}

impl SmallVolume {
    fn mount(size: &str) -> Option<SmallVolume> {
        // SAFETY: geteuid(2) has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .status()
            .is_ok_and(|s| s.success());
        ok.then_some(SmallVolume { dir })
    }

    fn path(&self) -> &std::path::Path {
        self.dir.path()
    }
}

impl Drop for SmallVolume {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg(self.dir.path())
            .status();
    }
}

fn long(seq: u64) -> StoredMessage {
    message(seq, &"x".repeat(2048))
}

/// Finishes `seq`: its turn, a 2 KB reply, its delivery.
fn finish(seq: u64) -> Vec<Record> {
    vec![
        Record::Started { seq, attempt: 1 },
        Record::Outcome {
            seq,
            outcome: outcome(seq, &"y".repeat(2048)),
        },
        Record::Delivered { seq },
    ]
}

/// 5,000 messages of 2 KB with their 2 KB replies (20 MB through the journal) on a 4 MiB
/// volume, at most 4 in flight: every write succeeds, the files stay small, and what is in
/// flight is what loads. Without a checkpoint before SQLite's default 1,000 pages the WAL
/// alone outgrows the volume.
#[test]
fn a_small_volume_carries_thousands_of_messages_with_few_in_flight() {
    let volume = SmallVolume::mount("4m");
    let fallback = tempfile::tempdir().unwrap();
    let base = match &volume {
        Some(v) => v.path(),
        None => {
            eprintln!("not root: a plain directory instead of a 4 MiB tmpfs (size bound only)");
            fallback.path()
        }
    };
    let data = base.join("data");
    let mut store = SqliteStore::open(&data).unwrap();
    assert!(store.reserve_held());
    let mut largest = 0;
    for seq in 1..=5000u64 {
        store
            .write(&[Record::Accepted(long(seq))])
            .unwrap_or_else(|e| panic!("message {seq}: {e}"));
        if seq > 4 {
            store
                .write(&finish(seq - 4))
                .unwrap_or_else(|e| panic!("finishing {}: {e}", seq - 4));
        }
        largest = largest.max(store.disk_bytes().unwrap());
    }
    // Idle housekeeping gives the rest back.
    let idle = store.idle().unwrap();
    assert!(largest < 3 << 20, "the journal took {largest} bytes");
    assert!(idle <= largest, "{idle} after idle, {largest} at most");
    eprintln!("5000 messages: largest {largest} bytes on disk, {idle} after idle");
    let r = store.load(now_ms()).unwrap();
    assert_eq!(r.messages.len(), 4);
    assert_eq!(r.max_seq, 5000);
}

/// The disk fills up (a ballast file takes the rest of a 4 MiB volume): new messages fail
/// (transient, the bridge answers `storage`), the reserve is released so that outcomes and
/// deliveries are still written, and once space returns new messages are written again by
/// the same store, with no restart.
#[test]
fn a_full_disk_refuses_new_messages_keeps_deliveries_and_recovers_by_itself() {
    let Some(volume) = SmallVolume::mount("4m") else {
        eprintln!(
            "not root: skipped (no small volume to fill; the thread's fault path is covered by a_failing_store_fails_new_messages_and_keeps_the_other_records)"
        );
        return;
    };
    let data = volume.path().join("data");
    let mut store = SqliteStore::open(&data).unwrap();
    for seq in 1..=3 {
        store.write(&[Record::Accepted(long(seq))]).unwrap();
    }
    let fill = |name: &str| {
        use std::io::Write;
        let path = volume.path().join(name);
        let mut f = std::fs::File::create(&path).unwrap();
        let chunk = vec![1u8; 4 << 10];
        while f.write_all(&chunk).is_ok() {}
        let _ = f.sync_all();
        path
    };
    let ballast = fill("ballast");
    // New messages until the disk refuses one (the WAL's room is used first).
    let mut seq = 3;
    let e = loop {
        seq += 1;
        assert!(seq < 3000, "the disk never filled");
        if let Err(e) = store.write(&[Record::Accepted(long(seq))]) {
            break e;
        }
    };
    assert!(e.is_transient(), "{e}");
    assert!(!store.reserve_held());
    // Outcomes and deliveries of what was acknowledged still get written.
    for done in 1..seq {
        store
            .write(&finish(done))
            .unwrap_or_else(|e| panic!("finishing {done} on a full disk: {e}"));
    }
    // What the deliveries freed is taken too: the disk stays full, new messages fail.
    let more = fill("more");
    let e = store
        .write(&[Record::Accepted(long(seq + 1))])
        .expect_err("still full");
    assert!(e.is_transient() && e.message.contains("full"), "{e}");
    // Space returns: the same store takes new messages again.
    std::fs::remove_file(&ballast).unwrap();
    std::fs::remove_file(&more).unwrap();
    store.write(&[Record::Accepted(long(seq + 2))]).unwrap();
    assert!(store.reserve_held());
    let r = store.load(now_ms()).unwrap();
    let left: Vec<u64> = r.messages.iter().map(|m| m.message.seq).collect();
    assert_eq!(left, [seq + 2]);
}

/// A store on a full disk: while `full` is set, a batch with a new message fails and any
/// other batch is written; the first write after `full` is set waits for the test.
struct FullDisk {
    inner: MemStore,
    full: std::sync::Arc<std::sync::atomic::AtomicBool>,
    hold: Option<(
        crossbeam_channel::Sender<()>,
        crossbeam_channel::Receiver<()>,
    )>,
}

impl Store for FullDisk {
    fn write(&mut self, batch: &[Record]) -> Result<(), turnstile::StoreError> {
        if self.full.load(Ordering::SeqCst) {
            if let Some((entered, hold)) = self.hold.take() {
                entered.send(()).unwrap();
                hold.recv().unwrap();
            }
            if batch.iter().any(|r| matches!(r, Record::Accepted(_))) {
                return Err(turnstile::StoreError::transient("disk full"));
            }
        }
        self.inner.write(batch)
    }

    fn load(&mut self, now: u64) -> Result<turnstile::Recovered, turnstile::StoreError> {
        self.inner.load(now)
    }
}

/// On a full disk every batch with a new message fails; the records kept from a failed
/// batch (an acknowledged message's outcome) are written alone before the next new
/// message, so they are not held back for as long as new messages keep coming.
#[test]
fn kept_records_are_written_before_new_messages_that_keep_failing() {
    let mem = MemStore::new();
    let full = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (entered_tx, entered) = crossbeam_channel::unbounded();
    let (release, hold) = crossbeam_channel::unbounded();
    let store = FullDisk {
        inner: mem.clone(),
        full: full.clone(),
        hold: Some((entered_tx, hold)),
    };
    let (wake_tx, wake_rx) = crossbeam_channel::unbounded();
    let cfg = JournalConfig {
        // Only new records start another try: no timer writes the kept ones alone.
        retry_every: Duration::from_secs(3600),
        ..JournalConfig::default()
    };
    let mut j = Journal::start(store, cfg, move || {
        let _ = wake_tx.send(());
    })
    .unwrap();
    let wait_failed = |seq: u64| loop {
        wake_rx.recv_timeout(Duration::from_secs(30)).unwrap();
        if j_failed(&j, seq) {
            break;
        }
    };
    fn j_failed(j: &Journal, seq: u64) -> bool {
        j.completions().any(|c| c.failed.contains(&seq))
    }
    j.send(Record::Accepted(message(1, "a")));
    wake_rx.recv_timeout(Duration::from_secs(30)).unwrap();
    assert_eq!(j.completions().next().unwrap().durable, vec![1]);
    full.store(true, Ordering::SeqCst);
    j.send(Record::Accepted(message(2, "b")));
    // The thread is inside the write of message 2: what is sent now makes one batch.
    entered.recv_timeout(Duration::from_secs(30)).unwrap();
    j.send(Record::Outcome {
        seq: 1,
        outcome: outcome(1, "x"),
    });
    j.send(Record::Accepted(message(3, "c")));
    release.send(()).unwrap();
    wait_failed(2);
    wait_failed(3);
    assert!(mem.clone().load(0).unwrap().messages[0].outcome.is_none());
    j.send(Record::Accepted(message(4, "d")));
    wait_failed(4);
    let r = mem.clone().load(0).unwrap();
    assert_eq!(r.messages.len(), 1);
    assert_eq!(r.messages[0].outcome, Some(outcome(1, "x")));
    let _ = j.finish(Duration::ZERO);
}

/// A journal that cannot be created or opened for want of space is a transient failure (a
/// supervisor may retry it: exit 1), not an untrusted journal (exit 2).
#[test]
fn a_full_disk_at_start_up_is_transient() {
    use turnstile::StoreErrorKind;
    let Some(volume) = SmallVolume::mount("1m") else {
        eprintln!("not root: skipped (no small volume to fill)");
        return;
    };
    {
        use std::io::Write;
        let mut f = std::fs::File::create(volume.path().join("ballast")).unwrap();
        let chunk = vec![1u8; 4 << 10];
        while f.write_all(&chunk).is_ok() {}
        let _ = f.sync_all();
    }
    let e = SqliteStore::open(&volume.path().join("data"))
        .and_then(|mut s| s.load(now_ms()))
        .expect_err("no space for a journal");
    assert_eq!(e.kind, StoreErrorKind::Transient, "{e}");
    assert!(e.is_transient());
    eprintln!("full disk at start-up: {e}");
}

/// Deliveries are deleted together, a run of consecutive numbers per statement: a run stops
/// at a number not delivered (the rows in the holes stay), and a record about a delivered
/// message in the same batch is applied in its order (a delivery before a new `accepted`
/// of the same number, an outcome after a delivery) — what the model says, and what a
/// reopened store says too (its mark's count of rows in flight must match).
#[test]
fn batched_deliveries_keep_the_holes_and_the_order_of_the_records() {
    let dir = tempfile::tempdir().unwrap();
    let mut model = Model::default();
    let batches: Vec<Vec<Record>> = vec![
        (1..=12)
            .map(|s| Record::Accepted(message(s, "x")))
            .collect(),
        [1, 2, 3, 5, 6, 9, 12, 40]
            .iter()
            .map(|&seq| Record::Delivered { seq })
            .collect(),
        vec![
            Record::Delivered { seq: 4 },
            Record::Accepted(message(4, "again")),
            Record::Outcome {
                seq: 7,
                outcome: outcome(7, "o"),
            },
            Record::Delivered { seq: 7 },
            Record::Delivered { seq: 8 },
            Record::Outcome {
                seq: 8,
                outcome: outcome(8, "late"),
            },
            Record::Started {
                seq: 10,
                attempt: 2,
            },
            Record::Delivered { seq: 11 },
        ],
    ];
    {
        let mut store = SqliteStore::open(dir.path()).unwrap();
        for b in &batches {
            store.write(b).unwrap();
            for r in b {
                model.apply(r);
            }
        }
        let now = now_ms();
        let r = store.load(now).unwrap();
        let seqs: Vec<u64> = r.messages.iter().map(|m| m.message.seq).collect();
        assert_eq!(seqs, vec![4, 10]);
        assert_eq!(r.messages[0].message.fields.text, "again");
        assert_eq!(r.messages[1].starts, 2);
        assert_eq!(r, model.recovered(now));
    }
    let now = now_ms();
    let mut store = SqliteStore::open(dir.path()).unwrap();
    assert_eq!(store.load(now).unwrap(), model.recovered(now));
}

/// A row as every release so far has written it — `chat_type` by its name, the platform
/// in its own column, the checksum over the same fields (the `sum` here was computed apart,
/// by an FNV-1a of the fields as the 0.x stores wrote them) — loads as the message it was;
/// the store writes a message as that same row; a `chat_type` no release writes makes the
/// row unreadable (quarantined), not a guess.
#[test]
fn a_row_in_the_stored_format_of_earlier_releases_loads() {
    let dir = tempfile::tempdir().unwrap();
    let until = 4_102_444_800_000;
    let fields = MessageFields {
        chat_type: ChatType::Group,
        thread_id: Some("t1".into()),
        user_id: Some("@ann:hs".into()),
        user_name: Some("Ann".into()),
        meta: Some(r#"{"k":[1,2]}"#.into()),
        ..MessageFields::new("m-7", "!room:hs", "h\u{e9}llo \"x\"\n")
    };
    let m = StoredMessage::new(7, "matrix", fields, until);
    let old_row = (
        "matrix".to_string(),
        "m-7".to_string(),
        "group".to_string(),
        "!room:hs".to_string(),
        [
            Some("t1"),
            Some("@ann:hs"),
            Some("Ann"),
            Some(r#"{"k":[1,2]}"#),
        ]
        .map(|s| s.map(String::from)),
        (
            "h\u{e9}llo \"x\"\n".to_string(),
            until as i64,
            6_586_495_355_791_925_230_i64,
        ),
    );
    let path = dir.path().join("journal.sqlite3");
    {
        let mut store = SqliteStore::open(dir.path()).unwrap();
        store
            .write(&[
                Record::Accepted(m.clone()),
                Record::Accepted(message(8, "x")),
            ])
            .unwrap();
    }
    let row = |c: &rusqlite::Connection| {
        c.query_row(
            "SELECT platform, id, chat_type, chat_id, thread_id, user_id, user_name, meta, text,
             dedup_until, sum FROM messages WHERE seq = 7",
            [],
            |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                    r.get::<_, String>(3)?,
                    [r.get(4)?, r.get(5)?, r.get(6)?, r.get(7)?],
                    (r.get(8)?, r.get(9)?, r.get(10)?),
                ))
            },
        )
        .unwrap()
    };
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        assert_eq!(row(&c), old_row, "the stored format is unchanged");
    }
    let mut store = SqliteStore::open(dir.path()).unwrap();
    let r = store.load(now_ms()).unwrap();
    assert_eq!(r.messages[0].message, m);
    assert_eq!(store.quarantined(), 0);
    drop(store);
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute("UPDATE messages SET chat_type = 'room' WHERE seq = 7", [])
            .unwrap();
    }
    let mut store = SqliteStore::open(dir.path()).unwrap();
    let r = store.load(now_ms()).unwrap();
    let seqs: Vec<u64> = r.messages.iter().map(|m| m.message.seq).collect();
    assert_eq!(seqs, vec![8]);
    assert_eq!(store.quarantined(), 1);
}
