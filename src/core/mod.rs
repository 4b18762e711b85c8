//! The sans-IO core: the session table and turn scheduler as a pure state machine.
//!
//! It takes [`Input`]s with the current time and pushes [`Effect`]s for a driver to carry out.
//! It owns no thread, socket or clock, so any interleaving can be replayed deterministically.
//! `R` is the opaque route of a message's events; `A` is the opaque agent, which the core only
//! moves: into a turn job, back with the completion, into the idle cache or a cleanup job.
//!
//! Invariants kept by construction (each is tested in `tests/`, and checked after every
//! input in debug builds of small tables):
//! - a session has at most one claimed turn (`Session::turn`);
//! - **a session has at most one live agent**, from the factory call (on the worker that runs
//!   a turn with no agent) until its `close()` returned or was given up on: a session whose
//!   agent is closing (or still held by an abandoned turn) starts no turn until that ends;
//! - an agent is evictable (in the recency queue) only while its session is idle: no turn,
//!   nothing queued, not waiting for a worker;
//! - a session holds a slot iff it has a turn, queued messages or an agent (held or closing);
//! - a finished turn hands over to the next queued message in the same step, through the
//!   ready queue, without the session ever leaving its slot.
//!
//! Here: the inputs, timers and commands. `admit`: a message's admission (commands answered,
//! bounds, the session's queue); `turns`: the turn mechanics (queues, abandonment, the ready
//! queue, starting a turn, held turns); `agents`: the idle cache, parking and closing agents;
//! `check`: the invariants above, recomputed in debug builds; `cleanups`, `recency`, `timers`:
//! the queues they use; `types`: what crosses the core's boundary.

mod admit;
mod agents;
mod check;
mod cleanups;
mod recency;
#[cfg(test)]
mod sizes;
// The timer wheel is internal; the `bench` feature exposes it to its micro-benchmark.
mod reply;
#[cfg_attr(not(feature = "bench"), allow(unreachable_pub))]
pub(crate) mod timers;
mod turns;
mod types;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use crate::key::{Key, Slots};
use crate::message::{Body, Command, KeyHashBuilder, Message, MessageContext, SessionKey};
use cleanups::{Cleanups, DeadlineOf};
use recency::RecencyQueue;
use timers::TimerQueue;
pub use types::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Timer {
    TurnDeadline { turn: TurnId, slot: Key },
    StopGrace { turn: TurnId, slot: Key },
    CleanupDeadline { job: CleanupId, of: DeadlineOf },
    Sweep,
    DrainDeadline,
}

#[derive(Debug)]
struct Queued<R> {
    id: Arc<str>,
    /// Its turn waits for [`Input::Release`] once claimed.
    held: bool,
    text: String,
    context: MessageContext,
    route: R,
}

/// A held turn's job, kept until a worker takes it.
#[derive(Debug)]
struct Held<A> {
    job: TurnJob<A>,
    /// Its [`Input::Release`] came: it is in `released`, waiting for a worker.
    released: bool,
}

#[derive(Debug)]
struct Running<R> {
    turn: TurnId,
    id: Arc<str>,
    route: R,
    started: Duration,
    cancel: Option<CancelReason>,
    /// The agent must not be cached when it returns (reset, shutdown).
    discard_agent: bool,
}

/// Where a session's agent is.
#[derive(Debug)]
enum AgentState<A> {
    /// None exists; the next turn's worker creates one.
    Absent,
    /// Between turns. Evictable (in the recency queue) exactly while the session is idle;
    /// otherwise parked until the session's next turn takes it.
    Held { agent: A, idle_since: Duration },
    /// With the running turn, or being created by it.
    InTurn,
    /// Being closed by this job (or still held by an abandoned turn the job waits for).
    Closing(CleanupId),
}

#[derive(Debug)]
struct Session<R, A> {
    key: SessionKey,
    queue: VecDeque<Queued<R>>,
    /// Boxed: at most `turn_workers` sessions run a turn, and every other session would
    /// carry its size (issue 21: bytes per session).
    turn: Option<Box<Running<R>>>,
    agent: AgentState<A>,
    waiting_for_worker: bool,
}

impl<R, A> Session<R, A> {
    fn holds_nothing(&self) -> bool {
        self.turn.is_none() && self.queue.is_empty() && matches!(self.agent, AgentState::Absent)
    }

    /// No turn, nothing queued, not waiting: the only state in which its agent may be evicted.
    fn is_idle(&self) -> bool {
        self.turn.is_none() && self.queue.is_empty() && !self.waiting_for_worker
    }

    /// Gives back the buffer of a queue that emptied: an idle session holds none (a
    /// `VecDeque` keeps its capacity, four entries after the first push, when drained).
    fn free_empty_queue(&mut self) {
        if self.queue.is_empty() && self.queue.capacity() > 0 {
            self.queue = VecDeque::new();
        }
    }

    /// Whether a turn may start: no agent, or one held between turns.
    fn agent_free(&self) -> bool {
        matches!(self.agent, AgentState::Absent | AgentState::Held { .. })
    }
}

#[derive(Debug)]
struct Shutdown {
    /// The counters when shutdown began: the report is what they did since.
    stats_before: CoreStats,
    announced: bool,
}

/// The session table and scheduler.
///
/// # What the driver owes the core
///
/// The core never blocks, never reads a clock and never touches a thread; its driver (the
/// reactor in this crate, a test harness in `tests/`) must:
/// - pass a **monotonic** `now` (time since any fixed origin), never going backwards between
///   calls;
/// - call [`Core::advance`] no later than [`Core::next_deadline`] (early is harmless);
/// - carry out the effects **in the order they were pushed**, each exactly once: an
///   [`Effect::Emit`] for a message may not overtake an earlier one for the same message;
/// - run every [`Effect::StartTurn`] job on a worker and report it back exactly once with
///   [`Input::TurnDone`], built by [`TurnJob::done`] with its agent (the one it was given,
///   or the one the worker's factory created; `None` if creation failed) — even after the
///   turn was abandoned;
/// - run every [`Effect::Cleanup`] job, reporting [`Input::CleanupStarted`] when `close()`
///   begins and [`Input::CleanupDone`] when it returns;
/// - signal the turn's cancellation token on [`Effect::CancelTurn`], and stop waiting for
///   (replace) the thread of an abandoned turn or an exceeded cleanup;
/// - forward partial replies as [`Input::Partial`] built by the job's `PartialRoute`.
///
/// In return every accepted message gets exactly one terminal event, a session never has
/// two turns or two live agents, and the core's memory is bounded by its configuration.
#[derive(Debug)]
pub struct Core<R, A> {
    cfg: CoreConfig,
    slots: Slots<Session<R, A>>,
    index: HashMap<SessionKey, Key, KeyHashBuilder>,
    /// Sessions with queued work waiting for a worker, first come first served.
    ready: VecDeque<Key>,
    /// Idle agents by recency.
    cache: RecencyQueue,
    /// Per slot, the recency stamp of its idle agent (0: not in the recency queue). A dense
    /// copy of what the slab holds, so that liveness checks over many entries stay in cache.
    agent_seq: Vec<u64>,
    /// Turns claimed now, on a worker (at most `turn_workers`) or held (at most
    /// `max_held_turns`); timer liveness is checked here without touching slots.
    claimed_turns: IdSet<TurnId>,
    timers: TimerQueue<Timer>,
    cleanups: Cleanups<A>,
    /// Claimed turns of held messages not yet on a worker, with whether each was released.
    held: IdMap<TurnId, Held<A>>,
    /// The released ones among them, waiting for a free worker, in release order.
    released: VecDeque<TurnId>,
    /// Held turns that ended before their release, to be reported as returned (as a worker
    /// would) at the end of the current input.
    returned: VecDeque<TurnDone<A>>,
    next_turn: u64,

    queued_total: usize,
    queued_bytes: usize,
    waiting_total: usize,
    parked_agents: usize,
    stats: CoreStats,
    shutdown: Option<Shutdown>,
    /// Names a session's agent in its `/status` (several agents, routed).
    agent_names: Option<AgentNames>,
}

/// Which agent serves a session, asked by `/status`.
pub(crate) struct AgentNames(pub(crate) Box<NameOf>);

/// The name of a session's agent, if the factory names them.
pub(crate) type NameOf = dyn Fn(&SessionKey) -> Option<String> + Send;

impl std::fmt::Debug for AgentNames {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AgentNames")
    }
}

impl<R: Clone, A> Core<R, A> {
    /// A core with the given limits; `now` starts the idle sweep's clock.
    pub fn new(cfg: CoreConfig, now: Duration) -> Self {
        let mut timers = TimerQueue::default();
        timers.insert(now + cfg.sweep_interval, Timer::Sweep);
        Core {
            cfg,
            slots: Slots::new(),
            index: HashMap::default(),
            ready: VecDeque::new(),
            cache: RecencyQueue::default(),
            agent_seq: Vec::new(),
            claimed_turns: IdSet::default(),
            timers,
            cleanups: Cleanups::default(),
            held: IdMap::default(),
            released: VecDeque::new(),
            returned: VecDeque::new(),
            next_turn: 0,

            queued_total: 0,
            queued_bytes: 0,
            waiting_total: 0,
            parked_agents: 0,
            stats: CoreStats::default(),
            shutdown: None,
            agent_names: None,
        }
    }

    /// `/status` names the session's agent as `names` says.
    pub(crate) fn set_agent_names(&mut self, names: AgentNames) {
        self.agent_names = Some(names);
    }

    /// The configuration in force.
    pub fn config(&self) -> &CoreConfig {
        &self.cfg
    }

    /// The settings a reload may change, as in force.
    pub fn tunables(&self) -> Tunables {
        self.cfg.tunables()
    }

    /// Changes the settings a reload may change (see [`Tunables`] for when each applies).
    pub fn retune(&mut self, t: Tunables) {
        self.cfg.retune(t);
    }

    /// Applies one input at time `now`, pushing the resulting effects onto `fx`.
    pub fn handle(&mut self, now: Duration, input: Input<R, A>, fx: &mut Vec<Effect<R, A>>) {
        match input {
            Input::Submit { message, route } => self.submit(now, message, route, false, fx),
            Input::SubmitHeld { message, route } => self.submit(now, message, route, true, fx),
            Input::Release { turn } => self.release(turn),
            Input::TurnDone(done) => self.turn_done(now, done, fx),
            Input::Partial { turn, slot, text } => self.partial(turn, slot, text, fx),
            Input::CleanupStarted { job } => self.cleanup_started(now, job),
            Input::CleanupDone { job, result } => self.cleanup_done(job, result, fx),
            Input::Shutdown => self.begin_shutdown(now, fx),
            Input::HandOver { sessions } => self.hand_over(now, sessions, fx),
        }
        self.take_back_unreleased(now, fx);
        self.dispatch(now, fx);
        self.check_shutdown_complete(fx);
        self.check_invariants();
    }

    /// Fires every timer due at `now`.
    pub fn advance(&mut self, now: Duration, fx: &mut Vec<Effect<R, A>>) {
        while let Some(timer) = self.timers.pop_due(now) {
            self.fire(now, timer, fx);
        }
        self.take_back_unreleased(now, fx);
        self.dispatch(now, fx);
        self.check_shutdown_complete(fx);
        self.check_invariants();
    }

    /// The earliest pending timer; the driver should call [`Core::advance`] by then.
    pub fn next_deadline(&self) -> Option<Duration> {
        self.timers.next_deadline()
    }

    /// Current counters and gauges.
    pub fn stats(&self) -> CoreStats {
        let mut stats = self.stats;
        stats.sessions.total = self.slots.len();
        stats.sessions.running = self.claimed_turns.len();
        stats.sessions.queued_messages = self.queued_total;
        stats.sessions.waiting_for_worker = self.waiting_total;
        stats.sessions.cached_agents = self.cache.live;
        stats.sessions.parked_agents = self.parked_agents;
        stats.turns.in_flight = self.claimed_turns.len();
        stats.turns.held = self.held.len();
        stats.turns.max_held = self.cfg.max_held_turns;
        stats.cleanups.pending = self.cleanups.len();
        stats.cleanups.queued = self.cleanups.queued();
        stats
    }

    /// True once shutdown has begun.
    pub fn is_shutting_down(&self) -> bool {
        self.shutdown.is_some()
    }

    /// A view of one session, if it holds a slot.
    pub fn session(&self, key: &SessionKey) -> Option<SessionView> {
        self.index.get(key).map(|&slot| self.view(slot))
    }

    /// Views of every session holding a slot.
    pub fn sessions(&self) -> impl Iterator<Item = SessionView> + '_ {
        self.slots.iter().map(|(slot, _)| self.view(slot))
    }

    fn view(&self, slot: Key) -> SessionView {
        let s = &self.slots[slot];
        let agent = match &s.agent {
            AgentState::Absent => AgentPhase::Absent,
            AgentState::Held { .. } if self.in_cache(slot) => AgentPhase::Idle,
            AgentState::Held { .. } => AgentPhase::Parked,
            AgentState::InTurn => AgentPhase::InTurn,
            AgentState::Closing(_) => AgentPhase::Closing,
        };
        SessionView {
            slot,
            key: s.key.clone(),
            running: s.turn.as_ref().map(|t| t.turn),
            running_since: s.turn.as_ref().map(|t| t.started),
            queued: s.queue.len(),
            agent_cached: matches!(s.agent, AgentState::Held { .. }),
            agent,
            waiting_for_worker: s.waiting_for_worker,
        }
    }

    // ---- inputs ------------------------------------------------------------------------

    fn turn_done(&mut self, now: Duration, done: TurnDone<A>, fx: &mut Vec<Effect<R, A>>) {
        let TurnDone {
            turn,
            slot,
            session: key,
            agent,
            result,
        } = done;
        if !self.is_current(slot, turn) {
            self.abandoned_turn_returned(turn, key, agent, fx);
            return;
        }
        let session = &mut self.slots[slot];
        let Some(running) = session.turn.take() else {
            return;
        };
        debug_assert!(matches!(session.agent, AgentState::InTurn));
        session.agent = AgentState::Absent;
        self.claimed_turns.remove(&running.turn);
        self.note_stale_timer();
        let panicked = matches!(result, TurnResult::Panicked(_));
        let outcome = match result {
            // Whatever it did, the session's new owner answers the message.
            _ if running.cancel == Some(CancelReason::HandedOver) => {
                self.stats.turns.cancelled += 1;
                Outcome::Cancelled(CancelReason::HandedOver)
            }
            TurnResult::Reply(reply) => {
                self.stats.turns.completed += 1;
                // A reply that beat `/new`'s cancellation must not write back the conversation
                // the reset cleared.
                if running.cancel == Some(CancelReason::Reset) {
                    Outcome::Reply(reply.remembering(None))
                } else {
                    Outcome::Reply(reply)
                }
            }
            TurnResult::Cancelled => match running.cancel {
                Some(reason) => {
                    self.stats.turns.cancelled += 1;
                    Outcome::Cancelled(reason)
                }
                None => {
                    self.stats.turns.failed += 1;
                    Outcome::Failed(FailReason::Agent("cancelled without a request".into()))
                }
            },
            TurnResult::Failed(e) => {
                self.stats.turns.failed += 1;
                Outcome::Failed(FailReason::Agent(e))
            }
            TurnResult::Panicked(e) => {
                self.stats.turns.failed += 1;
                Outcome::Failed(FailReason::Panic(e))
            }
        };
        let discard_agent = running.discard_agent;
        end_turn(fx, *running, &key, outcome);
        if let Some(agent) = agent {
            if panicked {
                self.close_agent(slot, CleanupContext::Panicked, agent, fx);
            } else if discard_agent || self.shutdown.is_some() {
                let ctx = if self.shutdown.is_some() {
                    CleanupContext::Shutdown
                } else {
                    CleanupContext::Reset
                };
                self.close_agent(slot, ctx, agent, fx);
            } else {
                self.hold_agent(now, slot, agent);
            }
        }
        self.after_turn(slot);
        self.enforce_cache_cap(fx);
    }

    /// An abandoned turn came back (its outcome was given at abandonment). Its agent goes to
    /// the cleanup job its session waits on, or, when that job already gave up waiting, to
    /// a cleanup of its own that no session waits for.
    fn abandoned_turn_returned(
        &mut self,
        turn: TurnId,
        key: SessionKey,
        agent: Option<A>,
        fx: &mut Vec<Effect<R, A>>,
    ) {
        match agent {
            Some(agent) => {
                if let Err(agent) = self.cleanups.agent_returned(turn, agent) {
                    self.cleanups.enqueue(key, CleanupContext::Abandoned, agent);
                }
                self.pump_cleanups(fx);
            }
            None => {
                // Its agent was never created: nothing to close, the session may go on.
                if let Some((job, pending)) = self.cleanups.agent_never_existed(turn) {
                    self.note_stale_timer();
                    self.agent_gone(&pending.session, job, fx);
                }
            }
        }
    }

    fn partial(&mut self, turn: TurnId, slot: Key, text: String, fx: &mut Vec<Effect<R, A>>) {
        // The generation check: a partial of an abandoned or superseded turn goes nowhere.
        if !self.is_current(slot, turn) {
            return;
        }
        let session = &self.slots[slot];
        if let Some(running) = &session.turn {
            emit(
                fx,
                running.route.clone(),
                &running.id,
                &session.key,
                EventKind::Partial(text),
            );
        }
    }

    fn cleanup_started(&mut self, now: Duration, job: CleanupId) {
        if self.cleanups.started(job) {
            let of = DeadlineOf::Close;
            self.timers.insert(
                now + self.cfg.cleanup_timeout,
                Timer::CleanupDeadline { job, of },
            );
        }
    }

    fn cleanup_done(
        &mut self,
        job: CleanupId,
        result: Result<(), String>,
        fx: &mut Vec<Effect<R, A>>,
    ) {
        // A job that already exceeded its deadline was counted as leaked; its late end is moot.
        let Some(pending) = self.cleanups.finish(job) else {
            return;
        };
        self.note_stale_timer();
        match result {
            Ok(()) => {
                self.stats.cleanups.done += 1;
            }
            Err(error) => {
                self.stats.cleanups.failed += 1;
                fx.push(Effect::CleanupFailed {
                    job,
                    session: pending.session.clone(),
                    context: pending.context,
                    error,
                });
            }
        }
        self.agent_gone(&pending.session, job, fx);
    }

    fn begin_shutdown(&mut self, now: Duration, fx: &mut Vec<Effect<R, A>>) {
        if self.shutdown.is_some() {
            return;
        }
        self.shutdown = Some(Shutdown {
            stats_before: self.stats,
            announced: false,
        });
        let slots: Vec<Key> = self.slots.keys().collect();
        for slot in slots {
            self.cancel_queue(slot, CancelReason::Shutdown, fx);
            self.unready(slot);
            self.retire_agent(slot, CleanupContext::Shutdown, fx);
            self.release_if_empty(slot);
        }
        self.ready.clear();
        self.timers
            .insert(now + self.cfg.drain_timeout, Timer::DrainDeadline);
    }

    // ---- timers ------------------------------------------------------------------------

    fn fire(&mut self, now: Duration, timer: Timer, fx: &mut Vec<Effect<R, A>>) {
        match timer {
            Timer::TurnDeadline { turn, slot } => {
                if self.is_current(slot, turn) {
                    self.abandon(now, slot, AbandonReason::Timeout, fx);
                }
            }
            Timer::StopGrace { turn, slot } => {
                if self.is_current(slot, turn) {
                    let reason = self.slots[slot]
                        .turn
                        .as_ref()
                        .and_then(|t| t.cancel)
                        .unwrap_or(CancelReason::Stopped);
                    self.abandon(now, slot, AbandonReason::IgnoredCancel(reason), fx);
                }
            }
            Timer::CleanupDeadline { job, of } => {
                if let Some(p) = self.cleanups.expire(job, of) {
                    self.stats.cleanups.timed_out += 1;
                    fx.push(Effect::CleanupExceeded {
                        job,
                        session: p.session.clone(),
                        context: p.context,
                    });
                    self.agent_gone(&p.session, job, fx);
                }
            }
            Timer::Sweep => {
                self.sweep(now, fx);
                self.timers
                    .insert(now + self.cfg.sweep_interval, Timer::Sweep);
            }
            Timer::DrainDeadline => {
                let running: Vec<Key> = self
                    .slots
                    .iter()
                    .filter(|(_, s)| s.turn.is_some())
                    .map(|(slot, _)| slot)
                    .collect();
                for slot in running {
                    self.cancel_turn(now, slot, CancelReason::Shutdown, fx);
                }
            }
        }
    }

    /// One queued timer became moot (its turn ended, its cleanup finished).
    fn note_stale_timer(&mut self) {
        let (claimed, cleanups) = (&self.claimed_turns, &self.cleanups);
        self.timers.mark_stale(|timer| match *timer {
            Timer::TurnDeadline { turn, .. } | Timer::StopGrace { turn, .. } => {
                claimed.contains(&turn)
            }
            Timer::CleanupDeadline { job, .. } => cleanups.contains(job),
            Timer::Sweep | Timer::DrainDeadline => true,
        });
    }

    fn is_current(&self, slot: Key, turn: TurnId) -> bool {
        self.slots
            .get(slot)
            .and_then(|s| s.turn.as_ref())
            .is_some_and(|t| t.turn == turn)
    }

    fn sweep(&mut self, now: Duration, fx: &mut Vec<Effect<R, A>>) {
        while self.cleanups.backlog_len() < self.cfg.cleanup_queue_cap {
            let Some(slot) = self.oldest_cached() else {
                break;
            };
            let expired = matches!(&self.slots[slot].agent,
                AgentState::Held { idle_since, .. } if *idle_since + self.cfg.agent_idle_ttl <= now);
            if !expired {
                break;
            }
            self.close_idle_agent(slot, CleanupContext::Sweep, fx);
        }
    }

    // ---- commands ----------------------------------------------------------------------

    fn command(
        &mut self,
        now: Duration,
        key: &SessionKey,
        cmd: Command,
        fx: &mut Vec<Effect<R, A>>,
    ) -> String {
        let reply = self.command_reply(now, key, cmd, fx);
        match (cmd, &self.agent_names) {
            (Command::Status, Some(names)) => match (names.0)(key) {
                Some(name) => format!("{reply}; agent {name}"),
                None => reply,
            },
            _ => reply,
        }
    }

    fn command_reply(
        &mut self,
        now: Duration,
        key: &SessionKey,
        cmd: Command,
        fx: &mut Vec<Effect<R, A>>,
    ) -> String {
        let Some(&slot) = self.index.get(key) else {
            return match cmd {
                Command::Status => "idle: no turn running, 0 queued".to_owned(),
                Command::Stop => "nothing to stop: no turn running, 0 queued".to_owned(),
                Command::Reset => "reset: the next message starts a fresh agent".to_owned(),
            };
        };
        match cmd {
            Command::Status => {
                let s = &self.slots[slot];
                let queued = s.queue.len();
                match &s.turn {
                    Some(t) => {
                        let secs = now.saturating_sub(t.started).as_secs_f64();
                        let cancel = t.cancel.map(|r| format!(" (cancelling: {})", r.as_str()));
                        format!(
                            "running for {secs:.1}s{}, {queued} queued",
                            cancel.unwrap_or_default()
                        )
                    }
                    None if s.waiting_for_worker => {
                        format!("waiting for a worker, {queued} queued")
                    }
                    None if queued > 0 => {
                        format!("waiting for its previous agent to close, {queued} queued")
                    }
                    None => "idle: no turn running, 0 queued".to_owned(),
                }
            }
            Command::Stop | Command::Reset => {
                let reason = if cmd == Command::Stop {
                    CancelReason::Stopped
                } else {
                    CancelReason::Reset
                };
                let dropped = self.cancel_queue(slot, reason, fx);
                let was_running = self.cancel_turn(now, slot, reason, fx);
                self.unready(slot);
                if cmd == Command::Reset {
                    self.retire_agent(slot, CleanupContext::Reset, fx);
                } else {
                    self.settle_agent(slot);
                }
                self.release_if_empty(slot);
                let running = if was_running {
                    "cancelled the running turn"
                } else {
                    "no turn running"
                };
                let verb = cmd.name();
                format!("{verb}: {running}, {dropped} queued message(s) cancelled")
            }
        }
    }

    fn check_shutdown_complete(&mut self, fx: &mut Vec<Effect<R, A>>) {
        let Some(sd) = &mut self.shutdown else { return };
        if sd.announced || !self.claimed_turns.is_empty() || !self.cleanups.is_empty() {
            return;
        }
        sd.announced = true;
        fx.push(Effect::ShutdownComplete(ShutdownReport::between(
            &sd.stats_before,
            &self.stats,
        )));
    }
}

/// Emits the end of a message's turn, then its outcome.
fn end_turn<R: Clone, A>(
    fx: &mut Vec<Effect<R, A>>,
    running: Running<R>,
    key: &SessionKey,
    outcome: Outcome,
) {
    emit(
        fx,
        running.route.clone(),
        &running.id,
        key,
        EventKind::TurnEnded(running.turn),
    );
    emit(
        fx,
        running.route,
        &running.id,
        key,
        EventKind::Finished(outcome),
    );
}

fn emit<R, A>(
    fx: &mut Vec<Effect<R, A>>,
    route: R,
    id: &Arc<str>,
    key: &SessionKey,
    kind: EventKind,
) {
    fx.push(Effect::Emit {
        route,
        event: MessageEvent {
            id: id.clone(),
            session: key.clone(),
            kind,
        },
    });
}

#[cfg(test)]
mod mutant_tests;
