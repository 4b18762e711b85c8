//! The reactor: one thread running a `mio` loop around the sans-IO [`Core`].
//!
//! Each wake it drains worker completions and submissions completely (wakes coalesce), feeds
//! them to the core with the current time, fires due timers, and carries out the effects:
//! turns go to the turn pool, agent teardown to the cleanup pool, events to their sinks. It
//! never runs agent code, never waits on a job and never touches the disk. A heartbeat tick
//! measures the loop's own lateness and publishes the status snapshot.

#[cfg(feature = "async")]
mod async_api;
mod deadline;
mod frontend;
mod notify;
mod workers;

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant, SystemTime};

use crossbeam_channel::{Receiver, Sender, TrySendError, bounded, unbounded};
use mio::{Events as MioEvents, Poll, Token};

use crate::agent::{AgentFactory, CancelToken};
use crate::core::{
    AbandonReason, BusyMode, CleanupId, CleanupJob, Core, CoreConfig, Effect, Input, MessageEvent,
    ShutdownReport, TurnId, TurnJob,
};
use crate::liveness::{
    CleanupCounts, LagHistogram, MessageCounts, RuntimeState, SessionCounts, Status, StatusCell,
    StatusFileWriter, TurnCounts, WorkerCounts, rfc3339_utc,
};
use crate::message::Message;
use crate::pool::{JobTicket, Pool, PoolSize, Replacement};
#[cfg(feature = "async")]
pub use async_api::{Cancelled, EventStream, StreamSink, Submit, SubmitStream};
pub use frontend::{Ctx, FIRST_RESERVED_TOKEN, Frontend, NoFrontend};
use notify::Notifier;
pub use workers::BoxAgent;
use workers::{Completion, CompletionSink, TurnLimits, run_cleanup, run_turn};

/// The reactor's fixed tokens sit at the top of the token space, apart from the slab keys a
/// frontend uses for its sockets (see [`FIRST_RESERVED_TOKEN`]).
const WAKE_TOKEN: Token = Token(usize::MAX - 1);
const TIMER_TOKEN: Token = Token(usize::MAX - 2);

/// Default least time between two forwarded partials of a turn.
pub const DEFAULT_PARTIAL_INTERVAL: Duration = Duration::from_millis(800);
/// Default cap on a reply's (and a partial's) length in bytes: 1 MiB.
pub const DEFAULT_MAX_REPLY_BYTES: usize = 1 << 20;

/// Submissions taken from the ingress channel per loop iteration.
const INGRESS_BATCH: usize = 1024;

/// Where a message's events go. Use an unbounded channel: the reactor never blocks on a
/// sink, so a full bounded one loses the event (logged at WARN and counted).
pub type EventSink = Sender<MessageEvent>;

/// Where the reactor delivers a message's events.
#[derive(Clone, Debug)]
pub enum Route {
    /// A channel to another thread.
    Sink(EventSink),
    /// The frontend running on the reactor, with its own tag.
    Local(u64),
    /// An [`EventStream`]'s sending half: the reactor wakes its task on delivery.
    #[cfg(feature = "async")]
    Stream(StreamSink),
}

/// The runtime's default event stream (events of messages sent with [`Handle::submit`]).
pub type Events = Receiver<MessageEvent>;

/// A settings value out of range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildError(pub String);

impl fmt::Display for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BuildError {}

/// Why a submission did not reach the reactor; the message is handed back.
#[derive(Debug)]
pub enum SubmitError {
    /// The ingress channel is full: back off and retry.
    Backpressure(Message),
    /// The reactor has stopped.
    Closed(Message),
}

impl fmt::Display for SubmitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SubmitError::Backpressure(m) => {
                write!(f, "ingress full; message {} not submitted", m.id)
            }
            SubmitError::Closed(m) => write!(f, "runtime stopped; message {} not submitted", m.id),
        }
    }
}

impl std::error::Error for SubmitError {}

/// Most threads a pool may be configured with: past this a setting is refused by name
/// rather than left to fail at run time.
pub const MAX_POOL_THREADS: usize = 4096;
/// Default number of cleanup threads that always run.
pub const DEFAULT_CLEANUP_WORKERS: usize = 2;
/// Default number of given-up (stuck) threads each pool may keep alive.
pub const DEFAULT_MAX_EXTRA_THREADS: usize = 16;
/// How long a cleanup thread beyond the minimum waits for work before it retires.
const CLEANUP_KEEPALIVE: Duration = Duration::from_secs(5);

/// Configures and builds a [`Runtime`].
pub struct Builder {
    factory: Arc<dyn AgentFactory>,
    core: CoreConfig,
    cleanup_workers: usize,
    max_extra_threads: usize,
    ingress_capacity: usize,
    tick_interval: Duration,
    status_file: Option<PathBuf>,
    precise_timers: bool,
    limits: TurnLimits,
}

macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident: $ty:ty => $($field:ident).+;)*) => {$(
        $(#[$doc])*
        pub fn $name(mut self, value: $ty) -> Self {
            self.$($field).+ = value;
            self
        }
    )*};
}

impl Builder {
    /// Defaults: 16 turn workers, 2 cleanup workers, queue mode, the limits of [`CoreConfig`],
    /// a 100 ms heartbeat, 65,536 pending submissions, no status file.
    pub fn new(factory: impl AgentFactory) -> Builder {
        Builder {
            factory: Arc::new(factory),
            core: CoreConfig::default(),
            cleanup_workers: DEFAULT_CLEANUP_WORKERS,
            max_extra_threads: DEFAULT_MAX_EXTRA_THREADS,
            ingress_capacity: 65_536,
            tick_interval: Duration::from_millis(100),
            status_file: None,
            precise_timers: true,
            limits: TurnLimits {
                partial_interval: DEFAULT_PARTIAL_INTERVAL,
                max_reply_bytes: DEFAULT_MAX_REPLY_BYTES,
            },
        }
    }

    setters! {
        /// Threads running agent turns; also the number of turns in flight at once.
        turn_workers: usize => core.turn_workers;
        /// Threads running agent `close()` that always run.
        cleanup_workers: usize => cleanup_workers;
        /// Agent `close()`s that may run at once: the cleanup pool grows on demand up to this
        /// many threads, and the rest wait in the core's backlog (their deadline not running).
        max_cleanup_workers: usize => core.cleanup_concurrency;
        /// Cleanup backlog length at which evictions and the idle sweep pause.
        cleanup_queue_cap: usize => core.cleanup_queue_cap;
        /// Replacement threads each pool may start for stuck jobs (given-up threads alive).
        max_extra_threads: usize => max_extra_threads;
        /// Messages waiting across all sessions before new ones are rejected `overloaded`.
        max_queued_messages: usize => core.max_queued_messages;
        /// Bytes of text waiting across all sessions before new messages are rejected
        /// `overloaded`.
        max_queued_bytes: usize => core.max_queued_bytes;
        /// What a follow-up does while a turn runs.
        busy_mode: BusyMode => core.busy_mode;
        /// Messages a session may hold waiting.
        queue_cap: usize => core.queue_cap;
        /// Idle agents kept for reuse.
        max_cached_agents: usize => core.max_cached_agents;
        /// Idle agents older than this are closed by the sweep.
        agent_idle_ttl: Duration => core.agent_idle_ttl;
        /// How often the idle sweep runs.
        sweep_interval: Duration => core.sweep_interval;
        /// Turns running longer are abandoned.
        turn_timeout: Duration => core.turn_timeout;
        /// How long a cancelled turn may take to return.
        stop_grace: Duration => core.stop_grace;
        /// How long an agent's close() may take before it counts as leaked.
        cleanup_timeout: Duration => core.cleanup_timeout;
        /// How long shutdown waits for running turns before cancelling them.
        drain_timeout: Duration => core.drain_timeout;
        /// Heartbeat period.
        tick_interval: Duration => tick_interval;
        /// Submissions that may wait for the reactor before `submit` reports backpressure.
        ingress_capacity: usize => ingress_capacity;
        /// Wake for deadlines with a timerfd (microsecond precision) rather than relying on
        /// the poll's millisecond timeout alone. On by default.
        precise_timers: bool => precise_timers;
        /// Least time between two forwarded partial replies of one turn.
        partial_interval: Duration => limits.partial_interval;
        /// Replies and partials longer than this are cut on a UTF-8 boundary and flagged
        /// `truncated`, on the worker.
        max_reply_bytes: usize => limits.max_reply_bytes;
    }

    /// Writes each snapshot as JSON to `path` (atomically, from a non-reactor thread).
    pub fn status_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.status_file = Some(path.into());
        self
    }

    /// Validates the settings, starts the worker threads and prepares the reactor. A setting
    /// the machine cannot honour (threads it will not start) is an error naming it.
    pub fn build(self) -> Result<(Runtime, Handle, Events), BuildError> {
        let positive = [
            ("turn_workers", self.core.turn_workers),
            ("cleanup_workers", self.cleanup_workers),
            ("max_cleanup_workers", self.core.cleanup_concurrency),
            ("queue_cap", self.core.queue_cap),
            ("max_queued_messages", self.core.max_queued_messages),
            ("max_queued_bytes", self.core.max_queued_bytes),
            ("max_reply_bytes", self.limits.max_reply_bytes),
            ("ingress_capacity", self.ingress_capacity),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(BuildError(format!("{name} must be at least 1")));
            }
        }
        let threads = [
            ("turn_workers", self.core.turn_workers),
            ("cleanup_workers", self.cleanup_workers),
            ("max_cleanup_workers", self.core.cleanup_concurrency),
            ("max_extra_threads", self.max_extra_threads),
        ];
        for (name, v) in threads {
            if v > MAX_POOL_THREADS {
                return Err(BuildError(format!(
                    "{name} must be at most {MAX_POOL_THREADS} (got {v})"
                )));
            }
        }
        if self.cleanup_workers > self.core.cleanup_concurrency {
            return Err(BuildError(format!(
                "cleanup_workers ({}) must not exceed max_cleanup_workers ({})",
                self.cleanup_workers, self.core.cleanup_concurrency
            )));
        }
        let nonzero = [
            ("tick_interval", self.tick_interval),
            ("sweep_interval", self.core.sweep_interval),
            ("turn_timeout", self.core.turn_timeout),
            ("cleanup_timeout", self.core.cleanup_timeout),
        ];
        for (name, v) in nonzero {
            if v.is_zero() {
                return Err(BuildError(format!("{name} must be greater than zero")));
            }
        }
        let poll = Poll::new().map_err(|e| BuildError(format!("cannot create poll: {e}")))?;
        let waker = mio::Waker::new(poll.registry(), WAKE_TOKEN)
            .map_err(|e| BuildError(format!("cannot create waker: {e}")))?;
        let notifier = Arc::new(Notifier::new(waker));
        let (ingress_tx, ingress_rx) = bounded(self.ingress_capacity);
        #[cfg(feature = "async")]
        let room = Arc::new(async_api::Room::default());
        let (events_tx, events_rx) = unbounded();
        let shutdown = Arc::new(AtomicBool::new(false));
        let status = Arc::new(StatusCell::default());
        let (completion_tx, completions) = unbounded();
        let sink = CompletionSink {
            tx: completion_tx,
            notifier: Arc::clone(&notifier),
        };
        let (turn_sink, factory, limits) = (sink.clone(), Arc::clone(&self.factory), self.limits);
        let turn_pool = Pool::new(
            "turnstile-turn",
            PoolSize {
                min: self.core.turn_workers,
                max: self.core.turn_workers,
                max_stuck: self.max_extra_threads,
                keepalive: CLEANUP_KEEPALIVE,
            },
            move |(job, cancel): (TurnJob<BoxAgent>, CancelToken)| {
                run_turn(job, &cancel, &*factory, &turn_sink, limits)
            },
        )
        .map_err(|e| {
            BuildError(format!(
                "turn_workers: cannot start {} threads: {e}",
                self.core.turn_workers
            ))
        })?;
        let cleanup_pool = Pool::new(
            "turnstile-cleanup",
            PoolSize {
                min: self.cleanup_workers,
                max: self.core.cleanup_concurrency,
                max_stuck: self.max_extra_threads,
                keepalive: CLEANUP_KEEPALIVE,
            },
            move |job| run_cleanup(job, &sink),
        )
        .map_err(|e| {
            BuildError(format!(
                "cleanup_workers: cannot start {} threads: {e}",
                self.cleanup_workers
            ))
        })?;
        let handle = Handle {
            ingress: ingress_tx,
            notifier: Arc::clone(&notifier),
            shutdown: Arc::clone(&shutdown),
            status: Arc::clone(&status),
            default_sink: events_tx,
            #[cfg(feature = "async")]
            room: Arc::clone(&room),
        };
        let runtime = Runtime {
            poll,
            notifier,
            #[cfg(feature = "async")]
            room: async_api::RoomGuard::new(room, ingress_rx.clone()),
            ingress: ingress_rx,
            shutdown,
            status,
            core: self.core,
            turn_pool,
            cleanup_pool,
            completions,
            factory: self.factory,
            tick_interval: self.tick_interval,
            status_file: self.status_file,
            precise_timers: self.precise_timers,
        };
        Ok((runtime, handle, events_rx))
    }
}

/// A cloneable, thread-safe handle to a runtime: submit, read status, shut down.
#[derive(Clone)]
pub struct Handle {
    ingress: Sender<(Message, Route)>,
    notifier: Arc<Notifier>,
    shutdown: Arc<AtomicBool>,
    status: Arc<StatusCell>,
    default_sink: EventSink,
    /// Submits waiting for ingress room (the `async` feature).
    #[cfg(feature = "async")]
    room: Arc<async_api::Room>,
}

impl Handle {
    /// Submits a message; its events go to the runtime's [`Events`] stream.
    pub fn submit(&self, message: Message) -> Result<(), SubmitError> {
        self.submit_to(message, self.default_sink.clone())
    }

    /// Submits a message whose events go to `sink`. Never blocks.
    pub fn submit_to(&self, message: Message, sink: EventSink) -> Result<(), SubmitError> {
        match self.ingress.try_send((message, Route::Sink(sink))) {
            Ok(()) => {
                self.notifier.notify();
                Ok(())
            }
            Err(TrySendError::Full((m, _))) => Err(SubmitError::Backpressure(m)),
            Err(TrySendError::Disconnected((m, _))) => Err(SubmitError::Closed(m)),
        }
    }

    /// The latest status snapshot (produced by the reactor's last heartbeat tick).
    pub fn status(&self) -> Arc<Status> {
        self.status.get()
    }

    /// Waits up to `timeout` for a snapshot satisfying `pred`.
    pub fn wait_status(
        &self,
        timeout: Duration,
        pred: impl FnMut(&Status) -> bool,
    ) -> Option<Arc<Status>> {
        self.status.wait_for(timeout, pred)
    }

    /// Asks the runtime to shut down gracefully; [`Runtime::run`] returns when it is done.
    pub fn shutdown(&self) {
        self.shutdown.store(true, Ordering::SeqCst);
        self.notifier.notify();
    }
}

/// The reactor, ready to run on the thread that calls [`Runtime::run`]; its worker threads
/// are already running.
pub struct Runtime {
    poll: Poll,
    notifier: Arc<Notifier>,
    /// Wakes submits waiting for ingress room (the `async` feature).
    #[cfg(feature = "async")]
    room: async_api::RoomGuard,
    ingress: Receiver<(Message, Route)>,
    shutdown: Arc<AtomicBool>,
    status: Arc<StatusCell>,
    core: CoreConfig,
    turn_pool: Pool<(TurnJob<BoxAgent>, CancelToken)>,
    cleanup_pool: Pool<CleanupJob<BoxAgent>>,
    completions: Receiver<Completion>,
    /// Kept for the heartbeat: the factory's agent usage joins the status.
    factory: Arc<dyn AgentFactory>,
    tick_interval: Duration,
    status_file: Option<PathBuf>,
    precise_timers: bool,
}

impl Runtime {
    /// Runs the reactor on a new thread named `turnstile-reactor`.
    pub fn spawn(self) -> std::io::Result<thread::JoinHandle<std::io::Result<ShutdownReport>>> {
        thread::Builder::new()
            .name("turnstile-reactor".into())
            .spawn(move || self.run())
    }

    /// Drives the loop until a shutdown requested through a [`Handle`] completes.
    pub fn run(self) -> std::io::Result<ShutdownReport> {
        self.run_with(NoFrontend)
    }

    /// Drives the loop with `frontend` hosted on it (its sockets, signals and timers) until
    /// shutdown completes, then lets the frontend flush its output.
    pub fn run_with<F: Frontend>(self, mut frontend: F) -> std::io::Result<ShutdownReport> {
        let Runtime {
            mut poll,
            notifier,
            #[cfg(feature = "async")]
            mut room,
            ingress,
            shutdown,
            status,
            core,
            turn_pool,
            cleanup_pool,
            completions,
            factory,
            tick_interval,
            status_file,
            precise_timers,
        } = self;
        let epoch = Instant::now();
        let writer = status_file.map(StatusFileWriter::start).transpose()?;
        let mut driver = Driver {
            core: Core::new(core, Duration::ZERO),
            turn_pool,
            cleanup_pool,
            turns: HashMap::new(),
            cleanups: HashMap::new(),
            undelivered: 0,
            report: None,
        };
        let mut heartbeat = Heartbeat::new(tick_interval, factory);
        let mut fx = Vec::new();
        let mut events = MioEvents::with_capacity(256);
        frontend.register(poll.registry())?;
        let mut timer = if precise_timers {
            Some(deadline::DeadlineTimer::new(poll.registry(), TIMER_TOKEN)?)
        } else {
            None
        };
        status.publish(heartbeat.snapshot(
            RuntimeState::Running,
            Duration::ZERO,
            &driver,
            frontend.status(),
        ));
        let report = loop {
            let now = epoch.elapsed();
            for completion in completions.try_iter() {
                driver.forget_job(&completion);
                driver.core.handle(now, completion.into(), &mut fx);
            }
            // Bounded per iteration so a burst of submissions cannot delay timers and the
            // heartbeat; what is left is taken on the next iteration, without sleeping.
            for (message, route) in ingress.try_iter().take(INGRESS_BATCH) {
                driver
                    .core
                    .handle(now, Input::Submit { message, route }, &mut fx);
            }
            #[cfg(feature = "async")]
            room.drained();
            let mut ctx = Ctx::new(now, &mut driver.core, &mut fx);
            for event in events.iter() {
                match event.token() {
                    WAKE_TOKEN => {}
                    TIMER_TOKEN => {
                        if let Some(t) = &mut timer {
                            t.fired();
                        }
                    }
                    _ => frontend.on_ready(event, &mut ctx),
                }
            }
            let frontend_deadline = frontend.on_wake(&mut ctx);
            if ctx.shutdown_requested() {
                shutdown.store(true, Ordering::SeqCst);
            }
            if shutdown.load(Ordering::SeqCst) && !driver.core.is_shutting_down() {
                log::info!("shutdown requested: draining");
                driver.core.handle(now, Input::Shutdown, &mut fx);
            }
            driver.core.advance(now, &mut fx);
            for effect in fx.drain(..) {
                driver.apply(effect, &mut frontend);
            }
            frontend.flush();

            if let Some(report) = driver.report.take() {
                break report;
            }
            let state = if driver.core.is_shutting_down() {
                RuntimeState::Draining
            } else {
                RuntimeState::Running
            };
            if let Some(snapshot) =
                heartbeat.tick_if_due(epoch.elapsed(), state, &driver, &frontend)
            {
                if let Some(w) = &writer {
                    w.offer(Arc::clone(&snapshot));
                }
                status.publish(snapshot);
            }
            let deadline = [driver.core.next_deadline(), frontend_deadline]
                .into_iter()
                .flatten()
                .fold(heartbeat.next, Duration::min);
            notifier.prepare_sleep();
            let pending = !completions.is_empty()
                || !ingress.is_empty()
                || (shutdown.load(Ordering::SeqCst) && !driver.core.is_shutting_down());
            if !pending {
                let now = epoch.elapsed();
                let timeout = deadline.saturating_sub(now);
                if let Some(t) = &mut timer
                    && let Err(e) = t.arm_for(deadline, now)
                {
                    log::error!("timerfd: {e}; falling back to millisecond poll timeouts");
                }
                if let Err(e) = poll.poll(&mut events, Some(timeout))
                    && e.kind() != std::io::ErrorKind::Interrupted
                {
                    return Err(e);
                }
            } else {
                // Work is waiting: skip the poll, and do not replay the last one's events.
                events.clear();
            }
            notifier.awake();
        };
        log::info!("shutdown complete: {report:?}");
        frontend.finish(&mut poll);
        let last = heartbeat.snapshot(
            RuntimeState::Stopped,
            epoch.elapsed(),
            &driver,
            frontend.status(),
        );
        status.publish(Arc::clone(&last));
        if let Some(w) = writer {
            w.finish(last);
        }
        Ok(report)
    }
}

/// The reactor's side of the pools: carries out the core's effects.
struct Driver {
    core: Core<Route, BoxAgent>,
    turn_pool: Pool<(TurnJob<BoxAgent>, CancelToken)>,
    cleanup_pool: Pool<CleanupJob<BoxAgent>>,
    turns: HashMap<TurnId, (CancelToken, JobTicket)>,
    cleanups: HashMap<CleanupId, JobTicket>,
    undelivered: u64,
    report: Option<ShutdownReport>,
}

impl Driver {
    /// A job came back: its ticket is no longer needed to cancel or replace it.
    fn forget_job(&mut self, completion: &Completion) {
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

    fn apply(&mut self, effect: Effect<Route, BoxAgent>, frontend: &mut impl Frontend) {
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
            #[cfg(feature = "async")]
            Effect::Emit {
                route: Route::Stream(stream),
                event,
            } => {
                if let Err(ev) = stream.deliver(event) {
                    self.undelivered += 1;
                    log::debug!("session {}: event stream dropped ({})", ev.session, ev.id);
                }
            }
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

/// The heartbeat: a tick every interval on the reactor, its lateness recorded.
struct Heartbeat {
    started: SystemTime,
    interval: Duration,
    next: Duration,
    ticks: u64,
    lag: LagHistogram,
    /// Asked for the agents' usage at each snapshot.
    factory: Arc<dyn AgentFactory>,
}

impl Heartbeat {
    fn new(interval: Duration, factory: Arc<dyn AgentFactory>) -> Heartbeat {
        Heartbeat {
            started: SystemTime::now(),
            interval,
            next: interval,
            ticks: 0,
            lag: LagHistogram::default(),
            factory,
        }
    }

    fn tick_if_due(
        &mut self,
        now: Duration,
        state: RuntimeState,
        driver: &Driver,
        frontend: &impl Frontend,
    ) -> Option<Arc<Status>> {
        if now < self.next {
            return None;
        }
        self.lag.record(now - self.next);
        self.ticks += 1;
        // Keep the phase; a loop late by several periods records one late tick, not a burst.
        while self.next <= now {
            self.next += self.interval;
        }
        Some(self.snapshot(state, now, driver, frontend.status()))
    }

    fn snapshot(
        &self,
        state: RuntimeState,
        now: Duration,
        driver: &Driver,
        frontend: Option<serde_json::Value>,
    ) -> Arc<Status> {
        let s = driver.core.stats();
        Arc::new(Status {
            pid: std::process::id(),
            state,
            updated_at: rfc3339_utc(self.started + now),
            uptime_s: now.as_secs_f64(),
            ticks: self.ticks,
            loop_lag_ms: self.lag.summary(),
            sessions: SessionCounts {
                total: s.sessions,
                running: s.running_turns,
                queued_messages: s.queued_messages,
                waiting_for_worker: s.waiting_for_worker,
                cached_agents: s.cached_agents,
                parked_agents: s.parked_agents,
                cache_overflows: s.cache_overflows,
            },
            turns: TurnCounts {
                in_flight: s.running_turns,
                completed: s.turns_completed,
                failed: s.turns_failed,
                cancelled: s.turns_cancelled,
                abandoned: s.turns_abandoned,
            },
            cleanups: CleanupCounts {
                pending: s.cleanups_pending,
                queued: s.cleanups_queued,
                done: s.cleanups_done,
                timed_out: s.cleanups_timed_out,
                failed: s.cleanups_failed,
            },
            workers: WorkerCounts {
                turn: driver.turn_pool.live_threads(),
                cleanup: driver.cleanup_pool.live_threads(),
                replaced: driver.turn_pool.replaced() + driver.cleanup_pool.replaced(),
            },
            messages: MessageCounts {
                accepted: s.accepted,
                rejected: s.rejected,
                events_undelivered: driver.undelivered,
            },
            agent_usage: self.factory.usage(),
            frontend,
        })
    }
}
