//! The leash (`--cluster` with process agents, docs/cluster.md "Self-fencing"): a small
//! process, the gateway's own binary re-executed (`turnstile leash`, hidden), that holds the
//! agents' lifeline and a deadline the member thread moves at each ownership pass. A gateway
//! that is stopped (SIGSTOP, a frozen VM thread, a debugger) cannot fence itself: no thread
//! of it runs. Its agent processes would run on while the next owner runs the same sessions;
//! the leash, not stopped with it, ends them.
//!
//! - The lifeline (`agents/child`): every agent leader reads fd 4 and kills its whole tree
//!   at end of file. With a leash, the write end is held by the leash alone, so the leash
//!   exiting ends every agent process of this gateway.
//! - The deadline: the earliest fence deadline of the leases held (`Ownership::fence_at`),
//!   as `CLOCK_MONOTONIC` nanoseconds (one clock for both processes), 8 bytes on the leash's
//!   fd 3; `u64::MAX` while nothing is held (no turn can run). Past it, the leash exits.
//! - The gateway dying closes fd 3: the leash exits too, as the lifeline did before.
//! - A gateway that wakes past its deadline finds the leash gone (its next write fails):
//!   its partitions are lost by then (the same deadline), and it starts a new leash with a
//!   new lifeline before its next pass reports anything gained.
//!
//! The leash stays in the gateway's process group (the subreaper's sweep spares it).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

/// The deadline that never comes: nothing held.
const NEVER: u64 = u64::MAX;

/// This gateway's leash: the control pipe's write end and the process.
struct Leash {
    control: OwnedFd,
    child: Child,
}

fn leash() -> MutexGuard<'static, Option<Leash>> {
    static LEASH: Mutex<Option<Leash>> = Mutex::new(None);
    LEASH.lock().unwrap_or_else(|e| e.into_inner())
}

/// `CLOCK_MONOTONIC` now, in nanoseconds (the clock `Instant` reads on Linux, and the
/// leash's).
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// Starts this gateway's leash (at start-up, before any agent runs): agent leaders forked
/// from now on die when it ends. Its deadline is `never` until [`extend`] says otherwise.
pub(crate) fn start() -> io::Result<()> {
    let new = spawn()?;
    if let Some(mut old) = leash().replace(new) {
        let _ = old.child.kill();
        let _ = old.child.wait();
    }
    Ok(())
}

fn spawn() -> io::Result<Leash> {
    let (lifeline_r, lifeline_w) = pipe()?;
    let (control_r, control_w) = pipe()?;
    let (cr, lw) = (control_r.as_raw_fd(), lifeline_w.as_raw_fd());
    let mut command = Command::new(std::env::current_exe()?);
    command
        .arg("leash")
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    // SAFETY: dup2 only (async-signal-safe), between fork and exec; the two fds are open
    // in the parent until `spawn` returns.
    unsafe {
        command.pre_exec(move || {
            // Lift them above the targets first, so neither dup2 clobbers the other.
            let (c, l) = (libc::dup(cr), libc::dup(lw));
            if c < 0 || l < 0 || libc::dup2(c, 3) < 0 || libc::dup2(l, 4) < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = command.spawn()?;
    // The lifeline's write end is the leash's alone now.
    drop((lifeline_w, control_r));
    // A leash that does not read never blocks the member thread.
    crate::agents::child::set_nonblocking(std::os::fd::AsFd::as_fd(&control_w))?;
    crate::agents::child::install_lifeline(lifeline_r);
    log::info!(
        "leash started (pid {}): agent processes end with it",
        child.id()
    );
    Ok(Leash {
        control: control_w,
        child,
    })
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: pipe2 writes two fds into the array we own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both fds are fresh and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// The member thread's ownership pass: the leash's deadline becomes `deadline` (the earliest
/// fence deadline of the leases held; `None` while none is held). A leash that is gone (it
/// fired while this gateway was stopped, or was killed) is started anew first. Does
/// nothing without a leash ([`start`] was never called).
pub(crate) fn extend(deadline: Option<Instant>) {
    let mut guard = leash();
    let Some(l) = guard.as_mut() else {
        return;
    };
    let ns = deadline.map_or(NEVER, |d| {
        let left = d.saturating_duration_since(Instant::now());
        monotonic_ns().saturating_add(left.as_nanos() as u64)
    });
    match write_deadline(l.control.as_raw_fd(), ns) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {
            let _ = l.child.wait();
            log::warn!(
                "the leash is gone (it stopped every agent process of this gateway: its fence deadline passed while it could not renew, or it was killed); starting a new one"
            );
            match spawn() {
                Ok(mut new) => {
                    if let Err(e) = write_deadline(new.control.as_raw_fd(), ns) {
                        log::warn!("the new leash's deadline: {e}");
                    }
                    std::mem::swap(l, &mut new);
                }
                Err(e) => {
                    log::error!("cannot start a new leash ({e}): agent processes now end at once")
                }
            }
        }
        // Full: the leash has not read for a long while; the next pass writes again.
        Err(e) => log::debug!("leash deadline not written: {e}"),
    }
}

fn write_deadline(fd: RawFd, ns: u64) -> io::Result<()> {
    let bytes = ns.to_le_bytes();
    // SAFETY: write from a buffer we own to an fd we own; 8 bytes are written whole (below
    // PIPE_BUF) or not at all.
    let n = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `turnstile leash`: the leash process itself. Reads deadlines on fd 3 and holds the
/// lifeline's write end on fd 4; exits (closing it: every agent leader kills its tree) once
/// the deadline passes, or when fd 3 ends (the gateway is gone). Returns the exit code.
pub(crate) fn run() -> i32 {
    let (control, mut deadline, mut buf) = (3, NEVER, Vec::<u8>::with_capacity(64));
    loop {
        let now = monotonic_ns();
        let timeout = match deadline {
            NEVER => -1,
            d if d <= now => 0,
            d => i32::try_from((d - now).div_ceil(1_000_000)).unwrap_or(i32::MAX),
        };
        let mut pfd = libc::pollfd {
            fd: control,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll on one pollfd we own.
        let ready = unsafe { libc::poll(&mut pfd, 1, timeout) };
        if ready < 0 {
            if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return 1;
        }
        if ready == 0 {
            if monotonic_ns() >= deadline {
                eprintln!(
                    "turnstile leash: the gateway did not renew its leases by their fence deadline; its agent processes are stopped"
                );
                return 0;
            }
            continue;
        }
        let mut chunk = [0u8; 512];
        // SAFETY: read into a buffer we own.
        let n = unsafe { libc::read(control, chunk.as_mut_ptr().cast(), chunk.len()) };
        if n <= 0 {
            // The gateway is gone (or fd 3 is unusable): its agents go with it.
            return 0;
        }
        buf.extend_from_slice(&chunk[..n as usize]);
        let whole = buf.len() / 8 * 8;
        if let Some(last) = buf[..whole].chunks_exact(8).last() {
            let mut b = [0u8; 8];
            b.copy_from_slice(last);
            deadline = u64::from_le_bytes(b);
        }
        buf.drain(..whole);
    }
}
