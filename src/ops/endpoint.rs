//! The HTTP endpoint on a thread of its own: [`Endpoint`] owns the [`HttpServer`] and its
//! own `mio` poll, and answers from the latest status snapshot the reactor publishes.
//!
//! Why a thread: on the reactor, 60 clients pipelining `/metrics` and `/status` cost a
//! bridge's ping 17–21 ms at the median (issue 18 row 4), because every answer (and every
//! render) was reactor time. Here the reactor only hands over an `Arc` per tick; parsing,
//! rendering and writing happen beside it. A wedged reactor publishes nothing, so `/healthz`
//! keeps answering, and answers 503 naming how old the last tick is.

use std::io;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use mio::{Events, Poll, Token, Waker};

use super::access::AccessDesk;
use super::history::HistoryDesk;
use super::http::{self, HttpServer, OpsSource};
use super::layer::{ReadinessCheck, health};
use super::metrics;
use crate::liveness::{HttpStatus, Status};
use crate::tls::ServerTls;

/// The endpoint thread's wake-up: outside the HTTP tokens ([`http::owns`]).
const WAKER: Token = Token(0);
/// Most messages the reactor may have queued for the thread (one per tick, a reload, the
/// stop); only a thread stuck for this many ticks could fill it.
const CONTROL_CAP: usize = 1024;

/// What the reactor tells the endpoint thread.
enum Control {
    /// A new status snapshot, taken at `at`.
    Snapshot(Arc<Status>, Instant),
    /// Shutdown began: `/healthz` and `/readyz` answer 503 from now on.
    ShuttingDown,
    /// A reload's auth token.
    Token(Option<String>),
    /// A reload's certificate.
    Tls(ServerTls),
    /// Close every connection and end.
    Stop,
}

/// The reactor's handle on the endpoint thread.
pub(crate) struct Endpoint {
    tx: Sender<Control>,
    waker: Arc<Waker>,
    /// The server's figures after its last pass, for the reactor's status snapshot.
    figures: Arc<Mutex<HttpStatus>>,
    thread: Option<JoinHandle<()>>,
}

impl Endpoint {
    /// Registers `server` on a poll of its own and starts serving it on a new thread.
    pub(crate) fn spawn(
        mut server: HttpServer,
        tick_interval: Duration,
        checks: Vec<(String, ReadinessCheck)>,
        (desk, history): (Option<AccessDesk>, Option<HistoryDesk>),
    ) -> io::Result<Endpoint> {
        let poll = Poll::new()?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        debug_assert!(!http::owns(WAKER), "the waker's token is one of HTTP's");
        server.register(poll.registry())?;
        let figures = Arc::new(Mutex::new(server.status()));
        let (tx, rx) = crossbeam_channel::bounded(CONTROL_CAP);
        let state = Served {
            latest: Arc::new(Status::default()),
            at: Instant::now(),
            generation: 0,
            shutting_down: false,
            tick_interval,
            checks,
            desk,
            history,
        };
        let shared = Arc::clone(&figures);
        let thread = std::thread::Builder::new()
            .name("turnstile-http".into())
            .spawn(move || run(server, poll, &rx, state, &shared))?;
        Ok(Endpoint {
            tx,
            waker,
            figures,
            thread: Some(thread),
        })
    }

    fn send(&self, c: Control) {
        match self.tx.try_send(c) {
            Ok(()) => {
                if let Err(e) = self.waker.wake() {
                    log::warn!("http: cannot wake the endpoint thread: {e}");
                }
            }
            // Only a thread stuck for CONTROL_CAP ticks: it answers from an older snapshot.
            Err(e) => log::warn!("http: the endpoint thread is not keeping up ({e})"),
        }
    }

    /// Hands over a new status snapshot (every tick).
    pub(crate) fn publish(&self, status: &Arc<Status>) {
        self.publish_taken(Arc::clone(status), Instant::now());
    }

    /// Hands over a snapshot taken at `at`.
    pub(crate) fn publish_taken(&self, status: Arc<Status>, at: Instant) {
        self.send(Control::Snapshot(status, at));
    }

    /// Shutdown began.
    pub(crate) fn shutting_down(&self) {
        self.send(Control::ShuttingDown);
    }

    /// A reload's token, for the requests that follow.
    pub(crate) fn set_auth_token(&self, token: Option<&str>) {
        self.send(Control::Token(token.map(str::to_owned)));
    }

    /// A reload's certificate, for the connections accepted from now on.
    pub(crate) fn set_tls(&self, tls: ServerTls) {
        self.send(Control::Tls(tls));
    }

    /// The server's figures after its last pass.
    pub(crate) fn status(&self) -> HttpStatus {
        self.figures
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Closes every connection and waits for the thread to end (shutdown).
    pub(crate) fn stop(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        self.send(Control::Stop);
        if thread.join().is_err() {
            log::error!("http: the endpoint thread panicked");
        }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.stop();
    }
}

/// What the thread answers from.
struct Served {
    latest: Arc<Status>,
    /// When `latest` was published: its age is measured on this thread's clock.
    at: Instant,
    generation: u64,
    shutting_down: bool,
    tick_interval: Duration,
    checks: Vec<(String, ReadinessCheck)>,
    /// Where `/access` calls go (the reactor), when the gateway has a policy.
    desk: Option<AccessDesk>,
    /// Where `/history` reads (the store, on this thread), when conversations are stored.
    history: Option<HistoryDesk>,
}

impl Served {
    fn view(&self) -> View<'_> {
        View {
            latest: &self.latest,
            generation: self.generation,
            // The reactor's clock now: the snapshot's time plus its age.
            now: Duration::from_secs_f64(self.latest.uptime_s.max(0.0)) + self.at.elapsed(),
            tick_interval: self.tick_interval,
            shutting_down: self.shutting_down,
            checks: &self.checks,
            desk: self.desk.as_ref(),
            history: self.history.as_ref(),
        }
    }
}

/// The thread: poll, take the reactor's messages, serve one pass, sleep until the server's
/// next deadline (at once while connections wait for a pass).
fn run(
    mut server: HttpServer,
    mut poll: Poll,
    rx: &Receiver<Control>,
    mut state: Served,
    figures: &Mutex<HttpStatus>,
) {
    // Nothing is answered before the loop's first snapshot (connections wait in the
    // listener's backlog, as they did for the loop itself): "listening" means healthy.
    if !first_snapshot(rx, &mut server, &mut state) {
        return;
    }
    let clock = Instant::now();
    let mut events = Events::with_capacity(256);
    let mut deadline: Option<Duration> = None;
    loop {
        let timeout = deadline.map(|d| d.saturating_sub(clock.elapsed()));
        if let Err(e) = poll.poll(&mut events, timeout)
            && e.kind() != io::ErrorKind::Interrupted
        {
            log::error!("http: poll failed: {e}; the endpoint stops");
            server.close_all();
            return;
        }
        if !take_controls(rx, &mut server, &mut state) {
            server.close_all();
            return;
        }
        let now = clock.elapsed();
        let view = state.view();
        for event in &events {
            if event.token() != WAKER {
                server.on_ready(event, now, &view);
            }
        }
        server.serve(now, &view);
        deadline = server.on_wake(now);
        *figures.lock().unwrap_or_else(PoisonError::into_inner) = server.status();
    }
}

/// Waits for the first snapshot (applying what comes before it); `false`: told to stop.
fn first_snapshot(rx: &Receiver<Control>, server: &mut HttpServer, state: &mut Served) -> bool {
    while state.generation == 0 {
        match rx.recv() {
            Ok(c) => {
                if !apply(c, server, state) {
                    return false;
                }
            }
            Err(_) => return false,
        }
    }
    true
}

/// Applies what the reactor sent; `false` once it said stop (or is gone).
fn take_controls(rx: &Receiver<Control>, server: &mut HttpServer, state: &mut Served) -> bool {
    loop {
        match rx.try_recv() {
            Ok(c) => {
                if !apply(c, server, state) {
                    return false;
                }
            }
            Err(TryRecvError::Disconnected) => return false,
            Err(TryRecvError::Empty) => return true,
        }
    }
}

/// Applies one message; `false` for [`Control::Stop`].
fn apply(c: Control, server: &mut HttpServer, state: &mut Served) -> bool {
    match c {
        Control::Snapshot(status, at) => {
            state.latest = status;
            state.at = at;
            state.generation += 1;
        }
        Control::ShuttingDown => state.shutting_down = true,
        Control::Token(token) => server.set_auth_token(token.as_deref()),
        Control::Tls(tls) => server.set_tls(Some(tls)),
        Control::Stop => return false,
    }
    true
}

/// The endpoint's answers over one snapshot.
pub(super) struct View<'a> {
    pub(super) latest: &'a Status,
    /// Counts the snapshots: the HTTP bodies' cache key (0: none yet).
    pub(super) generation: u64,
    /// The reactor's clock, to judge the snapshot's age.
    pub(super) now: Duration,
    pub(super) tick_interval: Duration,
    pub(super) shutting_down: bool,
    pub(super) checks: &'a [(String, ReadinessCheck)],
    pub(super) desk: Option<&'a AccessDesk>,
    pub(super) history: Option<&'a HistoryDesk>,
}

impl OpsSource for View<'_> {
    fn health(&self) -> Result<(), String> {
        health(
            self.latest,
            self.now,
            self.tick_interval,
            self.shutting_down,
        )
    }

    fn ready(&self) -> Result<(), String> {
        self.health()?;
        for (name, check) in self.checks {
            check(self.latest).map_err(|e| format!("{name}: {e}"))?;
        }
        Ok(())
    }

    fn status_json(&self) -> Vec<u8> {
        let mut body = serde_json::to_vec(self.latest).unwrap_or_default();
        body.push(b'\n');
        body
    }

    fn metrics(&self) -> String {
        metrics::render(self.latest)
    }

    fn snapshot(&self) -> Option<u64> {
        Some(self.generation)
    }

    fn access(&self, query: &str) -> (u16, String) {
        match self.desk {
            Some(desk) => desk.ask(query),
            None => http::no_access_policy(),
        }
    }

    fn history(&self, query: &str) -> (u16, String) {
        match self.history {
            Some(desk) => desk.answer(query),
            None => super::history::no_history(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::liveness::RuntimeState;
    use crate::ops::http::HttpConfig;
    use std::io::{Read as _, Write as _};

    fn running(uptime_s: f64) -> Status {
        Status {
            state: RuntimeState::Running,
            uptime_s,
            ..Status::default()
        }
    }

    fn get(addr: std::net::SocketAddr, path: &str) -> String {
        let mut c = std::net::TcpStream::connect(addr).expect("connect");
        c.set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        write!(c, "GET {path} HTTP/1.1\r\nConnection: close\r\n\r\n").expect("request");
        let mut answer = String::new();
        c.read_to_string(&mut answer).expect("the answer");
        answer
    }

    /// Issue 18 row 4: HTTP is answered beside the reactor, not on it. Nothing here plays
    /// the reactor's part beyond handing over snapshots, and every request is answered; the
    /// snapshot's age is judged on the endpoint's clock, so a reactor that stops publishing
    /// (wedged) is reported, not waited for.
    #[test]
    fn answers_from_published_snapshots_without_the_reactor() {
        let server = HttpServer::bind("127.0.0.1:0".parse().expect("addr"), HttpConfig::default())
            .expect("bind");
        let addr = server.local_addr().expect("addr");
        let tick = Duration::from_millis(100);
        let mut endpoint = Endpoint::spawn(server, tick, Vec::new(), (None, None)).expect("spawn");
        // A request before the first snapshot waits for it; a fresh snapshot: healthy.
        let early = std::thread::spawn(move || get(addr, "/healthz"));
        endpoint.publish(&Arc::new(running(1.0)));
        let answer = early.join().expect("the early request");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        // Sent before the request: the thread takes it before it serves the request.
        let status = get(addr, "/status");
        assert!(status.contains("\"state\":\"running\""), "{status}");
        // A snapshot older than three ticks: the endpoint says so by itself.
        let two_s_ago = Instant::now()
            .checked_sub(Duration::from_secs(2))
            .expect("a clock two seconds old");
        endpoint.publish_taken(Arc::new(running(1.0)), two_s_ago);
        let stale = get(addr, "/healthz");
        assert!(stale.starts_with("HTTP/1.1 503"), "{stale}");
        assert!(stale.contains("last heartbeat tick"), "{stale}");
        endpoint.shutting_down();
        let down = get(addr, "/healthz");
        assert!(down.contains("shutting down"), "{down}");
        endpoint.stop();
        // The figures the reactor reads are stored after each pass: all four are over.
        assert_eq!(endpoint.status().requests, 4, "{:?}", endpoint.status());
        assert!(
            std::net::TcpStream::connect(addr)
                .and_then(|mut c| {
                    c.write_all(b"GET /healthz HTTP/1.1\r\n\r\n")?;
                    let mut b = [0u8; 1];
                    c.read(&mut b)
                })
                .map_or(true, |n| n == 0),
            "answered after stop"
        );
    }

    #[test]
    fn readiness_needs_health_and_every_check() {
        let tick = Duration::from_millis(100);
        let s = running(1.0);
        let checks: Vec<(String, ReadinessCheck)> =
            vec![("store".into(), Box::new(|_| Err("not writable".into())))];
        let view = |shutting_down, checks| View {
            latest: &s,
            generation: 1,
            now: Duration::from_secs(1),
            tick_interval: tick,
            shutting_down,
            checks,
            desk: None,
            history: None,
        };
        assert_eq!(view(false, &[]).ready(), Ok(()));
        assert_eq!(view(true, &[]).ready(), Err("shutting down".into()));
        assert_eq!(
            view(false, &checks).ready(),
            Err("store: not writable".into())
        );
        let body = view(false, &[]).status_json();
        assert!(body.ends_with(b"}\n"));
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["state"], "running");
        assert!(view(false, &[]).metrics().contains("turnstile_up 1\n"));
    }
}
