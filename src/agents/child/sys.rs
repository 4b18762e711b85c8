//! The raw system calls of containment: pipes, poll, an eventfd, pidfds, and the new
//! leader's side of fork and exec. Everything `unsafe` about processes is here.

use std::ffi::CString;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

/// An `io::Result` of a libc return code (negative: `errno`).
pub(super) fn cvt(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// A pipe, both ends close-on-exec: (read, write).
pub(super) fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
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

/// A pidfd naming `pid` (Linux 5.4 or later).
pub(super) fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
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
pub(super) fn pidfd_signal(fd: BorrowedFd<'_>, sig: libc::c_int) -> io::Result<()> {
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
pub(super) fn has_exited(fd: BorrowedFd<'_>) -> bool {
    let mut p = [pollin(fd.as_raw_fd())];
    matches!(poll(&mut p, Some(Duration::ZERO)), Ok(n) if n > 0)
}

/// Waits until every process has exited or `timeout` passes; returns whether all did.
pub(super) fn wait_exited(fds: &[BorrowedFd<'_>], timeout: Duration) -> bool {
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
pub(super) fn reap(fd: BorrowedFd<'_>) -> io::Result<bool> {
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
/// The argument and environment vectors of the leader's exec, built before fork: the child
/// may only make system calls.
pub(super) struct ExecArgs {
    // Own the strings the pointers point into.
    _argv: Vec<CString>,
    _envp: Vec<CString>,
    argv_ptrs: Vec<*const libc::c_char>,
    envp_ptrs: Vec<*const libc::c_char>,
}

impl ExecArgs {
    /// `argv` (its first item the program) and exactly the environment `env`.
    pub(super) fn new(argv: &[&str], env: &[(String, String)]) -> io::Result<ExecArgs> {
        let invalid = |what: &str| io::Error::new(io::ErrorKind::InvalidInput, what.to_owned());
        let argv: Vec<CString> = argv
            .iter()
            .map(|a| CString::new(*a))
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
        Ok(ExecArgs {
            _argv: argv,
            _envp: envp,
            argv_ptrs,
            envp_ptrs,
        })
    }
}

/// Ends of the pipes as the new process sees them.
pub(super) struct ChildFds {
    pub(super) stdin: RawFd,
    pub(super) stdout: RawFd,
    pub(super) stderr: RawFd,
    pub(super) status: RawFd,
    pub(super) error: RawFd,
    /// The read end of the gateway's lifeline, put on fd 4.
    pub(super) lifeline: RawFd,
}

/// The read end of the gateway's lifeline: a pipe created once, whose write end stays open
/// in this process (close-on-exec, and closed in every leader between fork and exec) until
/// the process dies, however it dies. Each leader reads fd 4 and kills its tree at end of
/// file. Nothing is ever written to it. With `--cluster` the write end is a leash's instead
/// ([`install_lifeline`]).
pub(super) fn lifeline() -> io::Result<RawFd> {
    let mut lifelines = lifelines();
    if let Some(fd) = lifelines.current {
        return Ok(fd);
    }
    let (r, w) = pipe()?;
    let fd = r.as_raw_fd();
    lifelines.kept.extend([r, w]);
    lifelines.current = Some(fd);
    Ok(fd)
}

/// Leaders forked from now on read `read`, the read end of a lifeline whose write end
/// another process holds (the cluster's leash, `cluster/leash.rs`): when that process ends,
/// or closes it, every such leader kills its tree. The ends given before stay open (a leader
/// being forked may hold their number): one fd per leash, a handful in a process's life.
pub(crate) fn install_lifeline(read: OwnedFd) {
    let mut lifelines = lifelines();
    lifelines.current = Some(read.as_raw_fd());
    lifelines.kept.push(read);
}

/// The lifeline leaders get now, and every end ever given (never closed).
struct Lifelines {
    current: Option<RawFd>,
    kept: Vec<OwnedFd>,
}

fn lifelines() -> std::sync::MutexGuard<'static, Lifelines> {
    static LIFELINES: std::sync::Mutex<Lifelines> = std::sync::Mutex::new(Lifelines {
        current: None,
        kept: Vec::new(),
    });
    LIFELINES.lock().unwrap_or_else(|e| e.into_inner())
}

/// Forks a process that puts `fds` in place and execs `args` ([`exec_leader`]); returns its
/// pid. Whether the exec worked is for [`confirm_exec`] to tell.
pub(super) fn fork_leader(fds: &ChildFds, args: &ExecArgs) -> io::Result<i32> {
    // SAFETY: fork; the child runs only async-signal-safe system calls on data prepared
    // before and then execs or exits.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        // SAFETY: in the child of fork; never returns.
        unsafe { exec_leader(fds, args.argv_ptrs.as_ptr(), args.envp_ptrs.as_ptr()) }
    }
    Ok(pid)
}

/// In the parent, once its copies of the child's pipe ends are closed: the pidfd of the new
/// leader `pid`, or why it did not start (the errno a failed exec wrote on the error pipe,
/// whose child copy closes at exec; or no pidfd). A leader that did not start is killed and
/// reaped.
pub(super) fn confirm_exec(pid: i32, error_r: OwnedFd) -> io::Result<OwnedFd> {
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
    fd
}

/// The new process, between fork and exec: put the pipes on 0–3 and the lifeline on 4, a process group of its own,
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
        let mut src = [fds.stdin, fds.stdout, fds.stderr, fds.status, fds.lifeline];
        for fd in &mut src {
            *fd = libc::fcntl(*fd, libc::F_DUPFD_CLOEXEC, 10);
            if *fd < 0 {
                fail(err);
            }
        }
        for (target, fd) in src.iter().enumerate() {
            // dup2 clears close-on-exec on the target: these five survive the exec.
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
        libc::syscall(libc::SYS_close_range, 5u32, (err - 1) as u32, 0u32);
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
