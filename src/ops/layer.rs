//! [`Ops`]: a frontend wrapping another (the bridge server) with the operations endpoint
//! (served on its own thread, [`Endpoint`]) and the systemd notifications (on the reactor).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, TryRecvError};

use mio::event::Event;
use mio::{Poll, Registry};

use super::access::{AccessApplier, AccessCalls, AccessDesk};
use super::endpoint::Endpoint;
use super::history::HistoryDesk;
use super::http::HttpServer;
use super::systemd::{SdNotify, WatchdogPacer};
use crate::agent::AgentFactory;
use crate::core::{MessageEvent, Tunables};
use crate::liveness::{FrontendStatus, RuntimeState, Status};
use crate::reactor::{Ctx, Frontend};

/// Ticks a snapshot may be old, and a tick may be late, for the loop to count as healthy.
pub(crate) const HEALTHY_TICKS: u32 = 3;
/// How often `STATUS=` is sent to systemd.
const STATUS_LINE_EVERY: Duration = Duration::from_secs(1);

/// A readiness check beyond the loop's own health (e.g. a store being writable): `Err`
/// says why the gateway is not ready.
pub(crate) type ReadinessCheck = Box<dyn Fn(&Status) -> Result<(), String> + Send>;

/// A re-read configuration: what may change while running, and what changed but needs a
/// restart. Produced off the reactor (it reads files), applied on it.
pub(crate) struct Reload {
    /// The core's settings (queue cap, busy mode, timeouts).
    pub tunables: Tunables,
    /// The least time between two forwarded partials.
    pub partial_interval: Duration,
    /// The auth token (bridges' hellos and the HTTP endpoint's bearer token).
    pub auth_token: Option<String>,
    /// A new agent factory for agents created from now on, when the agent's command changed.
    pub factory: Option<Arc<dyn AgentFactory>>,
    /// Settings that differ from those in force and need a restart (named for the WARN).
    pub restart_needed: Vec<String>,
    /// The listeners' certificate and key, read again (`None`: TLS is off, or stays as is).
    pub tls: Option<crate::tls::ServerTls>,
}

/// Adds figures to the frontend's status each tick (e.g. serve's supervised bridges).
pub(crate) type StatusAddon = Box<dyn Fn(&mut FrontendStatus) + Send>;

/// Reads the configuration again (on a helper thread).
pub(crate) type ReloadLoader = Arc<dyn Fn() -> Result<Reload, String> + Send + Sync>;

/// Applies what [`Ops`] cannot apply itself (the wrapped frontend's token, the factory, the
/// partial interval); returns settings it could not apply (they need a restart).
pub(crate) type ReloadApplier<F> = Box<dyn FnMut(&mut F, &Reload) -> Vec<String> + Send>;

/// The operations side of the gateway, hosted around `inner`.
pub(crate) struct Ops<F> {
    inner: F,
    /// The HTTP endpoint until `register` starts its thread.
    http: Option<HttpServer>,
    endpoint: Option<Endpoint>,
    /// The snapshot of a tick before `register` (the loop's first), for the endpoint.
    early: Option<(Arc<Status>, Instant)>,
    notify: Option<SdNotify>,
    pacer: Option<WatchdogPacer>,
    tick_interval: Duration,
    shutting_down: bool,
    ready_sent: bool,
    stopping_sent: bool,
    next_status_line: Duration,
    checks: Vec<(String, ReadinessCheck)>,
    addon: Option<StatusAddon>,
    reloader: Option<(ReloadLoader, ReloadApplier<F>)>,
    /// A reload being read on its helper thread.
    reloading: Option<Receiver<Result<Reload, String>>>,
    /// `/access` calls from the endpoint, applied on `inner`; the desk until `register`.
    access: Option<AccessCalls<F>>,
    desk: Option<AccessDesk>,
    /// `/history`'s reader of the stored conversations, until `register`.
    history: Option<HistoryDesk>,
    #[cfg(feature = "test-hooks")]
    wedge: Option<test_hooks::Wedge>,
}

/// The loop's health, as `/healthz` and the watchdog judge it.
pub(crate) fn health(
    latest: &Status,
    now: Duration,
    tick_interval: Duration,
    shutting_down: bool,
) -> Result<(), String> {
    if shutting_down || latest.state != RuntimeState::Running {
        return Err("shutting down".into());
    }
    let limit = tick_interval * HEALTHY_TICKS;
    let age = now.saturating_sub(Duration::from_secs_f64(latest.uptime_s.max(0.0)));
    if age > limit {
        return Err(format!(
            "last heartbeat tick {} ms ago (limit {} ms)",
            age.as_millis(),
            limit.as_millis()
        ));
    }
    // Clients starving while the loop keeps its pulse: the same limit as a late tick.
    if let Some(s) = latest.frontend.as_ref().and_then(|f| f.service.as_ref()) {
        let limit_ms = limit.as_secs_f64() * 1000.0;
        for (what, p99) in [
            ("read", s.read_delay_recent_ms.p99),
            ("write", s.write_delay_recent_ms.p99),
        ] {
            if p99 > limit_ms {
                return Err(format!(
                    "bridge connections wait {p99} ms to be {what} (p99 over the last 10 s; limit {limit_ms} ms)"
                ));
            }
        }
    }
    Ok(())
}

/// Whether a tick's lateness is healthy (at most [`HEALTHY_TICKS`] periods).
pub(crate) fn lag_healthy(latest: &Status, tick_interval: Duration) -> bool {
    latest.loop_lag_last_ms <= (tick_interval * HEALTHY_TICKS).as_secs_f64() * 1000.0
}

/// `/readyz`'s store check (with `--data-dir`): not ready while the bridge's journal says its
/// last write failed (new messages would be rejected `storage`).
pub(crate) fn journal_ready(status: &Status) -> Result<(), String> {
    let journal = status
        .frontend
        .as_ref()
        .and_then(|f| f.bridge.as_ref()?.journal.as_ref());
    match journal {
        Some(j) if j.failing => Err("journal writes are failing".into()),
        _ => Ok(()),
    }
}

/// A one-line summary for systemd's `STATUS=` and `turnstile status`.
pub(crate) fn summary_line(s: &Status) -> String {
    let connections = s
        .frontend
        .as_ref()
        .and_then(|f| f.bridge.as_ref())
        .map(|b| b.connections);
    let mut line = format!(
        "{:?}: {} sessions, {} turns running, {} queued, {} done, {} failed",
        s.state,
        s.sessions.total,
        s.turns.in_flight,
        s.sessions.queued_messages,
        s.turns.completed,
        s.turns.failed
    )
    .to_lowercase();
    if let Some(c) = connections {
        line.push_str(&format!(", {c} connections"));
    }
    line.push_str(&format!(
        ", loop lag p99 {} ms (last minute)",
        s.loop_lag_window_ms.p99
    ));
    line
}

impl<F: Frontend> Ops<F> {
    /// Wraps `inner`; `tick_interval` is the runtime's heartbeat period.
    pub(crate) fn new(inner: F, tick_interval: Duration) -> Ops<F> {
        Ops {
            inner,
            http: None,
            endpoint: None,
            early: None,
            notify: None,
            pacer: None,
            tick_interval,
            shutting_down: false,
            ready_sent: false,
            stopping_sent: false,
            next_status_line: Duration::ZERO,
            checks: Vec::new(),
            addon: None,
            reloader: None,
            reloading: None,
            access: None,
            desk: None,
            history: None,
            #[cfg(feature = "test-hooks")]
            wedge: test_hooks::Wedge::from_env(),
        }
    }

    /// Serves the HTTP endpoint (on its own thread, from `register` on).
    pub(crate) fn with_http(mut self, server: HttpServer) -> Ops<F> {
        self.http = Some(server);
        self
    }

    /// Notifies systemd (and pings its watchdog if it asked).
    pub(crate) fn with_notify(mut self, notify: SdNotify) -> Ops<F> {
        self.pacer = notify.watchdog().map(WatchdogPacer::new);
        self.notify = Some(notify);
        self
    }

    /// Adds figures to every status the frontend reports.
    pub(crate) fn with_status_addon(mut self, addon: StatusAddon) -> Ops<F> {
        self.addon = Some(addon);
        self
    }

    /// Adds a readiness check (`/readyz` fails naming it while it fails).
    pub(crate) fn with_readiness_check(mut self, name: &str, check: ReadinessCheck) -> Ops<F> {
        self.checks.push((name.to_owned(), check));
        self
    }

    /// Re-reads the configuration on SIGHUP with `load` (off the reactor) and applies it:
    /// the core's tunables and the HTTP token here, the rest with `apply`.
    pub(crate) fn with_reload(mut self, load: ReloadLoader, apply: ReloadApplier<F>) -> Ops<F> {
        self.reloader = Some((load, apply));
        self
    }

    /// Serves `POST /access` on the endpoint: each call is applied on `inner` by `apply`
    /// on the reactor (within a tick).
    pub(crate) fn with_access(mut self, apply: AccessApplier<F>) -> Ops<F> {
        let (desk, calls) = super::access::channel(apply);
        (self.access, self.desk) = (Some(calls), Some(desk));
        self
    }

    /// Serves `GET /history` on the endpoint, read through `load` on the endpoint's thread.
    pub(crate) fn with_history(mut self, load: crate::journal::memory::MemoryLoader) -> Ops<F> {
        self.history = Some(HistoryDesk::new(load));
        self
    }

    fn start_reload(&mut self) {
        let Some((load, _)) = &self.reloader else {
            log::warn!("reload: no configuration file to re-read (start with --config FILE)");
            return;
        };
        if self.reloading.is_some() {
            log::info!("reload: already in progress");
            return;
        }
        let (tx, rx) = crossbeam_channel::bounded(1);
        let load = Arc::clone(load);
        let spawned = std::thread::Builder::new()
            .name("turnstile-reload".into())
            .spawn(move || {
                let _ = tx.send(load());
            });
        match spawned {
            Ok(_) => self.reloading = Some(rx),
            Err(e) => log::error!("reload: cannot start its thread: {e}; settings unchanged"),
        }
    }

    /// The layer's invariants: systemd hears `STOPPING=1` only after `READY=1`, and a reload
    /// is read only when there is a way to read and apply it. Checked after every wake in
    /// debug builds.
    #[cfg(debug_assertions)]
    fn check(&self) {
        assert!(
            !self.stopping_sent || self.ready_sent,
            "STOPPING=1 sent before READY=1"
        );
        assert!(
            self.reloading.is_none() || self.reloader.is_some(),
            "a reload in progress with no loader"
        );
    }

    /// Applies a reload once its thread has read the configuration.
    fn finish_reload(&mut self, ctx: &mut Ctx<'_>) {
        let Some(reload) = self.take_reload() else {
            return;
        };
        let Some((_, apply)) = &mut self.reloader else {
            return;
        };
        let mut restart = reload.restart_needed.clone();
        restart.extend(apply(&mut self.inner, &reload));
        if let Some(h) = &self.endpoint
            && !restart.iter().any(|n| n == "auth-token")
        {
            h.set_auth_token(reload.auth_token.as_deref());
        }
        if let (Some(h), Some(tls)) = (&self.endpoint, &reload.tls) {
            h.set_tls(tls.clone());
        }
        ctx.retune(reload.tunables);
        for name in &restart {
            log::warn!("reload: {name} changed but needs a restart to apply; the old value stays");
        }
        log_applied(&reload);
    }

    /// The reload read by its thread, when it is done; a refused one is logged and dropped.
    fn take_reload(&mut self) -> Option<Reload> {
        let result = match self.reloading.as_ref()?.try_recv() {
            Err(TryRecvError::Empty) => return None,
            Ok(r) => r,
            Err(TryRecvError::Disconnected) => Err("the reload thread died".into()),
        };
        self.reloading = None;
        match result {
            Ok(r) => Some(r),
            Err(e) => {
                // One line, for log shippers (a TOML error spans several).
                let e = e.split_whitespace().collect::<Vec<_>>().join(" ");
                log::error!("reload refused: {e}; the settings in force are kept");
                None
            }
        }
    }
}

/// The INFO line of an applied reload: every setting a reload may change, as now in force.
fn log_applied(reload: &Reload) {
    let t = &reload.tunables;
    log::info!(
        "reload: applied busy-mode={:?} queue-cap={} turn-timeout={:?} stop-grace={:?} cleanup-timeout={:?} drain-timeout={:?} partial-interval={:?} auth-token={} agent={}",
        t.busy_mode,
        t.queue_cap,
        t.turn_timeout,
        t.stop_grace,
        t.cleanup_timeout,
        t.drain_timeout,
        reload.partial_interval,
        if reload.auth_token.is_some() {
            "set"
        } else {
            "none"
        },
        if reload.factory.is_some() {
            "new command for new agents"
        } else {
            "unchanged"
        },
    );
}

impl<F: Frontend> Frontend for Ops<F> {
    fn register(&mut self, registry: &Registry) -> std::io::Result<()> {
        self.inner.register(registry)?;
        if let Some(server) = self.http.take() {
            let checks = std::mem::take(&mut self.checks);
            let desks = (self.desk.take(), self.history.take());
            let endpoint = Endpoint::spawn(server, self.tick_interval, checks, desks)?;
            if let Some((status, at)) = self.early.take() {
                endpoint.publish_taken(status, at);
            }
            self.endpoint = Some(endpoint);
        }
        Ok(())
    }

    fn on_ready(&mut self, event: &Event, ctx: &mut Ctx<'_>) {
        self.inner.on_ready(event, ctx);
        if ctx.take_reload_request() {
            self.start_reload();
        }
    }

    fn on_wake(&mut self, ctx: &mut Ctx<'_>) -> Option<Duration> {
        let inner = self.inner.on_wake(ctx);
        if ctx.take_reload_request() {
            self.start_reload();
        }
        self.finish_reload(ctx);
        if ctx.shutting_down() && !self.shutting_down {
            self.shutting_down = true;
            if let Some(h) = &self.endpoint {
                h.shutting_down();
            }
        }
        if let Some(n) = &mut self.notify {
            if !self.ready_sent {
                self.ready_sent = true;
                n.send("READY=1\nSTATUS=listening");
            }
            if self.shutting_down && !self.stopping_sent {
                self.stopping_sent = true;
                n.send("STOPPING=1\nSTATUS=shutting down: draining");
            }
        }
        #[cfg(debug_assertions)]
        self.check();
        inner
    }

    fn deliver(&mut self, tag: u64, event: MessageEvent) {
        self.inner.deliver(tag, event);
    }

    fn flush(&mut self) {
        self.inner.flush();
    }

    fn finish(&mut self, poll: &mut Poll) {
        if let Some(h) = &mut self.endpoint {
            h.stop();
        }
        self.inner.finish(poll);
    }

    fn on_tick(&mut self, status: &Arc<Status>) {
        match &self.endpoint {
            Some(h) => h.publish(status),
            None => self.early = Some((Arc::clone(status), Instant::now())),
        }
        self.inner.on_tick(status);
        if let Some(calls) = &mut self.access {
            calls.apply_waiting(&mut self.inner);
        }
        let now = Duration::from_secs_f64(status.uptime_s.max(0.0));
        // Nothing before READY=1 (sent on the loop's first wake).
        if let Some(n) = self.notify.as_mut().filter(|_| self.ready_sent) {
            let healthy =
                lag_healthy(status, self.tick_interval) && status.state != RuntimeState::Stopped;
            if let Some(p) = &mut self.pacer
                && p.on_tick(now, healthy)
            {
                n.send("WATCHDOG=1");
            }
            if now >= self.next_status_line {
                self.next_status_line = now + STATUS_LINE_EVERY;
                n.send(&format!("STATUS={}", summary_line(status)));
            }
        }
        #[cfg(feature = "test-hooks")]
        if let Some(w) = &self.wedge {
            w.block_if_asked();
        }
    }

    fn status(&self) -> Option<FrontendStatus> {
        let mut status = self.inner.status();
        if let Some(h) = &self.endpoint {
            status.get_or_insert_default().http = Some(h.status());
        }
        if let Some(addon) = &self.addon {
            addon(status.get_or_insert_default());
        }
        status
    }
}

/// Test-only: a way to wedge the reactor, compiled only with the `test-hooks` feature (on
/// for the crate's own tests, off in any other build).
#[cfg(feature = "test-hooks")]
mod test_hooks {
    use std::io::Read;
    use std::path::PathBuf;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// With `TURNSTILE_TEST_WEDGE=<fifo>` set, SIGUSR1 makes the next tick open the FIFO and
    /// read it to its end on the reactor thread: the loop is stuck until the test closes it.
    pub(super) struct Wedge {
        fifo: PathBuf,
        asked: Arc<AtomicBool>,
    }

    impl Wedge {
        pub(super) fn from_env() -> Option<Wedge> {
            let fifo = PathBuf::from(std::env::var_os("TURNSTILE_TEST_WEDGE")?);
            let asked = Arc::new(AtomicBool::new(false));
            signal_hook::flag::register(libc::SIGUSR1, Arc::clone(&asked)).ok()?;
            Some(Wedge { fifo, asked })
        }

        pub(super) fn block_if_asked(&self) {
            if self.asked.swap(false, Ordering::SeqCst) {
                log::warn!("test hook: wedging the reactor on {}", self.fifo.display());
                if let Ok(mut f) = std::fs::File::open(&self.fifo) {
                    let mut sink = Vec::new();
                    let _ = f.read_to_end(&mut sink);
                }
                log::warn!("test hook: reactor released");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::liveness::BridgeStatus;

    fn running(uptime_s: f64, last_lag_ms: f64) -> Status {
        Status {
            state: RuntimeState::Running,
            uptime_s,
            loop_lag_last_ms: last_lag_ms,
            ..Status::default()
        }
    }

    #[test]
    fn health_needs_a_fresh_tick_and_no_shutdown() {
        let tick = Duration::from_millis(100);
        let s = running(1.0, 0.0);
        let ms = Duration::from_millis;
        assert_eq!(health(&s, ms(1000), tick, false), Ok(()));
        assert_eq!(health(&s, ms(1300), tick, false), Ok(()));
        assert_eq!(
            health(&s, ms(1301), tick, false),
            Err("last heartbeat tick 301 ms ago (limit 300 ms)".into())
        );
        assert_eq!(
            health(&s, ms(1000), tick, true),
            Err("shutting down".into())
        );
        let draining = Status {
            state: RuntimeState::Draining,
            ..s.clone()
        };
        assert_eq!(
            health(&draining, ms(1000), tick, false),
            Err("shutting down".into())
        );
        assert!(lag_healthy(&running(1.0, 300.0), tick));
        // Starving connections make it unhealthy, past the same limit as a late tick.
        let mut starved = running(1.0, 0.0);
        let mut service = crate::liveness::ServiceStatus::default();
        service.read_delay_recent_ms.p99 = 300.0;
        starved.frontend = Some(FrontendStatus {
            service: Some(service.clone()),
            ..FrontendStatus::default()
        });
        assert_eq!(
            health(&starved, Duration::from_secs(1), tick, false),
            Ok(())
        );
        service.read_delay_recent_ms.p99 = 301.0;
        starved.frontend = Some(FrontendStatus {
            service: Some(service),
            ..FrontendStatus::default()
        });
        assert_eq!(
            health(&starved, Duration::from_secs(1), tick, false),
            Err(
                "bridge connections wait 301 ms to be read (p99 over the last 10 s; limit 300 ms)"
                    .into()
            )
        );
        assert!(!lag_healthy(&running(1.0, 300.5), tick));
    }

    #[test]
    fn summary_line_names_the_figures() {
        let mut s = running(1.0, 0.0);
        s.sessions.total = 4;
        s.turns.in_flight = 2;
        s.sessions.queued_messages = 3;
        s.turns.completed = 10;
        s.turns.failed = 1;
        s.loop_lag_window_ms.p99 = 0.25;
        let bridge = BridgeStatus {
            connections: 5,
            ..BridgeStatus::default()
        };
        s.frontend = Some(FrontendStatus {
            bridge: Some(bridge),
            ..FrontendStatus::default()
        });
        assert_eq!(
            summary_line(&s),
            "running: 4 sessions, 2 turns running, 3 queued, 10 done, 1 failed, 5 connections, loop lag p99 0.25 ms (last minute)"
        );
    }

    #[test]
    fn the_store_is_not_ready_while_journal_writes_fail() {
        let mut status = crate::Status::default();
        assert_eq!(journal_ready(&status), Ok(()));
        let with_journal = |failing| {
            let mut bridge = BridgeStatus {
                journal: Some(Default::default()),
                ..BridgeStatus::default()
            };
            if let Some(j) = &mut bridge.journal {
                j.failing = failing;
            }
            Some(FrontendStatus {
                bridge: Some(bridge),
                ..FrontendStatus::default()
            })
        };
        status.frontend = with_journal(false);
        assert_eq!(journal_ready(&status), Ok(()));
        status.frontend = with_journal(true);
        assert_eq!(
            journal_ready(&status),
            Err("journal writes are failing".to_owned())
        );
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "STOPPING=1 sent before READY=1")]
    fn the_check_catches_stopping_before_ready() {
        let mut ops = Ops::new(crate::reactor::NoFrontend, Duration::from_millis(100));
        ops.check();
        ops.stopping_sent = true;
        ops.check();
    }
}
