//! Issue 31 rows 2 and 10 with the real binary and a real `redis-server`: an owner
//! SIGSTOPped past its lease cannot fence itself (no thread of it runs), but its agent
//! processes must not run on while the next owner runs the same sessions. Its leash (the
//! gateway's binary re-executed, holding the agents' lifeline, `cluster/leash.rs`) ends them
//! at the fence deadline. Exec agents append `start`/`tick`/`end` lines, each naming its
//! instance, session and message, to one side-effect log (appends are ordered): no session
//! may show a turn starting while another turn of it still writes, and every message is
//! answered exactly once.
//!
//! Waits are on events: lines in the log, leases in Redis (polled with a deadline: a lease
//! changes hands on Redis's clock), lines from the gateway.

mod common;
mod redis_support;

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Stdio;
use std::time::Instant;

use common::{eventually, holds};
use redis_support::{ClusterServe, Redis, WAIT, require_redis, until_all_held_by};
use serde_json::{Value, json};

const PARTITIONS: u32 = 4;
const LEASE_MS: u64 = 2000;

type Server = ClusterServe;

impl ClusterServe {
    /// `serve --cluster` as `instance`, its exec agent logging to `log`.
    fn start(redis: &Redis, instance: &str, log: &Path) -> Server {
        // Reads its input, then writes for about 3 s (longer than the lease): a turn the
        // pause interrupts mid-way.
        let script = format!(
            "cat >/dev/null; l='{log}'; w=\"{instance} $TURNSTILE_SESSION $TURNSTILE_MESSAGE_ID\"; \
             echo \"start $w\" >> \"$l\"; i=0; while [ $i -lt 30 ]; do sleep 0.1; \
             echo \"tick $w\" >> \"$l\"; i=$((i+1)); done; echo \"end $w\" >> \"$l\"; echo done",
            log = log.display()
        );
        ClusterServe::spawn(
            ClusterServe::command(redis, instance, PARTITIONS, LEASE_MS)
                .args(["--cluster-rebalance", "false"])
                .args(["--agent", "exec", "--agent-cmd", &script])
                .env("RUST_LOG", "warn")
                .stderr(Stdio::inherit()),
        )
    }
}

/// The side-effect log's lines, split in words: `[what, instance, session, message]`.
fn log_lines(log: &Path) -> Vec<Vec<String>> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(|l| l.split(' ').map(str::to_owned).collect())
        .filter(|w: &Vec<String>| w.len() == 4)
        .collect()
}

/// Waits (bounded, polling the file) until `done` holds for the log.
fn until_log(log: &Path, what: &str, done: impl Fn(&[Vec<String>]) -> bool) {
    eventually(what, WAIT, || holds(log_lines(log), |l| done(l)));
}

/// Turns of one session that overlap: a `start` while another turn of the session has
/// written a line and will write another.
fn overlaps(lines: &[Vec<String>]) -> Vec<String> {
    // Each turn's first and last line, by (instance, session, message).
    let mut span: HashMap<(&str, &str, &str), (usize, usize)> = HashMap::new();
    for (i, w) in lines.iter().enumerate() {
        let key = (w[1].as_str(), w[2].as_str(), w[3].as_str());
        span.entry(key).or_insert((i, i)).1 = i;
    }
    let mut found = Vec::new();
    for (k1, (s1, e1)) in &span {
        for (k2, (s2, _)) in &span {
            if k1 != k2 && k1.1 == k2.1 && s1 < s2 && s2 < e1 {
                found.push(format!("session {}: {k2:?} started while {k1:?} ran", k1.1));
            }
        }
    }
    found
}

#[test]
fn an_owner_stopped_past_its_lease_has_its_agents_stopped_no_turns_of_a_session_overlap() {
    let Some(bin) = require_redis() else { return };
    let redis = Redis::start(&bin);
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("side-effects.log");
    // B owns every partition; A is there to take them over. The bridge talks to A only.
    let b = Server::start(&redis, "b", &log);
    until_all_held_by(&redis, PARTITIONS, &["b"]);
    let a = Server::start(&redis, "a", &log);
    let stream = TcpStream::connect(&a.addr).expect("connect");
    stream.set_read_timeout(Some(WAIT)).expect("timeout");
    let mut w = stream.try_clone().expect("clone");
    let mut send = |v: Value| {
        w.write_all((v.to_string() + "\n").as_bytes())
            .expect("write")
    };
    send(json!({"op": "hello", "platform": "tg", "acks": true}));
    let (sessions, per_session) = (4, 3);
    let mut sent = Vec::new();
    for i in 0..per_session {
        for s in 0..sessions {
            let id = format!("s{s}-{i}");
            send(json!({"op": "message", "id": id, "chat_id": format!("c{s}"), "text": id}));
            sent.push(id);
        }
    }
    // Every session's first turn is running on B: B stops, past its lease.
    until_log(&log, "every session's first turn started on b", |l| {
        l.iter().filter(|w| w[0] == "start" && w[1] == "b").count() >= sessions
    });
    b.signal(libc::SIGSTOP);
    until_all_held_by(&redis, PARTITIONS, &["a"]);
    // A runs a session's next turn to its end: long enough for a turn B started before its
    // pause, were its agent still running, to write on (each runs about 3 s).
    until_log(&log, "a turn run to its end on a", |l| {
        l.iter().any(|w| w[0] == "end" && w[1] == "a")
    });
    b.signal(libc::SIGCONT);
    // Every message answered once, on A's connection (confirmed as it comes).
    let mut reader = BufReader::new(stream);
    let mut answers: HashMap<String, Vec<Value>> = HashMap::new();
    let mut acked = HashSet::new();
    let t0 = Instant::now();
    while answers.len() < sent.len() {
        assert!(t0.elapsed() < WAIT, "answered {answers:?} of {sent:?}");
        let mut line = String::new();
        if reader.read_line(&mut line).expect("read") == 0 {
            panic!("a closed the connection");
        }
        let v: Value = serde_json::from_str(&line).expect("json");
        let id = v["id"].as_str().unwrap_or_default().to_owned();
        match v["op"].as_str() {
            Some("ack") => {
                acked.insert(id);
            }
            Some("reply" | "failed" | "cancelled" | "merged") => {
                send(json!({"op": "delivered", "ids": [id]}));
                answers.entry(id).or_default().push(v);
            }
            _ => {}
        }
    }
    assert_eq!(acked.len(), sent.len(), "every message acked");
    let lines = log_lines(&log);
    let found = overlaps(&lines);
    let stopped = lines
        .iter()
        .filter(|w| w[0] == "start" && w[1] == "b")
        .filter(|s| !lines.iter().any(|e| e[0] == "end" && e[1..] == s[1..]))
        .count();
    eprintln!(
        "{} turns started, {stopped} of b's stopped by its leash, overlapping: {}",
        lines.iter().filter(|w| w[0] == "start").count(),
        found.len()
    );
    assert!(
        found.is_empty(),
        "turns of one session overlapped: {found:#?}"
    );
    assert!(
        stopped > 0,
        "b's interrupted turns ran to their end: {lines:?}"
    );
    for id in &sent {
        let n = answers.get(id).map_or(0, Vec::len);
        assert_eq!(n, 1, "{id}: answered {n} times: {:?}", answers.get(id));
    }
    drop(a);
}
