//! The [`Builder`]: settings, then [`Builder::build`] — validate, wire the channels, start the
//! pools, assemble the [`Runtime`] and its [`Handle`].

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender, bounded, unbounded};
use mio::Poll;

use super::event_loop::Runtime;
use super::handle::{Handle, nanos};
use super::route::{Events, Submission};
use super::wake::Notifier;
use super::workers::{
    BoxAgent, CleanupPool, ReportSink, TurnLimits, TurnPool, run_cleanup, run_turn,
};
use crate::agent::{Agent, AgentFactory, CancelToken};
use crate::core::{BusyMode, CoreConfig, MessageEvent, TurnJob};
use crate::liveness::StatusCell;
use crate::message::SessionKey;
use crate::pool::{Pool, PoolSize};

/// Default least time between two forwarded partials of a turn.
pub(crate) const DEFAULT_PARTIAL_INTERVAL: Duration = Duration::from_millis(800);
/// Most threads a pool may be configured with: past this a setting is refused by name
/// rather than left to fail at run time.
pub(crate) const MAX_POOL_THREADS: usize = 4096;
/// Default number of cleanup threads that always run.
pub(crate) const DEFAULT_CLEANUP_WORKERS: usize = 2;
/// Default number of given-up (stuck) threads each pool may keep alive.
pub(crate) const DEFAULT_MAX_EXTRA_THREADS: usize = 16;
/// Default [`Builder::events_backlog`]: unread events in the runtime's [`Events`] stream at
/// which its partial replies are skipped.
pub(crate) const DEFAULT_EVENTS_BACKLOG: usize = 256;
/// How long a pool thread beyond the minimum waits for work before it retires.
const POOL_KEEPALIVE: Duration = Duration::from_secs(5);

/// Why [`Builder::build`] refused: a setting out of range, or what the system would not
/// give (threads, the poll).
///
/// [`Display`](fmt::Display) is the whole reason on one line, the system's error included
/// (what the `turnstile` binary prints); [`source`](std::error::Error::source) is that
/// [`io::Error`] itself.
#[derive(Debug)]
#[non_exhaustive]
pub enum BuildError {
    /// A setting is out of range.
    Setting {
        /// The setting, named as its [`Builder`] method (`turn_workers`).
        name: &'static str,
        /// What is wrong with its value (`must be at least 1`).
        problem: String,
    },
    /// A pool's threads could not be started.
    Threads {
        /// The setting asking for them (`turn_workers`, `cleanup_workers`).
        name: &'static str,
        /// Threads asked for.
        count: usize,
        /// Why the system refused.
        source: io::Error,
    },
    /// The reactor's poll or its waker could not be created.
    Poll {
        /// What was being created: `poll` or `waker`.
        what: &'static str,
        /// Why the system refused.
        source: io::Error,
    },
}

impl BuildError {
    /// The setting the error is about, if one is.
    pub fn setting(&self) -> Option<&'static str> {
        match self {
            BuildError::Setting { name, .. } | BuildError::Threads { name, .. } => Some(name),
            BuildError::Poll { .. } => None,
        }
    }

    fn setting_error(name: &'static str, problem: String) -> BuildError {
        BuildError::Setting { name, problem }
    }
}

impl fmt::Display for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BuildError::Setting { name, problem } => write!(f, "{name} {problem}"),
            BuildError::Threads {
                name,
                count,
                source,
            } => write!(f, "{name}: cannot start {count} threads: {source}"),
            BuildError::Poll { what, source } => write!(f, "cannot create {what}: {source}"),
        }
    }
}

impl std::error::Error for BuildError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            BuildError::Setting { .. } => None,
            BuildError::Threads { source, .. } | BuildError::Poll { source, .. } => Some(source),
        }
    }
}

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
    events_backlog: usize,
    /// An async runtime's factory and spawner ([`Builder::new_async`]).
    #[cfg(feature = "async")]
    tasks: Option<(
        Arc<dyn super::async_agent::AsyncAgentFactory>,
        Box<dyn super::async_agent::Spawn>,
    )>,
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
            .field("events_backlog", &self.events_backlog)
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

    /// The core's whole configuration at once (what the setters above set one by one), as
    /// `serve` resolved it from its flags.
    #[cfg(feature = "cli")]
    pub(crate) fn core_config(mut self, core: CoreConfig) -> Self {
        self.core = core;
        self
    }

    /// Defaults: 16 turn workers, 2 cleanup workers, queue mode, the limits of [`CoreConfig`],
    /// a 100 ms heartbeat, 65,536 pending submissions, partials skipped past 256 unread
    /// events, no status file.
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
                max_reply_bytes: crate::core::DEFAULT_MAX_REPLY_BYTES,
            },
            events_backlog: DEFAULT_EVENTS_BACKLOG,
            #[cfg(feature = "async")]
            tasks: None,
        }
    }

    /// A builder whose agents are [`AsyncAgent`](crate::AsyncAgent)s (feature `async`):
    /// each turn, and each agent's close, is a task handed to `spawner` (the embedder's
    /// executor), so no turnstile thread waits while an agent awaits. The same settings and
    /// defaults apply; `turn_workers` is then the number of turns in flight at once, and the
    /// turn pool starts no thread. Status counts the tasks in flight
    /// (`workers.async_turns`, `workers.async_closes`).
    ///
    /// ```no_run
    /// use turnstile::{AgentError, AsyncAgent, Builder, SessionKey, Task};
    /// # use turnstile::{AgentFuture, CancelToken, TurnError, TurnInput};
    /// # struct Model;
    /// # impl AsyncAgent for Model {
    /// #     fn turn<'a>(&'a mut self, input: &'a TurnInput<'a>, _: &'a CancelToken)
    /// #         -> AgentFuture<'a, Result<String, TurnError>> {
    /// #         Box::pin(async move { Ok(input.text.to_owned()) })
    /// #     }
    /// # }
    ///
    /// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let tokio = tokio::runtime::Handle::current();
    /// let (runtime, handle, events) = Builder::new_async(
    ///     |_: &SessionKey| -> Result<Box<dyn AsyncAgent>, AgentError> { Ok(Box::new(Model)) },
    ///     move |task: Task| {
    ///         tokio.spawn(task);
    ///     },
    /// )
    /// .turn_workers(256)
    /// .build()?;
    /// let reactor = runtime.spawn()?;
    /// # drop((handle, events, reactor)); Ok(()) }
    /// ```
    #[cfg(feature = "async")]
    pub fn new_async(
        factory: impl super::async_agent::AsyncAgentFactory,
        spawner: impl super::async_agent::Spawn,
    ) -> Builder {
        let factory: Arc<dyn super::async_agent::AsyncAgentFactory> = Arc::new(factory);
        let mut builder = Builder::new(super::async_agent::UsageOf(Arc::clone(&factory)));
        builder.tasks = Some((factory, Box::new(spawner)));
        builder
    }

    setters! {
        /// Threads running agent turns; also the number of turns in flight at once.
        turn_workers: usize => core.turn_workers;
        /// Held turns (a journaling shell's, waiting for their start record or for a free
        /// worker) claimed at once beside the running ones; default 1,024.
        max_held_turns: usize => core.max_held_turns;
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
        /// Unread events in the runtime's [`Events`] stream at which its partial replies are
        /// skipped (default 256): a reader that falls behind, or never reads, holds at most
        /// this many events with partials among them, plus the accepted, turn and outcome
        /// events, which are always sent (at most four a message). A later partial or the
        /// outcome carries the whole text; the status counts the skipped ones
        /// (`messages.partials_skipped`). Sinks of [`Handle::submit_to`] are the embedder's
        /// and are not watched. 0 sends no partial to the stream.
        events_backlog: usize => events_backlog;
    }

    /// Writes each snapshot as JSON to `path` (atomically, from a non-reactor thread).
    pub fn status_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.status_file = Some(path.into());
        self
    }

    /// Validates the settings, starts the worker threads and prepares the reactor. A setting
    /// the machine cannot honour (threads it will not start) is an error naming it.
    pub fn build(self) -> Result<(Runtime, Handle, Events), BuildError> {
        self.validate()?;
        let wiring = Wiring::new(self.ingress_capacity, self.limits.partial_interval)?;
        let (turn_pool, cleanup_pool) = self.start_pools(&wiring)?;
        Ok(self.assemble(wiring, turn_pool, cleanup_pool))
    }

    /// Refuses a setting out of range, naming it.
    fn validate(&self) -> Result<(), BuildError> {
        let positive = [
            ("turn_workers", self.core.turn_workers),
            ("max_held_turns", self.core.max_held_turns),
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
                return Err(BuildError::setting_error(name, "must be at least 1".into()));
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
                return Err(BuildError::setting_error(
                    name,
                    format!("must be at most {MAX_POOL_THREADS} (got {v})"),
                ));
            }
        }
        if self.cleanup_workers > self.core.cleanup_concurrency {
            return Err(BuildError::setting_error(
                "cleanup_workers",
                format!(
                    "({}) must not exceed max_cleanup_workers ({})",
                    self.cleanup_workers, self.core.cleanup_concurrency
                ),
            ));
        }
        let nonzero = [
            ("tick_interval", self.tick_interval),
            ("sweep_interval", self.core.sweep_interval),
            ("turn_timeout", self.core.turn_timeout),
            ("cleanup_timeout", self.core.cleanup_timeout),
        ];
        for (name, v) in nonzero {
            if v.is_zero() {
                return Err(BuildError::setting_error(
                    name,
                    "must be greater than zero".into(),
                ));
            }
        }
        Ok(())
    }

    /// Starts the turn pool and the cleanup pool; both report to the reactor through
    /// `wiring`'s completion channel.
    fn start_pools(&self, wiring: &Wiring) -> Result<(TurnPool, CleanupPool), BuildError> {
        let (turn_sink, factory, limits) = (
            wiring.completion_sink(),
            Arc::clone(&self.factory),
            self.limits,
        );
        // The partial interval may change while running (a reload): each turn reads it.
        let partial_ns = Arc::clone(&wiring.partial_ns);
        // An async runtime sends no turn to the pool: it starts no thread.
        #[cfg(feature = "async")]
        let min = if self.tasks.is_some() {
            0
        } else {
            self.core.turn_workers
        };
        #[cfg(not(feature = "async"))]
        let min = self.core.turn_workers;
        let turn_pool = Pool::new(
            "turnstile-turn",
            PoolSize {
                min,
                max: self.core.turn_workers,
                max_stuck: self.max_extra_threads,
                keepalive: POOL_KEEPALIVE,
            },
            move |(job, cancel): (TurnJob<BoxAgent>, CancelToken)| {
                let partial_interval = Duration::from_nanos(partial_ns.load(Ordering::Relaxed));
                let limits = TurnLimits {
                    partial_interval,
                    ..limits
                };
                run_turn(job, &cancel, &*factory, &turn_sink, limits)
            },
        )
        .map_err(|source| BuildError::Threads {
            name: "turn_workers",
            count: self.core.turn_workers,
            source,
        })?;
        let cleanup_sink = wiring.completion_sink();
        let cleanup_pool = Pool::new(
            "turnstile-cleanup",
            PoolSize {
                min: self.cleanup_workers,
                max: self.core.cleanup_concurrency,
                max_stuck: self.max_extra_threads,
                keepalive: POOL_KEEPALIVE,
            },
            move |job| run_cleanup(job, &cleanup_sink),
        )
        .map_err(|source| BuildError::Threads {
            name: "cleanup_workers",
            count: self.cleanup_workers,
            source,
        })?;
        Ok((turn_pool, cleanup_pool))
    }

    /// The runtime (the reactor's side of every channel) and the handle (the senders' side).
    fn assemble(
        self,
        wiring: Wiring,
        turn_pool: TurnPool,
        cleanup_pool: CleanupPool,
    ) -> (Runtime, Handle, Events) {
        #[cfg(feature = "async")]
        let tasks = self.tasks.map(|(factory, spawner)| {
            super::async_agent::AsyncRunner::new(
                factory,
                spawner,
                wiring.completion_sink(),
                self.limits,
                Arc::clone(&wiring.partial_ns),
            )
        });
        let Wiring {
            poll,
            notifier,
            ingress: (ingress_tx, ingress_rx),
            events: (events_tx, events_rx),
            completions: (_, completions),
            shutdown,
            status,
            partial_ns,
            #[cfg(feature = "async")]
            room,
        } = wiring;
        let handle = Handle {
            ingress: ingress_tx,
            notifier: Arc::clone(&notifier),
            shutdown: Arc::clone(&shutdown),
            status: Arc::clone(&status),
            partial_ns,
            #[cfg(feature = "async")]
            room: Arc::clone(&room),
        };
        let runtime = Runtime {
            poll,
            notifier,
            #[cfg(feature = "async")]
            room: super::async_api::RoomGuard::new(room, ingress_rx.clone()),
            ingress: ingress_rx,
            shutdown,
            status,
            core: self.core,
            turn_pool,
            cleanup_pool,
            completions,
            events: events_tx,
            events_backlog: self.events_backlog,
            factory: self.factory,
            tick_interval: self.tick_interval,
            status_file: self.status_file,
            precise_timers: self.precise_timers,
            #[cfg(feature = "async")]
            tasks,
        };
        (runtime, handle, events_rx)
    }
}

/// The channels and shared cells between the reactor, its handles and the pools, made
/// before any thread starts.
struct Wiring {
    poll: Poll,
    notifier: Arc<Notifier>,
    ingress: (Sender<Submission>, Receiver<Submission>),
    events: (Sender<MessageEvent>, Receiver<MessageEvent>),
    completions: (
        Sender<super::workers::WorkerReport>,
        Receiver<super::workers::WorkerReport>,
    ),
    shutdown: Arc<AtomicBool>,
    status: Arc<StatusCell>,
    /// The turn workers' partial interval in nanoseconds, shared with every [`Handle`].
    partial_ns: Arc<AtomicU64>,
    #[cfg(feature = "async")]
    room: Arc<super::async_api::Room>,
}

impl Wiring {
    fn new(ingress_capacity: usize, partial_interval: Duration) -> Result<Wiring, BuildError> {
        let poll = Poll::new().map_err(|source| BuildError::Poll {
            what: "poll",
            source,
        })?;
        let waker =
            mio::Waker::new(poll.registry(), crate::tokens::REACTOR_WAKE).map_err(|source| {
                BuildError::Poll {
                    what: "waker",
                    source,
                }
            })?;
        Ok(Wiring {
            poll,
            notifier: Arc::new(Notifier::new(waker)),
            ingress: bounded(ingress_capacity),
            // Unbounded so that the reactor never loses an accepted, turn or outcome event
            // (at most four per message the embedder submitted); partials are what a reader
            // that falls behind would pile up, and the driver skips them once the stream
            // holds `events_backlog` unread events (`Driver::skips_partial`).
            events: unbounded(),
            // Bounded by the pools: one report per job a worker ran, and jobs are bounded by
            // the core's running-turn and cleanup caps.
            completions: unbounded(),
            shutdown: Arc::new(AtomicBool::new(false)),
            status: Arc::new(StatusCell::default()),
            partial_ns: Arc::new(AtomicU64::new(nanos(partial_interval))),
            #[cfg(feature = "async")]
            room: Arc::new(super::async_api::Room::default()),
        })
    }

    /// Where a pool's workers send their completions.
    fn completion_sink(&self) -> ReportSink {
        ReportSink {
            tx: self.completions.0.clone(),
            notifier: Arc::clone(&self.notifier),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::EchoAgent;

    fn refused(builder: Builder) -> BuildError {
        builder.build().expect_err("refused")
    }

    #[test]
    fn a_setting_out_of_range_is_named_with_its_problem() {
        let echo = || Builder::new(EchoAgent::factory(Duration::ZERO));
        let e = refused(echo().turn_workers(0));
        assert_eq!(e.setting(), Some("turn_workers"));
        assert_eq!(e.to_string(), "turn_workers must be at least 1");
        assert!(std::error::Error::source(&e).is_none());
        let e = refused(echo().max_extra_threads(MAX_POOL_THREADS + 1));
        assert_eq!(
            e.to_string(),
            format!("max_extra_threads must be at most {MAX_POOL_THREADS} (got 4097)")
        );
        let e = refused(echo().cleanup_workers(3).max_cleanup_workers(2));
        assert_eq!(e.setting(), Some("cleanup_workers"));
        assert_eq!(
            e.to_string(),
            "cleanup_workers (3) must not exceed max_cleanup_workers (2)"
        );
        let e = refused(echo().tick_interval(Duration::ZERO));
        assert_eq!(e.to_string(), "tick_interval must be greater than zero");
    }

    #[test]
    fn a_system_refusal_keeps_its_io_error_as_the_source() {
        let e = BuildError::Threads {
            name: "turn_workers",
            count: 8,
            source: io::Error::other("no more threads"),
        };
        assert_eq!(e.setting(), Some("turn_workers"));
        assert_eq!(
            e.to_string(),
            "turn_workers: cannot start 8 threads: no more threads"
        );
        let source = std::error::Error::source(&e).expect("source");
        assert_eq!(source.to_string(), "no more threads");
    }
}
