//! A `timerfd` on the reactor's poll for its next deadline.
//!
//! mio takes poll timeouts in whole milliseconds (rounding up), so a loop that sleeps until
//! a deadline wakes up to a millisecond late. Arming a timerfd for the exact deadline and
//! registering it with the poll removes that floor: the poll wakes when the timer fires,
//! within the kernel's timer slack (about 50 us), while the millisecond timeout stays as a
//! safety net.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

use mio::unix::SourceFd;
use mio::{Interest, Registry, Token};

/// A non-blocking, monotonic timerfd registered with the reactor's poll.
pub(super) struct DeadlineTimer {
    fd: OwnedFd,
    /// The deadline the timer is armed for (on the reactor's clock), if any: consecutive
    /// sleeps towards the same deadline re-arm nothing.
    armed_for: Option<Duration>,
}

impl DeadlineTimer {
    /// Creates the timer and registers it with `token`.
    pub(super) fn new(registry: &Registry, token: Token) -> std::io::Result<DeadlineTimer> {
        // SAFETY: timerfd_create returns a new descriptor or -1; ownership moves to OwnedFd.
        let raw = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        };
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        registry.register(&mut SourceFd(&fd.as_raw_fd()), token, Interest::READABLE)?;
        Ok(DeadlineTimer {
            fd,
            armed_for: None,
        })
    }

    /// Makes sure the timer fires at `deadline` (on the reactor's clock, `now` being the
    /// current reading): a syscall only when the deadline changed since the last arming.
    pub(super) fn arm_for(&mut self, deadline: Duration, now: Duration) -> std::io::Result<()> {
        if self.armed_for == Some(deadline) {
            return Ok(());
        }
        self.armed_for = Some(deadline);
        self.arm(deadline.saturating_sub(now))
    }

    /// Fires once, `after` from now (a zero duration fires at once). Re-arming replaces the
    /// previous deadline and clears a pending expiry.
    fn arm(&self, after: Duration) -> std::io::Result<()> {
        // A zero it_value would disarm the timer; one nanosecond fires immediately instead.
        let after = after.max(Duration::from_nanos(1));
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: after.as_secs().min(i64::MAX as u64) as libc::time_t,
                tv_nsec: libc::c_long::from(after.subsec_nanos() as i32),
            },
        };
        // SAFETY: valid descriptor and a fully initialised itimerspec; old value not wanted.
        let rc =
            unsafe { libc::timerfd_settime(self.fd.as_raw_fd(), 0, &spec, std::ptr::null_mut()) };
        if rc < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Called when the timer's token was ready: consumes the expiry so the next one is a
    /// fresh readiness edge, and forgets the deadline it was armed for.
    pub(super) fn fired(&mut self) {
        self.armed_for = None;
        let mut buf = [0u8; 8];
        // SAFETY: reading up to 8 bytes into a local buffer; EAGAIN when nothing expired.
        let _ = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    }
}
