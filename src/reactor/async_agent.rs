//! Async agents (the `async` feature): an [`AsyncAgent`]'s turns and its close are futures
//! the runtime hands to the embedder's executor through a [`Spawn`]er, so no turnstile thread
//! is held while an agent awaits its model.
//!
//! The flow is the sync one with the pool swapped for a task: the core's `StartTurn` becomes
//! a task that creates the agent if need be, awaits its turn and sends the same completion a
//! turn worker sends, over the same channel; the core's `Cleanup` becomes a task that reports
//! `close()` starting and ending the same way. The core cannot tell the difference, so
//! ordering, exactly-once outcomes, turn timeouts, `/stop` and the cleanup deadline are the
//! ones sync agents get. What differs is what giving up means: a pool can only stop counting
//! a stuck thread, while a task's future can be dropped — an abandoned turn's future and an
//! overdue close's future are dropped as soon as the executor polls the task again, and the
//! agent comes back (or is dropped) at once.
//!
//! Nothing here depends on a particular executor: the library never names tokio.

use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use super::workers::{BoxAgent, ReportSink, TurnLimits, WorkerReport, panic_text};
use crate::agent::{
    AgentError, AgentFactory, AgentUsage, CancelToken, Partials, TurnError, TurnInput,
};
use crate::core::{CleanupId, Reply, TurnJob, TurnResult};
use crate::message::SessionKey;

/// A boxed, `Send` future borrowing for `'a`: what [`AsyncAgent`]'s methods return (the trait
/// stays object-safe, so the runtime can hold `Box<dyn AsyncAgent>`).
pub type AgentFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A task for the embedder's executor: what a [`Spawn`]er is given.
pub type Task = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// Runs the runtime's tasks (async turns and closes) on the embedder's executor.
///
/// Called on the reactor thread, so it must return at once: hand the task over (tokio's
/// `Handle::spawn`), never run it inline or block. A closure `Fn(Task)` is a spawner. A task
/// the executor drops unfinished (it shut down) still reports: its turn fails, its close
/// counts as failed.
///
/// ```
/// use turnstile::{Spawn, Task};
///
/// fn tokio_spawner(runtime: tokio::runtime::Handle) -> impl Spawn {
///     move |task: Task| {
///         runtime.spawn(task);
///     }
/// }
/// # drop(tokio_spawner);
/// ```
pub trait Spawn: Send + Sync + 'static {
    /// Starts `task` on the executor.
    fn spawn(&self, task: Task);
}

impl<F> Spawn for F
where
    F: Fn(Task) + Send + Sync + 'static,
{
    fn spawn(&self, task: Task) {
        self(task)
    }
}

/// An AI agent serving one session whose turns are futures, for agents built on async SDKs.
///
/// Its turns and its close run as tasks on the embedder's executor (see
/// [`Builder::new_async`](crate::Builder::new_async)); no turnstile thread waits for them. One
/// agent still serves one turn at a time, and the same limits apply as to an [`Agent`]
/// (`turn_workers` is then the number of turns in flight at once).
///
/// [`Agent`]: crate::Agent
///
/// ```
/// use turnstile::{AgentFuture, AsyncAgent, CancelToken, TurnError, TurnInput};
///
/// struct Shout;
///
/// impl AsyncAgent for Shout {
///     fn turn<'a>(
///         &'a mut self,
///         input: &'a TurnInput<'a>,
///         cancel: &'a CancelToken,
///     ) -> AgentFuture<'a, Result<String, TurnError>> {
///         Box::pin(async move {
///             // A real agent awaits its model here, racing `cancel.cancelled()`.
///             if cancel.is_cancelled() {
///                 return Err(TurnError::Cancelled);
///             }
///             Ok(input.text.to_uppercase())
///         })
///     }
/// }
/// ```
pub trait AsyncAgent: Send + 'static {
    /// Runs one turn. Should resolve to `Err(TurnError::Cancelled)` soon after `cancel` fires
    /// (`select` on [`CancelToken::cancelled`]). If the turn is given up on (past
    /// `turn_timeout` and `stop_grace`), the future is dropped.
    fn turn<'a>(
        &'a mut self,
        input: &'a TurnInput<'a>,
        cancel: &'a CancelToken,
    ) -> AgentFuture<'a, Result<String, TurnError>>;

    /// Releases the agent's resources, as a task on the executor under the cleanup deadline
    /// (`cleanup_timeout`): past it the close counts as leaked and the future is dropped. An
    /// error or panic is logged and goes no further.
    fn close(&mut self) -> AgentFuture<'_, Result<(), AgentError>> {
        Box::pin(std::future::ready(Ok(())))
    }
}

/// Creates a fresh [`AsyncAgent`] for a session. Called inside the turn's task on the
/// executor, so it must not block (build a client, do not connect).
///
/// A closure returning `Result<Box<dyn AsyncAgent>, E>` (any `E` converting into an
/// [`AgentError`]) is a factory:
///
/// ```
/// use turnstile::{AgentError, AsyncAgent, AsyncAgentFactory, SessionKey};
/// # use turnstile::{AgentFuture, CancelToken, TurnError, TurnInput};
/// # struct Shout;
/// # impl AsyncAgent for Shout {
/// #     fn turn<'a>(&'a mut self, input: &'a TurnInput<'a>, _: &'a CancelToken)
/// #         -> AgentFuture<'a, Result<String, TurnError>> {
/// #         Box::pin(async move { Ok(input.text.to_uppercase()) })
/// #     }
/// # }
///
/// fn factory() -> impl AsyncAgentFactory {
///     |_: &SessionKey| -> Result<Box<dyn AsyncAgent>, AgentError> { Ok(Box::new(Shout)) }
/// }
/// # drop(factory);
/// ```
pub trait AsyncAgentFactory: Send + Sync + 'static {
    /// A new agent for `session`, or why one could not be made (the turn then fails).
    fn create(&self, session: &SessionKey) -> Result<Box<dyn AsyncAgent>, AgentError>;

    /// What the factory's agents have consumed so far, for the status snapshot; as
    /// [`AgentFactory::usage`] (called on the reactor at every heartbeat: cheap, never
    /// blocking).
    fn usage(&self) -> Option<AgentUsage> {
        None
    }
}

impl<F, E> AsyncAgentFactory for F
where
    F: Fn(&SessionKey) -> Result<Box<dyn AsyncAgent>, E> + Send + Sync + 'static,
    E: Into<AgentError>,
{
    fn create(&self, session: &SessionKey) -> Result<Box<dyn AsyncAgent>, AgentError> {
        self(session).map_err(Into::into)
    }
}

/// The heartbeat asks an [`AgentFactory`] for usage; this one answers for an async factory.
/// Its `create` is never called: an async runtime sends no turn to the pool.
pub(super) struct UsageOf(pub(super) Arc<dyn AsyncAgentFactory>);

impl AgentFactory for UsageOf {
    fn create(&self, _: &SessionKey) -> Result<Box<dyn crate::Agent>, AgentError> {
        debug_assert!(false, "an async runtime asked for a sync agent");
        Err(AgentError::new("internal: this runtime's agents are async"))
    }

    fn usage(&self) -> Option<AgentUsage> {
        self.0.usage()
    }
}

/// What the reactor's driver uses to start async turns and closes.
pub(super) struct AsyncRunner {
    shared: Arc<Shared>,
}

struct Shared {
    factory: Arc<dyn AsyncAgentFactory>,
    spawner: Box<dyn Spawn>,
    sink: ReportSink,
    limits: TurnLimits,
    /// The partial interval now in force (a [`Handle`](super::Handle) may change it).
    partial_ns: Arc<AtomicU64>,
    /// Turn tasks spawned and not yet ended (reported or dropped).
    turns: AtomicUsize,
    /// Close tasks spawned and not yet ended.
    closes: AtomicUsize,
}

impl AsyncRunner {
    pub(super) fn new(
        factory: Arc<dyn AsyncAgentFactory>,
        spawner: Box<dyn Spawn>,
        sink: ReportSink,
        limits: TurnLimits,
        partial_ns: Arc<AtomicU64>,
    ) -> AsyncRunner {
        AsyncRunner {
            shared: Arc::new(Shared {
                factory,
                spawner,
                sink,
                limits,
                partial_ns,
                turns: AtomicUsize::new(0),
                closes: AtomicUsize::new(0),
            }),
        }
    }

    /// Async turns in flight: spawned and not yet ended.
    pub(super) fn turns_in_flight(&self) -> usize {
        self.shared.turns.load(Ordering::SeqCst)
    }

    /// Async closes in flight.
    pub(super) fn closes_in_flight(&self) -> usize {
        self.shared.closes.load(Ordering::SeqCst)
    }

    /// Spawns `job`'s turn; returns the token that drops its future (the turn was given up on).
    pub(super) fn start_turn(&self, job: TurnJob<BoxAgent>, cancel: CancelToken) -> CancelToken {
        let abort = CancelToken::new();
        let limits = TurnLimits {
            partial_interval: Duration::from_nanos(self.shared.partial_ns.load(Ordering::Relaxed)),
            ..self.shared.limits
        };
        self.shared.turns.fetch_add(1, Ordering::SeqCst);
        let mut report = TurnReport {
            shared: Arc::clone(&self.shared),
            job: Some(job),
        };
        let give_up = abort.clone();
        self.shared.spawner.spawn(Box::pin(async move {
            let (agent, result) = report.run(&cancel, &give_up, limits).await;
            report.send(agent, result);
        }));
        abort
    }

    /// Spawns the close of `job`'s agent (an async one); returns the token that drops the
    /// close's future (its deadline passed).
    pub(super) fn start_close(
        &self,
        job: CleanupId,
        agent: Box<dyn AsyncAgent>,
        session: SessionKey,
    ) -> CancelToken {
        let abort = CancelToken::new();
        self.shared.closes.fetch_add(1, Ordering::SeqCst);
        let mut report = CloseReport {
            shared: Arc::clone(&self.shared),
            job,
            session,
            agent: Some(agent),
            sent: false,
        };
        let give_up = abort.clone();
        self.shared.spawner.spawn(Box::pin(async move {
            let result = report.run(&give_up).await;
            report.send(result);
        }));
        abort
    }
}

/// A turn task's job until it reports. Dropped unreported (the executor dropped the task),
/// it still sends the turn's completion, so the core never waits for a turn nobody runs.
struct TurnReport {
    shared: Arc<Shared>,
    job: Option<TurnJob<BoxAgent>>,
}

/// What a turn task ends with: the agent to hand back (if it exists) and the result.
type Ended = (Option<Box<dyn AsyncAgent>>, TurnResult);

impl TurnReport {
    async fn run(
        &mut self,
        cancel: &CancelToken,
        abort: &CancelToken,
        limits: TurnLimits,
    ) -> Ended {
        let Some(job) = self.job.as_mut() else {
            return (
                None,
                TurnResult::Failed("internal: a turn ran twice".into()),
            );
        };
        let mut agent = match job.agent.take() {
            Some(BoxAgent::Async(a)) => a,
            other => {
                debug_assert!(other.is_none(), "a sync agent reached an async turn");
                match catch_unwind(AssertUnwindSafe(|| {
                    self.shared.factory.create(&job.session)
                })) {
                    Ok(Ok(a)) => a,
                    Ok(Err(e)) => {
                        let failed = TurnResult::Failed(format!("agent creation failed: {e}"));
                        return (None, failed);
                    }
                    Err(p) => {
                        let why = format!("agent creation: {}", panic_text(&*p));
                        return (None, TurnResult::Panicked(why));
                    }
                }
            }
        };
        let partials = {
            let (sink, route) = (self.shared.sink.clone(), job.partial_route());
            Partials::throttled(limits.partial_interval, move |text| {
                let text = Reply::bounded(text, limits.max_reply_bytes).text;
                sink.send(WorkerReport::Partial(route.partial(text)));
            })
        };
        let input = TurnInput {
            session: &job.session,
            message_id: &job.message_id,
            text: &job.input,
            context: &job.context,
            partials: &partials,
        };
        let result = {
            // `move`: the closure hands its borrows on to the future it returns.
            let (a, i) = (&mut *agent, &input);
            let turn = catch_unwind(AssertUnwindSafe(move || {
                let a = a;
                a.turn(i, cancel)
            }));
            match turn {
                Err(p) => Err(Stopped::Panicked(panic_text(&*p))),
                Ok(turn) => until_aborted(turn, abort).await,
            }
        };
        let result = match result {
            Ok(Ok(reply)) => TurnResult::Reply(Reply::bounded(reply, limits.max_reply_bytes)),
            Ok(Err(TurnError::Cancelled)) => TurnResult::Cancelled,
            Ok(Err(TurnError::Failed(e))) => {
                if std::error::Error::source(&e).is_some() {
                    log::debug!("session {}: turn failed: {}", job.session, e.chain());
                }
                TurnResult::Failed(e.message().to_owned())
            }
            Err(Stopped::Panicked(why)) => TurnResult::Panicked(why),
            // The core gave up on the turn and ignores the result; the agent goes to its close.
            Err(Stopped::Aborted) => TurnResult::Cancelled,
        };
        (Some(agent), result)
    }

    fn send(&mut self, agent: Option<Box<dyn AsyncAgent>>, result: TurnResult) {
        if let Some(job) = self.job.take() {
            // Counted out before the reactor can see the completion.
            self.shared.turns.fetch_sub(1, Ordering::SeqCst);
            let done = job.done(agent.map(BoxAgent::Async), result);
            self.shared.sink.send(WorkerReport::Turn(done));
        }
    }
}

impl Drop for TurnReport {
    fn drop(&mut self) {
        if let Some(job) = &self.job {
            log::warn!(
                "session {}: the executor dropped turn of message {} before it ended",
                job.session,
                job.message_id
            );
            let failed = TurnResult::Failed("the async runtime dropped the turn".into());
            self.send(None, failed);
        }
    }
}

/// A close task's job until it reports; dropped unreported, it reports the close as failed.
struct CloseReport {
    shared: Arc<Shared>,
    job: CleanupId,
    session: SessionKey,
    agent: Option<Box<dyn AsyncAgent>>,
    sent: bool,
}

impl CloseReport {
    async fn run(&mut self, abort: &CancelToken) -> Result<(), String> {
        // The deadline runs from here, not from when the task was spawned.
        self.shared
            .sink
            .send(WorkerReport::CleanupStarted(self.job));
        let Some(agent) = self.agent.as_mut() else {
            return Ok(());
        };
        let result = match catch_unwind(AssertUnwindSafe(move || {
            let agent = agent;
            agent.close()
        })) {
            Err(p) => Err(format!("close() panicked: {}", panic_text(&*p))),
            Ok(close) => match until_aborted(close, abort).await {
                Ok(r) => r.map_err(|e| e.chain()),
                Err(Stopped::Panicked(why)) => Err(format!("close() panicked: {why}")),
                // Past its deadline: the core already counted it; nobody reads this.
                Err(Stopped::Aborted) => Err("close() given up on at its deadline".into()),
            },
        };
        // Dropping an agent can run arbitrary code too; guarded like the pool's.
        let agent = self.agent.take();
        match (result, catch_unwind(AssertUnwindSafe(move || drop(agent)))) {
            (Ok(()), Err(p)) => Err(format!("drop panicked: {}", panic_text(&*p))),
            (r, _) => r,
        }
    }

    fn send(&mut self, result: Result<(), String>) {
        if !std::mem::replace(&mut self.sent, true) {
            self.shared.closes.fetch_sub(1, Ordering::SeqCst);
            self.shared
                .sink
                .send(WorkerReport::CleanupDone(self.job, result));
        }
    }
}

impl Drop for CloseReport {
    fn drop(&mut self) {
        if !self.sent {
            log::warn!(
                "session {}: the executor dropped an agent's close before it ended",
                self.session
            );
            self.send(Err("the async runtime dropped the close".into()));
        }
    }
}

/// Why an agent's future gave no output.
enum Stopped {
    /// It panicked, with this message.
    Panicked(String),
    /// The runtime gave up on it and dropped it.
    Aborted,
}

/// Polls `future` (catching a panic) until it resolves or `abort` fires; then drops it.
async fn until_aborted<T>(
    mut future: AgentFuture<'_, T>,
    abort: &CancelToken,
) -> Result<T, Stopped> {
    let mut aborted = abort.cancelled();
    std::future::poll_fn(move |cx: &mut Context<'_>| {
        if Pin::new(&mut aborted).poll(cx).is_ready() {
            return Poll::Ready(Err(Stopped::Aborted));
        }
        match catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(cx))) {
            Ok(Poll::Ready(v)) => Poll::Ready(Ok(v)),
            Ok(Poll::Pending) => Poll::Pending,
            Err(p) => Poll::Ready(Err(Stopped::Panicked(panic_text(&*p)))),
        }
    })
    .await
}

/// Drives `future` on this thread, parking between wakes: the cleanup pool's fallback for an
/// async agent's close when no spawner is at hand (never in a runtime the builder makes).
pub(super) fn block_on<T>(future: AgentFuture<'_, T>) -> T {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let mut future = future;
    let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(v) = future.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}
