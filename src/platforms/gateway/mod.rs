//! A blocking client of the bridge protocol (`docs/protocol.md`), shared by every platform
//! bridge.
//!
//! [`Gateway::connect`] starts one thread that owns the TCP connection: it connects, says
//! hello with `"acks":true` and the token, confirms the hello with a `ping`, reads the
//! gateway's lines and turns them into [`GatewayEvent`]s on a bounded channel (a bridge that
//! falls behind slows the reads, and TCP slows the gateway: nothing is dropped). When the
//! connection fails it reconnects with capped exponential backoff.
//!
//! Guarantees a bridge builds on:
//! - **A sent message is not lost while the gateway is away.** [`Gateway::send`] keeps the
//!   message until the gateway answers it with `ack` or `reject`; after a reconnect every
//!   unanswered message is sent again, in order (the gateway's duplicate window makes the
//!   repeat harmless: it answers `duplicate`). At most [`GatewayConfig::max_pending`] wait at
//!   once; beyond, `send` says so ([`SendError::TooManyPending`]) instead of queueing.
//! - **A message ends once.** A message whose line would pass the gateway's line limit
//!   (announced in its `pong`, else [`GatewayConfig::max_line_bytes`]) is refused by `send`
//!   ([`SendError::TooLong`]), and
//!   an `error` line (no id) answers the oldest message in flight (the gateway answers lines
//!   in order): it ends that message, reported as a `reject` with reason `invalid`.
//! - **Retryable means retried.** A refusal that passes (`shutting_down`, `overloaded`,
//!   `storage`, `backpressure`) is held and sent again with the same id ([`hold`]); the
//!   bridge hears of it only if the client gives up ([`GatewayConfig::max_hold`],
//!   [`GatewayConfig::max_held`]).
//! - **A result is shown once.** The bridge calls [`Gateway::delivered`] once it has handled
//!   a terminal event (posted it, or decided not to); the client remembers the id (the newest
//!   [`GatewayConfig::shown_memory`] of them) and confirms it with `delivered`. A terminal
//!   event for a remembered id (a `redelivery` after a reconnect, or the second copy the
//!   protocol allows when a connection dies) is confirmed again and never reaches the
//!   bridge.
//! - The token is sent in the hello only; it is never logged nor put in an error.

use std::collections::VecDeque;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, bounded};

use connection::run_connection;
pub(crate) use message::{
    Admission, GatewayEvent, OutgoingMessage, SendError, TerminalEvent, TerminalOutcome,
};
use recent::RecentIds;

use super::tls::Wire;
use crate::wire::ClientOp;
use message::message_line;

mod ask;
mod connection;
mod hold;
mod message;
mod protocol;
mod recent;
#[cfg(test)]
mod tests;

/// Where and how to reach the gateway.
#[derive(Clone)]
pub(crate) struct GatewayConfig {
    /// `HOST:PORT` of `turnstile serve`.
    pub addr: String,
    /// The platform named in the hello (`irc`, `telegram`, `matrix`, …).
    pub platform: String,
    /// The gateway's auth token, if it has one. Never logged.
    pub token: Option<String>,
    /// First wait before reconnecting; doubles up to `max_backoff`.
    pub initial_backoff: Duration,
    /// Longest wait between reconnection attempts.
    pub max_backoff: Duration,
    /// Messages sent and not yet answered (`ack`/`reject`) at most.
    pub max_pending: usize,
    /// Ids of handled results remembered, so a redelivered one is not shown twice.
    pub shown_memory: usize,
    /// Where those ids are kept across restarts (`<--state-dir>/<platform>-shown`), if
    /// anywhere: a result shown before a restart and redelivered after it is confirmed, not
    /// shown again.
    pub shown_file: Option<std::path::PathBuf>,
    /// Events buffered for the bridge before the client stops reading the gateway.
    pub event_capacity: usize,
    /// Longest `message` line sent when the gateway does not announce its own limit (in its
    /// `pong`, which then wins): a longer message is refused by [`Gateway::send`]
    /// ([`SendError::TooLong`]) instead of being sent to be discarded.
    pub max_line_bytes: usize,
    /// Messages held at once for a retry after a retryable refusal (`shutting_down`,
    /// `overloaded`, `storage`, `backpressure`); past it such a refusal is final.
    pub max_held: usize,
    /// How long after it was first handed over a message is sent again (retryable
    /// refusals, a gateway away) before the client gives up on it.
    pub max_hold: Duration,
    /// TLS to the gateway (its `--tls-cert`): the roots its certificate is checked against.
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// The name the gateway's certificate must be for; by default `addr`'s host.
    pub tls_name: Option<String>,
    /// Where the platform's files are downloaded (the gateway's spool) and their bounds;
    /// without a directory they reach the agent named, not fetched (issue 36).
    pub attachments: crate::AttachmentLimits,
}

impl std::fmt::Debug for GatewayConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatewayConfig")
            .field("addr", &self.addr)
            .field("platform", &self.platform)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("initial_backoff", &self.initial_backoff)
            .field("max_backoff", &self.max_backoff)
            .field("max_pending", &self.max_pending)
            .field("shown_memory", &self.shown_memory)
            .field("shown_file", &self.shown_file)
            .field("max_line_bytes", &self.max_line_bytes)
            .field("max_held", &self.max_held)
            .field("max_hold", &self.max_hold)
            .field("tls", &self.tls.is_some())
            .field("tls_name", &self.tls_name)
            .finish_non_exhaustive()
    }
}

impl GatewayConfig {
    /// Defaults: backoff 100 ms doubling to 10 s, 1,024 pending messages, 4,096 remembered
    /// result ids, 1,024 buffered events, lines of at most 65,536 bytes (the gateway's own
    /// default), 1,000 messages held for a retry, each for at most 10 minutes.
    pub(crate) fn new(addr: &str, platform: &str, token: Option<String>) -> GatewayConfig {
        GatewayConfig {
            addr: addr.to_owned(),
            platform: platform.to_owned(),
            token,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(10),
            max_pending: 1024,
            shown_memory: 4096,
            shown_file: None,
            event_capacity: 1024,
            max_line_bytes: DEFAULT_MAX_LINE_BYTES,
            max_held: DEFAULT_MAX_HELD,
            max_hold: DEFAULT_MAX_HOLD,
            tls: None,
            tls_name: None,
            attachments: crate::AttachmentLimits::default(),
        }
    }
}

/// The ids of results already shown: kept in [`GatewayConfig::shown_file`] if set (an
/// unreadable file is logged and the memory starts empty).
fn shown_memory(config: &GatewayConfig) -> RecentIds {
    let Some(path) = &config.shown_file else {
        return RecentIds::new(config.shown_memory);
    };
    RecentIds::open(path, config.shown_memory).unwrap_or_else(|e| {
        log::error!("gateway: the results shown before cannot be known ({e}); one redelivered after this restart may be shown again");
        RecentIds::new(config.shown_memory)
    })
}

/// The gateway's default `--max-line-bytes`, and so the client's.
pub(crate) const DEFAULT_MAX_LINE_BYTES: usize = 65_536;

/// Messages held for a retry at most, by default.
pub(crate) const DEFAULT_MAX_HELD: usize = 1000;
/// How long a message is retried at most, by default.
pub(crate) const DEFAULT_MAX_HOLD: Duration = Duration::from_secs(600);

/// Reads the gateway token from the environment variable `var`: `None` when it is unset or
/// empty (a gateway without a token). The error names the variable, never its value.
pub(crate) fn token_from_env(var: &str) -> Result<Option<String>, String> {
    match std::env::var(var) {
        Ok(v) if v.is_empty() => Ok(None),
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => {
            Err(format!("the variable {var} is not valid UTF-8"))
        }
    }
}

/// A message waiting for its `ack`/`reject`.
struct Pending {
    id: String,
    line: String,
    waiters: Vec<Sender<Admission>>,
    /// Written on the current connection and not answered yet: the order of the write
    /// (the gateway answers lines in order, so an `error` without an id answers the oldest).
    in_flight: Option<u64>,
    /// When it was first handed over ([`GatewayConfig::max_hold`] counts from here).
    since: Instant,
    /// Held after a retryable refusal: when it is sent again.
    retry_at: Option<Instant>,
    /// Retryable refusals so far (the backoff doubles with each).
    retries: u32,
    /// The last retryable refusal (reason, detail): told if the client gives up.
    refused: Option<(String, String)>,
}

/// What the handle and the connection thread share.
struct State {
    /// The writing side of the current connection; `None` while disconnected.
    conn: Option<Wire>,
    /// The current connection's hello was confirmed.
    connected: bool,
    pending: VecDeque<Pending>,
    shown: RecentIds,
    /// Message lines written so far (orders [`Pending::in_flight`]).
    writes: u64,
    /// The longest message line sent: the limit the gateway announced in its last pong, or
    /// [`GatewayConfig::max_line_bytes`] until (or unless) it announces one.
    max_line_bytes: usize,
    /// The last `link` report of the platform connection, as its line: written when it
    /// changes and again after every hello (a new connection starts without it).
    link: Option<(bool, String)>,
    /// `may_use` queries waiting for their answer.
    queries: ask::Queries,
}

impl State {
    /// Writes `pending[i]`'s line; it is in flight if that worked.
    fn write_pending(&mut self, i: usize) -> bool {
        let Some(line) = self.pending.get(i).map(|p| p.line.clone()) else {
            return false;
        };
        if !write_line(self, &line) {
            return false;
        }
        self.writes += 1;
        let seq = self.writes;
        if let Some(p) = self.pending.get_mut(i) {
            p.in_flight = Some(seq);
            p.retry_at = None;
        }
        true
    }

    /// The connection is gone: nothing written on it will be answered.
    fn lost_connection(&mut self) {
        self.conn = None;
        self.connected = false;
        self.queries.lost();
        for p in &mut self.pending {
            p.in_flight = None;
        }
    }

    /// The id of the oldest message in flight: the one an `error` line answers.
    fn oldest_in_flight(&self) -> Option<String> {
        self.pending
            .iter()
            .filter_map(|p| p.in_flight.map(|seq| (seq, &p.id)))
            .min_by_key(|(seq, _)| *seq)
            .map(|(_, id)| id.clone())
    }
}

struct Shared {
    config: GatewayConfig,
    state: Mutex<State>,
    stopping: AtomicBool,
    /// Wakes the connection thread out of its backoff wait at shutdown.
    stop_tx: Sender<()>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere cannot leave the state half-updated in a way that matters more
        // than stopping the bridge would; keep going with it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Writes one line to the connection, if there is one; a failed write drops the connection
/// (its reader then notices and reconnects). Returns whether it was written.
fn write_line(state: &mut State, line: &str) -> bool {
    let Some(conn) = state.conn.as_mut() else {
        return false;
    };
    let mut bytes = Vec::with_capacity(line.len() + 1);
    bytes.extend_from_slice(line.as_bytes());
    bytes.push(b'\n');
    match conn.write_all(&bytes) {
        Ok(()) => true,
        Err(e) => {
            log::warn!("gateway: write failed ({e}); reconnecting");
            conn.shutdown();
            state.lost_connection();
            false
        }
    }
}

/// A bridge's handle on the gateway. Cheap to clone; every clone drives the same connection.
#[derive(Clone)]
pub(crate) struct Gateway {
    shared: Arc<Shared>,
}

impl Gateway {
    /// Starts the connection thread; the events arrive on the returned receiver (the first
    /// one is [`GatewayEvent::Connected`] once the gateway answered). Never fails: an
    /// unreachable gateway is retried with backoff, each failure logged at WARN.
    pub(crate) fn connect(config: GatewayConfig) -> (Gateway, Receiver<GatewayEvent>) {
        let (events_tx, events_rx) = bounded(config.event_capacity.max(1));
        let (stop_tx, stop_rx) = bounded(1);
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                conn: None,
                connected: false,
                pending: VecDeque::new(),
                shown: shown_memory(&config),
                writes: 0,
                max_line_bytes: config.max_line_bytes,
                link: None,
                queries: ask::Queries::default(),
            }),
            config,
            stopping: AtomicBool::new(false),
            stop_tx,
            thread: Mutex::new(None),
        });
        let for_thread = Arc::clone(&shared);
        let spawned = std::thread::Builder::new()
            .name("gateway-client".into())
            .spawn(move || run_connection(&for_thread, &events_tx, &stop_rx));
        match spawned {
            Ok(handle) => {
                *shared.thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(handle);
            }
            Err(e) => {
                // Without the thread nothing is ever connected; the bridge sees the receiver
                // disconnected and exits with this error.
                log::error!("gateway: cannot start the client thread: {e}");
            }
        }
        (Gateway { shared }, events_rx)
    }

    /// Sends a message now (or at the next connection) and keeps it until the gateway
    /// answers; the answer arrives as [`GatewayEvent::Admission`]. A message whose id is
    /// already pending is not sent twice.
    pub(crate) fn send(&self, message: &OutgoingMessage) -> Result<(), SendError> {
        self.enqueue(message, None)
    }

    /// Like [`send`](Self::send), and waits up to `timeout` for the gateway's answer (which
    /// is also reported as an event). Used where the platform's own progress must wait for
    /// the gateway to have the message (Telegram's update offset).
    pub(crate) fn send_and_wait(
        &self,
        message: &OutgoingMessage,
        timeout: Duration,
    ) -> Result<Admission, SendError> {
        let (tx, rx) = bounded(1);
        self.enqueue(message, Some(tx))?;
        match rx.recv_timeout(timeout) {
            Ok(admission) => Ok(admission),
            Err(RecvTimeoutError::Timeout) => Err(SendError::TimedOut),
            Err(RecvTimeoutError::Disconnected) => Err(SendError::Closed),
        }
    }

    fn enqueue(
        &self,
        message: &OutgoingMessage,
        waiter: Option<Sender<Admission>>,
    ) -> Result<(), SendError> {
        if self.shared.stopping.load(Ordering::SeqCst) {
            return Err(SendError::Closed);
        }
        let mut state = self.shared.lock();
        if let Some(p) = state.pending.iter_mut().find(|p| p.id == message.id) {
            p.waiters.extend(waiter);
            return Ok(());
        }
        let max = self.shared.config.max_pending.max(1);
        if state.pending.len() >= max {
            return Err(SendError::TooManyPending(max));
        }
        let line = message_line(message, &self.shared.config.platform);
        let limit = state.max_line_bytes;
        if line.len() > limit {
            return Err(SendError::TooLong {
                bytes: line.len(),
                limit,
            });
        }
        log::debug!(
            "gateway: sending message {} for chat {}",
            message.id,
            message.chat_id
        );
        state.pending.push_back(Pending {
            id: message.id.clone(),
            line,
            waiters: waiter.into_iter().collect(),
            in_flight: None,
            since: Instant::now(),
            retry_at: None,
            retries: 0,
            refused: None,
        });
        let last = state.pending.len() - 1;
        state.write_pending(last);
        Ok(())
    }

    /// The bridge has handled the terminal event of `id` (shown it, or chosen not to): it is
    /// remembered so that a redelivered copy is dropped, and confirmed to the gateway (now,
    /// or, if the connection is down, when the gateway redelivers it).
    pub(crate) fn delivered(&self, id: &str) {
        let mut state = self.shared.lock();
        state.shown.insert(id);
        let line = ClientOp::Delivered {
            ids: vec![id.to_owned()],
        }
        .line();
        write_line(&mut state, &line);
    }

    /// Reports the bridge's own connection to its platform (`link` op, shown in the
    /// gateway's status): `up`, or down with `detail` (why). Written only when `up` changes
    /// (a new reason while down is not news), and again after each reconnection.
    pub(crate) fn link(&self, up: bool, detail: Option<String>) {
        let mut state = self.shared.lock();
        if state.link.as_ref().is_some_and(|(was, _)| *was == up) {
            return;
        }
        let line = ClientOp::Link { up, detail }.line();
        state.link = Some((up, line.clone()));
        write_line(&mut state, &line);
    }

    /// Whether `id`'s result was already handled (and is still remembered).
    pub(crate) fn was_delivered(&self, id: &str) -> bool {
        self.shared.lock().shown.contains(id)
    }

    /// Messages sent and not yet answered.
    pub(crate) fn pending(&self) -> usize {
        self.shared.lock().pending.len()
    }

    /// Closes the connection and stops the thread (waits for it). Idempotent. Messages still
    /// pending are dropped here: the platform side must not have confirmed them (Telegram's
    /// offset only moves on an answer), so they come again on the next start.
    pub(crate) fn shutdown(&self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        let _ = self.shared.stop_tx.try_send(());
        {
            let mut state = self.shared.lock();
            if let Some(conn) = state.conn.take() {
                conn.shutdown();
            }
            state.lost_connection();
        }
        let handle = self
            .shared
            .thread
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(handle) = handle
            && handle.thread().id() != std::thread::current().id()
        {
            let _ = handle.join();
        }
    }
}
