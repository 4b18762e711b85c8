//! The driver: carries out the core's effects on the pools, the sinks and the frontend.

use std::collections::HashMap;

use crossbeam_channel::TrySendError;

use super::frontend::Frontend;
use super::workers::{BoxAgent, Completion};
use super::{CancelToken, Route};
use crate::core::{
    AbandonReason, CleanupId, CleanupJob, Core, Effect, ShutdownReport, TurnId, TurnJob,
};
use crate::pool::{JobTicket, Pool, Replacement};

/// The reactor's side of the pools: carries out the core's effects.
pub(super) struct Driver {
    pub(super) core: Core<Route, BoxAgent>,
    pub(super) turn_pool: Pool<(TurnJob<BoxAgent>, CancelToken)>,
    pub(super) cleanup_pool: Pool<CleanupJob<BoxAgent>>,
    pub(super) turns: HashMap<TurnId, (CancelToken, JobTicket)>,
    pub(super) cleanups: HashMap<CleanupId, JobTicket>,
    pub(super) undelivered: u64,
    pub(super) report: Option<ShutdownReport>,
}

impl Driver {
    pub(super) fn new(
        core: Core<Route, BoxAgent>,
        turn_pool: Pool<(TurnJob<BoxAgent>, CancelToken)>,
        cleanup_pool: Pool<CleanupJob<BoxAgent>>,
    ) -> Driver {
        Driver {
            core,
            turn_pool,
            cleanup_pool,
            turns: HashMap::new(),
            cleanups: HashMap::new(),
            undelivered: 0,
            report: None,
        }
    }

    /// A job came back: its ticket is no longer needed to cancel or replace it.
    pub(super) fn forget_job(&mut self, completion: &Completion) {
        match completion {
            Completion::Turn(done) => {
                self.turns.remove(&done.turn());
            }
            Completion::CleanupDone(job, _) => {
                self.cleanups.remove(job);
            }
            Completion::Partial(_) | Completion::CleanupStarted(_) => {}
        }
    }

    pub(super) fn apply(&mut self, effect: Effect<Route, BoxAgent>, frontend: &mut impl Frontend) {
        match effect {
            Effect::Emit {
                route: Route::Local(tag),
                event,
            } => frontend.deliver(tag, event),
            Effect::Emit {
                route: Route::Sink(sink),
                event,
            } => match sink.try_send(event) {
                Ok(()) => {}
                Err(TrySendError::Full(ev)) => {
                    self.undelivered += 1;
                    log::warn!(
                        "session {}: event sink full, event for message {} lost: {:?}",
                        ev.session,
                        ev.id,
                        ev.kind
                    );
                }
                Err(TrySendError::Disconnected(ev)) => {
                    self.undelivered += 1;
                    log::debug!("session {}: event sink closed ({})", ev.session, ev.id);
                }
            },
            Effect::StartTurn(job) => {
                let cancel = CancelToken::new();
                let turn = job.turn;
                let ticket = self.turn_pool.submit((job, cancel.clone()));
                self.turns.insert(turn, (cancel, ticket));
            }
            Effect::CancelTurn(turn) => {
                if let Some((cancel, _)) = self.turns.get(&turn) {
                    cancel.cancel();
                }
            }
            Effect::TurnAbandoned {
                turn,
                session,
                reason,
            } => {
                let why = match reason {
                    AbandonReason::Timeout => "ran past its turn timeout".to_owned(),
                    AbandonReason::IgnoredCancel(r) => {
                        format!("ignored cancellation ({}) past the stop grace", r.as_str())
                    }
                };
                log::warn!(
                    "session {session}: turn {} abandoned: it {why}; its late result will be discarded",
                    turn.0
                );
                if let Some((_, ticket)) = self.turns.remove(&turn)
                    && self.turn_pool.replace(&ticket) == Replacement::Refused
                {
                    log::error!(
                        "session {session}: cannot replace the turn thread stuck on turn {}: extra-thread cap reached",
                        turn.0
                    );
                }
            }
            Effect::Cleanup(job) => {
                // The pool starts a thread for it if none is idle (up to the core's
                // concurrency), so shutdown closes every agent at once.
                let id = job.job;
                let ticket = self.cleanup_pool.submit(job);
                self.cleanups.insert(id, ticket);
            }
            Effect::CleanupExceeded {
                job,
                session,
                context,
            } => {
                log::warn!(
                    "session {session}: agent cleanup ({}) exceeded {:?}; proceeding without waiting (the thread is left to finish on its own)",
                    context.as_str(),
                    self.core.config().cleanup_timeout
                );
                if let Some(ticket) = self.cleanups.remove(&job)
                    && self.cleanup_pool.replace(&ticket) == Replacement::Refused
                {
                    log::error!(
                        "session {session}: cannot replace the cleanup thread stuck on job {}: extra-thread cap reached",
                        job.0
                    );
                }
            }
            Effect::CleanupFailed {
                session,
                context,
                error,
                ..
            } => {
                log::warn!(
                    "session {session}: agent cleanup ({}) failed: {error}",
                    context.as_str()
                );
            }
            Effect::ShutdownComplete(report) => self.report = Some(report),
        }
    }
}
