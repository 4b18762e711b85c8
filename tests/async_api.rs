//! The `async` feature: event streams, `CancelToken::cancelled()`, submits that wait out
//! backpressure. Run with `cargo test --features async --test async_api`.
//!
//! No async runtime and no sleeps: futures are polled by hand with a waker that counts its
//! wakes, so a test sees that the reactor woke the task (not that a busy poll found the
//! result), and waits on that count with a timeout that only bounds a failing run. Ingress
//! backpressure is made deterministic the way `tests/runtime.rs` makes it: a runtime built with
//! room for one submission and not yet running.

mod common;

use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::thread;
use std::time::{Duration, Instant};

use common::eventually;
use crossbeam_channel::unbounded;
use futures_core::future::FusedFuture;
use futures_core::stream::{FusedStream, Stream};
use turnstile::{
    AcceptState, Agent, AgentFuture, AsyncAgent, Builder, CancelReason, CancelToken, Cancelled,
    EchoAgent, EventKind, EventStream, Events, FailReason, Handle, Message, MessageEvent, Outcome,
    RejectReason, Runtime, SessionKey, Submit, SubmitError, SubmitStream, Task, TurnError,
    TurnInput, WaitError,
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

// ---------------------------------------------------------------------------------------
// Async agents (`Builder::new_async`): turns and closes as tasks on a real tokio executor.
// The agents report what happens to them on a channel; a gate (a `CancelToken` the test
// fires) holds their turns awaiting, so nothing is ordered by sleeping.
// ---------------------------------------------------------------------------------------

/// What a test agent went through.
#[derive(Debug, Clone, PartialEq)]
enum Seen {
    /// Its turn for this message started (on the executor).
    Started(String),
    /// That turn's future is gone: resolved or dropped.
    TurnGone(String),
    /// Its close started, on the thread named so.
    Closing(String),
    /// Its close's future is gone.
    CloseGone,
}

/// Sends `seen` when dropped: proves a future ended (or was dropped) rather than lingering.
struct OnDrop(crossbeam_channel::Sender<Seen>, Seen);

impl Drop for OnDrop {
    fn drop(&mut self) {
        let _ = self.0.send(self.1.clone());
    }
}

/// Replies with its input once `gate` fires; honours cancellation unless `deaf`; its close
/// waits for `close_gate` (when set).
struct Gated {
    gate: CancelToken,
    deaf: bool,
    close_gate: Option<CancelToken>,
    log: crossbeam_channel::Sender<Seen>,
}

impl AsyncAgent for Gated {
    fn turn<'a>(
        &'a mut self,
        input: &'a TurnInput<'a>,
        cancel: &'a CancelToken,
    ) -> AgentFuture<'a, Result<String, TurnError>> {
        Box::pin(async move {
            let id = input.message_id.to_owned();
            let _gone = OnDrop(self.log.clone(), Seen::TurnGone(id.clone()));
            let _ = self.log.send(Seen::Started(id));
            if self.deaf {
                self.gate.cancelled().await;
            } else {
                tokio::select! {
                    _ = self.gate.cancelled() => {}
                    _ = cancel.cancelled() => return Err(TurnError::Cancelled),
                }
            }
            Ok(input.text.to_owned())
        })
    }

    fn close(&mut self) -> AgentFuture<'_, Result<(), turnstile::AgentError>> {
        Box::pin(async move {
            let _gone = OnDrop(self.log.clone(), Seen::CloseGone);
            let thread = thread::current().name().unwrap_or("").to_owned();
            let _ = self.log.send(Seen::Closing(thread));
            if let Some(gate) = &self.close_gate {
                gate.cancelled().await;
            }
            Ok(())
        })
    }
}

/// A tokio executor whose threads are named `exec`, to tell them from turnstile's.
fn executor() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("exec")
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// A runtime of `Gated` agents on `exec`; returns the log of what they went through.
fn gated(
    exec: &tokio::runtime::Runtime,
    gate: &CancelToken,
    deaf: bool,
    close_gate: Option<CancelToken>,
) -> (Builder, crossbeam_channel::Receiver<Seen>) {
    let (log, seen) = unbounded();
    let gate = gate.clone();
    let factory = move |_: &SessionKey| -> Result<Box<dyn AsyncAgent>, String> {
        Ok(Box::new(Gated {
            gate: gate.clone(),
            deaf,
            close_gate: close_gate.clone(),
            log: log.clone(),
        }))
    };
    let tokio = exec.handle().clone();
    let spawner = move |task: Task| {
        tokio.spawn(task);
    };
    (Builder::new_async(factory, spawner), seen)
}

fn next_seen(seen: &crossbeam_channel::Receiver<Seen>) -> Seen {
    seen.recv_timeout(WAIT)
        .expect("the agent reported before the timeout")
}

#[test]
fn async_turns_await_on_the_executor_while_no_turn_worker_is_busy() {
    const N: usize = 6;
    let exec = executor();
    let gate = CancelToken::new();
    let (builder, seen) = gated(&exec, &gate, false, None);
    let (rt, handle, events) = builder.turn_workers(N).build().expect("settings");
    let reactor = rt.spawn().expect("reactor thread");
    for i in 0..N {
        handle
            .submit(msg(&format!("m{i}"), &format!("chat{i}"), &format!("t{i}")))
            .expect("room");
    }
    let mut started: Vec<Seen> = (0..N).map(|_| next_seen(&seen)).collect();
    started.sort_by_key(|s| format!("{s:?}"));
    let expected: Vec<Seen> = (0..N).map(|i| Seen::Started(format!("m{i}"))).collect();
    assert_eq!(started, expected);
    // All N turns are awaiting their gate: the status counts them as async turns in flight,
    // and not one turn-pool thread is busy (the pool has not even started one).
    let status = handle
        .wait_status(WAIT, |s| {
            s.workers.async_turns == N && s.turns.in_flight == N
        })
        .expect("N async turns in flight in the status");
    assert_eq!(status.workers.turn_threads.busy, 0, "{:?}", status.workers);
    assert_eq!(status.workers.turn, 0, "{:?}", status.workers);
    gate.cancel();
    let done = finished(&events, N);
    let want: Vec<(String, Outcome)> = (0..N)
        .map(|i| (format!("m{i}"), reply(&format!("t{i}"))))
        .collect();
    assert_eq!(done, want);
    handle
        .wait_status(WAIT, |s| {
            s.workers.async_turns == 0 && s.turns.completed == N as u64
        })
        .expect("the async turns counted out");
    stop(&handle, reactor);
}

#[test]
fn a_stop_cancels_an_awaiting_async_turn_through_its_cancel_future() {
    let exec = executor();
    let gate = CancelToken::new(); // never fired: only the cancellation ends the turn
    let (builder, seen) = gated(&exec, &gate, false, None);
    let (rt, handle, events) = builder.build().expect("settings");
    let reactor = rt.spawn().expect("reactor thread");
    handle.submit(msg("m1", "stop", "work")).expect("room");
    assert_eq!(next_seen(&seen), Seen::Started("m1".into()));
    handle.submit(msg("s1", "stop", "/stop")).expect("room");
    let done = finished(&events, 2);
    assert_eq!(
        done[0],
        ("m1".into(), Outcome::Cancelled(CancelReason::Stopped))
    );
    assert!(matches!(done[1].1, Outcome::Reply(_)), "{done:?}");
    // The future ended by itself (it returned `Cancelled`), and the agent was kept.
    assert_eq!(next_seen(&seen), Seen::TurnGone("m1".into()));
    let status = handle
        .wait_status(WAIT, |s| {
            s.turns.cancelled == 1 && s.workers.async_turns == 0
        })
        .expect("the cancelled turn counted");
    assert_eq!(status.turns.abandoned, 0);
    stop(&handle, reactor);
}

#[test]
fn an_async_turn_past_its_timeout_is_dropped_and_its_agent_closed_on_the_executor() {
    let exec = executor();
    let gate = CancelToken::new(); // never fired, and the agent ignores its cancellation
    let (builder, seen) = gated(&exec, &gate, true, None);
    let (rt, handle, events) = builder
        .turn_timeout(Duration::from_millis(100))
        .stop_grace(Duration::from_millis(50))
        .build()
        .expect("settings");
    let reactor = rt.spawn().expect("reactor thread");
    handle.submit(msg("m1", "deaf", "work")).expect("room");
    assert_eq!(next_seen(&seen), Seen::Started("m1".into()));
    let done = finished(&events, 1);
    assert_eq!(done[0], ("m1".into(), Outcome::Failed(FailReason::Timeout)));
    // Given up on, the turn's future is dropped (a deaf agent would otherwise await forever),
    // which hands the agent back to be closed — as a task on the executor.
    assert_eq!(next_seen(&seen), Seen::TurnGone("m1".into()));
    match next_seen(&seen) {
        Seen::Closing(thread) => assert!(thread.starts_with("exec"), "closed on {thread}"),
        other => panic!("expected the close, got {other:?}"),
    }
    assert_eq!(next_seen(&seen), Seen::CloseGone);
    let status = handle
        .wait_status(WAIT, |s| {
            s.cleanups.done == 1 && s.workers.async_turns == 0 && s.workers.async_closes == 0
        })
        .expect("the abandoned agent closed");
    assert_eq!(status.turns.abandoned, 1);
    assert_eq!(status.workers.cleanup_threads.busy, 0);
    stop(&handle, reactor);
}

#[test]
fn an_async_close_past_the_cleanup_timeout_counts_as_timed_out_and_is_dropped() {
    let exec = executor();
    let gate = CancelToken::new();
    gate.cancel(); // turns reply at once
    let close_gate = CancelToken::new(); // never fired: every close hangs
    let (builder, seen) = gated(&exec, &gate, false, Some(close_gate));
    let (rt, handle, events) = builder
        .cleanup_timeout(Duration::from_millis(100))
        .build()
        .expect("settings");
    let reactor = rt.spawn().expect("reactor thread");
    handle.submit(msg("m1", "reset", "hi")).expect("room");
    assert_eq!(finished(&events, 1), vec![("m1".into(), reply("hi"))]);
    assert_eq!(next_seen(&seen), Seen::Started("m1".into()));
    assert_eq!(next_seen(&seen), Seen::TurnGone("m1".into()));
    handle.submit(msg("n1", "reset", "/new")).expect("room");
    match next_seen(&seen) {
        Seen::Closing(thread) => assert!(thread.starts_with("exec"), "closed on {thread}"),
        other => panic!("expected the close, got {other:?}"),
    }
    // The deadline applies to the future: past it the close counts as timed out, and its
    // future is dropped rather than left pending on the executor.
    assert_eq!(next_seen(&seen), Seen::CloseGone);
    let status = handle
        .wait_status(WAIT, |s| {
            s.cleanups.timed_out == 1 && s.workers.async_closes == 0
        })
        .expect("the close timed out");
    assert_eq!(status.cleanups.done, 0);
    assert_eq!(status.workers.cleanup_threads.busy, 0);
    handle.shutdown();
    reactor.join().expect("reactor");
}

#[test]
fn shutdown_closes_cached_async_agents_on_the_executor() {
    let exec = executor();
    let gate = CancelToken::new();
    gate.cancel();
    let (builder, seen) = gated(&exec, &gate, false, None);
    let (rt, handle, events) = builder.build().expect("settings");
    let reactor = rt.spawn().expect("reactor thread");
    handle.submit(msg("m1", "a", "one")).expect("room");
    handle.submit(msg("m2", "b", "two")).expect("room");
    assert_eq!(
        finished(&events, 2),
        vec![("m1".into(), reply("one")), ("m2".into(), reply("two"))]
    );
    handle.shutdown();
    let report = reactor.join().expect("reactor");
    assert!(report.clean, "{report:?}");
    assert_eq!(report.cleanups_done, 2, "{report:?}");
    let closes: Vec<Seen> = seen
        .try_iter()
        .filter(|s| matches!(s, Seen::Closing(_)))
        .collect();
    assert_eq!(closes.len(), 2, "{closes:?}");
    for c in closes {
        assert!(
            matches!(&c, Seen::Closing(t) if t.starts_with("exec")),
            "{c:?}"
        );
    }
}

#[test]
fn submit_and_wait_returns_the_outcome_or_says_why_not() {
    let exec = executor();
    let gate = CancelToken::new();
    let (builder, _seen) = gated(&exec, &gate, false, None);
    let (rt, handle, _events) = builder.build().expect("settings");
    let reactor = rt.spawn().expect("reactor thread");
    // The gate is shut: no outcome in time, and the error says which message.
    match handle.submit_and_wait(msg("m1", "sync", "slow"), Duration::from_millis(50)) {
        Err(WaitError::TimedOut { id }) => assert_eq!(&*id, "m1"),
        other => panic!("expected a timeout, got {other:?}"),
    }
    gate.cancel();
    let outcome = handle
        .submit_and_wait(msg("m2", "sync", "fast"), WAIT)
        .expect("an outcome");
    assert_eq!(outcome, reply("fast"));
    handle.shutdown();
    reactor.join().expect("reactor");
    match handle.submit_and_wait(msg("m3", "sync", "late"), WAIT) {
        Err(WaitError::Submit(e)) if matches!(*e, SubmitError::Closed(_)) => {
            assert!(e.to_string().contains("m3"), "{e}");
        }
        other => panic!("expected closed, got {other:?}"),
    }
}

#[test]
fn submit_and_wait_ends_stopped_when_the_runtime_goes_without_taking_the_message() {
    let (rt, handle, _events) = echo().build().expect("settings");
    let waiter = {
        let handle = handle.clone();
        thread::spawn(move || handle.submit_and_wait(msg("m1", "gone", "x"), WAIT))
    };
    // The runtime never ran: once the message sits in its ingress channel, drop it.
    eventually("the message reached the ingress", WAIT, || {
        format!("{handle:?}").contains("queued_submissions: 1")
    });
    drop(rt);
    match waiter.join().expect("waiter") {
        Err(WaitError::Stopped { id }) => assert_eq!(&*id, "m1"),
        other => panic!("expected stopped, got {other:?}"),
    }
}

#[test]
fn a_task_the_executor_drops_still_reports_so_no_message_waits_forever() {
    let gate = CancelToken::new();
    gate.cancel();
    let (log, _seen) = unbounded();
    let factory = move |_: &SessionKey| -> Result<Box<dyn AsyncAgent>, String> {
        Ok(Box::new(Gated {
            gate: gate.clone(),
            deaf: false,
            close_gate: None,
            log: log.clone(),
        }))
    };
    // An executor that has shut down: every task it is given is dropped unpolled.
    let (rt, handle, events) = Builder::new_async(factory, drop::<Task>)
        .build()
        .expect("settings");
    let reactor = rt.spawn().expect("reactor thread");
    handle.submit(msg("m1", "dropped", "x")).expect("room");
    match finished(&events, 1).remove(0) {
        (id, Outcome::Failed(FailReason::Agent(why))) => {
            assert_eq!(id, "m1");
            assert!(why.contains("dropped"), "{why}");
        }
        other => panic!("expected a failed turn, got {other:?}"),
    }
    handle
        .wait_status(WAIT, |s| s.workers.async_turns == 0 && s.turns.failed == 1)
        .expect("the dropped turn counted out");
    stop(&handle, reactor);
}

/// Panics while its turn is being polled.
struct Panics;

impl AsyncAgent for Panics {
    fn turn<'a>(
        &'a mut self,
        input: &'a TurnInput<'a>,
        _: &'a CancelToken,
    ) -> AgentFuture<'a, Result<String, TurnError>> {
        Box::pin(async move {
            std::future::ready(()).await;
            panic!("model exploded on {}", input.message_id);
        })
    }
}

#[test]
fn a_panic_in_an_async_turn_fails_the_turn_and_the_runtime_keeps_serving() {
    let exec = executor();
    let tokio = exec.handle().clone();
    let (rt, handle, _events) = Builder::new_async(
        |_: &SessionKey| -> Result<Box<dyn AsyncAgent>, String> { Ok(Box::new(Panics)) },
        move |task: Task| {
            tokio.spawn(task);
        },
    )
    .build()
    .expect("settings");
    let reactor = rt.spawn().expect("reactor thread");
    for id in ["m1", "m2"] {
        match handle.submit_and_wait(msg(id, "boom", "x"), WAIT) {
            Ok(Outcome::Failed(FailReason::Panic(why))) => {
                assert!(why.contains(&format!("model exploded on {id}")), "{why}")
            }
            other => panic!("expected a panic outcome, got {other:?}"),
        }
    }
    // The panicked agents were closed (as tasks), not reused.
    handle
        .wait_status(WAIT, |s| {
            s.cleanups.done == 2 && s.workers.async_closes == 0
        })
        .expect("both panicked agents closed");
    stop(&handle, reactor);
}

/// Publishes the reply so far after each of its message's words.
struct Streamer;

impl Agent for Streamer {
    fn turn(&mut self, input: &TurnInput<'_>, _: &CancelToken) -> Result<String, TurnError> {
        let mut so_far = String::new();
        for word in input.text.split(' ') {
            so_far.push_str(word);
            input.partials.publish(&so_far);
        }
        Ok(so_far)
    }
}

/// A stream nobody polls while its reply streams holds the newest partial only (each is the
/// whole reply so far), and still every other event, the terminal one last.
#[test]
fn an_unpolled_stream_keeps_only_the_newest_partial_and_every_other_event() {
    let (rt, handle, events) = Builder::from_fn(|_session| Streamer)
        .partial_interval(Duration::ZERO)
        .build()
        .expect("settings");
    let reactor = rt.spawn().expect("reactor thread");
    let words: Vec<String> = (0..300).map(|i| format!("w{i}")).collect();
    let stream = handle
        .submit_stream(msg("m1", "coalesce", &words.join(" ")))
        .expect("room");
    // The same session's next message finishes after m1's every event was delivered.
    handle.submit(msg("m2", "coalesce", "x")).expect("room");
    assert_eq!(finished(&events, 1), vec![("m2".into(), reply("x"))]);
    let whole = words.concat();
    let kinds = collect(stream);
    let partials: Vec<&String> = kinds
        .iter()
        .filter_map(|k| match k {
            EventKind::Partial(t) => Some(t),
            _ => None,
        })
        .collect();
    assert_eq!(partials, vec![&whole], "{} partials", partials.len());
    match kinds.as_slice() {
        [
            EventKind::Accepted { .. },
            EventKind::TurnStarted(t),
            EventKind::Partial(_),
            EventKind::TurnEnded(u),
            EventKind::Finished(Outcome::Reply(r)),
        ] if t == u && r.text == whole => {}
        other => panic!("unexpected events: {:?}", &other[..other.len().min(6)]),
    }
    stop(&handle, reactor);
}
