//! The [`Handle`]: what any thread holds to submit messages, read the status and ask for
//! shutdown. The builder fills in its fields.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{RecvTimeoutError, Sender, TrySendError};

use super::route::{EventSink, Route, Submission};
use super::wake::Notifier;
use crate::core::{EventKind, Outcome, RejectReason};
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

/// Why [`Handle::submit_and_wait`] returned no [`Outcome`].
#[derive(Debug)]
#[non_exhaustive]
pub enum WaitError {
    /// The message was not submitted (a full ingress channel, or the runtime had stopped);
    /// it is handed back inside (boxed: it holds the whole message).
    Submit(Box<SubmitError>),
    /// The runtime refused the message; this is its only answer.
    Rejected {
        /// The message's id.
        id: Arc<str>,
        /// Why.
        reason: RejectReason,
    },
    /// No outcome came within the timeout. The message is still in the runtime and will
    /// still get one, which nobody reads (counted in the status as `events_undelivered`);
    /// send `/stop` to the session to end its turn.
    TimedOut {
        /// The message's id.
        id: Arc<str>,
    },
    /// The runtime stopped before the message got an outcome.
    Stopped {
        /// The message's id.
        id: Arc<str>,
    },
}

impl fmt::Display for WaitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WaitError::Submit(e) => fmt::Display::fmt(e, f),
            WaitError::Rejected { id, reason } => {
                write!(f, "message {id} rejected: {}", reason.detail())
            }
            WaitError::TimedOut { id } => write!(f, "no outcome for message {id} in time"),
            WaitError::Stopped { id } => {
                write!(f, "runtime stopped before message {id} got an outcome")
            }
        }
    }
}

impl std::error::Error for WaitError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            WaitError::Submit(e) => Some(&**e),
            _ => None,
        }
    }
}

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
        self.submit_route(message, Route::Default)
    }

    /// Submits a message whose events go to `sink`. Never blocks.
    pub fn submit_to(&self, message: Message, sink: EventSink) -> Result<(), SubmitError> {
        self.submit_route(message, Route::Sink(sink))
    }

    fn submit_route(&self, message: Message, route: Route) -> Result<(), SubmitError> {
        match self.ingress.try_send((message, route)) {
            Ok(()) => {
                self.notifier.notify();
                Ok(())
            }
            Err(TrySendError::Full((m, _))) => Err(SubmitError::Backpressure(m)),
            Err(TrySendError::Disconnected((m, _))) => Err(SubmitError::Closed(m)),
        }
    }

    /// Submits a message and blocks the calling thread until its [`Outcome`] or `timeout`:
    /// for sync callers that want an answer, not a stream of events. The reactor is never
    /// held: the events go to a channel of this call's own, and the wait is on it. Do not
    /// call it on the reactor thread (from a [`Frontend`](crate::Frontend)), which it would
    /// stall.
    ///
    /// Fails with [`WaitError::Submit`] when the message cannot be submitted (backpressure is
    /// not waited out), [`WaitError::Rejected`], [`WaitError::TimedOut`] (the message stays in
    /// the runtime), or [`WaitError::Stopped`].
    ///
    /// ```
    /// use std::time::Duration;
    /// use turnstile::{Builder, EchoAgent, Message, Outcome, SessionKey};
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let (runtime, handle, _events) = Builder::new(EchoAgent::factory(Duration::ZERO)).build()?;
    /// let reactor = runtime.spawn()?;
    /// let chat = SessionKey::dm("telegram", "42")?;
    /// let outcome = handle.submit_and_wait(Message::new("m1", chat, "hi")?, Duration::from_secs(30))?;
    /// assert!(matches!(outcome, Outcome::Reply(reply) if reply.text == "hi"));
    /// handle.shutdown();
    /// reactor.join()?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn submit_and_wait(
        &self,
        message: Message,
        timeout: Duration,
    ) -> Result<Outcome, WaitError> {
        let id = Arc::clone(&message.id);
        // One message's events (accepted, throttled partials, one terminal), read by this
        // loop as they come: bounded by the turn.
        let (sink, events) = crossbeam_channel::unbounded();
        self.submit_to(message, sink)
            .map_err(|e| WaitError::Submit(Box::new(e)))?;
        // A timeout too long to add to now is no timeout.
        let deadline = Instant::now().checked_add(timeout);
        loop {
            let next = match deadline {
                Some(d) => events.recv_deadline(d),
                None => events.recv().map_err(|_| RecvTimeoutError::Disconnected),
            };
            match next {
                Ok(event) => match event.kind {
                    EventKind::Finished(outcome) => return Ok(outcome),
                    EventKind::Rejected(reason) => return Err(WaitError::Rejected { id, reason }),
                    _ => {}
                },
                Err(RecvTimeoutError::Timeout) => return Err(WaitError::TimedOut { id }),
                // The reactor dropped the route: it stopped, or never took the message.
                Err(RecvTimeoutError::Disconnected) => return Err(WaitError::Stopped { id }),
            }
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
