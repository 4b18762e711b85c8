//! Async embedding (the `async` feature): a message's events as a [`Stream`], an awaitable
//! [`CancelToken::cancelled`], and submits that wait out backpressure.
//!
//! Nothing here needs an async runtime, and no thread is added: the reactor wakes the tasks
//! itself. It wakes a stream's task when it delivers one of its events, and the tasks waiting
//! for ingress room after each drain of the ingress channel. Each waiting side follows the same
//! rule to never miss a wake: register the waker first, then look again.
//!
//! ```no_run
//! # async fn example(handle: turnstile::Handle) -> Result<(), Box<dyn std::error::Error>> {
//! use turnstile::{EventKind, Message, SessionKey};
//!
//! let chat = SessionKey::dm("telegram", "42")?;
//! // Waits for room in the ingress channel rather than failing with `Backpressure`.
//! let mut events = handle.submit_stream_async(Message::new("m1", chat, "hello")?).await?;
//! while let Some(event) = events.recv().await {
//!     if let EventKind::Finished(outcome) = event.kind {
//!         println!("{outcome:?}");
//!     }
//! }
//! # Ok(())
//! # }
//! ```

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering, fence};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use crossbeam_channel::{Receiver, TryRecvError, TrySendError};
use futures_core::future::FusedFuture;
use futures_core::stream::{FusedStream, Stream};
use slab::Slab;

use super::handle::{Handle, SubmitError};
use super::route::{EventSink, Route};
use crate::agent::CancelToken;
use crate::core::{EventKind, MessageEvent};
use crate::message::Message;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves nothing half-updated worth refusing.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One task's waker, set by the consumer and taken by the producer.
#[derive(Default)]
struct WakerSlot(Mutex<Option<Waker>>);

impl WakerSlot {
    fn register(&self, waker: &Waker) {
        let mut slot = lock(&self.0);
        match &mut *slot {
            Some(w) => w.clone_from(waker),
            None => *slot = Some(waker.clone()),
        }
    }

    fn wake(&self) {
        // Taken under the lock, woken outside it: the executor may poll at once.
        let waker = lock(&self.0).take();
        if let Some(w) = waker {
            w.wake();
        }
    }
}

/// The tasks waiting for room in the ingress channel, and whether the reactor is gone.
///
/// Shared by every [`Handle`] and the reactor. A waiting submit registers here, then retries;
/// the reactor, after each drain, wakes every registered task (they race for the room, the
/// losers register again). Waking them all keeps this simple and needs no hand-over when a
/// woken future is dropped instead of polled.
#[derive(Default)]
pub(crate) struct Room {
    waiters: Mutex<Slab<Waker>>,
    /// `waiters.len()`, readable without the lock so that a drain with nobody waiting (the
    /// common case) costs the reactor a fence and a load.
    count: AtomicUsize,
    /// Set when the reactor stops: waiting submits and silent streams end.
    closed: AtomicBool,
}

impl Room {
    /// Registers (or re-registers under `key`) the task to wake when room appears.
    fn register(&self, key: &mut Option<usize>, waker: &Waker) {
        {
            let mut waiters = lock(&self.waiters);
            match key.and_then(|k| waiters.get_mut(k)) {
                Some(w) => w.clone_from(waker),
                None => *key = Some(waiters.insert(waker.clone())),
            }
            self.count.store(waiters.len(), Ordering::SeqCst);
        }
        // Pairs with the fence in `wake_all`: either the reactor sees this registration, or
        // the caller's retry sees the room the reactor made.
        fence(Ordering::SeqCst);
    }

    fn unregister(&self, key: &mut Option<usize>) {
        if let Some(k) = key.take() {
            let mut waiters = lock(&self.waiters);
            waiters.try_remove(k);
            self.count.store(waiters.len(), Ordering::SeqCst);
        }
    }

    /// Wakes every waiting task, through `scratch` so that no waker runs under the lock.
    fn wake_all(&self, scratch: &mut Vec<Waker>) {
        fence(Ordering::SeqCst);
        if self.count.load(Ordering::SeqCst) == 0 {
            return;
        }
        scratch.extend(lock(&self.waiters).iter().map(|(_, w)| w.clone()));
        scratch.drain(..).for_each(Waker::wake);
    }

    fn is_closed(&self) -> bool {
        // Pairs with the fence in `RoomGuard::drop`: a message sent after its last look at
        // the ingress channel is seen here as a closed runtime.
        fence(Ordering::SeqCst);
        self.closed.load(Ordering::SeqCst)
    }
}

/// The reactor's side of the [`Room`]: wakes waiting submits after each drain, and when the
/// reactor stops (this is dropped with it), closes the room.
pub(crate) struct RoomGuard {
    room: Arc<Room>,
    /// A receiver of the ingress channel, to empty it on close: a message left there would
    /// keep its stream open for as long as any handle lives.
    ingress: Receiver<(Message, Route)>,
    scratch: Vec<Waker>,
}

impl RoomGuard {
    pub(crate) fn new(room: Arc<Room>, ingress: Receiver<(Message, Route)>) -> RoomGuard {
        RoomGuard {
            room,
            ingress,
            scratch: Vec::new(),
        }
    }

    /// Called by the reactor after it drained the ingress channel.
    pub(crate) fn drained(&mut self) {
        self.room.wake_all(&mut self.scratch);
    }
}

impl Drop for RoomGuard {
    fn drop(&mut self) {
        self.room.closed.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        // Dropping their routes ends the streams of messages the reactor never took.
        for stranded in self.ingress.try_iter() {
            log::debug!("runtime stopped before taking message {}", stranded.0.id);
        }
        self.room.wake_all(&mut self.scratch);
    }
}

/// The sending half of an [`EventStream`]: where the reactor delivers its events.
#[derive(Clone)]
pub(super) struct StreamSink(Arc<StreamTx>);

struct StreamTx {
    // Fields drop in declaration order: the sender goes first, so the task woken by
    // `slot` (when the reactor drops the route without a terminal event) sees the stream
    // disconnected rather than registering again for an event that will never come.
    tx: InboxSender,
    slot: WakeOnDrop,
}

/// What waits for an [`EventStream`]'s consumer: its events in order, partials coalesced (a
/// partial is the whole reply so far, so a newer one replaces one not yet taken). Bounded:
/// beside at most one partial, a message has at most five events (accepted, turn started,
/// turn ended, and its terminal event; or its rejection).
#[derive(Default)]
struct Inbox {
    events: VecDeque<MessageEvent>,
    /// Every sender is gone: once `events` is empty, nothing more will come.
    senders_gone: bool,
    /// The stream is gone: deliveries are refused.
    stream_gone: bool,
}

/// The delivering side's hold on the inbox; dropping it (the last sink) ends the stream.
struct InboxSender(Arc<Mutex<Inbox>>);

impl Drop for InboxSender {
    fn drop(&mut self) {
        lock(&self.0).senders_gone = true;
    }
}

impl Inbox {
    /// Queues `event`, or hands it back when the stream is gone.
    fn push(&mut self, event: MessageEvent) -> Result<(), MessageEvent> {
        if self.stream_gone {
            return Err(event);
        }
        if let EventKind::Partial(_) = event.kind
            && let Some(last) = self.events.back_mut()
            && matches!(last.kind, EventKind::Partial(_))
        {
            *last = event;
            return Ok(());
        }
        self.events.push_back(event);
        Ok(())
    }

    fn pop(&mut self) -> Result<MessageEvent, TryRecvError> {
        match self.events.pop_front() {
            Some(event) => Ok(event),
            None if self.senders_gone => Err(TryRecvError::Disconnected),
            None => Err(TryRecvError::Empty),
        }
    }
}

struct WakeOnDrop(Arc<WakerSlot>);

impl Drop for WakeOnDrop {
    fn drop(&mut self) {
        self.0.wake();
    }
}

impl StreamSink {
    /// Delivers `event` and wakes the stream's task; hands the event back if the stream is
    /// gone.
    pub(super) fn deliver(&self, event: MessageEvent) -> Result<(), MessageEvent> {
        let sent = lock(&self.0.tx.0).push(event);
        self.0.slot.0.wake();
        sent
    }
}

impl std::fmt::Debug for StreamSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StreamSink")
    }
}

/// The events of one message, as a [`Stream`] that ends after its terminal event
/// ([`EventKind::Finished`] or [`EventKind::Rejected`]), or early (with no terminal event) if
/// the runtime stopped before taking the message.
///
/// Made by [`Handle::submit_stream`] or [`Handle::submit_stream_async`]. The reactor wakes the
/// task when it delivers an event; nothing polls on a timer. Dropping the stream is allowed at
/// any point: later events are counted in the status as `events_undelivered`.
///
/// Bounded while its consumer is behind: [`EventKind::Partial`] events (each the whole reply
/// so far) are coalesced, only the newest one not yet taken is kept, so a stream left
/// unpolled holds at most one partial beside the handful of other events a message has.
/// Every other event, the terminal one included, is kept and yielded in order.
///
/// ```no_run
/// # async fn example(handle: turnstile::Handle, message: turnstile::Message) {
/// let mut events = handle.submit_stream(message).expect("ingress has room");
/// while let Some(event) = events.recv().await {
///     println!("{:?}", event.kind);
/// }
/// # }
/// ```
pub struct EventStream {
    inbox: Arc<Mutex<Inbox>>,
    slot: Arc<WakerSlot>,
    room: Arc<Room>,
    done: bool,
}

impl EventStream {
    fn pair(room: Arc<Room>) -> (StreamSink, EventStream) {
        let inbox = Arc::new(Mutex::new(Inbox::default()));
        let slot = Arc::new(WakerSlot::default());
        let sink = StreamSink(Arc::new(StreamTx {
            tx: InboxSender(Arc::clone(&inbox)),
            slot: WakeOnDrop(Arc::clone(&slot)),
        }));
        let stream = EventStream {
            inbox,
            slot,
            room,
            done: false,
        };
        (sink, stream)
    }

    /// The next event, or `None` after the terminal one: [`Stream::poll_next`] as an
    /// inherent `async` method, for runtimes without a `StreamExt`.
    ///
    /// ```no_run
    /// # async fn example(mut events: turnstile::EventStream) {
    /// while let Some(event) = events.recv().await {
    ///     println!("{} {:?}", event.id, event.kind);
    /// }
    /// # }
    /// ```
    pub fn recv(&mut self) -> impl Future<Output = Option<MessageEvent>> + '_ {
        std::future::poll_fn(|cx| Pin::new(&mut *self).poll_next(cx))
    }

    fn ended(&mut self) -> Poll<Option<MessageEvent>> {
        self.done = true;
        Poll::Ready(None)
    }

    fn try_recv(&self) -> Result<MessageEvent, TryRecvError> {
        lock(&self.inbox).pop()
    }
}

impl Drop for EventStream {
    fn drop(&mut self) {
        let mut inbox = lock(&self.inbox);
        inbox.stream_gone = true;
        inbox.events.clear();
    }
}

impl std::fmt::Debug for EventStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventStream")
            .field("buffered", &lock(&self.inbox).events.len())
            .field("done", &self.done)
            .finish()
    }
}

impl Stream for EventStream {
    type Item = MessageEvent;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<MessageEvent>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        let event = match this.try_recv() {
            Ok(event) => event,
            Err(TryRecvError::Disconnected) => return this.ended(),
            Err(TryRecvError::Empty) => {
                // Register, then look again: an event delivered between the first look and
                // the registration would otherwise wait for a wake that already happened.
                this.slot.register(cx.waker());
                // Read before looking again, so that if the reactor is gone everything it
                // delivered is seen by that look; then an empty channel means nothing more
                // will come (the message was sent after the reactor's last drain).
                let closed = this.room.is_closed();
                match this.try_recv() {
                    Ok(event) => event,
                    Err(TryRecvError::Empty) if !closed => return Poll::Pending,
                    Err(_) => return this.ended(),
                }
            }
        };
        this.done = matches!(event.kind, EventKind::Finished(_) | EventKind::Rejected(_));
        Poll::Ready(Some(event))
    }
}

impl FusedStream for EventStream {
    fn is_terminated(&self) -> bool {
        self.done
    }
}

/// A submit waiting for room in the ingress channel; made by [`Handle::submit_async`] and
/// [`Handle::submit_to_async`]. Resolves to what [`Handle::submit_to`] returns, except that it
/// is never [`SubmitError::Backpressure`]: it waits until the reactor drains the channel.
///
/// Dropping it before it resolves withdraws the message (it was never sent). Waiting submits
/// are all woken after each drain and race for the room, so among submits waiting at the same
/// time there is no first-come order; one task awaiting its submits one after another keeps
/// its own order.
#[must_use = "a submit does nothing unless awaited"]
pub struct Submit<'a> {
    handle: &'a Handle,
    item: Option<(Message, Route)>,
    key: Option<usize>,
}

impl std::fmt::Debug for Submit<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Submit")
            .field("message", &self.item.as_ref().map(|(m, _)| &m.id))
            .field("waiting", &self.key.is_some())
            .finish()
    }
}

impl Submit<'_> {
    fn finish(&mut self, result: Result<(), SubmitError>) -> Poll<Result<(), SubmitError>> {
        self.handle.room.unregister(&mut self.key);
        Poll::Ready(result)
    }
}

impl Future for Submit<'_> {
    type Output = Result<(), SubmitError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let Some(item) = this.item.take() else {
            panic!("Submit polled after it resolved");
        };
        let item = match this.handle.try_send(item) {
            Attempt::Full(item) => item,
            Attempt::Done(result) => return this.finish(result),
        };
        // Register, then retry: room made between the failed send and the registration
        // would otherwise go unnoticed until the next drain, which may never come.
        this.handle.room.register(&mut this.key, cx.waker());
        if this.handle.room.is_closed() {
            return this.finish(Err(SubmitError::Closed(item.0)));
        }
        match this.handle.try_send(item) {
            Attempt::Full(item) => {
                this.item = Some(item);
                Poll::Pending
            }
            Attempt::Done(result) => this.finish(result),
        }
    }
}

impl FusedFuture for Submit<'_> {
    fn is_terminated(&self) -> bool {
        self.item.is_none()
    }
}

impl Drop for Submit<'_> {
    fn drop(&mut self) {
        self.handle.room.unregister(&mut self.key);
    }
}

/// One try at the ingress channel: done (sent, or the runtime is gone), or full with the
/// item handed back for a later try.
enum Attempt {
    Done(Result<(), SubmitError>),
    Full((Message, Route)),
}

/// A submit waiting for room whose events come as an [`EventStream`]; made by
/// [`Handle::submit_stream_async`].
#[must_use = "a submit does nothing unless awaited"]
#[derive(Debug)]
pub struct SubmitStream<'a> {
    submit: Submit<'a>,
    stream: Option<EventStream>,
}

impl Future for SubmitStream<'_> {
    type Output = Result<EventStream, SubmitError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        match Pin::new(&mut this.submit).poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Ready(Ok(())) => match this.stream.take() {
                Some(stream) => Poll::Ready(Ok(stream)),
                None => panic!("SubmitStream polled after it resolved"),
            },
        }
    }
}

impl FusedFuture for SubmitStream<'_> {
    fn is_terminated(&self) -> bool {
        self.submit.is_terminated()
    }
}

/// Resolves when its [`CancelToken`] fires (at once if it already has); made by
/// [`CancelToken::cancelled`].
#[must_use = "futures do nothing unless awaited"]
#[derive(Debug)]
pub struct Cancelled {
    token: CancelToken,
    key: Option<usize>,
    done: bool,
}

impl Future for Cancelled {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        if this.token.poll_fired(&mut this.key, cx.waker()) {
            this.done = true;
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

impl FusedFuture for Cancelled {
    fn is_terminated(&self) -> bool {
        self.done
    }
}

impl Drop for Cancelled {
    fn drop(&mut self) {
        self.token.forget_waker(self.key);
    }
}

impl CancelToken {
    /// A future that resolves when the token fires, so an async agent body can `select!` on
    /// it beside its work. Resolves at once if the token has already fired. It owns a clone
    /// of the token, so it may outlive the borrow it was made from (e.g. in a spawned task).
    ///
    /// ```
    /// use std::future::Future;
    /// use std::pin::Pin;
    /// use std::task::{Context, Waker};
    ///
    /// let token = turnstile::CancelToken::new();
    /// let mut cancelled = token.cancelled();
    /// let mut cx = Context::from_waker(Waker::noop());
    /// assert!(Pin::new(&mut cancelled).poll(&mut cx).is_pending());
    /// token.cancel(); // the reactor does this on `/stop`, a timeout or shutdown
    /// assert!(Pin::new(&mut cancelled).poll(&mut cx).is_ready());
    /// // In an agent: tokio::select! { _ = cancel.cancelled() => Err(TurnError::Cancelled), … }
    /// ```
    pub fn cancelled(&self) -> Cancelled {
        Cancelled {
            token: self.clone(),
            key: None,
            done: false,
        }
    }
}

impl Handle {
    fn try_send(&self, item: (Message, Route)) -> Attempt {
        match self.ingress.try_send(item) {
            Ok(()) => {
                self.notifier.notify();
                Attempt::Done(Ok(()))
            }
            Err(TrySendError::Full(item)) => Attempt::Full(item),
            Err(TrySendError::Disconnected((m, _))) => Attempt::Done(Err(SubmitError::Closed(m))),
        }
    }

    /// Submits a message whose events come as an [`EventStream`]. Never blocks: a full
    /// ingress channel is [`SubmitError::Backpressure`] (see [`Handle::submit_stream_async`]
    /// to wait instead).
    ///
    /// ```no_run
    /// # fn example(handle: turnstile::Handle) -> Result<(), Box<dyn std::error::Error>> {
    /// let chat = turnstile::SessionKey::dm("telegram", "42")?;
    /// let events = handle.submit_stream(turnstile::Message::new("m1", chat, "hello")?)?;
    /// # drop(events);
    /// # Ok(())
    /// # }
    /// ```
    pub fn submit_stream(&self, message: Message) -> Result<EventStream, SubmitError> {
        let (sink, stream) = EventStream::pair(Arc::clone(&self.room));
        match self.try_send((message, Route::Stream(sink))) {
            Attempt::Done(result) => result.map(|()| stream),
            Attempt::Full((m, _)) => Err(SubmitError::Backpressure(m)),
        }
    }

    /// Submits a message, waiting for room in the ingress channel; its events go to the
    /// runtime's [`Events`](super::Events). Fails only with [`SubmitError::Closed`].
    ///
    /// ```no_run
    /// # async fn example(handle: turnstile::Handle, message: turnstile::Message) {
    /// handle.submit_async(message).await.expect("runtime running");
    /// # }
    /// ```
    pub fn submit_async(&self, message: Message) -> Submit<'_> {
        self.submit_route_async(message, Route::Default)
    }

    /// Submits a message whose events go to `sink`, waiting for room in the ingress channel.
    /// Fails only with [`SubmitError::Closed`].
    ///
    /// ```no_run
    /// # async fn example(handle: turnstile::Handle, message: turnstile::Message) {
    /// // One message's events (accepted, throttled partials, one terminal): bounded by its turn.
    /// let (sink, events) = crossbeam_channel::unbounded();
    /// handle.submit_to_async(message, sink).await.expect("runtime running");
    /// # drop(events);
    /// # }
    /// ```
    pub fn submit_to_async(&self, message: Message, sink: EventSink) -> Submit<'_> {
        self.submit_route_async(message, Route::Sink(sink))
    }

    /// Submits a message whose events come as an [`EventStream`], waiting for room in the
    /// ingress channel. Fails only with [`SubmitError::Closed`].
    ///
    /// ```no_run
    /// # async fn example(handle: turnstile::Handle, message: turnstile::Message) {
    /// let events = handle.submit_stream_async(message).await.expect("runtime running");
    /// # drop(events);
    /// # }
    /// ```
    pub fn submit_stream_async(&self, message: Message) -> SubmitStream<'_> {
        let (sink, stream) = EventStream::pair(Arc::clone(&self.room));
        SubmitStream {
            submit: self.submit_route_async(message, Route::Stream(sink)),
            stream: Some(stream),
        }
    }

    fn submit_route_async(&self, message: Message, route: Route) -> Submit<'_> {
        Submit {
            handle: self,
            item: Some((message, route)),
            key: None,
        }
    }
}

#[cfg(test)]
mod tests {
    //! What only a race reaches from outside: the reactor's last drain is over (the room is
    //! closed) while the ingress channel still has a receiver.

    use std::task::Waker;

    use super::*;
    use crate::agent::EchoAgent;
    use crate::core::{AcceptState, EventKind};
    use crate::message::SessionKey;
    use crate::reactor::Builder;

    fn message(id: &str) -> Message {
        let session = SessionKey::dm("unit", "closed").expect("key");
        Message::new(id, session, "x").expect("message")
    }

    fn poll_next(stream: &mut EventStream) -> Poll<Option<MessageEvent>> {
        Pin::new(stream).poll_next(&mut Context::from_waker(Waker::noop()))
    }

    #[test]
    fn a_stream_sees_what_was_delivered_then_ends_once_the_room_is_closed() {
        let room = Arc::new(Room::default());
        let (sink, mut stream) = EventStream::pair(Arc::clone(&room));
        assert!(poll_next(&mut stream).is_pending());
        let accepted = MessageEvent {
            id: "m1".into(),
            session: SessionKey::dm("unit", "closed").expect("key"),
            kind: EventKind::Accepted {
                state: AcceptState::Queued,
                position: 0,
            },
        };
        sink.deliver(accepted.clone()).expect("stream alive");
        room.closed.store(true, Ordering::SeqCst);
        // The sink is still alive, but no reactor is left to use it.
        assert!(matches!(poll_next(&mut stream), Poll::Ready(Some(e)) if e == accepted));
        assert!(matches!(poll_next(&mut stream), Poll::Ready(None)));
        assert!(stream.is_terminated());
        drop(sink);
    }

    fn event(kind: EventKind) -> MessageEvent {
        MessageEvent {
            id: "m1".into(),
            session: SessionKey::dm("unit", "bounded").expect("key"),
            kind,
        }
    }

    /// A consumer that is behind holds the newest partial only; every other event, in order.
    #[test]
    fn partials_are_coalesced_while_the_consumer_is_behind() {
        let room = Arc::new(Room::default());
        let (sink, mut stream) = EventStream::pair(room);
        let turn = crate::core::TurnId(7);
        let accepted = EventKind::Accepted {
            state: AcceptState::Running,
            position: 0,
        };
        sink.deliver(event(accepted.clone())).expect("alive");
        sink.deliver(event(EventKind::TurnStarted(turn)))
            .expect("alive");
        let mut so_far = String::new();
        for i in 0..1_000 {
            so_far.push_str(&format!("{i} "));
            sink.deliver(event(EventKind::Partial(so_far.clone())))
                .expect("alive");
        }
        let held = lock(&stream.inbox).events.len();
        assert_eq!(held, 3, "{stream:?}");
        let next = |s: &mut EventStream| match poll_next(s) {
            Poll::Ready(Some(e)) => e.kind,
            other => panic!("expected an event, got {other:?}"),
        };
        assert_eq!(next(&mut stream), accepted);
        assert_eq!(next(&mut stream), EventKind::TurnStarted(turn));
        assert_eq!(next(&mut stream), EventKind::Partial(so_far.clone()));
        // Taken: the next partial queues anew; a turn end between two partials splits them.
        sink.deliver(event(EventKind::Partial("a".into())))
            .expect("alive");
        sink.deliver(event(EventKind::TurnEnded(turn)))
            .expect("alive");
        let outcome = crate::core::Outcome::Reply(so_far.as_str().into());
        sink.deliver(event(EventKind::Finished(outcome.clone())))
            .expect("alive");
        assert_eq!(next(&mut stream), EventKind::Partial("a".into()));
        assert_eq!(next(&mut stream), EventKind::TurnEnded(turn));
        assert_eq!(next(&mut stream), EventKind::Finished(outcome));
        assert!(matches!(poll_next(&mut stream), Poll::Ready(None)));
        // A stream dropped refuses what comes after.
        let (sink, stream) = EventStream::pair(Arc::new(Room::default()));
        drop(stream);
        assert!(sink.deliver(event(EventKind::Partial("x".into()))).is_err());
        // Every sink dropped: the stream ends once it is empty.
        let (sink, mut stream) = EventStream::pair(Arc::new(Room::default()));
        sink.deliver(event(EventKind::Partial("y".into())))
            .expect("alive");
        drop(sink);
        assert_eq!(next(&mut stream), EventKind::Partial("y".into()));
        assert!(matches!(poll_next(&mut stream), Poll::Ready(None)));
    }

    #[test]
    fn a_waiting_submit_ends_closed_once_the_room_is_closed() {
        let (rt, handle, _events) = Builder::new(EchoAgent::factory(std::time::Duration::ZERO))
            .ingress_capacity(1)
            .build()
            .expect("settings");
        handle.submit(message("a")).expect("the one slot");
        rt.room.room.closed.store(true, Ordering::SeqCst);
        let mut submit = handle.submit_async(message("b"));
        let cx = &mut Context::from_waker(Waker::noop());
        match Pin::new(&mut submit).poll(cx) {
            Poll::Ready(Err(SubmitError::Closed(m))) => assert_eq!(&*m.id, "b"),
            other => panic!("expected closed, got {other:?}"),
        }
        drop(rt);
    }
}
