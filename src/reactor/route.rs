//! Where a message's events go: a channel to another thread, the frontend on the loop, or
//! (feature `async`) a stream's task.

use crossbeam_channel::{Receiver, Sender};

#[cfg(feature = "async")]
use super::async_api::StreamSink;
use crate::core::MessageEvent;
use crate::message::Message;

/// Where a message's events go. Use an unbounded channel: the reactor never blocks on a
/// sink, so a full bounded one loses the event (logged at WARN and counted).
pub type EventSink = Sender<MessageEvent>;

/// The runtime's default event stream (events of messages sent with
/// [`Handle::submit`](super::Handle::submit)).
pub type Events = Receiver<MessageEvent>;

/// Where the reactor delivers a message's events.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub(super) enum Route {
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
