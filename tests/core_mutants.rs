//! Guarantees of the sans-IO core that operators and drivers rely on and that the scenario
//! and model tests left unchecked: found by mutation testing (`cargo mutants` on
//! `src/core/`, issue 9 §3). Each test names the guarantee it proves; all are driven with
//! explicit times, so they are deterministic and fast.

mod common;

use std::time::Duration;

use common::{Fx, Harness, key};
use turnstile::internal::core::{AgentPhase, CleanupContext, CoreStats, Input, TurnResult};
use turnstile::{
    AcceptState, CancelReason, CoreConfig, EventKind, FailReason, Outcome, RejectReason, Reply,
    ShutdownReport,
};

fn cfg() -> CoreConfig {
    CoreConfig {
        turn_workers: 4,
        ..CoreConfig::default()
    }
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

fn reply(s: &str) -> Outcome {
    Outcome::Reply(s.into())
}

/// The reply text of a command message.
fn command_reply(h: &Harness, id: &str) -> String {
    match &h.outcomes_of(id)[..] {
        [Outcome::Reply(r)] => r.text.clone(),
        other => panic!("{id}: expected one reply, got {other:?}"),
    }
}

fn accepted(h: &Harness, id: &str) -> (AcceptState, usize) {
    match h.events_of(id).first() {
        Some(EventKind::Accepted { state, position }) => (*state, *position),
        other => panic!("{id} not accepted: {other:?}"),
    }
}

fn cleanups_in(step: &[Fx]) -> Vec<CleanupContext> {
    step.iter()
        .filter_map(|f| match f {
            Fx::Cleanup { context, .. } => Some(*context),
            _ => None,
        })
        .collect()
}

fn count(step: &[Fx], pred: impl Fn(&Fx) -> bool) -> usize {
    step.iter().filter(|f| pred(f)).count()
}

// ---- the driver's view -------------------------------------------------------------------

#[test]
fn config_returns_the_limits_the_core_was_built_with() {
    let h = Harness::new(CoreConfig {
        turn_workers: 3,
        queue_cap: 7,
        ..cfg()
    });
    assert_eq!(h.core.config().turn_workers, 3);
    assert_eq!(h.core.config().queue_cap, 7);
}

#[test]
fn is_shutting_down_is_false_until_shutdown_then_true() {
    let mut h = Harness::new(cfg());
    assert!(!h.core.is_shutting_down());
    h.step(Input::Shutdown);
    assert!(h.core.is_shutting_down());
}

#[test]
fn default_queued_bytes_bound_is_256_mib() {
    assert_eq!(CoreConfig::default().max_queued_bytes, 256 * 1024 * 1024);
}

// ---- admission ---------------------------------------------------------------------------

/// `position` counts the running turn and every queued message ahead; `state` is `queued`
/// whenever no worker is free, even for an idle session.
#[test]
fn accepted_reports_the_position_behind_the_running_turn_and_queued_when_no_worker_is_free() {
    let mut h = Harness::new(CoreConfig {
        turn_workers: 1,
        ..cfg()
    });
    h.submit("a", "a1", "x");
    h.submit("a", "a2", "x");
    h.submit("a", "a3", "x");
    h.submit("b", "b1", "x");
    assert_eq!(accepted(&h, "a1"), (AcceptState::Running, 0));
    assert_eq!(accepted(&h, "a2"), (AcceptState::Queued, 1));
    assert_eq!(accepted(&h, "a3"), (AcceptState::Queued, 2));
    assert_eq!(accepted(&h, "b1"), (AcceptState::Queued, 0));
}

/// The byte bound admits waiting text up to `max_queued_bytes` exactly, and not one byte
/// more; the text of a running turn does not count.
#[test]
fn the_byte_bound_admits_exactly_max_queued_bytes() {
    let mut h = Harness::new(CoreConfig {
        turn_workers: 1,
        max_queued_bytes: 10,
        ..cfg()
    });
    h.submit("a", "a1", "x"); // runs: its text leaves the queue
    h.submit("b", "b1", "1234");
    h.submit("c", "c1", "123456"); // 4 + 6 = 10: exactly the bound
    h.submit("d", "d1", "1"); // 11: past it
    assert_eq!(accepted(&h, "b1"), (AcceptState::Queued, 0));
    assert_eq!(accepted(&h, "c1"), (AcceptState::Queued, 0));
    assert_eq!(
        h.events_of("d1"),
        vec![EventKind::Rejected(RejectReason::Overloaded)]
    );
    let s = h.core.stats();
    assert_eq!((s.messages.accepted, s.messages.rejected), (3, 1));
    assert_eq!(s.sessions.queued_messages, 2);
}

/// The message bound admits up to `max_queued_messages` waiting messages.
#[test]
fn the_message_bound_admits_exactly_max_queued_messages() {
    let mut h = Harness::new(CoreConfig {
        turn_workers: 1,
        max_queued_messages: 2,
        ..cfg()
    });
    h.submit("a", "a1", "x");
    h.submit("b", "b1", "x");
    h.submit("c", "c1", "x");
    h.submit("d", "d1", "x");
    assert!(matches!(
        h.events_of("c1")[..],
        [EventKind::Accepted { .. }]
    ));
    assert_eq!(
        h.events_of("d1"),
        vec![EventKind::Rejected(RejectReason::Overloaded)]
    );
}

/// A per-session queue holds exactly `queue_cap` messages behind the running turn.
#[test]
fn a_session_queue_holds_exactly_queue_cap_messages() {
    let mut h = Harness::new(CoreConfig {
        queue_cap: 2,
        ..cfg()
    });
    for i in 0..4 {
        h.submit("a", &format!("a{i}"), "x");
    }
    assert!(matches!(
        h.events_of("a2")[..],
        [EventKind::Accepted { .. }]
    ));
    assert_eq!(
        h.events_of("a3"),
        vec![EventKind::Rejected(RejectReason::QueueFull)]
    );
    assert_eq!(h.core.stats().messages.rejected, 1);
}

// ---- views -------------------------------------------------------------------------------

/// A session view tells an evictable (idle) agent from one parked for waiting work, and
/// `sessions()` lists every session holding a slot.
#[test]
fn views_tell_an_idle_agent_from_a_parked_one() {
    let mut h = Harness::new(CoreConfig {
        turn_workers: 1,
        ..cfg()
    });
    h.submit("a", "a1", "x");
    h.echo("a");
    let v = h.core.session(&key("a")).expect("a holds its agent");
    assert_eq!(v.agent, AgentPhase::Idle);
    assert!(v.agent_cached);
    assert_eq!(
        (v.running, v.queued, v.waiting_for_worker),
        (None, 0, false)
    );
    h.submit("b", "b1", "x"); // takes the only worker
    h.submit("a", "a2", "y"); // waits for it: a's agent is parked
    let v = h.core.session(&key("a")).expect("a");
    assert_eq!(v.agent, AgentPhase::Parked);
    assert!(v.agent_cached);
    assert_eq!((v.queued, v.waiting_for_worker), (1, true));
    let b = h.core.session(&key("b")).expect("b");
    assert_eq!(b.agent, AgentPhase::InTurn);
    assert!(b.running.is_some());
    assert_eq!(b.running_since, Some(Duration::ZERO));
    let mut keys: Vec<String> = h.core.sessions().map(|v| v.key.to_string()).collect();
    keys.sort();
    assert_eq!(keys, vec![key("a").to_string(), key("b").to_string()]);
    let s = h.core.stats();
    assert_eq!((s.sessions.parked_agents, s.sessions.cached_agents), (1, 0));
}

// ---- commands ----------------------------------------------------------------------------

/// `/status` names each state a session can be in, exactly.
#[test]
fn status_names_every_session_state() {
    let mut h = Harness::new(CoreConfig {
        turn_workers: 1,
        max_cached_agents: 4,
        ..cfg()
    });
    // No slot at all.
    h.submit("a", "s0", "/status");
    assert_eq!(command_reply(&h, "s0"), "idle: no turn running, 0 queued");
    // A slot held only by an idle agent is idle too.
    h.submit("a", "a1", "x");
    h.echo("a");
    h.submit("a", "s1", "/status");
    assert_eq!(command_reply(&h, "s1"), "idle: no turn running, 0 queued");
    // Running, then cancelling.
    h.submit("a", "a2", "x");
    h.advance(Duration::from_millis(2500));
    h.submit("a", "s2", "/status");
    assert_eq!(command_reply(&h, "s2"), "running for 2.5s, 0 queued");
    // Waiting for the only worker.
    h.submit("b", "b1", "x");
    h.submit("b", "s3", "/status");
    assert_eq!(command_reply(&h, "s3"), "waiting for a worker, 1 queued");
    h.submit("a", "stop", "/stop");
    h.submit("a", "s4", "/status");
    assert_eq!(
        command_reply(&h, "s4"),
        "running for 2.5s (cancelling: stopped), 0 queued"
    );
}

/// `/stop` and `/new` say whether a turn was running and how many queued messages they
/// cancelled, with their own name, on a session with or without a slot.
#[test]
fn stop_and_reset_replies_count_what_they_cancelled() {
    let mut h = Harness::new(cfg());
    h.submit("a", "s0", "/stop");
    assert_eq!(
        command_reply(&h, "s0"),
        "nothing to stop: no turn running, 0 queued"
    );
    h.submit("a", "r0", "/new");
    assert_eq!(
        command_reply(&h, "r0"),
        "reset: the next message starts a fresh agent"
    );
    h.submit("a", "a1", "x");
    h.submit("a", "a2", "x");
    h.submit("a", "a3", "x");
    h.submit("a", "s1", "/stop");
    assert_eq!(
        command_reply(&h, "s1"),
        "stop: cancelled the running turn, 2 queued message(s) cancelled"
    );
    let turn = h.turn_of("a");
    h.complete(turn, TurnResult::Cancelled);
    // The agent stayed (stop keeps it): the session is idle with it.
    h.submit("a", "s2", "/stop");
    assert_eq!(
        command_reply(&h, "s2"),
        "stop: no turn running, 0 queued message(s) cancelled"
    );
    h.submit("a", "a4", "x");
    h.submit("a", "a5", "x");
    h.submit("a", "r1", "/reset");
    assert_eq!(
        command_reply(&h, "r1"),
        "reset: cancelled the running turn, 1 queued message(s) cancelled"
    );
    assert_eq!(
        h.outcomes_of("a2"),
        vec![Outcome::Cancelled(CancelReason::Stopped)]
    );
    assert_eq!(
        h.outcomes_of("a5"),
        vec![Outcome::Cancelled(CancelReason::Reset)]
    );
    assert_eq!(h.core.stats().messages.queued_cancelled, 3);
}

/// `/stop` keeps the session's idle agent (the next message reuses it); `/new` closes it.
#[test]
fn stop_keeps_the_idle_agent_and_reset_closes_it() {
    let mut h = Harness::new(cfg());
    h.submit("a", "a1", "x");
    h.echo("a");
    let step = h.submit("a", "s", "/stop");
    assert!(cleanups_in(&step).is_empty(), "{step:?}");
    assert_eq!(
        h.core.session(&key("a")).map(|v| v.agent),
        Some(AgentPhase::Idle)
    );
    let step = h.submit("a", "r", "/new");
    assert_eq!(cleanups_in(&step), vec![CleanupContext::Reset]);
}

/// A `/stop` that empties the queue of a session waiting for a worker makes its parked
/// agent evictable again (idle, counted as cached, not parked).
#[test]
fn stop_on_a_waiting_session_makes_its_parked_agent_idle_again() {
    let mut h = Harness::new(CoreConfig {
        turn_workers: 1,
        ..cfg()
    });
    h.submit("a", "a1", "x");
    h.echo("a");
    h.submit("b", "b1", "x");
    h.submit("a", "a2", "x");
    assert_eq!(h.core.stats().sessions.parked_agents, 1);
    h.submit("a", "s", "/stop");
    let v = h.core.session(&key("a")).expect("a keeps its agent");
    assert_eq!(v.agent, AgentPhase::Idle);
    assert!(!v.waiting_for_worker);
    let s = h.core.stats();
    assert_eq!(
        (
            s.sessions.parked_agents,
            s.sessions.cached_agents,
            s.sessions.waiting_for_worker
        ),
        (0, 1, 0)
    );
    // b's completion starts nothing for a.
    let step = h.echo("b");
    assert_eq!(count(&step, |f| matches!(f, Fx::Started { .. })), 0);
}

// ---- agents and the cache ----------------------------------------------------------------

/// `cache_overflows` counts exactly the agents parked while the held total (idle plus
/// parked) exceeds `max_cached_agents`, and not those parked within the cap.
#[test]
fn cache_overflows_counts_only_agents_held_past_the_cap() {
    let mut h = Harness::new(CoreConfig {
        turn_workers: 2,
        max_cached_agents: 1,
        ..cfg()
    });
    // a's agent comes back to a busy session (a2 queued): one held, within the cap.
    h.submit("a", "a1", "x");
    h.submit("a", "a2", "x");
    h.echo("a");
    assert_eq!(h.core.stats().sessions.cache_overflows, 0);
    h.echo("a"); // a's agent idle: one cached
    assert_eq!(h.core.stats().sessions.cached_agents, 1);
    // b's agent comes back to a busy session while a's is cached: two held, over the cap.
    h.submit("b", "b1", "x");
    h.submit("b", "b2", "x");
    h.echo("b");
    assert_eq!(h.core.stats().sessions.cache_overflows, 1);
}

/// The idle sweep and LRU evictions pause while the cleanup backlog is at its cap: with a
/// cap of zero no idle agent is ever closed by them.
#[test]
fn a_zero_backlog_cap_pauses_sweeps_and_evictions() {
    let mut h = Harness::new(CoreConfig {
        max_cached_agents: 0,
        cleanup_queue_cap: 0,
        agent_idle_ttl: secs(10),
        sweep_interval: secs(5),
        ..cfg()
    });
    h.submit("a", "a1", "x");
    let step = h.echo("a");
    assert!(cleanups_in(&step).is_empty(), "evicted: {step:?}");
    let step = h.advance(secs(60));
    assert!(cleanups_in(&step).is_empty(), "swept: {step:?}");
    assert_eq!(h.core.stats().sessions.cached_agents, 1);
}

/// The sweep closes idle agents past their TTL while the backlog has room, and stops at
/// the first agent not yet expired.
#[test]
fn the_sweep_closes_expired_agents_only_while_the_backlog_has_room() {
    let mut h = Harness::new(CoreConfig {
        cleanup_concurrency: 1,
        cleanup_queue_cap: 1,
        agent_idle_ttl: secs(10),
        sweep_interval: secs(20),
        ..cfg()
    });
    h.auto_start_cleanups = false;
    for chat in ["a", "b", "c"] {
        h.submit(chat, &format!("{chat}1"), "x");
        h.echo(chat);
    }
    // At 20s all three expired: one goes to the pool, one to the backlog (now at its cap),
    // the third stays cached.
    let step = h.advance(secs(20));
    assert_eq!(
        cleanups_in(&step),
        vec![CleanupContext::Sweep],
        "only the pool's one job is issued"
    );
    let s = h.core.stats();
    assert_eq!((s.cleanups.pending, s.cleanups.queued), (2, 2));
    assert_eq!(s.sessions.cached_agents, 1);
}

/// A long run of turns on one session keeps the other sessions' idle agents findable by
/// the sweep: compacting the recency queue keeps live entries.
#[test]
fn recency_compaction_keeps_the_live_idle_agents() {
    let mut h = Harness::new(CoreConfig {
        agent_idle_ttl: secs(3600),
        sweep_interval: secs(3600),
        ..cfg()
    });
    h.submit("old", "o", "x");
    h.echo("old");
    for i in 0..2100 {
        h.submit("busy", &format!("m{i}"), "x");
        h.echo("busy");
    }
    h.log.clear();
    let step = h.advance(secs(3600));
    let swept: Vec<String> = step
        .iter()
        .filter_map(|f| match f {
            Fx::Cleanup {
                context: CleanupContext::Sweep,
                session,
                ..
            } => Some(session.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(
        swept,
        vec![key("old").to_string(), key("busy").to_string()],
        "both idle agents swept, oldest first"
    );
}

/// The agent of a turn that ends after `/new` is closed as a reset, one that ends during
/// shutdown as a shutdown, one that panicked as a panic; an ordinary one is kept.
#[test]
fn a_returning_agent_is_closed_with_the_reason_it_leaves_service() {
    let mut h = Harness::new(cfg());
    h.submit("a", "a1", "x");
    let step = h.echo("a");
    assert!(cleanups_in(&step).is_empty(), "kept: {step:?}");
    h.submit("a", "a2", "x");
    h.submit("a", "r", "/new");
    let turn = h.turn_of("a");
    let step = h.complete(turn, TurnResult::Reply("late".into()));
    assert_eq!(cleanups_in(&step), vec![CleanupContext::Reset]);
    h.submit("b", "b1", "x");
    let turn = h.turn_of("b");
    let step = h.complete(turn, TurnResult::Panicked("boom".into()));
    assert_eq!(cleanups_in(&step), vec![CleanupContext::Panicked]);
    h.submit("c", "c1", "x");
    h.step(Input::Shutdown);
    let step = h.echo("c");
    assert_eq!(cleanups_in(&step), vec![CleanupContext::Shutdown]);
}

/// A turn that returns `Cancelled` without having been asked fails; one asked is counted
/// cancelled.
#[test]
fn an_unrequested_cancellation_is_a_failure() {
    let mut h = Harness::new(cfg());
    h.submit("a", "a1", "x");
    let turn = h.turn_of("a");
    h.complete(turn, TurnResult::Cancelled);
    assert_eq!(
        h.outcomes_of("a1"),
        vec![Outcome::Failed(FailReason::Agent(
            "cancelled without a request".into()
        ))]
    );
    let s = h.core.stats();
    assert_eq!((s.turns.failed, s.turns.cancelled), (1, 0));
}

// ---- timers: next_deadline -----------------------------------------------------------------

/// A started cleanup's deadline is `cleanup_timeout` after its start.
#[test]
fn next_deadline_includes_a_started_cleanups_deadline() {
    let mut h = Harness::new(CoreConfig {
        max_cached_agents: 0,
        sweep_interval: secs(1000),
        turn_timeout: secs(1000),
        cleanup_timeout: secs(30),
        ..cfg()
    });
    h.auto_start_cleanups = false;
    h.advance(secs(100));
    h.submit("a", "a1", "x");
    h.echo("a"); // evicted: queued, not started
    assert_eq!(h.core.next_deadline(), Some(secs(1000)));
    h.advance(secs(5));
    h.start_cleanup();
    assert_eq!(h.core.next_deadline(), Some(secs(135)));
    // A second start report for the same job arms nothing and counts nothing.
    let job = *h.cleanups.keys().next().expect("the job");
    h.step(Input::CleanupStarted { job });
    assert_eq!(h.core.stats().cleanups.queued, 0);
    h.finish_cleanup(job, Ok(()));
    h.advance(secs(35)); // 140: past 135, the stale timer fired harmlessly
    assert_eq!(h.core.next_deadline(), Some(secs(1000)));
    // A start report for a finished job arms nothing.
    h.step(Input::CleanupStarted { job });
    assert_eq!(h.core.next_deadline(), Some(secs(1000)));
    assert_eq!(h.core.stats().cleanups.timed_out, 0);
}

/// The idle sweep comes back every `sweep_interval` after it ran.
#[test]
fn next_deadline_is_the_next_sweep_after_a_sweep() {
    let mut h = Harness::new(CoreConfig {
        sweep_interval: secs(60),
        ..cfg()
    });
    h.advance(secs(60));
    assert_eq!(h.core.next_deadline(), Some(secs(120)));
    h.advance(secs(70));
    assert_eq!(h.core.next_deadline(), Some(secs(190)));
}

/// Shutdown arms its drain deadline `drain_timeout` after it began, and on it cancels the
/// turns still running.
#[test]
fn next_deadline_is_the_drain_deadline_after_shutdown() {
    let mut h = Harness::new(CoreConfig {
        sweep_interval: secs(1000),
        turn_timeout: secs(1000),
        drain_timeout: secs(30),
        stop_grace: secs(5),
        ..cfg()
    });
    h.advance(secs(100));
    h.submit("a", "a1", "x");
    h.step(Input::Shutdown);
    assert_eq!(h.core.next_deadline(), Some(secs(130)));
    let step = h.advance(secs(30));
    let turn = h.turn_of("a");
    assert_eq!(step, vec![Fx::Cancel(turn)]);
    assert_eq!(h.core.next_deadline(), Some(secs(135)));
}

/// An abandoned turn's agent is awaited `cleanup_timeout` from the abandonment, no longer.
#[test]
fn next_deadline_awaits_an_abandoned_turns_agent_for_the_cleanup_timeout() {
    let mut h = Harness::new(CoreConfig {
        sweep_interval: secs(1000),
        turn_timeout: secs(30),
        cleanup_timeout: secs(10),
        ..cfg()
    });
    h.advance(secs(50));
    h.submit("a", "a1", "x");
    let step = h.advance(secs(30)); // 80: timed out
    assert_eq!(count(&step, |f| matches!(f, Fx::Abandoned(_))), 1);
    assert_eq!(h.core.stats().cleanups.timed_out, 0);
    assert_eq!(h.core.next_deadline(), Some(secs(90)));
    h.advance(secs(10));
    assert_eq!(h.core.stats().cleanups.timed_out, 1);
}

/// A timed-out turn is cancelled as it is abandoned; a turn that ignored `/stop` is not
/// signalled a second time.
#[test]
fn abandonment_signals_cancellation_only_for_a_timeout() {
    let mut h = Harness::new(CoreConfig {
        turn_timeout: secs(30),
        stop_grace: secs(5),
        ..cfg()
    });
    h.submit("a", "a1", "x");
    let ta = h.turn_of("a");
    let step = h.advance(secs(30));
    assert_eq!(step[..2], [Fx::Cancel(ta), Fx::Abandoned(ta)]);
    assert_eq!(
        h.outcomes_of("a1"),
        vec![Outcome::Failed(FailReason::Timeout)]
    );
    h.submit("b", "b1", "x");
    let tb = h.turn_of("b");
    let step = h.submit("b", "s", "/stop");
    assert_eq!(count(&step, |f| *f == Fx::Cancel(tb)), 1);
    let step = h.advance(secs(5));
    assert_eq!(count(&step, |f| matches!(f, Fx::Cancel(_))), 0, "{step:?}");
    assert_eq!(count(&step, |f| *f == Fx::Abandoned(tb)), 1);
    assert_eq!(
        h.outcomes_of("b1"),
        vec![Outcome::Cancelled(CancelReason::Stopped)]
    );
}

// ---- abandoned turns -----------------------------------------------------------------------

/// An abandoned turn whose worker returns with no agent (its creation failed) frees its
/// session at once: the queued message starts without waiting for the cleanup deadline.
#[test]
fn an_abandoned_turn_returning_without_an_agent_frees_its_session_at_once() {
    let mut h = Harness::new(CoreConfig {
        stop_grace: secs(5),
        cleanup_timeout: secs(30),
        ..cfg()
    });
    h.submit("a", "a1", "x");
    let turn = h.turn_of("a");
    h.submit("a", "s", "/stop");
    h.advance(secs(5)); // abandoned
    h.submit("a", "a2", "y");
    assert_eq!(h.core.stats().cleanups.pending, 1);
    let job = h.stuck.remove(&turn).expect("stuck");
    h.agent_of.remove(&turn);
    let step = h.step(Input::TurnDone(
        job.done(None, TurnResult::Failed("no agent".into())),
    ));
    assert_eq!(
        count(&step, |f| matches!(f, Fx::Started { id, .. } if id == "a2")),
        1,
        "{step:?}"
    );
    assert_eq!(h.core.stats().cleanups.pending, 0);
    assert!(cleanups_in(&step).is_empty());
}

/// An abandoned turn's agent that comes back goes to the job its session waits on; once
/// that job gave up, to a cleanup of its own.
#[test]
fn an_abandoned_turns_agent_is_closed_whenever_it_returns() {
    let mut h = Harness::new(CoreConfig {
        stop_grace: secs(5),
        cleanup_timeout: secs(30),
        ..cfg()
    });
    h.submit("a", "a1", "x");
    let ta = h.turn_of("a");
    h.submit("a", "s", "/stop");
    h.advance(secs(5));
    let step = h.complete(ta, TurnResult::Reply("late".into()));
    assert_eq!(cleanups_in(&step), vec![CleanupContext::Abandoned]);
    let job = *h.cleanups.keys().next().expect("a's cleanup");
    h.finish_cleanup(job, Ok(()));
    h.submit("b", "b1", "x");
    let tb = h.turn_of("b");
    h.submit("b", "s2", "/stop");
    h.advance(secs(5));
    h.advance(secs(30)); // the job gave up waiting
    assert_eq!(h.core.stats().cleanups.timed_out, 1);
    let step = h.complete(tb, TurnResult::Reply("very late".into()));
    assert_eq!(cleanups_in(&step), vec![CleanupContext::Abandoned]);
}

// ---- cleanups ------------------------------------------------------------------------------

/// `cleanups.queued` counts jobs whose `close()` has not started, in the backlog or in the
/// pool's queue; `pending` counts every job not yet ended.
#[test]
fn cleanup_gauges_count_jobs_by_stage() {
    let mut h = Harness::new(CoreConfig {
        max_cached_agents: 0,
        cleanup_concurrency: 2,
        ..cfg()
    });
    h.auto_start_cleanups = false;
    for chat in ["a", "b", "c"] {
        h.submit(chat, &format!("{chat}1"), "x");
        h.echo(chat);
    }
    // Two issued (not started), one in the backlog.
    let s = h.core.stats();
    assert_eq!((s.cleanups.pending, s.cleanups.queued), (3, 3));
    h.start_cleanup();
    let s = h.core.stats();
    assert_eq!((s.cleanups.pending, s.cleanups.queued), (3, 2));
    h.start_cleanup();
    let s = h.core.stats();
    assert_eq!((s.cleanups.pending, s.cleanups.queued), (3, 1));
    let job = *h.cleanups.keys().min().expect("a job");
    h.finish_cleanup(job, Ok(()));
    let s = h.core.stats();
    assert_eq!((s.cleanups.pending, s.cleanups.queued), (2, 1));
    assert_eq!(s.cleanups.done, 1);
}

// ---- shutdown ------------------------------------------------------------------------------

/// Shutdown completes once, only after every turn and every cleanup ended, and its report
/// counts what happened since it began.
#[test]
fn shutdown_completes_once_after_turns_and_cleanups_end() {
    let mut h = Harness::new(cfg());
    h.submit("a", "a1", "x");
    h.echo("a"); // a's agent idle
    h.submit("b", "b1", "x");
    h.submit("b", "b2", "x");
    h.auto_start_cleanups = false;
    let step = h.step(Input::Shutdown);
    assert!(!step.iter().any(|f| matches!(f, Fx::Complete(_))));
    // a's agent is being closed; b's turn runs.
    let step = h.echo("b");
    assert!(
        !step.iter().any(|f| matches!(f, Fx::Complete(_))),
        "{step:?}"
    );
    let jobs: Vec<_> = h.cleanups.keys().copied().collect();
    assert_eq!(jobs.len(), 2);
    let step = h.finish_cleanup(jobs[0], Ok(()));
    assert!(
        !step.iter().any(|f| matches!(f, Fx::Complete(_))),
        "{step:?}"
    );
    let step = h.finish_cleanup(jobs[1], Err("x".into()));
    let reports: Vec<&ShutdownReport> = step
        .iter()
        .filter_map(|f| match f {
            Fx::Complete(r) => Some(r),
            _ => None,
        })
        .collect();
    assert_eq!(reports.len(), 1);
    let r = reports[0];
    assert!(r.clean);
    assert_eq!(
        (
            r.queued_cancelled,
            r.turns_finished,
            r.turns_abandoned,
            r.cleanups_done,
            r.cleanups_failed,
            r.cleanups_timed_out
        ),
        (1, 1, 0, 1, 1, 0)
    );
    let step = h.advance(secs(100));
    assert!(!step.iter().any(|f| matches!(f, Fx::Complete(_))));
    let step = h.submit("c", "c1", "x");
    assert_eq!(
        h.events_of("c1"),
        vec![EventKind::Rejected(RejectReason::ShuttingDown)]
    );
    assert!(!step.iter().any(|f| matches!(f, Fx::Complete(_))));
}

/// With nothing running and nothing to close, shutdown completes in the step that began it.
#[test]
fn an_idle_core_completes_shutdown_at_once() {
    let mut h = Harness::new(cfg());
    let step = h.step(Input::Shutdown);
    assert_eq!(
        step,
        vec![Fx::Complete(ShutdownReport::between(
            &CoreStats::default(),
            &CoreStats::default()
        ))]
    );
    assert!(matches!(&step[0], Fx::Complete(r) if r.clean));
}

/// The report is the difference of the counters between shutdown's start and end.
#[test]
fn shutdown_report_is_the_difference_of_the_counters() {
    let mut before = CoreStats::default();
    before.turns.completed = 5;
    before.turns.failed = 4;
    before.turns.cancelled = 3;
    before.turns.abandoned = 2;
    before.cleanups.done = 10;
    before.cleanups.failed = 6;
    before.cleanups.timed_out = 1;
    before.messages.queued_cancelled = 7;
    let mut after = before;
    after.turns.completed += 3;
    after.turns.failed += 2;
    after.turns.cancelled += 1;
    after.cleanups.done += 4;
    after.cleanups.failed += 2;
    after.messages.queued_cancelled += 5;
    let r = ShutdownReport::between(&before, &after);
    assert!(r.clean);
    assert_eq!(
        (
            r.queued_cancelled,
            r.turns_finished,
            r.turns_abandoned,
            r.cleanups_done,
            r.cleanups_failed,
            r.cleanups_timed_out
        ),
        (5, 6, 0, 4, 2, 0)
    );
    let mut abandoned = after;
    abandoned.turns.abandoned += 3;
    let r = ShutdownReport::between(&before, &abandoned);
    assert_eq!((r.clean, r.turns_abandoned), (false, 3));
    let mut leaked = after;
    leaked.cleanups.timed_out += 2;
    let r = ShutdownReport::between(&before, &leaked);
    assert_eq!((r.clean, r.cleanups_timed_out), (false, 2));
}

// ---- partials ------------------------------------------------------------------------------

/// A job's partial route addresses its own turn: its partials reach its message.
#[test]
fn a_jobs_partial_route_reaches_its_message() {
    let mut h = Harness::new(cfg());
    h.submit("a", "a1", "x");
    let turn = h.turn_of("a");
    let route = h.running[&turn].partial_route();
    h.step(route.partial("so far".into()));
    assert!(
        h.events_of("a1")
            .contains(&EventKind::Partial("so far".into()))
    );
    let done = h
        .running
        .remove(&turn)
        .expect("job")
        .done(Some(1), TurnResult::Cancelled);
    assert_eq!(done.turn(), turn);
}

// ---- vocabulary ----------------------------------------------------------------------------

#[test]
fn wire_names_are_stable() {
    assert_eq!(RejectReason::QueueFull.as_str(), "queue_full");
    assert_eq!(RejectReason::ShuttingDown.as_str(), "shutting_down");
    assert_eq!(RejectReason::Overloaded.as_str(), "overloaded");
    assert_eq!(
        RejectReason::QueueFull.detail(),
        "the session's queue is full"
    );
    assert_eq!(
        RejectReason::ShuttingDown.detail(),
        "the gateway is shutting down"
    );
    assert!(RejectReason::Overloaded.detail().contains("retry later"));
    assert_eq!(CancelReason::Stopped.as_str(), "stopped");
    assert_eq!(CancelReason::Reset.as_str(), "reset");
    assert_eq!(CancelReason::Interrupted.as_str(), "interrupted");
    assert_eq!(CancelReason::Shutdown.as_str(), "shutdown");
    assert_eq!(CleanupContext::Sweep.as_str(), "sweep");
    assert_eq!(CleanupContext::Eviction.as_str(), "eviction");
    assert_eq!(CleanupContext::Reset.as_str(), "reset");
    assert_eq!(CleanupContext::Abandoned.as_str(), "abandoned turn");
    assert_eq!(CleanupContext::Panicked.as_str(), "panicked turn");
    assert_eq!(CleanupContext::Shutdown.as_str(), "shutdown");
    assert_eq!(FailReason::Agent("e".into()).to_string(), "agent error: e");
    assert_eq!(FailReason::Panic("p".into()).to_string(), "agent panic: p");
    assert_eq!(FailReason::Timeout.to_string(), "timeout");
}

/// A reply is cut to its byte bound on a character boundary, and flagged only when cut.
#[test]
fn a_reply_is_bounded_on_a_character_boundary() {
    let r = Reply::bounded("héllo".into(), 2); // 'é' spans bytes 1..3
    assert_eq!((r.text.as_str(), r.truncated), ("h", true));
    let r = Reply::bounded("hello".into(), 5);
    assert_eq!((r.text.as_str(), r.truncated), ("hello", false));
    let r = Reply::bounded("hello".into(), 4);
    assert_eq!((r.text.as_str(), r.truncated), ("hell", true));
    let r = Reply::bounded("hi".into(), 10);
    assert_eq!((r.text.as_str(), r.truncated), ("hi", false));
    let r = Reply::from("text");
    assert_eq!((&*r, r.truncated), ("text", false));
    assert_eq!(r.to_string(), "text");
    assert_eq!(Reply::from(String::from("s")).text, "s");
    assert_eq!(reply("x"), Outcome::Reply(Reply::from("x")));
}
