//! Wakes the reactor from other threads, paying the wake syscall once per sleep, not per send.

use std::sync::atomic::{AtomicBool, Ordering, fence};

/// A `mio::Waker` guarded by a "the reactor is (about to be) asleep" flag.
///
/// The reactor sets the flag, re-checks its channels and polls; a sender pushes to a channel
/// and then swaps the flag off, waking the poll only if the flag was on. Both sides use
/// sequentially consistent operations, so either the reactor sees the message in its re-check
/// or the sender sees the flag and wakes it: a message is never left unseen while the loop
/// sleeps, and a busy loop takes no wake syscalls at all.
pub(super) struct Notifier {
    waker: mio::Waker,
    sleeping: AtomicBool,
}

impl Notifier {
    /// Wraps a waker registered with the reactor's poll.
    pub(super) fn new(waker: mio::Waker) -> Notifier {
        Notifier {
            waker,
            sleeping: AtomicBool::new(false),
        }
    }

    /// Called after sending to one of the reactor's channels.
    pub(super) fn notify(&self) {
        fence(Ordering::SeqCst);
        // A load first: while the loop is awake (a busy loop, the common case under load)
        // the flag's cache line stays shared instead of bouncing to every sender for a
        // read-modify-write. The fence orders it after the send as the swap would; only a
        // sender that saw the flag on races for the one wake.
        if self.sleeping.load(Ordering::SeqCst)
            && self.sleeping.swap(false, Ordering::SeqCst)
            && let Err(e) = self.waker.wake()
        {
            log::error!("reactor wake failed: {e}");
        }
    }

    /// Reactor side: announces the coming sleep. The caller must re-check its channels after
    /// this and skip the sleep if anything arrived.
    pub(super) fn prepare_sleep(&self) {
        self.sleeping.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// Reactor side: back from poll (or skipped it).
    pub(super) fn awake(&self) {
        self.sleeping.store(false, Ordering::SeqCst);
    }
}
