//! A `turnstile serve` process seen from outside: the address its first line names, and the
//! status file its heartbeat rewrites.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Child;
use std::time::Duration;

use serde_json::Value;

use super::eventually;

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
    eventually(what, within, || {
        let left = spool_files(dir);
        if left.is_empty() { Ok(()) } else { Err(left) }
    });
}
