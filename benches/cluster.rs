//! The Redis store (`--cluster`) on this machine: the safe-ack path of one message — accept,
//! the owner's `started` and outcome (fenced), `delivered` — against a private redis-server
//! with `appendfsync always`, one call per round trip and pipelined in batches (the journal
//! thread's group commit), from 1 and from 3 clients at once (3 instances). One JSON line per
//! figure. `cargo bench --bench cluster [-- --messages N]`. Needs `redis-server` (Debian's).
//! `-- --only turn-commit`: the outcome's commit with and without the openai agent's
//! conversation (issue 35), and the bytes a conversation takes in Redis.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/redis_support/mod.rs"]
mod redis_support;

use std::time::Instant;

use turnstile::internal::cluster::{ClusterConfig, Done, Lease, Op, RedisStore, partition_of};
use turnstile::internal::journal::{kept_conversation, now_ms};
use turnstile::{MessageFields, StoredMessage, StoredOutcome};

const PARTITIONS: u32 = 64;
const SESSIONS: u64 = 2000;

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn message(client: usize, i: u64) -> (String, StoredMessage) {
    let chat = format!("s{}", i % SESSIONS);
    (
        format!("bench:dm:{chat}"),
        StoredMessage::new(
            0,
            "bench",
            MessageFields {
                user_id: Some("u1".into()),
                ..MessageFields::new(
                    &format!("c{client}-m{i}"),
                    &chat,
                    "a message of about forty bytes of text..",
                )
            },
            now_ms() + 600_000,
        ),
    )
}

fn outcome() -> StoredOutcome {
    StoredOutcome {
        head: br#"{"type":"done","id":"m","text":""#.to_vec(),
        text: "an answer of about forty bytes of text..".into(),
        tail: b"\"}\n".to_vec(),
        memory: None,
    }
}

/// Every partition's lease, held by one "owner" store for the whole run.
fn leases(url: &str) -> Vec<Lease> {
    let mut cfg = ClusterConfig::new(url, "owner");
    (cfg.partitions, cfg.lease) = (PARTITIONS, std::time::Duration::from_secs(600));
    let mut owner = RedisStore::connect(cfg).expect("owner");
    (0..PARTITIONS)
        .map(|p| match owner.acquire(p).expect("acquire") {
            turnstile::internal::cluster::Acquire::Acquired(l) => l,
            other => panic!("{other:?}"),
        })
        .collect()
}

/// `messages` through the four writes, `batch` of them per round trip; the client's
/// messages are its own (ids `c<client>-…`).
fn run(url: &str, leases: &[Lease], client: usize, messages: u64, batch: usize) -> u64 {
    let mut cfg = ClusterConfig::new(url, format!("client{client}"));
    cfg.partitions = PARTITIONS;
    let mut s = RedisStore::connect(cfg).expect("connect");
    let o = outcome();
    let mut done = 0;
    let all: Vec<(String, StoredMessage)> = (0..messages).map(|i| message(client, i)).collect();
    for chunk in all.chunks(batch) {
        let now = now_ms();
        let parts: Vec<u32> = chunk
            .iter()
            .map(|(k, _)| partition_of(k, PARTITIONS))
            .collect();
        let accepts: Vec<Op<'_>> = chunk
            .iter()
            .zip(&parts)
            .map(|((session, m), p)| Op::Accept {
                partition: *p,
                session,
                message: m,
                session_cap: 1_000_000,
            })
            .collect();
        let seqs: Vec<(u32, u64)> = s
            .write(&accepts, now)
            .expect("accept")
            .into_iter()
            .zip(&parts)
            .map(|(d, p)| match d {
                Ok(Done::Accepted(turnstile::internal::cluster::Accept::New { seq, .. })) => {
                    (*p, seq)
                }
                other => panic!("{other:?}"),
            })
            .collect();
        let started: Vec<Op<'_>> = seqs
            .iter()
            .map(|(p, seq)| Op::Started {
                lease: &leases[*p as usize],
                seq: *seq,
                attempt: 1,
            })
            .collect();
        let outcomes: Vec<Op<'_>> = seqs
            .iter()
            .map(|(p, seq)| Op::Outcome {
                lease: &leases[*p as usize],
                seq: *seq,
                outcome: &o,
            })
            .collect();
        let delivered: Vec<Op<'_>> = seqs
            .iter()
            .map(|(p, seq)| Op::Delivered {
                partition: *p,
                seq: *seq,
            })
            .collect();
        for ops in [started, outcomes, delivered] {
            for d in s.write(&ops, now).expect("write") {
                assert_eq!(d, Ok(Done::Written(true)));
            }
        }
        done += chunk.len() as u64;
    }
    done
}

/// A conversation of `n` typical exchanges: a 100-character question, a 500-character answer
/// (as `benches/journal.rs` stores it).
fn conversation(n: usize) -> Vec<(String, String)> {
    let cut = |s: String, n: usize| s.chars().cycle().take(n).collect::<String>();
    (0..n)
        .map(|i| {
            let user = cut(format!("question {i} about the product? "), 100);
            let answer = cut(format!("answer {i}, in several sentences. "), 500);
            (user, answer)
        })
        .collect()
}

/// One turn at a time in 50 sessions, as the owner's journal thread writes them: accept,
/// started, then the outcome (timed), then delivered; with `memory`, the outcome carries the
/// session's conversation of 20 typical exchanges. Prints the outcome's commit latencies,
/// the bytes stored per session as the store counts them and Redis's `MEMORY USAGE` of one.
fn turn_commit(bin: &std::path::Path, memory: bool) {
    let redis = redis_support::Redis::start(bin);
    let url = redis.url();
    let leases = leases(&url);
    let mut store = RedisStore::connect(ClusterConfig {
        partitions: PARTITIONS,
        ..ClusterConfig::new(url.as_str(), "bench")
    })
    .expect("connect");
    let exchanges = conversation(20);
    let mut outcomes = Vec::new();
    for i in 0..1000u64 {
        let chat = format!("s{}", i % 50);
        let session = format!("bench:dm:{chat}");
        let text = "a message of about forty bytes of text..";
        let m = StoredMessage::new(
            0,
            "bench",
            MessageFields::new(&format!("t{i}"), &chat, text),
            now_ms() + 600_000,
        );
        let p = partition_of(&session, PARTITIONS);
        let seq = match store.accept(p, &session, &m, 100, now_ms()) {
            Ok(turnstile::internal::cluster::Accept::New { seq, .. }) => seq,
            other => panic!("accept: {other:?}"),
        };
        let lease = &leases[p as usize];
        store.started(lease, seq, 1).expect("started");
        let mut o = outcome();
        if memory {
            o.memory = Some(kept_conversation(&session, exchanges.clone()));
        }
        let t = Instant::now();
        store.outcome(lease, seq, &o).expect("outcome");
        outcomes.push(t.elapsed().as_secs_f64() * 1000.0);
        store.delivered(p, seq, now_ms()).expect("delivered");
    }
    outcomes.sort_by(f64::total_cmp);
    let pct = |p: f64| outcomes[((outcomes.len() - 1) as f64 * p).round() as usize];
    let h = store.history_status(0..PARTITIONS);
    let session = "bench:dm:s0";
    let key = format!("ts:{{p{}}}:h:{session}", partition_of(session, PARTITIONS));
    let usage: Option<u64> = redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(key)
        .query(&mut redis.client())
        .expect("MEMORY USAGE");
    println!(
        "{{\"figure\":\"cluster_turn_commit\",\"durable_history\":{memory},\"turns\":1000,\"outcome_p50_ms\":{:.3},\"outcome_p99_ms\":{:.3},\"sessions_stored\":{},\"bytes_per_session\":{},\"redis_memory_usage_per_key\":{},\"load\":\"{}\"}}",
        pct(0.5),
        pct(0.99),
        h.sessions,
        h.bytes.checked_div(h.sessions).unwrap_or(0),
        usage.unwrap_or(0),
        load()
    );
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn main() {
    let Some(bin) = redis_support::require_redis() else {
        return;
    };
    if arg("--only").as_deref() == Some("turn-commit") {
        turn_commit(&bin, false);
        turn_commit(&bin, true);
        return;
    }
    let messages: u64 = arg("--messages")
        .and_then(|n| n.parse().ok())
        .unwrap_or(20_000);
    for (clients, batch, n) in [
        (1, 1, (messages / 20).max(1)),
        (1, 256, messages),
        (3, 1, (messages / 20).max(1)),
        (3, 256, messages),
    ] {
        // A fresh Redis each run: the append-only file starts empty.
        let redis = redis_support::Redis::start(&bin);
        let url = redis.url();
        let leases = leases(&url);
        let t0 = Instant::now();
        let total: u64 = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..clients)
                .map(|c| {
                    let (url, leases) = (&url, &leases);
                    sc.spawn(move || run(url, leases, c, n, batch))
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("client")).sum()
        });
        let secs = t0.elapsed().as_secs_f64();
        println!(
            "{{\"bench\":\"cluster_safe_ack\",\"clients\":{clients},\"batch\":{batch},\"messages\":{total},\"seconds\":{secs:.3},\"msgs_per_s\":{:.0},\"appendfsync\":\"always\",\"load\":\"{}\"}}",
            total as f64 / secs,
            load()
        );
    }
}
