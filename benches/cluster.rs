//! The Redis store (`--cluster`) on this machine: the safe-ack path of one message — accept,
//! the owner's `started` and outcome (fenced), `delivered` — against a private redis-server
//! with `appendfsync always`, one call per round trip and pipelined in batches (the journal
//! thread's group commit), from 1 and from 3 clients at once (3 instances). One JSON line per
//! figure. `cargo bench --bench cluster [-- --messages N]`. Needs `redis-server` (Debian's).

#[path = "../tests/redis_support/mod.rs"]
mod redis_support;

use std::time::Instant;

use turnstile::internal::cluster::{ClusterConfig, Done, Lease, Op, RedisStore, partition_of};
use turnstile::internal::journal::now_ms;
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

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn main() {
    let Some(bin) = redis_support::require_redis() else {
        return;
    };
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
