//! Rebalancing without a stop (issue 22), with the real binary: instance A alone on a
//! private redis-server (tests/redis_support) under load — many sessions, bridges with
//! `acks`, an echo agent with a delay so that turns are running — and instance B joining
//! mid-load. A drains the partitions beyond its fair share (no new turn starts there, the
//! running ones end and their outcomes are written, then the lease goes) and B takes them.
//! Checked: both hold their fair share (the time is printed), every acked message has
//! exactly one outcome record (one outcome-stream entry), replies come in per-session order
//! on each bridge, no result is `interrupted by restart`, both instances serve at the end.
//! Then B leaves (SIGTERM) and A takes everything back, serving on.
//!
//! The server and the leases come from tests/redis_support; the bridge client is copied
//! from tests/cluster_serve.rs, trimmed to what this file uses. Waits on a condition in Redis
//! (who holds the leases) poll it with a deadline: a lease changes hands on Redis's clock,
//! not on an event this test can wait on.

mod common;
mod redis_support;

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{eventually, holds};
use crossbeam_channel::{Receiver, Sender};
use redis_support::{ClusterServe, Redis, WAIT, leases, require_redis, terminal};
use serde_json::{Value, json};

const PARTITIONS: u32 = 8;
const LEASE_MS: u64 = 1000;

type Server = ClusterServe;

impl ClusterServe {
    /// An instance whose log (INFO and up) goes to `log`.
    fn start(redis: &Redis, instance: &str, log: &Path) -> Server {
        let log = std::fs::File::create(log).expect("log file");
        ClusterServe::spawn(
            ClusterServe::command(redis, instance, PARTITIONS, LEASE_MS)
                .args(["--echo-delay-ms", "40"])
                .env("RUST_LOG", "info")
                .stderr(Stdio::from(log)),
        )
    }
}

/// A bridge connection (`acks`): its lines go to a channel from a thread of its own, each
/// terminal event confirmed; the write side stays here.
struct Bridge {
    writer: TcpStream,
}

impl Bridge {
    fn connect(addr: &str, via: &'static str, tx: Sender<Value>) -> Bridge {
        let stream = TcpStream::connect(addr).expect("connect");
        let mut writer = stream.try_clone().expect("clone");
        let hello = json!({"op": "hello", "platform": "tg", "acks": true});
        writer
            .write_all((hello.to_string() + "\n").as_bytes())
            .expect("hello");
        let mut confirm = stream.try_clone().expect("clone");
        std::thread::spawn(move || {
            let mut reader = BufReader::new(stream);
            loop {
                let mut line = String::new();
                match reader.read_line(&mut line) {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
                let mut v: Value = serde_json::from_str(&line).expect("json");
                if v["op"] == "typing" || v["op"] == "partial" {
                    continue;
                }
                v["via"] = via.into();
                if terminal(&v) {
                    let ids = json!({"op": "delivered", "ids": [v["id"].clone()]});
                    let _ = confirm.write_all((ids.to_string() + "\n").as_bytes());
                }
                if tx.send(v).is_err() {
                    return;
                }
            }
        });
        Bridge { writer }
    }

    fn message(&mut self, id: &str, chat: &str) {
        let v = json!({"op": "message", "id": id, "chat_id": chat, "text": id});
        self.writer
            .write_all((v.to_string() + "\n").as_bytes())
            .expect("write");
    }
}

/// The holder (instance name) of each partition's lease now.
fn holders(redis: &Redis) -> Vec<Option<String>> {
    leases(redis, PARTITIONS)
        .into_iter()
        .map(|token| token.and_then(|t| t.rsplit_once(':').map(|(i, _)| i.to_owned())))
        .collect()
}

/// Waits (bounded) until each named instance holds exactly its count; how long that took.
fn until_held(redis: &Redis, want: &[(&str, usize)]) -> Duration {
    let t0 = Instant::now();
    eventually(&format!("held {want:?}"), WAIT, || {
        holds(holders(redis), |h| {
            let held = |i: &str| h.iter().filter(|x| x.as_deref() == Some(i)).count();
            want.iter().all(|(i, n)| held(i) == *n)
        })
    });
    t0.elapsed()
}

/// What the bridges received.
#[derive(Default)]
struct Seen {
    acked: HashSet<String>,
    outcomes: HashMap<String, Vec<Value>>,
    /// Each session's terminal events per bridge, in arrival order (`"<session> on <via>"`).
    order: HashMap<String, Vec<String>>,
}

impl Seen {
    fn record(&mut self, v: Value) {
        let id = v["id"].as_str().unwrap_or_default().to_owned();
        if v["op"] == "ack" {
            self.acked.insert(id);
        } else if terminal(&v) {
            let session = id.split('-').next().unwrap_or_default();
            let key = format!("{session} on {}", v["via"].as_str().unwrap_or_default());
            self.order.entry(key).or_default().push(id.clone());
            self.outcomes.entry(id).or_default().push(v);
        }
    }

    /// Reads until every id of `sent` is acked and answered (bounded).
    fn until_answered(&mut self, rx: &Receiver<Value>, sent: &[String]) {
        let t0 = Instant::now();
        while !sent
            .iter()
            .all(|id| self.acked.contains(id) && self.outcomes.contains_key(id))
        {
            let left = WAIT.saturating_sub(t0.elapsed());
            match rx.recv_timeout(left) {
                Ok(v) => self.record(v),
                Err(_) => {
                    let missing: Vec<&String> = sent
                        .iter()
                        .filter(|id| !self.outcomes.contains_key(*id))
                        .collect();
                    panic!("not answered within {WAIT:?}: {missing:?}");
                }
            }
        }
    }

    /// Every copy of an outcome the same, a second copy on one bridge marked `redelivery`,
    /// replies in per-session order on each bridge, none `interrupted by restart`.
    fn check(&self) {
        for (id, vs) in &self.outcomes {
            assert!(
                vs.iter()
                    .all(|v| v["op"] == vs[0]["op"] && v["text"] == vs[0]["text"]),
                "{id}: two different outcomes: {vs:?}"
            );
            for via in ["a", "b"] {
                let here: Vec<&Value> = vs.iter().filter(|v| v["via"] == via).collect();
                assert!(
                    here.iter().skip(1).all(|v| v["redelivery"] == true),
                    "{id}: a second copy on {via}'s bridge not marked redelivery: {vs:?}"
                );
            }
            assert!(
                !vs.iter()
                    .any(|v| v.to_string().contains("interrupted by restart")),
                "{id}: a turn cut off by the rebalance: {vs:?}"
            );
            assert_eq!(vs[0]["op"], "reply", "{id}: {vs:?}");
        }
        for (session, ids) in &self.order {
            let n: Vec<usize> = ids
                .iter()
                .filter_map(|id| id.rsplit('-').next()?.parse().ok())
                .collect();
            let mut dedup = n.clone();
            dedup.dedup();
            let mut sorted = dedup.clone();
            sorted.sort_unstable();
            assert_eq!(dedup, sorted, "{session}: replies out of order: {ids:?}");
        }
    }
}

/// Every message's outcome records, by the outcome streams: no seq published twice in a
/// partition; the total.
fn outcome_records(redis: &Redis) -> usize {
    let mut c = redis.client();
    let mut published = 0;
    for p in 0..PARTITIONS {
        let entries: Vec<(String, Vec<String>)> = redis::cmd("XRANGE")
            .arg(format!("ts:{{p{p}}}:out"))
            .arg("-")
            .arg("+")
            .query(&mut c)
            .expect("XRANGE");
        let mut seqs: Vec<&String> = entries
            .iter()
            .filter_map(|(_, kv)| kv.chunks(2).find(|f| f[0] == "seq").map(|f| &f[1]))
            .collect();
        let n = seqs.len();
        seqs.sort_unstable();
        seqs.dedup();
        assert_eq!(seqs.len(), n, "partition {p}: an outcome written twice");
        published += n;
    }
    published
}

fn log_lines(path: &Path, needle: &str) -> Vec<String> {
    std::fs::read_to_string(path)
        .expect("log")
        .lines()
        .filter(|l| l.contains(needle))
        .map(str::to_owned)
        .collect()
}

#[test]
fn an_instance_joining_mid_load_takes_its_fair_share_without_cutting_off_a_turn_and_leaving_gives_it_back()
 {
    let Some(bin) = require_redis() else { return };
    let redis = Redis::start(&bin);
    let dir = tempfile::tempdir().expect("tempdir");
    let (log_a, log_b) = (dir.path().join("a.log"), dir.path().join("b.log"));
    let a = Server::start(&redis, "a", &log_a);
    until_held(&redis, &[("a", PARTITIONS as usize)]);
    let (tx, rx) = crossbeam_channel::unbounded();
    let mut on_a = Bridge::connect(&a.addr, "a", tx.clone());
    let (sessions, per_session) = (24, 12);
    let mut seen = Seen::default();
    let mut sent: Vec<String> = Vec::new();
    // A alone under load: the first half of every session's messages.
    for i in 0..per_session / 2 {
        for s in 0..sessions {
            let id = format!("s{s}-{i}");
            on_a.message(&id, &s.to_string());
            sent.push(id);
        }
    }
    while seen.outcomes.len() < 20 {
        seen.record(rx.recv_timeout(WAIT).expect("a line before the join"));
    }
    // B joins mid-load, and half the sessions go on through its bridge.
    let joined = Instant::now();
    let b = Server::start(&redis, "b", &log_b);
    let mut on_b = Bridge::connect(&b.addr, "b", tx.clone());
    for i in per_session / 2..per_session {
        for s in 0..sessions {
            let id = format!("s{s}-{i}");
            let bridge = if s % 2 == 0 { &mut on_a } else { &mut on_b };
            bridge.message(&id, &s.to_string());
            sent.push(id);
        }
    }
    let half = PARTITIONS as usize / 2;
    until_held(&redis, &[("a", half), ("b", half)]);
    let took = joined.elapsed();
    eprintln!(
        "join: both instances hold their fair share ({half} of {PARTITIONS}) {took:?} after b started (lease {LEASE_MS} ms, a pass every {} ms)",
        LEASE_MS / 3
    );
    seen.until_answered(&rx, &sent);
    // Both serve: a message per session through each bridge, answered.
    let mut last: Vec<String> = Vec::new();
    for s in 0..sessions {
        let id = format!("s{s}-{per_session}");
        let bridge = if s % 2 == 0 { &mut on_b } else { &mut on_a };
        bridge.message(&id, &s.to_string());
        last.push(id);
    }
    sent.extend(last.iter().cloned());
    seen.until_answered(&rx, &sent);
    assert_eq!(
        holders(&redis)
            .iter()
            .filter(|h| h.as_deref() == Some("b"))
            .count(),
        half,
        "b still holds its share"
    );
    let twice = seen.outcomes.values().filter(|v| v.len() > 1).count();
    let records = outcome_records(&redis);
    eprintln!(
        "join: sent {}, acked {}, answered {}, answered more than once {twice}, outcome records {records}",
        sent.len(),
        seen.acked.len(),
        seen.outcomes.len()
    );
    seen.check();
    assert_eq!(records, sent.len(), "one outcome record per message");
    let drained = log_lines(&log_a, "drained: no turn left running");
    let began = log_lines(&log_a, "draining (more than");
    let gained = log_lines(&log_b, "gained (lease");
    eprintln!(
        "a's drains:\n{}\n{}\nb's gains:\n{}",
        began.join("\n"),
        drained.join("\n"),
        gained.join("\n")
    );
    assert_eq!(drained.len(), half, "a drained its surplus, each once");
    assert!(
        log_lines(&log_a, "handed over to its next owner").len() == half
            && log_lines(&log_a, "lost or fenced").is_empty()
            && log_lines(&log_a, "its drain took longer").is_empty(),
        "a partition was cut off instead of drained: {}",
        std::fs::read_to_string(&log_a).unwrap_or_default()
    );

    // B leaves mid-load (SIGTERM): A takes everything back and answers the rest.
    let mut more: Vec<String> = Vec::new();
    for s in 0..sessions {
        let id = format!("s{s}-{}", per_session + 1);
        on_a.message(&id, &s.to_string());
        more.push(id);
    }
    b.signal(libc::SIGTERM);
    let left = Instant::now();
    let mut b = b;
    let status = b.child.wait().expect("wait for b");
    assert!(status.success(), "b's exit: {status:?}");
    let back = until_held(&redis, &[("a", PARTITIONS as usize)]);
    eprintln!(
        "leave: every partition held by a {:?} after b's SIGTERM ({:?} after b exited)",
        left.elapsed(),
        back
    );
    sent.extend(more.iter().cloned());
    seen.until_answered(&rx, &sent);
    seen.check();
    assert_eq!(
        outcome_records(&redis),
        sent.len(),
        "one outcome record per message"
    );
    drop(on_b);
    drop(a);
}
