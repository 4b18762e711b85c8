//! Trust Redis or refuse (issue 31 rows 7 and 9): two `serve --cluster` instances under load
//! on one private redis-server (tests/redis_support), and Redis loses its data (FLUSHALL).
//! Each instance says so in an ERROR (an idle one too, from its ownership pass), fails `/readyz`, and accepts nothing more: a new
//! message is rejected `storage`, never acked into a database that forgot the ones before,
//! and Redis holds no message written after the flush. Before, both served on: 15 of 15
//! new messages were acked as if nothing had happened.
//!
//! Nothing sleeps: the instances' ERROR lines come on their stderr, the bridges' answers on
//! their connections, and `/readyz` is asked again at each new status snapshot (the endpoint
//! serves the latest one: tests/snapshot_watch).

mod common;
mod redis_support;
mod snapshot_watch;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};
use redis_support::{ClusterServe, Redis, WAIT, require_redis};
use serde_json::{Value, json};
use snapshot_watch::SnapshotWatch;

/// What every instance logs once it finds Redis without its generation.
/// What both distrust ERRORs say (the generation gone: "gone or replaced"; a partition's count
/// below what the instance saw: "older than this instance has seen"). Which check fires first
/// on an instance is a race between its accepts and its ownership pass: either is the promise.
const DISTRUST: &str = "no new one is accepted";

struct Server {
    /// Its log lines (WARN and up) read, also copied to this test's stderr.
    serve: ClusterServe,
    snapshots: SnapshotWatch,
    _dir: tempfile::TempDir,
}

impl Server {
    fn start(redis: &Redis, instance: &str) -> Server {
        let dir = tempfile::tempdir().expect("tempdir");
        let snapshots = SnapshotWatch::new(dir.path());
        let serve = ClusterServe::spawn_logged(
            ClusterServe::command_at(&redis.url(), "127.0.0.1:0", instance, 4, 1000)
                .arg("--status-file")
                .arg(dir.path().join("status.json"))
                .env("RUST_LOG", "warn")
                .env_remove("TURNSTILE_AUTH_TOKEN")
                .env_remove("NOTIFY_SOCKET"),
        );
        Server {
            serve,
            snapshots,
            _dir: dir,
        }
    }

    /// Blocks on the status snapshots until `/readyz` answers `code` with a body naming `why`
    /// (a loaded machine's late heartbeat tick is a 503 of its own: "last heartbeat tick
    /// 324 ms ago", once).
    fn wait_ready(&self, code: u16, why: &str) {
        let deadline = Instant::now() + WAIT;
        loop {
            let (got, body) = self.get("/readyz");
            if got == code && body.contains(why) {
                return;
            }
            assert!(
                self.snapshots.next_before(deadline),
                "/readyz never answered {code} naming {why:?}: {body}"
            );
        }
    }

    /// The status code and body of a GET of the HTTP endpoint.
    fn get(&self, path: &str) -> (u16, String) {
        let answer = common::http::get(self.serve.http(), path, None);
        (answer.status, answer.body)
    }
}

/// A bridge with `acks` on `addr`: its write side, and every line it receives (but typing
/// and partials) on a channel.
fn bridge(addr: &str) -> (TcpStream, Receiver<Value>) {
    let stream = TcpStream::connect(addr).expect("connect");
    let mut w = stream.try_clone().expect("clone");
    send(
        &mut w,
        &json!({"op": "hello", "platform": "tg", "acks": true}),
    );
    let (tx, rx) = crossbeam_channel::unbounded();
    std::thread::spawn(move || pump(stream, &tx));
    (w, rx)
}

fn pump(stream: TcpStream, tx: &Sender<Value>) {
    for line in BufReader::new(stream).lines() {
        let Ok(line) = line else { break };
        let Ok(v) = serde_json::from_str::<Value>(&line) else {
            break;
        };
        if v["op"] != "typing" && v["op"] != "partial" && tx.send(v).is_err() {
            break;
        }
    }
}

fn send(w: &mut TcpStream, v: &Value) {
    w.write_all((v.to_string() + "\n").as_bytes())
        .expect("write");
}

fn message(w: &mut TcpStream, id: &str, chat: usize) {
    send(
        w,
        &json!({"op": "message", "id": id, "chat_id": chat.to_string(), "text": id}),
    );
}

/// The first `ack` or `reject` of each id of `ids` from `rx`.
fn verdicts(rx: &Receiver<Value>, ids: &[String]) -> HashMap<String, Value> {
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

/// Redis's keys that only an accept writes (a message, the partition's count, its queue
/// and inbox): none may appear after the flush.
fn accepted_keys(redis: &Redis) -> Vec<String> {
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("ts:{p*}:*")
        .query(&mut redis.client())
        .expect("KEYS");
    keys.into_iter()
        .filter(|k| [":seq", ":q", ":in"].iter().any(|s| k.ends_with(s)) || k.contains(":m:"))
        .collect()
}

#[test]
fn redis_flushed_under_load_is_refused_by_every_instance_and_nothing_is_acked_into_it() {
    let Some(bin) = require_redis() else { return };
    let redis = Redis::start(&bin);
    let (a, b) = (Server::start(&redis, "gw-a"), Server::start(&redis, "gw-b"));
    // No bridge ever connects to C: its ownership pass alone must notice.
    let c = Server::start(&redis, "gw-c");
    let (mut wa, ra) = bridge(&a.serve.addr);
    let (mut wb, rb) = bridge(&b.serve.addr);
    assert_eq!(a.get("/readyz").0, 200);

    // Load on both; Redis is flushed once 50 of A's are answered, and the load goes on.
    let ids = |phase: &str| -> Vec<String> { (0..100).map(|i| format!("{phase}-{i}")).collect() };
    let (before, after) = (ids("before"), ids("after"));
    let (go, flushed) = crossbeam_channel::bounded::<()>(1);
    let loader = {
        let (mut wa, mut wb) = (
            wa.try_clone().expect("clone"),
            wb.try_clone().expect("clone"),
        );
        let (before, after) = (before.clone(), after.clone());
        std::thread::spawn(move || {
            for (phase, ids) in [(0, before), (1, after)] {
                if phase == 1 {
                    flushed.recv().expect("the flush");
                }
                for (i, id) in ids.iter().enumerate() {
                    let w = if i % 2 == 0 { &mut wa } else { &mut wb };
                    message(w, id, i % 20);
                }
            }
        })
    };
    let mut answered = 0;
    while answered < 50 {
        let v = ra.recv_timeout(WAIT).expect("A's answers under load");
        answered += usize::from(v["op"] == "reply");
    }
    let _: () = redis::cmd("FLUSHALL")
        .query(&mut redis.client())
        .expect("FLUSHALL");
    go.send(()).expect("go");
    loader.join().expect("loader");
    // Sent after the flush, before either instance may have noticed: every accept meets a
    // partition without its generation and is refused.
    let (to_a, to_b): (Vec<_>, Vec<_>) = after
        .iter()
        .cloned()
        .enumerate()
        .partition(|(i, _)| i % 2 == 0);
    for (rx, sent) in [(&ra, to_a), (&rb, to_b)] {
        let sent: Vec<String> = sent.into_iter().map(|(_, id)| id).collect();
        let got = verdicts(rx, &sent);
        let acked: Vec<&String> = sent.iter().filter(|id| got[*id]["op"] == "ack").collect();
        assert!(acked.is_empty(), "acked after the flush: {acked:?}");
    }

    // Each instance finds out, on its own (an accept or its ownership pass), and says so.
    for s in [&a, &b, &c] {
        let line = s.serve.log().wait_for(DISTRUST);
        assert!(line.contains("ERROR"), "{line}");
        s.wait_ready(503, "journal writes are failing");
    }
    // New messages on either: rejected `storage`, none acked into the empty database.
    for (w, rx, name) in [(&mut wa, &ra, "a"), (&mut wb, &rb, "b")] {
        let ids: Vec<String> = (0..15).map(|i| format!("later-{name}-{i}")).collect();
        for (i, id) in ids.iter().enumerate() {
            message(w, id, 100 + i);
        }
        let got = verdicts(rx, &ids);
        let acked: Vec<&String> = ids.iter().filter(|id| got[*id]["op"] == "ack").collect();
        assert!(acked.is_empty(), "{name}: acked after the flush: {acked:?}");
        for id in &ids {
            assert_eq!(got[id]["reason"], "storage", "{name}: {}", got[id]);
        }
    }
    let written = accepted_keys(&redis);
    assert!(written.is_empty(), "accepted after the flush: {written:?}");
}
