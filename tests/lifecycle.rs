//! The agent lifecycle with real pools and threads, as an embedder with a stateful agent sees
//! it: an agent that remembers its turns and "saves" in `close()`. Each test reproduces one
//! failure of the earlier lifecycle (issue 7) and checks the figure is now zero.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crossbeam_channel::unbounded;
use turnstile::{
    Agent, Builder, CancelToken, EventKind, Events, Handle, Message, Outcome, SessionKey,
    TurnError, TurnInput,
};

const WAIT: Duration = Duration::from_secs(60);

/// What the agents of one test observed.
#[derive(Default)]
struct Ledger {
    /// Agents alive per session: from the factory call to the end of `close()`.
    live: Mutex<HashMap<String, usize>>,
    /// Factory calls that found another agent of the same session alive.
    overlaps: AtomicUsize,
    created: AtomicUsize,
    closed: AtomicUsize,
}

/// A stateful agent: it counts its own turns (its "memory") and takes `save` to close.
struct Remembering {
    session: String,
    turns: usize,
    save: Duration,
    ledger: Arc<Ledger>,
}

impl Agent for Remembering {
    fn turn(&mut self, _: &TurnInput<'_>, _: &CancelToken) -> Result<String, TurnError> {
        self.turns += 1;
        Ok(self.turns.to_string())
    }

    fn close(&mut self) -> Result<(), turnstile::AgentError> {
        // Simulated work (saving memory to disk), not ordering: nothing waits on this.
        let (_keep, never) = unbounded::<()>();
        let _ = never.recv_timeout(self.save);
        let mut live = self.ledger.live.lock().unwrap_or_else(|e| e.into_inner());
        *live.entry(self.session.clone()).or_default() -= 1;
        self.ledger.closed.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

fn remembering(save: Duration) -> (impl turnstile::AgentFactory, Arc<Ledger>) {
    let ledger = Arc::new(Ledger::default());
    let l = Arc::clone(&ledger);
    let factory = move |key: &SessionKey| -> Result<Box<dyn Agent>, String> {
        let mut live = l.live.lock().unwrap_or_else(|e| e.into_inner());
        let n = live.entry(key.to_string()).or_default();
        if *n > 0 {
            l.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        *n += 1;
        l.created.fetch_add(1, Ordering::SeqCst);
        Ok(Box::new(Remembering {
            session: key.to_string(),
            turns: 0,
            save,
            ledger: Arc::clone(&l),
        }))
    };
    (factory, ledger)
}

fn key(i: usize) -> SessionKey {
    SessionKey::dm("lifecycle", &i.to_string()).expect("valid key")
}

fn submit(handle: &Handle, id: String, session: SessionKey) {
    let m = Message::new(&id, session, "hi").expect("valid message");
    handle.submit(m).expect("submitted");
}

/// Waits for `n` outcomes; returns them by message id.
fn outcomes(events: &Events, n: usize) -> HashMap<String, Outcome> {
    let mut out = HashMap::new();
    while out.len() < n {
        let e = events
            .recv_timeout(WAIT)
            .expect("an event before the timeout");
        if let EventKind::Finished(o) = e.kind {
            out.insert(e.id.to_string(), o);
        }
    }
    out
}

fn reply_of(outcomes: &HashMap<String, Outcome>, id: &str) -> String {
    match &outcomes[id] {
        Outcome::Reply(r) => r.text.clone(),
        other => panic!("{id}: {other:?}"),
    }
}

/// "Busy sessions lose their agent": 200 sessions on 16 workers, each sending a message and
/// two follow-ups at once. A follow-up waits for a worker with its session's agent parked,
/// never evicted, so every follow-up is served by the agent that served the first message
/// (it replies with its turn count: 2, then 3). Before: 400 of 400 follow-ups got a fresh
/// agent (the cache of 128 evicted sessions that were only waiting for a worker).
///
/// All 600 messages are in the ingress channel before the reactor starts, so it takes them
/// in one batch and every follow-up waits before its session's first turn ends. Submitted
/// to a running reactor, a loaded machine's workers sometimes finished first turns before
/// their follow-ups came: those sessions were idle, their agents rightly evictable, and up
/// to 26 follow-ups were served by a fresh agent (1 run in 30).
#[test]
fn follow_ups_waiting_for_a_worker_keep_their_sessions_agent() {
    let (factory, ledger) = remembering(Duration::ZERO);
    let (rt, handle, events) = Builder::new(factory)
        .turn_workers(16)
        .build()
        .expect("valid settings");
    let sessions = 200;
    for round in 0..3 {
        for i in 0..sessions {
            submit(&handle, format!("{i}-{round}"), key(i));
        }
    }
    let reactor = rt.spawn().expect("reactor thread");
    let got = outcomes(&events, 3 * sessions);
    let fresh = (0..sessions)
        .flat_map(|i| [1, 2].map(|r| reply_of(&got, &format!("{i}-{r}"))))
        .filter(|reply| reply == "1")
        .count();
    assert_eq!(fresh, 0, "follow-ups served by a fresh agent");
    let st = handle
        .wait_status(WAIT, |st| st.sessions.cache_overflows > 0)
        .expect("the overflow counted");
    assert_eq!(st.cleanups.timed_out, 0);
    handle.shutdown();
    let report = reactor.join().expect("run");
    assert!(report.clean, "{report:?}");
    assert_eq!(ledger.created.load(Ordering::SeqCst), sessions);
    assert_eq!(ledger.overlaps.load(Ordering::SeqCst), 0);
}

/// "Two agents alive for one session": 30 sessions, a cache of 8, agents that take 20 ms to
/// save in `close()`, rounds of one message per session. A session whose agent was evicted
/// gets its next message while that close runs: the message waits, and the next agent is
/// created only after the close returned. Before: 10 of 120 agents overlapped their
/// predecessor.
#[test]
fn a_sessions_next_agent_is_created_only_after_its_previous_close_returned() {
    let (factory, ledger) = remembering(Duration::from_millis(20));
    let (rt, handle, events) = Builder::new(factory)
        .turn_workers(8)
        .max_cached_agents(8)
        .build()
        .expect("valid settings");
    let reactor = rt.spawn().expect("reactor thread");
    let sessions = 30;
    for round in 0..4 {
        for i in 0..sessions {
            submit(&handle, format!("{i}-{round}"), key(i));
        }
        let got = outcomes(&events, sessions);
        assert!(got.values().all(|o| matches!(o, Outcome::Reply(_))));
    }
    handle.shutdown();
    let report = reactor.join().expect("run");
    assert!(report.clean, "{report:?}");
    assert!(
        ledger.created.load(Ordering::SeqCst) > sessions,
        "no agent was ever evicted and re-created: the test proves nothing"
    );
    assert_eq!(
        ledger.overlaps.load(Ordering::SeqCst),
        0,
        "two agents alive for one session"
    );
    assert_eq!(
        ledger.closed.load(Ordering::SeqCst),
        ledger.created.load(Ordering::SeqCst)
    );
}

/// "Cleanup deadlines run from queueing": 100 idle agents swept at once, each taking 100 ms
/// to close, a 1 s cleanup timeout and 2 resident cleanup threads. The pool grows for the
/// burst and queued closes wait without their deadline running, so every close runs and none
/// times out; shutdown is clean. Before: 100 timed out, 20 ran, shutdown `clean: false`.
#[test]
fn a_burst_of_evictions_all_close_and_none_times_out() {
    let logs = common::capture_logs();
    let (factory, ledger) = remembering(Duration::from_millis(100));
    let (rt, handle, events) = Builder::new(factory)
        .cleanup_workers(2)
        .cleanup_timeout(Duration::from_secs(1))
        .agent_idle_ttl(Duration::from_millis(1))
        .sweep_interval(Duration::from_millis(200))
        .tick_interval(Duration::from_millis(10))
        .build()
        .expect("valid settings");
    let reactor = rt.spawn().expect("reactor thread");
    let sessions = 100;
    for i in 0..sessions {
        submit(&handle, format!("{i}"), key(i));
    }
    outcomes(&events, sessions);
    let st = handle
        .wait_status(WAIT, |st| {
            st.cleanups.done + st.cleanups.timed_out >= sessions as u64
        })
        .expect("every agent swept and closed");
    assert_eq!(st.cleanups.timed_out, 0, "{st:?}");
    assert_eq!(ledger.closed.load(Ordering::SeqCst), sessions);
    handle.shutdown();
    let report = reactor.join().expect("run");
    assert!(report.clean, "{report:?}");
    assert!(logs.find(log::Level::Error, &["cleanup"]).is_empty());
    assert!(
        logs.find(log::Level::Warn, &["exceeded", "lifecycle"])
            .is_empty()
    );
}

/// Shutdown still closes every cached agent, concurrently (up to the cleanup concurrency),
/// each close under its own deadline from its start: 100 agents taking 50 ms each all close
/// and the report is clean.
#[test]
fn shutdown_closes_a_hundred_agents_and_reports_clean() {
    let (factory, ledger) = remembering(Duration::from_millis(50));
    let (rt, handle, events) = Builder::new(factory)
        .cleanup_timeout(Duration::from_secs(5))
        .build()
        .expect("valid settings");
    let reactor = rt.spawn().expect("reactor thread");
    for i in 0..100 {
        submit(&handle, format!("{i}"), key(i));
    }
    outcomes(&events, 100);
    handle.shutdown();
    let report = reactor.join().expect("run");
    assert!(report.clean, "{report:?}");
    assert_eq!(report.cleanups_done, 100);
    assert_eq!(ledger.closed.load(Ordering::SeqCst), 100);
}
