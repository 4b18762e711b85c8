//! The heartbeat: a tick every interval on the reactor, its lateness recorded, and the status
//! snapshot it publishes.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::driver::Driver;
use super::frontend::Frontend;
use crate::agent::AgentFactory;
use crate::liveness::{
    LagHistogram, MessageCounts, RuntimeState, Status, WorkerCounts, rfc3339_utc,
};

/// The heartbeat: a tick every interval on the reactor, its lateness recorded.
pub(super) struct Heartbeat {
    started: SystemTime,
    interval: Duration,
    pub(super) next: Duration,
    ticks: u64,
    lag: LagHistogram,
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
            factory,
        }
    }

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
        self.lag.record(now - self.next);
        self.ticks += 1;
        // Keep the phase; a loop late by several periods records one late tick, not a burst.
        while self.next <= now {
            self.next += self.interval;
        }
        Some(self.snapshot(state, now, driver, frontend.status()))
    }

    pub(super) fn snapshot(
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
            sessions: s.sessions,
            turns: s.turns,
            cleanups: s.cleanups,
            workers: WorkerCounts {
                turn: driver.turn_pool.live_threads(),
                cleanup: driver.cleanup_pool.live_threads(),
                replaced: driver.turn_pool.replaced() + driver.cleanup_pool.replaced(),
            },
            messages: MessageCounts {
                events_undelivered: driver.undelivered,
                ..s.messages
            },
            agent_usage: self.factory.usage(),
            frontend,
        })
    }
}
