//! The driver: carries out the core's effects on the pools, the sinks and the frontend.
//! `apply` only routes; each effect has a step of its own, and what is logged and counted
//! about it is the [`Observer`]'s.

use std::collections::BTreeMap;
use std::time::Duration;

use crossbeam_channel::TrySendError;

use super::frontend::Frontend;
use super::observe::Observer;
use super::route::{EventSink, Route};
use super::workers::{BoxAgent, CleanupPool, TurnPool, WorkerReport};
use crate::agent::CancelToken;
use crate::core::{
    AbandonReason, CleanupContext, CleanupId, CleanupJob, Core, Effect, EventKind, IdMap,
    MessageEvent, ShutdownReport, TurnId, TurnJob,
};
use crate::histogram::PromHistogram;
use crate::message::SessionKey;
use crate::pool::{JobTicket, Replacement};

/// How the driver gives up on a job it handed out.
enum Ticket {
    /// A pool's job: its thread stops counting toward the pool's cap.
    Pool(JobTicket),
    /// An async task's (feature `async`): firing the token drops the task's future.
    #[cfg(feature = "async")]
    Task(CancelToken),
}

/// The reactor's side of the pools: carries out the core's effects.
pub(super) struct Driver {
    core: Core<Route, BoxAgent>,
    turn_pool: TurnPool,
    cleanup_pool: CleanupPool,
    /// The runtime's own event channel, where `Route::Default` delivers.
    events: EventSink,
    /// Unread events in `events` at which partials are skipped.
    events_backlog: usize,
    /// Where turns and closes of async agents run, when the runtime's agents are async.
    #[cfg(feature = "async")]
    tasks: Option<super::async_agent::AsyncRunner>,
    /// Turns handed out: the token that cancels each, the ticket that gives up on it.
    turns: IdMap<TurnId, (CancelToken, Ticket)>,
    /// Cleanups handed out: the ticket that gives up on each.
    cleanups: IdMap<CleanupId, Ticket>,
    /// Set by the core's last effect.
    report: Option<ShutdownReport>,
    /// The reactor's clock at the effects being applied.
    now: Duration,
    observe: Observer,
}

impl Driver {
    pub(super) fn new(
        core: Core<Route, BoxAgent>,
        turn_pool: TurnPool,
        cleanup_pool: CleanupPool,
        (events, events_backlog): (EventSink, usize),
        #[cfg(feature = "async")] tasks: Option<super::async_agent::AsyncRunner>,
    ) -> Driver {
        Driver {
            core,
            turn_pool,
            cleanup_pool,
            events,
            events_backlog,
            #[cfg(feature = "async")]
            tasks,
            turns: IdMap::default(),
            cleanups: IdMap::default(),
            report: None,
            now: Duration::ZERO,
            observe: Observer::new(),
        }
    }

    /// The core.
    pub(super) fn core(&self) -> &Core<Route, BoxAgent> {
        &self.core
    }

    /// The core, to feed it inputs.
    pub(super) fn core_mut(&mut self) -> &mut Core<Route, BoxAgent> {
        &mut self.core
    }

    /// The pool running turns.
    pub(super) fn turn_pool(&self) -> &TurnPool {
        &self.turn_pool
    }

    /// The pool closing agents.
    pub(super) fn cleanup_pool(&self) -> &CleanupPool {
        &self.cleanup_pool
    }

    /// Async turns and closes in flight (zeros without async agents).
    pub(super) fn async_tasks(&self) -> (usize, usize) {
        #[cfg(feature = "async")]
        if let Some(tasks) = &self.tasks {
            return (tasks.turns_in_flight(), tasks.closes_in_flight());
        }
        (0, 0)
    }

    /// Events whose sink was full or gone.
    pub(super) fn undelivered(&self) -> u64 {
        self.observe.undelivered()
    }

    /// Partials delivered.
    pub(super) fn partials_forwarded(&self) -> u64 {
        self.observe.partials_forwarded()
    }

    /// Partials not sent to the runtime's `Events` stream: it was behind.
    pub(super) fn partials_skipped(&self) -> u64 {
        self.observe.partials_skipped()
    }

    /// The runtime's rejections by reason.
    pub(super) fn rejected_by_reason(&self) -> &BTreeMap<&'static str, u64> {
        self.observe.rejected_by_reason()
    }

    /// Turn durations, claim to end.
    pub(super) fn turn_durations(&self) -> &PromHistogram {
        self.observe.turn_durations()
    }

    /// The shutdown report, once the core has produced it.
    pub(super) fn take_report(&mut self) -> Option<ShutdownReport> {
        self.report.take()
    }

    /// A job came back: its ticket is no longer needed to cancel or replace it.
    pub(super) fn forget_job(&mut self, completion: &WorkerReport) {
        match completion {
            WorkerReport::Turn(done) => {
                self.turns.remove(&done.turn());
            }
            WorkerReport::CleanupDone(job, _) => {
                self.cleanups.remove(job);
            }
            WorkerReport::Partial(_) | WorkerReport::CleanupStarted(_) => {}
        }
    }

    /// Carries out `effects` in order, at the reactor's clock `now`.
    pub(super) fn apply_all(
        &mut self,
        now: Duration,
        effects: impl Iterator<Item = Effect<Route, BoxAgent>>,
        frontend: &mut impl Frontend,
    ) {
        self.now = now;
        for effect in effects {
            self.apply(effect, frontend);
        }
    }

    fn apply(&mut self, effect: Effect<Route, BoxAgent>, frontend: &mut impl Frontend) {
        match effect {
            Effect::Emit { route, event } => self.emit(route, event, frontend),
            Effect::StartTurn(job) => self.start_turn(job),
            Effect::CancelTurn(turn) => self.cancel_turn(turn),
            Effect::TurnAbandoned {
                turn,
                session,
                reason,
            } => self.abandon_turn(turn, &session, reason),
            Effect::Cleanup(job) => self.start_cleanup(job),
            Effect::CleanupExceeded {
                job,
                session,
                context,
            } => self.abandon_cleanup(job, &session, context),
            Effect::CleanupFailed {
                session,
                context,
                error,
                ..
            } => self.observe.cleanup_failed(&session, context, &error),
            Effect::ShutdownComplete(report) => self.report = Some(report),
        }
    }

    /// Observes a message's event, then delivers it on its route. The reactor never blocks
    /// on a sink: a full one loses the event.
    fn emit(&mut self, route: Route, event: MessageEvent, frontend: &mut impl Frontend) {
        if matches!(route, Route::Default) && self.skips_partial(&event) {
            self.observe
                .partial_skipped(&event, self.events.len(), self.now);
            return;
        }
        self.observe.event(&event, self.now);
        match route {
            Route::Local(tag) => frontend.deliver(tag, event),
            Route::Default => {
                let partial = matches!(event.kind, EventKind::Partial(_));
                Self::send(&self.events, event, &mut self.observe);
                // Sent only below the backlog; the reader only takes events away.
                debug_assert!(!partial || self.events.len() <= self.events_backlog);
            }
            Route::Sink(sink) => Self::send(&sink, event, &mut self.observe),
            #[cfg(feature = "async")]
            Route::Stream(stream) => {
                if let Err(ev) = stream.deliver(event) {
                    self.observe.stream_dropped(&ev);
                }
            }
        }
    }

    /// Whether `event` is a partial the runtime's `Events` stream is too far behind to take:
    /// its reader has `events_backlog` events or more still to read. Skipping one loses no
    /// text (a partial is the whole reply so far: the next one, or the outcome, carries it);
    /// every other event is always sent, so a reader that never reads holds the backlog plus
    /// at most four events per message.
    fn skips_partial(&self, event: &MessageEvent) -> bool {
        matches!(event.kind, EventKind::Partial(_)) && self.events.len() >= self.events_backlog
    }

    /// Sends an event to a channel; a full or closed one loses it (counted, logged).
    fn send(sink: &EventSink, event: MessageEvent, observe: &mut Observer) {
        match sink.try_send(event) {
            Ok(()) => {}
            Err(TrySendError::Full(ev)) => observe.sink_full(&ev),
            Err(TrySendError::Disconnected(ev)) => observe.sink_closed(&ev),
        }
    }

    /// Hands a turn to the turn pool (or, for async agents, the executor) with a fresh
    /// cancellation token.
    fn start_turn(&mut self, job: TurnJob<BoxAgent>) {
        let cancel = CancelToken::new();
        let turn = job.turn;
        self.observe.turn_started(turn, &job.message_id, self.now);
        #[cfg(feature = "async")]
        let ticket = match &self.tasks {
            Some(tasks) => Ticket::Task(tasks.start_turn(job, cancel.clone())),
            None => Ticket::Pool(self.turn_pool.submit((job, cancel.clone()))),
        };
        #[cfg(not(feature = "async"))]
        let ticket = Ticket::Pool(self.turn_pool.submit((job, cancel.clone())));
        self.turns.insert(turn, (cancel, ticket));
        self.check();
    }

    fn cancel_turn(&mut self, turn: TurnId) {
        if let Some((cancel, _)) = self.turns.get(&turn) {
            cancel.cancel();
        }
    }

    /// Gives up on a turn: its thread no longer counts toward the pool's cap (an async
    /// turn's future is dropped, which hands its agent back to be closed).
    fn abandon_turn(&mut self, turn: TurnId, session: &SessionKey, reason: AbandonReason) {
        self.observe.turn_abandoned(turn, session, reason, self.now);
        match self.turns.remove(&turn) {
            Some((_, Ticket::Pool(ticket)))
                if self.turn_pool.replace(&ticket) == Replacement::Refused =>
            {
                self.observe.turn_replace_refused(session, turn);
            }
            #[cfg(feature = "async")]
            Some((_, Ticket::Task(abort))) => abort.cancel(),
            _ => {}
        }
    }

    fn start_cleanup(&mut self, job: CleanupJob<BoxAgent>) {
        let id = job.job;
        #[cfg(feature = "async")]
        let job = match (job, &self.tasks) {
            (
                CleanupJob {
                    agent: BoxAgent::Async(agent),
                    session,
                    ..
                },
                Some(tasks),
            ) => {
                let abort = tasks.start_close(id, agent, session);
                self.cleanups.insert(id, Ticket::Task(abort));
                return;
            }
            (job, _) => job,
        };
        // The pool starts a thread for it if none is idle (up to the core's concurrency),
        // so shutdown closes every agent at once.
        let ticket = self.cleanup_pool.submit(job);
        self.cleanups.insert(id, Ticket::Pool(ticket));
    }

    /// Gives up on a cleanup past its deadline: its thread is left to finish on its own (an
    /// async close's future is dropped).
    fn abandon_cleanup(&mut self, job: CleanupId, session: &SessionKey, context: CleanupContext) {
        let timeout = self.core.config().cleanup_timeout;
        self.observe.cleanup_exceeded(session, context, timeout);
        match self.cleanups.remove(&job) {
            Some(Ticket::Pool(ticket))
                if self.cleanup_pool.replace(&ticket) == Replacement::Refused =>
            {
                self.observe.cleanup_replace_refused(session, job);
            }
            #[cfg(feature = "async")]
            Some(Ticket::Task(abort)) => abort.cancel(),
            _ => {}
        }
    }

    /// The driver's invariants (debug builds): no more turns timed or on the pool than
    /// there are turn workers.
    fn check(&self) {
        let workers = self.core.config().turn_workers;
        debug_assert!(
            self.observe.running_turns() <= workers,
            "a turn's start outlived its end"
        );
        debug_assert!(
            self.turns.len() <= workers,
            "a finished or abandoned turn kept its ticket"
        );
    }
}
