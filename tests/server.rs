//! The real binary over real sockets: `turnstile serve` on 127.0.0.1:0, spoken to with the
//! bridge protocol. Reads have timeouts that only bound a failing run; nothing sleeps.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, ExitStatus, Stdio};
use std::time::Duration;

use common::eventually;
use common::fifo::fifo_watch;
use common::gateway::{Serve, wait_status};
use crossbeam_channel::bounded;
use serde_json::{Value, json};

// Only a failing run waits this long; generous so a loaded 2-core machine never trips it.
const WAIT: Duration = Duration::from_secs(60);

type Server = Serve;

impl Serve {
    /// A gateway (its access open) with `args`: it dies with the test thread that started
    /// it, so a test that fails or is killed (a mutation run's timeout) never leaves a
    /// gateway behind.
    fn start(args: &[&str]) -> Server {
        Serve::spawn(
            Serve::local_command("off")
                .args(["--access-default", "open"])
                .args(args)
                .env("RUST_LOG", "warn")
                .stderr(Stdio::inherit()),
        )
    }

    fn client(&self) -> Client {
        let stream = TcpStream::connect(&self.addr).expect("connect");
        stream.set_read_timeout(Some(WAIT)).expect("timeout");
        Client {
            reader: BufReader::new(stream.try_clone().expect("clone")),
            writer: stream,
        }
    }

    /// Waits for exit (bounded: a hang fails the test instead of blocking it).
    fn wait(mut self) -> ExitStatus {
        let (tx, rx) = bounded(1);
        let mut child =
            std::mem::replace(&mut self.child, Command::new("true").spawn().expect("true"));
        std::thread::spawn(move || {
            let _ = tx.send(child.wait());
        });
        rx.recv_timeout(Duration::from_secs(60))
            .expect("server exited in time")
            .expect("wait")
    }
}

struct Client {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

fn msg(id: &str, chat: &str, text: &str) -> Value {
    json!({"op": "message", "id": id, "platform": "telegram", "chat_id": chat, "text": text})
}

impl Client {
    fn send(&mut self, v: &Value) {
        writeln!(self.writer, "{v}").expect("write");
    }

    fn send_raw(&mut self, bytes: &[u8]) {
        self.writer.write_all(bytes).expect("write");
    }

    fn recv(&mut self) -> Value {
        let mut line = String::new();
        let n = self
            .reader
            .read_line(&mut line)
            .expect("a line before the timeout");
        assert!(n > 0, "connection closed");
        serde_json::from_str(&line).expect("json line")
    }

    /// Reads lines until one matches; returns it and the lines skipped.
    fn recv_until(&mut self, pred: impl Fn(&Value) -> bool) -> (Value, Vec<Value>) {
        let mut skipped = Vec::new();
        loop {
            let v = self.recv();
            if pred(&v) {
                return (v, skipped);
            }
            skipped.push(v);
        }
    }

    /// The terminal event of message `id`.
    fn outcome(&mut self, id: &str) -> Value {
        self.recv_until(|v| {
            v["id"] == id
                && ["reply", "cancelled", "failed", "merged"]
                    .contains(&v["op"].as_str().unwrap_or(""))
        })
        .0
    }

    fn ack(&mut self, id: &str) -> Value {
        self.recv_until(|v| v["id"] == id && (v["op"] == "ack" || v["op"] == "reject"))
            .0
    }

    fn closed(&mut self) -> bool {
        let mut buf = [0u8; 1];
        matches!(self.reader.read(&mut buf), Ok(0))
    }
}

#[test]
fn reply_round_trip() {
    let server = Server::start(&[]);
    let mut c = server.client();
    c.send(&json!({"op": "ping"}));
    // The pong tells the server's line limit (`--max-line-bytes`, by default 65,536).
    assert_eq!(c.recv(), json!({"op": "pong", "max_line_bytes": 65_536}));
    c.send(&msg("m-1", "42", "hi there"));
    assert_eq!(
        c.recv(),
        json!({"op": "ack", "id": "m-1", "session": "telegram:dm:42", "state": "running", "position": 0})
    );
    let (reply, skipped) = c.recv_until(|v| v["op"] == "reply");
    assert_eq!(
        reply,
        json!({"op": "reply", "id": "m-1", "session": "telegram:dm:42", "text": "hi there"})
    );
    assert!(
        skipped
            .iter()
            .any(|v| v["op"] == "typing" && v["on"] == true && v["chat_id"] == "42")
    );
}

#[test]
fn a_pipelined_burst_gets_rising_positions_and_replies_in_order() {
    let server = Server::start(&["--echo-delay-ms", "50", "--queue-cap", "64"]);
    let mut c = server.client();
    let burst: String = (0..50)
        .map(|i| format!("{}\n", msg(&format!("b{i}"), "7", &format!("text {i}"))))
        .collect();
    c.send_raw(burst.as_bytes());
    let mut positions = Vec::new();
    let mut replies = Vec::new();
    while replies.len() < 50 {
        let v = c.recv();
        match v["op"].as_str() {
            Some("ack") => positions.push(v["position"].as_u64().expect("position")),
            Some("reply") => replies.push(v["text"].as_str().expect("text").to_owned()),
            Some("typing") => {}
            other => panic!("unexpected {other:?}: {v}"),
        }
    }
    assert_eq!(positions, (0..50).collect::<Vec<u64>>());
    assert_eq!(
        replies,
        (0..50).map(|i| format!("text {i}")).collect::<Vec<_>>()
    );
}

#[test]
fn many_sessions_progress_concurrently() {
    let server = Server::start(&["--echo-delay-ms", "300", "--turn-workers", "16"]);
    let mut c = server.client();
    for i in 0..200 {
        c.send(&msg(&format!("s{i}"), &format!("chat{i}"), "hello"));
    }
    // Concurrency without timing: the first two sessions both start before either replies.
    let (first_reply, before) = c.recv_until(|v| v["op"] == "reply");
    let typing_on: Vec<&Value> = before
        .iter()
        .filter(|v| v["op"] == "typing" && v["on"] == true)
        .collect();
    assert!(typing_on.len() >= 2, "turns did not overlap: {before:?}");
    let mut replied = 1;
    assert_eq!(first_reply["text"], "hello");
    while replied < 200 {
        if c.recv()["op"] == "reply" {
            replied += 1;
        }
    }
}

#[test]
fn one_past_the_queue_cap_is_rejected_queue_full() {
    let server = Server::start(&["--echo-delay-ms", "2000", "--queue-cap", "2"]);
    let mut c = server.client();
    for i in 0..4 {
        c.send(&msg(&format!("q{i}"), "1", "x"));
    }
    assert_eq!(c.ack("q0")["state"], "running");
    assert_eq!(c.ack("q1")["position"], 1);
    assert_eq!(c.ack("q2")["position"], 2);
    let r = c.ack("q3");
    assert_eq!(
        (r["op"].as_str(), r["reason"].as_str()),
        (Some("reject"), Some("queue_full"))
    );
    c.send(&msg("stop", "1", "/stop"));
    assert_eq!(c.outcome("q0")["reason"], "stopped");
}

#[test]
fn stop_new_and_status_commands() {
    let server = Server::start(&["--echo-delay-ms", "10000"]);
    let mut c = server.client();
    c.send(&msg("m1", "5", "long"));
    c.send(&msg("m2", "5", "queued"));
    c.ack("m2");
    c.send(&msg("st", "5", "/status"));
    let status = c.outcome("st");
    let text = status["text"].as_str().expect("status text");
    assert!(
        text.starts_with("running for") && text.ends_with("1 queued"),
        "{text}"
    );
    c.send(&msg("stop", "5", "/stop"));
    let stop = c.outcome("stop");
    assert_eq!(
        stop["text"],
        "stop: cancelled the running turn, 1 queued message(s) cancelled"
    );
    assert_eq!(c.outcome("m1")["reason"], "stopped");
    c.send(&msg("new", "5", "/new"));
    assert_eq!(c.outcome("new")["op"], "reply");
}

#[test]
fn interrupt_mode_cancels_the_running_turn() {
    let server = Server::start(&["--busy-mode", "interrupt", "--echo-delay-ms", "1500"]);
    let mut c = server.client();
    c.send(&msg("m1", "9", "first"));
    c.ack("m1");
    c.send(&msg("m2", "9", "second"));
    assert_eq!(
        c.outcome("m1"),
        json!({"op": "cancelled", "id": "m1", "session": "telegram:dm:9", "reason": "interrupted"})
    );
    assert_eq!(c.outcome("m2")["text"], "second");
}

#[test]
fn merge_mode_folds_the_queue_into_one_turn() {
    let server = Server::start(&["--busy-mode", "merge", "--echo-delay-ms", "1000"]);
    let mut c = server.client();
    c.send(&msg("m1", "9", "one"));
    c.ack("m1");
    c.send(&msg("m2", "9", "two"));
    c.send(&msg("m3", "9", "three"));
    c.ack("m3");
    assert_eq!(c.outcome("m1")["text"], "one");
    assert_eq!(
        c.outcome("m3"),
        json!({"op": "merged", "id": "m3", "session": "telegram:dm:9", "into": "m2"})
    );
    assert_eq!(c.outcome("m2")["text"], "two\nthree");
}

#[test]
fn a_duplicate_id_is_acknowledged_and_not_run_again() {
    let server = Server::start(&[]);
    let mut c = server.client();
    c.send(&msg("dup", "3", "once"));
    c.outcome("dup");
    c.send(&msg("dup", "3", "once"));
    assert_eq!(
        c.ack("dup"),
        json!({"op": "ack", "id": "dup", "session": "telegram:dm:3", "state": "duplicate"})
    );
    c.send(&json!({"op": "ping"}));
    let (_, skipped) = c.recv_until(|v| v["op"] == "pong");
    assert!(
        skipped.iter().all(|v| v["op"] != "reply"),
        "duplicate ran again: {skipped:?}"
    );
}

#[test]
fn a_reply_for_a_departed_sender_waits_for_the_next_hello_of_its_platform() {
    let server = Server::start(&["--echo-delay-ms", "500"]);
    let mut a = server.client();
    a.send(&json!({"op": "hello", "platform": "telegram"}));
    a.send(&msg("gone", "77", "for later"));
    a.ack("gone");
    drop(a);
    // A bridge of another platform queues behind "gone" on the same session; its reply proves
    // that "gone" finished while no telegram bridge was connected.
    let mut d = server.client();
    d.send(&json!({"op": "hello", "platform": "discord"}));
    d.send(&msg("marker", "77", "after"));
    d.outcome("marker");
    let mut b = server.client();
    b.send(&json!({"op": "hello", "platform": "telegram"}));
    assert_eq!(
        b.outcome("gone"),
        json!({"op": "reply", "id": "gone", "session": "telegram:dm:77", "text": "for later"})
    );
}

#[test]
fn malformed_input_gets_an_error_and_the_connection_keeps_working() {
    let server = Server::start(&["--max-line-bytes", "100"]);
    let mut c = server.client();
    let cases: [(&[u8], &str); 5] = [
        (b"{not json\n", "invalid JSON"),
        (b"[1,2]\n", "expected a JSON object"),
        (b"{\"op\":\"dance\"}\n", "unknown op"),
        (b"{\"text\":\"x\"}\n", "missing op"),
        (b"\xff\xfe\n", "invalid JSON"),
    ];
    for (line, expect) in cases {
        c.send_raw(line);
        let v = c.recv();
        assert_eq!(v["op"], "error");
        assert!(v["detail"].as_str().unwrap_or("").contains(expect), "{v}");
        c.send(&json!({"op": "ping"}));
        assert_eq!(c.recv()["op"], "pong");
    }
    // Too long: one error, the rest of the line discarded, the next line read normally.
    let long = format!("{{\"op\":\"ping\",\"pad\":\"{}\"}}\n", "x".repeat(500));
    c.send_raw(long.as_bytes());
    assert!(
        c.recv()["detail"]
            .as_str()
            .unwrap_or("")
            .contains("longer than 100")
    );
    c.send(&json!({"op": "ping"}));
    assert_eq!(c.recv()["op"], "pong");
    // A message with an id but a bad field: reject/invalid naming the field.
    c.send(&json!({"op": "message", "id": "bad", "platform": "t", "text": "x"}));
    let v = c.recv();
    assert_eq!(
        (v["op"].as_str(), v["reason"].as_str(), v["id"].as_str()),
        (Some("reject"), Some("invalid"), Some("bad"))
    );
    assert!(v["detail"].as_str().unwrap_or("").contains("chat_id"));
    c.send(&json!({"op": "message", "id": "bad2", "platform": "t", "chat_id": "1", "text": 5}));
    assert!(c.recv()["detail"].as_str().unwrap_or("").contains("text"));
    c.send(&json!({"op": "message", "id": "bad3", "chat_id": "1", "text": "x"}));
    assert!(
        c.recv()["detail"]
            .as_str()
            .unwrap_or("")
            .contains("platform")
    );
    c.send(&msg("ok", "1", "still fine"));
    assert_eq!(c.outcome("ok")["text"], "still fine");
}

#[test]
fn auth_token_is_required_when_configured() {
    let server = Server::start(&["--auth-token", "s3cret"]);
    let mut c = server.client();
    c.send(&msg("m", "1", "hi"));
    assert_eq!(c.recv(), json!({"op": "error", "detail": "unauthorized"}));
    assert!(c.closed());
    let mut c = server.client();
    c.send(&json!({"op": "hello", "platform": "telegram", "token": "s3creT"}));
    assert_eq!(c.recv()["detail"], "unauthorized");
    let mut c = server.client();
    c.send(&json!({"op": "hello", "platform": "telegram", "token": "s3cret"}));
    c.send(&json!({"op": "message", "id": "m", "chat_id": "1", "text": "hi"}));
    assert_eq!(c.outcome("m")["text"], "hi");
}

#[test]
fn sigterm_drains_running_turns_cancels_queued_ones_and_exits_zero() {
    let server = Server::start(&["--echo-delay-ms", "1000"]);
    let mut c = server.client();
    c.send(&msg("run", "1", "running"));
    c.send(&msg("wait", "1", "queued"));
    c.send(&msg("other", "2", "also running"));
    for id in ["run", "wait", "other"] {
        c.ack(id);
    }
    server.signal(libc::SIGTERM);
    let mut outcomes = std::collections::HashMap::new();
    while outcomes.len() < 3 {
        let v = c.recv();
        if ["reply", "cancelled", "failed", "merged"].contains(&v["op"].as_str().unwrap_or("")) {
            assert!(
                outcomes
                    .insert(v["id"].as_str().unwrap_or("").to_owned(), v.clone())
                    .is_none(),
                "two outcomes: {v}"
            );
        }
    }
    assert_eq!(outcomes["wait"]["reason"], "shutdown");
    assert_eq!(outcomes["run"]["text"], "running");
    assert_eq!(outcomes["other"]["text"], "also running");
    assert!(server.wait().success(), "a clean drain exits 0");
}

#[test]
fn sigterm_cancels_turns_still_running_at_the_drain_deadline() {
    let server = Server::start(&[
        "--agent",
        "exec",
        "--agent-cmd",
        "trap '' TERM; sleep 30",
        "--drain-timeout",
        "0.2",
        "--stop-grace",
        "0.2",
    ]);
    let mut c = server.client();
    c.send(&msg("slow", "1", "x"));
    c.ack("slow");
    server.signal(libc::SIGTERM);
    // The exec agent honours cancellation (it kills the group), so the turn ends cancelled.
    assert_eq!(c.outcome("slow")["reason"], "shutdown");
    let status = server.wait();
    assert!(
        status.success(),
        "cancelled in time is still a clean shutdown: {status:?}"
    );
}

#[test]
fn a_second_signal_exits_one_at_once() {
    let server = Server::start(&["--echo-delay-ms", "60000", "--drain-timeout", "600"]);
    let mut c = server.client();
    c.send(&msg("long", "1", "x"));
    c.ack("long");
    server.signal(libc::SIGTERM);
    // Wait until the first signal was handled: new messages are refused from then on. The
    // signal is asynchronous, so a message can still be accepted before the reactor sees it;
    // keep writing (new ids, one round trip each) until the refusal comes.
    let mut handled = false;
    for n in 0..100_000 {
        let id = format!("late{n}");
        c.send(&msg(&id, "2", "y"));
        let ack = c.ack(&id);
        if ack["reason"] == "shutting_down" {
            handled = true;
            break;
        }
        assert_eq!(
            ack["op"], "ack",
            "accepted before the signal was seen: {ack}"
        );
    }
    assert!(handled, "SIGTERM never started the drain");
    server.signal(libc::SIGHUP);
    c.send(&json!({"op": "ping"}));
    assert_eq!(
        c.recv_until(|v| v["op"] == "pong").0["op"],
        "pong",
        "SIGHUP killed it"
    );
    server.signal(libc::SIGINT);
    // Issue 8 row 14: the forced exit still answers what was running.
    assert_eq!(c.outcome("long")["reason"], "shutdown");
    assert_eq!(server.wait().code(), Some(1));
}

fn exec_script(dir: &std::path::Path) -> String {
    let script = dir.join("agent.sh");
    std::fs::write(
        &script,
        "read -r line\ncase \"$line\" in\n  fail) echo 'something broke' >&2; exit 3 ;;\n  sleep) sleep 300 > \"$FIFO\" & wait ;;\n  leave) sleep 300 > \"$FIFO\" 2>/dev/null & echo left ;;\n  *) echo \"$line\" | tr a-z A-Z ;;\nesac\n",
    )
    .expect("script");
    format!("sh {}", script.display())
}

#[test]
fn exec_agent_replies_fails_and_stop_leaves_no_process_behind() {
    let dir = std::env::temp_dir().join(format!("turnstile-exec-{}", std::process::id()));
    let fifo = fifo_watch(&dir, "sleep.fifo");
    let cmd = format!("FIFO={} {}", fifo.path.display(), exec_script(&dir));
    let server = Server::start(&["--agent", "exec", "--agent-cmd", &cmd]);
    let mut c = server.client();
    c.send(&msg("up", "1", "hello"));
    assert_eq!(c.outcome("up")["text"], "HELLO");
    c.send(&msg("bad", "1", "fail"));
    let failed = c.outcome("bad");
    assert_eq!(failed["op"], "failed");
    // The exit status only: stderr ("something broke") goes to the log, never to the chat.
    assert_eq!(failed["error"], "agent error: exit status 3");

    // The sleep child holds the FIFO's write end: EOF on our side means it is dead.
    c.send(&msg("nap", "2", "sleep"));
    fifo.opened.recv_timeout(WAIT).expect("sleep child started");
    c.send(&msg("stop", "2", "/stop"));
    assert_eq!(c.outcome("nap")["reason"], "stopped");
    fifo.eof
        .recv_timeout(WAIT)
        .expect("the sleep child was killed with its group");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn send_subcommand_prints_the_reply() {
    let server = Server::start(&[]);
    let out = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args([
            "send",
            "--addr",
            &server.addr,
            "--chat",
            "9",
            "hello",
            "from",
            "send",
        ])
        .output()
        .expect("run send");
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello from send\n");

    let locked = Server::start(&["--auth-token", "k"]);
    let out = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args(["send", "--addr", &locked.addr, "hi"])
        .env_remove("TURNSTILE_AUTH_TOKEN")
        .output()
        .expect("run send");
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unauthorized"));
}

#[test]
fn bad_flags_and_config_values_exit_two_naming_them() {
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .arg("serve")
            .args(args)
            .output()
            .expect("run")
    };
    let out = run(&["--queue-cap", "0"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--queue-cap"));
    let out = run(&["--max-held-turns", "0"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--max-held-turns: must be at least 1"));
    let out = run(&["--busy-mode", "chaos"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--busy-mode"));
    let out = run(&["--agent", "exec"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--agent-cmd"));

    let dir = std::env::temp_dir().join(format!("turnstile-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "queue-cap = \"lots\"\n").expect("write");
    let out = run(&["--config", bad.to_str().expect("path")]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("queue-cap"));
    let unknown = dir.join("unknown.toml");
    std::fs::write(&unknown, "queue-capp = 3\n").expect("write");
    let out = run(&["--config", unknown.to_str().expect("path")]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("queue-capp"));
    // A good file is honoured, and a flag overrides it.
    let good = dir.join("good.toml");
    std::fs::write(&good, "queue-cap = 1\necho-delay-ms = 2000\n").expect("write");
    let server = Server::start(&["--config", good.to_str().expect("path")]);
    let mut c = server.client();
    for i in 0..3 {
        c.send(&msg(&format!("c{i}"), "1", "x"));
    }
    assert_eq!(c.ack("c2")["reason"], "queue_full");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A client that stops reading is closed after `--write-stall-timeout`; what it had not taken
/// goes back to the outbox and the next hello of its platform gets it. Nothing is lost: what
/// the stalled client's socket had already taken, it can still read.
#[test]
fn a_client_that_stops_reading_is_closed_and_its_replies_wait_for_the_next_hello() {
    const N: usize = 200;
    // All turns run at once after the 300 ms delay, so most messages are accepted before the
    // replies (12 MB) flood a client that never reads. Not necessarily all: the stall clock
    // runs while the server still reads A, and on a loaded machine A can be closed before
    // its last lines are read. Those were never accepted and are owed nothing, so the replies
    // expected are those of the messages the status counts as accepted once A is closed.
    let dir = tempfile::tempdir().expect("tempdir");
    let status_file = dir.path().join("status.json");
    let server = Server::start(&[
        "--status-file",
        status_file.to_str().expect("utf-8 path"),
        "--echo-delay-ms",
        "300",
        "--turn-workers",
        "200",
        // Above everything A is sent, so reading A never pauses: all N are accepted
        // whatever the machine's load.
        "--max-write-buffer",
        "16777216",
        "--write-stall-timeout",
        "1",
    ]);
    let mut a = server.client();
    a.send(&json!({"op": "hello", "platform": "telegram"}));
    let pad = "p".repeat(60_000);
    let mut input = Vec::new();
    for i in 0..N {
        input.extend_from_slice(
            format!(
                "{}\n",
                msg(&format!("big{i}"), &format!("c{i}"), &format!("{i} {pad}"))
            )
            .as_bytes(),
        );
    }
    // Written from another thread: A reads nothing until B has its share.
    let mut writer = a.writer.try_clone().expect("clone");
    let feeder = std::thread::spawn(move || {
        let _ = writer.write_all(&input);
    });
    let mut b = server.client();
    b.send(&json!({"op": "hello", "platform": "telegram"}));
    let mut replied = std::collections::HashSet::new();
    // B gets the results A left behind once A is closed for stalling.
    let (first, _) = b.recv_until(|v| v["op"] == "reply");
    replied.insert(first["id"].as_str().unwrap_or("").to_owned());
    // Now A reads what its socket had taken before the server gave up on it.
    let _ = feeder.join();
    let mut received = Vec::new();
    let _ = a.reader.read_to_end(&mut received);
    let mut from_a = 0;
    for line in received.split(|&b| b == b'\n') {
        if let Ok(v) = serde_json::from_slice::<Value>(line)
            && v["op"] == "reply"
        {
            assert!(
                replied.insert(v["id"].as_str().unwrap_or("").to_owned()),
                "twice: {}",
                v["id"]
            );
            from_a += 1;
        }
    }
    assert!(from_a < N, "A was never closed");
    // B's first reply came from A's outbox, so A is closed: no message is accepted after it.
    // The first snapshot that counts A's close counts every message accepted.
    let accepted = wait_status(&status_file, "a status with A closed", WAIT, |st| {
        (st["frontend"]["connections_refused"].as_u64() >= Some(1))
            .then(|| st["messages"]["accepted"].as_u64().expect("accepted") as usize)
    });
    assert!(accepted > from_a && accepted <= N, "accepted {accepted}");
    while replied.len() < accepted {
        let v = b.recv();
        if v["op"] == "reply" {
            let id = v["id"].as_str().unwrap_or("").to_owned();
            let n: usize = id.trim_start_matches("big").parse().expect("id");
            assert_eq!(
                v["text"].as_str().map(|t| t.starts_with(&format!("{n} "))),
                Some(true)
            );
            assert!(replied.insert(id.clone()), "twice: {id}");
        }
    }
}

/// The outbox is kept by admission: an accepted message reserves its result's room, so with
/// `--outbox-cap 1` a second telegram message is refused while the first is undelivered, even
/// before its result exists; delivering it frees the room. Other platforms are unaffected.
#[test]
fn a_full_outbox_refuses_new_messages_for_its_platform_with_backpressure() {
    let server = Server::start(&["--echo-delay-ms", "300", "--outbox-cap", "1"]);
    let mut a = server.client();
    a.send(&json!({"op": "hello", "platform": "telegram"}));
    a.send(&msg("w1", "1", "x"));
    a.ack("w1");
    a.send(&msg("refused", "2", "z"));
    let r = a.ack("refused");
    assert_eq!(
        (r["op"].as_str(), r["reason"].as_str()),
        (Some("reject"), Some("backpressure"))
    );
    // Other platforms are unaffected.
    a.send(&json!({"op": "message", "id": "fine", "platform": "discord", "chat_id": "2", "text": "ok"}));
    let mut texts = std::collections::HashMap::new();
    while texts.len() < 2 {
        let v = a.recv();
        if v["op"] == "reply" {
            texts.insert(v["id"].as_str().unwrap_or("").to_owned(), v["text"].clone());
        }
    }
    assert_eq!((&texts["fine"], &texts["w1"]), (&json!("ok"), &json!("x")));
    // w1's result was written: its room is free again.
    a.send(&msg("again", "2", "z"));
    assert_eq!(a.outcome("again")["text"], "z");
}

/// `turnstile loadgen --addr ADDR ARGS…`, which must succeed: its one JSON line.
fn loadgen(addr: &str, args: &[&str]) -> Value {
    let out = common::run_ok(
        Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args(["loadgen", "--addr", addr])
            .args(args),
        "loadgen",
    );
    serde_json::from_slice(&out.stdout).expect("one JSON line")
}

#[test]
fn loadgen_runs_the_closed_loop_workload_and_prints_one_json_line() {
    let server = Server::start(&[]);
    let v = loadgen(
        &server.addr,
        &["--sessions", "7", "--rounds", "3", "--connections", "2"],
    );
    assert_eq!(
        (
            v["turns"].as_u64(),
            v["sessions"].as_u64(),
            v["rounds"].as_u64()
        ),
        (Some(21), Some(7), Some(3))
    );
    assert!(v["latency_ms"]["p50"].as_f64().is_some_and(|p| p > 0.0));
}

#[test]
fn a_loadgen_flood_gets_every_message_answered_and_prints_its_report() {
    let server = Server::start(&[]);
    let v = loadgen(
        &server.addr,
        &[
            "--flood",
            "--messages",
            "40",
            "--sessions",
            "4",
            "--connections",
            "2",
            "--window",
            "5",
        ],
    );
    assert_eq!(
        (v["scenario"].as_str(), v["messages"].as_u64()),
        (Some("flood"), Some(40))
    );
}

/// A gateway stand-in that acks every message line `duplicate` and answers nothing else: what a
/// loadgen sees when another sender used its ids first (issue 22's three-instance flood, whose
/// floods started in the same millisecond).
fn duplicate_answering_gateway() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut out = stream.try_clone().expect("clone");
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    let v: Value = serde_json::from_str(&line).unwrap_or_default();
                    if v["op"] == "message" {
                        let ack = json!({"op": "ack", "id": v["id"], "session": "s",
                                         "state": "duplicate"});
                        if writeln!(out, "{ack}").is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    addr
}

#[test]
fn a_loadgen_whose_ids_are_answered_duplicate_exits_naming_it_instead_of_waiting() {
    let addr = duplicate_answering_gateway();
    for mode in [
        &["--flood", "--messages", "5"][..],
        &["--sessions", "2", "--rounds", "2"],
    ] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args(["loadgen", "--addr", &addr, "--connections", "1"])
            .args(mode)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run loadgen");
        let mut stderr = child.stderr.take().expect("stderr");
        let (tx, rx) = bounded(1);
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text);
            let _ = tx.send(text);
        });
        // A bound, not an ordering: before the fix it waited for the answers forever.
        let Ok(text) = rx.recv_timeout(Duration::from_secs(60)) else {
            let _ = child.kill();
            panic!("loadgen {mode:?} still waiting after 60 s on answers that never come");
        };
        let status = child.wait().expect("wait");
        assert_eq!(status.code(), Some(1), "{mode:?}: {text}");
        assert!(
            text.contains("gateway answered duplicate for") && text.contains("same id"),
            "{mode:?}: {text}"
        );
    }
}

#[test]
fn connections_beyond_the_limit_get_an_error_and_are_closed() {
    let server = Server::start(&["--max-connections", "1"]);
    let mut first = server.client();
    first.send(&json!({"op": "ping"}));
    assert_eq!(first.recv()["op"], "pong");
    let mut second = server.client();
    assert_eq!(
        second.recv(),
        json!({"op": "error", "detail": "too many connections (1)"})
    );
    assert!(second.closed());
    // The first connection is unaffected.
    first.send(&msg("m", "1", "still here"));
    assert_eq!(first.outcome("m")["text"], "still here");
}

/// Issue 8 row 15: a non-loopback bind without a token is refused before `listening on`,
/// unless `--allow-insecure-bind` (then a WARN).
#[test]
fn a_non_loopback_address_without_a_token_is_refused_unless_allowed() {
    let out = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args(["serve", "--listen", "0.0.0.0:0"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--listen") && err.contains("--auth-token"),
        "{err}"
    );

    let mut child = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args([
            "serve",
            "--listen",
            "0.0.0.0:0",
            "--allow-insecure-bind",
            "--http-listen",
            "off",
        ])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start");
    let stderr = child.stderr.take().expect("stderr");
    let mut line = String::new();
    BufReader::new(stderr)
        .read_line(&mut line)
        .expect("a log line");
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        line.contains("WARN") && line.contains("without an auth token"),
        "{line}"
    );
}

#[test]
fn typing_is_refreshed_while_a_turn_runs_and_turned_off_at_its_end() {
    // The refresh period is 4 s, so this turn takes a little longer than one period.
    let server = Server::start(&["--echo-delay-ms", "4500"]);
    let mut c = server.client();
    c.send(&msg("slow", "8", "x"));
    let (reply, before) = c.recv_until(|v| v["op"] == "reply");
    assert_eq!(reply["id"], "slow");
    let typing: Vec<bool> = before
        .iter()
        .filter(|v| v["op"] == "typing")
        .map(|v| v["on"] == true)
        .collect();
    // On, refreshed at least once (more if a loaded machine slows the turn), then off.
    assert!(typing.len() >= 3, "no refresh: {before:?}");
    assert_eq!(typing.last(), Some(&false));
    assert!(
        typing[..typing.len() - 1].iter().all(|&on| on),
        "{before:?}"
    );
}

/// A turn that leaves a background process running gets its reply; closing the agent (here by
/// /new) kills what it left behind.
#[test]
fn closing_an_exec_agent_kills_what_its_turns_left_running() {
    let dir = std::env::temp_dir().join(format!("turnstile-exec-leave-{}", std::process::id()));
    let fifo = fifo_watch(&dir, "leftover.fifo");
    let cmd = format!("FIFO={} {}", fifo.path.display(), exec_script(&dir));
    let server = Server::start(&["--agent", "exec", "--agent-cmd", &cmd]);
    let mut c = server.client();
    c.send(&msg("bg", "3", "leave"));
    assert_eq!(c.outcome("bg")["text"], "left");
    fifo.opened
        .recv_timeout(WAIT)
        .expect("the leftover process started");
    assert!(
        fifo.eof.try_recv().is_err(),
        "the leftover died with its turn"
    );
    c.send(&msg("new", "3", "/new"));
    assert_eq!(c.outcome("new")["op"], "reply");
    fifo.eof
        .recv_timeout(WAIT)
        .expect("close() killed the leftover process");
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------------
// Issue 8 over real sockets.

/// Row 9: a client that half-closes (`shutdown(SHUT_WR)`, as `nc -N` does) and keeps reading
/// gets its reply, then the server closes.
#[test]
fn a_half_closed_client_keeps_getting_its_events() {
    let server = Server::start(&["--echo-delay-ms", "300"]);
    let mut a = server.client();
    a.send(&json!({"op": "hello", "platform": "telegram"}));
    let mut other = server.client();
    other.send(&json!({"op": "hello", "platform": "telegram"}));
    other.send(&json!({"op": "ping"}));
    other.recv_until(|v| v["op"] == "pong");
    a.send(&msg("half", "1", "still reading"));
    a.writer
        .shutdown(std::net::Shutdown::Write)
        .expect("shutdown");
    assert_eq!(a.outcome("half")["text"], "still reading");
    assert!(a.closed(), "the server closes once nothing is outstanding");
    other.send(&json!({"op": "ping"}));
    let (_, skipped) = other.recv_until(|v| v["op"] == "pong");
    assert!(skipped.iter().all(|v| v["id"] != "half"), "{skipped:?}");
}

/// Row 7: with a token, a connection that never says hello is closed at the deadline.
#[test]
fn a_connection_without_a_hello_is_closed_at_the_deadline() {
    let server = Server::start(&["--auth-token", "k", "--hello-timeout", "0.3"]);
    let mut idle = server.client();
    let mut real = server.client();
    real.send(&json!({"op": "hello", "platform": "tg", "token": "k"}));
    let v = idle.recv();
    assert_eq!(v["detail"], "no hello within 300ms");
    assert!(idle.closed());
    real.send(&json!({"op": "ping"}));
    assert_eq!(real.recv()["op"], "pong");
}

/// Row 8: under a low descriptor limit, connections past it are answered with an error line
/// (not left in the accept queue), and accepted again once descriptors are free.
#[test]
fn after_running_out_of_descriptors_connections_are_refused_then_accepted_again() {
    let script = format!(
        "ulimit -n 40 && exec {} serve --listen 127.0.0.1:0 --http-listen off",
        env!("CARGO_BIN_EXE_turnstile")
    );
    let server = Serve::spawn(
        Command::new("sh")
            .args(["-c", &script])
            .env("RUST_LOG", "error")
            .stderr(Stdio::null()),
    );
    // A ping on a new connection: Some(answer), or None when the connection was refused and
    // reset before its line could be read (a refused socket closes with our ping unread).
    let try_ping = |server: &Server| -> (Option<Value>, Option<Client>) {
        let mut c = server.client();
        if writeln!(c.writer, "{}", json!({"op": "ping"})).is_err() {
            return (None, None);
        }
        let mut line = String::new();
        match c.reader.read_line(&mut line) {
            Ok(n) if n > 0 => (serde_json::from_str(&line).ok(), Some(c)),
            _ => (None, None),
        }
    };
    let mut open = Vec::new();
    for _ in 0..100 {
        match try_ping(&server) {
            (Some(v), Some(c)) if v["op"] == "pong" => open.push(c),
            _ => break,
        }
    }
    assert!(open.len() > 10 && open.len() < 100, "{}", open.len());
    // At the limit, a new connection is answered with the error line (it says nothing).
    let mut refused = server.client();
    let v = refused.recv();
    assert!(
        v["detail"]
            .as_str()
            .unwrap_or("")
            .contains("too many open files"),
        "{v}"
    );
    assert!(refused.closed());
    open.truncate(open.len() - 5);
    // The server frees descriptors as it reads the closes; each try is answered either way.
    let mut answered = false;
    for _ in 0..1_000 {
        if let (Some(v), _) = try_ping(&server)
            && v["op"] == "pong"
        {
            answered = true;
            break;
        }
    }
    assert!(answered, "never accepted again");
    for c in &mut open {
        c.send(&json!({"op": "ping"}));
        assert_eq!(c.recv()["op"], "pong");
    }
}

/// Rows 4 and 6: a reply far larger than the socket buffers (8 MiB of `"`, 16 MiB escaped)
/// is written while another connection's pings are answered, and its reader is not cut off.
#[test]
fn a_huge_reply_is_written_while_other_connections_are_served() {
    let server = Server::start(&[
        "--max-line-bytes",
        "20000000",
        "--max-reply-bytes",
        "16777216",
        "--outbox-bytes",
        "1073741824",
    ]);
    let mut a = server.client();
    let mut b = server.client();
    let text = "\"".repeat(8 << 20);
    a.send(&msg("huge", "1", &text));
    // A reads nothing yet: its reply cannot fit in the socket buffers, so the server is
    // still writing it while B's pings are answered.
    let mut slowest = Duration::ZERO;
    for _ in 0..50 {
        let t = std::time::Instant::now();
        b.send(&json!({"op": "ping"}));
        assert_eq!(b.recv()["op"], "pong");
        slowest = slowest.max(t.elapsed());
    }
    eprintln!("slowest ping while the reply was being written: {slowest:?}");
    let reply = a.outcome("huge");
    assert_eq!(reply["text"].as_str().map(str::len), Some(8 << 20));
}

/// Row 1 and the memory test: 5,000 hellos with distinct platform names (and some 60 KB
/// names, refused) leave no platform behind once they disconnect.
#[test]
fn five_thousand_hellos_with_distinct_platforms_leave_no_platform_behind() {
    let dir = std::env::temp_dir().join(format!("turnstile-hellos-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let status = dir.join("status.json");
    let server = Server::start(&["--status-file", status.to_str().expect("path")]);
    let long = "p".repeat(60_000);
    for i in 0..5_000 {
        let mut c = server.client();
        let platform = if i % 50 == 0 {
            format!("{long}{i}")
        } else {
            format!("platform-{i:05}-{}", "x".repeat(40))
        };
        c.send(&json!({"op": "hello", "platform": platform}));
        c.send(&json!({"op": "ping"}));
        c.recv_until(|v| v["op"] == "pong");
    }
    // Once its ping is answered, `control` is the one connection left; the status file is
    // rewritten every 100 ms.
    let mut control = server.client();
    control.send(&json!({"op": "ping"}));
    control.recv_until(|v| v["op"] == "pong");
    wait_status(&status, "no platform and one connection left", WAIT, |v| {
        let bridge = &v["frontend"];
        (bridge["platforms"] == 0 && bridge["connections"] == 1).then_some(())
    });
    let _ = std::fs::remove_dir_all(&dir);
}

/// Row 15: an unwritable status file is refused before `listening on`, naming the setting;
/// a `\r` before the newline does not count toward the line limit.
#[test]
fn start_up_errors_exit_two_before_listening_and_cr_does_not_count() {
    let out = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--status-file",
            "/nonexistent/x",
        ])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--status-file"));

    // Thread counts the machine will not honour are refused by name, before listening.
    let out = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--turn-workers",
            "100000",
        ])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty(), "listening before refusing");
    assert!(String::from_utf8_lossy(&out.stderr).contains("turn_workers"));

    let server = Server::start(&["--max-line-bytes", "20"]);
    let mut c = server.client();
    let line = br#"{"op":"ping","xy":1}"#;
    assert_eq!(line.len(), 20);
    c.send_raw(&[&line[..], b"\r\n"].concat());
    assert_eq!(c.recv()["op"], "pong");
}

/// Issue 7 §2 end to end: the sender (in a DM too), its name and the platform's meta reach
/// the agent, here the exec agent's environment, through `turnstile send`.
#[test]
fn sender_name_and_meta_reach_the_agent() {
    let server = Server::start(&[
        "--agent",
        "exec",
        "--agent-cmd",
        r#"echo "$TURNSTILE_USER_ID|$TURNSTILE_USER_NAME|$TURNSTILE_META""#,
    ]);
    let out = common::run_ok(
        Command::new(env!("CARGO_BIN_EXE_turnstile")).args([
            "send",
            "--addr",
            &server.addr,
            "--user",
            "7",
            "--user-name",
            "Ann",
            "--meta",
            r#"{"reply_to": "m0"}"#,
            "hi",
        ]),
        "send",
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "7|Ann|{\"reply_to\":\"m0\"}\n"
    );
}

/// `send --stream` prints a partial reply as it comes: the agent holds its reply back until
/// the test has read the partial from send's stdout (a file it waits for), so the partial
/// can only have been read if it was printed before the reply existed.
#[test]
fn send_stream_prints_partials_as_they_come() {
    let dir = tempfile::tempdir().expect("tempdir");
    let gate = dir.path().join("go");
    let agent = format!(
        r#"python3 -c '
import json, os, sys, time
for line in sys.stdin:
    m = json.loads(line)
    if m["op"] != "turn": continue
    print(json.dumps({{"op": "partial", "id": m["id"], "text": "first "}}), flush=True)
    while not os.path.exists("{gate}"): time.sleep(0.01)
    print(json.dumps({{"op": "reply", "id": m["id"], "text": "first second"}}), flush=True)
'"#,
        gate = gate.display()
    );
    let server = Server::start(&[
        "--agent",
        "process",
        "--agent-cmd",
        &agent,
        "--partial-interval",
        "0",
    ]);
    let mut send = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args([
            "send",
            "--stream",
            "--addr",
            &server.addr,
            "--timeout",
            "60s",
            "go",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("run send");
    let mut out = send.stdout.take().expect("stdout");
    let mut first = [0u8; 6];
    std::io::Read::read_exact(&mut out, &mut first).expect("the partial, before the reply");
    assert_eq!(&first, b"first ");
    std::fs::write(&gate, b"").expect("open the gate");
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).expect("the rest");
    assert_eq!(rest, "second\n");
    assert!(send.wait().expect("send exits").success());
}

/// A config file must be a regular file of at most 1 MiB: a huge one is refused instead of
/// read into memory, a FIFO instead of blocking start-up (and every later reload) forever.
#[test]
fn an_oversized_or_non_regular_config_file_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let big = dir.path().join("big.toml");
    let mut text = String::from("queue-cap = 8\n");
    while text.len() <= 1 << 20 {
        text.push_str("# padding padding padding padding padding padding padding padding\n");
    }
    std::fs::write(&big, text).expect("write");
    let fifo = dir.path().join("fifo.toml");
    assert!(
        Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .expect("mkfifo")
            .success()
    );
    for (path, why) in [(&big, "larger than 1 MiB"), (&fifo, "not a regular file")] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args([
                "serve",
                "--check-config",
                "--http-listen",
                "off",
                "--config",
            ])
            .arg(path)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run serve");
        // Bounded: on a FIFO an unguarded read would block forever.
        let status = eventually(&format!("{why}: serve exits"), WAIT, || {
            child.try_wait().expect("try_wait")
        });
        let mut err = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut err)
            .expect("stderr");
        assert_eq!(status.code(), Some(2), "{why}: {err}");
        assert!(err.contains(why), "{why}: {err}");
    }
}

/// Lowers this thread's priority (nice 19), so that clients flooding the server do not take
/// the CPU from it on a small machine.
fn nice_this_thread() {
    // SAFETY: gettid and setpriority on the calling thread only.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, 19);
    }
}

/// Writes `chunk` without blocking until the socket takes no more (its buffers and the
/// server's are full); false if the connection failed.
fn stuff(stream: &std::net::TcpStream, chunk: &[u8]) -> bool {
    use std::os::fd::AsRawFd;
    loop {
        // SAFETY: send(2) from a live buffer on an open socket; MSG_DONTWAIT leaves the
        // descriptor (shared with the reading half) blocking.
        let n = unsafe {
            libc::send(
                stream.as_raw_fd(),
                chunk.as_ptr().cast(),
                chunk.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 {
            return std::io::Error::last_os_error().kind() == std::io::ErrorKind::WouldBlock;
        }
    }
}

/// Row 1 of issue 18: twenty connections flood the server with lines that need no answer
/// while a quiet one pings. Readable connections take turns (one that used its read budget
/// goes to the back), so the quiet one's pong comes within one round of the others' turns,
/// while every flood still goes on: before any flooder's closing ping, sent after its
/// flood, is answered. Ordered by events, never by a timed bound: the quiet one pings only
/// once every flooder has filled its socket (so all twenty are readable and stay so), and a
/// flooder's closing ping is reachable only after the server read tens of MiB more from it
/// (thousands of its turns, each one a round in which the quiet one is served). On a server
/// that serves readable connections in a fixed order, the pong waits for the floods to end.
#[test]
fn a_quiet_connection_is_served_while_twenty_others_flood() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    const FLOODERS: usize = 20;
    // Per flooder, far more than the sockets' buffers hold (a few MiB on loopback).
    const FLOOD_BYTES: usize = 64 << 20;
    let server = Server::start(&[]);
    let line = b"{\"op\":\"delivered\",\"ids\":[]}\n";
    let chunk: Arc<Vec<u8>> = Arc::new(line.repeat(2048 / line.len()));
    let (events, seen) = bounded::<(&'static str, usize)>(4 * FLOODERS);
    let stop = Arc::new(AtomicBool::new(false));
    // Connected and answered before any flood, so its accept is not what it waits for.
    let mut quiet = server.client();
    quiet.send(&json!({"op": "ping"}));
    assert_eq!(quiet.recv()["op"], "pong");
    let mut threads = Vec::new();
    for i in 0..FLOODERS {
        let mut c = server.client();
        let events = events.clone();
        let chunk = Arc::clone(&chunk);
        let stop = Arc::clone(&stop);
        threads.push(std::thread::spawn(move || {
            nice_this_thread();
            c.send(&json!({"op": "ping"}));
            let (v, _) = c.recv_until(|v| v["op"] == "pong");
            assert_eq!(v["op"], "pong");
            let mut writer = c.writer.try_clone().expect("clone");
            let full_events = events.clone();
            let flood = std::thread::spawn(move || {
                nice_this_thread();
                if !stuff(&writer, &chunk) {
                    return;
                }
                let _ = full_events.send(("full", i));
                let mut sent = 0;
                while sent < FLOOD_BYTES && !stop.load(Ordering::Relaxed) {
                    if writer.write_all(&chunk).is_err() {
                        return;
                    }
                    sent += chunk.len();
                }
                let _ = writeln!(writer, "{}", json!({"op": "ping"}));
            });
            let (v, _) = c.recv_until(|v| v["op"] == "pong");
            assert_eq!(v["op"], "pong");
            let _ = events.send(("done", i));
            let _ = flood.join();
        }));
    }
    // Every flooder's socket is full: all twenty are readable, with their floods to go.
    let mut full = 0;
    while full < FLOODERS {
        let (what, i) = seen
            .recv_timeout(WAIT)
            .expect("every flooder's socket full");
        assert_eq!(
            what, "full",
            "flooder {i} finished before all had filled their sockets"
        );
        full += 1;
    }
    let (tx, rx) = bounded(1);
    quiet.send(&json!({"op": "ping"}));
    let pinger = std::thread::spawn(move || {
        let v = quiet.recv();
        let _ = events.send(("quiet", usize::MAX));
        let _ = tx.send(v);
    });
    let (first, who) = seen.recv_timeout(WAIT).expect("an event");
    stop.store(true, Ordering::Relaxed);
    assert_eq!(
        (first, who),
        ("quiet", usize::MAX),
        "flooder {who}'s whole flood was read before the quiet connection's ping"
    );
    assert_eq!(rx.recv_timeout(WAIT).expect("pong")["op"], "pong");
    let _ = pinger.join();
    // The flooders' threads end with the server's sockets.
    drop(server);
    drop(threads);
}

/// `--max-held-turns` reaches the core: the status reports it as the held turns' bound.
#[test]
fn max_held_turns_is_the_bound_the_status_reports() {
    let dir = std::env::temp_dir().join(format!("turnstile-held-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let status = dir.join("status.json");
    let _server = Server::start(&[
        "--max-held-turns",
        "7",
        "--status-file",
        status.to_str().expect("path"),
    ]);
    // The status file is rewritten every 100 ms.
    wait_status(&status, "the status's max_held is 7", WAIT, |v| {
        (v["turns"]["max_held"] == json!(7)).then_some(())
    });
    let _ = std::fs::remove_dir_all(&dir);
}
