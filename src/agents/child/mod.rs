//! Containment of agent processes, shared by the exec and the process agent.
//!
//! Every agent command runs under a **leader**: a `/bin/sh` wrapper that the gateway forks
//! itself (not through `std::process`) with
//! - a clean environment: only an allow-list ([`AgentEnv`]), never the gateway's secrets;
//! - its own process group, and the **child-subreaper** attribute (`PR_SET_CHILD_SUBREAPER`,
//!   which survives `exec`): whatever the command starts, even after `setsid` or a double
//!   fork, is re-parented to the leader rather than to init, so it stays in the leader's tree;
//! - stdin, stdout and stderr on pipes, and fd 3 on a private status pipe.
//!
//! The wrapper runs the command as its child (`/bin/sh -c CMD`), writes the command's exit
//! status on fd 3, closes its pipes and idles (`exec sleep`). The gateway decides what happens
//! to the tree: [`ContainedChild::kill`] walks it and kills every process in it, then the
//! leader, then reaps.
//!
//! Two rules keep a recycled pid from ever being hit:
//! - the gateway never signals a process group, and never reaps with `waitpid(-1)`;
//! - the leader is the gateway's own child and stays unreaped until its tree is dead, so its
//!   pid cannot be reused while the tree is walked; every other process is signalled through
//!   a pidfd, opened first and then checked to still be the child of a process of the tree.
//!
//! The gateway binary also makes itself a child subreaper ([`become_subreaper`]): if an agent
//! kills its own leader, what the leader held is re-parented to the gateway instead of init,
//! and [`sweep_strays`] kills and reaps it. [`kill_all`] is for forced-exit paths.
//!
//! Linux only (pidfds: Linux 5.4 or later; `/proc/<pid>/task/<tid>/children`).

use std::collections::{HashMap, HashSet};
use std::ffi::CString;
use std::fmt;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock};
use std::thread;
use std::time::{Duration, Instant};

use crate::message::SessionKey;

/// The leader: runs the command as its child with fd 3 closed, reports its status on fd 3,
/// then idles holding nothing, so that the command's leftovers stay in its tree until the
/// gateway kills it. `$1` is the command.
const WRAPPER: &str = "/bin/sh -c \"$1\" 3>&-; echo $? >&3; exec 0</dev/null 1>/dev/null 2>&1 3>&-; exec sleep 2147483647";

/// `PATH` given to agents when the gateway has none.
const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// How long one kill round waits for the processes it signalled to exit.
const ROUND_WAIT: Duration = Duration::from_secs(1);
/// Kill rounds before giving up on a tree that keeps growing.
const KILL_ROUNDS: usize = 32;
/// Time all kill rounds of one kill may take; what is still alive after it is left to later
/// sweeps. With [`LEADER_WAIT`], a kill takes at most [`KILL_MAX`].
const KILL_BUDGET: Duration = Duration::from_secs(3);
/// How long a killed leader may take to exit before it is left to a later sweep.
const LEADER_WAIT: Duration = Duration::from_secs(2);
/// The longest [`ContainedChild::kill`] (and [`kill_all`]) waits.
pub(crate) const KILL_MAX: Duration = Duration::from_secs(5);
/// Bytes read from one pipe per call, so one flooding pipe cannot starve the rest of a poll
/// loop (or the cancel check).
pub(crate) const READ_BUDGET: usize = 1 << 20;
/// Longest stderr line logged; the rest of the line is dropped.
const STDERR_LINE_MAX: usize = 512;
/// stderr lines logged at once per agent stream, then this many per second.
const STDERR_BURST: f64 = 50.0;
const STDERR_PER_SEC: f64 = 10.0;

// ---- environment ------------------------------------------------------------------------

/// The environment of agent processes: `PATH` (a default if the gateway has none), `HOME`
/// and `LANG` if set, the names listed with `--agent-env`, and the `TURNSTILE_*` turn
/// variables the agent adds. Nothing else of the gateway's environment is passed on: not
/// `TURNSTILE_AUTH_TOKEN`, not a provider key the operator forgot about.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AgentEnv {
    pass: Vec<String>,
}

impl AgentEnv {
    /// An allow-list passing `names` through from the gateway's environment as well. Names
    /// starting with `TURNSTILE_` are refused: that prefix is the gateway's own (its auth token,
    /// and the turn variables it sets itself).
    pub fn new<I, S>(names: I) -> Result<AgentEnv, String>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut pass = Vec::new();
        for name in names {
            let name = name.into();
            if name.is_empty() || name.contains('=') || name.contains('\0') {
                return Err(format!("--agent-env {name:?}: not a variable name"));
            }
            if name.starts_with("TURNSTILE_") {
                return Err(format!(
                    "--agent-env {name}: TURNSTILE_* variables are the gateway's own and never passed to agents"
                ));
            }
            if !pass.contains(&name) {
                pass.push(name);
            }
        }
        Ok(AgentEnv { pass })
    }

    /// The full environment of one agent process: the allow-list read now, then `vars`.
    pub fn build(&self, vars: &[(&str, &str)]) -> Vec<(String, String)> {
        let mut env = Vec::new();
        let path = std::env::var("PATH").unwrap_or_else(|_| DEFAULT_PATH.to_owned());
        env.push(("PATH".to_owned(), path));
        for name in ["HOME", "LANG"]
            .into_iter()
            .chain(self.pass.iter().map(String::as_str))
        {
            if let Ok(v) = std::env::var(name)
                && !env.iter().any(|(k, _)| k == name)
            {
                env.push((name.to_owned(), v));
            }
        }
        for (k, v) in vars {
            env.retain(|(name, _)| name != k);
            env.push(((*k).to_owned(), (*v).to_owned()));
        }
        env
    }
}

// ---- small fd helpers ------------------------------------------------------------------

fn cvt(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// A pipe, both ends close-on-exec: (read, write).
fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: pipe2 writes two fds into the array we own.
    cvt(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) })?;
    // SAFETY: both fds are fresh and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Makes reads and writes on `fd` return `WouldBlock` instead of waiting.
pub(crate) fn set_nonblocking(fd: BorrowedFd<'_>) -> io::Result<()> {
    let raw = fd.as_raw_fd();
    // SAFETY: fcntl on a valid fd we borrow; only the status flags change.
    unsafe {
        let flags = cvt(libc::fcntl(raw, libc::F_GETFL))?;
        cvt(libc::fcntl(raw, libc::F_SETFL, flags | libc::O_NONBLOCK))?;
    }
    Ok(())
}

/// `poll(2)` over `fds`, retried on EINTR; `None` waits for ever. Returns how many are ready.
pub(crate) fn poll(fds: &mut [libc::pollfd], timeout: Option<Duration>) -> io::Result<usize> {
    let deadline = timeout.map(|t| Instant::now() + t);
    loop {
        let ms = match deadline {
            None => -1,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                // Round up so a short wait does not become a busy loop of zero timeouts.
                left.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int
            }
        };
        // SAFETY: the pointer and length describe the slice we hold mutably.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if rc >= 0 {
            return Ok(rc as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// A `pollfd` waiting for input (or hang-up) on `fd`.
pub(crate) fn pollin(fd: RawFd) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }
}

/// Whether a polled fd has something for a reader: data, end of file or an error.
pub(crate) fn readable(p: &libc::pollfd) -> bool {
    p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0
}

/// An eventfd that a cancellation hook writes to and a poll loop waits on.
#[derive(Debug)]
pub(crate) struct Wake(OwnedFd);

impl Wake {
    /// A fresh, unsignalled wake.
    pub(crate) fn new() -> io::Result<Wake> {
        // SAFETY: eventfd returns a new fd or -1.
        let fd = cvt(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) })?;
        // SAFETY: the fd is fresh and ours.
        Ok(Wake(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Makes the fd readable. Never blocks (the counter would need 2^64 signals to fill).
    pub(crate) fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a local to our eventfd.
        unsafe {
            libc::write(self.0.as_raw_fd(), (&one as *const u64).cast(), 8);
        }
    }

    /// The fd to poll for input.
    pub(crate) fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

// ---- bounded readers --------------------------------------------------------------------

/// What one non-blocking read pass found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReadState {
    /// The pipe is empty for now.
    WouldBlock,
    /// Stopped before the pipe was empty (the budget was used, or a line is complete):
    /// read again without waiting.
    More,
    /// Every writer closed the pipe.
    Eof,
}

fn read_some(r: &mut File, budget: usize, mut sink: impl FnMut(&[u8])) -> io::Result<ReadState> {
    let mut chunk = [0u8; 64 * 1024];
    let mut done = 0;
    while done < budget {
        match r.read(&mut chunk) {
            Ok(0) => return Ok(ReadState::Eof),
            Ok(n) => {
                done += n;
                sink(&chunk[..n]);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(ReadState::WouldBlock),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(ReadState::More)
}

/// Grows `v` to hold `extra` more bytes without its capacity ever passing `cap` (plain
/// `extend` may double it past the bound).
fn reserve_within(v: &mut Vec<u8>, extra: usize, cap: usize) {
    let want = v.len() + extra;
    if want > v.capacity() {
        let target = want.max(v.len().saturating_mul(2)).min(cap.max(want));
        v.reserve_exact(target - v.len());
    }
}

/// An agent's output, kept up to a cap; the rest is read (so the writer never blocks) and
/// discarded, and counted.
#[derive(Debug)]
pub(crate) struct OutputBuf {
    data: Vec<u8>,
    cap: usize,
    total: u64,
}

impl OutputBuf {
    /// Keeps at most `cap` bytes.
    pub(crate) fn new(cap: usize) -> OutputBuf {
        OutputBuf {
            data: Vec::new(),
            cap,
            total: 0,
        }
    }

    /// Reads what `r` (non-blocking) has now, at most `budget` bytes.
    pub(crate) fn read_from(&mut self, r: &mut File, budget: usize) -> io::Result<ReadState> {
        let (data, cap, total) = (&mut self.data, self.cap, &mut self.total);
        read_some(r, budget, |bytes| {
            *total += bytes.len() as u64;
            let take = cap.saturating_sub(data.len()).min(bytes.len());
            reserve_within(data, take, cap);
            data.extend_from_slice(&bytes[..take]);
        })
    }

    /// The bytes kept.
    #[cfg(test)]
    pub(crate) fn kept(&self) -> &[u8] {
        &self.data
    }

    /// Bytes read in all, kept or not.
    #[cfg(test)]
    pub(crate) fn total(&self) -> u64 {
        self.total
    }

    /// Bytes of memory the buffer holds (its capacity): never more than the cap.
    #[cfg(test)]
    pub(crate) fn buffered(&self) -> usize {
        self.data.capacity()
    }

    /// Whether output was discarded.
    pub(crate) fn truncated(&self) -> bool {
        self.total > self.data.len() as u64
    }

    /// The kept bytes.
    pub(crate) fn into_vec(self) -> Vec<u8> {
        self.data
    }
}

/// Splits an agent's stdout into lines of at most `max` bytes; a longer line is an error,
/// reported once it passes the bound, never buffered past it.
#[derive(Debug)]
pub(crate) struct LineBuf {
    buf: Vec<u8>,
    start: usize,
    /// Where to look for the next newline (everything before it was searched).
    scan: usize,
    max: usize,
}

/// A line longer than the limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LineTooLong {
    /// The limit in bytes.
    pub max: usize,
}

impl LineBuf {
    /// Lines of at most `max` bytes (without the newline).
    pub(crate) fn new(max: usize) -> LineBuf {
        LineBuf {
            buf: Vec::new(),
            start: 0,
            scan: 0,
            max,
        }
    }

    fn pending(&self) -> usize {
        self.buf.len() - self.start
    }

    /// Reads what `r` (non-blocking) has now, at most `budget` bytes. Returns early (with
    /// [`ReadState::More`]) as soon as a line is complete, and stops reading once the
    /// unfinished line is past the limit, so the buffer stays within `max` plus one chunk.
    pub(crate) fn read_from(&mut self, r: &mut File, budget: usize) -> io::Result<ReadState> {
        if self.start > 0 && self.start * 2 >= self.buf.len() {
            self.buf.drain(..self.start);
            self.scan -= self.start;
            self.start = 0;
        }
        const CHUNK: usize = 64 * 1024;
        let mut done = 0;
        while done < budget && self.pending() <= self.max {
            reserve_within(&mut self.buf, CHUNK, self.max.saturating_add(2 * CHUNK));
            let len = self.buf.len();
            self.buf.resize(len + CHUNK, 0);
            let got = r.read(&mut self.buf[len..]);
            self.buf.truncate(len + *got.as_ref().unwrap_or(&0));
            match got {
                Ok(0) => return Ok(ReadState::Eof),
                Ok(n) => {
                    done += n;
                    if self.buf[len..].contains(&b'\n') {
                        return Ok(ReadState::More);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    return Ok(ReadState::WouldBlock);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(ReadState::More)
    }

    /// The next complete line (without its newline), if one is buffered.
    pub(crate) fn next_line(&mut self) -> Option<Result<Vec<u8>, LineTooLong>> {
        match self.buf[self.scan..].iter().position(|&b| b == b'\n') {
            Some(i) => {
                let end = self.scan + i;
                self.scan = end + 1;
                let line = &self.buf[self.start..end];
                if line.len() > self.max {
                    self.start = self.scan;
                    return Some(Err(LineTooLong { max: self.max }));
                }
                let line = line.to_vec();
                self.start = self.scan;
                Some(Ok(line))
            }
            None => {
                self.scan = self.buf.len();
                if self.pending() > self.max {
                    Some(Err(LineTooLong { max: self.max }))
                } else {
                    None
                }
            }
        }
    }

    /// Bytes of memory the buffer holds.
    #[cfg(test)]
    pub(crate) fn buffered(&self) -> usize {
        self.buf.capacity()
    }
}

/// Logs an agent's stderr at INFO with its session key, on a thread of its own until end of
/// file: lines cut to 512 bytes, at most 50 at once then 10 a second (what is dropped is
/// counted in the log). stderr never reaches the chat.
pub(crate) fn log_stderr(stderr: File, session: SessionKey) {
    let key = session.clone();
    let spawned = thread::Builder::new()
        .name("turnstile-agent-stderr".into())
        .spawn(move || StderrLog::new(session).run(stderr));
    if let Err(e) = spawned {
        log::error!(
            "session {key}: cannot start an agent stderr reader thread: {e}; its stderr is discarded"
        );
    }
}

struct StderrLog {
    session: SessionKey,
    line: Vec<u8>,
    /// The current line passed the length limit; the rest of it is skipped.
    cut: bool,
    tokens: f64,
    refilled: Instant,
    dropped: u64,
}

impl StderrLog {
    fn new(session: SessionKey) -> StderrLog {
        StderrLog {
            session,
            line: Vec::new(),
            cut: false,
            tokens: STDERR_BURST,
            refilled: Instant::now(),
            dropped: 0,
        }
    }

    fn run(mut self, mut stderr: File) {
        let mut chunk = [0u8; 8192];
        loop {
            match stderr.read(&mut chunk) {
                Ok(0) => break,
                Ok(n) => {
                    for &b in &chunk[..n] {
                        if b == b'\n' {
                            self.emit();
                        } else if self.line.len() < STDERR_LINE_MAX {
                            self.line.push(b);
                        } else {
                            self.cut = true;
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        if !self.line.is_empty() {
            self.emit();
        }
        if self.dropped > 0 {
            log::info!(
                "session {}: {} more agent stderr line(s) not logged (rate limit)",
                self.session,
                self.dropped
            );
        }
    }

    fn emit(&mut self) {
        let now = Instant::now();
        let elapsed = now.duration_since(self.refilled).as_secs_f64();
        self.tokens = (self.tokens + elapsed * STDERR_PER_SEC).min(STDERR_BURST);
        self.refilled = now;
        if self.tokens < 1.0 {
            self.dropped += 1;
        } else {
            self.tokens -= 1.0;
            if self.dropped > 0 {
                log::info!(
                    "session {}: {} agent stderr line(s) not logged (rate limit)",
                    self.session,
                    self.dropped
                );
                self.dropped = 0;
            }
            let text = String::from_utf8_lossy(&self.line);
            let more = if self.cut { " …" } else { "" };
            log::info!("session {}: agent stderr: {text}{more}", self.session);
        }
        self.line.clear();
        self.cut = false;
    }
}

// ---- /proc and pidfds -------------------------------------------------------------------

/// The fields of `/proc/<pid>/stat` that matter here.
#[derive(Clone, Copy, Debug)]
struct Stat {
    ppid: i32,
    pgrp: i32,
    session: i32,
}

fn stat_of(pid: i32) -> Option<Stat> {
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
fn children_of(pid: &str) -> Vec<i32> {
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

fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open(2) takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Signals the process a pidfd refers to; a process that is gone (even if its pid was reused
/// since) is never hit: the call fails with ESRCH.
fn pidfd_signal(fd: BorrowedFd<'_>, sig: libc::c_int) -> io::Result<()> {
    // SAFETY: pidfd_send_signal(2) with a valid pidfd, no siginfo, no flags.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            sig,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Whether the process of a pidfd has exited (it may not be reaped yet).
fn has_exited(fd: BorrowedFd<'_>) -> bool {
    let mut p = [pollin(fd.as_raw_fd())];
    matches!(poll(&mut p, Some(Duration::ZERO)), Ok(n) if n > 0)
}

/// Waits until every process has exited or `timeout` passes; returns whether all did.
fn wait_exited(fds: &[BorrowedFd<'_>], timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    let mut left: Vec<libc::pollfd> = fds.iter().map(|f| pollin(f.as_raw_fd())).collect();
    while !left.is_empty() {
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        if poll(&mut left, Some(deadline - now)).is_err() {
            return false;
        }
        left.retain(|p| !readable(p));
        for p in &mut left {
            p.revents = 0;
        }
    }
    true
}

/// Reaps the process of a pidfd if it has exited and is our child. `Ok(true)`: reaped;
/// `Ok(false)`: still running; `Err`: not our child (someone else's to reap).
fn reap(fd: BorrowedFd<'_>) -> io::Result<bool> {
    // SAFETY: siginfo_t is plain data; waitid fills it in.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: waitid(P_PIDFD) on a valid pidfd with a siginfo we own.
        let rc = unsafe {
            libc::waitid(
                libc::P_PIDFD,
                fd.as_raw_fd() as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOHANG,
            )
        };
        if rc == 0 {
            // SAFETY: after a successful waitid the pid field is initialised (0: not exited).
            return Ok(unsafe { info.si_pid() } != 0);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// A process found in a tree, with the pidfd that names it safely.
struct Proc {
    pid: i32,
    fd: OwnedFd,
}

/// Opens `pid` if it is, right now, a live child of `parent`. The order matters: the pidfd is
/// opened first, then the parent checked, then liveness (a zombie's pidfd is readable too); a
/// live process keeps its pid, so the check read the process the pidfd names.
fn open_child(pid: i32, parent: i32) -> Option<Proc> {
    let fd = pidfd_open(pid).ok()?;
    let stat = stat_of(pid)?;
    if stat.ppid != parent || has_exited(fd.as_fd()) {
        return None;
    }
    Some(Proc { pid, fd })
}

/// Every live process below `root` (breadth first), each verified as the child of the one it
/// was found under. The caller guarantees `root` cannot be reaped meanwhile.
fn live_descendants(root: i32) -> Vec<Proc> {
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

// ---- the registry of leaders ------------------------------------------------------------

/// A leader: the gateway's own child, unreaped until its tree is dead.
#[derive(Debug)]
struct Leader {
    pid: i32,
    fd: OwnedFd,
    /// Held while the pid is used to walk the tree, and set once the leader is reaped: a walk
    /// never runs on a pid that could have been recycled.
    reaped: Mutex<bool>,
}

impl Leader {
    fn lock(&self) -> MutexGuard<'_, bool> {
        self.reaped.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Signals every live process of the tree, the leader excepted; returns them.
    fn signal_tree(&self, sig: libc::c_int) -> Vec<Proc> {
        let reaped = self.lock();
        if *reaped {
            return Vec::new();
        }
        let procs = live_descendants(self.pid);
        for p in &procs {
            let _ = pidfd_signal(p.fd.as_fd(), sig);
            if sig == libc::SIGTERM {
                // A stopped process would never act on the TERM.
                let _ = pidfd_signal(p.fd.as_fd(), libc::SIGCONT);
            }
        }
        procs
    }

    /// Reaps the leader if it has exited; true once reaped.
    fn try_reap(&self) -> bool {
        let mut reaped = self.lock();
        if !*reaped && !matches!(reap(self.fd.as_fd()), Ok(false)) {
            *reaped = true;
            registry().remove(&self.pid);
        }
        *reaped
    }
}

fn registry() -> MutexGuard<'static, HashMap<i32, Arc<Leader>>> {
    static LEADERS: OnceLock<Mutex<HashMap<i32, Arc<Leader>>>> = OnceLock::new();
    LEADERS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Held (shared) from fork until the new leader is registered, and (exclusive) by a sweep,
/// so that a sweep never mistakes a leader being born for a stray.
static SPAWNING: RwLock<()> = RwLock::new(());

/// Set by [`become_subreaper`].
static SUBREAPER: AtomicBool = AtomicBool::new(false);

/// Strays killed and not reaped yet, by pid.
fn strays() -> MutexGuard<'static, HashMap<i32, OwnedFd>> {
    static STRAYS: OnceLock<Mutex<HashMap<i32, OwnedFd>>> = OnceLock::new();
    STRAYS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Makes this process a child subreaper: an agent process whose leader died (killed from
/// inside the agent) is re-parented here instead of to init, where [`sweep_strays`] kills it.
///
/// The `turnstile` binary calls this when it runs exec or process agents. An embedding
/// program may call it too, with this consequence: any orphaned descendant of the program is
/// re-parented to it, and the sweep treats every child that is not an agent leader and is in
/// another process group or session than the program as an escaped agent process.
pub(crate) fn become_subreaper() -> io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    cvt(unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) })?;
    SUBREAPER.store(true, Ordering::SeqCst);
    Ok(())
}

/// Kills and reaps escaped agent processes: children of this (subreaper) process that are not
/// agent leaders and are in another process group or session than this process. They arrive
/// here only when an agent killed its own leader. Also reaps leaders that outlived their
/// kill. Does nothing unless [`become_subreaper`] was called. Returns how many were killed.
pub(crate) fn sweep_strays() -> usize {
    let mut killed = 0;
    let leaders: Vec<Arc<Leader>> = registry().values().cloned().collect();
    for l in &leaders {
        let _ = l.try_reap();
    }
    if SUBREAPER.load(Ordering::SeqCst) {
        let me = std::process::id() as i32;
        // SAFETY: getpgrp and getsid take no pointers.
        let (pgrp, sid) = unsafe { (libc::getpgrp(), libc::getsid(0)) };
        let found: Vec<Proc> = {
            let _sweep = SPAWNING.write().unwrap_or_else(|e| e.into_inner());
            let leaders = registry();
            children_of("self")
                .into_iter()
                .filter(|pid| !leaders.contains_key(pid))
                .filter_map(|pid| {
                    let fd = pidfd_open(pid).ok()?;
                    let st = stat_of(pid)?;
                    (st.ppid == me && (st.pgrp != pgrp || st.session != sid))
                        .then_some(Proc { pid, fd })
                })
                .collect()
        };
        let mut pending = strays();
        for p in found {
            if !has_exited(p.fd.as_fd()) {
                let _ = pidfd_signal(p.fd.as_fd(), libc::SIGKILL);
                killed += 1;
            }
            pending.entry(p.pid).or_insert(p.fd);
        }
        pending.retain(|_, fd| matches!(reap(fd.as_fd()), Ok(false)));
    }
    if killed > 0 {
        log::warn!(
            "killed {killed} escaped agent process(es) (session unknown: their leader had died)"
        );
    }
    killed
}

/// Kills every agent process this gateway started and everything they started, as far as it
/// can be found: each leader's tree (walked repeatedly until it stops changing, a second at
/// most per round), the leaders, then escaped processes ([`sweep_strays`]). Blocks for a few
/// seconds at most.
///
/// For forced-exit paths (a second signal, the shutdown watchdog): call it before
/// `std::process::exit`, or register it once with [`kill_all_at_exit`] (the `turnstile`
/// binary does). A graceful shutdown does not need it, since closing each agent kills its
/// processes; it is harmless there too.
pub(crate) fn kill_all() {
    let leaders: Vec<Arc<Leader>> = registry().values().cloned().collect();
    let deadline = Instant::now() + KILL_BUDGET;
    for _ in 0..KILL_ROUNDS {
        if Instant::now() >= deadline {
            break;
        }
        let signalled: Vec<Proc> = leaders
            .iter()
            .flat_map(|l| l.signal_tree(libc::SIGKILL))
            .collect();
        if signalled.is_empty() {
            break;
        }
        let fds: Vec<BorrowedFd<'_>> = signalled.iter().map(|p| p.fd.as_fd()).collect();
        wait_exited(
            &fds,
            ROUND_WAIT.min(deadline.saturating_duration_since(Instant::now())),
        );
    }
    for l in &leaders {
        if !*l.lock() {
            let _ = pidfd_signal(l.fd.as_fd(), libc::SIGKILL);
        }
    }
    let fds: Vec<BorrowedFd<'_>> = leaders.iter().map(|l| l.fd.as_fd()).collect();
    wait_exited(&fds, LEADER_WAIT);
    for _ in 0..4 {
        if sweep_strays() == 0 {
            break;
        }
    }
}

/// Runs [`kill_all`] when the process exits through `exit(3)`, which is what
/// `std::process::exit` calls: the forced-exit paths of an embedding program (a second
/// signal, a watchdog) then kill the agents without calling it themselves. Idempotent.
/// `_exit(2)`, a crash or SIGKILL bypass it.
pub(crate) fn kill_all_at_exit() {
    extern "C" fn at_exit() {
        // Unwinding out of an extern "C" function aborts; kill_all does not panic, but a
        // bug in it must not turn an orderly exit into an abort.
        let _ = std::panic::catch_unwind(kill_all);
    }
    static REGISTERED: std::sync::Once = std::sync::Once::new();
    REGISTERED.call_once(|| {
        // SAFETY: atexit with a function that lives as long as the program.
        if unsafe { libc::atexit(at_exit) } != 0 {
            log::warn!("cannot register kill_all at exit: forced exits may leave agent processes");
        }
    });
}

// ---- the contained child ----------------------------------------------------------------

/// How an agent command ended, as its leader reported it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Exit {
    /// It exited with this status.
    Code(i32),
    /// A signal killed it (the shell reports 128 + the signal number).
    Signal(i32),
    /// Its leader died before reporting: the agent killed it.
    Lost,
}

impl Exit {
    /// Exit status 0.
    pub(crate) fn success(self) -> bool {
        self == Exit::Code(0)
    }
}

impl fmt::Display for Exit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Exit::Code(c) => write!(f, "exit status {c}"),
            Exit::Signal(s) => write!(f, "killed by signal {s}"),
            Exit::Lost => f.write_str("exit status unknown (its supervising shell was killed)"),
        }
    }
}

/// One agent command under its leader. Dropping it kills the whole tree.
#[derive(Debug)]
pub(crate) struct ContainedChild {
    leader: Arc<Leader>,
    /// The command's stdin (blocking; make it non-blocking to write from a poll loop).
    pub stdin: Option<File>,
    /// The command's stdout.
    pub stdout: Option<File>,
    /// The command's stderr.
    pub stderr: Option<File>,
    status: Option<File>,
    status_line: Vec<u8>,
    exit: Option<Exit>,
}

/// Ends of the pipes as the new process sees them.
struct ChildFds {
    stdin: RawFd,
    stdout: RawFd,
    stderr: RawFd,
    status: RawFd,
    error: RawFd,
}

impl ContainedChild {
    /// Starts `command` under a new leader with exactly the environment `env`.
    pub(crate) fn spawn(command: &str, env: &[(String, String)]) -> io::Result<ContainedChild> {
        let invalid = |what: &str| io::Error::new(io::ErrorKind::InvalidInput, what.to_owned());
        // Everything that allocates is done before fork: the child may only make system calls.
        let argv: Vec<CString> = ["/bin/sh", "-c", WRAPPER, "turnstile-agent", command]
            .into_iter()
            .map(CString::new)
            .collect::<Result<_, _>>()
            .map_err(|_| invalid("the agent command contains a NUL byte"))?;
        let envp: Vec<CString> = env
            .iter()
            .map(|(k, v)| CString::new(format!("{k}={v}")))
            .collect::<Result<_, _>>()
            .map_err(|_| invalid("an agent environment value contains a NUL byte"))?;
        let mut argv_ptrs: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
        argv_ptrs.push(std::ptr::null());
        let mut envp_ptrs: Vec<*const libc::c_char> = envp.iter().map(|e| e.as_ptr()).collect();
        envp_ptrs.push(std::ptr::null());

        let (stdin_r, stdin_w) = pipe()?;
        let (stdout_r, stdout_w) = pipe()?;
        let (stderr_r, stderr_w) = pipe()?;
        let (status_r, status_w) = pipe()?;
        let (error_r, error_w) = pipe()?;
        let fds = ChildFds {
            stdin: stdin_r.as_raw_fd(),
            stdout: stdout_w.as_raw_fd(),
            stderr: stderr_w.as_raw_fd(),
            status: status_w.as_raw_fd(),
            error: error_w.as_raw_fd(),
        };

        sweep_strays();
        let spawning = SPAWNING.read().unwrap_or_else(|e| e.into_inner());
        // SAFETY: fork; the child runs only async-signal-safe system calls on data prepared
        // above and then execs or exits.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(io::Error::last_os_error());
        }
        if pid == 0 {
            // SAFETY: in the child of fork; never returns.
            unsafe { exec_leader(&fds, argv_ptrs.as_ptr(), envp_ptrs.as_ptr()) }
        }
        drop((stdin_r, stdout_w, stderr_w, status_w, error_w));
        // The child's copy of the error pipe closes at exec; a failed exec writes its errno.
        let mut errno = [0u8; 4];
        let mut got = 0;
        let mut error_r = File::from(error_r);
        while got < 4 {
            match error_r.read(&mut errno[got..]) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        let fd = pidfd_open(pid);
        let failed = if got == 4 {
            Some(io::Error::from_raw_os_error(i32::from_ne_bytes(errno)))
        } else {
            fd.as_ref()
                .err()
                .map(|e| io::Error::new(e.kind(), format!("pidfd_open (Linux 5.4 or later): {e}")))
        };
        if let Some(e) = failed {
            // Our own child, not reaped yet: its pid is still safe to use.
            // SAFETY: kill and waitpid on our own unreaped child.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, std::ptr::null_mut(), 0);
            }
            return Err(e);
        }
        let leader = Arc::new(Leader {
            pid,
            fd: fd?,
            reaped: Mutex::new(false),
        });
        registry().insert(pid, Arc::clone(&leader));
        drop(spawning);
        let status = File::from(status_r);
        set_nonblocking(status.as_fd())?;
        Ok(ContainedChild {
            leader,
            stdin: Some(File::from(stdin_w)),
            stdout: Some(File::from(stdout_r)),
            stderr: Some(File::from(stderr_r)),
            status: Some(status),
            status_line: Vec::new(),
            exit: None,
        })
    }

    /// The leader's pid (the command runs as its child).
    pub(crate) fn leader_pid(&self) -> i32 {
        self.leader.pid
    }

    /// The fd to poll for the command's exit (readable once the leader reports, or dies);
    /// `None` once the exit is known.
    pub(crate) fn exit_fd(&self) -> Option<RawFd> {
        self.status.as_ref().map(|f| f.as_raw_fd())
    }

    /// The command's exit, if the leader has reported it (never blocks).
    pub(crate) fn try_exit(&mut self) -> Option<Exit> {
        if self.exit.is_some() {
            return self.exit;
        }
        let status = self.status.as_mut()?;
        let mut buf = [0u8; 16];
        let eof = loop {
            match status.read(&mut buf) {
                Ok(0) => break true,
                Ok(n) => {
                    if self.status_line.len() < 16 {
                        self.status_line.extend_from_slice(&buf[..n]);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break false,
            }
        };
        if let Some(end) = self.status_line.iter().position(|&b| b == b'\n') {
            let code = std::str::from_utf8(&self.status_line[..end])
                .ok()
                .and_then(|s| s.trim().parse::<i32>().ok());
            self.exit = Some(match code {
                Some(c @ 129..=192) => Exit::Signal(c - 128),
                Some(c) => Exit::Code(c),
                None => Exit::Lost,
            });
        } else if eof {
            self.exit = Some(Exit::Lost);
        }
        if self.exit.is_some() {
            self.status = None;
        }
        self.exit
    }

    /// Waits up to `timeout` for the command's exit.
    pub(crate) fn wait_exit(&mut self, timeout: Duration) -> Option<Exit> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(exit) = self.try_exit() {
                return Some(exit);
            }
            let fd = self.exit_fd()?;
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            let mut p = [pollin(fd)];
            if poll(&mut p, Some(deadline - now)).is_err() {
                return None;
            }
        }
    }

    /// Whether anything of the tree is still running besides the leader.
    pub(crate) fn has_descendants(&self) -> bool {
        let reaped = self.leader.lock();
        !*reaped && !live_descendants(self.leader.pid).is_empty()
    }

    /// Sends `sig` to every process of the tree but the leader (SIGCONT follows a SIGTERM);
    /// returns how many were signalled.
    pub(crate) fn signal_descendants(&self, sig: libc::c_int) -> usize {
        self.leader.signal_tree(sig).len()
    }

    /// Waits up to `timeout` for every process of the tree but the leader to be gone.
    pub(crate) fn wait_descendants_gone(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let procs = {
                let reaped = self.leader.lock();
                if *reaped {
                    return true;
                }
                live_descendants(self.leader.pid)
            };
            if procs.is_empty() {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            let fds: Vec<BorrowedFd<'_>> = procs.iter().map(|p| p.fd.as_fd()).collect();
            wait_exited(&fds, deadline - now);
        }
    }

    /// Kills the whole tree: every process below the leader (round after round, until none is
    /// left), then the leader, which is then reaped, and the processes killed, which come
    /// back to the gateway when the leader dies (if it is a subreaper). Idempotent. Returns
    /// whether everything was seen to die.
    pub(crate) fn kill(&mut self) -> bool {
        self.stdin = None;
        let mut killed: Vec<Proc> = Vec::new();
        let mut clean = false;
        let deadline = Instant::now() + KILL_BUDGET;
        for _ in 0..KILL_ROUNDS {
            let procs = self.leader.signal_tree(libc::SIGKILL);
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
        if !*self.leader.lock() {
            // Our unreaped child: the signal cannot reach anyone else.
            let _ = pidfd_signal(self.leader.fd.as_fd(), libc::SIGKILL);
        }
        let leader_gone =
            wait_exited(&[self.leader.fd.as_fd()], LEADER_WAIT) && { self.leader.try_reap() };
        // The killed processes were the leader's; now they are ours (or init's) to reap.
        let mut unreaped = 0;
        for p in &killed {
            if matches!(reap(p.fd.as_fd()), Ok(false)) {
                unreaped += 1;
            }
        }
        if unreaped > 0 || !leader_gone {
            // Left to later sweeps, which reap them once they exit.
            let mut pending = strays();
            for p in killed {
                pending.entry(p.pid).or_insert(p.fd);
            }
        }
        if self.exit == Some(Exit::Lost) || !leader_gone {
            sweep_strays();
        }
        self.try_exit();
        clean && leader_gone
    }
}

impl Drop for ContainedChild {
    fn drop(&mut self) {
        if !*self.leader.lock() {
            self.kill();
        }
    }
}

/// The new process, between fork and exec: put the pipes on 0–3, a process group of its own,
/// the subreaper attribute, default signal handling, no other fds, then exec the wrapper.
///
/// # Safety
/// Only in the child of `fork`. Makes system calls only (no allocation, no locks).
unsafe fn exec_leader(
    fds: &ChildFds,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
) -> ! {
    unsafe {
        /// Reports errno to the parent through the error pipe and exits.
        unsafe fn fail(err: RawFd) -> ! {
            unsafe {
                let errno = *libc::__errno_location();
                let bytes = errno.to_ne_bytes();
                libc::write(err, bytes.as_ptr().cast(), 4);
                libc::_exit(127)
            }
        }
        // Lift every fd above the targets first, so no dup2 below clobbers a source.
        let err = libc::fcntl(fds.error, libc::F_DUPFD_CLOEXEC, 10);
        if err < 0 {
            libc::_exit(127);
        }
        let mut src = [fds.stdin, fds.stdout, fds.stderr, fds.status];
        for fd in &mut src {
            *fd = libc::fcntl(*fd, libc::F_DUPFD_CLOEXEC, 10);
            if *fd < 0 {
                fail(err);
            }
        }
        for (target, fd) in src.iter().enumerate() {
            // dup2 clears close-on-exec on the target: these four survive the exec.
            if libc::dup2(*fd, target as RawFd) < 0 {
                fail(err);
            }
        }
        if libc::setpgid(0, 0) < 0 {
            fail(err);
        }
        if libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0 {
            fail(err);
        }
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        libc::pthread_sigmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
        // Ignored signals stay ignored across exec (the gateway ignores SIGPIPE): reset them.
        let mut dfl: libc::sigaction = std::mem::zeroed();
        dfl.sa_sigaction = libc::SIG_DFL;
        for sig in 1..65 {
            if sig != libc::SIGKILL && sig != libc::SIGSTOP {
                libc::sigaction(sig, &dfl, std::ptr::null_mut());
            }
        }
        // Nothing else of the gateway's is inherited, close-on-exec or not.
        libc::syscall(libc::SYS_close_range, 4u32, (err - 1) as u32, 0u32);
        libc::syscall(libc::SYS_close_range, (err + 1) as u32, u32::MAX, 0u32);
        libc::execve(*argv, argv, envp);
        fail(err)
    }
}

/// Writes as much of `pending` as `w` (non-blocking) takes now; drops what was written.
/// `Ok(true)` once everything is written; an error means the reader is gone.
pub(crate) fn write_some(
    w: &mut File,
    pending: &mut Vec<u8>,
    written: &mut usize,
) -> io::Result<bool> {
    while *written < pending.len() {
        match w.write(&pending[*written..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => *written += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    pending.clear();
    *written = 0;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The state letter of `pid` in /proc (`Z`: a zombie).
    fn state_of(pid: i32) -> Option<u8> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let rest = text.rsplit(')').next()?;
        rest.trim_start().bytes().next()
    }

    /// Whether `pid` is a running process (a zombie counts as dead).
    fn running(pid: i32) -> bool {
        state_of(pid).is_some_and(|s| s != b'Z')
    }

    fn env() -> Vec<(String, String)> {
        AgentEnv::default().build(&[])
    }

    fn read_all(f: &mut File) -> String {
        let mut s = String::new();
        let _ = f.read_to_string(&mut s);
        s
    }

    #[test]
    fn the_command_runs_with_its_output_and_exit_status() {
        let mut c =
            ContainedChild::spawn("cat; echo out; echo err >&2; exit 3", &env()).expect("spawn");
        let mut stdin = c.stdin.take().expect("stdin");
        stdin.write_all(b"in\n").expect("write");
        drop(stdin);
        let mut out = c.stdout.take().expect("stdout");
        let mut err = c.stderr.take().expect("stderr");
        assert_eq!(c.wait_exit(Duration::from_secs(20)), Some(Exit::Code(3)));
        // The leader closes its pipes once it has reported: end of file without a kill.
        assert_eq!(read_all(&mut out), "in\nout\n");
        assert_eq!(read_all(&mut err), "err\n");
        assert!(c.kill());
        assert_eq!(c.try_exit(), Some(Exit::Code(3)));
    }

    #[test]
    fn signals_and_a_killed_leader_are_reported() {
        let mut c = ContainedChild::spawn("kill -9 $$", &env()).expect("spawn");
        assert_eq!(c.wait_exit(Duration::from_secs(20)), Some(Exit::Signal(9)));
    }

    #[test]
    fn an_agent_that_kills_its_leader_is_swept_up_by_the_subreaper_gateway() {
        become_subreaper().expect("prctl");
        // The command kills its own leader (its parent): nothing is reported, and the rest of
        // the agent is re-parented to this process, which kills it as a stray.
        let mut c =
            ContainedChild::spawn("echo $$; kill -9 $PPID; exec sleep 60", &env()).expect("spawn");
        let mut out = std::io::BufReader::new(c.stdout.take().expect("stdout"));
        let mut line = String::new();
        std::io::BufRead::read_line(&mut out, &mut line).expect("pid line");
        let pid: i32 = line.trim().parse().expect("pid");
        assert_eq!(c.wait_exit(Duration::from_secs(20)), Some(Exit::Lost));
        assert!(running(pid));
        c.kill();
        let fd = pidfd_open(pid);
        let gone =
            fd.is_err() || fd.is_ok_and(|fd| wait_exited(&[fd.as_fd()], Duration::from_secs(20)));
        assert!(gone, "the escaped sleep survived");
        assert!(!running(pid), "the escaped sleep was not reaped");
    }

    #[test]
    fn the_environment_is_the_allow_list_only() {
        // SAFETY (test): set before any agent reads the environment in this test; the names
        // are unique to this test.
        unsafe {
            std::env::set_var("TURNSTILE_AUTH_TOKEN_CHILD_TEST", "secret");
            std::env::set_var("CHILD_TEST_PASSED", "yes");
            std::env::set_var("CHILD_TEST_HIDDEN", "no");
        }
        let env = AgentEnv::new(["CHILD_TEST_PASSED"])
            .expect("valid")
            .build(&[("TURNSTILE_SESSION", "s")]);
        let mut c = ContainedChild::spawn("env", &env).expect("spawn");
        let mut out = c.stdout.take().expect("stdout");
        c.wait_exit(Duration::from_secs(20));
        let out = read_all(&mut out);
        let names: Vec<&str> = out
            .lines()
            .filter_map(|l| l.split('=').next())
            .filter(|n| !["PWD", "SHLVL", "_", "OLDPWD"].contains(n))
            .collect();
        let mut want = vec!["PATH", "CHILD_TEST_PASSED", "TURNSTILE_SESSION"];
        for n in ["HOME", "LANG"] {
            if std::env::var(n).is_ok() {
                want.push(n);
            }
        }
        let mut got = names.clone();
        got.sort_unstable();
        want.sort_unstable();
        assert_eq!(got, want, "{out}");
        assert!(!out.contains("secret"));
        assert!(AgentEnv::new(["TURNSTILE_AUTH_TOKEN"]).is_err());
        assert!(AgentEnv::new(["A=B"]).is_err());
    }

    #[test]
    fn a_setsid_double_forked_process_stays_in_the_tree_and_dies_with_it() {
        let mut c = ContainedChild::spawn(
            "setsid sh -c 'sleep 300 >/dev/null 2>&1 & echo $!' & wait; echo done",
            &env(),
        )
        .expect("spawn");
        let mut out = c.stdout.take().expect("stdout");
        assert_eq!(c.wait_exit(Duration::from_secs(20)), Some(Exit::Code(0)));
        let text = read_all(&mut out);
        let pid: i32 = text
            .lines()
            .next()
            .and_then(|l| l.parse().ok())
            .expect("pid");
        assert!(running(pid), "the sleep is running: {text}");
        let st = stat_of(pid).expect("stat");
        assert_eq!(
            st.ppid,
            c.leader_pid(),
            "re-parented to the leader, not init"
        );
        assert!(c.has_descendants());
        assert!(c.kill());
        assert!(!running(pid), "the detached sleep survived the kill");
    }

    #[test]
    fn output_is_kept_up_to_its_cap_and_the_rest_drained() {
        let mut c = ContainedChild::spawn("head -c 5000000 /dev/zero", &env()).expect("spawn");
        let mut out = c.stdout.take().expect("stdout");
        set_nonblocking(out.as_fd()).expect("nonblocking");
        let mut buf = OutputBuf::new(1000);
        loop {
            let mut p = [pollin(out.as_raw_fd())];
            poll(&mut p, Some(Duration::from_secs(20))).expect("poll");
            if buf.read_from(&mut out, READ_BUDGET).expect("read") == ReadState::Eof {
                break;
            }
        }
        assert_eq!(buf.total(), 5_000_000);
        assert_eq!(buf.kept(), &[0u8; 1000][..]);
        let buffered = buf.buffered();
        assert!(
            (1000..=1000).contains(&buffered),
            "{buffered} bytes buffered"
        );
        assert!(buf.truncated());
        assert_eq!(buf.into_vec().len(), 1000);
        // Output within the cap is kept whole and not flagged.
        let mut c = ContainedChild::spawn("printf abc", &env()).expect("spawn");
        let mut out = c.stdout.take().expect("stdout");
        set_nonblocking(out.as_fd()).expect("nonblocking");
        let mut buf = OutputBuf::new(3);
        while buf.read_from(&mut out, READ_BUDGET).expect("read") != ReadState::Eof {
            let mut p = [pollin(out.as_raw_fd())];
            poll(&mut p, Some(Duration::from_secs(20))).expect("poll");
        }
        assert_eq!((buf.kept(), buf.truncated()), (&b"abc"[..], false));
    }

    /// A pipe with `data` written into it by a thread; the read end, non-blocking.
    fn pipe_with(data: Vec<u8>) -> File {
        let (r, w) = pipe().expect("pipe");
        let mut w = File::from(w);
        thread::spawn(move || {
            let _ = w.write_all(&data);
        });
        let r = File::from(r);
        set_nonblocking(r.as_fd()).expect("nonblocking");
        r
    }

    /// Reads `r` to its end through `lines`, collecting lines (or the first error).
    fn read_lines(
        lines: &mut LineBuf,
        r: &mut File,
        budget: usize,
    ) -> Result<Vec<Vec<u8>>, LineTooLong> {
        let mut got = Vec::new();
        loop {
            let state = lines.read_from(r, budget).expect("read");
            while let Some(line) = lines.next_line() {
                got.push(line?);
            }
            match state {
                ReadState::Eof => return Ok(got),
                ReadState::More => {}
                ReadState::WouldBlock => {
                    let mut p = [pollin(r.as_raw_fd())];
                    poll(&mut p, Some(Duration::from_secs(20))).expect("poll");
                }
            }
        }
    }

    #[test]
    fn only_a_live_child_of_the_given_parent_is_opened() {
        let me = std::process::id() as i32;
        let mut sleeper = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .expect("spawn");
        let pid = sleeper.id() as i32;
        let st = stat_of(pid).expect("stat");
        assert_eq!(st.ppid, me);
        assert!(open_child(pid, me).is_some_and(|p| p.pid == pid));
        assert!(
            open_child(pid, 1).is_none(),
            "opened as the child of another parent"
        );
        let _ = sleeper.kill();
        // Exited but not reaped (a zombie): not live.
        let fd = pidfd_open(pid).expect("pidfd");
        assert!(wait_exited(&[fd.as_fd()], Duration::from_secs(20)));
        assert_eq!(state_of(pid), Some(b'Z'));
        assert!(open_child(pid, me).is_none(), "a zombie was taken for live");
        let _ = sleeper.wait();
        assert!(stat_of(pid).is_none());
    }

    #[test]
    fn many_short_lines_pass_through_a_small_buffer() {
        // 20 MB of lines through a 1000-byte line limit: consumed lines are dropped from the
        // buffer, which never holds much more than one chunk.
        let line = b"0123456789".repeat(9);
        let mut data = Vec::new();
        while data.len() < 20_000_000 {
            data.extend_from_slice(&line);
            data.push(b'\n');
        }
        let n = data.len() / (line.len() + 1);
        let mut r = pipe_with(data);
        let mut lines = LineBuf::new(1000);
        let mut count = 0;
        let mut peak = 0;
        loop {
            let state = lines.read_from(&mut r, READ_BUDGET).expect("read");
            peak = peak.max(lines.buffered());
            while let Some(l) = lines.next_line() {
                assert_eq!(l.expect("short line"), line);
                count += 1;
            }
            if state == ReadState::Eof {
                break;
            }
            if state == ReadState::WouldBlock {
                let mut p = [pollin(r.as_raw_fd())];
                poll(&mut p, Some(Duration::from_secs(20))).expect("poll");
            }
        }
        assert_eq!(count, n);
        // At least one chunk was read into it, and never much more.
        assert!(
            (64 * 1024..=1000 + 3 * 64 * 1024).contains(&peak),
            "{peak} bytes buffered"
        );
    }

    #[test]
    fn a_line_of_exactly_the_limit_passes_and_one_byte_more_does_not() {
        let mut data = vec![b'a'; 100];
        data.push(b'\n');
        data.extend(vec![b'b'; 101]);
        data.push(b'\n');
        let mut r = pipe_with(data);
        let mut lines = LineBuf::new(100);
        let mut got = Vec::new();
        let err = loop {
            let state = lines.read_from(&mut r, READ_BUDGET).expect("read");
            match lines.next_line() {
                Some(Ok(l)) => got.push(l),
                Some(Err(e)) => break e,
                None if state == ReadState::Eof => panic!("no error for the long line"),
                None => {
                    let mut p = [pollin(r.as_raw_fd())];
                    poll(&mut p, Some(Duration::from_secs(20))).expect("poll");
                }
            }
        };
        assert_eq!(got, vec![vec![b'a'; 100]]);
        assert_eq!(err, LineTooLong { max: 100 });
        // Without a newline: an unfinished line past the limit is refused too.
        let mut r = pipe_with(vec![b'c'; 5000]);
        let mut lines = LineBuf::new(100);
        assert_eq!(
            read_lines(&mut lines, &mut r, READ_BUDGET),
            Err(LineTooLong { max: 100 })
        );
        let mut r = pipe_with(vec![b'c'; 100]);
        let mut lines = LineBuf::new(100);
        assert_eq!(read_lines(&mut lines, &mut r, READ_BUDGET), Ok(vec![]));
    }

    #[test]
    fn a_read_stops_at_its_budget_so_a_flood_cannot_hold_the_loop() {
        // 4 MB without a newline, under a 10 MB limit: each call reads about the budget.
        let (r, w) = pipe().expect("pipe");
        let mut w = File::from(w);
        // SAFETY: F_SETPIPE_SZ on a pipe we own; a larger pipe lets one read see more.
        unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, 1 << 20) };
        let writer = thread::spawn(move || {
            let _ = w.write_all(&vec![b'x'; 4 << 20]);
        });
        let mut r = File::from(r);
        set_nonblocking(r.as_fd()).expect("nonblocking");
        let mut lines = LineBuf::new(10 << 20);
        let mut p = [pollin(r.as_raw_fd())];
        poll(&mut p, Some(Duration::from_secs(20))).expect("poll");
        let budget = 100_000;
        let _ = lines.read_from(&mut r, budget).expect("read");
        assert!(lines.pending() > 0);
        assert!(
            lines.pending() < budget + 64 * 1024,
            "{} bytes read for a budget of {budget}",
            lines.pending()
        );
        drop(r);
        let _ = writer.join();
    }

    #[test]
    fn lines_are_split_and_an_overlong_one_is_refused_without_buffering_it() {
        let mut c = ContainedChild::spawn(
            "printf 'one\\ntwo\\n'; head -c 3000000 /dev/zero; echo",
            &env(),
        )
        .expect("spawn");
        let mut out = c.stdout.take().expect("stdout");
        set_nonblocking(out.as_fd()).expect("nonblocking");
        let mut lines = LineBuf::new(100_000);
        let mut got = Vec::new();
        let too_long = 'outer: loop {
            let mut p = [pollin(out.as_raw_fd())];
            poll(&mut p, Some(Duration::from_secs(20))).expect("poll");
            let state = lines.read_from(&mut out, READ_BUDGET).expect("read");
            while let Some(line) = lines.next_line() {
                match line {
                    Ok(l) => got.push(String::from_utf8_lossy(&l).into_owned()),
                    Err(e) => break 'outer Some(e),
                }
            }
            if state == ReadState::Eof {
                break None;
            }
        };
        assert_eq!(got, ["one", "two"]);
        assert_eq!(too_long, Some(LineTooLong { max: 100_000 }));
        assert!(
            lines.buffered() <= 100_000 + 3 * 64 * 1024,
            "{} bytes buffered",
            lines.buffered()
        );
    }

    #[test]
    fn cancellation_wakes_a_poll_through_the_token_hook() {
        let token = crate::agent::CancelToken::new();
        let wake = Arc::new(Wake::new().expect("eventfd"));
        let w = Arc::clone(&wake);
        token.on_cancel(move || w.signal());
        let canceller = {
            let token = token.clone();
            thread::spawn(move || token.cancel())
        };
        let mut p = [pollin(wake.fd())];
        assert_eq!(
            poll(&mut p, Some(Duration::from_secs(20))).expect("poll"),
            1
        );
        canceller.join().expect("join");
    }
}
