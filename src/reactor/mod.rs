//! The reactor: one thread running a `mio` loop around the sans-IO [`Core`](crate::core::Core).
//!
//! It never runs agent code, never waits on a job and never touches the disk. The parts:
//!
//! - [`Builder`] validates the settings and starts the worker pools; [`Runtime`] runs the loop;
//!   [`Handle`] submits, reads the status and asks for shutdown from any thread.
//! - `event_loop`: the `Reactor` and its `turn()` — drain completions and ingress, dispatch
//!   I/O readiness, apply effects, tick the heartbeat, sleep until the next deadline.
//! - `driver`: carries out the core's effects (turns to the turn pool, agent teardown to the
//!   cleanup pool, events to their sinks or the frontend).
//! - `heartbeat`: the tick that measures the loop's lateness and builds the status snapshot.
//! - `workers`: what runs on the pool threads; `frontend`: the trait a server implements to
//!   host its sockets on the loop.

#[cfg(feature = "async")]
mod async_api;
mod deadline;
mod driver;
mod event_loop;
mod frontend;
mod heartbeat;
mod notify;
mod workers;

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender, TrySendError, bounded, unbounded};
use mio::Poll;

use crate::agent::{Agent, AgentFactory, CancelToken};
use crate::core::{BusyMode, CleanupJob, CoreConfig, MessageEvent, ShutdownReport, TurnJob};
use crate::liveness::{Status, StatusCell};
use crate::message::{Message, SessionKey};
use crate::pool::{Pool, PoolSize};
pub use crate::tokens::FIRST_RESERVED_TOKEN;
#[cfg(feature = "async")]
pub(crate) use async_api::StreamSink;
#[cfg(feature = "async")]
pub use async_api::{Cancelled, EventStream, Submit, SubmitStream};
use event_loop::Reactor;
pub use frontend::{Ctx, Frontend, NoFrontend};
use notify::Notifier;
pub(crate) use workers::BoxAgent;
use workers::{Completion, CompletionSink, TurnLimits, run_cleanup, run_turn};

/// Default least time between two forwarded partials of a turn.
pub(crate) const DEFAULT_PARTIAL_INTERVAL: Duration = Duration::from_millis(800);
/// Default cap on a reply's (and a partial's) length in bytes: 1 MiB.
pub const DEFAULT_MAX_REPLY_BYTES: usize = 1 << 20;

/// Submissions taken from the ingress channel per loop iteration.
const INGRESS_BATCH: usize = 1024;

/// Where a message's events go. Use an unbounded channel: the reactor never blocks on a
/// sink, so a full bounded one loses the event (logged at WARN and counted).
pub type EventSink = Sender<MessageEvent>;

/// Where the reactor delivers a message's events.
#[derive(Clone, Debug)]
#[non_exhaustive]
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
#[non_exhaustive]
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
pub(crate) const MAX_POOL_THREADS: usize = 4096;
/// Default number of cleanup threads that always run.
pub(crate) const DEFAULT_CLEANUP_WORKERS: usize = 2;
/// Default number of given-up (stuck) threads each pool may keep alive.
pub(crate) const DEFAULT_MAX_EXTRA_THREADS: usize = 16;
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

impl fmt::Debug for Builder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Builder")
            .field("core", &self.core)
            .field("cleanup_workers", &self.cleanup_workers)
            .field("max_extra_threads", &self.max_extra_threads)
            .field("ingress_capacity", &self.ingress_capacity)
            .field("tick_interval", &self.tick_interval)
            .field("status_file", &self.status_file)
            .field("precise_timers", &self.precise_timers)
            .field("max_reply_bytes", &self.limits.max_reply_bytes)
            .finish_non_exhaustive()
    }
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
    /// A builder whose agents come from `make`, called on a turn worker for each session
    /// that needs a fresh agent. The closure's types are inferred:
    ///
    /// ```
    /// use turnstile::{Agent, Builder, CancelToken, TurnError, TurnInput};
    ///
    /// struct Counter(usize);
    /// impl Agent for Counter {
    ///     fn turn(&mut self, input: &TurnInput<'_>, _: &CancelToken) -> Result<String, TurnError> {
    ///         self.0 += 1;
    ///         Ok(format!("message {} of this session: {}", self.0, input.text))
    ///     }
    /// }
    ///
    /// let builder = Builder::from_fn(|_session| Counter(0));
    /// # drop(builder);
    /// ```
    pub fn from_fn<F, A>(make: F) -> Builder
    where
        F: Fn(&SessionKey) -> A + Send + Sync + 'static,
        A: Agent,
    {
        Builder::new(crate::agent::FnFactory(make))
    }

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
        let waker = mio::Waker::new(poll.registry(), crate::tokens::REACTOR_WAKE)
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
        // The partial interval may change while running (a reload): each turn reads it.
        let partial_ns = Arc::new(AtomicU64::new(nanos(limits.partial_interval)));
        let turn_partial_ns = Arc::clone(&partial_ns);
        let turn_pool = Pool::new(
            "turnstile-turn",
            PoolSize {
                min: self.core.turn_workers,
                max: self.core.turn_workers,
                max_stuck: self.max_extra_threads,
                keepalive: CLEANUP_KEEPALIVE,
            },
            move |(job, cancel): (TurnJob<BoxAgent>, CancelToken)| {
                let partial_interval =
                    Duration::from_nanos(turn_partial_ns.load(Ordering::Relaxed));
                let limits = TurnLimits {
                    partial_interval,
                    ..limits
                };
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
            partial_ns,
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
    /// The turn workers' partial interval in nanoseconds.
    partial_ns: Arc<AtomicU64>,
    /// Submits waiting for ingress room (the `async` feature).
    #[cfg(feature = "async")]
    room: Arc<async_api::Room>,
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Handle {
    /// Changes the least time between two forwarded partials, for turns started from now on.
    pub fn set_partial_interval(&self, interval: Duration) {
        self.partial_ns.store(nanos(interval), Ordering::Relaxed);
    }

    /// The least time between two forwarded partials now in force.
    pub fn partial_interval(&self) -> Duration {
        Duration::from_nanos(self.partial_ns.load(Ordering::Relaxed))
    }

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

impl fmt::Debug for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Handle")
            .field("queued_submissions", &self.ingress.len())
            .field("shutdown_requested", &self.shutdown.load(Ordering::Relaxed))
            .finish_non_exhaustive()
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

impl fmt::Debug for Runtime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Runtime")
            .field("core", &self.core)
            .field("turn_threads", &self.turn_pool.live_threads())
            .field("cleanup_threads", &self.cleanup_pool.live_threads())
            .field("tick_interval", &self.tick_interval)
            .field("status_file", &self.status_file)
            .finish_non_exhaustive()
    }
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
    pub fn run_with<F: Frontend>(self, frontend: F) -> std::io::Result<ShutdownReport> {
        let mut reactor = Reactor::start(self, frontend)?;
        let report = loop {
            if let Some(report) = reactor.turn()? {
                break report;
            }
        };
        Ok(reactor.finish(report))
    }
}
