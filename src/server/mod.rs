//! The gateway server: the bridge protocol over TCP, hosted on the reactor as a
//! [`Frontend`]. Sockets are non-blocking and owned by the reactor thread; signals arrive
//! through `signal-hook-mio` on the same poll.
//!
//! Delivery rules: a terminal event goes to the connection that sent the message; if it has
//! gone, to the newest connection that said hello for the message's platform; if none, to
//! that platform's outbox, delivered in order on the next hello. Nothing accepted is lost
//! while the process lives.

mod conn;
mod dedup;
pub mod protocol;

use std::collections::{HashMap, VecDeque};
use std::io::{self, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use mio::event::Event;
use mio::net::TcpListener;
use mio::{Events as MioEvents, Interest, Poll, Registry, Token};
use slab::Slab;

use crate::core::{AcceptState, EventKind, MessageEvent, Outcome, TurnId};
use crate::message::{Message, SessionKey};
use crate::reactor::{Ctx, FIRST_RESERVED_TOKEN, Frontend};
use conn::{Conn, Frame, Line, ReadOutcome};
use dedup::{DedupWindow, Fingerprint};
use protocol::{ClientOp, LineError, MessageFields, ServerOp, encode, parse_line};

const LISTENER: Token = Token(FIRST_RESERVED_TOKEN - 1);
const SIGNALS: Token = Token(FIRST_RESERVED_TOKEN - 2);

/// Bytes read from one connection per loop iteration, so one flood cannot starve the rest.
const READ_BUDGET: usize = 256 * 1024;

/// Settings of the bridge server.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Required in a client's hello when set.
    pub auth_token: Option<String>,
    /// Connections beyond this get an error line and are closed.
    pub max_connections: usize,
    /// Longest accepted line.
    pub max_line_bytes: usize,
    /// Unwritten output past which a connection is closed (its terminal events go to the outbox).
    pub max_write_buffer: usize,
    /// Terminal events a platform's outbox holds before new messages are refused.
    pub outbox_cap: usize,
    /// How long an accepted (platform, id) is remembered for duplicate detection.
    pub dedup_window: Duration,
    /// Most (platform, id) pairs remembered; the oldest are forgotten early beyond it.
    pub dedup_max: usize,
    /// Typing refresh period while a turn runs.
    pub typing_refresh: Duration,
    /// Time allowed to flush output to clients after shutdown.
    pub flush_budget: Duration,
    /// Exit with code 1 if shutdown has not finished this long after the first signal.
    pub watchdog: Duration,
    /// Handle SIGTERM and SIGINT.
    pub handle_signals: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            auth_token: None,
            max_connections: 1024,
            max_line_bytes: 65_536,
            max_write_buffer: 8 << 20,
            outbox_cap: 10_000,
            dedup_window: Duration::from_secs(600),
            dedup_max: 1_000_000,
            typing_refresh: Duration::from_secs(4),
            flush_budget: Duration::from_secs(5),
            watchdog: Duration::from_secs(120),
            handle_signals: true,
        }
    }
}

/// Where a submitted message's events go.
struct MsgRoute {
    conn: u64,
    platform: Arc<str>,
    dedup_key: Fingerprint,
}

struct Typing {
    conn: u64,
    session: SessionKey,
    next: Duration,
}

/// The TCP bridge server.
pub struct BridgeServer {
    cfg: ServerConfig,
    listener: TcpListener,
    /// A handle on the reactor's poll registry, for sockets accepted later.
    registry: Option<Registry>,
    signals: Option<signal_hook_mio::v1_0::Signals>,
    signals_seen: usize,
    watchdog: Option<Sender<()>>,
    conns: Slab<Conn>,
    by_uid: HashMap<u64, usize>,
    next_uid: u64,
    /// Connections that said hello, per platform, oldest first.
    hellos: HashMap<Arc<str>, Vec<u64>>,
    outboxes: HashMap<Arc<str>, VecDeque<Vec<u8>>>,
    routes: HashMap<u64, MsgRoute>,
    next_tag: u64,
    dedup: DedupWindow,
    typing: HashMap<TurnId, Typing>,
    pending_reads: Vec<usize>,
    dirty: Vec<usize>,
    now: Duration,
    lines: Vec<Line>,
}

impl BridgeServer {
    /// Binds `addr` (non-blocking). Logs a WARN for a non-loopback address without a token.
    pub fn bind(addr: SocketAddr, cfg: ServerConfig) -> io::Result<BridgeServer> {
        let listener = TcpListener::bind(addr)?;
        if !addr.ip().is_loopback() && cfg.auth_token.is_none() {
            log::warn!(
                "listening on non-loopback {addr} without an auth token: anyone who can reach it can talk to the agent"
            );
        }
        let signals = if cfg.handle_signals {
            Some(signal_hook_mio::v1_0::Signals::new([
                libc::SIGTERM,
                libc::SIGINT,
            ])?)
        } else {
            None
        };
        Ok(BridgeServer {
            dedup: DedupWindow::new(cfg.dedup_window, cfg.dedup_max),
            cfg,
            listener,
            registry: None,
            signals,
            signals_seen: 0,
            watchdog: None,
            conns: Slab::new(),
            by_uid: HashMap::new(),
            next_uid: 0,
            hellos: HashMap::new(),
            outboxes: HashMap::new(),
            routes: HashMap::new(),
            next_tag: 0,
            typing: HashMap::new(),
            pending_reads: Vec::new(),
            dirty: Vec::new(),
            now: Duration::ZERO,
            lines: Vec::new(),
        })
    }

    /// The bound address (useful with port 0).
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    fn accept(&mut self) {
        let Some(registry) = self.registry.as_ref() else {
            return;
        };
        loop {
            let (mut stream, peer) = match self.listener.accept() {
                Ok(s) => s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // EMFILE and friends: the pending connection stays queued; try next wake.
                    log::error!("accept failed: {e}");
                    return;
                }
            };
            if self.conns.len() >= self.cfg.max_connections {
                let line = encode(&ServerOp::Error {
                    detail: "too many connections",
                });
                let _ = stream.write(&line);
                log::warn!(
                    "refused connection from {peer}: {} connections open",
                    self.conns.len()
                );
                continue;
            }
            let _ = stream.set_nodelay(true);
            self.next_uid += 1;
            let uid = self.next_uid;
            let entry = self.conns.vacant_entry();
            let slot = entry.key();
            if let Err(e) = registry.register(
                &mut stream,
                Token(slot),
                Interest::READABLE | Interest::WRITABLE,
            ) {
                log::error!("cannot register connection from {peer}: {e}");
                continue;
            }
            entry.insert(Conn::new(uid, stream, self.cfg.auth_token.is_none()));
            self.by_uid.insert(uid, slot);
            log::debug!("connection {uid} from {peer}");
        }
    }

    fn read(&mut self, slot: usize, ctx: &mut Ctx<'_>) {
        let mut lines = std::mem::take(&mut self.lines);
        let outcome = match self.conns.get_mut(slot) {
            Some(conn) => conn.read_lines(READ_BUDGET, self.cfg.max_line_bytes, &mut lines),
            None => return,
        };
        for line in lines.drain(..) {
            if !self.conns.contains(slot) {
                break;
            }
            match line {
                Line::Complete(bytes) => self.handle_line(slot, &bytes, ctx),
                Line::TooLong => {
                    let detail = format!(
                        "line longer than {} bytes; discarded",
                        self.cfg.max_line_bytes
                    );
                    self.send(slot, encode(&ServerOp::Error { detail: &detail }), None);
                }
            }
        }
        self.lines = lines;
        match outcome {
            ReadOutcome::Drained => {}
            ReadOutcome::MoreLater => self.pending_reads.push(slot),
            ReadOutcome::Closed => self.close(slot, "peer closed"),
        }
    }

    fn handle_line(&mut self, slot: usize, line: &[u8], ctx: &mut Ctx<'_>) {
        let parsed = parse_line(line);
        let authed = self.conns.get(slot).is_some_and(|c| c.authed);
        if !authed {
            // With a token configured the first line must be a hello carrying it.
            let ok = matches!(&parsed, Ok(ClientOp::Hello { token: Some(t), .. })
                if self.cfg.auth_token.as_deref().is_some_and(|want| constant_time_eq(t.as_bytes(), want.as_bytes())));
            if !ok {
                self.send(
                    slot,
                    encode(&ServerOp::Error {
                        detail: "unauthorized",
                    }),
                    None,
                );
                if let Some(c) = self.conns.get_mut(slot) {
                    c.close_after_flush = true;
                }
                log::warn!(
                    "connection {}: unauthorized; closing",
                    self.conns.get(slot).map_or(0, |c| c.uid)
                );
                return;
            }
        }
        match parsed {
            Ok(ClientOp::Ping) => {
                self.send(slot, encode(&ServerOp::Pong), None);
            }
            Ok(ClientOp::Hello { platform, .. }) => self.hello(slot, platform),
            Ok(ClientOp::Message(m)) => self.message(slot, m, ctx),
            Err(LineError::Malformed(detail)) => {
                self.send(slot, encode(&ServerOp::Error { detail: &detail }), None);
            }
            Err(LineError::Invalid { id, detail }) => {
                self.reject(slot, &id, None, "invalid", &detail)
            }
        }
    }

    fn hello(&mut self, slot: usize, platform: Option<String>) {
        let Some(conn) = self.conns.get_mut(slot) else {
            return;
        };
        conn.authed = true;
        let uid = conn.uid;
        if let Some(old) = conn.platform.take()
            && let Some(list) = self.hellos.get_mut(&old)
        {
            list.retain(|&u| u != uid);
        }
        let Some(platform) = platform else { return };
        let platform: Arc<str> = platform.into();
        if let Some(conn) = self.conns.get_mut(slot) {
            conn.platform = Some(platform.clone());
        }
        self.hellos.entry(platform.clone()).or_default().push(uid);
        self.refill(slot);
    }

    /// Feeds a platform's outbox, in order, to its newest hello connection, keeping that
    /// connection's unwritten output under half its cap so a large backlog flows at the
    /// client's pace instead of overflowing it.
    fn refill(&mut self, slot: usize) {
        let Some(platform) = self.conns.get(slot).and_then(|c| c.platform.clone()) else {
            return;
        };
        if self.newest_hello(&platform) != Some(slot) {
            return;
        }
        let Some(outbox) = self.outboxes.get_mut(&platform) else {
            return;
        };
        let Some(conn) = self.conns.get_mut(slot) else {
            return;
        };
        let budget = self.cfg.max_write_buffer / 2;
        let was_idle = !conn.has_output();
        while conn.queued_bytes() < budget {
            let Some(bytes) = outbox.pop_front() else {
                break;
            };
            conn.push(
                Frame {
                    bytes,
                    terminal_for: Some(platform.clone()),
                },
                usize::MAX,
            );
        }
        if outbox.is_empty() {
            self.outboxes.remove(&platform);
        }
        if was_idle && conn.has_output() {
            self.dirty.push(slot);
        }
    }

    fn message(&mut self, slot: usize, m: MessageFields, ctx: &mut Ctx<'_>) {
        let Some(conn) = self.conns.get(slot) else {
            return;
        };
        let uid = conn.uid;
        let platform: Arc<str> = match (m.platform, &conn.platform) {
            (Some(p), _) => p.into(),
            (None, Some(p)) => p.clone(),
            (None, None) => {
                return self.reject(
                    slot,
                    &m.id,
                    None,
                    "invalid",
                    "platform is required (no hello named one)",
                );
            }
        };
        let key = match SessionKey::new(
            &platform,
            m.chat_type,
            &m.chat_id,
            m.thread_id.as_deref(),
            m.user_id.as_deref(),
        ) {
            Ok(k) => k,
            Err(e) => return self.reject(slot, &m.id, None, "invalid", &e.to_string()),
        };
        let message = match Message::new(&m.id, key.clone(), &m.text) {
            Ok(msg) => msg,
            Err(e) => {
                return self.reject(slot, &m.id, Some(key.as_str()), "invalid", &e.to_string());
            }
        };
        let dedup_key = self.dedup.fingerprint(&platform, &message.id);
        if self.dedup.seen(dedup_key, self.now) {
            let ack = ServerOp::Ack {
                id: &m.id,
                session: key.as_str(),
                state: "duplicate",
                position: None,
            };
            self.send(slot, encode(&ack), None);
            return;
        }
        if self
            .outboxes
            .get(&platform)
            .is_some_and(|o| o.len() >= self.cfg.outbox_cap)
        {
            let detail = format!("outbox for {platform} is full; deliver pending replies first");
            return self.reject(slot, &m.id, Some(key.as_str()), "backpressure", &detail);
        }
        self.dedup.remember(dedup_key, self.now);
        self.next_tag += 1;
        self.routes.insert(
            self.next_tag,
            MsgRoute {
                conn: uid,
                platform,
                dedup_key,
            },
        );
        ctx.submit(message, self.next_tag);
    }

    fn reject(&mut self, slot: usize, id: &str, session: Option<&str>, reason: &str, detail: &str) {
        self.send(
            slot,
            encode(&ServerOp::Reject {
                id,
                session,
                reason,
                detail,
            }),
            None,
        );
    }

    /// Queues a line on a connection. Returns false if the connection was closed because its
    /// write buffer overflowed (terminal lines then went to the outbox).
    fn send(&mut self, slot: usize, bytes: Vec<u8>, terminal_for: Option<Arc<str>>) -> bool {
        let Some(conn) = self.conns.get_mut(slot) else {
            return false;
        };
        let was_idle = !conn.has_output();
        if !conn.push(
            Frame {
                bytes,
                terminal_for,
            },
            self.cfg.max_write_buffer,
        ) {
            log::warn!(
                "connection {}: write buffer over {} bytes; closing (the client stopped reading)",
                conn.uid,
                self.cfg.max_write_buffer
            );
            self.close(slot, "write buffer overflow");
            return false;
        }
        if was_idle {
            self.dirty.push(slot);
        }
        true
    }

    /// Sends a terminal line to the message's connection, else the platform's newest hello,
    /// else the outbox.
    fn send_terminal(&mut self, route: &MsgRoute, bytes: Vec<u8>) {
        if let Some(&slot) = self.by_uid.get(&route.conn) {
            self.send(slot, bytes, Some(route.platform.clone()));
            return;
        }
        self.queue_in_outbox(route.platform.clone(), bytes);
    }

    /// Queues a terminal line whose connection is gone behind the platform's backlog (so the
    /// outbox stays in order), and feeds the platform's newest hello connection, if any.
    fn queue_in_outbox(&mut self, platform: Arc<str>, bytes: Vec<u8>) {
        self.outboxes
            .entry(platform.clone())
            .or_default()
            .push_back(bytes);
        if let Some(slot) = self.newest_hello(&platform) {
            self.refill(slot);
        }
    }

    fn newest_hello(&self, platform: &str) -> Option<usize> {
        self.hellos
            .get(platform)?
            .iter()
            .rev()
            .find_map(|uid| self.by_uid.get(uid).copied())
    }

    fn send_typing(&mut self, conn: u64, session: &SessionKey, on: bool) {
        let op = ServerOp::Typing {
            session: session.as_str(),
            platform: session.platform(),
            chat_id: session.chat_id(),
            on,
        };
        let target = self
            .by_uid
            .get(&conn)
            .copied()
            .or_else(|| self.newest_hello(session.platform()));
        if let Some(slot) = target {
            self.send(slot, encode(&op), None);
        }
    }

    fn close(&mut self, slot: usize, why: &str) {
        if !self.conns.contains(slot) {
            return;
        }
        let mut conn = self.conns.remove(slot);
        self.by_uid.remove(&conn.uid);
        if let Some(p) = &conn.platform
            && let Some(list) = self.hellos.get_mut(p)
        {
            list.retain(|&u| u != conn.uid);
        }
        let undelivered = conn.take_undelivered_terminals();
        let moved = undelivered.len();
        for frame in undelivered {
            if let Some(platform) = frame.terminal_for {
                self.queue_in_outbox(platform, frame.bytes);
            }
        }
        log::debug!(
            "connection {} closed: {why}; {moved} undelivered terminal event(s) rerouted",
            conn.uid
        );
    }

    fn on_signal(&mut self, ctx: &mut Ctx<'_>) {
        let Some(signals) = &mut self.signals else {
            return;
        };
        let received: Vec<i32> = signals.pending().collect();
        for sig in received {
            self.signals_seen += 1;
            let name = if sig == libc::SIGINT {
                "SIGINT"
            } else {
                "SIGTERM"
            };
            if self.signals_seen > 1 {
                log::error!("received a second signal ({name}); exiting now");
                std::process::exit(1);
            }
            log::info!("received {name}: shutting down (a second signal exits at once)");
            ctx.request_shutdown();
            self.watchdog = Some(arm_watchdog(self.cfg.watchdog));
        }
    }
}

/// Starts a thread that exits the process with code 1 if the returned sender is still alive
/// after `limit`. Dropping the sender disarms it.
fn arm_watchdog(limit: Duration) -> Sender<()> {
    let (tx, rx) = crossbeam_channel::bounded::<()>(0);
    let spawned = std::thread::Builder::new().name("turnstile-watchdog".into()).spawn(move || {
        if rx.recv_timeout(limit) == Err(crossbeam_channel::RecvTimeoutError::Timeout) {
            log::error!("shutdown watchdog: still alive {limit:?} after the shutdown signal; exiting with code 1");
            std::process::exit(1);
        }
    });
    if let Err(e) = spawned {
        log::error!("cannot start the shutdown watchdog: {e}");
    }
    tx
}

/// Compares secrets without an early exit on the first differing byte.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn outcome_line(id: &str, session: &str, outcome: &Outcome) -> Vec<u8> {
    match outcome {
        Outcome::Reply(reply) => encode(&ServerOp::Reply {
            id,
            session,
            text: &reply.text,
            truncated: reply.truncated,
        }),
        Outcome::Cancelled(r) => encode(&ServerOp::Cancelled {
            id,
            session,
            reason: r.as_str(),
        }),
        Outcome::Failed(e) => encode(&ServerOp::Failed {
            id,
            session,
            error: &e.to_string(),
        }),
        Outcome::Merged { into } => encode(&ServerOp::Merged { id, session, into }),
    }
}

impl Frontend for BridgeServer {
    fn register(&mut self, registry: &Registry) -> io::Result<()> {
        registry.register(&mut self.listener, LISTENER, Interest::READABLE)?;
        self.registry = Some(registry.try_clone()?);
        if let Some(signals) = &mut self.signals {
            registry.register(signals, SIGNALS, Interest::READABLE)?;
        }
        Ok(())
    }

    fn on_ready(&mut self, event: &Event, ctx: &mut Ctx<'_>) {
        self.now = ctx.now();
        match event.token() {
            LISTENER => self.accept(),
            SIGNALS => self.on_signal(ctx),
            Token(slot) => {
                if event.is_readable() || event.is_read_closed() || event.is_error() {
                    self.read(slot, ctx);
                }
                if event.is_writable() && self.conns.contains(slot) {
                    self.dirty.push(slot);
                }
            }
        }
    }

    fn on_wake(&mut self, ctx: &mut Ctx<'_>) -> Option<Duration> {
        self.now = ctx.now();
        for slot in std::mem::take(&mut self.pending_reads) {
            self.read(slot, ctx);
        }
        self.dedup.expire(self.now);
        let now = self.now;
        let refresh: Vec<(u64, SessionKey)> = self
            .typing
            .values_mut()
            .filter(|t| t.next <= now)
            .map(|t| {
                t.next = now + self.cfg.typing_refresh;
                (t.conn, t.session.clone())
            })
            .collect();
        for (conn, session) in refresh {
            self.send_typing(conn, &session, true);
        }
        let next_typing = self.typing.values().map(|t| t.next).min();
        if self.pending_reads.is_empty() {
            next_typing
        } else {
            Some(now)
        }
    }

    fn deliver(&mut self, tag: u64, event: MessageEvent) {
        let MessageEvent { id, session, kind } = event;
        match kind {
            EventKind::Accepted { state, position } => {
                let Some(route) = self.routes.get(&tag) else {
                    return;
                };
                if let Some(&slot) = self.by_uid.get(&route.conn) {
                    let state = if state == AcceptState::Running {
                        "running"
                    } else {
                        "queued"
                    };
                    let ack = ServerOp::Ack {
                        id: &id,
                        session: session.as_str(),
                        state,
                        position: Some(position),
                    };
                    self.send(slot, encode(&ack), None);
                }
            }
            EventKind::Rejected(reason) => {
                let Some(route) = self.routes.remove(&tag) else {
                    return;
                };
                // A refused message was not accepted: a retry with the same id must be allowed.
                self.dedup.forget(route.dedup_key);
                if let Some(&slot) = self.by_uid.get(&route.conn) {
                    self.reject(
                        slot,
                        &id,
                        Some(session.as_str()),
                        reason.as_str(),
                        reason.detail(),
                    );
                }
            }
            EventKind::TurnStarted(turn) => {
                let Some(conn) = self.routes.get(&tag).map(|r| r.conn) else {
                    return;
                };
                self.send_typing(conn, &session, true);
                let next = self.now + self.cfg.typing_refresh;
                self.typing.insert(
                    turn,
                    Typing {
                        conn,
                        session,
                        next,
                    },
                );
            }
            // The bridge's `partial` op arrives with the protocol's streaming support.
            EventKind::Partial(_) => {}
            EventKind::TurnEnded(turn) => {
                if let Some(t) = self.typing.remove(&turn) {
                    self.send_typing(t.conn, &t.session, false);
                }
            }
            EventKind::Finished(outcome) => {
                let Some(route) = self.routes.remove(&tag) else {
                    return;
                };
                let line = outcome_line(&id, session.as_str(), &outcome);
                self.send_terminal(&route, line);
            }
        }
    }

    fn flush(&mut self) {
        // Refilling from an outbox can queue more output; go round until the sockets block
        // or nothing is left.
        while !self.dirty.is_empty() {
            let mut dirty = std::mem::take(&mut self.dirty);
            dirty.sort_unstable();
            dirty.dedup();
            for slot in dirty {
                let Some(conn) = self.conns.get_mut(slot) else {
                    continue;
                };
                match conn.write_out() {
                    Ok(()) if conn.close_after_flush && !conn.has_output() => {
                        self.close(slot, "closed after error");
                    }
                    Ok(()) => self.refill(slot),
                    Err(e) => self.close(slot, &format!("write failed: {e}")),
                }
            }
        }
    }

    fn finish(&mut self, poll: &mut Poll) {
        let deadline = Instant::now() + self.cfg.flush_budget;
        let mut events = MioEvents::with_capacity(64);
        loop {
            self.dirty = self
                .conns
                .iter()
                .filter(|(_, c)| c.has_output())
                .map(|(s, _)| s)
                .collect();
            if self.dirty.is_empty() {
                break;
            }
            self.flush();
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let stuck = self.conns.iter().filter(|(_, c)| c.has_output()).count();
                log::warn!(
                    "shutdown: {stuck} connection(s) still had output after the flush budget"
                );
                break;
            }
            if self.conns.iter().any(|(_, c)| c.has_output()) {
                let _ = poll.poll(&mut events, Some(left.min(Duration::from_millis(50))));
            }
        }
        let waiting: usize = self.outboxes.values().map(VecDeque::len).sum();
        if waiting > 0 {
            log::warn!(
                "shutdown: {waiting} terminal event(s) were still waiting in outboxes for a bridge to connect"
            );
        }
        self.watchdog = None;
    }
}
