//! `--cluster-min-replicas 1` against a real replica (`redis-server --replicaof`) and a
//! failover by promoting it (issue 31 row 7): an ack means the replica has the message.
//! While the replica is stopped (SIGSTOP) nothing is acked (`reject storage`: `WAIT` found
//! no replica); then the primary is killed (-9), the replica promoted (`REPLICAOF NO ONE`)
//! and the instances' address moved to it (a TCP relay in this test stands for the
//! virtual IP or DNS name an operator moves), and a new replica attached to it: every
//! message acked before is answered.
//!
//! Without it (`--cluster-min-replicas 0`), a failover to a replica that lagged is found
//! (each instance keeps every partition's high-water mark): an ERROR, and nothing more is
//! acked from the older copy.
//!
//! The turns are held by a gated exec agent (a FIFO the test opens), so every acked message
//! is still in flight when the primary dies. Nothing sleeps: answers come on the bridges'
//! connections.

mod common;
mod redis_support;

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};

use crossbeam_channel::{Receiver, Sender};
use redis_support::{ClusterServe, Redis, WAIT, require_redis, terminal};
use serde_json::{Value, json};

/// A TCP relay to a Redis port that can be moved: what a failover's virtual IP does.
struct Relay {
    port: u16,
    target: Arc<AtomicU16>,
    open: Arc<Mutex<Vec<TcpStream>>>,
}

impl Relay {
    fn start(target: u16) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let target = Arc::new(AtomicU16::new(target));
        let open = Arc::new(Mutex::new(Vec::new()));
        let (t, o) = (Arc::clone(&target), Arc::clone(&open));
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { break };
                let Ok(up) = TcpStream::connect(("127.0.0.1", t.load(Ordering::SeqCst))) else {
                    continue;
                };
                let mut open = o.lock().unwrap_or_else(|e| e.into_inner());
                for s in [&client, &up] {
                    open.push(s.try_clone().expect("clone"));
                }
                let (c2, u2) = (
                    client.try_clone().expect("clone"),
                    up.try_clone().expect("clone"),
                );
                std::thread::spawn(move || relay(client, up));
                std::thread::spawn(move || relay(u2, c2));
            }
        });
        Relay { port, target, open }
    }

    /// New connections go to `port`; the open ones are cut (their clients reconnect).
    fn switch(&self, port: u16) {
        self.target.store(port, Ordering::SeqCst);
        for s in self
            .open
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

fn relay(mut from: TcpStream, mut to: TcpStream) {
    let _ = std::io::copy(&mut from, &mut to);
    let _ = to.shutdown(Shutdown::Both);
    let _ = from.shutdown(Shutdown::Both);
}

/// An instance, its log lines (WARN and up) read, also copied to this test's stderr.
struct Server {
    serve: ClusterServe,
}

impl Server {
    /// An instance whose turns wait for `gate`, with one replica required.
    fn start(url: &str, instance: &str, gate: &Path) -> Server {
        let agent = format!(": < '{}'; cat", gate.display());
        Server::start_with(
            url,
            instance,
            &[
                "--cluster-min-replicas",
                "1",
                "--agent",
                "exec",
                "--agent-cmd",
                &agent,
            ],
        )
    }

    fn start_with(url: &str, instance: &str, extra: &[&str]) -> Server {
        let serve = ClusterServe::spawn_logged(
            ClusterServe::command_at(url, "off", instance, 4, 1000)
                .args(extra)
                .env("RUST_LOG", "warn")
                .env_remove("TURNSTILE_AUTH_TOKEN"),
        );
        Server { serve }
    }
}

/// A bridge with `acks` on `addr` that confirms every terminal event: its write side, and
/// every line it receives (but typing and partials) on a channel.
fn bridge(addr: &str) -> (TcpStream, Receiver<Value>) {
    let stream = TcpStream::connect(addr).expect("connect");
    let mut w = stream.try_clone().expect("clone");
    send(
        &mut w,
        &json!({"op": "hello", "platform": "tg", "acks": true}),
    );
    let (tx, rx) = crossbeam_channel::unbounded();
    let confirm = w.try_clone().expect("clone");
    std::thread::spawn(move || pump(stream, confirm, &tx));
    (w, rx)
}

fn pump(stream: TcpStream, mut confirm: TcpStream, tx: &Sender<Value>) {
    for line in BufReader::new(stream).lines() {
        let Ok(line) = line else { break };
        let Ok(v) = serde_json::from_str::<Value>(&line) else {
            break;
        };
        if terminal(&v) {
            let id = v["id"].clone();
            let _ = confirm
                .write_all((json!({"op": "delivered", "ids": [id]}).to_string() + "\n").as_bytes());
        }
        if v["op"] != "typing" && v["op"] != "partial" && tx.send(v).is_err() {
            break;
        }
    }
}

fn send(w: &mut TcpStream, v: &Value) {
    w.write_all((v.to_string() + "\n").as_bytes())
        .expect("write");
}

/// Sends `ids` (each in a chat of its own) and answers each one's first `ack` or `reject`.
fn verdicts(w: &mut TcpStream, rx: &Receiver<Value>, ids: &[String]) -> HashMap<String, Value> {
    for id in ids {
        send(
            w,
            &json!({"op": "message", "id": id, "chat_id": id, "text": id}),
        );
    }
    let mut got = HashMap::new();
    while got.len() < ids.len() {
        let v = rx
            .recv_timeout(WAIT)
            .unwrap_or_else(|e| panic!("{} of {} answered: {e}", got.len(), ids.len()));
        let id = v["id"].as_str().unwrap_or_default().to_owned();
        if matches!(v["op"].as_str(), Some("ack" | "reject")) && ids.contains(&id) {
            got.entry(id).or_insert(v);
        }
    }
    got
}

fn ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

#[test]
fn with_one_replica_required_an_ack_survives_a_failover_and_a_stopped_replica_acks_nothing() {
    let Some(bin) = require_redis() else { return };
    let primary = Redis::start(&bin);
    let replica_of = primary.port().to_string();
    let replica = Redis::start_args(&bin, "always", &["--replicaof", "127.0.0.1", &replica_of]);
    // The replica has synced once the primary's WAIT counts it (Redis answers when it does).
    let synced: i64 = redis::cmd("WAIT")
        .arg(1)
        .arg(WAIT.as_millis() as u64)
        .query(&mut primary.client())
        .expect("WAIT");
    assert_eq!(synced, 1, "the replica never synced");
    let relay = Relay::start(primary.port());
    let url = format!("redis://127.0.0.1:{}", relay.port);
    let dir = tempfile::tempdir().expect("tempdir");
    let gate = dir.path().join("gate");
    let status = Command::new("mkfifo").arg(&gate).status().expect("mkfifo");
    assert!(status.success());
    let (a, b) = (
        Server::start(&url, "gw-a", &gate),
        Server::start(&url, "gw-b", &gate),
    );
    let (mut wa, ra) = bridge(&a.serve.addr);
    let (mut wb, rb) = bridge(&b.serve.addr);
    let mut acked: Vec<(String, bool)> = Vec::new();
    let mut expect = |got: &HashMap<String, Value>, ids: &[String], on_a: bool, op: &str| {
        for id in ids {
            assert_eq!(got[id]["op"], op, "{id}: {}", got[id]);
            if op == "ack" {
                acked.push((id.clone(), on_a));
            } else {
                assert_eq!(got[id]["reason"], "storage", "{id}: {}", got[id]);
            }
        }
    };

    let first = ids("first", 10);
    expect(&verdicts(&mut wa, &ra, &first), &first, true, "ack");
    // The replica stopped: no batch is confirmed, so nothing is acked.
    replica.signal(libc::SIGSTOP);
    let stopped = ids("stopped", 6);
    expect(&verdicts(&mut wb, &rb, &stopped), &stopped, false, "reject");
    replica.signal(libc::SIGCONT);
    let resumed = ids("resumed", 10);
    expect(&verdicts(&mut wb, &rb, &resumed), &resumed, false, "ack");

    // Failover: the primary dies with every acked turn still held; the replica is promoted
    // and takes the address.
    let mut primary = primary;
    primary.kill();
    let _: () = redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query(&mut replica.client())
        .expect("REPLICAOF NO ONE");
    relay.switch(replica.port());
    // With one replica required, the promoted one accepts no write until a replica of its
    // own has synced (as Sentinel would attach the old primary once it is back).
    let promoted = replica.port().to_string();
    let _second = Redis::start_args(&bin, "always", &["--replicaof", "127.0.0.1", &promoted]);
    // The turns go on (a writer keeps the FIFO open: every reader passes at once).
    let _gate = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&gate)
        .expect("open the gate");

    // Every acked message is answered, on the bridge that sent it.
    for (rx, on_a) in [(&ra, true), (&rb, false)] {
        let mut owed: HashSet<String> = acked
            .iter()
            .filter(|(_, a)| *a == on_a)
            .map(|(id, _)| id.clone())
            .collect();
        let total = owed.len();
        while !owed.is_empty() {
            let v = rx.recv_timeout(WAIT).unwrap_or_else(|e| {
                panic!(
                    "{} of {total} acked messages never answered after the failover: {owed:?} ({e})",
                    owed.len()
                )
            });
            if terminal(&v) {
                owed.remove(v["id"].as_str().unwrap_or_default());
            }
        }
    }
    drop((a, b));
}

#[test]
fn a_failover_to_a_replica_that_lagged_is_refused_with_an_error() {
    let Some(bin) = require_redis() else { return };
    let mut primary = Redis::start(&bin);
    let replica_of = primary.port().to_string();
    let replica = Redis::start_args(&bin, "always", &["--replicaof", "127.0.0.1", &replica_of]);
    let synced: i64 = redis::cmd("WAIT")
        .arg(1)
        .arg(WAIT.as_millis() as u64)
        .query(&mut primary.client())
        .expect("WAIT");
    assert_eq!(synced, 1, "the replica never synced");
    let relay = Relay::start(primary.port());
    let url = format!("redis://127.0.0.1:{}", relay.port);
    let a = Server::start_with(&url, "gw-a", &[]);
    let (mut wa, ra) = bridge(&a.serve.addr);
    let mut expect = |ids: &[String], op: &str| {
        let got = verdicts(&mut wa, &ra, ids);
        for id in ids {
            assert_eq!(got[id]["op"], op, "{id}: {}", got[id]);
        }
    };
    expect(&ids("first", 10), "ack");
    // The replica falls behind: its link cut while it is stopped (what the kernel had
    // buffered for it, it still reads), these are acked by the primary alone.
    replica.signal(libc::SIGSTOP);
    let _: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("replica")
        .query(&mut primary.client())
        .expect("CLIENT KILL TYPE replica");
    expect(&ids("lagged", 10), "ack");
    primary.kill();
    replica.signal(libc::SIGCONT);
    let _: () = redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query(&mut replica.client())
        .expect("REPLICAOF NO ONE");
    relay.switch(replica.port());
    // The instance's next pass finds partitions counting fewer messages than it saw.
    let line = a.serve.log().wait_for("older than this instance has seen");
    assert!(line.contains("ERROR"), "{line}");
    expect(&ids("after", 10), "reject");
}
