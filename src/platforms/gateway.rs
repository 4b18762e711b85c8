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
//! - **A result is shown once.** The bridge calls [`Gateway::delivered`] once it has handled
//!   a terminal event (posted it, or decided not to); the client remembers the id (the newest
//!   [`GatewayConfig::shown_memory`] of them) and confirms it with `delivered`. A terminal
//!   event for a remembered id (a `redelivery` after a reconnect, or the second copy the
//!   protocol allows when a connection dies) is confirmed again and never reaches the
//!   bridge.
//! - The token is sent in the hello only; it is never logged nor put in an error.

use std::collections::{HashSet, VecDeque};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, bounded};
use serde_json::{Value, json};

use crate::message::ChatType;

/// Longest gateway line accepted: a 1 MiB reply escaped as JSON fits many times over; a
/// longer line is a broken peer and ends the connection.
pub(crate) const MAX_GATEWAY_LINE_BYTES: usize = 16 << 20;
/// Silence after which the client sends a `ping`.
const PING_AFTER: Duration = Duration::from_secs(30);
/// Silence after which the connection is considered dead and replaced.
const DEAD_AFTER: Duration = Duration::from_secs(75);
/// How long a read blocks before the stop flag and the ping timer are checked.
const READ_SLICE: Duration = Duration::from_millis(250);
/// A write taking longer than this ends the connection (the gateway stopped reading).
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Time to open a TCP connection to the gateway.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// A connection that stayed up this long resets the backoff even without a pong.
const STABLE_AFTER: Duration = Duration::from_secs(10);

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
    /// Events buffered for the bridge before the client stops reading the gateway.
    pub event_capacity: usize,
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
            .finish_non_exhaustive()
    }
}

impl GatewayConfig {
    /// Defaults: backoff 100 ms doubling to 10 s, 1,024 pending messages, 4,096 remembered
    /// result ids, 1,024 buffered events.
    pub(crate) fn new(addr: &str, platform: &str, token: Option<String>) -> GatewayConfig {
        GatewayConfig {
            addr: addr.to_owned(),
            platform: platform.to_owned(),
            token,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(10),
            max_pending: 1024,
            shown_memory: 4096,
            event_capacity: 1024,
        }
    }
}

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

/// A chat message for the gateway (the `message` op).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct OutgoingMessage {
    /// Unique per platform (the gateway drops a repeat within its duplicate window).
    pub id: String,
    /// The chat (room, channel, nick, chat id).
    pub chat_id: String,
    /// `dm` or `group` (part of the session key).
    pub chat_type: ChatType,
    /// The sender (part of the session key of a `group` chat).
    pub user_id: Option<String>,
    /// The sender's display name.
    pub user_name: Option<String>,
    /// A thread inside the chat (part of the session key).
    pub thread_id: Option<String>,
    /// Platform metadata passed to the agent: a JSON object.
    pub meta: Option<Value>,
    /// The text; `/stop`, `/new`, `/reset`, `/status` at its start are commands.
    pub text: String,
}

impl OutgoingMessage {
    /// A message with only the required fields (a `dm` without user).
    pub(crate) fn new(id: &str, chat_id: &str, text: &str) -> OutgoingMessage {
        OutgoingMessage {
            id: id.to_owned(),
            chat_id: chat_id.to_owned(),
            chat_type: ChatType::Dm,
            user_id: None,
            user_name: None,
            thread_id: None,
            meta: None,
            text: text.to_owned(),
        }
    }

    fn line(&self, platform: &str) -> String {
        json!({
            "op": "message",
            "id": self.id,
            "platform": platform,
            "chat_id": self.chat_id,
            "chat_type": self.chat_type.as_str(),
            "user_id": self.user_id,
            "user_name": self.user_name,
            "thread_id": self.thread_id,
            "meta": self.meta,
            "text": self.text,
        })
        .to_string()
    }
}

/// The gateway's answer to a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Admission {
    /// Accepted: its turn runs (`queued == false`) or waits behind `position` others.
    Accepted {
        /// The session key.
        session: String,
        /// Waiting behind others rather than running.
        queued: bool,
        /// Messages of the session ahead of it.
        position: usize,
    },
    /// Already accepted earlier (a repeat after a reconnect, or a restarted bridge): not run
    /// again; its result comes (or came) with the first copy.
    Duplicate {
        /// The session key.
        session: String,
    },
    /// Refused; nothing else follows for this id.
    Rejected {
        /// The session key, when one could be built.
        session: Option<String>,
        /// `queue_full`, `overloaded`, `backpressure`, `shutting_down`, `storage`, `invalid`.
        reason: String,
        /// The gateway's explanation.
        detail: String,
    },
}

/// How a message's turn ended (a terminal event).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The agent's reply, or a command's answer.
    Reply {
        /// The whole text.
        text: String,
        /// The reply was cut at the gateway's `--max-reply-bytes`.
        truncated: bool,
    },
    /// Cancelled: `stopped`, `reset`, `interrupted` or `shutdown`.
    Cancelled {
        /// Why.
        reason: String,
    },
    /// Failed: `agent error: …`, `timeout`, `interrupted by restart`, …
    Failed {
        /// What failed.
        error: String,
    },
    /// The text ran in another message's turn (merge mode); that one carries the reply.
    Merged {
        /// The carrier message's id.
        into: String,
    },
}

impl Outcome {
    /// What a chat shows for this outcome; `None` for a merge (the carrier's reply says it).
    pub(crate) fn chat_text(&self) -> Option<String> {
        match self {
            Outcome::Reply { text, truncated } if *truncated => {
                Some(format!("{text}\n[reply truncated by the gateway]"))
            }
            Outcome::Reply { text, .. } => Some(text.clone()),
            Outcome::Cancelled { reason } => Some(format!("[cancelled: {reason}]")),
            Outcome::Failed { error } => Some(format!("[failed: {error}]")),
            Outcome::Merged { .. } => None,
        }
    }
}

/// A terminal event: the one result of an accepted message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TerminalEvent {
    /// The message id.
    pub id: String,
    /// The session key (`platform:chat_type:chat_id[…]`; parse it with
    /// [`SessionKey`](crate::SessionKey)'s `FromStr` to find the chat after a restart).
    pub session: String,
    /// How it ended.
    pub outcome: Outcome,
    /// The gateway may have sent it before (see the protocol's Delivery section). Ids the
    /// client remembers as handled never reach the bridge; this one it does not remember.
    pub redelivery: bool,
}

/// What the gateway client reports to its bridge.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum GatewayEvent {
    /// A hello was confirmed (the gateway answered the ping after it): messages flow.
    Connected,
    /// The connection ended; the client reconnects by itself.
    Disconnected {
        /// What happened (no secret in it).
        reason: String,
    },
    /// The answer to a message.
    Admission {
        /// The message id.
        id: String,
        /// Accepted, duplicate or rejected.
        admission: Admission,
    },
    /// A turn started (`on`), is still running, or ended (`!on`).
    Typing {
        /// The session key.
        session: String,
        /// The chat.
        chat_id: String,
        /// On or off.
        on: bool,
    },
    /// The reply so far of a running turn (cumulative; best effort).
    Partial {
        /// The message id.
        id: String,
        /// The session key.
        session: String,
        /// The text so far.
        text: String,
    },
    /// A terminal event not handled before: show it, then call [`Gateway::delivered`].
    Result(TerminalEvent),
    /// The gateway could not act on a line, or refused the connection (`unauthorized`, …).
    Error {
        /// The gateway's detail.
        detail: String,
    },
}

/// Why a message could not be handed to the client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum SendError {
    /// [`GatewayConfig::max_pending`] messages already wait for their answer.
    TooManyPending(usize),
    /// [`Gateway::send_and_wait`] got no answer in time (the message stays pending and is
    /// sent again after a reconnect; sending it again with the same id is safe).
    TimedOut,
    /// The client was shut down.
    Closed,
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SendError::TooManyPending(n) => {
                write!(f, "{n} messages already wait for the gateway's answer")
            }
            SendError::TimedOut => write!(f, "no answer from the gateway in time"),
            SendError::Closed => write!(f, "the gateway client was shut down"),
        }
    }
}

impl std::error::Error for SendError {}

/// A bounded set of ids, oldest forgotten first.
#[derive(Debug)]
pub(crate) struct RecentIds {
    order: VecDeque<String>,
    set: HashSet<String>,
    capacity: usize,
}

impl RecentIds {
    /// Remembers at most `capacity` ids (at least one).
    pub(crate) fn new(capacity: usize) -> RecentIds {
        RecentIds {
            order: VecDeque::new(),
            set: HashSet::new(),
            capacity: capacity.max(1),
        }
    }

    /// Remembers `id`; returns false if it was already there.
    pub(crate) fn insert(&mut self, id: &str) -> bool {
        if self.set.contains(id) {
            return false;
        }
        if self.order.len() == self.capacity
            && let Some(old) = self.order.pop_front()
        {
            self.set.remove(&old);
        }
        self.order.push_back(id.to_owned());
        self.set.insert(id.to_owned());
        true
    }

    /// Whether `id` is remembered.
    pub(crate) fn contains(&self, id: &str) -> bool {
        self.set.contains(id)
    }

    /// Ids remembered.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.order.len()
    }
}

/// A message waiting for its `ack`/`reject`.
struct Pending {
    id: String,
    line: String,
    waiters: Vec<Sender<Admission>>,
}

/// What the handle and the connection thread share.
struct State {
    /// The writing side of the current connection; `None` while disconnected.
    conn: Option<TcpStream>,
    /// The current connection's hello was confirmed.
    connected: bool,
    pending: VecDeque<Pending>,
    shown: RecentIds,
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
            let _ = conn.shutdown(Shutdown::Both);
            state.conn = None;
            state.connected = false;
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
                shown: RecentIds::new(config.shown_memory),
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
        let line = message.line(&self.shared.config.platform);
        log::debug!(
            "gateway: sending message {} for chat {}",
            message.id,
            message.chat_id
        );
        write_line(&mut state, &line);
        state.pending.push_back(Pending {
            id: message.id.clone(),
            line,
            waiters: waiter.into_iter().collect(),
        });
        Ok(())
    }

    /// The bridge has handled the terminal event of `id` (shown it, or chosen not to): it is
    /// remembered so that a redelivered copy is dropped, and confirmed to the gateway (now,
    /// or, if the connection is down, when the gateway redelivers it).
    pub(crate) fn delivered(&self, id: &str) {
        let mut state = self.shared.lock();
        state.shown.insert(id);
        let line = json!({"op": "delivered", "ids": [id]}).to_string();
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
                let _ = conn.shutdown(Shutdown::Both);
            }
            state.connected = false;
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

/// The connection thread: connect, hello, read; reconnect with backoff; until shutdown or
/// until the bridge dropped its receiver.
fn run_connection(shared: &Shared, events: &Sender<GatewayEvent>, stop: &Receiver<()>) {
    let config = &shared.config;
    let mut backoff = config.initial_backoff.max(Duration::from_millis(1));
    let mut attempt: u32 = 0;
    while !shared.stopping.load(Ordering::SeqCst) {
        attempt += 1;
        let started = Instant::now();
        let result = match open(&config.addr) {
            Ok(stream) => serve_connection(shared, stream, events),
            Err(e) => Err(e),
        };
        if shared.stopping.load(Ordering::SeqCst) {
            break;
        }
        let (confirmed, reason) = match result {
            Ok(ConnectionEnd::ReceiverGone) => return,
            Ok(ConnectionEnd::Closed { confirmed, reason }) => (confirmed, reason),
            Err(e) => (false, e),
        };
        {
            let mut state = shared.lock();
            state.conn = None;
            state.connected = false;
        }
        if confirmed || started.elapsed() >= STABLE_AFTER {
            backoff = config.initial_backoff.max(Duration::from_millis(1));
            attempt = 1;
        }
        if confirmed
            && events
                .send(GatewayEvent::Disconnected {
                    reason: reason.clone(),
                })
                .is_err()
        {
            return;
        }
        log::warn!(
            "gateway {}: {reason}; reconnecting in {backoff:?} (attempt {attempt})",
            config.addr
        );
        match stop.recv_timeout(backoff) {
            Ok(()) | Err(RecvTimeoutError::Disconnected) => break,
            Err(RecvTimeoutError::Timeout) => {}
        }
        backoff = (backoff * 2).min(config.max_backoff.max(Duration::from_millis(1)));
    }
}

enum ConnectionEnd {
    /// The bridge dropped its event receiver: the client has nobody to work for.
    ReceiverGone,
    /// The connection ended; `confirmed` if its hello had been answered.
    Closed { confirmed: bool, reason: String },
}

fn open(addr: &str) -> Result<TcpStream, String> {
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {addr}: {e}"))?
        .collect();
    let mut last = format!("{addr} resolves to no address");
    for a in addrs {
        match TcpStream::connect_timeout(&a, CONNECT_TIMEOUT) {
            Ok(s) => return Ok(s),
            Err(e) => last = format!("cannot connect to {a}: {e}"),
        }
    }
    Err(last)
}

fn serve_connection(
    shared: &Shared,
    stream: TcpStream,
    events: &Sender<GatewayEvent>,
) -> Result<ConnectionEnd, String> {
    let config = &shared.config;
    let io_err = |e: io::Error| format!("socket setup failed: {e}");
    stream.set_nodelay(true).map_err(io_err)?;
    stream
        .set_write_timeout(Some(WRITE_TIMEOUT))
        .map_err(io_err)?;
    stream.set_read_timeout(Some(READ_SLICE)).map_err(io_err)?;
    let mut reader = stream.try_clone().map_err(io_err)?;
    {
        let mut state = shared.lock();
        state.conn = Some(stream);
        state.connected = false;
        let hello = json!({
            "op": "hello", "platform": config.platform, "token": config.token, "acks": true,
        })
        .to_string();
        // The pong to this ping confirms the hello: with a token, a refused hello is
        // answered `error` and closed instead.
        let mut ok = write_line(&mut state, &hello) && write_line(&mut state, r#"{"op":"ping"}"#);
        let lines: Vec<String> = state.pending.iter().map(|p| p.line.clone()).collect();
        for line in &lines {
            ok = ok && write_line(&mut state, line);
        }
        if !ok {
            return Err("the gateway closed the connection during the hello".into());
        }
        if !lines.is_empty() {
            log::info!(
                "gateway: sent {} unanswered message(s) again after reconnecting",
                lines.len()
            );
        }
    }
    let mut confirmed = false;
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    let mut last_heard = Instant::now();
    let mut pinged = false;
    let mut error_detail: Option<String> = None;
    loop {
        if shared.stopping.load(Ordering::SeqCst) {
            return Ok(ConnectionEnd::Closed {
                confirmed,
                reason: "shutting down".into(),
            });
        }
        match reader.read(&mut chunk) {
            Ok(0) => {
                let reason = match error_detail {
                    Some(d) => format!("the gateway closed the connection: {d}"),
                    None => "the gateway closed the connection".into(),
                };
                return Ok(ConnectionEnd::Closed { confirmed, reason });
            }
            Ok(n) => {
                last_heard = Instant::now();
                pinged = false;
                buf.extend_from_slice(&chunk[..n]);
                let mut start = 0;
                while let Some(nl) = buf[start..].iter().position(|&b| b == b'\n') {
                    let line = &buf[start..start + nl];
                    start += nl + 1;
                    match handle_line(shared, line, &mut confirmed, events) {
                        LineResult::Continue => {}
                        LineResult::Error(detail) => error_detail = Some(detail),
                        LineResult::ReceiverGone => return Ok(ConnectionEnd::ReceiverGone),
                    }
                }
                buf.drain(..start);
                if buf.len() > MAX_GATEWAY_LINE_BYTES {
                    return Ok(ConnectionEnd::Closed {
                        confirmed,
                        reason: format!(
                            "the gateway sent a line longer than {MAX_GATEWAY_LINE_BYTES} bytes"
                        ),
                    });
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) =>
            {
                let silent = last_heard.elapsed();
                if silent >= DEAD_AFTER {
                    return Ok(ConnectionEnd::Closed {
                        confirmed,
                        reason: format!("no answer from the gateway for {silent:?}"),
                    });
                }
                if silent >= PING_AFTER && !pinged {
                    pinged = true;
                    write_line(&mut shared.lock(), r#"{"op":"ping"}"#);
                }
            }
            Err(e) => {
                return Ok(ConnectionEnd::Closed {
                    confirmed,
                    reason: format!("reading from the gateway failed: {e}"),
                });
            }
        }
    }
}

enum LineResult {
    Continue,
    /// An `error` line (kept as the reason should the gateway close right after it).
    Error(String),
    ReceiverGone,
}

fn str_field(v: &Value, name: &str) -> String {
    v.get(name)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}

/// Acts on one gateway line: answers pending messages, filters results already shown, and
/// passes the rest on as events.
fn handle_line(
    shared: &Shared,
    line: &[u8],
    confirmed: &mut bool,
    events: &Sender<GatewayEvent>,
) -> LineResult {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    if line.is_empty() {
        return LineResult::Continue;
    }
    let v: Value = match serde_json::from_slice(line) {
        Ok(v @ Value::Object(_)) => v,
        _ => {
            log::warn!(
                "gateway: ignoring a line that is not a JSON object ({} bytes)",
                line.len()
            );
            return LineResult::Continue;
        }
    };
    let op = v.get("op").and_then(Value::as_str).unwrap_or_default();
    let id = str_field(&v, "id");
    let session = str_field(&v, "session");
    let event = match op {
        "pong" => {
            if *confirmed {
                return LineResult::Continue;
            }
            *confirmed = true;
            shared.lock().connected = true;
            log::info!(
                "gateway: connected to {} as platform {}",
                shared.config.addr,
                shared.config.platform
            );
            GatewayEvent::Connected
        }
        "ack" | "reject" => {
            let admission = if op == "reject" {
                Admission::Rejected {
                    session: v.get("session").and_then(Value::as_str).map(str::to_owned),
                    reason: str_field(&v, "reason"),
                    detail: str_field(&v, "detail"),
                }
            } else if v.get("state").and_then(Value::as_str) == Some("duplicate") {
                Admission::Duplicate { session }
            } else {
                Admission::Accepted {
                    session,
                    queued: v.get("state").and_then(Value::as_str) == Some("queued"),
                    position: v
                        .get("position")
                        .and_then(Value::as_u64)
                        .and_then(|p| usize::try_from(p).ok())
                        .unwrap_or(0),
                }
            };
            let waiters = {
                let mut state = shared.lock();
                match state.pending.iter().position(|p| p.id == id) {
                    Some(i) => state
                        .pending
                        .remove(i)
                        .map(|p| p.waiters)
                        .unwrap_or_default(),
                    None => Vec::new(),
                }
            };
            for w in waiters {
                let _ = w.try_send(admission.clone());
            }
            GatewayEvent::Admission { id, admission }
        }
        "typing" => GatewayEvent::Typing {
            session,
            chat_id: str_field(&v, "chat_id"),
            on: v.get("on").and_then(Value::as_bool).unwrap_or(false),
        },
        "partial" => GatewayEvent::Partial {
            id,
            session,
            text: str_field(&v, "text"),
        },
        "reply" | "cancelled" | "failed" | "merged" => {
            let outcome = match op {
                "reply" => Outcome::Reply {
                    text: str_field(&v, "text"),
                    truncated: v.get("truncated").and_then(Value::as_bool) == Some(true),
                },
                "cancelled" => Outcome::Cancelled {
                    reason: str_field(&v, "reason"),
                },
                "failed" => Outcome::Failed {
                    error: str_field(&v, "error"),
                },
                _ => Outcome::Merged {
                    into: str_field(&v, "into"),
                },
            };
            let redelivery = v.get("redelivery").and_then(Value::as_bool) == Some(true);
            {
                let mut state = shared.lock();
                if state.shown.contains(&id) {
                    // Handled before (the protocol allows a second copy): confirm again so
                    // the gateway forgets it, and keep it from the chat.
                    log::debug!(
                        "gateway: result {id} of {session} was already handled; confirmed again"
                    );
                    let line = json!({"op": "delivered", "ids": [id]}).to_string();
                    write_line(&mut state, &line);
                    return LineResult::Continue;
                }
            }
            GatewayEvent::Result(TerminalEvent {
                id,
                session,
                outcome,
                redelivery,
            })
        }
        "error" => {
            let detail = str_field(&v, "detail");
            log::warn!("gateway {}: error: {detail}", shared.config.addr);
            if events
                .send(GatewayEvent::Error {
                    detail: detail.clone(),
                })
                .is_err()
            {
                return LineResult::ReceiverGone;
            }
            return LineResult::Error(detail);
        }
        other => {
            log::debug!("gateway: ignoring op {other:?}");
            return LineResult::Continue;
        }
    };
    if events.send(event).is_err() {
        return LineResult::ReceiverGone;
    }
    LineResult::Continue
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader};
    use std::net::TcpListener;

    const WAIT: Duration = Duration::from_secs(20);

    /// A scripted fake gateway: accepts connections one at a time.
    struct FakeGateway {
        listener: TcpListener,
    }

    struct Peer {
        reader: BufReader<TcpStream>,
        writer: TcpStream,
    }

    impl FakeGateway {
        fn new() -> FakeGateway {
            FakeGateway {
                listener: TcpListener::bind("127.0.0.1:0").expect("bind"),
            }
        }
        fn addr(&self) -> String {
            self.listener.local_addr().expect("addr").to_string()
        }
        fn accept(&self) -> Peer {
            let (s, _) = self.listener.accept().expect("accept");
            s.set_read_timeout(Some(WAIT)).expect("timeout");
            Peer {
                reader: BufReader::new(s.try_clone().expect("clone")),
                writer: s,
            }
        }
    }

    impl Peer {
        fn recv(&mut self) -> Value {
            let mut line = String::new();
            let n = self.reader.read_line(&mut line).expect("a line in time");
            assert!(n > 0, "client closed");
            serde_json::from_str(&line).expect("json")
        }
        fn send(&mut self, v: Value) {
            writeln!(self.writer, "{v}").expect("write");
        }
        /// Reads the hello and the ping, answers the ping.
        fn handshake(&mut self) -> Value {
            let hello = self.recv();
            assert_eq!(self.recv()["op"], "ping");
            self.send(json!({"op": "pong"}));
            hello
        }
    }

    fn next(rx: &Receiver<GatewayEvent>) -> GatewayEvent {
        rx.recv_timeout(WAIT).expect("an event in time")
    }

    fn config(addr: &str) -> GatewayConfig {
        let mut c = GatewayConfig::new(addr, "irc", Some("s3cret".into()));
        c.initial_backoff = Duration::from_millis(5);
        c.max_backoff = Duration::from_millis(20);
        c
    }

    #[test]
    fn hello_carries_acks_and_token_and_messages_carry_every_field() {
        let fake = FakeGateway::new();
        let (gw, rx) = Gateway::connect(config(&fake.addr()));
        let mut peer = fake.accept();
        let hello = peer.handshake();
        assert_eq!(
            hello,
            json!({"op":"hello","platform":"irc","token":"s3cret","acks":true})
        );
        assert_eq!(next(&rx), GatewayEvent::Connected);
        let mut m = OutgoingMessage::new("m1", "#chan", "hi");
        m.chat_type = ChatType::Group;
        m.user_id = Some("ann".into());
        m.user_name = Some("Ann".into());
        m.meta = Some(json!({"reply_to": "x"}));
        gw.send(&m).expect("send");
        let line = peer.recv();
        assert_eq!(line["op"], "message");
        assert_eq!(line["platform"], "irc");
        assert_eq!(line["chat_type"], "group");
        assert_eq!(line["user_id"], "ann");
        assert_eq!(line["user_name"], "Ann");
        assert_eq!(line["meta"]["reply_to"], "x");
        assert_eq!(line["text"], "hi");
        assert_eq!(gw.pending(), 1);
        peer.send(json!({"op":"ack","id":"m1","session":"irc:group:#chan:user:ann","state":"running","position":0}));
        assert_eq!(
            next(&rx),
            GatewayEvent::Admission {
                id: "m1".into(),
                admission: Admission::Accepted {
                    session: "irc:group:#chan:user:ann".into(),
                    queued: false,
                    position: 0
                }
            }
        );
        assert_eq!(gw.pending(), 0);
        gw.shutdown();
    }

    #[test]
    fn unanswered_messages_are_sent_again_after_a_reconnect_and_results_shown_once() {
        let fake = FakeGateway::new();
        let (gw, rx) = Gateway::connect(config(&fake.addr()));
        let mut first = fake.accept();
        first.handshake();
        assert_eq!(next(&rx), GatewayEvent::Connected);
        gw.send(&OutgoingMessage::new("a", "1", "one"))
            .expect("send");
        gw.send(&OutgoingMessage::new("b", "1", "two"))
            .expect("send");
        assert_eq!(first.recv()["id"], "a");
        assert_eq!(first.recv()["id"], "b");
        // `a` is answered and its result shown; `b` never gets an answer on this connection.
        first.send(json!({"op":"ack","id":"a","session":"irc:dm:1","state":"running"}));
        first.send(json!({"op":"reply","id":"a","session":"irc:dm:1","text":"done"}));
        assert!(matches!(next(&rx), GatewayEvent::Admission { .. }));
        let GatewayEvent::Result(result) = next(&rx) else {
            panic!("a result")
        };
        assert_eq!(result.outcome.chat_text().as_deref(), Some("done"));
        gw.delivered("a");
        assert_eq!(first.recv(), json!({"op":"delivered","ids":["a"]}));
        drop(first);
        assert!(matches!(next(&rx), GatewayEvent::Disconnected { .. }));

        let mut second = fake.accept();
        second.recv(); // hello
        assert_eq!(second.recv()["op"], "ping");
        // Only the unanswered message is sent again.
        let again = second.recv();
        assert_eq!(
            (again["op"].as_str(), again["id"].as_str()),
            (Some("message"), Some("b"))
        );
        second.send(json!({"op":"pong"}));
        assert_eq!(next(&rx), GatewayEvent::Connected);
        // The redelivered result of `a` is confirmed but not shown again; `b`'s is shown.
        second.send(
            json!({"op":"reply","id":"a","session":"irc:dm:1","text":"done","redelivery":true}),
        );
        second.send(
            json!({"op":"reply","id":"b","session":"irc:dm:1","text":"two!","redelivery":true}),
        );
        assert_eq!(second.recv(), json!({"op":"delivered","ids":["a"]}));
        let GatewayEvent::Result(result) = next(&rx) else {
            panic!("b's result")
        };
        assert_eq!((result.id.as_str(), result.redelivery), ("b", true));
        gw.shutdown();
    }

    #[test]
    fn send_and_wait_returns_the_answer_and_pending_is_bounded() {
        let fake = FakeGateway::new();
        let mut c = config(&fake.addr());
        c.max_pending = 2;
        let (gw, rx) = Gateway::connect(c);
        let mut peer = fake.accept();
        peer.handshake();
        assert_eq!(next(&rx), GatewayEvent::Connected);
        let waiter = {
            let gw = gw.clone();
            std::thread::spawn(move || gw.send_and_wait(&OutgoingMessage::new("w", "1", "x"), WAIT))
        };
        assert_eq!(peer.recv()["id"], "w");
        gw.send(&OutgoingMessage::new("v", "1", "y"))
            .expect("second fits");
        assert_eq!(
            gw.send(&OutgoingMessage::new("u", "1", "z")),
            Err(SendError::TooManyPending(2))
        );
        peer.send(json!({"op":"reject","id":"w","session":"irc:dm:1","reason":"queue_full","detail":"full"}));
        let answer = waiter.join().expect("thread").expect("answered");
        assert!(matches!(answer, Admission::Rejected { reason, .. } if reason == "queue_full"));
        gw.shutdown();
    }

    #[test]
    fn recent_ids_are_bounded_oldest_first() {
        let mut ids = RecentIds::new(2);
        assert!(ids.insert("a"));
        assert!(!ids.insert("a"));
        ids.insert("b");
        ids.insert("c");
        assert_eq!(ids.len(), 2);
        assert!(!ids.contains("a"));
        assert!(ids.contains("b") && ids.contains("c"));
    }

    #[test]
    fn the_token_never_shows_in_debug_output() {
        let c = GatewayConfig::new("h:1", "irc", Some("s3cret".into()));
        assert!(!format!("{c:?}").contains("s3cret"));
    }
}
