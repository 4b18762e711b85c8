//! The journal's store: a proptest against its model (random appends, starts, outcomes,
//! deliveries, refusals, and a crash after any batch), a torn or scribbled file, and the
//! journal thread under an injected write fault.

use std::sync::atomic::Ordering;
use std::time::Duration;

use proptest::prelude::*;
use turnstile::internal::journal::{
    FaultyStore, Journal, JournalConfig, MemStore, Model, Record, SqliteStore, Store,
    StoredMessage, StoredOutcome, now_ms,
};

fn message(seq: u64, text: &str) -> StoredMessage {
    StoredMessage {
        seq,
        platform: format!("p{}", seq % 3),
        id: format!("m-{seq}"),
        chat_type: "dm".into(),
        chat_id: format!("c{}", seq % 5),
        thread_id: seq.is_multiple_of(4).then(|| "t".to_string()),
        user_id: Some(format!("u{seq}")),
        user_name: seq.is_multiple_of(2).then(|| "Ann".to_string()),
        meta: seq.is_multiple_of(3).then(|| "{\"k\":1}".to_string()),
        text: text.into(),
        // In the future: the store's housekeeping expires ids by the wall clock.
        dedup_until_ms: now_ms() + 3_600_000 + seq,
    }
}

fn outcome(seq: u64, text: &str) -> StoredOutcome {
    if seq.is_multiple_of(2) {
        StoredOutcome {
            head: format!("{{\"op\":\"reply\",\"id\":\"m-{seq}\",\"text\":\"").into_bytes(),
            text: text.into(),
            tail: b"\"}\n".to_vec(),
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
    assert!(e.0.contains("locked"), "{e}");
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
            match SqliteStore::open(case.path()).and_then(|mut s| s.load(0)) {
                Err(e) => {
                    assert!(!e.0.is_empty());
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
