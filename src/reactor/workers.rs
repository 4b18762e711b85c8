//! What the pool threads do: run a turn, close an agent. Both report back over the
//! completion channel and never let a panic escape.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Sender;

use super::route::Route;
use super::wake::Notifier;
use crate::agent::{Agent, AgentFactory, CancelToken, Partials, TurnError, TurnInput};
use crate::core::{CleanupId, CleanupJob, Input, Reply, TurnDone, TurnJob, TurnResult};
use crate::journal::MemoryUpdate;
use crate::message::SessionKey;
use crate::pool::Pool;

/// An agent as the runtime moves it around: a sync one, run on the turn pool, or (feature
/// `async`) an async one, whose turns and close are tasks on the embedder's runtime. One
/// runtime makes only one kind (its factory's), but the core needs a single type.
pub(crate) enum BoxAgent {
    /// Runs on the turn pool and the cleanup pool.
    Sync(Box<dyn Agent>),
    /// Runs on the embedder's async runtime.
    #[cfg(feature = "async")]
    Async(Box<dyn super::async_agent::AsyncAgent>),
}

impl std::fmt::Debug for BoxAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BoxAgent::Sync(_) => f.write_str("SyncAgent"),
            #[cfg(feature = "async")]
            BoxAgent::Async(_) => f.write_str("AsyncAgent"),
        }
    }
}
/// The pool running turns; each job carries the token that cancels it.
pub(super) type TurnPool = Pool<(TurnJob<BoxAgent>, CancelToken)>;
/// The pool closing agents.
pub(super) type CleanupPool = Pool<CleanupJob<BoxAgent>>;

/// A worker's report to the reactor (a turn ended, a partial, a cleanup started or ended).
/// Each is built from the job it reports on.
pub(super) enum WorkerReport {
    /// A turn returned.
    Turn(TurnDone<BoxAgent>),
    /// A running turn's reply so far.
    Partial(Input<Route, BoxAgent>),
    /// A cleanup job's `close()` started.
    CleanupStarted(CleanupId),
    /// A cleanup job ended.
    CleanupDone(CleanupId, Result<(), String>),
}

impl From<WorkerReport> for Input<Route, BoxAgent> {
    fn from(c: WorkerReport) -> Self {
        match c {
            WorkerReport::Turn(done) => Input::TurnDone(done),
            WorkerReport::Partial(input) => input,
            WorkerReport::CleanupStarted(job) => Input::CleanupStarted { job },
            WorkerReport::CleanupDone(job, result) => Input::CleanupDone { job, result },
        }
    }
}

/// Where workers send completions.
#[derive(Clone)]
pub(super) struct ReportSink {
    /// The channel the reactor drains.
    pub tx: Sender<WorkerReport>,
    /// Wakes the reactor.
    pub notifier: Arc<Notifier>,
}

impl ReportSink {
    pub(super) fn send(&self, c: WorkerReport) {
        // The reactor holds the receiver until it exits; after that nobody needs the result.
        if self.tx.send(c).is_ok() {
            self.notifier.notify();
        }
    }
}

/// A panic's message, when it has one.
pub(super) fn panic_text(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

/// What every turn worker applies to the agents' output.
#[derive(Clone, Copy, Debug)]
pub(super) struct TurnLimits {
    /// Least time between two forwarded partials of one turn.
    pub partial_interval: Duration,
    /// Replies and partials longer than this are cut (on a UTF-8 boundary) and flagged, here
    /// on the worker, so the reactor never handles an unbounded text.
    pub max_reply_bytes: usize,
}

/// Runs one turn on a turn-pool thread.
pub(super) fn run_turn(
    mut job: TurnJob<BoxAgent>,
    cancel: &CancelToken,
    factory: &dyn AgentFactory,
    sink: &ReportSink,
    limits: TurnLimits,
) {
    let partials = {
        let (sink, route) = (sink.clone(), job.partial_route());
        Partials::throttled(limits.partial_interval, move |text| {
            let text = Reply::bounded(text, limits.max_reply_bytes).text;
            sink.send(WorkerReport::Partial(route.partial(text)));
        })
    };
    let mut agent = match job.agent.take() {
        Some(BoxAgent::Sync(a)) => Ok(a),
        // Only an async runtime makes async agents, and it never sends a turn here.
        #[cfg(feature = "async")]
        Some(other @ BoxAgent::Async(_)) => {
            debug_assert!(false, "an async agent reached the turn pool");
            let failed = TurnResult::Failed("internal: an async agent on the turn pool".into());
            sink.send(WorkerReport::Turn(job.done(Some(other), failed)));
            return;
        }
        None => match catch_unwind(AssertUnwindSafe(|| {
            factory.create_for(&job.session, &job.context)
        })) {
            Ok(Ok(a)) => Ok(a),
            Ok(Err(e)) => Err(TurnResult::Failed(format!("agent creation failed: {e}"))),
            Err(p) => Err(TurnResult::Panicked(format!(
                "agent creation: {}",
                panic_text(&*p)
            ))),
        },
    };
    let result = match &mut agent {
        Ok(a) => {
            let input = TurnInput {
                session: &job.session,
                message_id: &job.message_id,
                text: &job.input,
                context: &job.context,
                partials: &partials,
            };
            match catch_unwind(AssertUnwindSafe(|| a.turn(&input, cancel))) {
                Ok(Ok(reply)) => {
                    let memory = remembered(&mut **a, &job.session);
                    let mut reply =
                        Reply::bounded(reply, limits.max_reply_bytes).remembering(memory);
                    reply.tokens = a
                        .turn_usage()
                        .map(|u| u.prompt_tokens.saturating_add(u.completion_tokens));
                    reply = reply.attaching(attached(&mut **a, &job.session));
                    TurnResult::Reply(reply)
                }
                Ok(Err(TurnError::Cancelled)) => TurnResult::Cancelled,
                Ok(Err(TurnError::Failed(e))) => {
                    if std::error::Error::source(&e).is_some() {
                        log::debug!("session {}: turn failed: {}", job.session, e.chain());
                    }
                    TurnResult::Failed(e.message().to_owned())
                }
                Err(p) => TurnResult::Panicked(panic_text(&*p)),
            }
        }
        Err(r) => r.clone(),
    };
    sink.send(WorkerReport::Turn(
        job.done(agent.ok().map(BoxAgent::Sync), result),
    ));
}

/// What the agent wants kept of its conversation after a reply, for the outcome record; a
/// panic there keeps nothing (logged), the reply stands.
fn remembered(agent: &mut dyn Agent, session: &SessionKey) -> Option<MemoryUpdate> {
    match catch_unwind(AssertUnwindSafe(|| agent.durable_memory())) {
        Ok(kept) => kept.map(|exchanges| MemoryUpdate::keep(session.as_str(), exchanges)),
        Err(p) => {
            log::error!(
                "session {session}: the agent's durable_memory() panicked: {}; nothing kept",
                panic_text(&*p)
            );
            None
        }
    }
}

/// The files the agent attached to its reply; a panic there attaches none (logged), the
/// reply stands.
fn attached(agent: &mut dyn Agent, session: &SessionKey) -> Vec<crate::Attachment> {
    catch_unwind(AssertUnwindSafe(|| agent.turn_attachments())).unwrap_or_else(|p| {
        log::error!(
            "session {session}: the agent's turn_attachments() panicked: {}; no file attached",
            panic_text(&*p)
        );
        Vec::new()
    })
}

/// Closes one agent on a cleanup-pool thread.
pub(super) fn run_cleanup(job: CleanupJob<BoxAgent>, sink: &ReportSink) {
    let CleanupJob { job, mut agent, .. } = job;
    // The deadline runs from here, not from when the job was queued.
    sink.send(WorkerReport::CleanupStarted(job));
    let result = match catch_unwind(AssertUnwindSafe(|| close(&mut agent))) {
        // The core keeps the text; the log line it ends in shows every cause.
        Ok(r) => r.map_err(|e| e.chain()),
        Err(p) => Err(format!("close() panicked: {}", panic_text(&*p))),
    };
    // Dropping an agent can run arbitrary code too; do it here, off the reactor, guarded.
    let dropped = catch_unwind(AssertUnwindSafe(move || drop(agent)));
    let result = match (result, dropped) {
        (Ok(()), Err(p)) => Err(format!("drop panicked: {}", panic_text(&*p))),
        (r, _) => r,
    };
    sink.send(WorkerReport::CleanupDone(job, result));
}

/// Closes `agent` on this (cleanup-pool) thread. An async agent only gets here from a runtime
/// without a spawner, which the builder never makes; its close is then driven here.
fn close(agent: &mut BoxAgent) -> Result<(), crate::agent::AgentError> {
    match agent {
        BoxAgent::Sync(a) => a.close(),
        #[cfg(feature = "async")]
        BoxAgent::Async(a) => super::async_agent::block_on(a.close()),
    }
}
