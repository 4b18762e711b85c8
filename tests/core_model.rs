//! Property test: random interleavings of submissions, completions, failures, commands,
//! cleanups (started late or at once), timer firings and shutdown across a few sessions,
//! checked after every step against a simple model of guarantees 1 (one turn per session),
//! 2 (order), 3 (exactly one outcome), 4 (never unclaimed while holding work), 6 (no leak),
//! 7 (bounded queues, per session and in total) and the agent lifecycle: at most one live
//! agent per session, counting agents being closed and agents held by abandoned turns, and
//! no agent evicted while its session is busy; and the start gate: a held turn (a journaling
//! shell's) reaches no worker before its release, and no more turns run than workers.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use common::{Fx, Harness, key};
use proptest::prelude::*;
use turnstile::internal::core::{AgentPhase, Input, SessionView, TurnResult};
use turnstile::{
    AcceptState, BusyMode, CancelReason, CoreConfig, EventKind, Outcome, RejectReason, TurnId,
};

const CHATS: [&str; 3] = ["a", "b", "c"];

#[derive(Clone, Debug)]
enum Op {
    Text(usize),
    /// A held message (a journaling shell's): its turn waits for a `Release` once claimed.
    HeldText(usize),
    /// Releases the i-th claimed held turn (modulo their number), or one already released.
    Release(usize),
    Command(usize, &'static str),
    Complete(usize, u8),
    CompleteStuck,
    StartCleanup,
    Cleanup(bool),
    Advance(u64),
    Shutdown,
    /// `--cluster`: the session's partition was lost (`Input::HandOver`).
    HandOver(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..3usize).prop_map(Op::Text),
        3 => (0..3usize).prop_map(Op::HeldText),
        3 => (0..4usize).prop_map(Op::Release),
        1 => (0..3usize, prop::sample::select(vec!["/stop", "/new", "/status"])).prop_map(|(s, c)| Op::Command(s, c)),
        5 => (0..3usize, 0..4u8).prop_map(|(s, r)| Op::Complete(s, r)),
        1 => Just(Op::CompleteStuck),
        2 => Just(Op::StartCleanup),
        2 => any::<bool>().prop_map(Op::Cleanup),
        2 => (0..8_000u64).prop_map(Op::Advance),
        1 => Just(Op::Shutdown),
        1 => (0..3usize).prop_map(Op::HandOver),
    ]
}

fn config() -> impl Strategy<Value = (CoreConfig, bool)> {
    (
        (1..4usize, 1..5usize, 0..3usize, 0..3usize),
        (1..12usize, 1..3usize, 0..3usize, any::<bool>()),
        1..4usize,
    )
        .prop_map(
            |((workers, cap, cached, mode), (total, concurrency, backlog, auto_start), held)| {
                let cfg = CoreConfig {
                    turn_workers: workers,
                    max_held_turns: held,
                    queue_cap: cap,
                    max_cached_agents: cached,
                    busy_mode: [BusyMode::Queue, BusyMode::Interrupt, BusyMode::Merge][mode],
                    agent_idle_ttl: Duration::from_secs(10),
                    sweep_interval: Duration::from_secs(3),
                    turn_timeout: Duration::from_secs(20),
                    stop_grace: Duration::from_secs(2),
                    cleanup_timeout: Duration::from_secs(5),
                    drain_timeout: Duration::from_secs(3),
                    max_queued_messages: total,
                    max_queued_bytes: 1 << 20,
                    cleanup_concurrency: concurrency,
                    cleanup_queue_cap: backlog,
                };
                (cfg, auto_start)
            },
        )
}

#[derive(Default)]
struct Model {
    /// Text messages accepted per session, in acceptance order.
    accepted: HashMap<String, Vec<String>>,
    /// Every accepted message (texts and commands).
    all_accepted: HashSet<String>,
    rejected: HashSet<String>,
    outcomes: HashMap<String, usize>,
    /// Session -> its claimed turn.
    in_flight: HashMap<String, TurnId>,
    /// Ids of held messages.
    held_ids: HashSet<String>,
    /// Claimed held turns, in claim order, and those not released yet: none of these may
    /// reach a worker.
    held_turns: Vec<TurnId>,
    unreleased: HashSet<TurnId>,
    /// Per session, the acceptance index of the last message that started a turn.
    last_started: HashMap<String, usize>,
    agents_in_turns: HashSet<u64>,
    agents_closed: HashSet<u64>,
    /// Agents alive (from their factory call until their close returned or was given up
    /// on), with their session.
    alive: HashMap<u64, String>,
    /// Agents given up on past a deadline: no longer counted, may still come back.
    given_up: HashSet<u64>,
    /// Cleanup job -> the agent it closes.
    job_agent: HashMap<turnstile::internal::core::CleanupId, u64>,
    /// Abandoned turns still holding their agent: turn -> (session, agent).
    stuck: HashMap<TurnId, (String, u64)>,
    /// Running turns: turn -> (session, agent).
    turn_agents: HashMap<TurnId, (String, u64)>,
    next_id: usize,
}

impl Model {
    fn observe(
        &mut self,
        step: &[Fx],
        cfg: &CoreConfig,
        queued_before: &HashMap<String, usize>,
    ) -> Result<(), TestCaseError> {
        let cap = cfg.queue_cap;
        for f in step {
            match f {
                Fx::Event(e) => {
                    let id = e.id.to_string();
                    let session = e.session.to_string();
                    match &e.kind {
                        EventKind::Accepted { state, .. } => {
                            prop_assert!(
                                self.all_accepted.insert(id.clone()),
                                "{id} accepted twice"
                            );
                            if !id.starts_with("cmd") {
                                // `running`: claimed in this step; a turn not held is also
                                // handed to a worker in it.
                                let claimed_now = step.iter().any(|f| matches!(f, Fx::Event(e) if *e.id == *id && matches!(e.kind, EventKind::TurnStarted(_))));
                                let started_now = step
                                    .iter()
                                    .any(|f| matches!(f, Fx::Started { id: s, .. } if *s == id));
                                // A follow-up in interrupt mode is accepted `queued`; when
                                // the turn it cancels was held (never on a worker), that turn
                                // ends at once and the follow-up is claimed in the same step.
                                let unheld_by_interrupt = cfg.busy_mode == BusyMode::Interrupt
                                    && step.iter().any(|f| matches!(f, Fx::Event(e) if self.held_ids.contains(&*e.id) && e.kind == EventKind::Finished(Outcome::Cancelled(CancelReason::Interrupted))));
                                prop_assert_eq!(
                                    claimed_now && !unheld_by_interrupt,
                                    *state == AcceptState::Running,
                                    "{} accepted as {:?}: {:?}",
                                    id,
                                    state,
                                    step
                                );
                                if !self.held_ids.contains(&id) {
                                    prop_assert_eq!(
                                        started_now,
                                        claimed_now,
                                        "{} claimed but not started",
                                        id
                                    );
                                }
                            }
                            if !id.starts_with("cmd") {
                                self.accepted.entry(session).or_default().push(id);
                            }
                        }
                        EventKind::Rejected(reason) => {
                            prop_assert!(
                                !self.all_accepted.contains(&id),
                                "{id} accepted and rejected"
                            );
                            if *reason == RejectReason::QueueFull {
                                let q = queued_before.get(&session).copied().unwrap_or(0);
                                prop_assert_eq!(q, cap, "queue_full below the cap");
                            }
                            if *reason == RejectReason::Overloaded {
                                let total: usize = queued_before.values().sum();
                                prop_assert_eq!(
                                    total,
                                    cfg.max_queued_messages,
                                    "overloaded below the cap"
                                );
                            }
                            self.rejected.insert(id);
                        }
                        EventKind::TurnStarted(t) => {
                            let prev = self.in_flight.insert(session.clone(), *t);
                            prop_assert!(prev.is_none(), "two turns in flight for {session}");
                            let order = &self.accepted[&session];
                            let idx = order
                                .iter()
                                .position(|m| *m == id)
                                .expect("claimed an accepted message");
                            if let Some(&last) = self.last_started.get(&session) {
                                prop_assert!(idx > last, "{id} started out of order in {session}");
                            }
                            self.last_started.insert(session.clone(), idx);
                            if self.held_ids.contains(&id) {
                                self.held_turns.push(*t);
                                self.unreleased.insert(*t);
                            }
                        }
                        EventKind::Partial(_) => {}
                        EventKind::TurnEnded(t) => {
                            prop_assert_eq!(
                                self.in_flight.remove(&session),
                                Some(*t),
                                "ended a turn not in flight"
                            );
                        }
                        EventKind::Finished(_) => {
                            prop_assert!(
                                self.all_accepted.contains(&id),
                                "outcome for unaccepted {id}"
                            );
                            let n = self.outcomes.entry(id.clone()).or_default();
                            *n += 1;
                            prop_assert_eq!(*n, 1, "{} got a second outcome", id);
                        }
                        other => {
                            prop_assert!(false, "an event the model does not know: {:?}", other)
                        }
                    }
                }
                Fx::Started {
                    turn,
                    session,
                    id,
                    agent,
                    agent_id,
                    ..
                } => {
                    match agent {
                        None => {
                            let other = self.alive.iter().find(|(_, s)| *s == session);
                            prop_assert!(
                                other.is_none(),
                                "a second agent for {} while {:?} lives",
                                session,
                                other
                            );
                            self.alive.insert(*agent_id, session.clone());
                        }
                        Some(a) => prop_assert_eq!(
                            self.alive.get(a),
                            Some(session),
                            "agent {} reused but not alive for its session",
                            a
                        ),
                    }
                    self.turn_agents.insert(*turn, (session.clone(), *agent_id));
                    prop_assert_eq!(
                        self.in_flight.get(session),
                        Some(turn),
                        "{} on a worker without its claim",
                        id
                    );
                    prop_assert!(
                        !self.unreleased.contains(turn),
                        "held {} reached a worker before its release",
                        id
                    );
                    if let Some(a) = agent {
                        prop_assert!(!self.agents_closed.contains(a), "closed agent {a} reused");
                        prop_assert!(self.agents_in_turns.insert(*a), "agent {a} in two turns");
                    }
                }
                Fx::Cleanup { job, agent, .. } => {
                    prop_assert!(
                        self.agents_closed.insert(*agent),
                        "agent {agent} closed twice"
                    );
                    prop_assert!(
                        !self.agents_in_turns.contains(agent),
                        "closing agent {agent} mid-turn"
                    );
                    prop_assert!(
                        self.alive.contains_key(agent) || self.given_up.contains(agent),
                        "closing agent {agent} that is not alive"
                    );
                    self.job_agent.insert(*job, *agent);
                    self.stuck.retain(|_, (_, a)| a != agent);
                }
                Fx::Abandoned(turn) => {
                    if let Some((session, agent)) = self.turn_agents.remove(turn) {
                        self.stuck.insert(*turn, (session, agent));
                    }
                }
                Fx::Exceeded { job, session, .. } => {
                    let agent = match self.job_agent.get(job) {
                        Some(&a) => Some(a),
                        // A job still waiting for an abandoned turn to hand its agent back.
                        None => self
                            .stuck
                            .values()
                            .find(|(s, a)| s == session && self.alive.contains_key(a))
                            .map(|&(_, a)| a),
                    };
                    prop_assert!(agent.is_some(), "exceeded job {:?} without an agent", job);
                    if let Some(a) = agent {
                        self.alive.remove(&a);
                        self.given_up.insert(a);
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }
}

fn check_table(h: &Harness, cap: usize) -> Result<(), TestCaseError> {
    let views: Vec<_> = h.core.sessions().collect();
    prop_assert_eq!(views.len(), h.core.stats().sessions.total);
    for v in &views {
        prop_assert!(
            v.running.is_some() || v.queued > 0 || v.agent != AgentPhase::Absent,
            "leaked slot for {}",
            v.key
        );
        prop_assert!(
            v.queued == 0
                || v.running.is_some()
                || v.waiting_for_worker
                || v.agent == AgentPhase::Closing,
            "{} holds work unclaimed",
            v.key
        );
        if v.agent == AgentPhase::Idle {
            prop_assert!(v.running.is_none() && v.queued == 0 && !v.waiting_for_worker);
        }
        prop_assert!(v.queued <= cap, "{} queue over cap", v.key);
        prop_assert_eq!(h.core.session(&v.key).map(|x| x.slot), Some(v.slot));
    }
    let (stats, cfg) = (h.core.stats(), h.core.config());
    prop_assert!(stats.turns.held <= cfg.max_held_turns);
    prop_assert!(stats.turns.in_flight <= cfg.turn_workers + cfg.max_held_turns);
    prop_assert!(
        h.running.len() <= cfg.turn_workers,
        "more turns on workers than workers"
    );
    Ok(())
}

fn views(h: &Harness) -> HashMap<String, SessionView> {
    h.core.sessions().map(|v| (v.key.to_string(), v)).collect()
}

/// An agent kept for a busy session (parked) leaves it only for its next turn, or to be
/// closed by `/new`, a hand-over or shutdown: never by eviction or the idle sweep.
fn check_no_busy_eviction(
    op: &Op,
    before: &HashMap<String, SessionView>,
    after: &HashMap<String, SessionView>,
) -> Result<(), TestCaseError> {
    for (session, b) in before {
        let Some(a) = after.get(session) else {
            continue;
        };
        if b.agent == AgentPhase::Parked && a.agent == AgentPhase::Closing {
            let allowed = match op {
                Op::Shutdown => true,
                Op::Command(s, "/new") | Op::HandOver(s) => key(CHATS[*s]).to_string() == *session,
                _ => false,
            };
            prop_assert!(allowed, "{}'s parked agent closed by {:?}", session, op);
        }
    }
    Ok(())
}

fn queued_by_session(h: &Harness) -> HashMap<String, usize> {
    h.core
        .sessions()
        .map(|v| (v.key.to_string(), v.queued))
        .collect()
}

fn apply(h: &mut Harness, m: &mut Model, op: &Op) -> Vec<Fx> {
    match *op {
        Op::Text(s) => {
            m.next_id += 1;
            h.submit(
                CHATS[s],
                &format!("m{}", m.next_id),
                &format!("text {}", m.next_id),
            )
        }
        Op::HeldText(s) => {
            m.next_id += 1;
            let id = format!("m{}", m.next_id);
            m.held_ids.insert(id.clone());
            h.submit_held(CHATS[s], &id, &format!("text {}", m.next_id))
        }
        Op::Release(i) => {
            if m.held_turns.is_empty() {
                return vec![];
            }
            // Any claimed held turn: not yet released, released, or ended (then ignored).
            let turn = m.held_turns[i % m.held_turns.len()];
            m.unreleased.remove(&turn);
            h.step(Input::Release { turn })
        }
        Op::Command(s, c) => {
            m.next_id += 1;
            h.submit(CHATS[s], &format!("cmd{}", m.next_id), c)
        }
        Op::Complete(s, r) => {
            let k = key(CHATS[s]);
            let Some((&turn, job)) = h.running.iter().find(|(_, j)| j.session == k) else {
                return vec![];
            };
            if let Some(a) = job.agent {
                m.agents_in_turns.remove(&a);
            }
            m.turn_agents.remove(&turn);
            let result = match r {
                0 => TurnResult::Reply("ok".into()),
                1 => TurnResult::Cancelled,
                2 => TurnResult::Failed("agent error".into()),
                _ => TurnResult::Panicked("boom".into()),
            };
            h.complete(turn, result)
        }
        Op::CompleteStuck => {
            let Some((&turn, job)) = h.stuck.iter().next() else {
                return vec![];
            };
            if let Some(a) = job.agent {
                m.agents_in_turns.remove(&a);
            }
            h.complete(turn, TurnResult::Reply("late".into()))
        }
        Op::StartCleanup => h.start_cleanup(),
        Op::Cleanup(ok) => {
            let Some(&job) = h.cleanups.keys().min() else {
                return vec![];
            };
            if let Some(a) = h.cleanups.get(&job) {
                m.alive.remove(a);
            }
            h.finish_cleanup(
                job,
                if ok {
                    Ok(())
                } else {
                    Err("close failed".into())
                },
            )
        }
        Op::Advance(ms) => h.advance(Duration::from_millis(ms)),
        Op::Shutdown => h.step(Input::Shutdown),
        Op::HandOver(s) => h.step(Input::HandOver {
            sessions: vec![key(CHATS[s])],
        }),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn guarantees_hold_under_any_interleaving((cfg, auto_start) in config(), ops in prop::collection::vec(op(), 1..120)) {
        let cap = cfg.queue_cap;
        let mut h = Harness::new(cfg.clone());
        h.auto_start_cleanups = auto_start;
        let mut m = Model::default();
        for op in &ops {
            let before = queued_by_session(&h);
            let views_before = views(&h);
            let step = apply(&mut h, &mut m, op);
            m.observe(&step, &cfg, &before)?;
            check_no_busy_eviction(op, &views_before, &views(&h))?;
            check_table(&h, cap)?;
        }
        // Let everything run out: complete every turn, answer every cleanup, pass time.
        for _ in 0..200 {
            if h.running.is_empty() && h.stuck.is_empty() && h.cleanups.is_empty() && h.core.stats().sessions.total == 0 {
                break;
            }
            let unreleased = m.held_turns.iter().position(|t| m.unreleased.contains(t));
            let op = if let Some(i) = unreleased {
                Op::Release(i)
            } else if let Some(s) = CHATS.iter().position(|c| h.running.values().any(|j| j.session == key(c))) {
                Op::Complete(s, 0)
            } else if !h.stuck.is_empty() {
                Op::CompleteStuck
            } else if !h.unstarted.is_empty() {
                Op::StartCleanup
            } else if !h.cleanups.is_empty() {
                Op::Cleanup(true)
            } else {
                Op::Advance(60_000)
            };
            let before = queued_by_session(&h);
            let step = apply(&mut h, &mut m, &op);
            m.observe(&step, &cfg, &before)?;
            check_table(&h, cap)?;
        }
        prop_assert!(h.running.is_empty() && h.core.stats().sessions.queued_messages == 0);
        for id in &m.all_accepted {
            prop_assert_eq!(m.outcomes.get(id).copied(), Some(1), "{} has no outcome", id);
        }
        for id in &m.rejected {
            prop_assert!(!m.outcomes.contains_key(id));
        }
    }
}
