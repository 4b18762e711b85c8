//! Durability with the real binary (`--data-dir`): `kill -9` under load and a restart on the
//! same data directory lose no acknowledged message and run none twice; dedup and outboxes
//! survive a restart; interrupted turns fail or resume (and a message interrupted twice is
//! poison). Nothing sleeps: kill points are counts of events the bridge has seen.

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use turnstile::internal::journal::{SqliteStore, Store};

const WAIT: Duration = Duration::from_secs(30);

struct Server {
    child: Child,
    addr: String,
}

impl Server {
    fn start(data_dir: &Path, args: &[&str]) -> Server {
        let mut command = Command::new(env!("CARGO_BIN_EXE_turnstile"));
        command
            .arg("serve")
            .args(["--listen", "127.0.0.1:0", "--http-listen", "off"])
            .arg("--data-dir")
            .arg(data_dir)
            .args(args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        // The server dies with the test thread that started it.
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

    fn kill9(mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reaped");
    }

    fn stop(mut self) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let status = self.child.wait().expect("wait");
        assert!(status.success(), "{status}");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What the bridge saw, by message id.
#[derive(Default)]
struct Ledger {
    acked: HashSet<String>,
    rejected: HashMap<String, String>,
    /// Terminal lines (without the redelivery flag) and whether each was marked a redelivery.
    terminals: HashMap<String, Vec<(String, bool)>>,
    pongs: usize,
}

/// A bridge with `acks`: a reader thread fills the ledger and confirms every terminal event.
struct Bridge {
    writer: Arc<Mutex<TcpStream>>,
    ledger: Arc<Mutex<Ledger>>,
    events: crossbeam_channel::Receiver<()>,
}

fn terminal_op(op: &str) -> bool {
    matches!(op, "reply" | "failed" | "cancelled" | "merged")
}

impl Bridge {
    fn connect(addr: &str, ledger: Arc<Mutex<Ledger>>) -> Bridge {
        let stream = TcpStream::connect(addr).expect("connect");
        stream.set_read_timeout(Some(WAIT)).expect("timeout");
        let writer = Arc::new(Mutex::new(stream.try_clone().expect("clone")));
        let (tx, events) = crossbeam_channel::unbounded();
        let (w, l) = (writer.clone(), ledger.clone());
        std::thread::spawn(move || {
            let mut reader = BufReader::new(stream);
            let mut line = String::new();
            loop {
                line.clear();
                match reader.read_line(&mut line) {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
                let Ok(v) = serde_json::from_str::<Value>(&line) else {
                    panic!("not JSON: {line}");
                };
                let op = v["op"].as_str().unwrap_or("").to_string();
                let id = v["id"].as_str().unwrap_or("").to_string();
                {
                    let mut l = l.lock().unwrap();
                    match op.as_str() {
                        "ack" => {
                            l.acked.insert(id.clone());
                        }
                        "pong" => l.pongs += 1,
                        "reject" => {
                            l.rejected.insert(id.clone(), v["reason"].to_string());
                        }
                        op if terminal_op(op) => {
                            let mut plain = v.clone();
                            let redelivery = plain
                                .as_object_mut()
                                .unwrap()
                                .remove("redelivery")
                                .is_some();
                            l.terminals
                                .entry(id.clone())
                                .or_default()
                                .push((plain.to_string(), redelivery));
                        }
                        _ => {}
                    }
                }
                if terminal_op(&op) {
                    let confirm = json!({"op": "delivered", "ids": [id]}).to_string() + "\n";
                    if w.lock().unwrap().write_all(confirm.as_bytes()).is_err() {
                        return;
                    }
                }
                if tx.send(()).is_err() {
                    return;
                }
            }
        });
        let b = Bridge {
            writer,
            ledger,
            events,
        };
        b.send_raw(&json!({"op": "hello", "platform": "tg", "acks": true}));
        b
    }

    fn send_raw(&self, v: &Value) {
        let line = v.to_string() + "\n";
        // A write into a killed server fails; the ledger tells what was answered.
        let _ = self.writer.lock().unwrap().write_all(line.as_bytes());
    }

    fn send(&self, id: &str, chat: usize) {
        self.send_raw(
            &json!({"op": "message", "id": id, "chat_id": format!("c{chat}"), "text": id}),
        );
    }

    /// Waits until `done` holds of the ledger (each event re-checks it).
    fn wait_until(&self, what: &str, done: impl Fn(&Ledger) -> bool) {
        while !done(&self.ledger.lock().unwrap()) {
            self.events
                .recv_timeout(WAIT)
                .unwrap_or_else(|_| panic!("timed out waiting for {what}"));
        }
    }
}

fn ids(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("m{i}")).collect()
}

/// One kill point: `n` messages over `sessions` sessions through a slow agent (5 ms a turn);
/// SIGKILL once the bridge has seen `kill_after` terminal events; restart on the same data
/// directory; resend what got no answer. A message run twice with both outcomes reaching
/// the bridge would show as a second copy not marked `redelivery`, or as two different
/// outcomes (a reply and `interrupted by restart`). Returns (acked before the kill,
/// interrupted, redelivered).
fn kill_point(n: usize, sessions: usize, kill_after: usize) -> (usize, usize, usize) {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let args = [
        "--echo-delay-ms",
        "5",
        "--turn-workers",
        "8",
        "--queue-cap",
        "100",
        // Room in the outbox for every message in flight (each reserves the longest reply).
        "--max-reply-bytes",
        "4096",
    ];
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let all = ids(n);
    let server = Server::start(&data, &args);
    let bridge = Bridge::connect(&server.addr, ledger.clone());
    let sender = {
        let writer = bridge.writer.clone();
        let all = all.clone();
        std::thread::spawn(move || {
            let mut out = Vec::new();
            for (i, id) in all.iter().enumerate() {
                let m = json!({"op": "message", "id": id, "chat_id": format!("c{}", i % sessions), "text": id});
                out.extend_from_slice((m.to_string() + "\n").as_bytes());
            }
            let _ = writer.lock().unwrap().write_all(&out);
        })
    };
    bridge.wait_until("the kill point", |l| l.terminals.len() >= kill_after);
    server.kill9();
    let _ = sender.join();
    let acked_before = ledger.lock().unwrap().acked.clone();
    assert!(!acked_before.is_empty());

    let server = Server::start(&data, &args);
    let bridge = Bridge::connect(&server.addr, ledger.clone());
    let unanswered: Vec<(usize, String)> = {
        let l = ledger.lock().unwrap();
        all.iter()
            .enumerate()
            .filter(|(_, id)| !l.acked.contains(*id) && !l.rejected.contains_key(*id))
            .map(|(i, id)| (i, id.clone()))
            .collect()
    };
    for (i, id) in &unanswered {
        bridge.send(id, i % sessions);
    }
    bridge.wait_until("every message answered", |l| {
        all.iter()
            .all(|id| l.acked.contains(id) || l.rejected.contains_key(id))
    });
    bridge.wait_until("a terminal event for every acked message", |l| {
        l.acked.iter().all(|id| l.terminals.contains_key(id))
    });
    // Every confirmation is read before the server stops: a ping's pong comes after them.
    bridge.send_raw(&json!({"op": "ping"}));
    bridge.wait_until("the pong", |l| l.pongs > 0);
    let l = ledger.lock().unwrap();
    let (mut interrupted, mut redelivered) = (0, 0);
    for id in &l.acked {
        let t = &l.terminals[id];
        let distinct: HashSet<&String> = t.iter().map(|(line, _)| line).collect();
        assert_eq!(distinct.len(), 1, "{id}: more than one outcome: {t:?}");
        // A second copy is always marked as a redelivery.
        assert!(t.iter().skip(1).all(|(_, r)| *r), "{id}: {t:?}");
        redelivered += t.len() - 1;
        let v: Value = serde_json::from_str(&t[0].0).unwrap();
        match v["op"].as_str() {
            Some("reply") => assert_eq!(v["text"], *id),
            Some("failed") => {
                assert_eq!(v["error"], "interrupted by restart", "{id}");
                interrupted += 1;
            }
            other => panic!("{id}: unexpected terminal {other:?}"),
        }
    }
    assert!(l.rejected.is_empty(), "rejected: {:?}", l.rejected);
    assert!(l.terminals.keys().all(|id| l.acked.contains(id)));
    drop(l);
    drop(bridge);
    server.stop();
    // The journal is empty once everything is confirmed: the data dir holds what is in flight.
    let left = SqliteStore::open(&data).unwrap().load(0).unwrap();
    assert!(left.messages.is_empty(), "{} left", left.messages.len());
    eprintln!(
        "kill after {kill_after} terminal events: {} acked before the kill, {n} acked in all, {interrupted} interrupted by restart, {redelivered} redelivered",
        acked_before.len()
    );
    (acked_before.len(), interrupted, redelivered)
}

#[test]
fn kill_9_under_load_loses_no_acked_message_and_runs_none_twice() {
    // 2,100 messages in all; the last kill point is late in the run (most outcomes sent).
    for kill_after in [1, 200, 550] {
        let (acked, _, _) = kill_point(700, 30, kill_after);
        assert!(acked >= kill_after);
    }
}

/// A client without the kill-point machinery: one line at a time.
struct Plain {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Plain {
    fn connect(addr: &str, hello: Value) -> Plain {
        let stream = TcpStream::connect(addr).expect("connect");
        stream.set_read_timeout(Some(WAIT)).expect("timeout");
        let mut p = Plain {
            reader: BufReader::new(stream.try_clone().expect("clone")),
            writer: stream,
        };
        p.send(&hello);
        p
    }

    fn send(&mut self, v: &Value) {
        self.writer
            .write_all((v.to_string() + "\n").as_bytes())
            .expect("write");
    }

    fn message(&mut self, id: &str, chat: &str) {
        self.send(&json!({"op": "message", "id": id, "chat_id": chat, "text": id}));
    }

    /// The next line that is not a typing indicator.
    fn next(&mut self) -> Value {
        loop {
            let mut line = String::new();
            let n = self.reader.read_line(&mut line).expect("read");
            assert!(n > 0, "connection closed");
            let v: Value = serde_json::from_str(&line).expect("json");
            if v["op"] != "typing" {
                return v;
            }
        }
    }
}

fn acks_hello() -> Value {
    json!({"op": "hello", "platform": "tg", "acks": true})
}

/// `--resume-interrupted`: a turn a crash interrupted runs again; interrupted a second time it
/// is failed `poison`; without the flag an interrupted turn fails `interrupted by restart`.
/// Everything is in one session, so one turn runs and the rest wait. A turn's start is known
/// to be journaled once a later message's ack arrives (the journal is written in order, and
/// an ack waits for its record).
#[test]
fn resume_interrupted_reruns_a_turn_once_and_a_second_interruption_is_poison() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let hang = [
        "--agent",
        "exec",
        "--agent-cmd",
        "sleep 600",
        "--resume-interrupted",
    ];
    let server = Server::start(&data, &hang);
    let mut c = Plain::connect(&server.addr, acks_hello());
    c.message("m1", "1");
    assert_eq!(c.next()["state"], "running");
    c.message("b1", "1");
    assert_eq!(c.next()["state"], "queued");
    server.kill9();

    // Second life: m1 runs again (its second start), b1 waits behind it.
    let server = Server::start(&data, &hang);
    let mut c = Plain::connect(&server.addr, acks_hello());
    c.message("b2", "1");
    let v = c.next();
    assert_eq!(
        (v["id"].as_str(), v["state"].as_str()),
        (Some("b2"), Some("queued")),
        "{v}"
    );
    server.kill9();

    // Third life: m1 was interrupted twice: poison. b1 runs now.
    let server = Server::start(&data, &hang);
    let mut c = Plain::connect(&server.addr, acks_hello());
    let v = c.next();
    assert_eq!(
        (v["op"].as_str(), v["id"].as_str()),
        (Some("failed"), Some("m1")),
        "{v}"
    );
    assert!(v["error"].as_str().unwrap().starts_with("poison"), "{v}");
    c.send(&json!({"op": "delivered", "ids": ["m1"]}));
    c.message("b3", "1");
    assert_eq!(c.next()["id"], "b3");
    server.kill9();

    // Fourth life, without the flag: b1's interrupted turn fails, and nothing else answers.
    let server = Server::start(&data, &["--agent", "exec", "--agent-cmd", "sleep 600"]);
    let mut c = Plain::connect(&server.addr, acks_hello());
    let v = c.next();
    assert_eq!(
        (v["op"].as_str(), v["id"].as_str()),
        (Some("failed"), Some("b1")),
        "{v}"
    );
    assert_eq!(v["error"], "interrupted by restart");
    c.send(&json!({"op": "ping"}));
    assert_eq!(c.next()["op"], "pong");
    server.kill9();
}

/// The duplicate window and an unconfirmed reply both survive `kill -9`.
#[test]
fn dedup_and_the_outbox_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &[]);
    let mut c = Plain::connect(&server.addr, acks_hello());
    c.message("once", "1");
    assert_eq!(c.next()["state"], "running");
    let reply = c.next();
    assert_eq!(
        (reply["op"].as_str(), reply["text"].as_str()),
        (Some("reply"), Some("once"))
    );
    // Read but never confirmed, then the gateway dies.
    server.kill9();

    let server = Server::start(&data, &[]);
    let mut c = Plain::connect(&server.addr, acks_hello());
    let again = c.next();
    assert_eq!(again["op"], "reply");
    assert_eq!(again["id"], "once");
    assert_eq!(again["redelivery"], true);
    c.send(&json!({"op": "delivered", "ids": ["once"]}));
    c.message("once", "1");
    let dup = c.next();
    assert_eq!(dup["state"], "duplicate", "{dup}");
    server.stop();

    // Confirmed: a third life has nothing to send, and still knows the id.
    let server = Server::start(&data, &[]);
    let mut c = Plain::connect(&server.addr, acks_hello());
    c.message("once", "1");
    assert_eq!(c.next()["state"], "duplicate");
    c.send(&json!({"op": "ping"}));
    assert_eq!(c.next()["op"], "pong");
    server.stop();
}

/// A bad data directory or a damaged journal stops the gateway before it listens, naming it.
#[test]
fn a_damaged_journal_is_refused_at_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(data.join("journal.sqlite3"), vec![0x5a; 8192]).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "off",
            "--data-dir",
        ])
        .arg(&data)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--data-dir") && err.contains("journal"),
        "{err}"
    );
    assert!(out.stdout.is_empty(), "it listened");
}

mod injected_fault {
    use super::*;
    use std::sync::atomic::Ordering;
    use turnstile::internal::agent::{Agent, CancelToken, TurnError, TurnInput};
    use turnstile::internal::journal::{FaultyStore, JournalConfig, MemStore};
    use turnstile::internal::message::SessionKey;
    use turnstile::internal::server::{BridgeConfig, BridgeServer, ServerConfig};

    /// Replies with its text once the test opens the gate for it.
    struct Gated(crossbeam_channel::Receiver<()>);

    impl Agent for Gated {
        fn turn(
            &mut self,
            input: &TurnInput<'_>,
            cancel: &CancelToken,
        ) -> Result<String, TurnError> {
            loop {
                if self.0.recv_timeout(Duration::from_millis(20)).is_ok() {
                    return Ok(input.text.to_string());
                }
                if cancel.is_cancelled() {
                    return Err(TurnError::Cancelled);
                }
            }
        }
    }

    /// A store that fails on command under the real server: new messages are rejected
    /// `storage`, an acked message's outcome waits for its record, and once writes succeed
    /// again everything kept is written, the outcome goes out and new messages are acked.
    #[test]
    fn a_failing_store_rejects_storage_and_loses_nothing_acked() {
        let (gate, gate_rx) = crossbeam_channel::unbounded::<()>();
        let factory = move |_: &SessionKey| -> Result<Box<dyn Agent>, String> {
            Ok(Box::new(Gated(gate_rx.clone())))
        };
        let (runtime, handle, _events) = turnstile::Builder::new(factory).build().unwrap();
        let mem = MemStore::new();
        let (store, failing) = FaultyStore::new(mem.clone());
        let cfg = ServerConfig {
            bridge: BridgeConfig {
                journal: true,
                ..BridgeConfig::default()
            },
            handle_signals: false,
            ..ServerConfig::default()
        };
        let server = BridgeServer::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap();
        let addr = server.local_addr().unwrap().to_string();
        let (server, _) = server
            .with_journal(
                store,
                JournalConfig {
                    retry_every: Duration::from_millis(10),
                    ..JournalConfig::default()
                },
            )
            .unwrap();
        let reactor = std::thread::spawn(move || runtime.run_with(server));

        let mut c = Plain::connect(&addr, acks_hello());
        c.message("m1", "1");
        assert_eq!(c.next()["state"], "running");
        failing.store(true, Ordering::SeqCst);
        c.message("m2", "2");
        let r = c.next();
        assert_eq!(
            (r["op"].as_str(), r["reason"].as_str()),
            (Some("reject"), Some("storage")),
            "{r}"
        );
        // The acked message finishes while the disk fails: its reply waits for its outcome
        // record (a bridge that had it could be answered differently after a crash).
        gate.send(()).unwrap();
        let left = mem.clone().load(0).unwrap();
        assert_eq!(
            left.messages.len(),
            1,
            "m1 must stay journaled while its records cannot be written"
        );
        assert!(left.messages[0].outcome.is_none());
        // The disk works again: the next batch writes what was kept, and then m1's reply
        // and m3's ack go out.
        failing.store(false, Ordering::SeqCst);
        c.message("m3", "3");
        let mut got: Vec<(String, String)> = (0..2)
            .map(|_| {
                let v = c.next();
                (
                    v["id"].as_str().unwrap_or("").to_string(),
                    v["op"].as_str().unwrap_or("").to_string(),
                )
            })
            .collect();
        got.sort();
        assert_eq!(
            got,
            [("m1".into(), "reply".into()), ("m3".into(), "ack".into())]
        );
        c.send(&json!({"op": "delivered", "ids": ["m1"]}));
        gate.send(()).unwrap();
        assert_eq!(c.next()["id"], "m3");
        handle.shutdown();
        reactor.join().unwrap().unwrap();
    }
}
