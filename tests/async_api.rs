//! The `async` feature: event streams, `CancelToken::cancelled()`, submits that wait out
//! backpressure. Run with `cargo test --features async --test async_api`.
//!
//! No async runtime and no sleeps: futures are polled by hand with a waker that counts its
//! wakes, so a test sees that the reactor woke the task (not that a busy poll found the
//! result), and waits on that count with a timeout that only bounds a failing run. Ingress
//! backpressure is made deterministic the way `tests/runtime.rs` makes it: a runtime built with
//! room for one submission and not yet running.

use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::thread;
use std::time::{Duration, Instant};

use crossbeam_channel::unbounded;
use futures_core::future::FusedFuture;
use futures_core::stream::{FusedStream, Stream};
use turnstile::{
    AcceptState, Agent, Builder, CancelReason, CancelToken, Cancelled, EchoAgent, EventKind,
    EventStream, Events, Handle, Message, MessageEvent, Outcome, RejectReason, Runtime, SessionKey,
    Submit, SubmitError, SubmitStream, TurnError, TurnInput,
};

const WAIT: Duration = Duration::from_secs(20);

/// A waker that counts its wakes and lets a thread wait for the next one.
#[derive(Default)]
struct Signal {
    wakes: Mutex<usize>,
    cond: Condvar,
}

impl Wake for Signal {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        *self.wakes.lock().expect("lock") += 1;
        self.cond.notify_all();
    }
}

impl Signal {
    fn new() -> Arc<Signal> {
        Arc::default()
    }

    fn count(&self) -> usize {
        *self.wakes.lock().expect("lock")
    }

    /// Waits until woken more than `seen` times; returns the count.
    fn wait_past(&self, seen: usize) -> usize {
        let deadline = Instant::now() + WAIT;
        let mut wakes = self.wakes.lock().expect("lock");
        while *wakes <= seen {
            let left = deadline
                .checked_duration_since(Instant::now())
                .expect("a wake before the timeout");
            wakes = self.cond.wait_timeout(wakes, left).expect("lock").0;
        }
        *wakes
    }
}

/// Polls `f` once with `signal`'s waker.
fn poll_once<F: Future + Unpin>(f: &mut F, signal: &Arc<Signal>) -> Poll<F::Output> {
    let waker = Waker::from(Arc::clone(signal));
    Pin::new(f).poll(&mut Context::from_waker(&waker))
}

fn poll_next(stream: &mut EventStream, signal: &Arc<Signal>) -> Poll<Option<MessageEvent>> {
    let waker = Waker::from(Arc::clone(signal));
    Pin::new(stream).poll_next(&mut Context::from_waker(&waker))
}

/// A one-future executor: polls only after a wake.
fn block_on<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    let signal = Signal::new();
    let waker = Waker::from(Arc::clone(&signal));
    let mut cx = Context::from_waker(&waker);
    loop {
        let seen = signal.count();
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        signal.wait_past(seen);
    }
}

fn collect(mut stream: EventStream) -> Vec<EventKind> {
    block_on(async move {
        let mut kinds = Vec::new();
        while let Some(event) = stream.recv().await {
            kinds.push(event.kind);
        }
        kinds
    })
}

fn key(chat: &str) -> SessionKey {
    SessionKey::dm("test", chat).expect("valid key")
}

fn msg(id: &str, chat: &str, text: &str) -> Message {
    Message::new(id, key(chat), text).expect("valid message")
}

fn echo() -> Builder {
    Builder::new(EchoAgent::factory(Duration::ZERO))
}

/// A runtime with room for one submission, filled with message `a`, not yet running.
fn full_ingress() -> (Runtime, Handle, Events) {
    let (rt, handle, events) = echo().ingress_capacity(1).build().expect("settings");
    handle.submit(msg("a", "full", "x")).expect("the one slot");
    match handle.submit(msg("probe", "full", "x")) {
        Err(SubmitError::Backpressure(_)) => {}
        other => panic!("expected a full ingress, got {other:?}"),
    }
    (rt, handle, events)
}

fn stop(handle: &Handle, reactor: turnstile::RuntimeThread) {
    handle.shutdown();
    let report = reactor.join().expect("reactor");
    assert!(report.clean, "{report:?}");
}

/// Terminal outcomes on the default stream, by message id, until `n` arrived.
fn finished(events: &Events, n: usize) -> Vec<(String, Outcome)> {
    let mut done = Vec::new();
    while done.len() < n {
        let e = events
            .recv_timeout(WAIT)
            .expect("an event before the timeout");
        if let EventKind::Finished(o) = e.kind {
            done.push((e.id.to_string(), o));
        }
    }
    done.sort_by(|a, b| a.0.cmp(&b.0));
    done
}

fn reply(text: &str) -> Outcome {
    Outcome::Reply(text.into())
}

#[test]
fn the_futures_and_stream_can_move_between_threads() {
    fn send_unpin<T: Send + Unpin>() {}
    send_unpin::<Submit<'static>>();
    send_unpin::<SubmitStream<'static>>();
    send_unpin::<Cancelled>();
    send_unpin::<EventStream>();
}

#[test]
fn a_stream_yields_a_messages_events_in_order_and_ends_after_its_terminal_event() {
    let (rt, handle, _events) = echo().build().expect("settings");
    let reactor = rt.spawn().expect("reactor thread");
    let mut stream = handle
        .submit_stream(msg("m1", "order", "hello"))
        .expect("room");
    assert!(!stream.is_terminated());
    let kinds = block_on(async {
        let mut kinds = Vec::new();
        while let Some(event) = stream.recv().await {
            assert_eq!(&*event.id, "m1");
            kinds.push(event.kind);
        }
        kinds
    });
    match kinds.as_slice() {
        [
            EventKind::Accepted {
                state: AcceptState::Running,
                position: 0,
            },
            EventKind::TurnStarted(t),
            EventKind::TurnEnded(u),
            EventKind::Finished(Outcome::Reply(r)),
        ] if t == u && r.text == "hello" => {}
        other => panic!("unexpected events: {other:?}"),
    }
    // Fused: it stays ended.
    assert!(stream.is_terminated());
    assert!(matches!(
        poll_next(&mut stream, &Signal::new()),
        Poll::Ready(None)
    ));
    stop(&handle, reactor);
}

#[test]
fn a_stream_polled_before_its_events_exist_is_woken_by_the_reactor() {
    let (rt, handle, _events) = echo().build().expect("settings");
    let mut stream = handle.submit_stream(msg("m1", "wake", "hi")).expect("room");
    let signal = Signal::new();
    // The reactor is not running: nothing can arrive yet.
    assert!(poll_next(&mut stream, &signal).is_pending());
    assert_eq!(signal.count(), 0);
    let reactor = rt.spawn().expect("reactor thread");
    // Polled again only after the reactor's wake: no busy poll found the event.
    signal.wait_past(0);
    match poll_next(&mut stream, &signal) {
        Poll::Ready(Some(e)) => assert!(matches!(e.kind, EventKind::Accepted { .. }), "{e:?}"),
        other => panic!("expected the accepted event after the wake, got {other:?}"),
    }
    let rest = collect(stream);
    assert!(matches!(rest.last(), Some(EventKind::Finished(o)) if *o == reply("hi")));
    stop(&handle, reactor);
}

#[test]
fn a_rejected_messages_stream_ends_after_the_rejection() {
    // One worker, one waiting message per session: all three are taken in one drain, so the
    // third finds the queue full whatever the timing.
    let (rt, handle, _events) = echo()
        .turn_workers(1)
        .queue_cap(1)
        .build()
        .expect("settings");
    let first = handle.submit_stream(msg("m1", "cap", "one")).expect("room");
    let second = handle.submit_stream(msg("m2", "cap", "two")).expect("room");
    let third = handle
        .submit_stream(msg("m3", "cap", "three"))
        .expect("room");
    let reactor = rt.spawn().expect("reactor thread");
    assert_eq!(
        collect(third),
        vec![EventKind::Rejected(RejectReason::QueueFull)]
    );
    assert!(matches!(collect(first).last(), Some(EventKind::Finished(o)) if *o == reply("one")));
    assert!(matches!(collect(second).last(), Some(EventKind::Finished(o)) if *o == reply("two")));
    stop(&handle, reactor);
}

#[test]
fn events_of_a_dropped_stream_are_counted_undelivered() {
    let (rt, handle, _events) = echo().build().expect("settings");
    drop(
        handle
            .submit_stream(msg("m1", "dropped", "lost"))
            .expect("room"),
    );
    let reactor = rt.spawn().expect("reactor thread");
    // Accepted, turn started, turn ended, finished: four events with nowhere to go.
    let status = handle.wait_status(WAIT, |s| {
        s.turns.completed == 1 && s.messages.events_undelivered == 4
    });
    assert!(status.is_some(), "last status: {:?}", handle.status());
    stop(&handle, reactor);
}

#[test]
fn a_stream_ends_when_the_runtime_stops_before_taking_its_message() {
    let (rt, handle, _events) = echo().build().expect("settings");
    let mut stream = handle
        .submit_stream(msg("m1", "stranded", "hi"))
        .expect("room");
    let signal = Signal::new();
    assert!(poll_next(&mut stream, &signal).is_pending());
    // The runtime never runs: its message is dropped, and the stream is told so.
    drop(rt);
    assert_eq!(signal.count(), 1);
    assert!(matches!(poll_next(&mut stream, &signal), Poll::Ready(None)));
    assert!(stream.is_terminated());
}

#[test]
fn submitting_to_a_stopped_runtime_is_closed() {
    let (rt, handle, _events) = echo().build().expect("settings");
    drop(rt);
    match block_on(handle.submit_async(msg("m1", "closed", "hi"))) {
        Err(SubmitError::Closed(m)) => assert_eq!(&*m.id, "m1"),
        other => panic!("expected closed, got {other:?}"),
    }
    match block_on(handle.submit_stream_async(msg("m2", "closed", "hi"))) {
        Err(SubmitError::Closed(m)) => assert_eq!(&*m.id, "m2"),
        other => panic!("expected closed, got {other:?}"),
    }
    match handle.submit_stream(msg("m3", "closed", "hi")) {
        Err(SubmitError::Closed(m)) => assert_eq!(&*m.id, "m3"),
        other => panic!("expected closed, got {other:?}"),
    }
}

#[test]
fn submit_stream_reports_backpressure_when_the_ingress_is_full() {
    let (_rt, handle, _events) = full_ingress();
    match handle.submit_stream(msg("b", "full", "y")) {
        Err(SubmitError::Backpressure(m)) => assert_eq!(&*m.id, "b"),
        other => panic!("expected backpressure, got {other:?}"),
    }
}

#[test]
fn an_async_submit_waits_while_the_ingress_is_full_and_proceeds_when_drained() {
    let (rt, handle, events) = full_ingress();
    let mut submit = handle.submit_async(msg("b", "full", "y"));
    let signal = Signal::new();
    assert!(poll_once(&mut submit, &signal).is_pending());
    assert!(!submit.is_terminated());
    assert_eq!(signal.count(), 0);
    // Waiting does not take the slot from anyone: the channel is still full.
    assert!(matches!(
        handle.submit(msg("c", "full", "z")),
        Err(SubmitError::Backpressure(_))
    ));
    let reactor = rt.spawn().expect("reactor thread");
    signal.wait_past(0);
    assert!(matches!(
        poll_once(&mut submit, &signal),
        Poll::Ready(Ok(()))
    ));
    assert!(submit.is_terminated());
    drop(submit);
    assert_eq!(
        finished(&events, 2),
        vec![("a".into(), reply("x")), ("b".into(), reply("y"))]
    );
    stop(&handle, reactor);
}

#[test]
fn an_async_stream_submit_waits_for_room_then_streams() {
    let (rt, handle, _events) = full_ingress();
    let mut submit = handle.submit_stream_async(msg("b", "full", "y"));
    let signal = Signal::new();
    assert!(poll_once(&mut submit, &signal).is_pending());
    assert!(!submit.is_terminated());
    assert_eq!(signal.count(), 0);
    let reactor = rt.spawn().expect("reactor thread");
    signal.wait_past(0);
    let stream = match poll_once(&mut submit, &signal) {
        Poll::Ready(Ok(stream)) => stream,
        other => panic!("expected the stream after the wake, got {other:?}"),
    };
    assert!(submit.is_terminated());
    let kinds = collect(stream);
    assert!(
        matches!(kinds.first(), Some(EventKind::Accepted { .. })),
        "{kinds:?}"
    );
    assert!(matches!(kinds.last(), Some(EventKind::Finished(o)) if *o == reply("y")));
    stop(&handle, reactor);
}

#[test]
fn a_waiting_submit_is_closed_when_the_runtime_stops() {
    let (rt, handle, _events) = full_ingress();
    let mut submit = handle.submit_async(msg("b", "full", "y"));
    let signal = Signal::new();
    assert!(poll_once(&mut submit, &signal).is_pending());
    drop(rt);
    assert_eq!(signal.count(), 1);
    match poll_once(&mut submit, &signal) {
        Poll::Ready(Err(SubmitError::Closed(m))) => assert_eq!(&*m.id, "b"),
        other => panic!("expected closed, got {other:?}"),
    }
}

#[test]
fn a_dropped_waiting_submit_withdraws_its_message_and_its_waker() {
    let (rt, handle, events) = full_ingress();
    let dropped = Signal::new();
    let mut withdrawn = handle.submit_async(msg("b", "full", "never"));
    assert!(poll_once(&mut withdrawn, &dropped).is_pending());
    drop(withdrawn);
    let waiting = Signal::new();
    let mut submit = handle.submit_async(msg("c", "full", "z"));
    assert!(poll_once(&mut submit, &waiting).is_pending());
    let reactor = rt.spawn().expect("reactor thread");
    waiting.wait_past(0);
    assert!(matches!(
        poll_once(&mut submit, &waiting),
        Poll::Ready(Ok(()))
    ));
    assert_eq!(dropped.count(), 0, "a dropped submit's waker was woken");
    assert_eq!(
        finished(&events, 2),
        vec![("a".into(), reply("x")), ("c".into(), reply("z"))]
    );
    stop(&handle, reactor);
}

#[test]
fn a_repolled_submit_wakes_only_its_latest_waker() {
    let (rt, handle, _events) = full_ingress();
    let (old, new) = (Signal::new(), Signal::new());
    let mut submit = handle.submit_async(msg("b", "full", "y"));
    assert!(poll_once(&mut submit, &old).is_pending());
    assert!(poll_once(&mut submit, &new).is_pending());
    let reactor = rt.spawn().expect("reactor thread");
    new.wait_past(0);
    assert_eq!(old.count(), 0);
    assert!(matches!(poll_once(&mut submit, &new), Poll::Ready(Ok(()))));
    stop(&handle, reactor);
}

#[test]
fn many_waiting_submits_all_get_in_through_a_one_slot_ingress() {
    let (rt, handle, events) = full_ingress();
    thread::scope(|s| {
        // They race each other for the slot each drain frees: every loser registers again.
        let submitters: Vec<_> = (0..8)
            .map(|i| {
                let handle = &handle;
                s.spawn(move || {
                    block_on(handle.submit_async(msg(&format!("m{i}"), &format!("c{i}"), "t")))
                        .map_err(|e| e.to_string())
                })
            })
            .collect();
        let reactor = rt.spawn().expect("reactor thread");
        for t in submitters {
            t.join().expect("submitter").expect("submitted");
        }
        assert_eq!(finished(&events, 9).len(), 9);
        stop(&handle, reactor);
    });
}

#[test]
fn submit_to_async_sends_the_events_to_the_given_sink() {
    let (rt, handle, _events) = echo().build().expect("settings");
    let reactor = rt.spawn().expect("reactor thread");
    let (sink, mine) = unbounded();
    block_on(handle.submit_to_async(msg("m1", "sink", "hi"), sink)).expect("submitted");
    assert_eq!(finished(&mine, 1), vec![("m1".into(), reply("hi"))]);
    stop(&handle, reactor);
}

#[test]
fn cancelled_resolves_when_the_token_fires() {
    let token = CancelToken::new();
    let mut cancelled = token.cancelled();
    let signal = Signal::new();
    assert!(poll_once(&mut cancelled, &signal).is_pending());
    assert!(!cancelled.is_terminated());
    let other = token.clone();
    thread::spawn(move || other.cancel())
        .join()
        .expect("canceller");
    assert_eq!(signal.count(), 1);
    assert!(poll_once(&mut cancelled, &signal).is_ready());
    assert!(cancelled.is_terminated());
}

#[test]
fn cancelled_is_ready_at_first_poll_when_the_token_already_fired() {
    let token = CancelToken::new();
    token.cancel();
    let signal = Signal::new();
    assert!(poll_once(&mut token.cancelled(), &signal).is_ready());
    assert_eq!(signal.count(), 0);
}

#[test]
fn a_dropped_cancelled_future_is_not_woken_and_a_repolled_one_wakes_its_latest_waker() {
    let token = CancelToken::new();
    let dropped = Signal::new();
    let mut gone = token.cancelled();
    assert!(poll_once(&mut gone, &dropped).is_pending());
    drop(gone);
    let (old, new) = (Signal::new(), Signal::new());
    let mut cancelled = token.cancelled();
    assert!(poll_once(&mut cancelled, &old).is_pending());
    assert!(poll_once(&mut cancelled, &new).is_pending());
    token.cancel();
    assert_eq!((dropped.count(), old.count(), new.count()), (0, 0, 1));
    // A future that outlived the cancel drops cleanly.
    assert!(poll_once(&mut cancelled, &new).is_ready());
}

/// An agent whose turn is an async body: it awaits the cancellation.
struct AwaitsCancel;

impl Agent for AwaitsCancel {
    fn turn(&mut self, _: &TurnInput<'_>, cancel: &CancelToken) -> Result<String, TurnError> {
        block_on(cancel.cancelled());
        Err(TurnError::Cancelled)
    }
}

#[test]
fn an_async_agent_body_awaiting_cancelled_honours_a_stop() {
    let (rt, handle, _events) = Builder::from_fn(|_session| AwaitsCancel)
        .build()
        .expect("settings");
    let reactor = rt.spawn().expect("reactor thread");
    let mut stream = handle
        .submit_stream(msg("m1", "stop", "work"))
        .expect("room");
    block_on(async {
        while let Some(e) = stream.recv().await {
            if matches!(e.kind, EventKind::TurnStarted(_)) {
                return;
            }
        }
        panic!("the stream ended before the turn started");
    });
    let stop_cmd = handle
        .submit_stream(msg("s1", "stop", "/stop"))
        .expect("room");
    let rest = collect(stream);
    assert!(
        matches!(
            rest.last(),
            Some(EventKind::Finished(Outcome::Cancelled(
                CancelReason::Stopped
            )))
        ),
        "{rest:?}"
    );
    assert!(matches!(
        collect(stop_cmd).last(),
        Some(EventKind::Finished(Outcome::Reply(_)))
    ));
    stop(&handle, reactor);
}
