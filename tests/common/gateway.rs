//! A `turnstile serve` process seen from outside: the address its first line names, and the
//! status file its heartbeat rewrites.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use super::{eventually, holds};

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
