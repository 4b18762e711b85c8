//! The loop: the [`Runtime`] an embedder runs, and the `Reactor` it becomes on its thread —
//! one [`Reactor::turn`] per wake, in named steps.

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use mio::{Events as MioEvents, Poll};

use super::deadline::DeadlineTimer;
use super::driver::Driver;
use super::frontend::{Ctx, Frontend, NoFrontend};
use super::heartbeat::Heartbeat;
use super::route::{Route, Submission};
use super::wake::Notifier;
use super::workers::{BoxAgent, CleanupPool, TurnPool, WorkerReport, panic_text};
use crate::agent::AgentFactory;
use crate::core::{Core, CoreConfig, Effect, Input, ShutdownReport};
use crate::liveness::{RuntimeState, StatusCell, StatusFileWriter};
use crate::tokens::{REACTOR_TIMER as TIMER_TOKEN, REACTOR_WAKE as WAKE_TOKEN};

/// Readiness events taken per poll.
const EVENTS_CAPACITY: usize = 256;
/// Submissions taken from the ingress channel per loop iteration.
const INGRESS_BATCH: usize = 1024;

/// The reactor, ready to run on the thread that calls [`Runtime::run`]; its worker threads
/// are already running.
pub struct Runtime {
    pub(super) poll: Poll,
    pub(super) notifier: Arc<Notifier>,
    /// Wakes submits waiting for ingress room (the `async` feature).
    #[cfg(feature = "async")]
    pub(super) room: super::async_api::RoomGuard,
    pub(super) ingress: Receiver<Submission>,
    pub(super) shutdown: Arc<AtomicBool>,
    pub(super) status: Arc<StatusCell>,
    pub(super) core: CoreConfig,
    pub(super) turn_pool: TurnPool,
    pub(super) cleanup_pool: CleanupPool,
    pub(super) completions: Receiver<WorkerReport>,
    /// The sending half of the runtime's [`Events`](super::Events): where `Route::Default`
    /// delivers. Held by the reactor alone, so the stream ends when the loop does.
    pub(super) events: super::route::EventSink,
    /// Unread events in `events` at which partials are skipped ([`Builder::events_backlog`]).
    ///
    /// [`Builder::events_backlog`]: super::Builder::events_backlog
    pub(super) events_backlog: usize,
    /// Kept for the heartbeat: the factory's agent usage joins the status.
    pub(super) factory: Arc<dyn AgentFactory>,
    pub(super) tick_interval: Duration,
    pub(super) status_file: Option<PathBuf>,
    pub(super) precise_timers: bool,
    /// Where async agents' turns and closes run (the `async` feature, `Builder::new_async`).
    #[cfg(feature = "async")]
    pub(super) tasks: Option<super::async_agent::AsyncRunner>,
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
    /// Runs the reactor on a new thread named `turnstile-reactor`; fails only if the thread
    /// cannot be started.
    pub fn spawn(self) -> io::Result<RuntimeThread> {
        thread::Builder::new()
            .name("turnstile-reactor".into())
            .spawn(move || self.run())
            .map(|thread| RuntimeThread { thread })
    }

    /// Drives the loop until a shutdown requested through a [`Handle`](super::Handle)
    /// completes.
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

/// The reactor running on a thread of its own, from [`Runtime::spawn`].
#[derive(Debug)]
pub struct RuntimeThread {
    thread: thread::JoinHandle<io::Result<ShutdownReport>>,
}

impl RuntimeThread {
    /// Waits for the loop to end (after a shutdown asked through a
    /// [`Handle`](super::Handle)) and returns its report.
    pub fn join(self) -> Result<ShutdownReport, RunError> {
        match self.thread.join() {
            Ok(ran) => ran.map_err(RunError::Io),
            Err(payload) => Err(RunError::Panicked(panic_text(&*payload))),
        }
    }

    /// Whether the loop has ended (`join` then returns at once).
    pub fn is_finished(&self) -> bool {
        self.thread.is_finished()
    }
}

/// Why the reactor's loop ended without a report.
#[derive(Debug)]
#[non_exhaustive]
pub enum RunError {
    /// An I/O error stopped the loop: its poll, the frontend's registration, the status
    /// file's writer.
    Io(io::Error),
    /// The reactor thread panicked, with this message.
    Panicked(String),
}

impl fmt::Display for RunError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RunError::Io(_) => f.write_str("the reactor stopped on an I/O error"),
            RunError::Panicked(why) => write!(f, "the reactor thread panicked: {why}"),
        }
    }
}

impl std::error::Error for RunError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RunError::Io(e) => Some(e),
            RunError::Panicked(_) => None,
        }
    }
}

/// Everything the loop owns, on the reactor thread.
pub(super) struct Reactor<F: Frontend> {
    /// The loop's clock: the core's `now` is the time since this instant (monotonic).
    epoch: Instant,
    poll: Poll,
    events: MioEvents,
    notifier: Arc<Notifier>,
    /// Fires at the next deadline with sub-millisecond precision, when enabled.
    timer: Option<DeadlineTimer>,
    ingress: Receiver<Submission>,
    /// Submits waiting for ingress room, woken after each drain (the `async` feature).
    #[cfg(feature = "async")]
    room: super::async_api::RoomGuard,
    completions: Receiver<WorkerReport>,
    shutdown: Arc<AtomicBool>,
    driver: Driver,
    /// Effects produced by the core this turn, applied in order by [`Reactor::apply_effects`].
    effects: Vec<Effect<Route, BoxAgent>>,
    frontend: F,
    /// The frontend's next timer, as it said on its last wake.
    frontend_deadline: Option<Duration>,
    heartbeat: Heartbeat,
    status: Arc<StatusCell>,
    status_file: Option<StatusFileWriter>,
}

impl<F: Frontend> Reactor<F> {
    /// Takes over the runtime's parts, registers the frontend and publishes the first status.
    pub(super) fn start(runtime: Runtime, mut frontend: F) -> std::io::Result<Reactor<F>> {
        let Runtime {
            poll,
            notifier,
            #[cfg(feature = "async")]
            room,
            ingress,
            shutdown,
            status,
            core,
            turn_pool,
            cleanup_pool,
            completions,
            events,
            events_backlog,
            factory,
            tick_interval,
            status_file,
            precise_timers,
            #[cfg(feature = "async")]
            tasks,
        } = runtime;
        let status_file = status_file.map(StatusFileWriter::start).transpose()?;
        frontend.register(poll.registry())?;
        let timer = if precise_timers {
            Some(DeadlineTimer::new(poll.registry(), TIMER_TOKEN)?)
        } else {
            None
        };
        let reactor = Reactor {
            epoch: Instant::now(),
            poll,
            events: MioEvents::with_capacity(EVENTS_CAPACITY),
            notifier,
            timer,
            ingress,
            #[cfg(feature = "async")]
            room,
            completions,
            shutdown,
            driver: Driver::new(
                core_naming_agents(core, &factory),
                turn_pool,
                cleanup_pool,
                (events, events_backlog),
                #[cfg(feature = "async")]
                tasks,
            ),
            effects: Vec::new(),
            frontend,
            frontend_deadline: None,
            heartbeat: Heartbeat::new(tick_interval, factory),
            status,
            status_file,
        };
        let mut reactor = reactor;
        let first = reactor.heartbeat.snapshot(
            RuntimeState::Running,
            Duration::ZERO,
            &reactor.driver,
            reactor.frontend.status(),
        );
        reactor.status.publish(Arc::clone(&first));
        reactor.frontend.on_tick(&first);
        Ok(reactor)
    }

    /// One pass of the loop. The readiness events handled here were gathered by the previous
    /// turn's sleep; everything else is taken fresh. Returns the report once shutdown is done.
    pub(super) fn turn(&mut self) -> std::io::Result<Option<ShutdownReport>> {
        let now = self.epoch.elapsed();
        self.drain_completions(now);
        self.drain_ingress(now);
        self.dispatch_readiness(now);
        self.begin_shutdown_if_requested(now);
        self.apply_effects(now);
        if let Some(report) = self.driver.take_report() {
            return Ok(Some(report));
        }
        self.tick_heartbeat();
        self.sleep_until_next_deadline()?;
        Ok(None)
    }

    /// Worker results: turns ended, partials, cleanups started and ended. Taken completely,
    /// since wakes coalesce.
    fn drain_completions(&mut self, now: Duration) {
        for completion in self.completions.try_iter() {
            self.driver.forget_job(&completion);
            self.driver
                .core_mut()
                .handle(now, completion.into(), &mut self.effects);
        }
    }

    /// Submissions through a [`Handle`](super::Handle). Bounded per turn so a burst cannot
    /// delay timers and the heartbeat; the rest is taken next turn, without sleeping.
    fn drain_ingress(&mut self, now: Duration) {
        for (message, route) in self.ingress.try_iter().take(INGRESS_BATCH) {
            self.driver
                .core_mut()
                .handle(now, Input::Submit { message, route }, &mut self.effects);
        }
        #[cfg(feature = "async")]
        self.room.drained();
    }

    /// Hands socket readiness to the frontend, then lets it do its per-wake work.
    fn dispatch_readiness(&mut self, now: Duration) {
        let mut ctx = Ctx::new(now, self.driver.core_mut(), &mut self.effects);
        for event in self.events.iter() {
            match event.token() {
                WAKE_TOKEN => {}
                TIMER_TOKEN => {
                    if let Some(timer) = &mut self.timer {
                        timer.fired();
                    }
                }
                _ => self.frontend.on_ready(event, &mut ctx),
            }
        }
        self.frontend_deadline = self.frontend.on_wake(&mut ctx);
        if ctx.shutdown_requested() {
            self.shutdown.store(true, Ordering::SeqCst);
        }
    }

    /// A shutdown asked for by a handle, a signal or the frontend starts the core's drain once.
    fn begin_shutdown_if_requested(&mut self, now: Duration) {
        if self.shutdown.load(Ordering::SeqCst) && !self.driver.core().is_shutting_down() {
            log::info!("shutdown requested: draining");
            self.driver
                .core_mut()
                .handle(now, Input::Shutdown, &mut self.effects);
        }
    }

    /// Fires the core's due timers, then carries out every effect in the order produced.
    fn apply_effects(&mut self, now: Duration) {
        self.driver.core_mut().advance(now, &mut self.effects);
        self.driver
            .apply_all(now, self.effects.drain(..), &mut self.frontend);
        self.frontend.flush();
    }

    /// Records the tick's lateness and publishes a snapshot when a tick is due.
    fn tick_heartbeat(&mut self) {
        let state = if self.driver.core().is_shutting_down() {
            RuntimeState::Draining
        } else {
            RuntimeState::Running
        };
        let now = self.epoch.elapsed();
        if let Some(snapshot) = self
            .heartbeat
            .tick_if_due(now, state, &self.driver, &self.frontend)
        {
            if let Some(writer) = &self.status_file {
                writer.offer(Arc::clone(&snapshot));
            }
            self.status.publish(Arc::clone(&snapshot));
            self.frontend.on_tick(&snapshot);
        }
    }

    /// Polls until readiness, a wake, or the earliest deadline (the core's timers, the
    /// frontend's, the next tick). Skipped when work is already waiting.
    fn sleep_until_next_deadline(&mut self) -> std::io::Result<()> {
        let deadline = [self.driver.core().next_deadline(), self.frontend_deadline]
            .into_iter()
            .flatten()
            .fold(self.heartbeat.next, Duration::min);
        self.notifier.prepare_sleep();
        let pending = !self.completions.is_empty()
            || !self.ingress.is_empty()
            || (self.shutdown.load(Ordering::SeqCst) && !self.driver.core().is_shutting_down());
        if pending && !self.frontend.has_sources() {
            // Work is waiting and no socket can be ready: the next pass starts at once. Only
            // the waker and the timer are registered, and both matter only to a sleep (the
            // core's timers and the heartbeat read the clock every pass); skipping the
            // zero-timeout poll spares a syscall per busy pass (issue 21 §5: the epoll path
            // was the reactor's largest item in the raw profile). Last pass's events are
            // handled already.
            self.events.clear();
        } else if pending {
            // Work is waiting: no sleep, but readiness is still gathered (a zero timeout), so
            // a socket that became ready waits one turn, not until the completions run dry.
            if let Err(e) = self.poll.poll(&mut self.events, Some(Duration::ZERO))
                && e.kind() != std::io::ErrorKind::Interrupted
            {
                return Err(e);
            }
        } else {
            let now = self.epoch.elapsed();
            let timeout = deadline.saturating_sub(now);
            // A deadline already due (a frontend asking for the loop at once, each pass a
            // new `now`) needs no timer: arming one per pass cost a syscall and a timer
            // interrupt each (9 % of the reactor's samples under 20 flooders).
            if !timeout.is_zero()
                && let Some(timer) = &mut self.timer
                && let Err(e) = timer.arm_for(deadline, now)
            {
                log::error!("timerfd: {e}; falling back to millisecond poll timeouts");
            }
            if let Err(e) = self.poll.poll(&mut self.events, Some(timeout))
                && e.kind() != std::io::ErrorKind::Interrupted
            {
                return Err(e);
            }
        }
        self.notifier.awake();
        Ok(())
    }

    /// After the last turn: the frontend flushes its output, and the final snapshot says the
    /// loop has stopped.
    pub(super) fn finish(mut self, report: ShutdownReport) -> ShutdownReport {
        log::info!("shutdown complete {report}");
        self.frontend.finish(&mut self.poll);
        let last = self.heartbeat.snapshot(
            RuntimeState::Stopped,
            self.epoch.elapsed(),
            &self.driver,
            self.frontend.status(),
        );
        self.status.publish(Arc::clone(&last));
        if let Some(writer) = self.status_file {
            writer.finish(last);
        }
        report
    }
}

/// The core, its `/status` naming each session's agent as the factory says.
fn core_naming_agents(
    cfg: crate::core::CoreConfig,
    factory: &Arc<dyn AgentFactory>,
) -> Core<Route, BoxAgent> {
    let mut core = Core::new(cfg, Duration::ZERO);
    let factory = Arc::clone(factory);
    core.set_agent_names(crate::core::AgentNames(Box::new(move |key| {
        factory.session_agent(key)
    })));
    core
}
