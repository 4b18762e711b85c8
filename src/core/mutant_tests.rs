//! Mutation-testing guarantees (issue 9 §3) on internals no caller can see.

use super::*;
use crate::journal::MemoryUpdate;

/// The memory each finished message carries to its outcome record.
fn memories(fx: Vec<Effect<(), u64>>) -> Vec<(Arc<str>, Option<MemoryUpdate>)> {
    fx.into_iter()
        .filter_map(|f| match f {
            Effect::Emit { event, .. } => match event.kind {
                EventKind::Finished(Outcome::Reply(mut r)) => Some((event.id, r.take_memory())),
                _ => None,
            },
            _ => None,
        })
        .collect()
}

/// `/new` clears the durable conversation in its own outcome, and a reply that beat its
/// cancellation (the agent answered anyway) stores nothing: the clear is not undone.
#[test]
fn new_clears_the_memory_and_a_reply_racing_it_stores_none() {
    let mut core: Core<(), u64> = Core::new(CoreConfig::default(), Duration::ZERO);
    let key = SessionKey::dm("test", "a").expect("key");
    let now = Duration::ZERO;
    let mut fx = Vec::new();
    let message = Message::new("m1", key.clone(), "hi").expect("message");
    core.handle(now, Input::Submit { message, route: () }, &mut fx);
    let job = fx
        .into_iter()
        .find_map(|f| match f {
            Effect::StartTurn(job) => Some(job),
            _ => None,
        })
        .expect("a turn started");
    let mut fx = Vec::new();
    let reset = Message::new("m2", key.clone(), "/new").expect("message");
    core.handle(
        now,
        Input::Submit {
            message: reset,
            route: (),
        },
        &mut fx,
    );
    let cleared = MemoryUpdate::clear(key.as_str());
    assert_eq!(memories(fx), vec![("m2".into(), Some(cleared))]);
    let kept = MemoryUpdate::keep(key.as_str(), vec![("hi".into(), "hello".into())]);
    let reply = Reply::from("hello").remembering(Some(kept.clone()));
    let mut fx = Vec::new();
    core.handle(
        now,
        Input::TurnDone(job.done(Some(1), TurnResult::Reply(reply))),
        &mut fx,
    );
    assert_eq!(memories(fx), vec![("m1".into(), None)]);
    // Without a reset (another session: this one's agent is still closing), the reply
    // keeps what it carries.
    let key = SessionKey::dm("test", "b").expect("key");
    let kept = MemoryUpdate::keep(key.as_str(), vec![("hi".into(), "hello".into())]);
    let mut fx = Vec::new();
    let message = Message::new("m3", key.clone(), "again").expect("message");
    core.handle(now, Input::Submit { message, route: () }, &mut fx);
    let job = fx
        .into_iter()
        .find_map(|f| match f {
            Effect::StartTurn(job) => Some(job),
            _ => None,
        })
        .expect("a turn started");
    let reply = Reply::from("hello").remembering(Some(kept.clone()));
    let mut fx = Vec::new();
    core.handle(
        now,
        Input::TurnDone(job.done(Some(2), TurnResult::Reply(reply))),
        &mut fx,
    );
    assert_eq!(memories(fx), vec![("m3".into(), Some(kept))]);
}

/// Every finished turn marks its timeout timer stale, so the timer heap stays bounded
/// by live timers however many turns run before their timeouts.
#[test]
fn finished_turns_leave_no_timer_buildup() {
    let mut core: Core<(), u64> = Core::new(CoreConfig::default(), Duration::ZERO);
    let key = SessionKey::dm("test", "a").expect("key");
    let now = Duration::ZERO;
    for i in 0..5_000 {
        let mut fx = Vec::new();
        let message = Message::new(&format!("m{i}"), key.clone(), "x").expect("message");
        core.handle(now, Input::Submit { message, route: () }, &mut fx);
        let job = fx
            .into_iter()
            .find_map(|f| match f {
                Effect::StartTurn(job) => Some(job),
                _ => None,
            })
            .expect("a turn started");
        let mut fx = Vec::new();
        let done = job.done(Some(1), TurnResult::Reply("ok".into()));
        core.handle(now, Input::TurnDone(done), &mut fx);
    }
    assert!(
        core.timers.queued_for_test() < 2_100,
        "{} timers kept",
        core.timers.queued_for_test()
    );
}

/// Every finished cleanup marks its deadline timer stale, and compaction drops it: the
/// heap stays bounded however many agents are closed before their deadlines.
#[test]
fn finished_cleanups_leave_no_timer_buildup() {
    let cfg = CoreConfig {
        max_cached_agents: 0,
        turn_timeout: Duration::from_millis(1),
        ..CoreConfig::default()
    };
    let mut core: Core<(), u64> = Core::new(cfg, Duration::ZERO);
    let key = SessionKey::dm("test", "a").expect("key");
    let mut now = Duration::ZERO;
    for i in 0..5_000 {
        let mut fx = Vec::new();
        let message = Message::new(&format!("m{i}"), key.clone(), "x").expect("message");
        core.handle(now, Input::Submit { message, route: () }, &mut fx);
        let Some(Effect::StartTurn(job)) = fx.pop() else {
            panic!("no turn started");
        };
        let done = job.done(Some(i), TurnResult::Reply("ok".into()));
        let mut fx = Vec::new();
        core.handle(now, Input::TurnDone(done), &mut fx);
        let Some(Effect::Cleanup(job)) = fx.pop() else {
            panic!("the agent was not evicted");
        };
        core.handle(now, Input::CleanupStarted { job: job.job }, &mut fx);
        let result = Ok(());
        core.handle(
            now,
            Input::CleanupDone {
                job: job.job,
                result,
            },
            &mut fx,
        );
        // The turn timeouts (1 ms) pass and fire stale; the cleanup deadlines stay queued.
        now += Duration::from_millis(2);
        core.advance(now, &mut fx);
    }
    assert_eq!(core.stats().cleanups.done, 5_000);
    assert!(
        core.timers.queued_for_test() < 2_100,
        "{} timers kept",
        core.timers.queued_for_test()
    );
}
