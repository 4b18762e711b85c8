//! The journal on this machine's disk: group-commit throughput of the journal thread, a
//! message's whole life in the store (accepted, started, outcome, delivered: records, bytes
//! written and transactions per message), and recovery time (SQLite load + the bridge's
//! rebuild) for 100,000 journaled messages. One JSON line per figure.
//! `cargo bench --bench journal [-- --messages N] [-- --dir DIR] [-- --only lifecycle]`.

use std::time::{Duration, Instant};

use turnstile::BridgeConfig;
use turnstile::internal::journal::{Journal, JournalConfig, kept_conversation, now_ms};
use turnstile::internal::server::Bridge;
use turnstile::{MessageFields, Record, SqliteStore, Store, StoredMessage, StoredOutcome};

fn message(seq: u64, sessions: u64) -> StoredMessage {
    StoredMessage::new(
        seq,
        "bench",
        MessageFields {
            user_id: Some("u1".into()),
            ..MessageFields::new(
                &format!("m-{seq}"),
                &format!("s{}", seq % sessions),
                "a message of about forty bytes of text..",
            )
        },
        now_ms() + 600_000,
    )
}

/// The echo reply of `seq`, as the bridge journals it (a short line: all `head`).
fn reply(seq: u64, sessions: u64) -> StoredOutcome {
    StoredOutcome {
        head: format!(
            "{{\"op\":\"reply\",\"id\":\"m-{seq}\",\"session\":\"bench:dm:s{}\",\"text\":\"a message of about forty bytes of text..\"}}\n",
            seq % sessions
        )
        .into_bytes(),
        ..StoredOutcome::default()
    }
}

/// Bytes this process has passed to `write(2)` and friends so far (`wchar` of /proc/self/io).
fn written_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/io")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("wchar: ")
                    .and_then(|v| v.trim().parse().ok())
            })
        })
        .unwrap_or(0)
}

/// A message's whole life through the journal thread, as the bridge writes it under a flood:
/// `accepted`, then (once thousands of later messages were accepted, so in other
/// transactions) `started`, its outcome and its delivery, with about `in_flight` messages in
/// the store at any time. Prints messages/s, records/s, and per message: records, bytes
/// written (database, write-ahead log and mark) and transactions.
fn lifecycle(dir: &std::path::Path, n: u64, in_flight: u64) {
    let store = SqliteStore::open(dir).expect("open");
    let (tx, rx) = crossbeam_channel::unbounded();
    let mut journal = Journal::start(store, JournalConfig::default(), move || {
        let _ = tx.send(());
    })
    .expect("journal");
    let (start_lag, outcome_lag, deliver_lag) = (in_flight / 4, in_flight / 2, in_flight);
    let bytes_before = written_bytes();
    let start = Instant::now();
    let mut records = 0u64;
    let mut send = |r: Record| {
        records += 1;
        journal.send(r);
    };
    for i in 1..=n + deliver_lag {
        if i <= n {
            send(Record::Accepted(message(i, 1000)));
        }
        if let Some(seq) = i.checked_sub(start_lag).filter(|s| (1..=n).contains(s)) {
            send(Record::Started { seq, attempt: 1 });
        }
        if let Some(seq) = i.checked_sub(outcome_lag).filter(|s| (1..=n).contains(s)) {
            send(Record::Outcome {
                seq,
                outcome: reply(seq, 1000),
            });
        }
        if let Some(seq) = i.checked_sub(deliver_lag).filter(|s| (1..=n).contains(s)) {
            send(Record::Delivered { seq });
        }
    }
    let (mut taken, mut batches) = (0u64, 0u64);
    while taken < records {
        rx.recv_timeout(Duration::from_secs(120)).expect("progress");
        for c in journal.completions() {
            assert!(c.error.is_none(), "{:?}", c.error);
            taken += c.taken as u64;
            batches += 1;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let bytes = written_bytes() - bytes_before;
    let (_, finished) = journal.finish(Duration::from_secs(60));
    assert!(finished);
    println!(
        "{{\"figure\":\"lifecycle\",\"messages\":{n},\"in_flight\":{in_flight},\"records\":{records},\"transactions\":{batches},\"seconds\":{secs:.3},\"messages_per_s\":{:.0},\"records_per_s\":{:.0},\"records_per_message\":{:.2},\"bytes_written_per_message\":{:.0},\"transactions_per_1000_messages\":{:.2}}}",
        n as f64 / secs,
        records as f64 / secs,
        records as f64 / n as f64,
        bytes as f64 / n as f64,
        batches as f64 * 1000.0 / n as f64,
    );
}

/// A conversation of `n` typical exchanges: a 100-character question, a 500-character answer.
fn conversation(n: usize) -> Vec<(String, String)> {
    (0..n)
        .map(|i| {
            let user = format!("question {i}: ")
                .chars()
                .cycle()
                .take(100)
                .collect();
            let answer = format!("answer {i}, in several sentences. ")
                .chars()
                .cycle()
                .take(500)
                .collect();
            (user, answer)
        })
        .collect()
}

/// One turn at a time in 50 sessions, as the bridge journals it: the ack's commit
/// (`accepted`), the start gate's, then the outcome's, each timed; with `memory`, the
/// outcome carries the session's conversation of 20 typical exchanges (the openai agent's
/// durable history). Prints the ack and outcome commit latencies and the bytes stored per
/// session. Run: `cargo bench --bench journal -- --only turn-commit`.
fn turn_commit(dir: &std::path::Path, memory: bool) {
    let mut store = SqliteStore::open(dir).expect("open");
    let exchanges = conversation(20);
    let (mut acks, mut outcomes) = (Vec::new(), Vec::new());
    for seq in 1..=1000u64 {
        let t = Instant::now();
        store
            .write(&[Record::Accepted(message(seq, 50))])
            .expect("accepted");
        acks.push(t.elapsed().as_secs_f64() * 1000.0);
        store
            .write(&[Record::Started { seq, attempt: 1 }])
            .expect("started");
        let mut outcome = reply(seq, 50);
        if memory {
            let session = format!("bench:dm:s{}", seq % 50);
            outcome.memory = Some(kept_conversation(&session, exchanges.clone()));
        }
        let t = Instant::now();
        store
            .write(&[Record::Outcome { seq, outcome }])
            .expect("outcome");
        outcomes.push(t.elapsed().as_secs_f64() * 1000.0);
        store
            .write(&[Record::Delivered { seq }])
            .expect("delivered");
    }
    let pct = |v: &mut Vec<f64>, p: f64| {
        v.sort_by(f64::total_cmp);
        v[((v.len() - 1) as f64 * p).round() as usize]
    };
    let h = store.history().unwrap_or_default();
    println!(
        "{{\"figure\":\"turn_commit\",\"durable_history\":{memory},\"turns\":1000,\"ack_p50_ms\":{:.3},\"ack_p99_ms\":{:.3},\"outcome_p50_ms\":{:.3},\"outcome_p99_ms\":{:.3},\"sessions_stored\":{},\"bytes_per_session\":{}}}",
        pct(&mut acks, 0.5),
        pct(&mut acks, 0.99),
        pct(&mut outcomes, 0.5),
        pct(&mut outcomes, 0.99),
        h.sessions,
        h.bytes.checked_div(h.sessions).unwrap_or(0),
    );
}

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn main() {
    let n: u64 = arg("--messages")
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000);
    let base = arg("--dir").map(std::path::PathBuf::from);
    let dir = match &base {
        Some(b) => tempfile::tempdir_in(b),
        None => tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")),
    }
    .expect("temp dir");
    let only = arg("--only");
    if only.as_deref() == Some("turn-commit") {
        let plain = tempfile::tempdir_in(dir.path()).expect("temp dir");
        turn_commit(plain.path(), false);
        let durable = tempfile::tempdir_in(dir.path()).expect("temp dir");
        turn_commit(durable.path(), true);
        return;
    }

    // 0. A message's whole life in the store, 20,000 in flight (the flood's 20 x 1,000).
    {
        let life = tempfile::tempdir_in(dir.path()).expect("temp dir");
        lifecycle(life.path(), n, 20_000);
    }
    if only.as_deref() == Some("lifecycle") {
        return;
    }

    // 1. Group commit: n accepted records through the journal thread, as fast as it takes them.
    let store = SqliteStore::open(dir.path()).expect("open");
    let (tx, rx) = crossbeam_channel::unbounded();
    let mut journal = Journal::start(store, JournalConfig::default(), move || {
        let _ = tx.send(());
    })
    .expect("journal");
    let start = Instant::now();
    for seq in 1..=n {
        journal.send(Record::Accepted(message(seq, 1000)));
    }
    let (mut durable, mut batches) = (0u64, 0u64);
    while durable < n {
        rx.recv_timeout(Duration::from_secs(60)).expect("progress");
        for c in journal.completions() {
            durable += c.durable.len() as u64;
            batches += 1;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{{\"figure\":\"group_commit\",\"records\":{n},\"transactions\":{batches},\"seconds\":{secs:.3},\"durable_records_per_s\":{:.0}}}",
        n as f64 / secs
    );
    let (_, finished) = journal.finish(Duration::from_secs(60));
    assert!(finished);

    // 1b. Commit latency of small transactions (what an ack waits for under light load):
    // 64 records per transaction, one transaction at a time, 500 times.
    let mut latencies = Vec::new();
    {
        let small = tempfile::tempdir_in(dir.path()).expect("temp dir");
        let mut store = SqliteStore::open(small.path()).expect("open");
        let mut seq = 0;
        for _ in 0..500 {
            let batch: Vec<Record> = (0..64)
                .map(|_| {
                    seq += 1;
                    Record::Accepted(message(seq, 1000))
                })
                .collect();
            let t = Instant::now();
            store.write(&batch).expect("write");
            latencies.push(t.elapsed().as_secs_f64() * 1000.0);
        }
    }
    latencies.sort_by(f64::total_cmp);
    let pct = |p: f64| latencies[((latencies.len() - 1) as f64 * p).round() as usize];
    println!(
        "{{\"figure\":\"commit_latency_64\",\"transactions\":500,\"p50_ms\":{:.3},\"p99_ms\":{:.3},\"max_ms\":{:.3}}}",
        pct(0.5),
        pct(0.99),
        pct(1.0)
    );

    // 1c. What the high-water mark adds to each commit: a 40-byte write in place and an
    // fdatasync on a file of its own (what `journal.mark` does after every commit), 500
    // times, measured in the same minutes as the commits above.
    let mut marks = Vec::new();
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::create(dir.path().join("mark-probe")).expect("probe");
        f.write_all_at(&[0u8; 1024], 0).expect("write");
        f.sync_all().expect("sync");
        for i in 0..500u64 {
            let t = Instant::now();
            f.write_all_at(&i.to_le_bytes().repeat(5), (i % 2) * 512)
                .expect("write");
            f.sync_data().expect("sync");
            marks.push(t.elapsed().as_secs_f64() * 1000.0);
        }
    }
    marks.sort_by(f64::total_cmp);
    let mpct = |p: f64| marks[((marks.len() - 1) as f64 * p).round() as usize];
    println!(
        "{{\"figure\":\"mark_write\",\"writes\":500,\"p50_ms\":{:.3},\"p99_ms\":{:.3},\"max_ms\":{:.3}}}",
        mpct(0.5),
        mpct(0.99),
        mpct(1.0)
    );

    // 2. Recovery: open and load what is journaled, then rebuild the bridge from it.
    let start = Instant::now();
    let mut store = SqliteStore::open(dir.path()).expect("reopen");
    let recovered = store.load(now_ms()).expect("load");
    let loaded = start.elapsed().as_secs_f64();
    assert_eq!(recovered.messages.len() as u64, n);
    let mut bridge = Bridge::new(BridgeConfig {
        journal: true,
        outbox_cap: n as usize + 1,
        outbox_bytes: usize::MAX / 2,
        ..BridgeConfig::default()
    });
    let t = Instant::now();
    let counts = bridge.recover(recovered, now_ms(), Duration::ZERO);
    let rebuilt = t.elapsed().as_secs_f64();
    let mut submitted = 0;
    while let Some(a) = bridge.poll_action() {
        submitted += usize::from(matches!(
            a,
            turnstile::internal::server::Action::Submit { .. }
        ));
    }
    assert_eq!(submitted as u64, n);
    println!(
        "{{\"figure\":\"recovery\",\"messages\":{},\"load_s\":{loaded:.3},\"rebuild_s\":{rebuilt:.3},\"total_s\":{:.3},\"file_mib\":{:.1}}}",
        counts.messages,
        loaded + rebuilt,
        std::fs::metadata(dir.path().join("journal.sqlite3"))
            .map_or(0.0, |m| m.len() as f64 / 1048576.0)
    );
}
