//! A `turnstile serve` process seen from outside: the addresses its first lines name, its
//! log lines, and the status file its heartbeat rewrites.

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use super::{eventually, holds};

/// Only a failing run waits this long for a log line.
const WAIT: Duration = Duration::from_secs(60);

/// A `turnstile serve` process with a status file, killed with SIGKILL when dropped.
pub struct Gateway {
    pub child: Child,
    /// The address its listening line named.
    pub addr: String,
    /// The status file its heartbeat rewrites.
    pub status: PathBuf,
}

impl Gateway {
    /// Starts `command` (a `turnstile serve` listening on 127.0.0.1:0) with its status file
    /// at `status`, nothing of the test's environment's secrets, stderr silenced; reads its
    /// listening line.
    pub fn spawn(command: &mut Command, status: &Path) -> Gateway {
        let mut child = command
            .arg("--status-file")
            .arg(status)
            .env_remove("OPENAI_API_KEY")
            .env_remove("TURNSTILE_AUTH_TOKEN")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start turnstile serve");
        let addr = listening_addr(&mut child);
        Gateway {
            child,
            addr,
            status: status.to_owned(),
        }
    }

    /// Sends `text` with `turnstile send` and returns the reply.
    pub fn send(&self, text: &str) -> String {
        self.send_args(&[text])
    }

    /// Sends `text` in the chat `chat` (another session than `send`'s).
    pub fn send_in(&self, chat: &str, text: &str) -> String {
        self.send_args(&["--chat", chat, text])
    }

    fn send_args(&self, args: &[&str]) -> String {
        let out = Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args(["send", "--addr", &self.addr, "--timeout", "60s"])
            .args(args)
            .output()
            .expect("run turnstile send");
        assert!(out.status.success(), "send {args:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// Polls the status file (rewritten by the heartbeat) until `pred` holds.
    #[track_caller]
    pub fn wait_status(&self, what: &str, within: Duration, pred: impl Fn(&Value) -> bool) {
        wait_status(&self.status, what, within, |s| pred(s).then_some(()));
    }

    /// SIGKILL, then reaped.
    pub fn kill_9(mut self) {
        // SAFETY: plain kill(2) on our own child's pid.
        let rc = unsafe { libc::kill(self.child.id() as i32, libc::SIGKILL) };
        assert_eq!(rc, 0);
        let _ = self.child.wait();
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The address of `serve`'s first line, `listening on <ip>:<port>` (its stdout piped).
pub fn listening_addr(child: &mut Child) -> String {
    let mut first = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut first)
        .expect("first line");
    first
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("no listening line: {first:?}"))
        .to_owned()
}

/// The status file as it is now (`None` before the heartbeat first wrote it whole).
pub fn read_status(path: &Path) -> Option<Value> {
    std::fs::read(path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
}

/// Polls the status file (rewritten by the heartbeat, on its own clock) until `pick` finds
/// what it wants in it, within `within`; returns what it picked.
#[track_caller]
pub fn wait_status<T>(
    path: &Path,
    what: &str,
    within: Duration,
    mut pick: impl FnMut(&Value) -> Option<T>,
) -> T {
    eventually(what, within, || {
        let status = read_status(path);
        status.as_ref().and_then(&mut pick).ok_or(status)
    })
}

/// The first value under `key`, anywhere in `v` (a status section's figures, wherever the
/// section sits).
pub fn find<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    match v {
        Value::Object(m) => m.get(key).or_else(|| m.values().find_map(|x| find(x, key))),
        Value::Array(a) => a.iter().find_map(|x| find(x, key)),
        _ => None,
    }
}

/// The names of the regular files in the attachments spool `dir`, sorted (the outboxes'
/// directories aside).
pub fn spool_files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("spool")
        .filter_map(Result::ok)
        .filter(|e| e.path().is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Waits until the spool `dir` holds no regular file: the gateway's janitor deletes a
/// message's files on a thread of its own, in another process.
#[track_caller]
pub fn spool_empties(dir: &Path, what: &str, within: Duration) {
    eventually(what, within, || holds(spool_files(dir), Vec::is_empty));
}

/// A `turnstile serve` process that dies with the test, killed (SIGKILL) and reaped when
/// dropped: the addresses its first lines name.
pub struct Serve {
    pub child: Child,
    /// The address its listening line named.
    pub addr: String,
    /// The address its `http on` line named, when it has an HTTP endpoint.
    http: Option<String>,
    /// Its log lines, when started with [`Serve::spawn_logged`].
    log: Option<LogLines>,
}

impl Serve {
    /// `turnstile serve` listening on 127.0.0.1:0, its HTTP endpoint on `http` (`off`, or
    /// `127.0.0.1:0` for one that [`Serve::http`] names): the caller adds the rest.
    pub fn local_command(http: &str) -> Command {
        let mut command = Command::new(env!("CARGO_BIN_EXE_turnstile"));
        command
            .arg("serve")
            .args(["--listen", "127.0.0.1:0", "--http-listen", http]);
        command
    }

    /// Starts `command` (dying with the test, its stdout piped) and reads its listening
    /// line, and its `http on` line when the command gives it an HTTP endpoint.
    pub fn spawn(command: &mut Command) -> Serve {
        let has_http = command
            .get_args()
            .collect::<Vec<_>>()
            .windows(2)
            .any(|w| w[0] == "--http-listen" && w[1] != "off");
        let mut child = die_with_parent(command.stdout(Stdio::piped()))
            .spawn()
            .expect("start turnstile serve");
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let addr = read_named_line(&mut out, "listening on ");
        let http = has_http.then(|| read_named_line(&mut out, "http on "));
        Serve {
            child,
            addr,
            http,
            log: None,
        }
    }

    /// As [`Serve::spawn`], its log (stderr) read line by line: [`Serve::log`].
    pub fn spawn_logged(command: &mut Command) -> Serve {
        let mut serve = Serve::spawn(command.stderr(Stdio::piped()));
        let stderr = serve.child.stderr.take().expect("stderr piped");
        serve.log = Some(LogLines::read(stderr));
        serve
    }

    /// The address of its HTTP endpoint (panics for a process started without one).
    pub fn http(&self) -> &str {
        self.http.as_deref().expect("started with an HTTP endpoint")
    }

    /// Its log lines (panics for a process not started with [`Serve::spawn_logged`]).
    pub fn log(&self) -> &LogLines {
        self.log.as_ref().expect("started with spawn_logged")
    }

    /// Its log lines, taken (to read to their end: [`LogLines::rest`]).
    pub fn take_log(&mut self) -> Option<LogLines> {
        self.log.take()
    }

    /// Sends `sig` to the process (SIGSTOP, SIGCONT, SIGTERM).
    pub fn signal(&self, sig: libc::c_int) {
        let pid = libc::pid_t::try_from(self.child.id()).expect("pid");
        // SAFETY: kill(2) on our own child's pid.
        assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill({pid}, {sig})");
    }

    /// kill -9, and reaped.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A process's log lines, read on a thread of their own.
pub struct LogLines(crossbeam_channel::Receiver<String>);

impl LogLines {
    /// Reads `stderr` on a thread of its own, each line also copied to this test's stderr.
    fn read(stderr: std::process::ChildStderr) -> LogLines {
        // Bounded by the child's stderr: the gateway rate-limits its WARN/ERROR lines, the
        // child lives no longer than the test, and its lines are taken as the test reads them.
        let (tx, log) = crossbeam_channel::unbounded();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                eprintln!("{line}");
                let _ = tx.send(line);
            }
        });
        LogLines(log)
    }

    /// Blocks until a line contains `needle` (lines before it are passed over); that line.
    #[track_caller]
    pub fn wait_for(&self, needle: &str) -> String {
        self.until(&[needle]).0
    }

    /// Blocks until a line contains every one of `needles`: that line, and the lines passed
    /// over on the way.
    #[track_caller]
    pub fn until(&self, needles: &[&str]) -> (String, Vec<String>) {
        let mut seen = Vec::new();
        loop {
            match self.0.recv_timeout(WAIT) {
                Ok(line) if needles.iter().all(|n| line.contains(n)) => return (line, seen),
                Ok(line) => seen.push(line),
                Err(e) => panic!("no log line with {needles:?}: {e}; saw {seen:#?}"),
            }
        }
    }

    /// The lines read and not yet taken, without waiting.
    pub fn taken_now(&self) -> Vec<String> {
        self.0.try_iter().collect()
    }

    /// Every line not yet taken, to the end of the log (the process exited: its stderr
    /// closed).
    pub fn rest(self) -> Vec<String> {
        self.0.iter().collect()
    }
}

/// The rest of the next line of `out` after `prefix` (`listening on `, `http on `).
fn read_named_line(out: &mut impl BufRead, prefix: &str) -> String {
    let mut line = String::new();
    out.read_line(&mut line)
        .expect("read a line of serve's stdout");
    line.trim()
        .strip_prefix(prefix)
        .unwrap_or_else(|| panic!("a line {prefix:?}…, got {line:?}"))
        .to_owned()
}

impl Drop for Serve {
    fn drop(&mut self) {
        // A stopped process must be continued to die of SIGTERM; SIGKILL needs nothing.
        self.kill9();
    }
}

/// The `turnstile` binary, as a command that dies with the test thread that runs it.
pub fn turnstile() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_turnstile"));
    die_with_parent(&mut command);
    command
}

include!("die_with_parent.rs");
