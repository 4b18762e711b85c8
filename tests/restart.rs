//! Planned restarts and start-up errors with the real binary (issue 17 §3–§5): a graceful
//! SIGTERM with `--data-dir` leaves the queue in the journal and the next start runs every
//! message exactly once (the agents keep a side-effect log); turns the drain cut off are
//! interrupted (failed, or run again with `--resume-interrupted`); without `--data-dir` the
//! queue is still cancelled; a second gateway on the same directory is refused before it
//! binds, naming the holder; `--check-config` fails where `serve` would; a full disk at
//! start-up exits 1 and a configuration error 2; a shutdown whose journal could not finish
//! exits 1. Nothing sleeps: agents report their turns' starts through a FIFO.
//!
//! The tmpfs tests mount a small tmpfs (they need root, as in CI's container); without the
//! permission they say so and return — except under `TURNSTILE_REQUIRE_REAL_SERVERS=1`
//! (`.ci/run`), where they fail.

mod common;

use std::collections::{HashMap, HashSet};
use std::ffi::CString;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::Duration;

use common::gateway::Serve;
use serde_json::{Value, json};
use turnstile::{SqliteStore, Store};

const WAIT: Duration = Duration::from_secs(60);

fn binary() -> Command {
    Command::new(env!("CARGO_BIN_EXE_turnstile"))
}

type Server = Serve;

impl Serve {
    fn start(data_dir: Option<&Path>, args: &[&str]) -> Server {
        let mut command = Serve::local_command("off");
        command
            .args(args)
            .env("RUST_LOG", "warn")
            .stderr(Stdio::inherit());
        if let Some(dir) = data_dir {
            command.arg("--data-dir").arg(dir);
        }
        Serve::spawn(&mut command)
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM (a graceful stop), and the exit status.
    fn terminate(self) -> ExitStatus {
        self.signal_term();
        self.wait()
    }

    /// Sends SIGTERM once (a second one would force an exit 1).
    fn signal_term(&self) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
    }

    fn wait(mut self) -> ExitStatus {
        self.child.wait().expect("wait")
    }
}

/// A bridge connection, one line at a time.
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

    /// The next line that is not a typing indicator; `None` at the end of the stream.
    fn next_line(&mut self) -> Option<Value> {
        loop {
            let mut line = String::new();
            let n = self.reader.read_line(&mut line).expect("read");
            if n == 0 {
                return None;
            }
            let v: Value = serde_json::from_str(&line).expect("json");
            if v["op"] != "typing" {
                return Some(v);
            }
        }
    }

    fn next(&mut self) -> Value {
        self.next_line().expect("connection closed")
    }
}

fn terminal(v: &Value) -> bool {
    matches!(
        v["op"].as_str(),
        Some("reply" | "failed" | "cancelled" | "merged")
    )
}

fn mkfifo(path: &Path) {
    let c = CString::new(path.as_os_str().as_bytes()).expect("path");
    // SAFETY: mkfifo(3) with a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
}

/// Lines the agents write into the FIFO at `path` as their turns start, on a channel. The
/// FIFO is opened read-write so that it never reaches end of file between writers.
fn starts(path: &Path) -> crossbeam_channel::Receiver<String> {
    mkfifo(path);
    let fifo = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("open fifo");
    let (tx, rx) = crossbeam_channel::unbounded();
    std::thread::spawn(move || {
        for line in BufReader::new(fifo).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

/// The exec agent of the first life: logs its message (the side effect), reports its start,
/// then works until it is cancelled.
fn hanging_agent(log: &Path, fifo: &Path) -> String {
    format!(
        "read -r t; echo \"$t\" >> '{}'; echo \"$t\" > '{}'; exec sleep 600",
        log.display(),
        fifo.display()
    )
}

/// The exec agent of the second life: logs its message and replies with it.
fn replying_agent(log: &Path) -> String {
    format!("read -r t; echo \"$t\" >> '{}'; echo \"$t\"", log.display())
}

/// How many times each message's turn ran, from the side-effect log.
fn runs(log: &Path) -> HashMap<String, usize> {
    let mut n = HashMap::new();
    for line in std::fs::read_to_string(log).unwrap_or_default().lines() {
        *n.entry(line.to_owned()).or_default() += 1;
    }
    n
}

/// 40 durably acked messages in 4 sessions, 4 turns running and 36 queued, then SIGTERM
/// (`--drain-timeout 0`: the running turns are cut at once). Nothing is answered
/// `cancelled: shutdown`; the next start runs each of the 36 queued messages exactly once,
/// in order within its session, and fails the 4 cut-off turns `interrupted by restart`
/// (their side effects happened once, in the first life). The journal is empty after.
#[test]
fn sigterm_keeps_the_queue_and_the_restart_runs_every_message_once() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let log = dir.path().join("side-effects.log");
    let started = starts(&dir.path().join("started"));
    let common = ["--turn-workers", "8", "--queue-cap", "16"];
    let first = hanging_agent(&log, &dir.path().join("started"));
    let mut args = vec![
        "--agent",
        "exec",
        "--agent-cmd",
        &first,
        "--drain-timeout",
        "0",
    ];
    args.extend(common);
    let server = Server::start(Some(&data), &args);
    let mut c = Client::connect(&server.addr);
    let ids = |s: usize| (0..10).map(move |i| format!("s{s}-{i}"));
    for i in 0..10 {
        for s in 0..4 {
            c.message(&format!("s{s}-{i}"), &format!("chat{s}"));
        }
    }
    let mut acked = HashSet::new();
    while acked.len() < 40 {
        let v = c.next();
        assert_eq!(v["op"], "ack", "{v}");
        acked.insert(v["id"].as_str().unwrap().to_owned());
    }
    let mut running = HashSet::new();
    while running.len() < 4 {
        running.insert(started.recv_timeout(WAIT).expect("a turn started"));
    }
    let expected_running: HashSet<String> = (0..4).map(|s| format!("s{s}-0")).collect();
    assert_eq!(running, expected_running);
    let status = server.terminate();
    assert!(status.success(), "graceful stop: {status}");
    // The connection ends without an answer for any of them.
    while let Some(v) = c.next_line() {
        assert!(!terminal(&v), "answered during the shutdown: {v}");
    }

    let second = replying_agent(&log);
    let mut args = vec!["--agent", "exec", "--agent-cmd", &second];
    args.extend(common);
    let server = Server::start(Some(&data), &args);
    let mut c = Client::connect(&server.addr);
    let mut outcomes: HashMap<String, Value> = HashMap::new();
    let mut order: HashMap<String, Vec<String>> = HashMap::new();
    while outcomes.len() < 40 {
        let v = c.next();
        assert!(terminal(&v), "{v}");
        let id = v["id"].as_str().unwrap().to_owned();
        c.send(&json!({"op": "delivered", "ids": [id]}));
        order
            .entry(v["session"].as_str().unwrap().to_owned())
            .or_default()
            .push(id.clone());
        assert!(
            outcomes.insert(id.clone(), v).is_none(),
            "{id} answered twice"
        );
    }
    for (id, v) in &outcomes {
        if expected_running.contains(id) {
            assert_eq!(v["op"], "failed", "{v}");
            assert_eq!(v["error"], "interrupted by restart", "{v}");
        } else {
            assert_eq!(v["op"], "reply", "{v}");
            assert_eq!(v["text"], *id, "{v}");
        }
    }
    for s in 0..4 {
        let queued: Vec<String> = ids(s).skip(1).collect();
        let got: Vec<String> = order[&format!("tg:dm:chat{s}")]
            .iter()
            .filter(|id| !expected_running.contains(*id))
            .cloned()
            .collect();
        assert_eq!(got, queued, "session {s} ran out of order");
    }
    let runs = runs(&log);
    for id in (0..4).flat_map(ids) {
        assert_eq!(
            runs.get(&id),
            Some(&1),
            "{id} ran {:?} times",
            runs.get(&id)
        );
    }
    assert_eq!(runs.len(), 40);
    // Every confirmation is read before the stop: the pong comes after them.
    c.send(&json!({"op": "ping"}));
    assert_eq!(c.next()["op"], "pong");
    assert!(server.terminate().success());
    let left = SqliteStore::open(&data).unwrap().load(0).unwrap();
    assert!(left.messages.is_empty(), "{} left", left.messages.len());
}

/// With `--resume-interrupted`, a turn cut off by the drain runs again at the next start
/// (its side effect happens twice: that is what the flag asks for), and the message queued
/// behind it runs once.
#[test]
fn a_turn_cut_by_the_drain_is_resumed_with_resume_interrupted() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let log = dir.path().join("side-effects.log");
    let fifo = dir.path().join("started");
    let started = starts(&fifo);
    let first = hanging_agent(&log, &fifo);
    let server = Server::start(
        Some(&data),
        &[
            "--agent",
            "exec",
            "--agent-cmd",
            &first,
            "--drain-timeout",
            "0",
        ],
    );
    let mut c = Client::connect(&server.addr);
    c.message("m1", "1");
    assert_eq!(c.next()["state"], "running");
    c.message("m2", "1");
    assert_eq!(c.next()["state"], "queued");
    assert_eq!(started.recv_timeout(WAIT).expect("m1 started"), "m1");
    assert!(server.terminate().success());
    while let Some(v) = c.next_line() {
        assert!(!terminal(&v), "answered during the shutdown: {v}");
    }

    let second = replying_agent(&log);
    let server = Server::start(
        Some(&data),
        &[
            "--agent",
            "exec",
            "--agent-cmd",
            &second,
            "--resume-interrupted",
        ],
    );
    let mut c = Client::connect(&server.addr);
    for id in ["m1", "m2"] {
        let v = c.next();
        assert_eq!(
            (v["op"].as_str(), v["id"].as_str()),
            (Some("reply"), Some(id)),
            "{v}"
        );
        c.send(&json!({"op": "delivered", "ids": [id]}));
    }
    let runs = runs(&log);
    assert_eq!((runs["m1"], runs["m2"]), (2, 1));
    assert!(server.terminate().success());
}

/// Without `--data-dir` nothing survives the process, so SIGTERM still answers the queued
/// messages and the cut-off turn `cancelled: shutdown`.
#[test]
fn without_a_data_dir_sigterm_still_cancels_the_queue() {
    let server = Server::start(
        None,
        &[
            "--agent",
            "exec",
            "--agent-cmd",
            "sleep 600",
            "--drain-timeout",
            "0",
        ],
    );
    let mut c = Client::connect(&server.addr);
    c.message("m1", "1");
    assert_eq!(c.next()["state"], "running");
    c.message("m2", "1");
    assert_eq!(c.next()["state"], "queued");
    server.signal_term();
    let mut cancelled = HashSet::new();
    while cancelled.len() < 2 {
        let v = c.next();
        assert_eq!(
            (v["op"].as_str(), v["reason"].as_str()),
            (Some("cancelled"), Some("shutdown")),
            "{v}"
        );
        cancelled.insert(v["id"].as_str().unwrap().to_owned());
    }
    assert!(server.wait().success());
}

/// A second gateway on the same data directory exits 2 naming the first one's pid — before
/// it binds: it is given the first one's own address, which would fail with "address in
/// use" if it bound first. `--check-config` says the same. The first keeps serving.
#[test]
fn a_second_gateway_on_the_same_data_dir_exits_2_before_binding() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let first = Server::start(Some(&data), &[]);
    for check in [false, true] {
        let mut cmd = binary();
        cmd.args(["serve", "--listen", &first.addr, "--http-listen", "off"])
            .arg("--data-dir")
            .arg(&data);
        if check {
            cmd.arg("--check-config");
        }
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "check {check}: {err}");
        assert!(
            err.contains("turnstile.lock") && err.contains(&format!("pid {}", first.pid())),
            "check {check}: {err}"
        );
        assert!(
            !err.contains("in use") && !err.contains("database is locked"),
            "{err}"
        );
        assert!(out.stdout.is_empty(), "check {check}: it went on");
    }
    let mut c = Client::connect(&first.addr);
    c.send(&json!({"op": "ping"}));
    assert_eq!(c.next()["op"], "pong");
    assert!(first.terminate().success());
    // The lock went with its holder: the directory serves again.
    let again = Server::start(Some(&data), &[]);
    assert!(again.terminate().success());
}

fn check_config(args: &[&str], data: Option<&Path>) -> (Option<i32>, String) {
    let mut cmd = binary();
    cmd.args(["serve", "--check-config", "--http-listen", "off"])
        .args(args)
        .env_remove("OPENAI_API_KEY");
    if let Some(d) = data {
        cmd.arg("--data-dir").arg(d);
    }
    let out = cmd.output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    (out.status.code(), text)
}

/// `--check-config` fails (2) wherever `serve` would refuse to start: a data directory that
/// is not a directory, a damaged journal, a base URL that does not parse, a missing model.
#[test]
fn check_config_runs_the_checks_serve_runs() {
    let dir = tempfile::tempdir().unwrap();
    let (code, out) = check_config(&[], Some(&dir.path().join("fresh")));
    assert_eq!((code, out.trim()), (Some(0), "configuration ok"));

    let file = dir.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    let (code, out) = check_config(&[], Some(&file));
    assert_eq!(code, Some(2), "{out}");
    assert!(out.contains("--data-dir"), "{out}");

    let damaged = dir.path().join("damaged");
    std::fs::create_dir_all(&damaged).unwrap();
    std::fs::write(damaged.join("journal.sqlite3"), vec![0x5a; 8192]).unwrap();
    let (code, out) = check_config(&[], Some(&damaged));
    assert_eq!(code, Some(2), "{out}");
    assert!(out.contains("journal"), "{out}");

    let openai = ["--agent", "openai", "--model", "m", "--openai-base-url"];
    let (code, out) = check_config(&[&openai[..], &["ftp://example.com/v1"]].concat(), None);
    assert_eq!(code, Some(2), "{out}");
    assert!(out.contains("base URL"), "{out}");
    let (code, out) = check_config(&[&openai[..], &["http://[::1/v1"]].concat(), None);
    assert_eq!(code, Some(2), "{out}");
    let (code, out) = check_config(
        &[
            "--agent",
            "openai",
            "--openai-base-url",
            "http://127.0.0.1:9/v1",
        ],
        None,
    );
    assert_eq!(code, Some(2), "{out}");
    assert!(out.contains("--model"), "{out}");
}

/// A tmpfs mounted for one test, unmounted when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(path: PathBuf, options: &str) -> Option<Tmpfs> {
        std::fs::create_dir_all(&path).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", options, "tmpfs"])
            .arg(&path)
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            // CI runs as root (it installs packages), where a skip would hide a regression.
            assert!(
                std::env::var("TURNSTILE_REQUIRE_REAL_SERVERS").as_deref() != Ok("1"),
                "cannot mount a tmpfs, and TURNSTILE_REQUIRE_REAL_SERVERS=1 (run as root)"
            );
            eprintln!("cannot mount a tmpfs (not root?): skipping this test");
        }
        ok.then_some(Tmpfs(path))
    }

    /// Fills it: a file grows until the disk is full.
    fn fill(&self) {
        let mut f = std::fs::File::create(self.0.join("filler")).unwrap();
        let chunk = vec![0u8; 64 << 10];
        while f.write_all(&chunk).is_ok() {}
        let _ = f.write_all(&[0]);
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// A read-only data directory is a configuration error (2), for `--check-config` and for
/// `serve` alike (root writes anywhere else, so a read-only mount it is).
#[test]
fn an_unwritable_data_dir_fails_check_config_with_2() {
    let dir = tempfile::tempdir().unwrap();
    let Some(ro) = Tmpfs::mount(dir.path().join("ro"), "size=1m,ro") else {
        return;
    };
    for check in [true, false] {
        let mut cmd = binary();
        cmd.args(["serve", "--listen", "127.0.0.1:0", "--http-listen", "off"])
            .arg("--data-dir")
            .arg(ro.0.join("data"));
        if check {
            cmd.arg("--check-config");
        }
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "check {check}: {err}");
        assert!(err.contains("Read-only file system"), "{err}");
        assert!(out.stdout.is_empty());
    }
}

/// A full disk at start-up may pass: `serve` and `--check-config` exit 1 (the unit restarts
/// on 1), before listening, naming the directory.
#[test]
fn a_full_disk_at_start_up_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let Some(fs) = Tmpfs::mount(dir.path().join("full"), "size=1m") else {
        return;
    };
    fs.fill();
    for check in [true, false] {
        let mut cmd = binary();
        cmd.args(["serve", "--listen", "127.0.0.1:0", "--http-listen", "off"])
            .arg("--data-dir")
            .arg(fs.0.join("data"));
        if check {
            cmd.arg("--check-config");
        }
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "check {check}: {err}");
        assert!(err.contains("--data-dir"), "{err}");
        assert!(out.stdout.is_empty());
    }
}

/// The disk fills while a turn runs: its reply's outcome record cannot be written, not even
/// into the reserve the journal releases on a full disk, so SIGTERM's journal flush cannot
/// finish and the process exits 1, not 0 — and the reply, having no record, is never sent.
/// The fault is a real full tmpfs under the data directory.
#[test]
fn a_shutdown_whose_journal_cannot_finish_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let Some(fs) = Tmpfs::mount(dir.path().join("disk"), "size=8m") else {
        return;
    };
    let gate = dir.path().join("gate");
    mkfifo(&gate);
    let done = starts(&dir.path().join("done"));
    let agent = format!(
        "cat '{}'; echo done > '{}'",
        gate.display(),
        dir.path().join("done").display()
    );
    let server = Server::start(
        Some(&fs.0.join("data")),
        &[
            "--agent",
            "exec",
            "--agent-cmd",
            &agent,
            "--max-reply-bytes",
            "4MiB",
        ],
    );
    let mut c = Client::connect(&server.addr);
    c.message("m1", "1");
    assert_eq!(c.next()["state"], "running");
    fs.fill();
    // A reply larger than the journal's files hold now and than the 1 MiB reserve: its
    // record cannot be written.
    let mut w = std::fs::OpenOptions::new().write(true).open(&gate).unwrap();
    w.write_all(&vec![b'x'; 3 << 20]).unwrap();
    drop(w);
    // The agent has its reply out; SIGTERM's drain waits for the turn to end either way.
    assert_eq!(done.recv_timeout(WAIT).as_deref(), Ok("done"));
    let status = server.terminate();
    assert_eq!(status.code(), Some(1), "{status}");
    while let Some(v) = c.next_line() {
        assert_ne!(v["op"], "reply", "a result was sent before its record: {v}");
    }
}
