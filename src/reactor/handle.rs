//! The [`Handle`]: what any thread holds to submit messages, read the status and ask for
//! shutdown. The builder fills in its fields.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crossbeam_channel::{Sender, TrySendError};

use super::route::{EventSink, Route, Submission};
use super::wake::Notifier;
use crate::liveness::{Status, StatusCell};
use crate::message::Message;

/// Why a submission did not reach the reactor; the message is handed back.
#[derive(Debug)]
#[non_exhaustive]
pub enum SubmitError {
    /// The ingress channel is full: back off and retry.
    Backpressure(Message),
    /// The reactor has stopped.
    Closed(Message),
}

impl fmt::Display for SubmitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SubmitError::Backpressure(m) => {
                write!(f, "ingress full; message {} not submitted", m.id)
            }
            SubmitError::Closed(m) => write!(f, "runtime stopped; message {} not submitted", m.id),
        }
    }
}

impl std::error::Error for SubmitError {}

/// A cloneable, thread-safe handle to a runtime: submit, read status, shut down.
#[derive(Clone)]
pub struct Handle {
    /// Submissions on their way to the reactor.
    pub(super) ingress: Sender<Submission>,
    /// Wakes the reactor after a send.
    pub(super) notifier: Arc<Notifier>,
    /// Set to ask for a graceful shutdown.
    pub(super) shutdown: Arc<AtomicBool>,
    /// Where the heartbeat publishes each snapshot.
    pub(super) status: Arc<StatusCell>,
    /// Where [`Handle::submit`]'s events go: the runtime's [`Events`](super::Events).
    pub(super) default_sink: EventSink,
    /// The turn workers' partial interval in nanoseconds.
    pub(super) partial_ns: Arc<AtomicU64>,
    /// Submits waiting for ingress room (the `async` feature).
    #[cfg(feature = "async")]
    pub(super) room: Arc<super::async_api::Room>,
}

/// A duration in nanoseconds, saturating (an atomic holds it).
pub(super) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Handle {
    /// Changes the least time between two forwarded partials, for turns started from now on.
    pub fn set_partial_interval(&self, interval: Duration) {
        self.partial_ns.store(nanos(interval), Ordering::Relaxed);
    }

    /// The least time between two forwarded partials now in force.
    pub fn partial_interval(&self) -> Duration {
        Duration::from_nanos(self.partial_ns.load(Ordering::Relaxed))
    }

    /// Submits a message; its events go to the runtime's [`Events`](super::Events) stream.
    pub fn submit(&self, message: Message) -> Result<(), SubmitError> {
        self.submit_to(message, self.default_sink.clone())
    }

    /// Submits a message whose events go to `sink`. Never blocks.
    pub fn submit_to(&self, message: Message, sink: EventSink) -> Result<(), SubmitError> {
        match self.ingress.try_send((message, Route::Sink(sink))) {
            Ok(()) => {
                self.notifier.notify();
                Ok(())
            }
            Err(TrySendError::Full((m, _))) => Err(SubmitError::Backpressure(m)),
            Err(TrySendError::Disconnected((m, _))) => Err(SubmitError::Closed(m)),
        }
    }

    /// The latest status snapshot, produced by the reactor's last heartbeat tick: up to one
    /// tick interval old (100 ms by default, [`Builder::tick_interval`]); its `updated_at`
    /// says when it was taken. An event that just arrived on a channel may not be counted
    /// yet — to wait for a figure, use [`Handle::wait_status`].
    ///
    /// [`Builder::tick_interval`]: crate::Builder::tick_interval
    pub fn status(&self) -> Arc<Status> {
        self.status.get()
    }

    /// Waits up to `timeout` for a snapshot satisfying `pred`.
    pub fn wait_status(
        &self,
        timeout: Duration,
        pred: impl FnMut(&Status) -> bool,
    ) -> Option<Arc<Status>> {
        self.status.wait_for(timeout, pred)
    }

    /// Asks the runtime to shut down gracefully; [`Runtime::run`](super::Runtime::run)
    /// returns when it is done.
    pub fn shutdown(&self) {
        self.shutdown.store(true, Ordering::SeqCst);
        self.notifier.notify();
    }
}

impl fmt::Debug for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Handle")
            .field("queued_submissions", &self.ingress.len())
            .field("shutdown_requested", &self.shutdown.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}
