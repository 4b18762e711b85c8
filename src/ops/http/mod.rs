//! The operations HTTP endpoint: a small HTTP/1.1 server hosted on the reactor.
//!
//! Two halves, like the bridge server: `respond` ([`parse_request`] and [`respond`]) is sans-IO
//! (bytes in, a response out), and [`HttpServer`] here is the mio shell that accepts, reads and
//! writes on the reactor thread without blocking. Every resource is bounded (see
//! [`HttpConfig`]).

use std::cell::RefCell;
use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use mio::event::Event;
use mio::net::{TcpListener, TcpStream};
use mio::{Interest, Registry, Token};
use slab::Slab;

mod respond;

pub(crate) use respond::{OpsSource, Parsed, Request, no_access_policy, parse_request, respond};
use respond::{TEXT, response};

use crate::auth::Token as AuthToken;
use crate::liveness::HttpStatus;
use crate::tls::{ServerTls, Transport};
use crate::tokens::{HTTP_CONNS, HTTP_LISTENER as LISTENER};

/// Default address of the endpoint.
pub(crate) const DEFAULT_HTTP_LISTEN: &str = "127.0.0.1:7879";
/// Default cap on open HTTP connections.
pub(crate) const DEFAULT_MAX_CONNECTIONS: usize = 64;
/// Default cap on the bytes of a request's head (request line and headers).
pub(crate) const DEFAULT_MAX_HEADER_BYTES: usize = 8 * 1024;
/// Default number of requests served on one connection before it is closed.
pub(crate) const DEFAULT_MAX_REQUESTS: usize = 100;
/// Default time a connection has to complete a request (from its opening or its last
/// response) before it is closed.
pub(crate) const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(10);
/// Default cap on the open connections of one peer address; at it, that peer's oldest
/// idle connection makes room.
pub(crate) const DEFAULT_MAX_PER_PEER: usize = 16;
/// Default time a new connection has to send its first request's head.
pub(crate) const DEFAULT_HEAD_TIMEOUT: Duration = Duration::from_secs(2);
/// Most connections the endpoint may be configured with (their tokens are a fixed band).
pub(crate) const MAX_CONNECTIONS_LIMIT: usize = crate::tokens::HTTP_MAX_CONNECTIONS;
/// Requests answered per pass of the loop across all connections (round-robin, one per
/// connection per turn); the rest wait for the next pass.
pub(crate) const ANSWERS_PER_PASS: usize = 16;
/// Lines of one kind (refusals, evictions, wrong tokens) logged per [`LOG_WINDOW`]; the rest
/// are counted and reported as "(N more suppressed)".
const LOG_BURST: u32 = 5;
/// The window of [`LOG_BURST`].
const LOG_WINDOW: Duration = Duration::from_secs(1);
/// Connections accepted per wake.
const ACCEPT_BATCH: usize = 64;

/// Whether `token` belongs to the HTTP endpoint.
pub(crate) fn owns(token: Token) -> bool {
    token == LISTENER || HTTP_CONNS.slot(token).is_some()
}

/// Settings of the endpoint.
#[derive(Clone, Debug)]
pub(crate) struct HttpConfig {
    /// When set, every path but `/healthz` requires `Authorization: Bearer <token>`.
    pub auth_token: Option<String>,
    /// Open connections; one more gets `503` and is closed.
    pub max_connections: usize,
    /// Bytes of a request head; more is `431` and the connection is closed.
    pub max_header_bytes: usize,
    /// Requests per connection; the last response says `Connection: close`.
    pub max_requests: usize,
    /// Time to complete a request, from the connection's opening or its last response.
    pub idle_timeout: Duration,
    /// Open connections of one peer address; one more evicts that peer's oldest idle one.
    pub max_per_peer: usize,
    /// Time a new connection has to send its first request's head.
    pub head_timeout: Duration,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            auth_token: None,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_header_bytes: DEFAULT_MAX_HEADER_BYTES,
            max_requests: DEFAULT_MAX_REQUESTS,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            max_per_peer: DEFAULT_MAX_PER_PEER,
            head_timeout: DEFAULT_HEAD_TIMEOUT,
        }
    }
}

struct HttpConn {
    /// The socket, or TLS over it.
    stream: Transport,
    peer: SocketAddr,
    input: Vec<u8>,
    output: Vec<u8>,
    written: usize,
    served: usize,
    /// When the current request's time started (opening or last response).
    since: Duration,
    /// Close once the output is written.
    closing: bool,
    /// In the ready queue.
    queued: bool,
}

/// A log line kind limited to [`LOG_BURST`] lines per [`LOG_WINDOW`]; the rest are counted.
#[derive(Default)]
struct RateLog {
    start: Duration,
    logged: u32,
    suppressed: u64,
}

impl RateLog {
    /// Whether to log an event now; `Some(n)`: yes, with `n` suppressed before it.
    fn note(&mut self, now: Duration) -> Option<u64> {
        let mut before = 0;
        if now >= self.start + LOG_WINDOW {
            before = std::mem::take(&mut self.suppressed);
            self.start = now;
            self.logged = 0;
        }
        if self.logged < LOG_BURST {
            self.logged += 1;
            Some(before)
        } else {
            self.suppressed += 1;
            None
        }
    }

    /// The count suppressed in a window that is over (to log it), if any.
    fn flush(&mut self, now: Duration) -> Option<u64> {
        if self.suppressed > 0 && now >= self.start + LOG_WINDOW {
            self.start = now;
            self.logged = 0;
            Some(std::mem::take(&mut self.suppressed))
        } else {
            None
        }
    }

    /// When [`RateLog::flush`] has something to say.
    fn due(&self) -> Option<Duration> {
        (self.suppressed > 0).then_some(self.start + LOG_WINDOW)
    }
}

/// " (N more suppressed)" after a rate-limited line, or nothing.
fn suppressed(n: u64) -> String {
    if n == 0 {
        String::new()
    } else {
        format!(" ({n} more suppressed)")
    }
}

/// `/status` and `/metrics` bodies rendered once per status snapshot, served as bytes.
#[derive(Default)]
struct BodyCache {
    snapshot: Option<u64>,
    status: Option<Arc<[u8]>>,
    metrics: Option<Arc<[u8]>>,
    renders: u64,
}

/// An [`OpsSource`] whose `/status` and `/metrics` come from the [`BodyCache`].
struct Cached<'a> {
    inner: &'a dyn OpsSource,
    cache: &'a RefCell<BodyCache>,
}

impl Cached<'_> {
    fn body(&self, metrics: bool) -> Arc<[u8]> {
        let mut c = self.cache.borrow_mut();
        let snapshot = self.inner.snapshot();
        if snapshot.is_none() || c.snapshot != snapshot {
            c.snapshot = snapshot;
            c.status = None;
            c.metrics = None;
        }
        let slot = if metrics { &c.metrics } else { &c.status };
        if let Some(b) = slot {
            return Arc::clone(b);
        }
        let b: Arc<[u8]> = if metrics {
            self.inner.metrics().into_bytes().into()
        } else {
            self.inner.status_json().into()
        };
        c.renders += 1;
        if metrics {
            c.metrics = Some(Arc::clone(&b));
        } else {
            c.status = Some(Arc::clone(&b));
        }
        b
    }
}

impl OpsSource for Cached<'_> {
    fn health(&self) -> Result<(), String> {
        self.inner.health()
    }
    fn ready(&self) -> Result<(), String> {
        self.inner.ready()
    }
    fn snapshot(&self) -> Option<u64> {
        self.inner.snapshot()
    }
    fn status_json(&self) -> Vec<u8> {
        self.body(false).to_vec()
    }
    fn metrics(&self) -> String {
        String::from_utf8_lossy(&self.body(true)).into_owned()
    }
    fn status_bytes(&self) -> Arc<[u8]> {
        self.body(false)
    }
    fn metrics_bytes(&self) -> Arc<[u8]> {
        self.body(true)
    }
    fn access(&self, query: &str) -> (u16, String) {
        self.inner.access(query)
    }
    fn history(&self, query: &str) -> (u16, String) {
        self.inner.history(query)
    }
}

/// What [`HttpServer::pick_victim`] found.
enum Victim {
    /// A connection closed by its peer was found (and removed).
    RoomMade,
    /// Close this one (its peer named for the log).
    Evict(usize, SocketAddr),
    /// Every candidate is mid-response.
    None,
}

/// What one turn of [`HttpServer::drive`] left.
enum Turn {
    /// Waiting for the socket's next readiness event (or closed).
    Wait,
    /// More to do: back of the queue.
    More,
}

/// What a connection's socket did in one step of [`HttpServer::drive`].
enum Io {
    /// Done for now with no trouble: go on to the next step.
    Ready,
    /// The socket would block: wait for its next readiness event.
    Blocked,
    /// The peer closed, or the socket failed: close the connection.
    Gone,
}

impl HttpConn {
    /// Writes the pending response; once it is all written, the next request's time starts.
    fn write_output(&mut self, now: Duration) -> Io {
        // TLS may hold ciphertext (the handshake's, a write's tail) for the socket.
        if self.stream.flush_tls().is_err() {
            return Io::Gone;
        }
        if self.stream.tls_queued() {
            return Io::Blocked;
        }
        while self.written < self.output.len() {
            match self.stream.write(&self.output[self.written..]) {
                Ok(0) => return Io::Gone,
                Ok(n) => self.written += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Io::Blocked,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return Io::Gone,
            }
        }
        if !self.output.is_empty() {
            self.output.clear();
            self.written = 0;
            self.since = now;
        }
        Io::Ready
    }

    /// Reads once, never past the head bound (plus one byte to detect an overflow).
    fn read_input(&mut self, scratch: &mut [u8], max_header_bytes: usize) -> Io {
        let room = (max_header_bytes + 1)
            .saturating_sub(self.input.len())
            .min(scratch.len());
        debug_assert!(room > 0, "a full head is answered 431 before reading more");
        match self.stream.read(&mut scratch[..room]) {
            Ok(0) => Io::Gone,
            Ok(n) => {
                self.input.extend_from_slice(&scratch[..n]);
                Io::Ready
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Io::Blocked,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Io::Ready,
            Err(_) => Io::Gone,
        }
    }
}

/// The endpoint's mio shell: a listener and its connections, on the reactor's poll.
pub(crate) struct HttpServer {
    cfg: HttpConfig,
    token: Option<AuthToken>,
    listener: TcpListener,
    /// The certificate new connections are served TLS with; none: plain HTTP.
    tls: Option<ServerTls>,
    registry: Option<Registry>,
    conns: Slab<HttpConn>,
    /// Connections with something to do, served round-robin within the pass budget.
    ready: VecDeque<usize>,
    /// The accept batch ran out with connections perhaps still queued.
    accept_more: bool,
    next_sweep: Option<Duration>,
    stats: HttpStatus,
    scratch: Vec<u8>,
    cache: RefCell<BodyCache>,
    log_refused: RateLog,
    log_evicted: RateLog,
    log_unauthorized: RateLog,
}

impl HttpServer {
    /// Binds `addr` (non-blocking). The connection cap is clamped to
    /// [`MAX_CONNECTIONS_LIMIT`].
    pub(crate) fn bind(addr: SocketAddr, mut cfg: HttpConfig) -> io::Result<HttpServer> {
        cfg.max_connections = cfg.max_connections.clamp(1, MAX_CONNECTIONS_LIMIT);
        cfg.max_per_peer = cfg.max_per_peer.clamp(1, cfg.max_connections);
        let listener = TcpListener::bind(addr)?;
        Ok(HttpServer {
            token: cfg.auth_token.as_deref().map(AuthToken::new),
            stats: HttpStatus {
                max_connections: cfg.max_connections,
                max_header_bytes: cfg.max_header_bytes,
                max_requests: cfg.max_requests,
                idle_timeout_s: cfg.idle_timeout.as_secs_f64(),
                max_per_peer: cfg.max_per_peer,
                head_timeout_s: cfg.head_timeout.as_secs_f64(),
                answers_per_pass: ANSWERS_PER_PASS,
                ..HttpStatus::default()
            },
            cfg,
            listener,
            tls: None,
            registry: None,
            conns: Slab::new(),
            ready: VecDeque::new(),
            accept_more: false,
            next_sweep: None,
            scratch: vec![0; 4096],
            cache: RefCell::new(BodyCache::default()),
            log_refused: RateLog::default(),
            log_evicted: RateLog::default(),
            log_unauthorized: RateLog::default(),
        })
    }

    /// The bound address.
    pub(crate) fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Replaces the auth token for the requests that follow (a reload).
    pub(crate) fn set_auth_token(&mut self, token: Option<&str>) {
        self.token = token.map(AuthToken::new);
        self.cfg.auth_token = token.map(str::to_owned);
    }

    /// Serves TLS with `tls` to the connections accepted from now on; `None`: plain HTTP.
    #[cfg_attr(not(feature = "tls"), allow(dead_code))]
    pub(crate) fn set_tls(&mut self, tls: Option<ServerTls>) {
        self.tls = tls;
    }

    /// The endpoint's figures.
    pub(crate) fn status(&self) -> HttpStatus {
        HttpStatus {
            connections: self.conns.len(),
            tls: self.tls.is_some(),
            renders: self.cache.borrow().renders,
            ..self.stats.clone()
        }
    }

    /// Registers the listener on the reactor's poll.
    pub(crate) fn register(&mut self, registry: &Registry) -> io::Result<()> {
        registry.register(&mut self.listener, LISTENER, Interest::READABLE)?;
        self.registry = Some(registry.try_clone()?);
        Ok(())
    }

    /// A readiness event for one of the endpoint's tokens ([`owns`]).
    /// Connections are only queued here; the pass ([`HttpServer::serve`]) serves them.
    pub(crate) fn on_ready(&mut self, event: &Event, now: Duration, source: &dyn OpsSource) {
        if event.token() == LISTENER {
            self.accept(now, source);
            return;
        }
        if let Some(slot) = HTTP_CONNS.slot(event.token()) {
            self.enqueue(slot);
        }
        #[cfg(debug_assertions)]
        self.check();
    }

    fn enqueue(&mut self, slot: usize) {
        if let Some(c) = self.conns.get_mut(slot)
            && !c.queued
        {
            c.queued = true;
            self.ready.push_back(slot);
        }
    }

    /// The connections queued at the start of the pass, round-robin, one answer per turn,
    /// at most [`ANSWERS_PER_PASS`] answers in all. The host runs it once per loop
    /// iteration after the bridge's own output is written (see `Ops::flush`), so no HTTP
    /// answer sits between a bridge's line and its reply.
    pub(crate) fn serve(&mut self, now: Duration, source: &dyn OpsSource) {
        if std::mem::take(&mut self.accept_more) {
            self.accept(now, source);
        }
        let cache = std::mem::take(&mut self.cache);
        let cached = Cached {
            inner: source,
            cache: &cache,
        };
        let mut budget = ANSWERS_PER_PASS;
        let mut turns = self.ready.len();
        while budget > 0 && turns > 0 {
            turns -= 1;
            let Some(slot) = self.ready.pop_front() else {
                break;
            };
            let Some(c) = self.conns.get_mut(slot) else {
                continue;
            };
            c.queued = false;
            if let Turn::More = self.drive(slot, now, &cached, &mut budget) {
                self.enqueue(slot);
                // Served again this pass only after every other queued connection.
                turns += 1;
            }
        }
        if budget == 0 && !self.ready.is_empty() {
            self.stats.budget_spent += 1;
        }
        self.cache = cache;
    }

    /// Closes idle connections; returns when it next needs the loop
    /// (at once while connections wait for [`HttpServer::serve`]).
    pub(crate) fn on_wake(&mut self, now: Duration) -> Option<Duration> {
        if self.next_sweep.is_some_and(|t| t <= now) {
            let expired: Vec<(usize, bool)> = self
                .conns
                .iter()
                .filter(|(_, c)| self.deadline(c) <= now)
                .map(|(slot, c)| (slot, c.served == 0))
                .collect();
            for (slot, first) in expired {
                if first {
                    self.stats.head_timeouts += 1;
                } else {
                    self.stats.idle_closed += 1;
                }
                self.close(slot);
            }
            self.next_sweep = self.conns.iter().map(|(_, c)| self.deadline(c)).min();
        }
        self.flush_logs(now);
        #[cfg(debug_assertions)]
        self.check();
        let logs = [&self.log_refused, &self.log_evicted, &self.log_unauthorized]
            .into_iter()
            .filter_map(RateLog::due)
            .min();
        if self.ready.is_empty() && !self.accept_more {
            [self.next_sweep, logs].into_iter().flatten().min()
        } else {
            Some(now)
        }
    }

    /// When a connection is closed for not completing its request: the head timeout for the
    /// first request, the idle timeout for the later ones.
    fn deadline(&self, c: &HttpConn) -> Duration {
        if c.served == 0 {
            c.since + self.cfg.head_timeout.min(self.cfg.idle_timeout)
        } else {
            c.since + self.cfg.idle_timeout
        }
    }

    /// The counts of rate-limited lines whose window is over.
    fn flush_logs(&mut self, now: Duration) {
        if let Some(n) = self.log_refused.flush(now) {
            log::info!("http: {n} more refused connections suppressed");
        }
        if let Some(n) = self.log_evicted.flush(now) {
            log::info!("http: {n} more evicted connections suppressed");
        }
        if let Some(n) = self.log_unauthorized.flush(now) {
            log::info!("http: {n} more unauthorized requests suppressed");
        }
    }

    /// The endpoint's invariants: connections within the cap and their token band, buffers
    /// within their bounds, an idle sweep due while any connection is open, counts that add
    /// up. Checked after every event and wake in debug builds.
    #[cfg(debug_assertions)]
    fn check(&self) {
        let cap = self.cfg.max_connections;
        assert!(
            self.conns.len() <= cap,
            "{} connections over the cap {cap}",
            self.conns.len()
        );
        for (slot, c) in &self.conns {
            assert!(slot < cap, "slot {slot} outside the token band");
            assert!(c.written <= c.output.len(), "wrote past the response");
            assert!(
                c.input.len() <= self.cfg.max_header_bytes + 1,
                "read past the head bound"
            );
        }
        assert!(
            self.ready.iter().all(|&slot| slot < cap),
            "a queued slot outside the band"
        );
        for (slot, c) in &self.conns {
            assert!(
                !c.queued || self.ready.contains(&slot),
                "slot {slot} marked queued but not in the queue"
            );
        }
        assert!(
            self.conns.is_empty() || self.next_sweep.is_some(),
            "open connections with no idle sweep due"
        );
        let st = &self.stats;
        assert!(
            st.unauthorized + st.bad_requests <= st.requests,
            "more refused requests than requests"
        );
    }

    /// Closes every connection (shutdown).
    pub(crate) fn close_all(&mut self) {
        let slots: Vec<usize> = self.conns.iter().map(|(s, _)| s).collect();
        for slot in slots {
            self.close(slot);
        }
    }

    fn accept(&mut self, now: Duration, source: &dyn OpsSource) {
        for _ in 0..ACCEPT_BATCH {
            let (stream, peer) = match self.listener.accept() {
                Ok(pair) => pair,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    log::warn!("http: accept failed: {e}");
                    return;
                }
            };
            if self.registry.is_none() {
                return;
            }
            if self.make_room(peer, now, source) {
                self.admit(stream, peer, now);
            } else {
                self.refuse_connection(stream, peer, now);
            }
        }
        // More may wait; the listener is edge-triggered, so look again next wake.
        self.accept_more = true;
    }

    /// Room for a connection from `peer`: at the peer's cap, one of its connections is
    /// evicted; at the global cap, one of any peer's ([`HttpServer::pick_victim`]). False
    /// when every candidate is mid-response.
    fn make_room(&mut self, peer: SocketAddr, now: Duration, source: &dyn OpsSource) -> bool {
        let same = |c: &HttpConn| c.peer.ip() == peer.ip();
        let of_peer = self.conns.iter().filter(|(_, c)| same(c)).count();
        let (why, mine) = if of_peer >= self.cfg.max_per_peer {
            ("its peer's cap", true)
        } else if self.conns.len() >= self.cfg.max_connections {
            ("the connection cap", false)
        } else {
            return true;
        };
        let (slot, old) = match self.pick_victim(|c| !mine || same(c), now, source) {
            Victim::RoomMade => return true,
            Victim::None => return false,
            Victim::Evict(slot, old) => (slot, old),
        };
        self.stats.evicted += 1;
        if let Some(n) = self.log_evicted.note(now) {
            log::info!(
                "http: closed the oldest idle connection from {old} for one from {peer}: {why} ({}){}",
                if mine {
                    self.cfg.max_per_peer
                } else {
                    self.cfg.max_connections
                },
                suppressed(n)
            );
        }
        self.close(slot);
        true
    }

    /// Which connection among those `eligible` (and not mid-response) makes room: the
    /// oldest idle keep-alive connection (answered before, nothing sent since), else the
    /// oldest that never completed a head (silent, or part way). Each socket is read first,
    /// and a connection whose request has arrived is answered now, before anything is
    /// chosen (at most [`ANSWERS_PER_PASS`] of them): a probe accepted in a churner's batch
    /// gets its answer instead of being taken for idle, and a churner's pipelined requests
    /// cannot shield its connections. Only past that budget is the oldest connection with a
    /// request waiting chosen.
    fn pick_victim(
        &mut self,
        eligible: impl Fn(&HttpConn) -> bool,
        now: Duration,
        source: &dyn OpsSource,
    ) -> Victim {
        let max = self.cfg.max_header_bytes;
        let whole_head = |c: &HttpConn| c.input.windows(4).any(|w| w == b"\r\n\r\n");
        let mut candidates: Vec<(u8, Duration, usize)> = self
            .conns
            .iter()
            .filter(|(_, c)| eligible(c) && c.output.is_empty())
            .map(|(slot, c)| {
                (
                    u8::from(c.served == 0 || !c.input.is_empty()),
                    c.since,
                    slot,
                )
            })
            .collect();
        candidates.sort_unstable();
        let mut budget = ANSWERS_PER_PASS;
        let mut waiting: Option<(Duration, usize)> = None;
        for (_, since, slot) in candidates {
            let Some(c) = self.conns.get_mut(slot) else {
                continue;
            };
            let io = if whole_head(c) || c.input.len() > max {
                Io::Ready
            } else {
                c.read_input(&mut self.scratch, max)
            };
            match io {
                Io::Blocked => return Victim::Evict(slot, c.peer),
                // Closed by its peer: that is the room.
                Io::Gone => {
                    self.close(slot);
                    return Victim::RoomMade;
                }
                Io::Ready if budget > 0 => {
                    self.answer_now(slot, now, source, &mut budget);
                    match self.conns.get(slot) {
                        // Answered and closed (`Connection: close`, or its peer left).
                        None => return Victim::RoomMade,
                        // Answered, nothing more to do: idle now, nothing is lost.
                        Some(c) if c.output.is_empty() && !whole_head(c) => {
                            return Victim::Evict(slot, c.peer);
                        }
                        // Mid-response, or part of a head: its pass goes on with it.
                        Some(_) => self.enqueue(slot),
                    }
                }
                Io::Ready => {
                    self.enqueue(slot);
                    if waiting.is_none_or(|(t, _)| since < t) {
                        waiting = Some((since, slot));
                    }
                }
            }
        }
        match waiting.and_then(|(_, slot)| Some((slot, self.conns.get(slot)?.peer))) {
            Some((slot, peer)) => Victim::Evict(slot, peer),
            None => Victim::None,
        }
    }

    /// One turn of `slot` outside the pass (see [`HttpServer::pick_victim`]).
    fn answer_now(
        &mut self,
        slot: usize,
        now: Duration,
        source: &dyn OpsSource,
        budget: &mut usize,
    ) {
        let cache = std::mem::take(&mut self.cache);
        let cached = Cached {
            inner: source,
            cache: &cache,
        };
        let _ = self.drive(slot, now, &cached, budget);
        self.cache = cache;
    }

    /// One connection over the cap with no idle one to evict: `503` (best effort, never
    /// blocking) and closed.
    fn refuse_connection(&mut self, mut stream: TcpStream, peer: SocketAddr, now: Duration) {
        self.stats.refused += 1;
        let retry = [("Retry-After", "1")];
        let r = response(503, TEXT, b"too many connections\n", &retry, true, false);
        // A TLS client cannot read a plain answer before its handshake: it sees the
        // connection closed (counted in `refused`).
        if self.tls.is_none() {
            let _ = stream.write(&r.bytes);
        }
        if let Some(n) = self.log_refused.note(now) {
            log::info!(
                "http: refused connection from {peer}: too many connections ({}), none idle{}",
                self.cfg.max_connections,
                suppressed(n)
            );
        }
    }

    /// Registers an accepted connection in a free slot of the band.
    fn admit(&mut self, stream: TcpStream, peer: SocketAddr, now: Duration) {
        let entry = self.conns.vacant_entry();
        let slot = entry.key();
        debug_assert!(slot < self.cfg.max_connections, "slot beyond the cap");
        let Some(registry) = &self.registry else {
            return;
        };
        let mut stream = match Transport::accept(stream, self.tls.as_ref()) {
            Ok(t) => t,
            Err(e) => {
                log::warn!("http: cannot start TLS for the connection from {peer}: {e}");
                return;
            }
        };
        let interest = Interest::READABLE | Interest::WRITABLE;
        if let Err(e) = registry.register(stream.tcp_mut(), HTTP_CONNS.token(slot), interest) {
            log::warn!("http: cannot register connection from {peer}: {e}");
            return;
        }
        log::debug!("http: connection from {peer}");
        entry.insert(HttpConn {
            stream,
            peer,
            input: Vec::new(),
            output: Vec::new(),
            written: 0,
            served: 0,
            since: now,
            closing: false,
            queued: false,
        });
        // Data may have arrived before registration (edge-triggered): look once.
        self.enqueue(slot);
        let due = now + self.cfg.head_timeout.min(self.cfg.idle_timeout);
        self.next_sweep = Some(self.next_sweep.map_or(due, |t| t.min(due)));
    }

    fn close(&mut self, slot: usize) {
        if !self.conns.contains(slot) {
            return;
        }
        let mut conn = self.conns.remove(slot);
        if let Some(registry) = &self.registry {
            let _ = registry.deregister(conn.stream.tcp_mut());
        }
        log::debug!("http: connection from {} closed", conn.peer);
    }

    /// One turn of a connection: writes pending output, answers at most one complete
    /// request (from the pass's `budget`), reads more; until the socket would block, the
    /// connection closes, or its turn is over (it has more to do: [`Turn::More`]).
    fn drive(
        &mut self,
        slot: usize,
        now: Duration,
        source: &dyn OpsSource,
        budget: &mut usize,
    ) -> Turn {
        let mut answered = false;
        loop {
            let Some(conn) = self.conns.get_mut(slot) else {
                return Turn::Wait;
            };
            // 1. Output first: the next request is read only once this one is written.
            match conn.write_output(now) {
                Io::Ready => {}
                Io::Blocked => return Turn::Wait,
                Io::Gone => {
                    self.close(slot);
                    return Turn::Wait;
                }
            }
            if conn.closing {
                conn.stream.shutdown_write();
                self.close(slot);
                return Turn::Wait;
            }
            // 2. A complete request in the input: answer it.
            match parse_request(&conn.input, self.cfg.max_header_bytes) {
                Parsed::Request(_) if answered || *budget == 0 => return Turn::More,
                Parsed::Request(req) => {
                    answered = true;
                    *budget -= 1;
                    self.answer(slot, &req, source, now);
                    continue;
                }
                Parsed::Bad(status, why) => {
                    self.answer_bad(slot, status, why);
                    continue;
                }
                Parsed::Incomplete if answered => return Turn::More,
                Parsed::Incomplete => {}
            }
            // 3. Read more.
            match conn.read_input(&mut self.scratch, self.cfg.max_header_bytes) {
                Io::Ready => {}
                Io::Blocked => return Turn::Wait,
                Io::Gone => {
                    self.close(slot);
                    return Turn::Wait;
                }
            }
        }
    }

    /// Answers a complete request and queues the response; counts it.
    fn answer(&mut self, slot: usize, req: &Request, source: &dyn OpsSource, now: Duration) {
        let Some(conn) = self.conns.get_mut(slot) else {
            return;
        };
        conn.input.drain(..req.len);
        conn.served += 1;
        let last = conn.served >= self.cfg.max_requests;
        let r = respond(req, self.token.as_ref(), source, last);
        self.stats.requests += 1;
        match r.status {
            401 => {
                self.stats.unauthorized += 1;
                if let Some(n) = self.log_unauthorized.note(now) {
                    log::info!(
                        "http: unauthorized request for {} from {}{}",
                        req.path,
                        conn.peer,
                        suppressed(n)
                    );
                }
            }
            400 | 404 | 405 | 431 => self.stats.bad_requests += 1,
            _ => {}
        }
        conn.closing = r.close;
        conn.output = r.bytes;
    }

    /// Answers a malformed or unacceptable request, then closes once it is written.
    fn answer_bad(&mut self, slot: usize, status: u16, why: &str) {
        let Some(conn) = self.conns.get_mut(slot) else {
            return;
        };
        self.stats.requests += 1;
        self.stats.bad_requests += 1;
        let body = format!("{why}\n");
        conn.input.clear();
        conn.closing = true;
        conn.output = response(status, TEXT, body.as_bytes(), &[], true, false).bytes;
    }
}

#[cfg(test)]
mod tests;
