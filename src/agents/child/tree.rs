//! Walking a leader's process tree through /proc, each process named by a pidfd checked to be
//! the child of the one it was found under, and killing it round after round.

use std::collections::HashSet;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use super::registry::Leader;
use super::sys::{has_exited, pidfd_open, wait_exited};

/// How long one kill round waits for the processes it signalled to exit.
pub(super) const ROUND_WAIT: Duration = Duration::from_secs(1);
/// Kill rounds before giving up on a tree that keeps growing.
pub(super) const KILL_ROUNDS: usize = 32;
/// Time all kill rounds of one kill may take; what is still alive after it is left to later
/// sweeps. With [`LEADER_WAIT`], a kill takes at most [`super::KILL_MAX`].
pub(super) const KILL_BUDGET: Duration = Duration::from_secs(3);
/// How long a killed leader may take to exit before it is left to a later sweep.
pub(super) const LEADER_WAIT: Duration = Duration::from_secs(2);

/// The fields of `/proc/<pid>/stat` that matter here.
#[derive(Clone, Copy, Debug)]
pub(super) struct Stat {
    pub(super) ppid: i32,
    pub(super) pgrp: i32,
    pub(super) session: i32,
}

/// The parent, process group and session of `pid`, if it exists.
pub(super) fn stat_of(pid: i32) -> Option<Stat> {
    let text = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ppid pgrp session …": comm may hold anything, so split after the last ')'.
    let close = text.iter().rposition(|&b| b == b')')?;
    let rest = std::str::from_utf8(text.get(close + 1..)?).ok()?;
    let mut it = rest.split_ascii_whitespace().skip(1); // the state
    let ppid = it.next()?.parse().ok()?;
    let pgrp = it.next()?.parse().ok()?;
    let session = it.next()?.parse().ok()?;
    Some(Stat {
        ppid,
        pgrp,
        session,
    })
}

/// The children of every thread of `pid`.
pub(super) fn children_of(pid: &str) -> Vec<i32> {
    let mut out = Vec::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for task in tasks.flatten() {
        let mut path = task.path();
        path.push("children");
        if let Ok(text) = std::fs::read_to_string(&path) {
            out.extend(
                text.split_ascii_whitespace()
                    .filter_map(|p| p.parse::<i32>().ok()),
            );
        }
    }
    out
}

/// A process found in a tree, with the pidfd that names it safely.
pub(super) struct Proc {
    pub(super) pid: i32,
    pub(super) fd: OwnedFd,
}

/// Opens `pid` if it is, right now, a live child of `parent`. The order matters: the pidfd is
/// opened first, then the parent checked, then liveness (a zombie's pidfd is readable too); a
/// live process keeps its pid, so the check read the process the pidfd names.
pub(super) fn open_child(pid: i32, parent: i32) -> Option<Proc> {
    let fd = pidfd_open(pid).ok()?;
    let stat = stat_of(pid)?;
    if stat.ppid != parent || has_exited(fd.as_fd()) {
        return None;
    }
    Some(Proc { pid, fd })
}

/// Every live process below `root` (breadth first), each verified as the child of the one it
/// was found under. The caller guarantees `root` cannot be reaped meanwhile.
pub(super) fn live_descendants(root: i32) -> Vec<Proc> {
    let mut out: Vec<Proc> = Vec::new();
    let mut seen = HashSet::new();
    let mut queue = vec![root];
    while let Some(parent) = queue.pop() {
        for pid in children_of(&parent.to_string()) {
            if !seen.insert(pid) {
                continue;
            }
            if let Some(p) = open_child(pid, parent) {
                queue.push(p.pid);
                out.push(p);
            }
        }
    }
    out
}

/// Kills every process below `leader`, round after round until none is left (or
/// [`KILL_ROUNDS`] or [`KILL_BUDGET`] run out); returns the processes killed, now the leader's
/// to reap (or ours, once it dies), and whether the tree was seen empty.
pub(super) fn kill_descendants(leader: &Leader) -> (Vec<Proc>, bool) {
    let mut killed: Vec<Proc> = Vec::new();
    let mut clean = false;
    let deadline = Instant::now() + KILL_BUDGET;
    for _ in 0..KILL_ROUNDS {
        let procs = leader.signal_tree(libc::SIGKILL);
        if procs.is_empty() {
            clean = true;
            break;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let fds: Vec<BorrowedFd<'_>> = procs.iter().map(|p| p.fd.as_fd()).collect();
        wait_exited(&fds, ROUND_WAIT.min(left));
        killed.extend(procs);
        if left.is_zero() {
            break;
        }
    }
    (killed, clean)
}
