//! Where a message's events go: a channel to another thread, the frontend on the loop, or
//! (feature `async`) a stream's task.

use crossbeam_channel::{Receiver, Sender};

#[cfg(feature = "async")]
use super::async_api::StreamSink;
use crate::core::MessageEvent;
use crate::message::Message;

/// Where a message's events go. Use an unbounded channel: the reactor never blocks on a
/// sink, so a full bounded one loses the event (logged at WARN and counted). A sink is the
/// embedder's: every event is sent to it, its length is not watched (unlike [`Events`]).
pub type EventSink = Sender<MessageEvent>;

/// The runtime's default event stream (events of messages sent with
/// [`Handle::submit`](super::Handle::submit)). Its sender is the reactor's: the stream ends
/// (`recv` returns an error once drained) when the runtime's loop has ended or the
/// [`Runtime`](super::Runtime) was dropped without running.
///
/// Bounded for a reader that falls behind: once it holds
/// [`Builder::events_backlog`](super::Builder::events_backlog) unread events, partial replies
/// are skipped (counted as `partials_skipped` in the status) until it is read; every other
/// event is always sent.
pub type Events = Receiver<MessageEvent>;

/// Where the reactor delivers a message's events.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub(super) enum Route {
    /// The runtime's own [`Events`] channel ([`Handle::submit`](super::Handle::submit)),
    /// whose sender the reactor holds: the core copies a route into every event it emits,
    /// and copying this one touches no reference count shared with other threads (a
    /// `Sink`'s clone and drop are atomic operations on the channel's counter, which the
    /// submitting thread writes too).
    Default,
    /// A channel to another thread.
    Sink(EventSink),
    /// The frontend running on the reactor, with its own tag.
    Local(u64),
    /// An [`EventStream`](super::EventStream)'s sending half: the reactor wakes its task on
    /// delivery.
    #[cfg(feature = "async")]
    Stream(StreamSink),
}

/// A message on its way to the reactor, with where its events go.
pub(super) type Submission = (Message, Route);
