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
use turnstile::journal::{SqliteStore, Store};

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
            .args(["--listen", "127.0.0.1:0"])
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

/// One kill point: `n` messages over `sessions` sessions through a slow exec agent whose reply
/// names its process (a second run of a message would answer differently); SIGKILL once the
/// bridge has seen `kill_after` terminal events; restart on the same data directory; resend
/// what got no answer. Returns (acked before the kill, interrupted, redelivered).
fn kill_point(n: usize, sessions: usize, kill_after: usize) -> (usize, usize, usize) {
    let dir = tempfile::tempdir().unwrap();
    let runs = dir.path().join("runs");
    let agent = format!(
        "echo \"$TURNSTILE_MESSAGE_ID\" >> {}; sleep 0.01; echo \"$TURNSTILE_MESSAGE_ID ran in $$\"",
        runs.display()
    );
    let data = dir.path().join("data");
    let args = [
        "--agent",
        "exec",
        "--agent-cmd",
        &agent,
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
            Some("reply") => assert!(
                v["text"]
                    .as_str()
                    .unwrap()
                    .starts_with(&format!("{id} ran in "))
            ),
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
    let ran = std::fs::read_to_string(&runs).unwrap_or_default();
    let mut runs_per_id: HashMap<&str, usize> = HashMap::new();
    for id in ran.lines() {
        *runs_per_id.entry(id).or_insert(0) += 1;
    }
    let twice = runs_per_id.values().filter(|&&n| n > 1).count();
    eprintln!(
        "kill after {kill_after} terminal events: {} acked before the kill, {n} acked in all, {interrupted} interrupted by restart, {redelivered} redelivered, {twice} started twice by the agent",
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
