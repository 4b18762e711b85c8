//! The heartbeat: a tick every interval on the reactor, its lateness recorded, and the status
//! snapshot it publishes.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::driver::Driver;
use super::frontend::Frontend;
use super::procstat::ProcSample;
use crate::agent::AgentFactory;
use crate::histogram::{LAG_BUCKETS, LagHistogram, LagWindow, PromHistogram};
use crate::liveness::{
    FrontendStatus, Histograms, MessageCounts, ProcessInfo, RuntimeState, Status, ThreadStates,
    WorkerCounts, rfc3339_utc,
};
use crate::pool::Pool;

/// Length of one slice of the loop-lag window (six slices: the last minute).
const WINDOW_SLICE: Duration = Duration::from_secs(10);
/// How often the process's figures (memory, CPU, descriptors) are read.
const PROCESS_EVERY: Duration = Duration::from_secs(1);

fn thread_states<J: Send + 'static>(pool: &Pool<J>) -> ThreadStates {
    let live = pool.live_threads();
    let stuck = pool.stuck_threads().min(live);
    let idle = pool.idle_threads().min(live - stuck);
    ThreadStates {
        idle,
        busy: live - stuck - idle,
        stuck,
    }
}

/// The heartbeat: a tick every interval on the reactor, its lateness recorded.
pub(super) struct Heartbeat {
    started: SystemTime,
    interval: Duration,
    pub(super) next: Duration,
    ticks: u64,
    lag: LagHistogram,
    /// The last minute's lag.
    window: LagWindow,
    /// The lag in the metrics' buckets.
    lag_buckets: PromHistogram,
    last_lag: Duration,
    process: ProcSample,
    next_process: Duration,
    /// Asked for the agents' usage at each snapshot.
    factory: Arc<dyn AgentFactory>,
}

impl Heartbeat {
    pub(super) fn new(interval: Duration, factory: Arc<dyn AgentFactory>) -> Heartbeat {
        Heartbeat {
            started: SystemTime::now(),
            interval,
            next: interval,
            ticks: 0,
            lag: LagHistogram::default(),
            window: LagWindow::new(WINDOW_SLICE),
            lag_buckets: PromHistogram::new(LAG_BUCKETS),
            last_lag: Duration::ZERO,
            process: ProcSample::read(ProcSample::default()),
            next_process: PROCESS_EVERY,
            factory,
        }
    }

    /// Ticks when the period is due: records the tick's lateness and returns the snapshot
    /// (with the frontend's figures) to publish.
    pub(super) fn tick_if_due(
        &mut self,
        now: Duration,
        state: RuntimeState,
        driver: &Driver,
        frontend: &impl Frontend,
    ) -> Option<Arc<Status>> {
        if now < self.next {
            return None;
        }
        let lag = now - self.next;
        self.lag.record(lag);
        self.window.record(now, lag);
        self.lag_buckets.record(lag);
        self.last_lag = lag;
        self.ticks += 1;
        if now >= self.next_process {
            self.next_process = now + PROCESS_EVERY;
            self.process = ProcSample::read(self.process);
        }
        // Keep the phase; a loop late by several periods records one late tick, not a burst.
        while self.next <= now {
            self.next += self.interval;
        }
        Some(self.snapshot(state, now, driver, frontend.status()))
    }

    /// The status snapshot now: the core's counts, the pools', the driver's and the
    /// frontend's figures, and the heartbeat's own.
    pub(super) fn snapshot(
        &self,
        state: RuntimeState,
        now: Duration,
        driver: &Driver,
        frontend: Option<FrontendStatus>,
    ) -> Arc<Status> {
        let s = driver.core().stats();
        Arc::new(Status {
            version: crate::liveness::VERSION,
            revision: crate::liveness::REVISION,
            pid: std::process::id(),
            state,
            updated_at: rfc3339_utc(self.started + now),
            uptime_s: now.as_secs_f64(),
            ticks: self.ticks,
            loop_lag_ms: self.lag.summary(),
            loop_lag_window_ms: self.window.merged(now).summary(),
            loop_lag_last_ms: self.last_lag.as_micros() as f64 / 1000.0,
            process: self.process_info(now),
            sessions: s.sessions,
            turns: s.turns,
            cleanups: s.cleanups,
            workers: worker_counts(driver),
            messages: MessageCounts {
                events_undelivered: driver.undelivered(),
                partials_forwarded: driver.partials_forwarded(),
                partials_skipped: driver.partials_skipped(),
                ..s.messages
            },
            rejected_by_reason: driver.rejected_by_reason().clone(),
            agent_usage: self.factory.usage(),
            agent_usage_by_model: self.factory.usage_by_model(),
            agent_failures: self.factory.failures(),
            agents: self.factory.agents(),
            frontend,
            histograms: Arc::new(Histograms {
                loop_lag: self.lag_buckets.clone(),
                turn_duration: driver.turn_durations().clone(),
            }),
        })
    }

    fn process_info(&self, now: Duration) -> ProcessInfo {
        ProcessInfo {
            rss_bytes: self.process.rss_bytes,
            cpu_seconds: self.process.cpu_seconds,
            open_fds: self.process.open_fds,
            max_fds: self.process.max_fds,
            started_unix_s: unix_s(self.started),
            updated_unix_s: unix_s(self.started + now),
            tick_interval_s: self.interval.as_secs_f64(),
        }
    }
}

fn worker_counts(driver: &Driver) -> WorkerCounts {
    let (async_turns, async_closes) = driver.async_tasks();
    WorkerCounts {
        async_turns,
        async_closes,
        turn: driver.turn_pool().live_threads(),
        cleanup: driver.cleanup_pool().live_threads(),
        replaced: driver.turn_pool().replaced() + driver.cleanup_pool().replaced(),
        turn_threads: thread_states(driver.turn_pool()),
        cleanup_threads: thread_states(driver.cleanup_pool()),
    }
}

fn unix_s(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}
