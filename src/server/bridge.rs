//! The bridge protocol as a sans-IO state machine, as the core is for sessions.
//!
//! [`Bridge`] owns everything the server knows about its clients — connections by handle,
//! per-platform state (the connections that said hello, the outbox, reservations, the
//! duplicate window), message routes and typing — and nothing that does I/O. The shell
//! (`super::BridgeServer`, on the reactor) feeds it connections, complete lines, runtime
//! events and the time, and carries out what it asks: submit a message ([`Action::Submit`]),
//! drop a socket ([`Action::Close`]), write a connection's output into a socket
//! ([`Bridge::write`]). quinn-proto's `Endpoint` versus the I/O in `quinn` is the model: every
//! rule below is tested without a socket (`tests/bridge.rs`).
//!
//! Rules:
//! - **One answer per line, in order.** Each message line takes a place in its connection's
//!   answer queue when read; the runtime's admission fills it, and answers leave in line
//!   order. A copy of an id still awaiting admission is answered with the original's fate
//!   (`duplicate` if accepted, the same `reject` if not).
//! - **Bounded everywhere, with an explicit answer**: connections, connections waiting for
//!   their hello (a deadline and a per-address cap), platforms (validated names, a cap, freed
//!   when empty), each platform's outbox in events and bytes (kept by admission: an accepted
//!   message reserves room for its terminal event until that event is written, so results are
//!   never dropped and the outbox never overflows; a full one answers `backpressure`), each
//!   platform's duplicate window (full: `backpressure`, never evicted early), output per
//!   connection (reads pause; best-effort lines are dropped).
//! - **Delivery**: a terminal event goes to the connection that sent the message; if it has
//!   gone, to its platform's outbox, which feeds the newest connection that said hello for
//!   the platform as fast as that connection reads. A result is delivered once the peer's
//!   TCP acknowledges it ([`Bridge::acked`]); what a dying connection had not delivered goes
//!   back to the *front* of its outbox, in order. A half-closed client keeps getting its
//!   events until none is outstanding.
//! - **Isolation**: with a token, only a hello carrying it authenticates, a connection acts
//!   only for the platform its hello named, and after `unauthorized` no further line counts.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::{self, Write};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use super::dedup::{DedupWindow, Fingerprint, Seen, fingerprint};
use super::frame::{Body, Frame, write_frames};
use super::protocol::{
    ClientOp, LineError, MessageFields, ServerOp, check_platform, encode, parse_line,
};
use super::sharded::Sharded;
use crate::auth::Token;
use crate::core::{AcceptState, CancelReason, EventKind, MessageEvent, Outcome, TurnId};
use crate::journal::{Committed, Record, Recovered, StoredMessage};
use crate::key::{Key, Slots};
use crate::message::{ChatType, Message, SessionKey};

pub use super::frame::Flushed;

/// The message a journal record describes, built as the bridge builds a received one.
fn rebuild(m: &StoredMessage) -> Result<Message, crate::message::InvalidInput> {
    let chat_type = ChatType::parse(&m.chat_type).ok_or(crate::message::InvalidInput {
        field: "chat_type",
        problem: "unknown",
    })?;
    let key = SessionKey::new(
        &m.platform,
        chat_type,
        &m.chat_id,
        m.thread_id.as_deref(),
        m.user_id.as_deref(),
    )?;
    let mut msg = Message::new(&m.id, key, &m.text)?;
    if let Some(u) = &m.user_id {
        msg = msg.from_user(u, m.user_name.as_deref())?;
    }
    if let Some(meta) = &m.meta {
        msg = msg.with_meta(meta)?;
    }
    Ok(msg)
}

/// Outbox room a terminal event may need beyond its text: the JSON envelope with the id and
/// the session key (each escaped), generously.
pub const TERMINAL_ENVELOPE: usize = 8 * 1024;
/// How often deadlines (hello, write stall, typing) and expiry are checked.
const HOUSEKEEPING: Duration = Duration::from_millis(100);
/// Expired duplicate-window entries dropped per platform per housekeeping pass, so that a
/// mass expiry is spread over passes instead of stalling one.
const EXPIRY_BUDGET: usize = 4096;

/// Limits and timings of the bridge.
#[derive(Clone, Debug)]
pub struct BridgeConfig {
    /// Required in a client's hello when set.
    pub auth_token: Option<String>,
    /// Open connections; beyond it a new one gets an error line and is closed.
    pub max_connections: usize,
    /// Connections that have not yet authenticated (only with a token), in all.
    pub max_unauthenticated: usize,
    /// Connections that have not yet authenticated, per peer address.
    pub max_unauthenticated_per_peer: usize,
    /// Time a connection has to authenticate (only with a token).
    pub hello_timeout: Duration,
    /// Longest accepted line.
    pub max_line_bytes: usize,
    /// Output queued on a connection past which its reads pause and best-effort lines
    /// (typing, partials) are dropped; also how much outbox backlog it is fed at a time.
    pub max_write_buffer: usize,
    /// Bytes written to one connection per wake.
    pub write_budget: usize,
    /// A connection with output that takes none of it for this long is closed (its terminal
    /// events go back to the outbox).
    pub write_stall_timeout: Duration,
    /// Platforms known at once (with connections, pending results or remembered ids).
    pub max_platforms: usize,
    /// Terminal events one platform may have undelivered (reserved at admission).
    pub outbox_cap: usize,
    /// Bytes one platform may have reserved for undelivered terminal events.
    pub outbox_bytes: usize,
    /// Longest reply text (the turn worker cuts replies there; the bridge reserves for it).
    pub max_reply_bytes: usize,
    /// How long an accepted (platform, id) is remembered.
    pub dedup_window: Duration,
    /// Ids one platform may have remembered at once.
    pub dedup_max: usize,
    /// Typing refresh period while a turn runs.
    pub typing_refresh: Duration,
    /// Durability is on (`--data-dir`): messages are journaled ([`Action::Journal`]) and
    /// acknowledged only once durable.
    pub journal: bool,
    /// Accepted messages waiting for the journal at once; beyond, `reject` `overloaded`.
    pub max_pending_durable: usize,
    /// At recovery, run again the turns a crash interrupted (else they fail `interrupted by
    /// restart`); a message interrupted twice fails `poison` either way.
    pub resume_interrupted: bool,
}

impl Default for BridgeConfig {
    fn default() -> Self {
        BridgeConfig {
            auth_token: None,
            max_connections: 1024,
            max_unauthenticated: 256,
            max_unauthenticated_per_peer: 32,
            hello_timeout: Duration::from_secs(5),
            max_line_bytes: 65_536,
            max_write_buffer: 1 << 20,
            write_budget: 256 * 1024,
            write_stall_timeout: Duration::from_secs(60),
            max_platforms: 16,
            outbox_cap: 10_000,
            outbox_bytes: 256 << 20,
            max_reply_bytes: crate::reactor::DEFAULT_MAX_REPLY_BYTES,
            dedup_window: Duration::from_secs(600),
            dedup_max: 1_000_000,
            typing_refresh: Duration::from_secs(4),
            journal: false,
            max_pending_durable: DEFAULT_MAX_PENDING_DURABLE,
            resume_interrupted: false,
        }
    }
}

/// Default of [`BridgeConfig::max_pending_durable`].
pub(crate) const DEFAULT_MAX_PENDING_DURABLE: usize = 10_000;
/// The failure of a turn that was running when the process died.
pub(crate) const INTERRUPTED: &str = "interrupted by restart";
/// The failure of a message whose turn a restart interrupted twice (the restart-loop breaker).
pub(crate) const POISON: &str =
    "poison: its turn was interrupted by a restart twice; not run again";

/// The route of a message recovered from the journal: no connection (its events go to its
/// platform's outbox). No slot ever gets this key.
fn no_conn() -> ConnId {
    Key::from_bits(u64::MAX)
}

/// A connection's handle: a generational [`Key`], so a handle kept after its connection
/// closed never reaches the connection that reuses its slot. The shell uses its bits as the
/// socket's poll token.
pub type ConnId = Key;

/// What the bridge asks of its shell.
#[derive(Debug)]
pub enum Action {
    /// Submit to the runtime; its events come back through [`Bridge::event`] with `tag`.
    Submit {
        /// The route tag.
        tag: u64,
        /// The message.
        message: Message,
    },
    /// Close the connection's socket; the bridge has forgotten it.
    Close(ConnId),
    /// Reset the connection (close discarding unsent data): results written to it and not
    /// acknowledged went back to the outbox, so nothing more of them may reach the peer.
    Reset(ConnId),
    /// Write a record to the journal; accepted messages are confirmed through
    /// [`Bridge::journaled`].
    Journal(Record),
}

/// An answer to one line, in line order.
enum Answer {
    Ready(Frame),
    /// Waits for the runtime's admission of `tag`; `copy` is a duplicate line's id and
    /// session (`None`: the line that was submitted).
    Pending {
        tag: u64,
        copy: Option<(Arc<str>, SessionKey)>,
    },
}

struct Conn {
    peer: IpAddr,
    authed: bool,
    /// The platform of its hello.
    platform: Option<Arc<str>>,
    /// No further line counts; closed once its output is written.
    closing: bool,
    /// The peer shut down its sending side.
    read_closed: bool,
    opened: Duration,
    answers: VecDeque<Answer>,
    out: VecDeque<Frame>,
    /// Bytes (as accounted by [`Body::size`]) of the ready answers and `out`.
    queued: usize,
    /// Messages it sent that have no terminal event yet.
    outstanding: usize,
    /// Last time output was written, or output appeared on an idle connection.
    last_progress: Duration,
    /// Bytes written to the socket so far.
    written: u64,
    /// Results written to the socket but not yet acknowledged by the peer's TCP, with the
    /// byte offset their pass ended at; they keep their reservation and go back to the
    /// outbox if the connection dies first (a peer that closed answers with a reset, never
    /// an acknowledgement: this is also how a half-close is told from a close).
    unconfirmed: VecDeque<(u64, Frame)>,
    /// Its hello asked for `acks`: results written wait here for its `delivered`.
    acks: bool,
    /// Results written to an `acks` connection and not yet confirmed, in order.
    awaiting: VecDeque<Frame>,
    dirty: bool,
}

impl Conn {
    fn idle(&self) -> bool {
        self.out.is_empty() && self.answers.is_empty()
    }
}

struct Platform {
    /// Connections that said hello for it, oldest first.
    conns: Vec<ConnId>,
    outbox: VecDeque<Frame>,
    outbox_bytes: usize,
    /// Accepted (or submitted) messages whose terminal event is not yet written.
    reserved_events: usize,
    reserved_bytes: usize,
    dedup: DedupWindow,
}

struct Route {
    conn: ConnId,
    id: Arc<str>,
    session: SessionKey,
    platform: Arc<str>,
    fp: Fingerprint,
    /// Connections holding a duplicate of this message awaiting its admission.
    copies: Vec<ConnId>,
    /// The message, while it waits for the journal before its submission.
    pending: Option<Message>,
    /// Times its turn started (carried over from before a restart).
    starts: u32,
    /// Recovered from the journal: its acknowledgement was sent by an earlier process.
    recovered: bool,
}

struct Typing {
    conn: ConnId,
    session: SessionKey,
    next: Duration,
}

/// One platform's figures in the status.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PlatformStatus {
    /// Connections that said hello for it.
    pub connections: usize,
    /// Terminal events waiting in its outbox.
    pub outbox_events: usize,
    /// Bytes of those events.
    pub outbox_bytes: usize,
    /// Terminal events reserved (accepted messages not yet answered, outbox included).
    pub reserved_events: usize,
    /// Bytes reserved for them.
    pub reserved_bytes: usize,
    /// Ids in its duplicate window.
    pub dedup_ids: usize,
}

/// The bridge's figures, for the status snapshot.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct BridgeStatus {
    /// Open connections.
    pub connections: usize,
    /// Connections that have not authenticated yet.
    pub unauthenticated: usize,
    /// Platforms known.
    pub platforms: usize,
    /// Per platform.
    pub outboxes: BTreeMap<String, PlatformStatus>,
    /// Rejections by reason, the runtime's included.
    pub rejected: BTreeMap<&'static str, u64>,
    /// Connections refused or closed at a bound (too many, hello deadline, stall).
    pub connections_refused: u64,
    /// Lines answered with `error`.
    pub errors: u64,
    /// Partial replies dropped (connection gone or over its output bound).
    pub partials_dropped: u64,
    /// Typing lines dropped (no connection, or over its output bound).
    pub typing_dropped: u64,
    /// Durability (`--data-dir`); absent without it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub journal: Option<JournalStatus>,
    /// Results written to `acks` connections and not yet confirmed `delivered`.
    pub awaiting_delivery: usize,
}

/// The journal's figures in the status.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[non_exhaustive]
pub struct JournalStatus {
    /// Records sent to the journal thread and not yet taken.
    pub queued_records: usize,
    /// Accepted messages waiting to be durable before their ack.
    pub pending_durable: usize,
    /// Terminal events waiting for their outcome record before they are sent.
    pub unjournaled_outcomes: usize,
    /// The bound on them (`--max-pending-durable`).
    pub max_pending_durable: usize,
    /// Transactions written.
    pub batches: u64,
    /// Transactions that failed.
    pub failed_batches: u64,
    /// Records kept for another try after a failed write.
    pub retrying: usize,
    /// The last write failed (new messages are rejected `storage`).
    pub failing: bool,
    /// Wake-ups of the reactor by the journal thread that reached the server on the
    /// journal's own poll token (set by the shell).
    pub wakes: u64,
    /// What start-up recovery found.
    pub recovery: RecoveryCounts,
}

/// What start-up recovery did, by message.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct RecoveryCounts {
    /// Messages found in the journal.
    pub messages: usize,
    /// Waiting messages submitted again, in their original order.
    pub requeued: usize,
    /// Interrupted turns run again (`--resume-interrupted`).
    pub resumed: usize,
    /// Interrupted turns failed `interrupted by restart`.
    pub interrupted: usize,
    /// Messages failed `poison` (interrupted twice).
    pub poisoned: usize,
    /// Outcomes not yet delivered, back in their outboxes.
    pub outcomes: usize,
    /// Ids in the duplicate windows.
    pub dedup_ids: usize,
}

/// The bridge protocol's state machine. See the module documentation.
pub struct Bridge {
    cfg: BridgeConfig,
    token: Option<Token>,
    /// Outbox bytes an accepted message reserves.
    reserve: usize,
    conns: Slots<Conn>,
    unauthenticated: usize,
    unauth_by_peer: HashMap<IpAddr, usize>,
    platforms: HashMap<Arc<str>, Platform>,
    routes: Sharded<Route>,
    next_tag: u64,
    typing: HashMap<TurnId, Typing>,
    actions: VecDeque<Action>,
    dirty: Vec<ConnId>,
    next_housekeeping: Duration,
    /// The time of the latest input.
    now: Duration,
    stats: BridgeStatus,
    /// Wall-clock ms since the epoch at `now == 0` (duplicate windows are journaled in wall
    /// time, to survive a restart).
    wall_at_zero: u64,
    /// Routes waiting for the journal.
    pending_durable: usize,
    /// Terminal events waiting for their outcome record (by sequence number), with the
    /// connection they go to.
    unjournaled: HashMap<u64, (ConnId, Frame)>,
    journal: JournalStatus,
}

fn error_line(detail: &str) -> Vec<u8> {
    encode(&ServerOp::Error { detail })
}

/// `text` cut to at most `max` bytes on a character boundary; whether it was cut.
fn cut(mut text: String, max: usize) -> (String, bool) {
    let cut = crate::text::truncate(&mut text, max);
    (text, cut)
}

fn reject_detail(reason: &str) -> &'static str {
    match reason {
        "queue_full" => "the session's queue is full",
        "shutting_down" => "the gateway is shutting down",
        "overloaded" => "the gateway holds as many queued messages as it may; retry later",
        _ => "refused by the runtime",
    }
}

impl Bridge {
    /// A bridge with no connection.
    pub fn new(cfg: BridgeConfig) -> Bridge {
        Bridge {
            token: cfg.auth_token.as_deref().map(Token::new),
            reserve: cfg.max_reply_bytes.saturating_add(TERMINAL_ENVELOPE),
            cfg,
            conns: Slots::new(),
            unauthenticated: 0,
            unauth_by_peer: HashMap::new(),
            platforms: HashMap::new(),
            routes: Sharded::default(),
            next_tag: 0,
            typing: HashMap::new(),
            actions: VecDeque::new(),
            dirty: Vec::new(),
            next_housekeeping: Duration::ZERO,
            now: Duration::ZERO,
            stats: BridgeStatus::default(),
            wall_at_zero: 0,
            pending_durable: 0,
            unjournaled: HashMap::new(),
            journal: JournalStatus::default(),
        }
    }

    /// Sets the wall clock: `epoch_ms` is the wall-clock time (ms since the Unix epoch) at
    /// time zero of the bridge's clock.
    pub fn set_wall_clock(&mut self, epoch_ms: u64) {
        self.wall_at_zero = epoch_ms;
    }

    fn wall_ms(&self, now: Duration) -> u64 {
        self.wall_at_zero + now.as_millis() as u64
    }

    fn journal(&mut self, r: Record) {
        debug_assert!(self.cfg.journal);
        self.journal.queued_records += 1;
        self.actions.push_back(Action::Journal(r));
    }

    /// The settings.
    pub fn config(&self) -> &BridgeConfig {
        &self.cfg
    }

    /// Replaces the auth token (a reload): hellos from now on are checked against it;
    /// connections already authenticated stay so. `None` (no token) is refused when a token
    /// was set, since connections admitted without one would skip the hello deadline's
    /// bookkeeping; going from none to a token needs a restart too (returns false).
    pub fn set_auth_token(&mut self, token: Option<&str>) -> bool {
        match (token, self.token.is_some()) {
            (Some(t), true) => {
                self.token = Some(Token::new(t));
                self.cfg.auth_token = Some(t.to_owned());
                true
            }
            (None, false) => true,
            _ => false,
        }
    }

    /// A new connection from `peer`, or the error line to write before closing it.
    pub fn connect(&mut self, peer: IpAddr, now: Duration) -> Result<ConnId, Vec<u8>> {
        let refuse = |stats: &mut BridgeStatus, why: String| {
            stats.connections_refused += 1;
            log::warn!("refused connection from {peer}: {why}");
            Err(error_line(&why))
        };
        if self.conns.len() >= self.cfg.max_connections {
            let why = format!("too many connections ({})", self.cfg.max_connections);
            return refuse(&mut self.stats, why);
        }
        let authed = self.token.is_none();
        if !authed {
            if self.unauthenticated >= self.cfg.max_unauthenticated {
                let why = format!(
                    "too many connections waiting for their hello ({})",
                    self.cfg.max_unauthenticated
                );
                return refuse(&mut self.stats, why);
            }
            let from_peer = self.unauth_by_peer.get(&peer).copied().unwrap_or(0);
            if from_peer >= self.cfg.max_unauthenticated_per_peer {
                let why = format!(
                    "too many connections from {peer} waiting for their hello ({})",
                    self.cfg.max_unauthenticated_per_peer
                );
                return refuse(&mut self.stats, why);
            }
            self.unauthenticated += 1;
            *self.unauth_by_peer.entry(peer).or_insert(0) += 1;
        }
        let id = self.conns.insert(Conn {
            peer,
            authed,
            platform: None,
            closing: false,
            read_closed: false,
            opened: now,
            answers: VecDeque::new(),
            out: VecDeque::new(),
            queued: 0,
            outstanding: 0,
            last_progress: now,
            written: 0,
            unconfirmed: VecDeque::new(),
            acks: false,
            awaiting: VecDeque::new(),
            dirty: false,
        });
        Ok(id)
    }

    /// Whether the shell should read from `conn` now: not while its output is over its bound
    /// (the client is not reading), nor once it is closing or half-closed.
    pub fn wants_read(&self, conn: ConnId) -> bool {
        self.conns
            .get(conn)
            .is_some_and(|c| !c.closing && !c.read_closed && c.queued < self.cfg.max_write_buffer)
    }

    /// Whether `conn` has output waiting.
    pub fn has_output(&self, conn: ConnId) -> bool {
        self.conns.get(conn).is_some_and(|c| !c.out.is_empty())
    }

    /// Connections whose output changed since the last call: the shell should write them.
    pub fn take_dirty(&mut self) -> Vec<ConnId> {
        let mut dirty = std::mem::take(&mut self.dirty);
        // A connection written since it was marked (its flag cleared) has had its turn.
        dirty.retain(|id| {
            self.conns
                .get_mut(*id)
                .is_some_and(|c| std::mem::replace(&mut c.dirty, false))
        });
        dirty
    }

    /// The next thing the shell must do.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// One complete line from `conn` (without its newline).
    pub fn line(&mut self, id: ConnId, line: &[u8], now: Duration) {
        self.on_line(id, line, now);
        self.audit();
    }

    fn on_line(&mut self, id: ConnId, line: &[u8], now: Duration) {
        self.now = now;
        let Some(conn) = self.conns.get(id) else {
            return;
        };
        if conn.closing {
            return;
        }
        let parsed = parse_line(line);
        if !conn.authed {
            match parsed {
                Ok(ClientOp::Hello {
                    platform,
                    token: Some(t),
                    acks,
                }) if self.token_matches(&t) => self.hello(id, platform, acks),
                _ => self.unauthorized(id),
            }
            return;
        }
        match parsed {
            Ok(ClientOp::Ping) => self.answer(id, encode(&ServerOp::Pong)),
            Ok(ClientOp::Hello {
                platform,
                token,
                acks,
            }) => {
                if self.token.is_some() && !token.is_some_and(|t| self.token_matches(&t)) {
                    self.unauthorized(id);
                } else {
                    self.hello(id, platform, acks);
                }
            }
            Ok(ClientOp::Delivered { ids }) => self.delivered(id, &ids),
            Ok(ClientOp::Message(m)) => self.message(id, m, now),
            Err(LineError::Malformed(detail)) => self.error(id, &detail),
            Err(LineError::Invalid { id: mid, detail }) => {
                self.reject(id, &mid, None, "invalid", &detail);
            }
        }
    }

    /// A line from `conn` went over the limit and was discarded.
    pub fn line_too_long(&mut self, id: ConnId) {
        self.on_line_too_long(id);
        self.audit();
    }

    fn on_line_too_long(&mut self, id: ConnId) {
        let Some(conn) = self.conns.get(id) else {
            return;
        };
        if conn.closing {
            return;
        }
        if !conn.authed {
            return self.unauthorized(id);
        }
        let detail = format!(
            "line longer than {} bytes; discarded",
            self.cfg.max_line_bytes
        );
        self.error(id, &detail);
    }

    /// The peer of `conn` shut down its sending side. It keeps getting its events until none
    /// is outstanding.
    pub fn read_closed(&mut self, id: ConnId) {
        self.on_read_closed(id);
        self.audit();
    }

    fn on_read_closed(&mut self, id: ConnId) {
        let Some(conn) = self.conns.get_mut(id) else {
            return;
        };
        conn.read_closed = true;
        log::debug!(
            "connection {} from {}: peer half-closed; {} message(s) outstanding",
            id,
            conn.peer,
            conn.outstanding
        );
        let outstanding = conn.outstanding;
        // It reads its own events still, but no longer takes its platform's backlog.
        if let Some(p) = conn.platform.take() {
            if let Some(pl) = self.platforms.get_mut(&p) {
                pl.conns.retain(|&c| c != id);
            }
            if let Some(newest) = self.newest_hello(&p) {
                self.refill(newest);
            }
            self.maybe_free(&p);
        }
        if outstanding == 0 && self.conns.get(id).is_some_and(Conn::idle) {
            self.close(id, "peer closed", true);
        }
    }

    /// The socket of `conn` is gone (closed by the peer, or failed). What it had not written
    /// goes back to the front of its outbox.
    pub fn disconnected(&mut self, id: ConnId) {
        self.close(id, "disconnected", false);
        self.audit();
    }

    /// An event of the message submitted with `tag`.
    pub fn event(&mut self, tag: u64, event: MessageEvent, now: Duration) {
        self.on_event(tag, event, now);
        self.audit();
    }

    fn on_event(&mut self, tag: u64, event: MessageEvent, now: Duration) {
        self.now = now;
        let MessageEvent { id, session, kind } = event;
        match kind {
            EventKind::Accepted { state, position } => {
                let Some(route) = self.routes.get_mut(&tag) else {
                    return;
                };
                let (conn, copies) = (route.conn, std::mem::take(&mut route.copies));
                if let Some(p) = self.platforms.get_mut(&route.platform) {
                    p.dedup.accepted(route.fp, now);
                }
                let state = match state {
                    AcceptState::Running => "running",
                    AcceptState::Queued => "queued",
                };
                let ack = encode(&ServerOp::Ack {
                    id: &id,
                    session: session.as_str(),
                    state,
                    position: Some(position),
                });
                self.resolve(conn, tag, |copy| match copy {
                    None => ack.clone(),
                    Some((cid, ckey)) => encode(&ServerOp::Ack {
                        id: cid,
                        session: ckey.as_str(),
                        state: "duplicate",
                        position: None,
                    }),
                });
                for c in copies {
                    self.resolve(c, tag, |copy| match copy {
                        None => ack.clone(),
                        Some((cid, ckey)) => encode(&ServerOp::Ack {
                            id: cid,
                            session: ckey.as_str(),
                            state: "duplicate",
                            position: None,
                        }),
                    });
                }
            }
            EventKind::Rejected(reason) => {
                let reason = reason.as_str();
                if self.routes.get(&tag).is_some_and(|r| r.recovered) {
                    // Acknowledged by the process before the restart: it gets a terminal event.
                    let detail = format!("not admitted again after a restart: {reason}");
                    return self.finish_recovered(tag, &detail);
                }
                if self.cfg.journal {
                    self.journal(Record::Forget { seq: tag });
                }
                self.refuse(tag, reason, reject_detail(reason));
            }
            EventKind::TurnStarted(turn) => {
                let Some(route) = self.routes.get_mut(&tag) else {
                    return;
                };
                route.starts += 1;
                let (conn, attempt) = (route.conn, route.starts);
                if self.cfg.journal {
                    self.journal(Record::Started { seq: tag, attempt });
                }
                self.send_typing(conn, &session, true);
                let next = now + self.cfg.typing_refresh;
                self.typing.insert(
                    turn,
                    Typing {
                        conn,
                        session,
                        next,
                    },
                );
            }
            EventKind::Partial(text) => {
                let target = self.routes.get(&tag).map(|r| r.conn).filter(|c| {
                    self.conns
                        .get(*c)
                        .is_some_and(|c| !c.closing && c.queued < self.cfg.max_write_buffer)
                });
                let Some(conn) = target else {
                    self.stats.partials_dropped += 1;
                    return;
                };
                let (text, _) = cut(text, self.cfg.max_reply_bytes);
                let body = Body::with_text("partial", &id, session.as_str(), "text", text, "");
                self.push(conn, Frame::new(body, None));
            }
            EventKind::TurnEnded(turn) => {
                if let Some(t) = self.typing.remove(&turn) {
                    self.send_typing(t.conn, &t.session, false);
                }
            }
            EventKind::Finished(outcome) => {
                let Some(route) = self.routes.remove(&tag) else {
                    return;
                };
                if let Some(c) = self.conns.get_mut(route.conn) {
                    c.outstanding -= 1;
                }
                let body = self.terminal_body(&id, session.as_str(), outcome);
                debug_assert!(
                    body.size() <= self.reserve,
                    "a terminal outgrew its reservation"
                );
                self.terminal(tag, route.conn, &route.platform, route.id, body);
            }
        }
    }

    /// Journals a terminal event and sends it on once that record is durable: an outcome a
    /// bridge has seen must survive a crash, or recovery would answer the message again
    /// differently (`interrupted by restart`).
    fn terminal(&mut self, seq: u64, conn: ConnId, platform: &Arc<str>, id: Arc<str>, body: Body) {
        let frame = Frame::new(body, Some(platform.clone())).of_message(seq, id);
        if !self.cfg.journal {
            return self.deliver_terminal(conn, platform, frame);
        }
        self.journal(Record::Outcome {
            seq,
            outcome: frame.body.to_stored(),
        });
        debug_assert!(!self.unjournaled.contains_key(&seq));
        self.unjournaled.insert(seq, (conn, frame));
    }

    /// A recovered message the runtime would not take back fails with `why`.
    fn finish_recovered(&mut self, tag: u64, why: &str) {
        let Some(route) = self.routes.remove(&tag) else {
            return;
        };
        log::warn!("session {}: message {} {why}", route.session, route.id);
        let (text, _) = cut(why.to_string(), self.cfg.max_reply_bytes);
        let body = Body::with_text(
            "failed",
            &route.id,
            route.session.as_str(),
            "error",
            text,
            "",
        );
        self.terminal(tag, route.conn, &route.platform, route.id.clone(), body);
    }

    /// Refuses the message of `tag` (runtime refusal or journal failure): every line waiting
    /// for it gets the `reject`, and a retry of its id is new.
    fn refuse(&mut self, tag: u64, reason: &'static str, detail: &str) {
        {
            {
                let Some(route) = self.routes.remove(&tag) else {
                    return;
                };
                let (id, session) = (route.id.clone(), route.session.clone());
                if let Some(p) = self.platforms.get_mut(&route.platform) {
                    p.dedup.forget(route.fp);
                }
                self.unreserve(&route.platform);
                if let Some(c) = self.conns.get_mut(route.conn) {
                    c.outstanding -= 1;
                }
                let line = |cid: &str, ckey: &SessionKey| {
                    encode(&ServerOp::Reject {
                        id: cid,
                        session: Some(ckey.as_str()),
                        reason,
                        detail,
                    })
                };
                for c in std::iter::once(route.conn).chain(route.copies.iter().copied()) {
                    self.resolve(c, tag, |copy| match copy {
                        None => line(&id, &session),
                        Some((cid, ckey)) => line(cid, ckey),
                    });
                }
                *self.stats.rejected.entry(reason).or_insert(0) += 1 + route.copies.len() as u64;
                self.maybe_free(&route.platform);
                self.maybe_finish(route.conn);
            }
        }
    }

    /// Fires the bridge's deadlines; returns when it next needs to be called.
    pub fn tick(&mut self, now: Duration) -> Duration {
        let next = self.on_tick(now);
        self.audit();
        next
    }

    fn on_tick(&mut self, now: Duration) -> Duration {
        self.now = now;
        if now < self.next_housekeeping {
            return self.next_housekeeping;
        }
        self.next_housekeeping = now + HOUSEKEEPING;
        let late: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| !c.authed && !c.closing && now >= c.opened + self.cfg.hello_timeout)
            .map(|(id, _)| id)
            .collect();
        for id in late {
            if let Some(c) = self.conns.get(id) {
                log::warn!(
                    "connection {} from {}: no hello within {:?}; closing",
                    id,
                    c.peer,
                    self.cfg.hello_timeout
                );
            }
            self.stats.connections_refused += 1;
            let detail = format!("no hello within {:?}", self.cfg.hello_timeout);
            self.answer(id, error_line(&detail));
            self.set_closing(id);
        }
        let stalled: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| {
                (!c.idle() || !c.unconfirmed.is_empty())
                    && now >= c.last_progress + self.cfg.write_stall_timeout
            })
            .map(|(id, _)| id)
            .collect();
        for id in stalled {
            if let Some(c) = self.conns.get(id) {
                log::warn!(
                    "connection {} from {}: took no output for {:?}; closing (its results go back to the outbox)",
                    id,
                    c.peer,
                    self.cfg.write_stall_timeout
                );
            }
            self.stats.connections_refused += 1;
            self.close(id, "write stalled", true);
        }
        let refresh: Vec<(ConnId, SessionKey)> = self
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
        let mut emptied = Vec::new();
        for (name, p) in &mut self.platforms {
            if p.dedup.expire(now, EXPIRY_BUDGET) > 0 && p.dedup.is_empty() {
                emptied.push(name.clone());
            }
        }
        for name in emptied {
            self.maybe_free(&name);
        }
        self.next_housekeeping
    }

    /// Writes `conn`'s output into `w`, at most the write budget, feeding it its platform's
    /// backlog as it goes. A write error is returned; the shell then calls
    /// [`Bridge::disconnected`].
    pub fn write<W: Write + ?Sized>(
        &mut self,
        id: ConnId,
        w: &mut W,
        now: Duration,
    ) -> io::Result<Flushed> {
        let result = self.on_write(id, w, now);
        self.audit();
        result
    }

    fn on_write<W: Write + ?Sized>(
        &mut self,
        id: ConnId,
        w: &mut W,
        now: Duration,
    ) -> io::Result<Flushed> {
        self.now = now;
        let mut budget = self.cfg.write_budget;
        let mut how;
        loop {
            self.refill(id);
            let Some(conn) = self.conns.get_mut(id) else {
                return Ok(Flushed::All);
            };
            let queued = &mut conn.queued;
            let (unconfirmed, before) = (&mut conn.unconfirmed, conn.written);
            let (acks, awaiting) = (conn.acks, &mut conn.awaiting);
            let (n, h) = write_frames(&mut conn.out, w, budget, |f, at| {
                *queued -= f.body.size();
                if f.terminal_for.is_some() {
                    if acks {
                        // Delivered once the bridge says so.
                        awaiting.push_back(f);
                    } else {
                        // Delivered once the peer's TCP acknowledges its last byte.
                        unconfirmed.push_back((before + at as u64, f));
                    }
                }
            })?;
            how = h;
            if n > 0 {
                conn.last_progress = now;
            }
            conn.written += n as u64;
            budget -= n.min(budget);
            if how != Flushed::All || budget == 0 || !self.backlog_for(id) {
                break;
            }
        }
        if let Some(c) = self.conns.get_mut(id) {
            // This pass was its turn (the budget is per wake): only new output marks it again.
            c.dirty = false;
        }
        if how == Flushed::All {
            self.maybe_finish(id);
        }
        Ok(how)
    }

    /// The peer's TCP has acknowledged the first `acked` bytes written to `conn`: the results
    /// they held are delivered and release their outbox room.
    pub fn acked(&mut self, id: ConnId, acked: u64) {
        let Some(conn) = self.conns.get_mut(id) else {
            return;
        };
        debug_assert!(acked <= conn.written);
        let mut done: Vec<Frame> = Vec::new();
        while conn
            .unconfirmed
            .front()
            .is_some_and(|(end, _)| *end <= acked)
        {
            if let Some((_, f)) = conn.unconfirmed.pop_front() {
                done.push(f);
            }
        }
        if !done.is_empty() {
            conn.last_progress = self.now;
        }
        for f in done {
            self.confirm(f);
        }
        self.maybe_finish(id);
        self.audit();
    }

    /// Bytes written to `conn` so far (for the shell's acknowledgement count).
    pub fn written(&self, id: ConnId) -> u64 {
        self.conns.get(id).map_or(0, |c| c.written)
    }

    /// Connections with written results not yet acknowledged.
    pub fn awaiting_ack(&self) -> Vec<ConnId> {
        self.conns
            .iter()
            .filter(|(_, c)| !c.unconfirmed.is_empty())
            .map(|(id, _)| id)
            .collect()
    }

    /// Forced exit: every message still running gets `cancelled: shutdown` on its own
    /// connection, if that is still open, so the shell can write what it can before exiting.
    pub fn abandon_all(&mut self) {
        let mut routes: Vec<(u64, Route)> = self.routes.drain();
        routes.sort_unstable_by_key(|(tag, _)| *tag);
        self.pending_durable = 0;
        for (tag, route) in routes {
            if let Some(c) = self.conns.get_mut(route.conn) {
                c.outstanding -= 1;
            }
            let line = encode(&ServerOp::Cancelled {
                id: &route.id,
                session: route.session.as_str(),
                reason: CancelReason::Shutdown.as_str(),
            });
            if self.cfg.journal && route.pending.is_none() {
                // Best effort: the process exits now, and what the journal does not take is
                // recovered at the next start.
                self.terminal(tag, route.conn, &route.platform, route.id, Body::Line(line));
            } else {
                let frame = Frame::new(Body::Line(line), Some(route.platform.clone()));
                self.deliver_terminal(route.conn, &route.platform, frame);
            }
        }
        self.audit();
    }

    /// The figures for the status snapshot.
    pub fn status(&self) -> BridgeStatus {
        let mut s = self.stats.clone();
        if self.cfg.journal {
            let mut j = self.journal.clone();
            j.pending_durable = self.pending_durable;
            j.unjournaled_outcomes = self.unjournaled.len();
            j.max_pending_durable = self.cfg.max_pending_durable;
            s.journal = Some(j);
        }
        s.awaiting_delivery = self.conns.iter().map(|(_, c)| c.awaiting.len()).sum();
        s.connections = self.conns.len();
        s.unauthenticated = self.unauthenticated;
        s.platforms = self.platforms.len();
        s.outboxes = self
            .platforms
            .iter()
            .map(|(name, p)| {
                let st = PlatformStatus {
                    connections: p.conns.len(),
                    outbox_events: p.outbox.len(),
                    outbox_bytes: p.outbox_bytes,
                    reserved_events: p.reserved_events,
                    reserved_bytes: p.reserved_bytes,
                    dedup_ids: p.dedup.len(),
                };
                (name.to_string(), st)
            })
            .collect();
        s
    }

    /// Terminal events waiting for their outcome record to be durable.
    pub fn unjournaled(&self) -> usize {
        self.unjournaled.len()
    }

    /// Terminal events still waiting in outboxes (or for their outcome record).
    pub fn outboxed(&self) -> usize {
        self.platforms
            .values()
            .map(|p| p.outbox.len())
            .sum::<usize>()
            + self.unjournaled.len()
    }

    /// Connections open.
    pub fn connections(&self) -> impl Iterator<Item = ConnId> + '_ {
        self.conns.keys()
    }

    /// Checks, in debug builds, that every count matches what it counts: each reservation is
    /// a route, a result on a connection, or a result in an outbox; byte totals match.
    fn audit(&self) {
        // O(state): skipped in release builds, and past a small size so that debug builds of
        // large scenarios stay fast.
        if !cfg!(debug_assertions) || self.routes.len() + self.conns.len() + self.outboxed() > 1_000
        {
            return;
        }
        let mut owed: HashMap<&str, usize> = HashMap::new();
        for r in self.routes.values() {
            *owed.entry(&r.platform).or_insert(0) += 1;
            debug_assert!(self.platforms.contains_key(&r.platform));
        }
        for (_, f) in self.unjournaled.values() {
            if let Some(p) = &f.terminal_for {
                *owed.entry(p).or_insert(0) += 1;
            }
        }
        let mut unauth = 0;
        for (id, c) in &self.conns {
            unauth += usize::from(!c.authed);
            let sent = self.routes.values().filter(|r| r.conn == id).count();
            debug_assert_eq!(sent, c.outstanding, "connection {} outstanding", id);
            let mut queued = 0;
            let mut terminals = c.unconfirmed.iter().map(|(_, f)| f).collect::<Vec<_>>();
            terminals.extend(c.awaiting.iter());
            debug_assert!(c.acks || c.awaiting.is_empty());
            for f in &c.out {
                queued += f.body.size();
                terminals.push(f);
            }
            for a in &c.answers {
                if let Answer::Ready(f) = a {
                    queued += f.body.size();
                    terminals.push(f);
                }
            }
            debug_assert_eq!(queued, c.queued, "connection {} queued bytes", id);
            for f in terminals {
                if let Some(p) = &f.terminal_for {
                    *owed.entry(p).or_insert(0) += 1;
                }
            }
            if let Some(p) = &c.platform {
                debug_assert!(
                    self.platforms
                        .get(p)
                        .is_some_and(|pl| pl.conns.contains(&id))
                );
            }
        }
        debug_assert_eq!(unauth, self.unauthenticated);
        debug_assert_eq!(
            self.routes.values().filter(|r| r.pending.is_some()).count(),
            self.pending_durable
        );
        debug_assert!(self.pending_durable <= self.cfg.max_pending_durable);
        debug_assert_eq!(
            self.unauth_by_peer.values().sum::<usize>(),
            self.unauthenticated
        );
        debug_assert!(self.platforms.len() <= self.cfg.max_platforms);
        for (name, p) in &self.platforms {
            let bytes: usize = p.outbox.iter().map(|f| f.body.size()).sum();
            debug_assert_eq!(bytes, p.outbox_bytes, "platform {name} outbox bytes");
            let owed = owed.get(&**name).copied().unwrap_or(0) + p.outbox.len();
            debug_assert_eq!(owed, p.reserved_events, "platform {name} reservations");
            debug_assert_eq!(p.reserved_events * self.reserve, p.reserved_bytes);
            // Recovery may restore more than a lowered cap allows; admission never adds past it.
            debug_assert!(
                p.reserved_events <= self.cfg.outbox_cap.max(self.journal.recovery.messages)
            );
            debug_assert!(p.dedup.len() <= self.cfg.dedup_max);
            for c in &p.conns {
                debug_assert!(
                    self.conns
                        .get(*c)
                        .is_some_and(|conn| conn.platform.as_deref() == Some(&**name))
                );
            }
        }
    }

    fn token_matches(&self, guess: &str) -> bool {
        self.token.as_ref().is_some_and(|t| t.matches(guess))
    }

    fn hello(&mut self, id: ConnId, platform: Option<String>, acks: bool) {
        let new = match platform {
            None => None,
            Some(name) => {
                if let Err(detail) = check_platform(&name) {
                    return self.error(id, &format!("hello: {detail}"));
                }
                match self.platform_for(&name) {
                    Some(p) => Some(p),
                    None => {
                        let detail = format!(
                            "hello refused: {} platforms are active (--max-platforms)",
                            self.cfg.max_platforms
                        );
                        return self.error(id, &detail);
                    }
                }
            }
        };
        let Some(conn) = self.conns.get_mut(id) else {
            return;
        };
        let old = conn.platform.take();
        conn.platform = new.clone();
        if acks != conn.acks && !conn.awaiting.is_empty() {
            // Switching off acks: what waits for a confirmation counts as delivered as it would
            // have without acks (its TCP has taken it).
            let frames: Vec<Frame> = conn.awaiting.drain(..).collect();
            conn.acks = acks;
            for f in frames {
                self.confirm(f);
            }
        } else {
            conn.acks = acks;
        }
        let Some(conn) = self.conns.get_mut(id) else {
            return;
        };
        let was_authed = std::mem::replace(&mut conn.authed, true);
        let peer = conn.peer;
        if !was_authed {
            self.count_authenticated(peer);
        }
        if let Some(old) = &old
            && let Some(p) = self.platforms.get_mut(old)
        {
            p.conns.retain(|&c| c != id);
        }
        if let Some(new) = &new
            && let Some(p) = self.platforms.get_mut(new)
        {
            p.conns.push(id);
        }
        if let Some(old) = old {
            self.maybe_free(&old);
        }
        self.refill(id);
    }

    fn count_authenticated(&mut self, peer: IpAddr) {
        debug_assert!(self.unauthenticated > 0);
        self.unauthenticated -= 1;
        if let Some(n) = self.unauth_by_peer.get_mut(&peer) {
            *n -= 1;
            if *n == 0 {
                self.unauth_by_peer.remove(&peer);
            }
        }
    }

    fn unauthorized(&mut self, id: ConnId) {
        if let Some(c) = self.conns.get(id) {
            log::warn!("connection {} from {}: unauthorized; closing", id, c.peer);
        }
        *self.stats.rejected.entry("unauthorized").or_insert(0) += 1;
        self.answer(id, error_line("unauthorized"));
        self.set_closing(id);
    }

    /// No further line of `id` counts; it closes once its output is written.
    fn set_closing(&mut self, id: ConnId) {
        let Some(conn) = self.conns.get_mut(id) else {
            return;
        };
        conn.closing = true;
        if let Some(p) = conn.platform.take() {
            if let Some(pl) = self.platforms.get_mut(&p) {
                pl.conns.retain(|&c| c != id);
            }
            self.maybe_free(&p);
        }
        self.mark_dirty(id);
    }

    fn error(&mut self, id: ConnId, detail: &str) {
        self.stats.errors += 1;
        self.answer(id, error_line(detail));
    }

    fn reject(
        &mut self,
        id: ConnId,
        mid: &str,
        session: Option<&str>,
        reason: &'static str,
        detail: &str,
    ) {
        *self.stats.rejected.entry(reason).or_insert(0) += 1;
        let line = encode(&ServerOp::Reject {
            id: mid,
            session,
            reason,
            detail,
        });
        self.answer(id, line);
    }

    fn message(&mut self, id: ConnId, m: MessageFields, now: Duration) {
        let Some(conn) = self.conns.get(id) else {
            return;
        };
        let hello = conn.platform.clone();
        let name = match (&m.platform, &hello) {
            (Some(p), _) => p.as_str(),
            (None, Some(p)) => p,
            (None, None) => {
                return self.reject(
                    id,
                    &m.id,
                    None,
                    "invalid",
                    "platform is required (no hello named one)",
                );
            }
        };
        if self.token.is_some() && hello.as_deref() != Some(name) {
            let detail = match &hello {
                Some(h) => {
                    format!("this connection said hello for {h}; it may only send messages for {h}")
                }
                None => "this connection's hello named no platform; it may send no message".into(),
            };
            return self.reject(id, &m.id, None, "invalid", &detail);
        }
        if let Err(detail) = check_platform(name) {
            return self.reject(id, &m.id, None, "invalid", &detail);
        }
        let key = match SessionKey::new(
            name,
            m.chat_type,
            &m.chat_id,
            m.thread_id.as_deref(),
            m.user_id.as_deref(),
        ) {
            Ok(k) => k,
            Err(e) => return self.reject(id, &m.id, None, "invalid", &e.to_string()),
        };
        let built = Message::new(&m.id, key.clone(), &m.text).and_then(|msg| {
            let msg = match (&m.user_id, &m.user_name) {
                (Some(u), name) => msg.from_user(u, name.as_deref())?,
                (None, Some(_)) => {
                    return Err(crate::message::InvalidInput {
                        field: "user_name",
                        problem: "needs user_id",
                    });
                }
                (None, None) => msg,
            };
            match &m.meta {
                Some(meta) => msg.with_meta(meta),
                None => Ok(msg),
            }
        });
        let message = match built {
            Ok(msg) => msg,
            Err(e) => {
                return self.reject(id, &m.id, Some(key.as_str()), "invalid", &e.to_string());
            }
        };
        let Some(platform) = self.platform_for(name) else {
            let detail = format!(
                "{} platforms are active (--max-platforms); no room for {name}",
                self.cfg.max_platforms
            );
            return self.reject(id, &m.id, Some(key.as_str()), "overloaded", &detail);
        };
        let fp = fingerprint(&m.id);
        let reserve = self.reserve;
        let Some(p) = self.platforms.get_mut(&platform) else {
            return;
        };
        let seen = p.dedup.seen(fp, now);
        let window_full = seen == Seen::New && p.dedup.is_full(now);
        let (reserved_events, reserved_bytes) = (p.reserved_events, p.reserved_bytes);
        match seen {
            Seen::Accepted => {
                let ack = encode(&ServerOp::Ack {
                    id: &m.id,
                    session: key.as_str(),
                    state: "duplicate",
                    position: None,
                });
                return self.answer(id, ack);
            }
            Seen::Pending(tag) => {
                if let Some(route) = self.routes.get_mut(&tag) {
                    route.copies.push(id);
                }
                let copy = Some((message.id.clone(), key));
                return self.push_answer(id, Answer::Pending { tag, copy });
            }
            Seen::New => {}
        }
        if window_full {
            let detail = format!(
                "the duplicate window of {platform} holds {} ids (--dedup-max); retry later",
                self.cfg.dedup_max
            );
            return self.reject(id, &m.id, Some(key.as_str()), "backpressure", &detail);
        }
        if reserved_events >= self.cfg.outbox_cap
            || reserved_bytes.saturating_add(reserve) > self.cfg.outbox_bytes
        {
            let detail = format!(
                "outbox of {platform} is full ({reserved_events} undelivered results); deliver them first"
            );
            return self.reject(id, &m.id, Some(key.as_str()), "backpressure", &detail);
        }
        if self.cfg.journal && self.pending_durable >= self.cfg.max_pending_durable {
            let detail = format!(
                "{} messages are waiting for the journal (--max-pending-durable); retry later",
                self.cfg.max_pending_durable
            );
            return self.reject(id, &m.id, Some(key.as_str()), "overloaded", &detail);
        }
        self.next_tag += 1;
        let tag = self.next_tag;
        if let Some(p) = self.platforms.get_mut(&platform) {
            p.reserved_events += 1;
            p.reserved_bytes += reserve;
            p.dedup.pending(fp, tag);
        }
        self.routes.insert(
            tag,
            Route {
                conn: id,
                id: message.id.clone(),
                session: key,
                platform: platform.clone(),
                fp,
                copies: Vec::new(),
                pending: None,
                starts: 0,
                recovered: false,
            },
        );
        if let Some(c) = self.conns.get_mut(id) {
            c.outstanding += 1;
        }
        self.push_answer(id, Answer::Pending { tag, copy: None });
        if !self.cfg.journal {
            self.actions.push_back(Action::Submit { tag, message });
            return;
        }
        let stored = StoredMessage {
            seq: tag,
            platform: platform.to_string(),
            id: m.id,
            chat_type: m.chat_type.as_str().to_string(),
            chat_id: m.chat_id,
            thread_id: m.thread_id,
            user_id: m.user_id,
            user_name: m.user_name,
            meta: m.meta,
            text: m.text,
            dedup_until_ms: self.wall_ms(now + self.cfg.dedup_window),
        };
        if let Some(r) = self.routes.get_mut(&tag) {
            r.pending = Some(message);
        }
        self.pending_durable += 1;
        log::debug!("message {tag} waits for the journal");
        self.journal(Record::Accepted(stored));
    }

    /// Rebuilds the state a journal held at start-up (before any connection): the duplicate
    /// windows, the waiting messages submitted again in their original order, undelivered
    /// outcomes back in their outboxes (marked `redelivery`), and the turns a crash
    /// interrupted failed `interrupted by restart` — or, with `resume_interrupted`, run again
    /// unless they were interrupted twice (`poison`). `wall_now_ms` is the wall clock now;
    /// the bridge's clock must be at `now`. Logs one INFO line with the counts.
    pub fn recover(&mut self, r: Recovered, wall_now_ms: u64, now: Duration) -> RecoveryCounts {
        self.now = now;
        self.wall_at_zero = wall_now_ms.saturating_sub(now.as_millis() as u64);
        let mut n = RecoveryCounts {
            messages: r.messages.len(),
            ..RecoveryCounts::default()
        };
        self.journal.recovery.messages = n.messages;
        self.next_tag = self.next_tag.max(r.max_seq);
        let mut dedup = r.dedup;
        // Each shard's expiry queue must be in expiry order.
        dedup.sort_by_key(|(_, _, until)| *until);
        for (platform, id, until) in dedup {
            let Some(p) = self.force_platform(&platform) else {
                continue;
            };
            let left = Duration::from_millis(until.saturating_sub(wall_now_ms));
            if let Some(p) = self.platforms.get_mut(&p) {
                p.dedup.remember(fingerprint(&id), now + left);
                n.dedup_ids += 1;
            }
        }
        for rm in r.messages {
            let m = rm.message;
            let Some(platform) = self.force_platform(&m.platform) else {
                continue;
            };
            if let Some(p) = self.platforms.get_mut(&platform) {
                p.reserved_events += 1;
                p.reserved_bytes += self.reserve;
            }
            let id: Arc<str> = m.id.as_str().into();
            let seq = m.seq;
            // A message still in flight stays a duplicate, even if its window ran out while
            // it waited (its entry is later than every restored one: the order holds).
            let fp = fingerprint(&m.id);
            let window = self.cfg.dedup_window;
            if let Some(p) = self.platforms.get_mut(&platform)
                && p.dedup.seen(fp, now) == Seen::New
            {
                p.dedup.remember(fp, now + window);
                n.dedup_ids += 1;
            }
            if let Some(o) = rm.outcome {
                let mut frame =
                    Frame::new(Body::from_stored(o), Some(platform.clone())).of_message(seq, id);
                frame.mark_redelivery();
                if let Some(p) = self.platforms.get_mut(&platform) {
                    p.outbox_bytes += frame.body.size();
                    p.outbox.push_back(frame);
                }
                n.outcomes += 1;
                continue;
            }
            let rebuilt = rebuild(&m);
            let session = match &rebuilt {
                Ok(msg) => msg.session.clone(),
                Err(_) => match SessionKey::dm(&m.platform, &m.chat_id) {
                    Ok(k) => k,
                    Err(_) => continue,
                },
            };
            let failure = match (&rebuilt, rm.starts) {
                (Err(e), _) => Some(format!("not admitted again after a restart: {e}")),
                (Ok(_), 0) => None,
                (Ok(_), 1) if self.cfg.resume_interrupted => None,
                (Ok(_), _) if self.cfg.resume_interrupted => {
                    n.poisoned += 1;
                    log::warn!("session {session}: message {id}: {POISON}");
                    Some(POISON.to_string())
                }
                (Ok(_), _) => {
                    n.interrupted += 1;
                    Some(INTERRUPTED.to_string())
                }
            };
            let route = Route {
                conn: no_conn(),
                id: id.clone(),
                session: session.clone(),
                platform: platform.clone(),
                fp: fingerprint(&m.id),
                copies: Vec::new(),
                pending: None,
                starts: rm.starts,
                recovered: true,
            };
            self.routes.insert(seq, route);
            match (failure, rebuilt) {
                (Some(why), _) => {
                    let body = Body::with_text("failed", &id, session.as_str(), "error", why, "");
                    self.routes.remove(&seq);
                    self.terminal(seq, no_conn(), &platform, id, body);
                }
                (None, Ok(message)) => {
                    n.requeued += 1;
                    n.resumed += usize::from(rm.starts > 0);
                    self.actions.push_back(Action::Submit { tag: seq, message });
                }
                (None, Err(_)) => {}
            }
        }
        log::info!(
            "recovered from the journal: {} message(s): {} requeued ({} interrupted turn(s) resumed), {} interrupted (failed), {} poison, {} outcome(s) to deliver; {} id(s) in duplicate windows",
            n.messages,
            n.requeued,
            n.resumed,
            n.interrupted,
            n.poisoned,
            n.outcomes,
            n.dedup_ids
        );
        self.journal.recovery = n;
        self.audit();
        n
    }

    /// The platform named `name`, created even past `max_platforms` (what the journal holds
    /// was admitted under the bound; a lowered bound must not lose it).
    fn force_platform(&mut self, name: &str) -> Option<Arc<str>> {
        if check_platform(name).is_err() {
            return None;
        }
        if let Some(p) = self.platform_for(name) {
            return Some(p);
        }
        Some(self.insert_platform(name))
    }

    /// A new, empty platform named `name` (the caller checked the bound).
    fn insert_platform(&mut self, name: &str) -> Arc<str> {
        let k: Arc<str> = name.into();
        self.platforms.insert(
            k.clone(),
            Platform {
                conns: Vec::new(),
                outbox: VecDeque::new(),
                outbox_bytes: 0,
                reserved_events: 0,
                reserved_bytes: 0,
                dedup: DedupWindow::new(self.cfg.dedup_window, self.cfg.dedup_max),
            },
        );
        k
    }

    /// The journal thread's report: submit the messages now durable, reject `storage` those
    /// whose write failed.
    pub fn journaled(&mut self, c: Committed, now: Duration) {
        self.now = now;
        self.journal.queued_records = self.journal.queued_records.saturating_sub(c.taken);
        self.journal.retrying = c.retrying;
        self.journal.batches += 1;
        self.journal.failing = c.error.is_some();
        if c.error.is_some() {
            self.journal.failed_batches += 1;
        }
        for seq in c.outcomes {
            if let Some((conn, frame)) = self.unjournaled.remove(&seq)
                && let Some(platform) = frame.terminal_for.clone()
            {
                self.deliver_terminal(conn, &platform, frame);
            }
        }
        for seq in c.durable {
            let Some(message) = self.routes.get_mut(&seq).and_then(|r| r.pending.take()) else {
                continue;
            };
            self.pending_durable -= 1;
            self.actions.push_back(Action::Submit { tag: seq, message });
        }
        for seq in c.failed {
            let Some(r) = self.routes.get(&seq) else {
                continue;
            };
            if r.pending.is_none() {
                continue;
            }
            self.pending_durable -= 1;
            let detail = match &c.error {
                Some(e) => format!("the message could not be made durable: {e}"),
                None => "the message could not be made durable".to_string(),
            };
            log::debug!("message {seq}: journal write failed; rejected storage");
            self.refuse(seq, "storage", &detail);
        }
        self.audit();
    }

    /// The bridge confirmed (or, without `acks`, its TCP acknowledged) a terminal event: its
    /// reservation is released and the message leaves the journal.
    fn confirm(&mut self, f: Frame) {
        if let Some(p) = f.terminal_for {
            if self.cfg.journal && f.seq != 0 {
                self.journal(Record::Delivered { seq: f.seq });
            }
            self.unreserve(&p);
            self.maybe_free(&p);
        }
    }

    /// A `delivered` line from an `acks` connection.
    fn delivered(&mut self, id: ConnId, ids: &[String]) {
        let Some(conn) = self.conns.get_mut(id) else {
            return;
        };
        let mut done = Vec::new();
        for mid in ids {
            if let Some(i) = conn
                .awaiting
                .iter()
                .position(|f| f.msg_id.as_deref() == Some(mid.as_str()))
                && let Some(f) = conn.awaiting.remove(i)
            {
                done.push(f);
            }
        }
        if !done.is_empty() {
            conn.last_progress = self.now;
        }
        for f in done {
            self.confirm(f);
        }
        self.maybe_finish(id);
    }

    /// The platform named `name`, created if there is room.
    fn platform_for(&mut self, name: &str) -> Option<Arc<str>> {
        if let Some((k, _)) = self.platforms.get_key_value(name) {
            return Some(k.clone());
        }
        if self.platforms.len() >= self.cfg.max_platforms {
            return None;
        }
        Some(self.insert_platform(name))
    }

    /// Forgets a platform that holds nothing.
    fn maybe_free(&mut self, name: &str) {
        let empty = self.platforms.get(name).is_some_and(|p| {
            p.conns.is_empty()
                && p.outbox.is_empty()
                && p.reserved_events == 0
                && p.dedup.is_empty()
        });
        if empty && let Some(p) = self.platforms.remove(name) {
            debug_assert_eq!((p.outbox_bytes, p.reserved_bytes), (0, 0));
        }
    }

    fn unreserve(&mut self, name: &str) {
        if let Some(p) = self.platforms.get_mut(name) {
            debug_assert!(p.reserved_events > 0 && p.reserved_bytes >= self.reserve);
            p.reserved_events -= 1;
            p.reserved_bytes -= self.reserve;
        }
    }

    fn terminal_body(&self, id: &str, session: &str, outcome: Outcome) -> Body {
        let max = self.cfg.max_reply_bytes;
        match outcome {
            Outcome::Reply(reply) => {
                let (text, cut_here) = cut(reply.text, max);
                let extra = if reply.truncated || cut_here {
                    ",\"truncated\":true"
                } else {
                    ""
                };
                Body::with_text("reply", id, session, "text", text, extra)
            }
            Outcome::Failed(e) => {
                let (text, _) = cut(e.to_string(), max);
                Body::with_text("failed", id, session, "error", text, "")
            }
            Outcome::Cancelled(r) => Body::Line(encode(&ServerOp::Cancelled {
                id,
                session,
                reason: r.as_str(),
            })),
            Outcome::Merged { into } => Body::Line(encode(&ServerOp::Merged {
                id,
                session,
                into: &into,
            })),
        }
    }

    /// Sends a terminal event to the message's connection, else its platform's outbox.
    fn deliver_terminal(&mut self, origin: ConnId, platform: &Arc<str>, frame: Frame) {
        if self.conns.get(origin).is_some_and(|c| !c.closing) {
            return self.push(origin, frame);
        }
        if let Some(p) = self.platforms.get_mut(platform) {
            p.outbox_bytes += frame.body.size();
            p.outbox.push_back(frame);
        }
        if let Some(newest) = self.newest_hello(platform) {
            self.refill(newest);
        }
    }

    fn newest_hello(&self, platform: &str) -> Option<ConnId> {
        self.platforms.get(platform)?.conns.last().copied()
    }

    fn backlog_for(&self, id: ConnId) -> bool {
        let Some(platform) = self.conns.get(id).and_then(|c| c.platform.as_deref()) else {
            return false;
        };
        self.newest_hello(platform) == Some(id)
            && self
                .platforms
                .get(platform)
                .is_some_and(|p| !p.outbox.is_empty())
    }

    /// Feeds `id` its platform's backlog while its queued output is under its bound, if it is
    /// the newest connection that said hello for it.
    fn refill(&mut self, id: ConnId) {
        if !self.backlog_for(id) {
            return;
        }
        let Some(conn) = self.conns.get_mut(id) else {
            return;
        };
        let Some(p) = conn
            .platform
            .as_deref()
            .and_then(|n| self.platforms.get_mut(n))
        else {
            return;
        };
        let mut moved = false;
        while conn.queued < self.cfg.max_write_buffer {
            let Some(frame) = p.outbox.pop_front() else {
                break;
            };
            let size = frame.body.size();
            p.outbox_bytes -= size;
            if conn.idle() {
                conn.last_progress = self.now;
            }
            conn.queued += size;
            if conn.answers.is_empty() {
                conn.out.push_back(frame);
            } else {
                conn.answers.push_back(Answer::Ready(frame));
            }
            moved = true;
        }
        if moved {
            self.mark_dirty(id);
        }
    }

    fn send_typing(&mut self, conn: ConnId, session: &SessionKey, on: bool) {
        let target = Some(conn)
            .filter(|c| self.conns.get(*c).is_some_and(|c| !c.closing))
            .or_else(|| self.newest_hello(session.platform()))
            .filter(|c| {
                self.conns
                    .get(*c)
                    .is_some_and(|c| c.queued < self.cfg.max_write_buffer)
            });
        let Some(target) = target else {
            self.stats.typing_dropped += 1;
            return;
        };
        let line = encode(&ServerOp::Typing {
            session: session.as_str(),
            platform: session.platform(),
            chat_id: session.chat_id(),
            on,
        });
        self.push(target, Frame::line(line));
    }

    fn answer(&mut self, id: ConnId, line: Vec<u8>) {
        self.push(id, Frame::line(line));
    }

    /// Queues a frame behind the connection's earlier answers.
    fn push(&mut self, id: ConnId, frame: Frame) {
        self.push_answer(id, Answer::Ready(frame));
    }

    fn push_answer(&mut self, id: ConnId, answer: Answer) {
        let Some(conn) = self.conns.get_mut(id) else {
            return;
        };
        if conn.idle() {
            // The stall clock starts when output appears, not when the connection last wrote.
            conn.last_progress = self.now;
        }
        match answer {
            Answer::Ready(frame) if conn.answers.is_empty() => {
                conn.queued += frame.body.size();
                conn.out.push_back(frame);
            }
            Answer::Ready(frame) => {
                conn.queued += frame.body.size();
                conn.answers.push_back(Answer::Ready(frame));
            }
            pending => conn.answers.push_back(pending),
        }
        self.mark_dirty(id);
    }

    /// Fills `conn`'s answers waiting for `tag`, then releases the ready ones in order.
    fn resolve(
        &mut self,
        id: ConnId,
        tag: u64,
        mut line: impl FnMut(Option<(&str, &SessionKey)>) -> Vec<u8>,
    ) {
        let Some(conn) = self.conns.get_mut(id) else {
            return;
        };
        for a in conn.answers.iter_mut() {
            if let Answer::Pending { tag: t, copy } = a
                && *t == tag
            {
                let bytes = line(copy.as_ref().map(|(i, k)| (&**i, k)));
                conn.queued += bytes.len();
                *a = Answer::Ready(Frame::line(bytes));
            }
        }
        while let Some(Answer::Ready(_)) = conn.answers.front() {
            if let Some(Answer::Ready(f)) = conn.answers.pop_front() {
                conn.out.push_back(f);
            }
        }
        self.mark_dirty(id);
    }

    fn mark_dirty(&mut self, id: ConnId) {
        if let Some(c) = self.conns.get_mut(id)
            && !c.dirty
        {
            c.dirty = true;
            self.dirty.push(id);
        }
    }

    /// Closes a connection that has nothing left to do: closing and written out, or
    /// half-closed with nothing outstanding and every result acknowledged.
    fn maybe_finish(&mut self, id: ConnId) {
        let Some(c) = self.conns.get(id) else {
            return;
        };
        if !c.idle() {
            return;
        }
        if c.closing {
            self.close(id, "closed after error", true);
        } else if c.read_closed
            && c.outstanding == 0
            && c.unconfirmed.is_empty()
            && c.awaiting.is_empty()
        {
            self.close(id, "peer closed", true);
        }
    }

    /// Forgets a connection; its unwritten terminal events go back to the front of their
    /// outboxes, in order.
    fn close(&mut self, id: ConnId, why: &str, emit: bool) {
        let Some(mut conn) = self.conns.remove(id) else {
            return;
        };
        if !conn.authed {
            self.count_authenticated(conn.peer);
        }
        // Written to an `acks` bridge and not confirmed: it may have them, so they go again
        // marked as a redelivery.
        let mut rescued: Vec<Frame> = conn
            .awaiting
            .drain(..)
            .map(|mut f| {
                f.mark_redelivery();
                f
            })
            .collect();
        rescued.extend(conn.unconfirmed.drain(..).map(|(_, f)| f));
        for f in conn.out.drain(..) {
            if f.terminal_for.is_some() {
                rescued.push(f);
            }
        }
        for a in conn.answers.drain(..) {
            if let Answer::Ready(f) = a
                && f.terminal_for.is_some()
            {
                rescued.push(f);
            }
        }
        let moved = rescued.len();
        let mut touched: Vec<Arc<str>> = Vec::new();
        for mut f in rescued.into_iter().rev() {
            f.rewind();
            let Some(name) = f.terminal_for.clone() else {
                continue;
            };
            if let Some(p) = self.platforms.get_mut(&name) {
                p.outbox_bytes += f.body.size();
                p.outbox.push_front(f);
            }
            if !touched.contains(&name) {
                touched.push(name);
            }
        }
        if let Some(p) = &conn.platform {
            if let Some(pl) = self.platforms.get_mut(p) {
                pl.conns.retain(|&c| c != id);
            }
            if !touched.contains(p) {
                touched.push(p.clone());
            }
        }
        for name in touched {
            if let Some(newest) = self.newest_hello(&name) {
                self.refill(newest);
            }
            self.maybe_free(&name);
        }
        log::debug!(
            "connection {} from {} closed: {why}; {moved} undelivered terminal event(s) back to the outbox",
            id,
            conn.peer
        );
        if emit {
            self.actions.push_back(if moved > 0 {
                Action::Reset(id)
            } else {
                Action::Close(id)
            });
        }
    }
}
