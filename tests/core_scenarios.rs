//! Deterministic scenarios against the sans-IO core, driven step by step.
//!
//! The first three are the Python gateway's pending-drain seeds
//! (`../shared/seeds/test_pending_drain_race.py`) rewritten for this design.

mod common;

use std::time::Duration;

use common::{Fx, Harness, key};
use turnstile::internal::core::{AgentPhase, CleanupContext, Input, TurnResult};
use turnstile::{
    AcceptState, BusyMode, CancelReason, CoreConfig, EventKind, FailReason, Outcome, RejectReason,
};

fn cfg() -> CoreConfig {
    CoreConfig {
        turn_workers: 4,
        ..CoreConfig::default()
    }
}

fn reply(s: &str) -> Outcome {
    Outcome::Reply(s.into())
}

fn started_ids(fx: &[Fx]) -> Vec<String> {
    fx.iter()
        .filter_map(|f| match f {
            Fx::Started { id, .. } => Some(id.clone()),
            _ => None,
        })
        .collect()
}

/// Seed `test_pending_drain_keeps_active_session_guard_live` (guarantee 4): when a turn ends
/// with a message queued, the next turn starts in the same step, from the same slot, and the
/// session is never unclaimed while it holds work.
#[test]
fn handoff_keeps_the_same_slot_and_starts_the_next_turn_in_the_same_step() {
    let mut h = Harness::new(cfg());
    h.submit("42", "M1", "first");
    let slot = h.core.session(&key("42")).expect("claimed").slot;
    h.submit("42", "M2", "second");
    let view = h.core.session(&key("42")).expect("still claimed");
    assert_eq!((view.slot, view.queued), (slot, 1));

    let step = h.echo("42");
    // One step: M1's outcome and M2's start, from the same slot.
    let m1_done = step.iter().position(|f| matches!(f, Fx::Event(e) if &*e.id == "M1" && e.kind == EventKind::Finished(reply("first"))));
    let m2_start = step
        .iter()
        .position(|f| matches!(f, Fx::Started { id, .. } if id == "M2"));
    assert!(
        m1_done.is_some() && m2_start.is_some(),
        "hand-off not in one step: {step:?}"
    );
    assert!(matches!(&step[m2_start.unwrap_or(0)], Fx::Started { slot: s, .. } if *s == slot));
    let view = h
        .core
        .session(&key("42"))
        .expect("claimed across the hand-off");
    assert_eq!(view.slot, slot);
    assert!(view.running.is_some());

    // A third message arriving during M2 queues behind it rather than starting a second turn.
    let step = h.submit("42", "M3", "third");
    assert!(
        started_ids(&step).is_empty(),
        "a second turn started: {step:?}"
    );
    h.echo("42");
    h.echo("42");
    for (id, text) in [("M1", "first"), ("M2", "second"), ("M3", "third")] {
        assert_eq!(h.outcomes_of(id), vec![reply(text)]);
    }
}

/// Seed `test_finally_cleanup_drains_late_arrival_pending` (guarantee 5): a message that
/// arrives before, right after (same reactor batch) or well after a turn's completion runs.
#[test]
fn late_arrival_runs_whatever_its_order_relative_to_the_completion() {
    // Before the completion.
    let mut h = Harness::new(cfg());
    h.submit("42", "M1", "a");
    let turn = h.turn_of("42");
    h.submit("42", "LATE", "b");
    h.complete(turn, TurnResult::Reply("a".into()));
    h.echo("42");
    assert_eq!(h.outcomes_of("LATE"), vec![reply("b")]);

    // In the same batch, completion first: both inputs handled with no time passing.
    let mut h = Harness::new(cfg());
    h.submit("42", "M1", "a");
    let turn = h.turn_of("42");
    h.complete(turn, TurnResult::Reply("a".into()));
    let step = h.submit("42", "LATE", "b");
    assert_eq!(started_ids(&step), vec!["LATE".to_owned()]);
    h.echo("42");
    assert_eq!(h.outcomes_of("LATE"), vec![reply("b")]);

    // Long after: the session is idle with a cached agent, which the new turn reuses.
    let mut h = Harness::new(cfg());
    h.submit("42", "M1", "a");
    h.echo("42");
    h.advance(Duration::from_secs(5));
    let step = h.submit("42", "LATE", "b");
    assert!(matches!(step.last(), Some(Fx::Started { id, agent: Some(_), .. }) if id == "LATE"));
    h.echo("42");
    assert_eq!(h.outcomes_of("LATE"), vec![reply("b")]);
}

/// Seed `test_no_pending_cleans_up_normally` (guarantee 6): a solo turn leaves no slot once
/// the session holds neither work nor an agent.
#[test]
fn solo_turn_leaves_no_slot_once_its_agent_is_gone() {
    // Without an agent cache the slot goes as the turn ends.
    let mut h = Harness::new(CoreConfig {
        max_cached_agents: 0,
        ..cfg()
    });
    h.submit("42", "solo", "hi");
    h.echo("42");
    assert_eq!(h.outcomes_of("solo"), vec![reply("hi")]);
    let job = h
        .log
        .iter()
        .find_map(|f| match f {
            Fx::Cleanup {
                job,
                context: CleanupContext::Eviction,
                ..
            } => Some(*job),
            _ => None,
        })
        .expect("the agent was evicted");
    // The slot stays while the agent closes (a message now would wait for the close)...
    let view = h.core.session(&key("42")).expect("held while closing");
    assert_eq!(view.agent, AgentPhase::Closing);
    // ...and goes once it has.
    h.finish_cleanup(job, Ok(()));
    assert!(h.core.session(&key("42")).is_none());
    assert_eq!(h.core.stats().sessions.total, 0);

    // With the cache, the slot holds the idle agent until the sweep closes it.
    let ttl = Duration::from_secs(60);
    let mut h = Harness::new(CoreConfig {
        agent_idle_ttl: ttl,
        sweep_interval: Duration::from_secs(10),
        ..cfg()
    });
    h.submit("42", "solo", "hi");
    h.echo("42");
    assert!(
        h.core
            .session(&key("42"))
            .is_some_and(|v| v.agent_cached && v.queued == 0)
    );
    h.advance(Duration::from_secs(50));
    assert!(h.core.session(&key("42")).is_some(), "swept before its TTL");
    let step = h.advance(Duration::from_secs(20));
    let Some(&Fx::Cleanup { job, .. }) = step.iter().find(|f| {
        matches!(
            f,
            Fx::Cleanup {
                context: CleanupContext::Sweep,
                ..
            }
        )
    }) else {
        panic!("swept: {step:?}");
    };
    h.finish_cleanup(job, Ok(()));
    assert!(h.core.session(&key("42")).is_none());
    assert_eq!(h.core.stats().sessions.total, 0);
}

/// Guarantee 7: one message past `queue_cap` is rejected `queue_full` to its sender, and gets
/// nothing else.
#[test]
fn queue_full_rejects_explicitly() {
    let mut h = Harness::new(CoreConfig {
        queue_cap: 3,
        ..cfg()
    });
    h.submit("42", "run", "r");
    for i in 0..3 {
        h.submit("42", &format!("q{i}"), "q");
    }
    assert_eq!(
        h.events_of("q2"),
        vec![EventKind::Accepted {
            state: AcceptState::Queued,
            position: 3
        }]
    );
    h.submit("42", "over", "x");
    assert_eq!(
        h.events_of("over"),
        vec![EventKind::Rejected(RejectReason::QueueFull)]
    );
    // Space frees as turns run; the queue accepts again.
    h.echo("42");
    h.submit("42", "again", "y");
    assert!(matches!(
        h.events_of("again")[..],
        [EventKind::Accepted { .. }]
    ));
}

/// Guarantee 8: with every worker busy, ready sessions take turns in arrival order; a session
/// with a long backlog does not hold the worker against a newcomer.
#[test]
fn a_busy_session_cannot_starve_a_newcomer() {
    let mut h = Harness::new(CoreConfig {
        turn_workers: 1,
        ..cfg()
    });
    for i in 0..5 {
        h.submit("A", &format!("a{i}"), "a");
    }
    h.submit("B", "b0", "b");
    assert_eq!(
        h.events_of("b0"),
        vec![EventKind::Accepted {
            state: AcceptState::Queued,
            position: 0
        }]
    );
    let step = h.echo("A");
    assert_eq!(
        started_ids(&step),
        vec!["b0".to_owned()],
        "B must run before A's backlog"
    );
    let step = h.echo("B");
    assert_eq!(started_ids(&step), vec!["a1".to_owned()]);
}

#[test]
fn interrupt_mode_cancels_the_running_turn_then_runs_the_follow_up() {
    let mut h = Harness::new(CoreConfig {
        busy_mode: BusyMode::Interrupt,
        ..cfg()
    });
    h.submit("42", "M1", "long job");
    let t1 = h.turn_of("42");
    let step = h.submit("42", "M2", "never mind");
    assert!(step.contains(&Fx::Cancel(t1)));
    let step = h.complete(t1, TurnResult::Cancelled);
    assert_eq!(
        h.outcomes_of("M1"),
        vec![Outcome::Cancelled(CancelReason::Interrupted)]
    );
    assert_eq!(started_ids(&step), vec!["M2".to_owned()]);

    // An agent that finished anyway keeps its reply.
    let t2 = h.turn_of("42");
    h.submit("42", "M3", "more");
    h.complete(t2, TurnResult::Reply("done".into()));
    assert_eq!(h.outcomes_of("M2"), vec![reply("done")]);
}

#[test]
fn merge_mode_runs_the_queue_as_one_turn_and_names_the_carrier() {
    let mut h = Harness::new(CoreConfig {
        busy_mode: BusyMode::Merge,
        ..cfg()
    });
    h.submit("42", "M1", "one");
    h.submit("42", "M2", "two");
    h.submit("42", "M3", "three");
    let step = h.echo("42");
    assert!(step.iter().any(
        |f| matches!(f, Fx::Started { id, input, .. } if id == "M2" && input == "two\nthree")
    ));
    assert_eq!(
        h.outcomes_of("M3"),
        vec![Outcome::Merged { into: "M2".into() }]
    );
    h.echo("42");
    assert_eq!(h.outcomes_of("M2"), vec![reply("two\nthree")]);
}

#[test]
fn stop_cancels_the_turn_and_the_queue_and_reports_how_many() {
    let mut h = Harness::new(cfg());
    h.submit("42", "M1", "a");
    let t1 = h.turn_of("42");
    h.submit("42", "M2", "b");
    h.submit("42", "M3", "c");
    let step = h.submit("42", "S", "/stop");
    assert!(step.contains(&Fx::Cancel(t1)));
    assert_eq!(
        h.outcomes_of("M2"),
        vec![Outcome::Cancelled(CancelReason::Stopped)]
    );
    assert_eq!(
        h.outcomes_of("M3"),
        vec![Outcome::Cancelled(CancelReason::Stopped)]
    );
    match &h.outcomes_of("S")[..] {
        [Outcome::Reply(text)] => assert!(
            text.contains("cancelled the running turn, 2 queued"),
            "{text}"
        ),
        other => panic!("stop reply: {other:?}"),
    }
    assert!(
        started_ids(&step).is_empty(),
        "a command never runs as agent text"
    );
    h.complete(t1, TurnResult::Cancelled);
    assert_eq!(
        h.outcomes_of("M1"),
        vec![Outcome::Cancelled(CancelReason::Stopped)]
    );
}

/// A turn that ignores cancellation is abandoned after the grace: its message gets its
/// outcome at once. Its agent is still alive on the stuck worker, so the session's next turn
/// waits (one live agent per session) until that agent comes back and is closed; the late
/// result is discarded.
#[test]
fn a_turn_ignoring_stop_is_abandoned_after_the_grace_and_the_session_proceeds() {
    let grace = Duration::from_secs(5);
    let mut h = Harness::new(CoreConfig {
        stop_grace: grace,
        ..cfg()
    });
    h.submit("42", "M1", "a");
    h.echo("42"); // caches an agent
    h.submit("42", "M2", "b");
    let stuck = h.turn_of("42");
    h.submit("42", "S", "/stop");
    h.submit("42", "M3", "c");
    assert!(h.advance(grace - Duration::from_millis(1)).is_empty());
    let step = h.advance(Duration::from_millis(1));
    assert!(step.contains(&Fx::Abandoned(stuck)));
    assert_eq!(
        h.outcomes_of("M2"),
        vec![Outcome::Cancelled(CancelReason::Stopped)]
    );
    assert!(started_ids(&step).is_empty(), "a second agent: {step:?}");
    // The stuck worker finally returns: no second outcome, its agent goes to cleanup.
    let step = h.complete(stuck, TurnResult::Reply("late".into()));
    let [
        Fx::Cleanup {
            job,
            context: CleanupContext::Abandoned,
            ..
        },
    ] = step[..]
    else {
        panic!("{step:?}");
    };
    assert_eq!(h.outcomes_of("M2").len(), 1);
    assert!(
        started_ids(&step).is_empty(),
        "started before the close: {step:?}"
    );
    // Its close ends: the session proceeds with a fresh agent.
    let step = h.finish_cleanup(job, Ok(()));
    assert!(
        step.iter()
            .any(|f| matches!(f, Fx::Started { id, agent: None, .. } if id == "M3"))
    );
    h.echo("42");
    assert_eq!(h.outcomes_of("M3"), vec![reply("c")]);
    assert_eq!(h.core.stats().turns.abandoned, 1);
}

/// An abandoned turn that never hands its agent back holds its session up for
/// `cleanup_timeout` at most: then the agent is given up on (counted as a timed-out cleanup,
/// WARNed `exceeded`) and the session proceeds; if the agent ever comes back it is closed
/// on its own.
#[test]
fn an_agent_stuck_past_the_cleanup_timeout_is_given_up_and_the_session_proceeds() {
    let (grace, cleanup) = (Duration::from_secs(5), Duration::from_secs(30));
    let mut h = Harness::new(CoreConfig {
        stop_grace: grace,
        cleanup_timeout: cleanup,
        ..cfg()
    });
    h.submit("42", "M1", "a");
    let stuck = h.turn_of("42");
    h.submit("42", "S", "/stop");
    h.submit("42", "M2", "b");
    h.advance(grace);
    assert!(h.advance(cleanup - Duration::from_millis(1)).is_empty());
    let step = h.advance(Duration::from_millis(1));
    assert!(
        step.iter().any(|f| matches!(
            f,
            Fx::Exceeded {
                context: CleanupContext::Abandoned,
                ..
            }
        )),
        "{step:?}"
    );
    assert!(
        step.iter()
            .any(|f| matches!(f, Fx::Started { id, agent: None, .. } if id == "M2"))
    );
    assert_eq!(h.core.stats().cleanups.timed_out, 1);
    let step = h.complete(stuck, TurnResult::Reply("very late".into()));
    assert!(matches!(
        step[..],
        [Fx::Cleanup {
            context: CleanupContext::Abandoned,
            ..
        }]
    ));
    assert_eq!(h.outcomes_of("M1").len(), 1);
}

#[test]
fn a_turn_past_its_timeout_fails_with_timeout() {
    let timeout = Duration::from_secs(600);
    let mut h = Harness::new(CoreConfig {
        turn_timeout: timeout,
        ..cfg()
    });
    h.submit("42", "M1", "a");
    let t = h.turn_of("42");
    let step = h.advance(timeout);
    assert!(step.contains(&Fx::Cancel(t)) && step.contains(&Fx::Abandoned(t)));
    assert_eq!(
        h.outcomes_of("M1"),
        vec![Outcome::Failed(FailReason::Timeout)]
    );
    // The stuck worker still has the agent: the session keeps its slot, waiting for it.
    let view = h
        .core
        .session(&key("42"))
        .expect("waiting for the stuck agent");
    assert_eq!(view.agent, AgentPhase::Closing);
    let step = h.complete(t, TurnResult::Reply("late".into()));
    let Some(&Fx::Cleanup { job, .. }) = step.first() else {
        panic!("the returning agent is closed: {step:?}");
    };
    h.finish_cleanup(job, Ok(()));
    assert!(
        h.core.session(&key("42")).is_none(),
        "no work, no agent: no slot"
    );
}

#[test]
fn reset_closes_the_agent_so_the_next_message_gets_a_fresh_one() {
    let mut h = Harness::new(cfg());
    h.submit("42", "M1", "a");
    h.echo("42");
    let step = h.submit("42", "R", "/new");
    let Some(&Fx::Cleanup { job, .. }) = step.iter().find(|f| {
        matches!(
            f,
            Fx::Cleanup {
                context: CleanupContext::Reset,
                ..
            }
        )
    }) else {
        panic!("the agent goes to cleanup: {step:?}");
    };
    // One live agent per session: the next message waits until the old agent's close ends.
    let step = h.submit("42", "M2", "b");
    assert!(
        started_ids(&step).is_empty(),
        "started during close: {step:?}"
    );
    assert_eq!(
        h.events_of("M2"),
        vec![EventKind::Accepted {
            state: AcceptState::Queued,
            position: 0
        }]
    );
    let step = h.finish_cleanup(job, Ok(()));
    assert!(
        step.iter()
            .any(|f| matches!(f, Fx::Started { agent: None, id, .. } if id == "M2"))
    );

    // Reset mid-turn: the agent coming back is closed, not cached.
    let t = h.turn_of("42");
    h.submit("42", "R2", "/reset");
    let step = h.complete(t, TurnResult::Cancelled);
    let Some(&Fx::Cleanup { job, .. }) = step.iter().find(|f| {
        matches!(
            f,
            Fx::Cleanup {
                context: CleanupContext::Reset,
                ..
            }
        )
    }) else {
        panic!("closed on return: {step:?}");
    };
    assert_eq!(
        h.outcomes_of("M2"),
        vec![Outcome::Cancelled(CancelReason::Reset)]
    );
    h.finish_cleanup(job, Ok(()));
    assert!(h.core.session(&key("42")).is_none());
}

#[test]
fn status_reports_state_and_queue_depth() {
    let mut h = Harness::new(cfg());
    h.submit("42", "s0", "/status");
    assert!(matches!(&h.outcomes_of("s0")[..], [Outcome::Reply(t)] if t.starts_with("idle")));
    assert!(
        h.core.session(&key("42")).is_none(),
        "a command on an idle session claims no slot"
    );
    h.submit("42", "M1", "a");
    h.submit("42", "M2", "b");
    h.advance(Duration::from_millis(1500));
    h.submit("42", "s1", "/status");
    assert_eq!(
        h.outcomes_of("s1"),
        vec![reply("running for 1.5s, 1 queued")]
    );
}

#[test]
fn a_panicking_turn_fails_and_its_agent_is_closed() {
    let mut h = Harness::new(cfg());
    h.submit("42", "M1", "a");
    let t = h.turn_of("42");
    let step = h.complete(t, TurnResult::Panicked("boom".into()));
    assert_eq!(
        h.outcomes_of("M1"),
        vec![Outcome::Failed(FailReason::Panic("boom".into()))]
    );
    assert!(step.iter().any(|f| matches!(
        f,
        Fx::Cleanup {
            context: CleanupContext::Panicked,
            ..
        }
    )));
}

#[test]
fn lru_evicts_the_least_recently_used_idle_agent() {
    let mut h = Harness::new(CoreConfig {
        max_cached_agents: 2,
        ..cfg()
    });
    for chat in ["a", "b", "c"] {
        h.submit(chat, &format!("{chat}1"), "x");
    }
    h.echo("b");
    h.echo("a");
    let step = h.echo("c");
    // b went idle first, so b's agent is evicted (its slot freed once it closed); a and c
    // keep theirs.
    let Some(&Fx::Cleanup { job, .. }) = step.iter().find(|f| {
        matches!(
            f,
            Fx::Cleanup {
                context: CleanupContext::Eviction,
                ..
            }
        )
    }) else {
        panic!("an eviction: {step:?}");
    };
    h.finish_cleanup(job, Ok(()));
    assert!(h.core.session(&key("b")).is_none());
    assert!(h.core.session(&key("a")).is_some_and(|v| v.agent_cached));
    assert!(h.core.session(&key("c")).is_some_and(|v| v.agent_cached));
}

#[test]
fn a_cleanup_past_its_deadline_is_counted_once_and_its_late_end_ignored() {
    let timeout = Duration::from_secs(30);
    let mut h = Harness::new(CoreConfig {
        cleanup_timeout: timeout,
        max_cached_agents: 0,
        ..cfg()
    });
    h.submit("42", "M1", "a");
    h.echo("42");
    let job = *h.cleanups.keys().next().expect("eviction cleanup");
    let step = h.advance(timeout);
    assert!(
        step.iter()
            .any(|f| matches!(f, Fx::Exceeded { job: j, .. } if *j == job))
    );
    let step = h.step(Input::CleanupDone {
        job,
        result: Err("late failure".into()),
    });
    assert!(
        step.is_empty(),
        "a leaked cleanup's late end must not be reported again: {step:?}"
    );
    let s = h.core.stats();
    assert_eq!(
        (s.cleanups.timed_out, s.cleanups.failed, s.cleanups.pending),
        (1, 0, 0)
    );
}

#[test]
fn a_failed_cleanup_is_reported() {
    let mut h = Harness::new(CoreConfig {
        max_cached_agents: 0,
        ..cfg()
    });
    h.submit("42", "M1", "a");
    h.echo("42");
    let job = *h.cleanups.keys().next().expect("cleanup");
    let step = h.finish_cleanup(job, Err("socket stuck".into()));
    assert!(matches!(step[..], [Fx::CleanupFailed { .. }]));
    assert_eq!(h.core.stats().cleanups.failed, 1);
}

#[test]
fn shutdown_drains_running_turns_cancels_the_queue_and_closes_agents() {
    let mut h = Harness::new(cfg());
    h.submit("idle", "I1", "x");
    h.echo("idle"); // cached agent
    h.submit("busy", "B1", "x");
    h.submit("busy", "B2", "y");
    let step = h.step(Input::Shutdown);
    assert_eq!(
        h.outcomes_of("B2"),
        vec![Outcome::Cancelled(CancelReason::Shutdown)]
    );
    assert!(step.iter().any(|f| matches!(
        f,
        Fx::Cleanup {
            context: CleanupContext::Shutdown,
            ..
        }
    )));
    h.submit("new", "N1", "z");
    assert_eq!(
        h.events_of("N1"),
        vec![EventKind::Rejected(RejectReason::ShuttingDown)]
    );
    // The running turn finishes within the drain and keeps its reply; its agent is closed.
    h.echo("busy");
    assert_eq!(h.outcomes_of("B1"), vec![reply("x")]);
    let jobs: Vec<_> = h.cleanups.keys().copied().collect();
    assert_eq!(jobs.len(), 2);
    let mut last = Vec::new();
    for job in jobs {
        last = h.finish_cleanup(job, Ok(()));
    }
    match &last[..] {
        [Fx::Complete(r)] => {
            assert!(r.clean);
            assert_eq!(
                (r.queued_cancelled, r.turns_finished, r.cleanups_done),
                (1, 1, 2)
            );
        }
        other => panic!("expected completion: {other:?}"),
    }
}

#[test]
fn shutdown_is_bounded_when_turns_and_cleanups_hang() {
    let c = CoreConfig {
        drain_timeout: Duration::from_secs(30),
        stop_grace: Duration::from_secs(5),
        cleanup_timeout: Duration::from_secs(30),
        ..cfg()
    };
    let mut h = Harness::new(c);
    h.submit("42", "M1", "a");
    h.step(Input::Shutdown);
    let step = h.advance(Duration::from_secs(30));
    assert!(step.iter().any(|f| matches!(f, Fx::Cancel(_))));
    let step = h.advance(Duration::from_secs(5));
    assert_eq!(
        h.outcomes_of("M1"),
        vec![Outcome::Cancelled(CancelReason::Shutdown)]
    );
    assert!(!step.iter().any(|f| matches!(f, Fx::Complete(_))));
    // The abandoned turn keeps its agent; shutdown waits for it up to the cleanup timeout.
    let step = h.advance(Duration::from_secs(30));
    match &step[..] {
        [.., Fx::Complete(r)] => {
            assert!(!r.clean && r.turns_abandoned == 1 && r.cleanups_timed_out == 1)
        }
        other => panic!("expected completion: {other:?}"),
    }
}

/// Streaming: a running turn's partial reaches its message's route; a partial of a turn that
/// was abandoned (or of any turn no longer current) is dropped by the generation check.
#[test]
fn partials_reach_the_current_turn_only() {
    let grace = Duration::from_secs(5);
    let mut h = Harness::new(CoreConfig {
        stop_grace: grace,
        ..cfg()
    });
    h.submit("42", "M1", "a");
    let t1 = h.turn_of("42");
    let slot = h.core.session(&key("42")).expect("claimed").slot;
    h.step(Input::Partial {
        turn: t1,
        slot,
        text: "so far".into(),
    });
    assert_eq!(
        h.events_of("M1").last(),
        Some(&EventKind::Partial("so far".into()))
    );
    h.submit("42", "S", "/stop");
    h.submit("42", "M2", "b");
    h.advance(grace);
    let stale = h.step(Input::Partial {
        turn: t1,
        slot,
        text: "late".into(),
    });
    assert!(stale.is_empty(), "a stale partial went out: {stale:?}");
    // Nor does a turn id that never existed reach anyone.
    let bogus = h.step(Input::Partial {
        turn: turnstile::TurnId(999),
        slot,
        text: "x".into(),
    });
    assert!(bogus.is_empty());
}

fn cleanup_job(
    step: &[Fx],
    context: CleanupContext,
) -> Option<turnstile::internal::core::CleanupId> {
    step.iter().find_map(|f| match f {
        Fx::Cleanup {
            job, context: c, ..
        } if *c == context => Some(*job),
        _ => None,
    })
}

/// Issue 7, "busy sessions lose their agent": a session whose follow-up waits for a worker
/// is busy, so its agent is parked, never evicted, and serves the follow-up; the cache
/// overflows its cap instead, and counts it.
#[test]
fn a_session_waiting_for_a_worker_keeps_its_agent_and_the_cache_overflows() {
    let mut h = Harness::new(CoreConfig {
        turn_workers: 1,
        max_cached_agents: 1,
        ..cfg()
    });
    for chat in ["a", "b", "c"] {
        h.submit(chat, &format!("{chat}1"), "x");
        h.submit(chat, &format!("{chat}2"), "y");
    }
    // a1 runs; the others wait. Each turn's agent comes back to a busy session.
    for _ in 0..6 {
        let running: Vec<String> = h.running.values().map(|j| j.session.to_string()).collect();
        let chat = running[0].rsplit(':').next().unwrap_or("").to_owned();
        h.echo(&chat);
    }
    for chat in ["a", "b", "c"] {
        let second = h.log.iter().find_map(|f| match f {
            Fx::Started { id, agent, .. } if *id == format!("{chat}2") => Some(*agent),
            _ => None,
        });
        assert!(
            matches!(second, Some(Some(_))),
            "{chat}'s follow-up got a fresh agent"
        );
    }
    // b's and c's agents were parked with the held total over the cap of one.
    assert_eq!(h.core.stats().sessions.cache_overflows, 2);
    // Once idle, the cap applies again: two of the three idle agents are evicted.
    assert_eq!(h.core.stats().sessions.cached_agents, 1);
    assert_eq!(h.core.stats().sessions.parked_agents, 0);
}

/// Issue 7, "two agents alive for one session": a message for a session whose agent is
/// being evicted waits for that close; its turn then creates the next agent.
#[test]
fn a_message_waits_for_its_sessions_evicted_agent_to_close() {
    let mut h = Harness::new(CoreConfig {
        max_cached_agents: 0,
        ..cfg()
    });
    h.submit("42", "M1", "a");
    let step = h.echo("42");
    let job = cleanup_job(&step, CleanupContext::Eviction).expect("evicted");
    let step = h.submit("42", "M2", "b");
    assert!(started_ids(&step).is_empty(), "{step:?}");
    h.submit("42", "st", "/status");
    assert_eq!(
        h.outcomes_of("st"),
        vec![reply("waiting for its previous agent to close, 1 queued")]
    );
    // A failed close ends it just the same.
    let step = h.finish_cleanup(job, Err("disk full".into()));
    assert_eq!(started_ids(&step), vec!["M2".to_owned()]);
}

/// Issue 7, "cleanup deadlines run from queueing": a job waiting behind the pool's
/// concurrency never times out; its deadline starts when `close()` starts.
#[test]
fn a_queued_cleanup_does_not_time_out_its_deadline_runs_from_its_start() {
    let timeout = Duration::from_secs(30);
    let mut h = Harness::new(CoreConfig {
        max_cached_agents: 0,
        cleanup_concurrency: 1,
        cleanup_timeout: timeout,
        ..cfg()
    });
    h.auto_start_cleanups = false;
    h.submit("a", "a1", "x");
    h.submit("b", "b1", "x");
    h.echo("a");
    h.echo("b");
    // One job issued (a's), b's waits in the backlog.
    assert_eq!(h.cleanups.len(), 1);
    assert_eq!(h.core.stats().cleanups.queued, 2);
    h.start_cleanup();
    assert_eq!(h.core.stats().cleanups.queued, 1);
    let (&a_job, _) = h.cleanups.iter().next().expect("a's job");
    h.advance(timeout / 2);
    h.finish_cleanup(a_job, Ok(()));
    // b's job was issued when a's ended; it sits unstarted for ten timeouts.
    let step = h.advance(timeout * 10);
    assert!(
        !step.iter().any(|f| matches!(f, Fx::Exceeded { .. })),
        "{step:?}"
    );
    assert_eq!(h.core.stats().cleanups.timed_out, 0);
    h.start_cleanup();
    assert!(h.advance(timeout - Duration::from_millis(1)).is_empty());
    let step = h.advance(Duration::from_millis(1));
    assert!(step.iter().any(|f| matches!(
        f,
        Fx::Exceeded {
            context: CleanupContext::Eviction,
            ..
        }
    )));
    assert_eq!(h.core.stats().cleanups.timed_out, 1);
}

/// The cleanup backlog is bounded: while it holds `cleanup_queue_cap` jobs, evictions pause
/// (the agents stay cached, over the cap) and resume as jobs finish.
#[test]
fn evictions_pause_while_the_cleanup_backlog_is_full() {
    let mut h = Harness::new(CoreConfig {
        max_cached_agents: 0,
        cleanup_concurrency: 1,
        cleanup_queue_cap: 1,
        ..cfg()
    });
    for chat in ["a", "b", "c", "d"] {
        h.submit(chat, &format!("{chat}1"), "x");
    }
    for chat in ["a", "b", "c", "d"] {
        h.echo(chat);
    }
    // a's job in the pool, b's in the backlog (full): c and d stay cached.
    let s = h.core.stats();
    assert_eq!((s.cleanups.pending, s.sessions.cached_agents), (2, 2));
    let job = *h.cleanups.keys().next().expect("a job in the pool");
    h.finish_cleanup(job, Ok(()));
    // b's job moves to the pool, c is evicted into the backlog.
    let s = h.core.stats();
    assert_eq!((s.cleanups.pending, s.sessions.cached_agents), (2, 1));
}

/// The idle sweep only closes agents of idle sessions: a parked agent is never swept.
#[test]
fn the_idle_sweep_never_closes_a_parked_agent() {
    let ttl = Duration::from_secs(60);
    let mut h = Harness::new(CoreConfig {
        turn_workers: 1,
        agent_idle_ttl: ttl,
        sweep_interval: Duration::from_secs(10),
        ..cfg()
    });
    h.submit("a", "a1", "x");
    h.echo("a"); // a's agent idle
    h.submit("b", "b1", "x"); // b runs on the one worker
    h.submit("a", "a2", "y"); // a waits for it: its agent is parked
    let step = h.advance(ttl * 3);
    assert!(
        cleanup_job(&step, CleanupContext::Sweep).is_none(),
        "{step:?}"
    );
    h.echo("b");
    assert!(
        h.log
            .iter()
            .any(|f| matches!(f, Fx::Started { id, agent: Some(_), .. } if id == "a2"))
    );
}

/// A global bound on waiting messages: past `max_queued_messages` (or bytes) across all
/// sessions, a new message is rejected `overloaded`, never accepted and never dropped.
#[test]
fn past_the_global_queue_bound_messages_are_rejected_overloaded() {
    let mut h = Harness::new(CoreConfig {
        turn_workers: 1,
        max_queued_messages: 2,
        max_queued_bytes: 10,
        ..cfg()
    });
    h.submit("a", "a1", "run"); // runs: not queued
    h.submit("b", "b1", "1234");
    h.submit("c", "c1", "12345678901"); // 11 bytes: past the byte bound
    h.submit("c", "c2", "123");
    h.submit("d", "d1", "x"); // two queued already
    assert_eq!(
        h.events_of("c1"),
        vec![EventKind::Rejected(RejectReason::Overloaded)]
    );
    assert_eq!(
        h.events_of("d1"),
        vec![EventKind::Rejected(RejectReason::Overloaded)]
    );
    assert!(
        h.core.session(&key("d")).is_none(),
        "a refused message claims no slot"
    );
    h.echo("a");
    h.submit("d", "d2", "x");
    assert!(matches!(
        h.events_of("d2")[..],
        [EventKind::Accepted { .. }]
    ));
}

/// Every counter and gauge of `CoreStats` moves exactly with what happened: a scripted run
/// touching each, checked field by field (operators read these; a miscount is a bug).
#[test]
fn stats_count_every_event_exactly() {
    let (grace, cleanup) = (Duration::from_secs(5), Duration::from_secs(30));
    let mut h = Harness::new(CoreConfig {
        turn_workers: 2,
        queue_cap: 2,
        max_cached_agents: 1,
        max_queued_messages: 3,
        stop_grace: grace,
        cleanup_timeout: cleanup,
        ..cfg()
    });
    h.submit("a", "a1", "x"); // runs
    h.submit("b", "b1", "x"); // runs
    h.submit("a", "a2", "y"); // queued
    h.submit("a", "a3", "z"); // queued (a's queue now full)
    h.submit("a", "a4", "w"); // queue_full
    h.submit("c", "c1", "v"); // queued (third waiting message overall)
    h.submit("c", "c2", "u"); // overloaded
    let s = h.core.stats();
    assert_eq!(
        (
            s.sessions.total,
            s.turns.in_flight,
            s.sessions.queued_messages,
            s.sessions.waiting_for_worker
        ),
        (3, 2, 3, 1)
    );
    assert_eq!((s.messages.accepted, s.messages.rejected), (5, 2));
    h.echo("a"); // a1 replies; a's agent parked (a2 waits); c1 starts
    let s = h.core.stats();
    assert_eq!(
        (
            s.turns.completed,
            s.sessions.parked_agents,
            s.sessions.cached_agents
        ),
        (1, 1, 0)
    );
    let tb = h.turn_of("b");
    h.complete(tb, TurnResult::Failed("nope".into())); // b's agent idle; a2 starts
    let tc = h.turn_of("c");
    h.complete(tc, TurnResult::Panicked("boom".into())); // c's agent closes
    let s = h.core.stats();
    assert_eq!(
        (
            s.turns.failed,
            s.sessions.cached_agents,
            s.sessions.parked_agents
        ),
        (2, 1, 0)
    );
    assert_eq!((s.cleanups.pending, s.cleanups.done), (1, 0));
    let job = *h.cleanups.keys().next().expect("c's cleanup");
    h.finish_cleanup(job, Err("close failed".into()));
    let s = h.core.stats();
    assert_eq!(
        (s.cleanups.pending, s.cleanups.failed, s.sessions.total),
        (0, 1, 2)
    );
    h.submit("a", "stop", "/stop"); // cancels a2 (running) and a3 (queued)
    let ta = h.turn_of("a");
    h.complete(ta, TurnResult::Cancelled);
    let s = h.core.stats();
    assert_eq!(
        (
            s.turns.cancelled,
            s.messages.queued_cancelled,
            s.messages.accepted
        ),
        (1, 1, 6)
    );
    // a's agent back and idle: two idle agents over a cap of one, b's (older) evicted.
    let s = h.core.stats();
    assert_eq!((s.sessions.cached_agents, s.cleanups.pending), (1, 1));
    let job = *h.cleanups.keys().next().expect("b's eviction");
    h.finish_cleanup(job, Ok(()));
    assert_eq!(h.core.stats().cleanups.done, 1);
    // An abandoned turn whose agent never returns: abandoned, then timed out.
    h.submit("d", "d1", "x");
    h.submit("d", "dstop", "/stop");
    h.advance(grace);
    let s = h.core.stats();
    assert_eq!(
        (s.turns.abandoned, s.turns.in_flight, s.cleanups.pending),
        (1, 0, 1)
    );
    h.advance(cleanup);
    let s = h.core.stats();
    assert_eq!((s.cleanups.timed_out, s.cleanups.pending), (1, 0));
    assert_eq!(
        s.sessions.cache_overflows, 0,
        "no agent was ever held over the cap"
    );
    assert_eq!(s.cleanups.queued, 0);
}

/// `next_deadline` is the earliest pending timer: the sweep at first, then a turn's timeout
/// when that comes sooner, then a stop grace.
#[test]
fn next_deadline_is_the_earliest_timer() {
    let mut h = Harness::new(CoreConfig {
        sweep_interval: Duration::from_secs(60),
        turn_timeout: Duration::from_secs(30),
        stop_grace: Duration::from_secs(5),
        ..cfg()
    });
    assert_eq!(h.core.next_deadline(), Some(Duration::from_secs(60)));
    h.advance(Duration::from_secs(1));
    h.submit("a", "a1", "x");
    assert_eq!(h.core.next_deadline(), Some(Duration::from_secs(31)));
    h.advance(Duration::from_secs(1));
    h.submit("a", "s", "/stop");
    assert_eq!(h.core.next_deadline(), Some(Duration::from_secs(7)));
}

// ---- held turns (a journaling shell's): claimed without a worker ------------------------

fn one_worker(max_held_turns: usize) -> CoreConfig {
    CoreConfig {
        turn_workers: 1,
        max_held_turns,
        ..cfg()
    }
}

fn on_worker(fx: &[Fx], id: &str) -> bool {
    fx.iter()
        .any(|f| matches!(f, Fx::Started { id: s, .. } if s == id))
}

/// Issue 21 §1: a held turn waiting for its `started` record takes no worker. With one
/// worker and three held turns waiting for their commit, all three are claimed (their
/// records can go in one commit), and the one released first runs at once, whatever the
/// others wait for. (Before, the first held turn kept the only worker and the others were
/// not even claimed until it had run: turns/s was bounded by workers / commit latency.)
#[test]
fn a_released_turn_starts_at_once_while_other_held_turns_wait_for_their_commit() {
    let mut h = Harness::new(one_worker(8));
    for chat in ["a", "b", "c"] {
        let step = h.submit_held(chat, chat, "x");
        assert!(h.claimed(chat).is_some(), "{chat} not claimed: {step:?}");
        assert!(
            !on_worker(&step, chat),
            "a held turn reached a worker: {step:?}"
        );
    }
    let s = h.core.stats();
    assert_eq!((s.turns.in_flight, s.turns.held), (3, 3));
    let step = h.release("b");
    assert!(on_worker(&step, "b"), "b's start is durable: {step:?}");
    assert_eq!(h.core.stats().turns.held, 2);
    h.echo("b");
    assert_eq!(h.outcomes_of("b"), vec![reply("x")]);
    assert!(h.running.is_empty(), "a and c were never released");
}

/// Released turns wait for a worker in release order, each starting in the step that frees
/// one; a message that is not held waits behind them.
#[test]
fn released_turns_take_the_free_workers_in_release_order() {
    let mut h = Harness::new(one_worker(8));
    for chat in ["a", "b", "c"] {
        h.submit_held(chat, chat, "x");
    }
    assert!(on_worker(&h.release("c"), "c"));
    assert!(!on_worker(&h.release("a"), "a"), "the only worker is busy");
    let step = h.release("b");
    assert!(!on_worker(&step, "b"));
    // An unheld message for an idle session: no worker, and released turns go first.
    let step = h.submit("d", "d", "y");
    assert!(!on_worker(&step, "d"), "{step:?}");
    assert!(
        h.claimed("d").is_none(),
        "d claimed before the released turns"
    );
    let step = h.echo("c");
    assert!(on_worker(&step, "a") && !on_worker(&step, "b"), "{step:?}");
    assert!(on_worker(&h.echo("a"), "b"));
    assert!(on_worker(&h.echo("b"), "d"));
    h.echo("d");
    for id in ["a", "b", "c"] {
        assert_eq!(h.outcomes_of(id), vec![reply("x")]);
    }
    assert_eq!(h.outcomes_of("d"), vec![reply("y")]);
}

/// `max_held_turns` bounds the held turns: past it a held message waits in its queue
/// (accepted `queued`, not claimed), and it is claimed in the step a held turn leaves for
/// a worker. The bound and the gauge are in the stats.
#[test]
fn held_turns_past_max_held_turns_wait_in_their_queues() {
    let mut h = Harness::new(one_worker(2));
    h.submit_held("a", "a", "x");
    h.submit_held("b", "b", "x");
    let step = h.submit_held("c", "c", "x");
    assert!(
        h.claimed("c").is_none(),
        "a third held turn past the bound: {step:?}"
    );
    assert_eq!(
        h.events_of("c"),
        vec![EventKind::Accepted {
            state: AcceptState::Queued,
            position: 0
        }]
    );
    let s = h.core.stats();
    assert_eq!(
        (
            s.turns.held,
            s.turns.max_held,
            s.sessions.waiting_for_worker
        ),
        (2, 2, 1)
    );
    let step = h.release("a");
    assert!(on_worker(&step, "a"));
    assert!(
        h.claimed("c").is_some(),
        "room among the held turns: {step:?}"
    );
    assert!(!on_worker(&step, "c"));
    assert_eq!(h.core.stats().turns.held, 2);
    h.echo("a");
    assert!(on_worker(&h.release("c"), "c"), "a's worker is free");
    assert!(h.running.contains_key(&h.turn_of("c")));
}

/// A released turn that is stopped while it waits for a worker ends `cancelled` without
/// reaching one, exactly once, and the others keep their place.
#[test]
fn a_released_turn_stopped_while_waiting_for_a_worker_never_reaches_one() {
    let mut h = Harness::new(one_worker(8));
    for chat in ["a", "b", "c"] {
        h.submit_held(chat, chat, "x");
    }
    h.release("a");
    h.release("b");
    h.release("c");
    h.submit("b", "stop", "/stop");
    assert_eq!(
        h.outcomes_of("b"),
        vec![Outcome::Cancelled(CancelReason::Stopped)]
    );
    let step = h.echo("a");
    assert!(on_worker(&step, "c") && !on_worker(&step, "b"), "{step:?}");
    h.echo("c");
    assert_eq!(h.outcomes_of("b").len(), 1);
    assert_eq!(h.core.stats().turns.held, 0);
}

/// A held turn waiting for a worker keeps its deadline (from its claim): it fails
/// `timeout` without reaching one, while the worker's turn runs on.
#[test]
fn a_released_turn_waiting_for_a_worker_times_out_without_reaching_one() {
    let mut h = Harness::new(CoreConfig {
        turn_timeout: Duration::from_secs(10),
        ..one_worker(8)
    });
    h.submit_held("c", "c", "x");
    h.advance(Duration::from_secs(5));
    h.submit_held("b", "b", "x");
    assert!(on_worker(&h.release("b"), "b"));
    h.advance(Duration::from_secs(1));
    assert!(!on_worker(&h.release("c"), "c"), "b holds the only worker");
    // c's deadline (10 s) comes before b's (15 s).
    let step = h.advance(Duration::from_secs(4));
    assert!(!on_worker(&step, "c"), "{step:?}");
    assert_eq!(
        h.outcomes_of("c"),
        vec![Outcome::Failed(FailReason::Timeout)]
    );
    assert!(h.outcomes_of("b").is_empty(), "b runs on");
    assert_eq!(h.core.stats().turns.held, 0);
    h.echo("b");
    assert_eq!(h.outcomes_of("b"), vec![reply("x")]);
}

/// `--cluster`, a lost partition: the handed-over sessions' queued and held messages end at
/// once, their running turn is cancelled, and whatever that turn returns — even a reply —
/// its message ends `cancelled: handed_over` (the new owner answers it); other sessions go
/// on, and a handed-over session takes new work afterwards (the partition regained).
#[test]
fn a_handed_over_session_ends_in_place_and_its_running_turns_result_is_discarded() {
    let mut h = Harness::new(cfg());
    let handed = Outcome::Cancelled(CancelReason::HandedOver);
    h.submit("a", "A1", "running");
    h.submit("a", "A2", "queued");
    h.submit_held("b", "B1", "held");
    h.submit("c", "C1", "other");
    let a1 = h.turn_of("a");
    let step = h.step(Input::HandOver {
        sessions: vec![key("a"), key("b"), key("gone")],
    });
    assert!(step.contains(&Fx::Cancel(a1)), "{step:?}");
    assert_eq!(h.outcomes_of("A2"), vec![handed.clone()]);
    assert_eq!(h.outcomes_of("B1"), vec![handed.clone()]);
    assert!(
        h.outcomes_of("A1").is_empty(),
        "ends when its worker returns"
    );
    assert!(h.core.session(&key("b")).is_none(), "the held session left");

    // The agent ignored the cancellation and replied: the reply is not the outcome.
    h.complete(a1, TurnResult::Reply("late".into()));
    assert_eq!(h.outcomes_of("A1"), vec![handed.clone()]);
    assert!(
        h.outcomes_of("C1").is_empty(),
        "another session's turn is untouched"
    );
    h.echo("c");
    assert_eq!(h.outcomes_of("C1"), vec![reply("other")]);

    // Its agent is closed (the new owner starts its own); then the session runs again.
    let jobs: Vec<_> = h.cleanups.keys().copied().collect();
    assert_eq!(jobs.len(), 1, "the handed-over session's agent is closed");
    h.submit("a", "A3", "again");
    for job in jobs {
        h.finish_cleanup(job, Ok(()));
    }
    h.echo("a");
    assert_eq!(h.outcomes_of("A3"), vec![reply("again")]);
}

/// A turn already cancelling (`/stop`) when its session is handed over, whose worker never
/// returns: its abandonment after the grace still ends it `handed_over`, not `stopped`.
#[test]
fn a_handed_over_turn_abandoned_after_its_grace_ends_handed_over() {
    let grace = Duration::from_secs(2);
    let mut h = Harness::new(CoreConfig {
        stop_grace: grace,
        ..cfg()
    });
    h.submit("a", "A1", "running");
    h.submit("a", "S", "/stop");
    h.step(Input::HandOver {
        sessions: vec![key("a")],
    });
    h.advance(grace);
    assert_eq!(
        h.outcomes_of("A1"),
        vec![Outcome::Cancelled(CancelReason::HandedOver)]
    );
}
