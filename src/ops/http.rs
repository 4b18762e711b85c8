//! The operations HTTP endpoint: a small HTTP/1.1 server hosted on the reactor.
//!
//! Two halves, like the bridge server: [`parse_request`] and [`respond`] are sans-IO (bytes in,
//! a response out), and [`HttpServer`] is the mio shell that accepts, reads and writes on the
//! reactor thread without blocking. Requests are parsed by `httparse`; only `GET` and `HEAD`
//! without a body are served. Every resource is bounded (see [`HttpConfig`]).

use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

use mio::event::Event;
use mio::net::{TcpListener, TcpStream};
use mio::{Interest, Registry, Token};
use slab::Slab;

use crate::liveness::HttpStatus;
use crate::server::auth::Token as AuthToken;
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
/// Most connections the endpoint may be configured with (their tokens are a fixed band).
pub(crate) const MAX_CONNECTIONS_LIMIT: usize = crate::tokens::HTTP_MAX_CONNECTIONS;
/// Headers parsed per request; more is `431`.
const MAX_HEADERS: usize = 32;
/// Requests answered per connection per wake; the rest wait for the next wake.
const REQUESTS_PER_WAKE: usize = 4;
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
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            auth_token: None,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_header_bytes: DEFAULT_MAX_HEADER_BYTES,
            max_requests: DEFAULT_MAX_REQUESTS,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
        }
    }
}

/// A parsed request: what routing needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Request {
    /// `GET`, `HEAD`, …
    pub method: String,
    /// The path without its query.
    pub path: String,
    /// The bearer token of the `Authorization` header, if any.
    pub bearer: Option<String>,
    /// The client asked to close after this response (or speaks HTTP/1.0).
    pub close: bool,
    /// Bytes of the buffer the request took.
    pub len: usize,
}

/// The outcome of parsing the start of a connection's input.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Parsed {
    /// More bytes are needed.
    Incomplete,
    /// A complete request.
    Request(Request),
    /// A malformed or unacceptable request: answer with this status and close.
    Bad(u16, &'static str),
}

/// Parses one request head from `buf` (at most `max_head` bytes of it count).
pub(crate) fn parse_request(buf: &[u8], max_head: usize) -> Parsed {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let len = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) if n <= max_head => n,
        Ok(httparse::Status::Complete(_)) => return Parsed::Bad(431, "request head too large"),
        Ok(httparse::Status::Partial) if buf.len() >= max_head => {
            return Parsed::Bad(431, "request head too large");
        }
        Ok(httparse::Status::Partial) => return Parsed::Incomplete,
        Err(httparse::Error::TooManyHeaders) => return Parsed::Bad(431, "too many headers"),
        Err(_) => return Parsed::Bad(400, "malformed request"),
    };
    let (Some(method), Some(target), Some(version)) = (req.method, req.path, req.version) else {
        return Parsed::Bad(400, "malformed request");
    };
    let mut bearer = None;
    let mut close = version == 0;
    for h in req.headers.iter() {
        let name = h.name.to_ascii_lowercase();
        let value = String::from_utf8_lossy(h.value);
        match name.as_str() {
            "content-length" if value.trim() != "0" => {
                return Parsed::Bad(400, "request bodies are not accepted");
            }
            "transfer-encoding" => return Parsed::Bad(400, "request bodies are not accepted"),
            "connection" => {
                let v = value.to_ascii_lowercase();
                if v.split(',').any(|t| t.trim() == "close") {
                    close = true;
                } else if v.split(',').any(|t| t.trim() == "keep-alive") {
                    close = false;
                }
            }
            "authorization" => {
                let v = value.trim();
                if v.len() > 7 && v[..7].eq_ignore_ascii_case("bearer ") {
                    bearer = Some(v[7..].trim().to_owned());
                }
            }
            _ => {}
        }
    }
    let path = target.split('?').next().unwrap_or("").to_owned();
    Parsed::Request(Request {
        method: method.to_owned(),
        path,
        bearer,
        close,
        len,
    })
}

/// What the endpoint serves; implemented over the reactor's latest snapshot.
pub(crate) trait OpsSource {
    /// `Ok` while the gateway is live, else why not (`/healthz`).
    fn health(&self) -> Result<(), String>;
    /// `Ok` while the gateway takes traffic, else why not (`/readyz`).
    fn ready(&self) -> Result<(), String>;
    /// The status document (`/status`).
    fn status_json(&self) -> Vec<u8>;
    /// The Prometheus exposition (`/metrics`).
    fn metrics(&self) -> String;
}

/// A response, ready to write.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Response {
    /// The status code.
    pub status: u16,
    /// The bytes to write (head and body).
    pub bytes: Vec<u8>,
    /// Close the connection once written.
    pub close: bool,
}

fn reason_phrase(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "Error",
    }
}

/// A response's bytes; `head_only` leaves the body out (a `HEAD` request).
pub(crate) fn response(
    status: u16,
    content_type: &str,
    body: &[u8],
    extra: &[(&str, &str)],
    close: bool,
    head_only: bool,
) -> Response {
    let mut bytes = Vec::with_capacity(160 + body.len());
    let _ = write!(
        bytes,
        "HTTP/1.1 {status} {}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nCache-Control: no-store\r\n",
        reason_phrase(status),
        body.len()
    );
    for (name, value) in extra {
        let _ = write!(bytes, "{name}: {value}\r\n");
    }
    bytes.extend_from_slice(if close {
        b"Connection: close\r\n\r\n"
    } else {
        b"Connection: keep-alive\r\n\r\n"
    });
    if !head_only {
        bytes.extend_from_slice(body);
    }
    Response {
        status,
        bytes,
        close,
    }
}

const TEXT: &str = "text/plain; charset=utf-8";
const JSON: &str = "application/json";
/// The Prometheus text exposition format's content type.
pub(crate) const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Answers one request. `token` is the configured auth token; `close` forces
/// `Connection: close` (the connection's last request).
pub(crate) fn respond(
    req: &Request,
    token: Option<&AuthToken>,
    source: &dyn OpsSource,
    close: bool,
) -> Response {
    let close = close || req.close;
    let head = req.method == "HEAD";
    if let Some(refusal) = refuse(req, token, close, head) {
        return refusal;
    }
    let probe = |r: Result<(), String>| match r {
        Ok(()) => response(200, TEXT, b"ok\n", &[], close, head),
        Err(why) => response(503, TEXT, format!("{why}\n").as_bytes(), &[], close, head),
    };
    match req.path.as_str() {
        "/healthz" => probe(source.health()),
        "/readyz" => probe(source.ready()),
        "/status" => response(200, JSON, &source.status_json(), &[], close, head),
        _ => response(
            200,
            METRICS_CONTENT_TYPE,
            source.metrics().as_bytes(),
            &[],
            close,
            head,
        ),
    }
}

/// The answer to a request the endpoint does not serve: an unknown path (`404`), a method
/// other than `GET` or `HEAD` (`405`), a missing or wrong bearer token (`401`, every path but
/// `/healthz`).
fn refuse(req: &Request, token: Option<&AuthToken>, close: bool, head: bool) -> Option<Response> {
    let known = matches!(
        req.path.as_str(),
        "/healthz" | "/readyz" | "/status" | "/metrics"
    );
    if !known {
        return Some(response(404, TEXT, b"not found\n", &[], close, head));
    }
    if req.method != "GET" && !head {
        let allow = [("Allow", "GET, HEAD")];
        return Some(response(
            405,
            TEXT,
            b"method not allowed\n",
            &allow,
            close,
            head,
        ));
    }
    let authorized = |t: &AuthToken| req.bearer.as_deref().is_some_and(|b| t.matches(b));
    if req.path != "/healthz" && token.is_some_and(|t| !authorized(t)) {
        let challenge = [("WWW-Authenticate", "Bearer")];
        return Some(response(
            401,
            TEXT,
            b"unauthorized\n",
            &challenge,
            close,
            head,
        ));
    }
    None
}

struct HttpConn {
    stream: TcpStream,
    peer: SocketAddr,
    input: Vec<u8>,
    output: Vec<u8>,
    written: usize,
    served: usize,
    /// When the current request's time started (opening or last response).
    since: Duration,
    /// Close once the output is written.
    closing: bool,
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
    registry: Option<Registry>,
    conns: Slab<HttpConn>,
    /// Connections with requests left unanswered at the per-wake budget.
    pending: Vec<usize>,
    /// The accept batch ran out with connections perhaps still queued.
    accept_more: bool,
    next_sweep: Option<Duration>,
    stats: HttpStatus,
    scratch: Vec<u8>,
}

impl HttpServer {
    /// Binds `addr` (non-blocking). The connection cap is clamped to
    /// [`MAX_CONNECTIONS_LIMIT`].
    pub(crate) fn bind(addr: SocketAddr, mut cfg: HttpConfig) -> io::Result<HttpServer> {
        cfg.max_connections = cfg.max_connections.clamp(1, MAX_CONNECTIONS_LIMIT);
        let listener = TcpListener::bind(addr)?;
        Ok(HttpServer {
            token: cfg.auth_token.as_deref().map(AuthToken::new),
            stats: HttpStatus {
                max_connections: cfg.max_connections,
                max_header_bytes: cfg.max_header_bytes,
                max_requests: cfg.max_requests,
                idle_timeout_s: cfg.idle_timeout.as_secs_f64(),
                ..HttpStatus::default()
            },
            cfg,
            listener,
            registry: None,
            conns: Slab::new(),
            pending: Vec::new(),
            accept_more: false,
            next_sweep: None,
            scratch: vec![0; 4096],
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

    /// The endpoint's figures.
    pub(crate) fn status(&self) -> HttpStatus {
        HttpStatus {
            connections: self.conns.len(),
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
    pub(crate) fn on_ready(&mut self, event: &Event, now: Duration, source: &dyn OpsSource) {
        if event.token() == LISTENER {
            self.accept(now);
            return;
        }
        if let Some(slot) = HTTP_CONNS.slot(event.token()) {
            self.drive(slot, now, source);
        }
        #[cfg(debug_assertions)]
        self.check();
    }

    /// Serves what the budget left, closes idle connections; returns when it next needs the
    /// loop.
    pub(crate) fn on_wake(&mut self, now: Duration, source: &dyn OpsSource) -> Option<Duration> {
        if std::mem::take(&mut self.accept_more) {
            self.accept(now);
        }
        for slot in std::mem::take(&mut self.pending) {
            self.drive(slot, now, source);
        }
        if self.next_sweep.is_some_and(|t| t <= now) {
            let idle = self.cfg.idle_timeout;
            let expired: Vec<usize> = self
                .conns
                .iter()
                .filter(|(_, c)| now.saturating_sub(c.since) >= idle)
                .map(|(slot, _)| slot)
                .collect();
            for slot in expired {
                self.stats.idle_closed += 1;
                self.close(slot);
            }
            self.next_sweep = self.conns.iter().map(|(_, c)| c.since + idle).min();
        }
        #[cfg(debug_assertions)]
        self.check();
        if self.pending.is_empty() && !self.accept_more {
            self.next_sweep
        } else {
            Some(now)
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
            self.pending.iter().all(|&slot| slot < cap),
            "a pending slot outside the band"
        );
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

    fn accept(&mut self, now: Duration) {
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
            if self.conns.len() >= self.cfg.max_connections {
                self.refuse_connection(stream, peer);
            } else if self.registry.is_none() {
                return;
            } else {
                self.admit(stream, peer, now);
            }
        }
        // More may wait; the listener is edge-triggered, so look again next wake.
        self.accept_more = true;
    }

    /// One connection over the cap: `503` (best effort, never blocking) and closed.
    fn refuse_connection(&mut self, mut stream: TcpStream, peer: SocketAddr) {
        self.stats.refused += 1;
        let retry = [("Retry-After", "1")];
        let r = response(503, TEXT, b"too many connections\n", &retry, true, false);
        let _ = stream.write(&r.bytes);
        log::info!(
            "http: refused connection from {peer}: too many connections ({})",
            self.cfg.max_connections
        );
    }

    /// Registers an accepted connection in a free slot of the band.
    fn admit(&mut self, mut stream: TcpStream, peer: SocketAddr, now: Duration) {
        let entry = self.conns.vacant_entry();
        let slot = entry.key();
        debug_assert!(slot < self.cfg.max_connections, "slot beyond the cap");
        let Some(registry) = &self.registry else {
            return;
        };
        let interest = Interest::READABLE | Interest::WRITABLE;
        if let Err(e) = registry.register(&mut stream, HTTP_CONNS.token(slot), interest) {
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
        });
        let due = now + self.cfg.idle_timeout;
        self.next_sweep = Some(self.next_sweep.map_or(due, |t| t.min(due)));
    }

    fn close(&mut self, slot: usize) {
        if !self.conns.contains(slot) {
            return;
        }
        let mut conn = self.conns.remove(slot);
        if let Some(registry) = &self.registry {
            let _ = registry.deregister(&mut conn.stream);
        }
        log::debug!("http: connection from {} closed", conn.peer);
    }

    /// Writes pending output, answers complete requests, reads more: until the socket
    /// would block, the connection closes, or the per-wake budget is spent.
    fn drive(&mut self, slot: usize, now: Duration, source: &dyn OpsSource) {
        let mut answered = 0;
        loop {
            let Some(conn) = self.conns.get_mut(slot) else {
                return;
            };
            // 1. Output first: the next request is read only once this one is written.
            match conn.write_output(now) {
                Io::Ready => {}
                Io::Blocked => return,
                Io::Gone => return self.close(slot),
            }
            if conn.closing {
                let _ = conn.stream.shutdown(std::net::Shutdown::Write);
                return self.close(slot);
            }
            // 2. A complete request in the input: answer it.
            match parse_request(&conn.input, self.cfg.max_header_bytes) {
                Parsed::Request(_) if answered == REQUESTS_PER_WAKE => {
                    self.pending.push(slot);
                    return;
                }
                Parsed::Request(req) => {
                    answered += 1;
                    self.answer(slot, &req, source);
                    continue;
                }
                Parsed::Bad(status, why) => {
                    self.answer_bad(slot, status, why);
                    continue;
                }
                Parsed::Incomplete => {}
            }
            // 3. Read more.
            match conn.read_input(&mut self.scratch, self.cfg.max_header_bytes) {
                Io::Ready => {}
                Io::Blocked => return,
                Io::Gone => return self.close(slot),
            }
        }
    }

    /// Answers a complete request and queues the response; counts it.
    fn answer(&mut self, slot: usize, req: &Request, source: &dyn OpsSource) {
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
                log::info!(
                    "http: unauthorized request for {} from {}",
                    req.path,
                    conn.peer
                );
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
mod tests {
    use super::*;

    struct Fixed {
        healthy: bool,
    }

    impl OpsSource for Fixed {
        fn health(&self) -> Result<(), String> {
            if self.healthy {
                Ok(())
            } else {
                Err("shutting down".into())
            }
        }
        fn ready(&self) -> Result<(), String> {
            Err("not yet".into())
        }
        fn status_json(&self) -> Vec<u8> {
            b"{\"state\":\"running\"}".to_vec()
        }
        fn metrics(&self) -> String {
            "turnstile_ticks_total 3\n".into()
        }
    }

    fn req(text: &str) -> Request {
        match parse_request(text.as_bytes(), 8192) {
            Parsed::Request(r) => r,
            other => panic!("{other:?}"),
        }
    }

    fn answer(text: &str, token: Option<&AuthToken>, healthy: bool) -> (u16, String) {
        let r = respond(&req(text), token, &Fixed { healthy }, false);
        (r.status, String::from_utf8(r.bytes).unwrap())
    }

    #[test]
    fn parses_a_get_with_query_bearer_and_connection_close() {
        let r = req(
            "GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer s3cret\r\nConnection: close\r\n\r\nGET",
        );
        assert_eq!(r.method, "GET");
        assert_eq!(r.path, "/metrics");
        assert_eq!(r.bearer.as_deref(), Some("s3cret"));
        assert!(r.close);
        assert_eq!(r.len, 87);
        assert!(!req("GET / HTTP/1.1\r\n\r\n").close);
        assert!(req("GET / HTTP/1.0\r\n\r\n").close);
        assert!(!req("GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n").close);
        assert_eq!(
            req("GET / HTTP/1.1\r\nAuthorization: Basic x\r\n\r\n").bearer,
            None
        );
    }

    #[test]
    fn incomplete_oversized_malformed_and_bodies() {
        assert_eq!(
            parse_request(b"GET / HTTP/1.1\r\n", 8192),
            Parsed::Incomplete
        );
        assert_eq!(
            parse_request(b"GET / HTTP/1.1\r\nX: aaaaaaaa", 16),
            Parsed::Bad(431, "request head too large")
        );
        assert_eq!(
            parse_request(b"GET / HTTP/1.1\r\nX: a\r\n\r\n", 20),
            Parsed::Bad(431, "request head too large")
        );
        let many: String = (0..40).map(|i| format!("H{i}: v\r\n")).collect();
        assert_eq!(
            parse_request(format!("GET / HTTP/1.1\r\n{many}\r\n").as_bytes(), 8192),
            Parsed::Bad(431, "too many headers")
        );
        assert_eq!(
            parse_request(b"GE T / HTTP/1.1\r\n\r\n", 8192),
            Parsed::Bad(400, "malformed request")
        );
        assert_eq!(
            parse_request(b"POST /x HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc", 8192),
            Parsed::Bad(400, "request bodies are not accepted")
        );
        assert_eq!(
            parse_request(
                b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
                8192
            ),
            Parsed::Bad(400, "request bodies are not accepted")
        );
        assert!(matches!(
            parse_request(b"GET /x HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 8192),
            Parsed::Request(_)
        ));
    }

    #[test]
    fn routes_methods_and_probes() {
        let (s, text) = answer("GET /healthz HTTP/1.1\r\n\r\n", None, true);
        assert_eq!(s, 200);
        assert!(text.ends_with("\r\n\r\nok\n"), "{text}");
        assert!(text.contains("Content-Length: 3\r\n"), "{text}");
        assert!(text.contains("Connection: keep-alive\r\n"), "{text}");
        let (s, text) = answer("GET /healthz HTTP/1.1\r\n\r\n", None, false);
        assert_eq!(s, 503);
        assert!(text.ends_with("shutting down\n"), "{text}");
        assert_eq!(answer("GET /readyz HTTP/1.1\r\n\r\n", None, true).0, 503);
        let (s, text) = answer("GET /status HTTP/1.1\r\n\r\n", None, true);
        assert_eq!(s, 200);
        assert!(
            text.contains("application/json") && text.ends_with("}"),
            "{text}"
        );
        let (s, text) = answer("GET /metrics HTTP/1.1\r\n\r\n", None, true);
        assert_eq!(s, 200);
        assert!(text.contains("version=0.0.4"), "{text}");
        assert!(text.ends_with("turnstile_ticks_total 3\n"), "{text}");
        assert_eq!(answer("GET /nope HTTP/1.1\r\n\r\n", None, true).0, 404);
        let (s, text) = answer("DELETE /status HTTP/1.1\r\n\r\n", None, true);
        assert_eq!(s, 405);
        assert!(text.contains("Allow: GET, HEAD\r\n"), "{text}");
        let (s, text) = answer("HEAD /healthz HTTP/1.1\r\n\r\n", None, true);
        assert_eq!(s, 200);
        assert!(
            text.ends_with("\r\n\r\n") && text.contains("Content-Length: 3"),
            "{text}"
        );
        let r = respond(
            &req("GET /healthz HTTP/1.1\r\n\r\n"),
            None,
            &Fixed { healthy: true },
            true,
        );
        assert!(r.close);
        assert!(
            String::from_utf8(r.bytes)
                .unwrap()
                .contains("Connection: close")
        );
    }

    #[test]
    fn the_token_guards_everything_but_healthz() {
        let t = AuthToken::new("s3cret");
        assert_eq!(
            answer("GET /healthz HTTP/1.1\r\n\r\n", Some(&t), true).0,
            200
        );
        for path in ["/readyz", "/status", "/metrics"] {
            let (s, text) = answer(&format!("GET {path} HTTP/1.1\r\n\r\n"), Some(&t), true);
            assert_eq!(s, 401, "{path}");
            assert!(text.contains("WWW-Authenticate: Bearer"), "{text}");
            let wrong = format!("GET {path} HTTP/1.1\r\nAuthorization: Bearer nope\r\n\r\n");
            assert_eq!(answer(&wrong, Some(&t), true).0, 401, "{path}");
            let right = format!("GET {path} HTTP/1.1\r\nAuthorization: bearer s3cret\r\n\r\n");
            assert_ne!(answer(&right, Some(&t), true).0, 401, "{path}");
        }
        assert!(owns(LISTENER));
        assert!(owns(HTTP_CONNS.token(0)));
        assert!(owns(HTTP_CONNS.token(MAX_CONNECTIONS_LIMIT - 1)));
        assert!(!owns(Token(
            HTTP_CONNS.token(MAX_CONNECTIONS_LIMIT - 1).0 - 1
        )));
        assert!(!owns(crate::tokens::JOURNAL));
        assert!(!owns(Token(LISTENER.0 + 1)));
    }

    #[test]
    #[cfg(debug_assertions)]
    fn the_endpoint_keeps_its_invariants_through_accept_and_requests() {
        let mut poll = mio::Poll::new().unwrap();
        let cfg = HttpConfig {
            max_connections: 2,
            ..HttpConfig::default()
        };
        let mut server = HttpServer::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap();
        server.register(poll.registry()).unwrap();
        server.check();
        let addr = server.local_addr().unwrap();
        let mut clients: Vec<std::net::TcpStream> = (0..3)
            .map(|_| std::net::TcpStream::connect(addr).unwrap())
            .collect();
        clients[0]
            .write_all(b"GET /healthz HTTP/1.1\r\n\r\nGET /nope HTTP/1.1\r\n\r\n")
            .unwrap();
        let source = Fixed { healthy: true };
        let mut events = mio::Events::with_capacity(16);
        let now = Duration::from_secs(1);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while server.stats.requests < 2 || server.stats.refused < 1 {
            assert!(std::time::Instant::now() < deadline, "{:?}", server.stats);
            poll.poll(&mut events, Some(Duration::from_millis(50)))
                .unwrap();
            for event in &events {
                server.on_ready(event, now, &source);
            }
            server.on_wake(now, &source);
        }
        assert_eq!(server.status().connections, 2);
        assert_eq!(server.stats.bad_requests, 1);
        server.close_all();
        server.check();
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "more refused requests than requests")]
    fn the_check_catches_counts_that_do_not_add_up() {
        let mut server =
            HttpServer::bind("127.0.0.1:0".parse().unwrap(), HttpConfig::default()).unwrap();
        server.stats.unauthorized = 1;
        server.check();
    }
}
