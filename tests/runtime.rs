//! The real reactor, real pools, real threads. No sleeps: tests wait on channels, on events
//! and on status snapshots, with generous timeouts that only bound a failing run.
//!
//! The first three are the Python gateway's cleanup-off-loop seeds
//! (`../shared/seeds/test_53175_cleanup_off_loop.py`) rewritten for this design.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use common::capture_logs;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, bounded, unbounded};
use turnstile::{
    Agent, Builder, CancelReason, CancelToken, EchoAgent, EventKind, Events, FailReason, Handle,
    Message, Outcome, RejectReason, SessionKey, SubmitError, TurnError, TurnInput,
};

const WAIT: Duration = Duration::from_secs(20);

fn key(platform: &str, chat: &str) -> SessionKey {
    SessionKey::dm(platform, chat).expect("valid key")
}

fn send(handle: &Handle, id: &str, session: &SessionKey, text: &str) {
    let msg = Message::new(id, session.clone(), text).expect("valid message");
    handle.submit(msg).expect("submitted");
}

/// Waits for message `id`'s terminal outcome, skipping other events (kept in `seen`).
fn outcome_of(events: &Events, id: &str) -> Outcome {
    loop {
        let e = events
            .recv_timeout(WAIT)
            .expect("an event before the timeout");
        if &*e.id == id
            && let EventKind::Finished(o) = e.kind
        {
            return o;
        }
    }
}

fn wait_for_event(events: &Events, id: &str, pred: impl Fn(&EventKind) -> bool) {
    loop {
        let e = events
            .recv_timeout(WAIT)
            .expect("an event before the timeout");
        if &*e.id == id && pred(&e.kind) {
            return;
        }
    }
}

/// An agent whose `close()` is scripted by the test: it reports that it started, then blocks
/// until released, or panics.
struct CloseScript {
    started: Sender<()>,
    release: Receiver<()>,
    panic: bool,
}

impl Agent for CloseScript {
    fn turn(&mut self, input: &TurnInput<'_>, _: &CancelToken) -> Result<String, TurnError> {
        Ok(input.text.to_owned())
    }
    fn close(&mut self) -> Result<(), turnstile::AgentError> {
        let _ = self.started.send(());
        if self.panic {
            panic!("provider shutdown blew up");
        }
        let _ = self.release.recv();
        Ok(())
    }
}

fn close_script_factory(panic: bool) -> (impl turnstile::AgentFactory, Receiver<()>, Sender<()>) {
    let (started_tx, started_rx) = unbounded();
    let (release_tx, release_rx) = unbounded::<()>();
    let factory = move |_: &SessionKey| -> Result<Box<dyn Agent>, String> {
        Ok(Box::new(CloseScript {
            started: started_tx.clone(),
            release: release_rx.clone(),
            panic,
        }))
    };
    (factory, started_rx, release_tx)
}

/// Seed 1 (#53175): a `close()` that blocks does not freeze the loop; the heartbeat keeps
/// ticking while it blocks, and the status file keeps being refreshed.
/// The default stream's sender is the reactor's (`Handle::submit` sends `Route::Default`,
/// not a clone of a sender each handle holds): the stream ends with the loop, after every
/// event of the run, though a handle is still alive.
#[test]
fn the_default_event_stream_ends_with_the_loop_while_a_handle_lives() {
    let (runtime, handle, events) = Builder::new(EchoAgent::factory(Duration::ZERO))
        .build()
        .expect("runtime");
    let reactor = runtime.spawn().expect("reactor");
    send(&handle, "m1", &key("t", "a"), "hi");
    assert!(matches!(outcome_of(&events, "m1"), Outcome::Reply(r) if r.text == "hi"));
    handle.shutdown();
    reactor.join().expect("reactor run");
    assert_eq!(
        events.recv_timeout(WAIT),
        Err(RecvTimeoutError::Disconnected),
        "the stream outlived its loop"
    );
    drop(handle);
}

#[test]
fn blocking_close_leaves_the_heartbeat_ticking() {
    let (factory, close_started, release) = close_script_factory(false);
    let dir = std::env::temp_dir().join(format!("turnstile-hb-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let status_path = dir.join("status.json");
    let (rt, handle, events) = Builder::new(factory)
        .tick_interval(Duration::from_millis(5))
        .status_file(&status_path)
        .build()
        .expect("valid settings");
    let reactor = rt.spawn().expect("reactor thread");
    let s = key("seed", "hb");
    send(&handle, "m1", &s, "hello");
    assert_eq!(outcome_of(&events, "m1"), Outcome::Reply("hello".into()));
    send(&handle, "reset", &s, "/reset");
    close_started.recv_timeout(WAIT).expect("close() ran");

    let at_block = handle.status();
    let later = handle.wait_status(WAIT, |st| st.ticks >= at_block.ticks + 5);
    let later = later.expect("the heartbeat stalled while close() blocked");
    assert!(
        later.updated_at > at_block.updated_at,
        "updated_at did not advance"
    );
    assert_eq!(
        later.cleanups.pending, 1,
        "close() must still be blocked during the ticks"
    );
    // The reactor still answers while the teardown is stuck (another session: this one's
    // next agent waits for its old one to close).
    send(&handle, "m2", &key("seed", "other"), "still there?");
    assert_eq!(
        outcome_of(&events, "m2"),
        Outcome::Reply("still there?".into())
    );
    // The file is written by its own thread; give it heartbeats (not wall time) to appear.
    let mut written = None;
    for _ in 0..1000 {
        if let Ok(text) = std::fs::read_to_string(&status_path) {
            written = Some(text);
            break;
        }
        let t = handle.status().ticks;
        handle
            .wait_status(WAIT, |st| st.ticks > t)
            .expect("heartbeat");
    }
    let st: serde_json::Value = serde_json::from_str(&written.expect("status file")).expect("json");
    assert!(st["ticks"].as_u64().unwrap_or(0) > 0 && st["loop_lag_ms"]["p99"].is_number());

    drop(release); // unblocks every close(), including shutdown's
    handle.shutdown();
    let report = reactor.join().expect("run");
    assert!(report.clean, "{report:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Seed 2 (#53175): a cleanup past its timeout logs WARN with `exceeded` and the session key,
/// is counted as leaked, and the reactor carries on.
#[test]
fn cleanup_past_its_timeout_logs_exceeded_and_the_reactor_carries_on() {
    let logs = capture_logs();
    let (factory, close_started, release) = close_script_factory(false);
    let (rt, handle, events) = Builder::new(factory)
        .cleanup_timeout(Duration::from_millis(50))
        .tick_interval(Duration::from_millis(5))
        .build()
        .expect("valid settings");
    let reactor = rt.spawn().expect("reactor thread");
    let s = key("seed", "timeout");
    send(&handle, "m1", &s, "hello");
    outcome_of(&events, "m1");
    send(&handle, "reset", &s, "/new");
    close_started.recv_timeout(WAIT).expect("close() ran");
    let st = handle
        .wait_status(WAIT, |st| st.cleanups.timed_out == 1)
        .expect("timeout counted");
    assert_eq!(st.cleanups.pending, 0);
    let warned = logs.find(log::Level::Warn, &["exceeded", "seed:dm:timeout", "reset"]);
    assert_eq!(
        warned.len(),
        1,
        "expected one WARN naming the session: {warned:?}"
    );
    assert!(
        handle
            .wait_status(WAIT, |st| st.workers.replaced >= 1)
            .is_some(),
        "stuck thread not replaced"
    );

    send(&handle, "m2", &s, "carry on");
    assert_eq!(outcome_of(&events, "m2"), Outcome::Reply("carry on".into()));
    drop(release);
    handle.shutdown();
    reactor.join().expect("run");
}

/// Seed 3 (#53175): a `close()` that panics logs WARN with `failed` and never reaches the loop.
#[test]
fn panicking_cleanup_logs_failed_and_the_reactor_carries_on() {
    let logs = capture_logs();
    let (factory, close_started, _release) = close_script_factory(true);
    let (rt, handle, events) = Builder::new(factory)
        .tick_interval(Duration::from_millis(5))
        .build()
        .expect("valid settings");
    let reactor = rt.spawn().expect("reactor thread");
    let s = key("seed", "panic");
    send(&handle, "m1", &s, "hello");
    outcome_of(&events, "m1");
    send(&handle, "reset", &s, "/reset");
    close_started.recv_timeout(WAIT).expect("close() ran");
    handle
        .wait_status(WAIT, |st| st.cleanups.failed == 1)
        .expect("failure counted");
    let warned = logs.find(
        log::Level::Warn,
        &["failed", "seed:dm:panic", "provider shutdown blew up"],
    );
    assert_eq!(warned.len(), 1, "{warned:?}");
    send(&handle, "m2", &s, "carry on");
    assert_eq!(outcome_of(&events, "m2"), Outcome::Reply("carry on".into()));
    handle.shutdown();
    reactor.join().expect("run");
}

/// An agent that panics on `panic`, ignores cancellation on `stuck` (blocking until the test
/// releases it) and echoes anything else.
struct Unruly {
    stuck_started: Sender<()>,
    release: Receiver<()>,
}

impl Agent for Unruly {
    fn turn(&mut self, input: &TurnInput<'_>, _: &CancelToken) -> Result<String, TurnError> {
        match input.text {
            "panic" => panic!("agent blew up"),
            "stuck" => {
                let _ = self.stuck_started.send(());
                let _ = self.release.recv();
                Ok("too late".into())
            }
            t => Ok(t.to_owned()),
        }
    }
}

fn unruly() -> (impl turnstile::AgentFactory, Receiver<()>, Sender<()>) {
    let (started_tx, started_rx) = unbounded();
    let (release_tx, release_rx) = unbounded::<()>();
    let factory = move |_: &SessionKey| -> Result<Box<dyn Agent>, String> {
        Ok(Box::new(Unruly {
            stuck_started: started_tx.clone(),
            release: release_rx.clone(),
        }))
    };
    (factory, started_rx, release_tx)
}

#[test]
fn a_panicking_turn_fails_and_its_worker_survives() {
    let (factory, _, _release) = unruly();
    let (rt, handle, events) = Builder::new(factory)
        .turn_workers(1)
        .build()
        .expect("settings");
    let reactor = rt.spawn().expect("reactor thread");
    let s = key("t", "panic");
    send(&handle, "m1", &s, "panic");
    assert_eq!(
        outcome_of(&events, "m1"),
        Outcome::Failed(FailReason::Panic("agent blew up".into()))
    );
    // One worker only: this reply proves it survived the panic.
    send(&handle, "m2", &s, "hi");
    assert_eq!(outcome_of(&events, "m2"), Outcome::Reply("hi".into()));
    handle.shutdown();
    reactor.join().expect("run");
    assert_eq!(handle.status().workers.replaced, 0);
}

/// A turn ignoring cancellation is abandoned after the grace: its message is answered at
/// once, and the session's next message waits until the stuck turn hands its agent back and
/// that agent is closed (one live agent per session); it then runs on a replacement thread.
#[test]
fn a_turn_ignoring_cancellation_is_abandoned_and_the_session_proceeds() {
    let logs = capture_logs();
    let (factory, stuck_started, release) = unruly();
    let (rt, handle, events) = Builder::new(factory)
        .turn_workers(1)
        .stop_grace(Duration::from_millis(50))
        .build()
        .expect("settings");
    let reactor = rt.spawn().expect("reactor thread");
    let s = key("t", "stuck");
    send(&handle, "m1", &s, "stuck");
    stuck_started
        .recv_timeout(WAIT)
        .expect("stuck turn running");
    send(&handle, "stop", &s, "/stop");
    send(&handle, "m2", &s, "after");
    assert_eq!(
        outcome_of(&events, "m1"),
        Outcome::Cancelled(CancelReason::Stopped)
    );
    assert_eq!(
        logs.find(log::Level::Warn, &["abandoned", "t:dm:stuck"])
            .len(),
        1
    );
    // m2 waits: the stuck turn still holds the session's agent.
    let st = handle
        .wait_status(WAIT, |st| st.turns.abandoned == 1)
        .expect("abandonment in the status");
    assert_eq!((st.sessions.queued_messages, st.turns.in_flight), (1, 0));
    release.send(()).expect("release");
    // The stuck worker returns: its late reply is discarded, its agent closed, then m2 runs.
    assert_eq!(outcome_of(&events, "m2"), Outcome::Reply("after".into()));
    handle
        .wait_status(WAIT, |st| st.cleanups.done >= 1)
        .expect("late agent closed");
    handle.shutdown();
    let report = reactor.join().expect("run");
    assert!(
        report.clean,
        "abandonment happened before shutdown: {report:?}"
    );
    while let Ok(e) = events.try_recv() {
        assert!(
            &*e.id != "m1",
            "late event for the abandoned message: {e:?}"
        );
    }
}

/// A stuck turn that never hands its agent back holds its session up for the cleanup
/// timeout at most: the agent is then given up on (WARN `exceeded`, with the session key)
/// and the session proceeds with a fresh agent.
#[test]
fn a_session_waits_for_a_stuck_agent_no_longer_than_the_cleanup_timeout() {
    let logs = capture_logs();
    let (factory, stuck_started, release) = unruly();
    let (rt, handle, events) = Builder::new(factory)
        .turn_workers(1)
        .stop_grace(Duration::from_millis(20))
        .cleanup_timeout(Duration::from_millis(50))
        .build()
        .expect("settings");
    let reactor = rt.spawn().expect("reactor thread");
    let s = key("t", "never-back");
    send(&handle, "m1", &s, "stuck");
    stuck_started
        .recv_timeout(WAIT)
        .expect("stuck turn running");
    send(&handle, "stop", &s, "/stop");
    send(&handle, "m2", &s, "after");
    assert_eq!(outcome_of(&events, "m2"), Outcome::Reply("after".into()));
    assert_eq!(
        logs.find(
            log::Level::Warn,
            &["exceeded", "t:dm:never-back", "abandoned turn"]
        )
        .len(),
        1
    );
    handle
        .wait_status(WAIT, |st| st.cleanups.timed_out == 1)
        .expect("the given-up agent counted");
    release.send(()).expect("release");
    handle.shutdown();
    reactor.join().expect("run");
}

/// An agent that counts how many turns run at once for its session and records its inputs.
struct Counting {
    active: Arc<Mutex<HashMap<String, usize>>>,
    overlaps: Arc<AtomicUsize>,
    seen: Arc<Mutex<HashMap<String, Vec<String>>>>,
}

impl Agent for Counting {
    fn turn(&mut self, input: &TurnInput<'_>, cancel: &CancelToken) -> Result<String, TurnError> {
        let k = input.session.to_string();
        {
            let mut a = self.active.lock().unwrap_or_else(|e| e.into_inner());
            let n = a.entry(k.clone()).or_default();
            *n += 1;
            if *n > 1 {
                self.overlaps.fetch_add(1, Ordering::SeqCst);
            }
        }
        // Simulated work of 0-500 us, derived from the text; cancellable, never a blind sleep.
        let h = input
            .text
            .bytes()
            .fold(7u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
        cancel.wait_timeout(Duration::from_micros(h % 500));
        self.seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(k.clone())
            .or_default()
            .push(input.text.to_owned());
        *self
            .active
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(k)
            .or_default() -= 1;
        Ok(input.text.to_owned())
    }
}

/// Guarantees 1-3 on real threads: 1,000 sessions x 20 messages, random agent delays.
#[test]
fn stress_one_thousand_sessions_by_twenty_messages() {
    const SESSIONS: usize = 1000;
    const ROUNDS: usize = 20;
    let active = Arc::new(Mutex::new(HashMap::new()));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let seen = Arc::new(Mutex::new(HashMap::new()));
    let (a, o, sn) = (active.clone(), overlaps.clone(), seen.clone());
    let factory = move |_: &SessionKey| -> Result<Box<dyn Agent>, String> {
        Ok(Box::new(Counting {
            active: a.clone(),
            overlaps: o.clone(),
            seen: sn.clone(),
        }))
    };
    let (rt, handle, events) = Builder::new(factory)
        .turn_workers(16)
        .build()
        .expect("settings");
    let reactor = rt.spawn().expect("reactor thread");
    let keys: Vec<SessionKey> = (0..SESSIONS)
        .map(|s| key("stress", &s.to_string()))
        .collect();
    for r in 0..ROUNDS {
        for (s, k) in keys.iter().enumerate() {
            send(&handle, &format!("{s}/{r}"), k, &format!("{s}/{r}"));
        }
    }
    let mut outcomes: HashMap<String, Vec<Outcome>> = HashMap::new();
    let mut finished = 0;
    while finished < SESSIONS * ROUNDS {
        let e = events.recv_timeout(WAIT).expect("progress");
        if let EventKind::Finished(o) = e.kind {
            outcomes.entry(e.id.to_string()).or_default().push(o);
            finished += 1;
        }
    }
    handle.shutdown();
    reactor.join().expect("run");
    while let Ok(e) = events.try_recv() {
        assert!(
            !matches!(e.kind, EventKind::Finished(_)),
            "extra outcome {e:?}"
        );
    }
    assert_eq!(
        overlaps.load(Ordering::SeqCst),
        0,
        "two turns ran at once on one session"
    );
    for s in 0..SESSIONS {
        for r in 0..ROUNDS {
            let id = format!("{s}/{r}");
            assert_eq!(
                outcomes.get(&id),
                Some(&vec![Outcome::Reply(id.clone().into())]),
                "message {id}"
            );
        }
        let expected: Vec<String> = (0..ROUNDS).map(|r| format!("{s}/{r}")).collect();
        let seen = seen.lock().unwrap_or_else(|e| e.into_inner());
        assert_eq!(
            seen[&format!("stress:dm:{s}")],
            expected,
            "order in session {s}"
        );
    }
}

/// Guarantee 8: 10,000 sessions share 16 workers and every one of them progresses.
#[test]
fn ten_thousand_sessions_on_sixteen_workers_all_progress() {
    let (rt, handle, events) = Builder::new(EchoAgent::factory(Duration::ZERO))
        .turn_workers(16)
        .build()
        .expect("settings");
    let reactor = rt.spawn().expect("reactor thread");
    for s in 0..10_000 {
        send(&handle, &s.to_string(), &key("fair", &s.to_string()), "hi");
    }
    let mut replied = std::collections::HashSet::new();
    while replied.len() < 10_000 {
        let e = events.recv_timeout(WAIT).expect("progress");
        if e.kind == EventKind::Finished(Outcome::Reply("hi".into())) {
            assert!(replied.insert(e.id.to_string()), "duplicate reply {}", e.id);
        }
    }
    handle.shutdown();
    reactor.join().expect("run");
}

#[test]
fn shutdown_drains_running_turns_and_cancels_queued_ones() {
    let (gate_tx, gate_rx) = bounded::<()>(0);
    let (started_tx, started_rx) = unbounded::<()>();
    struct Gated(Receiver<()>, Sender<()>);
    impl Agent for Gated {
        fn turn(&mut self, input: &TurnInput<'_>, _: &CancelToken) -> Result<String, TurnError> {
            let _ = self.1.send(());
            let _ = self.0.recv();
            Ok(input.text.to_owned())
        }
    }
    let factory = move |_: &SessionKey| -> Result<Box<dyn Agent>, String> {
        Ok(Box::new(Gated(gate_rx.clone(), started_tx.clone())))
    };
    let (rt, handle, events) = Builder::new(factory).build().expect("settings");
    let reactor = rt.spawn().expect("reactor thread");
    let s = key("t", "drain");
    send(&handle, "running", &s, "a");
    send(&handle, "queued", &s, "b");
    started_rx.recv_timeout(WAIT).expect("turn started");
    handle.shutdown();
    assert_eq!(
        outcome_of(&events, "queued"),
        Outcome::Cancelled(CancelReason::Shutdown)
    );
    // Admission is closed before the running turn is let go.
    let late = Message::new("late", s.clone(), "c").expect("message");
    match handle.submit(late) {
        Ok(()) => wait_for_event(&events, "late", |k| {
            *k == EventKind::Rejected(RejectReason::ShuttingDown)
        }),
        Err(SubmitError::Closed(_)) => {}
        Err(e) => panic!("unexpected {e}"),
    }
    gate_tx.send(()).expect("release the turn");
    assert_eq!(outcome_of(&events, "running"), Outcome::Reply("a".into()));
    let report = reactor.join().expect("run");
    assert!(report.clean, "{report:?}");
    assert_eq!((report.queued_cancelled, report.turns_finished), (1, 1));
    assert_eq!(handle.status().state, turnstile::RuntimeState::Stopped);
}

#[test]
fn a_full_ingress_is_an_error_to_the_submitter() {
    let (_rt, handle, _events) = Builder::new(EchoAgent::factory(Duration::ZERO))
        .ingress_capacity(1)
        .build()
        .expect("settings");
    let s = key("t", "ingress");
    handle
        .submit(Message::new("a", s.clone(), "x").expect("message"))
        .expect("first fits");
    match handle.submit(Message::new("b", s, "y").expect("message")) {
        Err(SubmitError::Backpressure(m)) => assert_eq!(&*m.id, "b"),
        other => panic!("expected backpressure, got {other:?}"),
    }
}

#[test]
fn invalid_settings_are_refused_by_name() {
    let err = Builder::new(EchoAgent::factory(Duration::ZERO))
        .turn_workers(0)
        .build()
        .err();
    assert!(err.is_some_and(|e| e.to_string().contains("turn_workers")));
    let err = Builder::new(EchoAgent::factory(Duration::ZERO))
        .tick_interval(Duration::ZERO)
        .build()
        .err();
    assert!(err.is_some_and(|e| e.to_string().contains("tick_interval")));
}

/// The handle is usable from many threads at once.
#[test]
fn handles_submit_concurrently_from_many_threads() {
    let (rt, handle, events) = Builder::new(EchoAgent::factory(Duration::ZERO))
        .build()
        .expect("settings");
    let reactor = rt.spawn().expect("reactor thread");
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let h = handle.clone();
            thread::spawn(move || {
                for i in 0..250 {
                    send(
                        &h,
                        &format!("{t}-{i}"),
                        &key("mt", &format!("{t}-{i}")),
                        "x",
                    );
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("submitter");
    }
    let mut n = 0;
    while n < 1000 {
        if let EventKind::Finished(o) = events.recv_timeout(WAIT).expect("progress").kind {
            assert_eq!(o, Outcome::Reply("x".into()));
            n += 1;
        }
    }
    handle.shutdown();
    reactor.join().expect("run");
}

/// Shutdown closes every cached agent at once under one deadline (the reference closed them
/// one at a time, 30 s each, and its watchdog killed the process, H7). Each `close()` here
/// waits at a barrier that opens only when all eight are running together: with the cleanup
/// pool's two threads alone it would never open, and every cleanup would time out.
#[test]
fn shutdown_closes_all_cached_agents_concurrently() {
    use std::sync::Barrier;
    const AGENTS: usize = 8;
    struct Gathered(Arc<Barrier>);
    impl Agent for Gathered {
        fn turn(&mut self, input: &TurnInput<'_>, _: &CancelToken) -> Result<String, TurnError> {
            Ok(input.text.to_owned())
        }
        fn close(&mut self) -> Result<(), turnstile::AgentError> {
            self.0.wait();
            Ok(())
        }
    }
    let barrier = Arc::new(Barrier::new(AGENTS));
    let b = barrier.clone();
    let factory = move |_: &SessionKey| -> Result<Box<dyn Agent>, String> {
        Ok(Box::new(Gathered(b.clone())))
    };
    let (rt, handle, events) = Builder::new(factory)
        .cleanup_workers(2)
        .cleanup_timeout(Duration::from_secs(20))
        .build()
        .expect("settings");
    let reactor = rt.spawn().expect("reactor thread");
    for i in 0..AGENTS {
        send(
            &handle,
            &format!("m{i}"),
            &key("close", &i.to_string()),
            "hi",
        );
    }
    let mut finished = 0;
    while finished < AGENTS {
        if let EventKind::Finished(_) = events.recv_timeout(WAIT).expect("progress").kind {
            finished += 1;
        }
    }
    handle.shutdown();
    let report = reactor.join().expect("run");
    assert!(report.clean, "{report:?}");
    assert_eq!(report.cleanups_done, AGENTS as u64);
}

/// Streaming through the real pool: an agent publishing many partials has them forwarded
/// throttled (here: every one, interval zero, then none past the first with a long interval),
/// in order, all before the terminal reply.
#[test]
fn partials_are_forwarded_in_order_before_the_reply_and_throttled() {
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
    for (interval, expected) in [
        (Duration::ZERO, vec!["a", "ab", "abc"]),
        (Duration::from_secs(3600), vec!["a"]),
    ] {
        let factory = |_: &SessionKey| -> Result<Box<dyn Agent>, String> { Ok(Box::new(Streamer)) };
        let (runtime, handle, events) = Builder::new(factory)
            .partial_interval(interval)
            .build()
            .expect("valid settings");
        let reactor = runtime.spawn().expect("reactor thread");
        send(&handle, "m1", &key("t", "1"), "a b c");
        let mut partials = Vec::new();
        loop {
            let e = events.recv_timeout(WAIT).expect("an event");
            match e.kind {
                EventKind::Partial(t) => partials.push(t),
                EventKind::Finished(o) => {
                    assert_eq!(o, Outcome::Reply("abc".into()));
                    break;
                }
                _ => {}
            }
        }
        assert_eq!(partials, expected);
        handle.shutdown();
        reactor.join().expect("clean run");
    }
}

/// A reply longer than `max_reply_bytes` is cut on the worker, on a UTF-8 boundary, and
/// flagged; a partial is cut the same way, so the reactor never carries an unbounded text.
#[test]
fn long_replies_and_partials_are_cut_on_a_char_boundary_and_flagged() {
    struct Long;
    impl Agent for Long {
        fn turn(&mut self, input: &TurnInput<'_>, _: &CancelToken) -> Result<String, TurnError> {
            let text = "é".repeat(4_000); // 8,000 bytes of two-byte characters
            input.partials.publish(&text);
            Ok(text)
        }
    }
    let factory = |_: &SessionKey| -> Result<Box<dyn Agent>, String> { Ok(Box::new(Long)) };
    let (runtime, handle, events) = Builder::new(factory)
        .partial_interval(Duration::ZERO)
        .max_reply_bytes(1_001)
        .build()
        .expect("valid settings");
    let reactor = runtime.spawn().expect("reactor thread");
    send(&handle, "m1", &key("t", "1"), "go");
    let mut partial = None;
    let reply = loop {
        let e = events.recv_timeout(WAIT).expect("an event");
        match e.kind {
            EventKind::Partial(t) => partial = Some(t),
            EventKind::Finished(Outcome::Reply(r)) => break r,
            EventKind::Finished(other) => panic!("not a reply: {other:?}"),
            _ => {}
        }
    };
    assert!(reply.truncated);
    assert_eq!(
        reply.text,
        "é".repeat(500),
        "cut at 1,000 bytes, not mid-character"
    );
    assert_eq!(partial.as_deref(), Some(&*"é".repeat(500)));
    handle.shutdown();
    reactor.join().expect("clean run");
}

/// A frontend's source that becomes ready while the loop always has work waiting (here a
/// handle's submission made before every sleep) is still reported to it: the loop gathers
/// readiness every turn, with a zero timeout when it must not sleep. Before, a turn with
/// submissions or completions waiting skipped the poll, so a socket that became ready waited
/// until that work ran dry (under `loadgen --flood`, a quiet bridge's ping: p99 250–880 ms).
/// Deterministic: the ingress is never empty when the loop decides whether to poll, until
/// the frontend has seen the readiness; on a loop that polls only when idle, it never does.
#[test]
fn readiness_is_gathered_while_work_keeps_waiting() {
    use std::io::Write as _;
    use turnstile::mio::{Interest, Poll, Registry, Token, event::Event, unix::pipe};
    use turnstile::{Ctx, Frontend, MessageEvent};

    struct Busy {
        rx: pipe::Receiver,
        handle: Handle,
        submitted: usize,
        seen: Option<Sender<usize>>,
    }
    impl Frontend for Busy {
        fn register(&mut self, registry: &Registry) -> std::io::Result<()> {
            registry.register(&mut self.rx, Token(1), Interest::READABLE)
        }
        fn on_ready(&mut self, event: &Event, _: &mut Ctx<'_>) {
            if event.token() == Token(1)
                && let Some(seen) = self.seen.take()
            {
                let _ = seen.send(self.submitted);
            }
        }
        fn on_wake(&mut self, _: &mut Ctx<'_>) -> Option<Duration> {
            None
        }
        fn deliver(&mut self, _: u64, _: MessageEvent) {}
        fn flush(&mut self) {
            // Work waiting at every sleep until the readiness is seen.
            if self.seen.is_some() {
                self.submitted += 1;
                let id = format!("busy-{}", self.submitted);
                let session = key("busy", &(self.submitted % 64).to_string());
                if let Ok(m) = Message::new(id.as_str(), session, "x") {
                    let _ = self.handle.submit(m);
                }
            }
        }
        fn finish(&mut self, _: &mut Poll) {}
    }

    let (rt, handle, events) = Builder::new(EchoAgent::factory(Duration::ZERO))
        .build()
        .expect("settings");
    let (mut tx, rx) = pipe::new().expect("pipe");
    let (seen_tx, seen) = bounded(1);
    let (going_tx, going) = bounded(1);
    let frontend = Busy {
        rx,
        handle: handle.clone(),
        submitted: 0,
        seen: Some(seen_tx),
    };
    let reactor = thread::spawn(move || rt.run_with(frontend));
    // Keep the events flowing out so nothing backs up behind them.
    let drain = thread::spawn(move || {
        let mut n = 0usize;
        while events.recv_timeout(WAIT).is_ok() {
            n += 1;
            if n == 100 {
                let _ = going_tx.send(());
            }
        }
    });
    // The loop is busy (a hundred messages through) before the source becomes ready.
    going.recv_timeout(WAIT).expect("the busy loop under way");
    tx.write_all(b"x").expect("write");
    let submitted = seen
        .recv_timeout(WAIT)
        .expect("the readiness reported while work kept waiting");
    assert!(submitted > 0, "{submitted}");
    handle.shutdown();
    reactor.join().expect("reactor").expect("run");
    drop(handle);
    let _ = drain.join();
}
