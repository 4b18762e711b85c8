//! `turnstile serve --cluster` with the real binary: instances on one private redis-server
//! (tests/redis_support), bridges with `acks` on each. A message accepted on A whose
//! partition B owns is run on B and answered on A; kill -9 of the owner mid-load with its
//! bridge reconnecting to the survivor: every acked message gets its outcome, the same one
//! wherever it arrives, in per-session order; the takeover time is printed.
//!
//! Waits on a condition in Redis (which instance holds the leases) poll it with a deadline:
//! a lease changes hands on Redis's clock, not on an event this test can wait on.

mod redis_support;

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use redis_support::{Redis, WAIT, require_redis};
use serde_json::{Value, json};

const PARTITIONS: u32 = 4;

struct Server {
    child: Child,
    addr: String,
}

impl Server {
    fn start(redis: &Redis, instance: &str, lease_ms: u64) -> Server {
        let mut command = Command::new(env!("CARGO_BIN_EXE_turnstile"));
        command
            .arg("serve")
            .args(["--listen", "127.0.0.1:0", "--http-listen", "off"])
            .args(["--cluster", &redis.url(), "--instance-id", instance])
            .args(["--partitions", &PARTITIONS.to_string()])
            .args(["--lease-ms", &lease_ms.to_string()])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        // SAFETY: prctl(2) only, which is async-signal-safe, between fork and exec.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = command.spawn().expect("start turnstile serve");
        let stdout = child.stdout.take().expect("stdout");
        let mut first = String::new();
        BufReader::new(stdout)
            .read_line(&mut first)
            .expect("first line");
        let addr = first
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("listening line, got {first:?}"))
            .to_owned();
        Server { child, addr }
    }

    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill9();
    }
}

struct Client {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Client {
    fn connect(addr: &str) -> Client {
        let stream = TcpStream::connect(addr).expect("connect");
        stream.set_read_timeout(Some(WAIT)).expect("timeout");
        let mut c = Client {
            reader: BufReader::new(stream.try_clone().expect("clone")),
            writer: stream,
        };
        c.send(&json!({"op": "hello", "platform": "tg", "acks": true}));
        c
    }

    fn send(&mut self, v: &Value) {
        self.writer
            .write_all((v.to_string() + "\n").as_bytes())
            .expect("write");
    }

    fn message(&mut self, id: &str, chat: &str) {
        self.send(&json!({"op": "message", "id": id, "chat_id": chat, "text": id}));
    }

    /// The next line that is not a typing indicator or a partial; `None` at the end.
    fn next_line(&mut self) -> Option<Value> {
        loop {
            let mut line = String::new();
            match self.reader.read_line(&mut line) {
                Ok(0) | Err(_) => return None,
                Ok(_) => {}
            }
            let v: Value = serde_json::from_str(&line).expect("json");
            if v["op"] != "typing" && v["op"] != "partial" {
                return Some(v);
            }
        }
    }

    fn next(&mut self) -> Value {
        self.next_line().expect("connection closed")
    }

    /// Confirms a terminal event (an `acks` bridge).
    fn delivered(&mut self, v: &Value) {
        let id = v["id"].as_str().expect("id").to_owned();
        self.send(&json!({"op": "delivered", "ids": [id]}));
    }
}

fn terminal(v: &Value) -> bool {
    matches!(
        v["op"].as_str(),
        Some("reply" | "failed" | "cancelled" | "merged")
    )
}

/// The holder of each partition's lease now.
fn holders(redis: &Redis) -> Vec<Option<String>> {
    let mut c = redis.client();
    (0..PARTITIONS)
        .map(|p| {
            redis::cmd("GET")
                .arg(format!("ts:{{p{p}}}:lease"))
                .query::<Option<String>>(&mut c)
                .expect("GET")
        })
        .collect()
}

/// Waits (bounded) until `instance` holds every partition; how long that took.
fn until_all_held_by(redis: &Redis, instance: &str) -> Duration {
    let t0 = Instant::now();
    let prefix = format!("{instance}:");
    loop {
        if holders(redis)
            .iter()
            .all(|h| h.as_deref().is_some_and(|h| h.starts_with(&prefix)))
        {
            return t0.elapsed();
        }
        assert!(
            t0.elapsed() < WAIT,
            "{instance} never held every partition: {:?}",
            holders(redis)
        );
        std::thread::park_timeout(Duration::from_millis(10));
    }
}

fn messages_in_flight(redis: &Redis) -> u64 {
    let mut c = redis.client();
    (0..PARTITIONS)
        .map(|p| {
            redis::cmd("ZCARD")
                .arg(format!("ts:{{p{p}}}:q"))
                .query::<u64>(&mut c)
                .expect("ZCARD")
        })
        .sum()
}

#[test]
fn a_message_accepted_on_a_and_owned_by_b_is_run_on_b_and_answered_on_a() {
    let Some(bin) = require_redis() else { return };
    let redis = Redis::start(&bin);
    let b = Server::start(&redis, "b", 3000);
    until_all_held_by(&redis, "b");
    let a = Server::start(&redis, "a", 3000);
    let mut on_a = Client::connect(&a.addr);
    on_a.message("m1", "1");
    let ack = on_a.next();
    assert_eq!(
        (ack["op"].as_str(), ack["state"].as_str()),
        (Some("ack"), Some("queued")),
        "{ack}"
    );
    let done = on_a.next();
    assert!(terminal(&done), "{done}");
    assert_eq!(
        (
            done["op"].as_str(),
            done["id"].as_str(),
            done["text"].as_str()
        ),
        (Some("reply"), Some("m1"), Some("m1")),
        "{done}"
    );
    assert!(
        holders(&redis)
            .iter()
            .all(|h| h.as_deref().is_some_and(|h| h.starts_with("b:")))
    );
    // B's own bridge is answered by B.
    let mut on_b = Client::connect(&b.addr);
    on_b.message("m2", "2");
    assert_eq!(on_b.next()["op"], "ack");
    let done_b = on_b.next();
    assert_eq!(done_b["text"], "m2", "{done_b}");
    // Confirmed: both leave Redis, whichever instance confirms.
    on_a.delivered(&done);
    on_b.delivered(&done_b);
    let t0 = Instant::now();
    while messages_in_flight(&redis) > 0 {
        assert!(t0.elapsed() < WAIT, "delivered messages stayed in Redis");
        std::thread::park_timeout(Duration::from_millis(10));
    }
    drop(a);
}

#[test]
fn kill_9_of_the_owner_mid_load_loses_no_acked_message_and_keeps_per_session_order() {
    let Some(bin) = require_redis() else { return };
    let redis = Redis::start(&bin);
    let lease_ms = 1000;
    let mut b = Server::start(&redis, "b", lease_ms);
    until_all_held_by(&redis, "b");
    let a = Server::start(&redis, "a", lease_ms);
    let (sessions, per_session) = (20, 10);
    let mut on_a = Client::connect(&a.addr);
    let mut on_b = Client::connect(&b.addr);
    // Half the sessions through each instance, every message sent before the kill.
    let mut sent: Vec<(String, String)> = Vec::new();
    for i in 0..per_session {
        for s in 0..sessions {
            let (id, chat) = (format!("s{s}-{i}"), format!("{s}"));
            if s % 2 == 0 {
                on_a.message(&id, &chat);
            } else {
                on_b.message(&id, &chat);
            }
            sent.push((id, chat));
        }
    }
    // Read B's bridge until a few of its results came, then kill B mid-load.
    let mut acked: HashSet<String> = HashSet::new();
    let mut outcomes: HashMap<String, Vec<Value>> = HashMap::new();
    let mut order: HashMap<String, Vec<String>> = HashMap::new();
    let record = |v: Value,
                  acked: &mut HashSet<String>,
                  outcomes: &mut HashMap<String, Vec<Value>>,
                  order: &mut HashMap<String, Vec<String>>| {
        let id = v["id"].as_str().unwrap_or_default().to_owned();
        if v["op"] == "ack" {
            acked.insert(id);
        } else if terminal(&v) {
            let session = id.split('-').next().unwrap_or_default().to_owned();
            order.entry(session).or_default().push(id.clone());
            outcomes.entry(id).or_default().push(v);
        }
    };
    let mut seen_b = 0;
    while seen_b < 20 {
        let Some(v) = on_b.next_line() else { break };
        if terminal(&v) {
            seen_b += 1;
            on_b.delivered(&v);
        }
        record(v, &mut acked, &mut outcomes, &mut order);
    }
    b.kill9();
    let killed = Instant::now();
    // B's bridge reads what B wrote before it died, then reconnects to A.
    while let Some(v) = on_b.next_line() {
        record(v, &mut acked, &mut outcomes, &mut order);
    }
    let again = Client::connect(&a.addr);
    let took = until_all_held_by(&redis, "a");
    eprintln!(
        "takeover: every partition held by a {:?} after kill -9 of b (lease {lease_ms} ms)",
        killed.elapsed().max(took)
    );
    // Every acked message's outcome reaches a bridge: A's own or the reconnected one.
    let all_done = |acked: &HashSet<String>, outcomes: &HashMap<String, Vec<Value>>| {
        acked.iter().all(|id| outcomes.contains_key(id))
    };
    let (tx, rx) = crossbeam_channel::unbounded();
    for mut c in [on_a, again] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            while let Some(v) = c.next_line() {
                if terminal(&v) {
                    c.delivered(&v);
                }
                if tx.send(v).is_err() {
                    return;
                }
            }
        });
    }
    drop(tx);
    let t0 = Instant::now();
    while !all_done(&acked, &outcomes) || acked.len() < sent.len() / 2 {
        let left = WAIT.saturating_sub(t0.elapsed());
        match rx.recv_timeout(left) {
            Ok(v) => record(v, &mut acked, &mut outcomes, &mut order),
            Err(_) => break,
        }
    }
    let missing: Vec<&String> = acked
        .iter()
        .filter(|id| !outcomes.contains_key(*id))
        .collect();
    let twice = outcomes.values().filter(|v| v.len() > 1).count();
    eprintln!(
        "sent {}, acked {}, answered {}, lost {}, answered more than once {twice}",
        sent.len(),
        acked.len(),
        outcomes.len(),
        missing.len()
    );
    assert!(missing.is_empty(), "acked and never answered: {missing:?}");
    for (id, vs) in &outcomes {
        let first = vs[0]["op"].clone();
        assert!(
            vs.iter()
                .all(|v| v["op"] == first && v["text"] == vs[0]["text"]),
            "{id}: two different outcomes: {vs:?}"
        );
        // A second copy is the same outcome sent again, marked as possibly seen.
        assert!(
            vs[1..].iter().all(|v| v["redelivery"] == true),
            "{id}: a second copy not marked redelivery: {vs:?}"
        );
    }
    // Per-session order: a session's replies (not its interrupted turns) in sending order.
    for (session, ids) in &order {
        let replies: Vec<usize> = ids
            .iter()
            .filter(|id| outcomes[*id][0]["op"] == "reply")
            .filter_map(|id| id.rsplit('-').next()?.parse().ok())
            .collect();
        let mut dedup = replies.clone();
        dedup.dedup();
        let mut sorted = dedup.clone();
        sorted.sort_unstable();
        assert_eq!(
            dedup, sorted,
            "session {session}: replies out of order: {ids:?}"
        );
    }
}
