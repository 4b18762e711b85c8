//! The Matrix bridge: `turnstile bridge matrix --gateway HOST:PORT --homeserver URL`.
//!
//! A bot account on a homeserver, spoken to with the Client-Server API by hand over ureq
//! (no SDK, no async runtime). **Unencrypted rooms only**: an end-to-end encrypted room's
//! messages arrive as `m.room.encrypted` and are not seen.
//!
//! Threads: one long-polls `/sync` ([`sync`]), joins the rooms the bot is invited to and
//! hands the humans' messages over on a bounded channel; the gateway client
//! ([`gateway`](crate::platforms::gateway)) owns the gateway connection; this module's main
//! loop owns everything the bot sends to Matrix:
//!
//! - a reply's first partial is a new message replying to the human's event; later partials
//!   and the final text are `m.replace` edits of it (an identical text is not sent again); a
//!   cancellation is a last edit with a marker; a command's answer is an `m.notice` reply;
//! - typing is on while a turn runs (`PUT /typing`, refreshed);
//! - rate limits: a 429 waits its `retry_after_ms`; only the newest pending edit per message
//!   is kept and results and command answers go first ([`EditQueue`]); after repeated
//!   strikes no edit is sent at all, only finals;
//! - a result is confirmed to the gateway (`delivered`) once it is posted (or deliberately
//!   not), so a result redelivered after a reconnect is not posted twice.

pub(crate) mod api;
pub(crate) mod state;
pub(crate) mod sync;

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{Receiver, Select, Sender, TryRecvError, bounded};
use serde_json::{Value, json};

use crate::message::{ChatType, Command, SessionKey};
use crate::platforms::BridgeError;
use crate::platforms::edits::{EditLimits, EditQueue, Next};
use crate::platforms::gateway::{
    Admission, Gateway, GatewayConfig, GatewayEvent, Outcome, OutgoingMessage, SendError,
    TerminalEvent,
};
use crate::platforms::split::{Limit, split};

use api::{Api, ApiError};
use sync::{ChatKind, HumanMessage, Incoming, SyncState};

/// The most text one Matrix event carries: an edit holds it twice (`body` and
/// `m.new_content`), and an event may be at most 64 KiB in all.
pub(crate) const CHUNK_BYTES: usize = 16_000;
/// The marker a stopped reply's last edit ends with.
pub(crate) const STOPPED_MARKER: &str = "[stopped]";

/// Everything `turnstile bridge matrix` needs.
#[derive(Clone)]
pub(crate) struct MatrixConfig {
    /// The homeserver's base URL.
    pub homeserver: String,
    /// The bot's access token. Never logged.
    pub access_token: String,
    /// The gateway connection (platform `matrix`).
    pub gateway: GatewayConfig,
    /// Rooms the bot stays joined to at most; invites past it are declined (logged).
    pub max_rooms: usize,
    /// Edit pacing and rate-limit strikes.
    pub limits: EditLimits,
    /// How long one `/sync` long poll waits for news.
    pub sync_timeout: Duration,
    /// Replies whose state (the bot's message, the text shown) is kept at once.
    pub max_turns: usize,
    /// Where the sync position is kept across restarts (`--state-dir`); without it every
    /// start answers only what is written after it.
    pub state_dir: Option<std::path::PathBuf>,
}

impl std::fmt::Debug for MatrixConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MatrixConfig")
            .field("homeserver", &self.homeserver)
            .field("gateway", &self.gateway)
            .field("max_rooms", &self.max_rooms)
            .finish_non_exhaustive()
    }
}

impl MatrixConfig {
    /// Defaults for everything but the two endpoints and the tokens.
    pub(crate) fn new(
        homeserver: &str,
        access_token: String,
        gateway: GatewayConfig,
    ) -> MatrixConfig {
        MatrixConfig {
            homeserver: homeserver.to_owned(),
            access_token,
            gateway,
            max_rooms: 1000,
            limits: EditLimits::default(),
            sync_timeout: Duration::from_secs(30),
            max_turns: 4096,
            state_dir: None,
        }
    }
}

/// The calls the main loop makes on the homeserver (a trait so that the pacing rules are
/// tested against a scripted fake).
pub(crate) trait Homeserver {
    /// Sends an `m.room.message` with this transaction id; the new event's id.
    fn send(&mut self, room: &str, txn: &str, content: &Value) -> Result<String, ApiError>;
    /// Sets the bot's typing notice in `room`.
    fn typing(&mut self, room: &str, on: bool) -> Result<(), ApiError>;
}

/// The calls the main loop makes on the gateway.
pub(crate) trait GatewaySide {
    /// Hands a message to the gateway.
    fn send(&mut self, message: &OutgoingMessage) -> Result<(), SendError>;
    /// The terminal event of `id` was handled.
    fn delivered(&mut self, id: &str);
}

impl GatewaySide for Gateway {
    fn send(&mut self, message: &OutgoingMessage) -> Result<(), SendError> {
        Gateway::send(self, message)
    }
    fn delivered(&mut self, id: &str) {
        Gateway::delivered(self, id)
    }
}

/// The real homeserver.
pub(crate) struct HttpHomeserver {
    api: Api,
    me: String,
    typing_timeout: Duration,
}

impl Homeserver for HttpHomeserver {
    fn send(&mut self, room: &str, txn: &str, content: &Value) -> Result<String, ApiError> {
        self.api.send_message(room, txn, content)
    }
    fn typing(&mut self, room: &str, on: bool) -> Result<(), ApiError> {
        self.api.typing(room, &self.me, on, self.typing_timeout)
    }
}

/// A reply in progress: the human's message and what the bot has shown for it.
#[derive(Debug)]
struct Turn {
    room: String,
    sender: String,
    kind: ChatKind,
    command: bool,
    /// The bot's message carrying the reply, once posted.
    bot_event: Option<String>,
    /// The text that message shows now.
    shown: String,
    /// The transaction id of the reply's first message: every attempt to post it uses this
    /// one, so a send whose answer was lost and is tried again does not post a second copy.
    first_txn: String,
    /// A first-message send got no answer: what the server kept is not known.
    first_uncertain: bool,
    /// The session was stopped: no more partials are shown.
    stopped: bool,
}

/// A result or command answer to post, with how far it got.
#[derive(Debug)]
struct Post {
    /// The gateway message id whose terminal event this is (confirmed when done), if any.
    id: Option<String>,
    room: String,
    reply_to: Option<String>,
    /// The pieces to show; the first replaces the bot's message when there is one.
    chunks: Vec<String>,
    next_chunk: usize,
    notice: bool,
    /// Transaction ids of the pieces after the first (fixed, so retries are idempotent).
    txn: String,
}

/// Counts for the log and the tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Stats {
    /// New messages posted.
    pub messages: u64,
    /// `m.replace` edits posted.
    pub edits: u64,
    /// Edits not sent because the text was already shown.
    pub identical_skipped: u64,
    /// 429 answers.
    pub rate_limited: u64,
    /// Typing requests sent.
    pub typing: u64,
}

#[derive(Debug, Default)]
struct Typing {
    sessions: HashSet<String>,
    sent: Option<bool>,
    sent_at: Option<Instant>,
}

/// What [`Core::step`] did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Sent (or dropped) one item; call again.
    Worked,
    /// Nothing to do before this instant (or before new input, when `None`).
    Idle(Option<Instant>),
}

/// The bridge's state: replies in progress and what waits to be sent to Matrix.
pub(crate) struct Core<H> {
    hs: H,
    platform: String,
    turns: HashMap<String, Turn>,
    turn_order: VecDeque<String>,
    max_turns: usize,
    queue: EditQueue<String, Post, String>,
    /// Results queued and not yet posted (a redelivered copy is not queued twice).
    queued_results: HashSet<String>,
    typing: HashMap<String, Typing>,
    typing_refresh: Duration,
    txn_prefix: String,
    txn_counter: u64,
    backoff: Duration,
    /// What was sent.
    pub stats: Stats,
}

fn chunks_of(text: &str) -> Vec<String> {
    split(text, Limit::Bytes(CHUNK_BYTES))
        .into_iter()
        .map(str::to_owned)
        .collect()
}

/// The first piece of a partial (the rest comes with the final).
fn partial_view(text: &str) -> String {
    match split(text, Limit::Bytes(CHUNK_BYTES - 4)).first() {
        Some(first) if first.len() < text.len() => format!("{first}…"),
        Some(first) => (*first).to_owned(),
        None => String::new(),
    }
}

fn message_content(text: &str, notice: bool, reply_to: Option<&str>) -> Value {
    let mut c = json!({
        "msgtype": if notice { "m.notice" } else { "m.text" },
        "body": text,
    });
    if let Some(r) = reply_to {
        c["m.relates_to"] = json!({"m.in_reply_to": {"event_id": r}});
    }
    c
}

fn edit_content(original: &str, text: &str, notice: bool) -> Value {
    let msgtype = if notice { "m.notice" } else { "m.text" };
    json!({
        "msgtype": msgtype,
        "body": format!("* {text}"),
        "m.new_content": {"msgtype": msgtype, "body": text},
        "m.relates_to": {"rel_type": "m.replace", "event_id": original},
    })
}

impl<H: Homeserver> Core<H> {
    /// A bridge core posting through `hs`.
    pub(crate) fn new(hs: H, platform: &str, limits: EditLimits, max_turns: usize) -> Core<H> {
        let started = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0);
        Core {
            hs,
            platform: platform.to_owned(),
            turns: HashMap::new(),
            turn_order: VecDeque::new(),
            max_turns: max_turns.max(1),
            queue: EditQueue::new(limits),
            queued_results: HashSet::new(),
            typing: HashMap::new(),
            typing_refresh: Duration::from_secs(15),
            txn_prefix: format!("ts{started}-{}", std::process::id()),
            txn_counter: 0,
            backoff: Duration::ZERO,
            stats: Stats::default(),
        }
    }

    /// The homeserver (tests inspect their fake through it).
    #[cfg(test)]
    pub(crate) fn homeserver(&self) -> &H {
        &self.hs
    }

    /// Results and command answers waiting to be posted.
    pub(crate) fn urgent_len(&self) -> usize {
        self.queue.urgent_len()
    }

    /// Whether only finals are sent now (after repeated rate-limit strikes).
    #[cfg(test)]
    pub(crate) fn final_only(&self, now: Instant) -> bool {
        self.queue.final_only(now)
    }

    fn txn(&mut self) -> String {
        self.txn_counter += 1;
        format!("{}-{}", self.txn_prefix, self.txn_counter)
    }

    /// A human's message: remembered as a turn and handed to the gateway. A stop or reset
    /// command also ends the showing of that session's partials.
    /// Returns whether the gateway client took it (it then answers it with an admission).
    pub(crate) fn on_human(
        &mut self,
        msg: &HumanMessage,
        kind: ChatKind,
        gw: &mut impl GatewaySide,
    ) -> bool {
        let command = msg.command();
        if matches!(command, Some(Command::Stop | Command::Reset)) {
            let stopped: Vec<String> = self
                .turns
                .iter_mut()
                .filter(|(_, t)| {
                    !t.command
                        && t.room == msg.room
                        && (t.kind == ChatKind::Dm || t.sender == msg.sender)
                })
                .map(|(id, t)| {
                    t.stopped = true;
                    id.clone()
                })
                .collect();
            for id in stopped {
                self.queue.cancel_edit(&id);
            }
        }
        if self.turns.len() >= self.max_turns
            && let Some(old) = self.turn_order.pop_front()
            && self.turns.remove(&old).is_some()
        {
            log::warn!(
                "matrix: {} replies in progress (the bound): forgot the state of {old}; its result will be posted as a new message",
                self.max_turns
            );
        }
        let first_txn = self.txn();
        self.turns.insert(
            msg.event_id.clone(),
            Turn {
                room: msg.room.clone(),
                sender: msg.sender.clone(),
                kind,
                command: command.is_some(),
                bot_event: None,
                shown: String::new(),
                first_txn,
                first_uncertain: false,
                stopped: false,
            },
        );
        self.turn_order.push_back(msg.event_id.clone());
        let out = OutgoingMessage {
            id: msg.event_id.clone(),
            chat_id: msg.room.clone(),
            chat_type: match kind {
                ChatKind::Dm => ChatType::Dm,
                ChatKind::Group => ChatType::Group,
            },
            user_id: Some(msg.sender.clone()),
            user_name: msg.sender_name.clone(),
            thread_id: None,
            meta: msg.to_bridge(&self.platform, kind).get("meta").cloned(),
            text: msg.text.clone(),
        };
        log::debug!(
            "matrix: room {}: message {} to the gateway",
            msg.room,
            msg.event_id
        );
        if let Err(e) = gw.send(&out) {
            log::warn!(
                "matrix: room {}: message {} not handed to the gateway: {e}",
                msg.room,
                msg.event_id
            );
            self.forget(&msg.event_id);
            self.notice(
                &msg.room,
                Some(&msg.event_id),
                &format!("[not passed on: {e}]"),
            );
            return false;
        }
        true
    }

    /// A message the bridge refuses (too long): the human is told.
    pub(crate) fn on_refused(&mut self, room: &str, event_id: &str, why: &str) {
        log::warn!("matrix: room {room}: message {event_id} refused: {why}");
        self.notice(room, Some(event_id), &format!("[{why}]"));
    }

    fn notice(&mut self, room: &str, reply_to: Option<&str>, text: &str) {
        let txn = self.txn();
        self.queue.push_urgent(Post {
            id: None,
            room: room.to_owned(),
            reply_to: reply_to.map(str::to_owned),
            chunks: chunks_of(text),
            next_chunk: 0,
            notice: true,
            txn,
        });
    }

    fn forget(&mut self, id: &str) {
        self.turns.remove(id);
        if let Some(at) = self.turn_order.iter().position(|t| t == id) {
            self.turn_order.remove(at);
        }
    }

    /// One event from the gateway client.
    pub(crate) fn on_gateway(
        &mut self,
        event: GatewayEvent,
        now: Instant,
        gw: &mut impl GatewaySide,
    ) {
        match event {
            GatewayEvent::Connected => log::info!("matrix: connected to the gateway"),
            GatewayEvent::Disconnected { reason } => {
                log::warn!("matrix: gateway connection lost ({reason}); reconnecting");
                // Typing notices time out on the homeserver; the gateway sends them again.
                for t in self.typing.values_mut() {
                    t.sessions.clear();
                }
            }
            GatewayEvent::Error { detail } => log::warn!("matrix: the gateway says: {detail}"),
            GatewayEvent::Admission { id, admission } => match admission {
                Admission::Accepted {
                    session, queued, ..
                } => {
                    log::debug!("matrix: {id} accepted in {session} (queued: {queued})");
                }
                Admission::Duplicate { session } => {
                    log::debug!("matrix: {id} already accepted in {session}");
                }
                Admission::Rejected {
                    session,
                    reason,
                    detail,
                } => {
                    let room = self.turns.get(&id).map(|t| t.room.clone());
                    log::warn!(
                        "matrix: message {id} (session {}) rejected by the gateway: {reason}: {detail}",
                        session.as_deref().unwrap_or("-")
                    );
                    self.forget(&id);
                    if let Some(room) = room {
                        self.notice(
                            &room,
                            Some(&id),
                            &format!("[not accepted: {reason}: {detail}]"),
                        );
                    }
                }
            },
            GatewayEvent::Typing {
                session,
                chat_id,
                on,
            } => {
                if on {
                    if self.typing.len() < self.max_turns || self.typing.contains_key(&chat_id) {
                        self.typing
                            .entry(chat_id)
                            .or_default()
                            .sessions
                            .insert(session);
                    }
                } else if let Some(t) = self.typing.get_mut(&chat_id) {
                    t.sessions.remove(&session);
                }
            }
            GatewayEvent::Partial { id, text, .. } => {
                let Some(turn) = self.turns.get(&id) else {
                    return;
                };
                if turn.stopped || turn.command {
                    return;
                }
                self.queue.push_edit(id, text, now);
            }
            GatewayEvent::Result(terminal) => self.on_result(terminal, gw),
        }
    }

    fn on_result(&mut self, terminal: TerminalEvent, gw: &mut impl GatewaySide) {
        let TerminalEvent {
            id,
            session,
            outcome,
            redelivery,
        } = terminal;
        if self.queued_results.contains(&id) {
            // A redelivered copy of a result that waits to be posted: posted once.
            log::debug!("matrix: {id}: a second copy of a queued result dropped");
            return;
        }
        self.queue.cancel_edit(&id);
        let (room, shown, command) = match self.turns.get(&id) {
            Some(t) => (t.room.clone(), t.shown.clone(), t.command),
            None => match session.parse::<SessionKey>() {
                // A result of a message this process did not send (it restarted): the room
                // is in the session key, the human's event is the id.
                Ok(key) if key.platform() == self.platform => {
                    (key.chat_id().to_owned(), String::new(), false)
                }
                _ => {
                    log::warn!(
                        "matrix: result {id} for session {session}: not a Matrix room; confirmed without posting"
                    );
                    gw.delivered(&id);
                    return;
                }
            },
        };
        let text = match &outcome {
            Outcome::Reply { .. } => outcome.chat_text(),
            Outcome::Merged { .. } => None,
            Outcome::Cancelled { reason } => {
                if !shown.is_empty() {
                    let marker = if reason == "stopped" {
                        STOPPED_MARKER.to_owned()
                    } else {
                        format!("[cancelled: {reason}]")
                    };
                    Some(format!("{shown}\n\n{marker}"))
                } else if reason == "stopped" || reason == "reset" {
                    // Nothing was shown, and the human asked: the command's answer says it.
                    None
                } else {
                    outcome.chat_text()
                }
            }
            Outcome::Failed { .. } => match outcome.chat_text() {
                Some(t) if !shown.is_empty() => Some(format!("{shown}\n\n{t}")),
                other => other,
            },
        };
        log::debug!(
            "matrix: room {room}: result of {id} ({}{})",
            match &outcome {
                Outcome::Reply { .. } => "reply",
                Outcome::Cancelled { .. } => "cancelled",
                Outcome::Failed { .. } => "failed",
                Outcome::Merged { .. } => "merged",
            },
            if redelivery { ", redelivered" } else { "" }
        );
        let Some(text) = text.filter(|t| !t.trim().is_empty()) else {
            self.forget(&id);
            gw.delivered(&id);
            return;
        };
        if let Some(t) = self.turns.get_mut(&id) {
            t.stopped = true; // no partial after the final
        }
        self.queued_results.insert(id.clone());
        let txn = self.txn();
        self.queue.push_urgent(Post {
            id: Some(id.clone()),
            room,
            reply_to: Some(id),
            chunks: chunks_of(&text),
            next_chunk: 0,
            notice: command,
            txn,
        });
    }

    fn finish(&mut self, post: &Post, gw: &mut impl GatewaySide) {
        if let Some(id) = &post.id {
            self.queued_results.remove(id);
            self.forget(id);
            gw.delivered(id);
        }
    }

    /// Sends at most one thing: the next result, command answer or edit, else a typing
    /// change (text first: a typing request before a reply's first message cost the human
    /// a homeserver round trip, ~80 ms measured; a slow turn still shows typing at once). Errors are handled here (rate limits wait, transient errors back off); only a
    /// refused access token is returned.
    pub(crate) fn step(
        &mut self,
        now: Instant,
        gw: &mut impl GatewaySide,
    ) -> Result<Step, ApiError> {
        let Some(next) = self.queue.next(now) else {
            if let Some(worked) = self.step_typing(now)? {
                return Ok(worked);
            }
            let wake = self.queue.ready_at(now);
            let typing_wake = self
                .typing
                .values()
                .filter(|t| !t.sessions.is_empty())
                .filter_map(|t| t.sent_at.map(|at| at + self.typing_refresh))
                .min();
            let wake = match (wake, typing_wake) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            return Ok(Step::Idle(wake));
        };
        match next {
            Next::Urgent(post) => self.send_post(post, now, gw)?,
            Next::Edit(id, text) => self.send_edit(id, text, now)?,
        }
        Ok(Step::Worked)
    }

    fn step_typing(&mut self, now: Instant) -> Result<Option<Step>, ApiError> {
        let refresh = self.typing_refresh;
        let due = self.typing.iter().find_map(|(room, t)| {
            let want = !t.sessions.is_empty();
            let stale = want && t.sent_at.is_none_or(|at| now >= at + refresh);
            (t.sent != Some(want) || stale).then(|| (room.clone(), want))
        });
        let Some((room, want)) = due else {
            return Ok(None);
        };
        let result = self.hs.typing(&room, want);
        self.stats.typing += 1;
        if let Some(t) = self.typing.get_mut(&room) {
            // Tried once per change or refresh: a failed typing notice is not worth a retry.
            t.sent = Some(want);
            t.sent_at = Some(now);
            if !want {
                self.typing.remove(&room);
            }
        }
        match result {
            Ok(()) => {}
            Err(e) if e.is_unauthorized() => return Err(e),
            Err(e) => log::debug!("matrix: room {room}: typing notice failed: {e}"),
        }
        Ok(Some(Step::Worked))
    }

    fn send_edit(&mut self, id: String, text: String, now: Instant) -> Result<(), ApiError> {
        let Some(turn) = self.turns.get(&id) else {
            return Ok(());
        };
        if turn.stopped {
            return Ok(());
        }
        let view = partial_view(&text);
        if view.trim().is_empty() {
            return Ok(());
        }
        if view == turn.shown && turn.bot_event.is_some() {
            self.stats.identical_skipped += 1;
            return Ok(());
        }
        let room = turn.room.clone();
        let (txn, content, first) = match &turn.bot_event {
            None => (
                turn.first_txn.clone(),
                message_content(&view, false, Some(&id)),
                true,
            ),
            Some(original) => {
                let c = edit_content(original, &view, false);
                (self.txn(), c, false)
            }
        };
        match self.hs.send(&room, &txn, &content) {
            Ok(event) => {
                self.backoff = Duration::ZERO;
                if let Some(t) = self.turns.get_mut(&id) {
                    if first {
                        self.stats.messages += 1;
                        t.shown = if t.first_uncertain {
                            String::new()
                        } else {
                            view
                        };
                        t.bot_event = Some(event);
                    } else {
                        self.stats.edits += 1;
                        t.shown = view;
                    }
                }
                log::debug!(
                    "matrix: room {room}: {} for {id}",
                    if first { "reply started" } else { "edit" }
                );
                Ok(())
            }
            Err(e) => {
                if first
                    && matches!(e, ApiError::Transport(_))
                    && let Some(t) = self.turns.get_mut(&id)
                {
                    t.first_uncertain = true;
                }
                self.failed(&room, &e, now)?;
                if e.is_transient() {
                    self.queue.requeue_edit(id, text, now);
                } else {
                    log::warn!(
                        "matrix: room {room}: an edit of the reply to {id} was refused: {e}"
                    );
                }
                Ok(())
            }
        }
    }

    fn send_post(
        &mut self,
        mut post: Post,
        now: Instant,
        gw: &mut impl GatewaySide,
    ) -> Result<(), ApiError> {
        let Some(chunk) = post.chunks.get(post.next_chunk).cloned() else {
            self.finish(&post, gw);
            return Ok(());
        };
        let first = post.next_chunk == 0;
        let turn = post.id.as_ref().and_then(|id| self.turns.get(id));
        let original = if first {
            turn.and_then(|t| t.bot_event.clone())
        } else {
            None
        };
        if let (Some(_), Some(t)) = (&original, turn)
            && t.shown == chunk
        {
            // The last partial already showed exactly this.
            self.stats.identical_skipped += 1;
            post.next_chunk += 1;
            self.continue_post(post, gw);
            return Ok(());
        }
        let (txn, content) = match (&original, first) {
            (Some(orig), _) => (self.txn(), edit_content(orig, &chunk, post.notice)),
            (None, true) => (
                turn.map(|t| t.first_txn.clone())
                    .unwrap_or_else(|| format!("{}-0", post.txn)),
                message_content(&chunk, post.notice, post.reply_to.as_deref()),
            ),
            (None, false) => (
                format!("{}-{}", post.txn, post.next_chunk),
                message_content(&chunk, post.notice, None),
            ),
        };
        match self.hs.send(&post.room, &txn, &content) {
            Ok(event) => {
                self.backoff = Duration::ZERO;
                if original.is_some() {
                    self.stats.edits += 1;
                } else {
                    self.stats.messages += 1;
                }
                if first && let Some(t) = post.id.as_ref().and_then(|id| self.turns.get_mut(id)) {
                    t.bot_event.get_or_insert(event);
                    t.shown = chunk;
                }
                log::debug!(
                    "matrix: room {}: posted piece {} of {} ({})",
                    post.room,
                    post.next_chunk + 1,
                    post.chunks.len(),
                    post.id.as_deref().unwrap_or("notice")
                );
                post.next_chunk += 1;
                self.continue_post(post, gw);
                Ok(())
            }
            Err(e) => {
                self.failed(&post.room, &e, now)?;
                if e.is_transient() {
                    self.queue.requeue_urgent(post);
                } else {
                    log::warn!(
                        "matrix: room {}: the result of {} could not be posted: {e}",
                        post.room,
                        post.id.as_deref().unwrap_or("a notice")
                    );
                    self.finish(&post, gw);
                }
                Ok(())
            }
        }
    }

    fn continue_post(&mut self, post: Post, gw: &mut impl GatewaySide) {
        if post.next_chunk >= post.chunks.len() {
            self.finish(&post, gw);
        } else {
            self.queue.requeue_urgent(post);
        }
    }

    /// Bookkeeping of a failed send: rate limits and back-off.
    fn failed(&mut self, room: &str, e: &ApiError, now: Instant) -> Result<(), ApiError> {
        match e {
            e if e.is_unauthorized() => Err(e.clone()),
            ApiError::RateLimited(wait) => {
                self.stats.rate_limited += 1;
                let was = self.queue.final_only(now);
                let final_only = self.queue.rate_limited(*wait, now);
                if final_only && !was {
                    log::warn!(
                        "matrix: room {room}: rate limited repeatedly; sending only final replies (no edits) until it stops"
                    );
                } else {
                    log::info!("matrix: room {room}: rate limited, waiting {wait:?}");
                }
                Ok(())
            }
            e if e.is_transient() => {
                self.backoff =
                    (self.backoff * 2).clamp(Duration::from_millis(250), Duration::from_secs(30));
                log::warn!(
                    "matrix: room {room}: {e}; trying again in {:?}",
                    self.backoff
                );
                self.queue.pause(self.backoff, now);
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Typing notices still on (turned off at shutdown).
    pub(crate) fn typing_rooms(&self) -> Vec<String> {
        self.typing
            .iter()
            .filter(|(_, t)| t.sent == Some(true))
            .map(|(r, _)| r.clone())
            .collect()
    }

    /// Turns the bot's typing notice off in `room` (best effort).
    pub(crate) fn typing_off(&mut self, room: &str) {
        let _ = self.hs.typing(room, false);
    }
}

/// What the sync thread hands to the main loop.
enum FromSync {
    /// The first sync is done (the backlog skipped): the bridge is ready.
    Ready,
    /// The messages of the sync batch ending with this `next_batch` were all handed over.
    Batch(String),
    Message(HumanMessage, ChatKind),
    Refused {
        room: String,
        event_id: String,
        why: String,
    },
    Fatal(String),
}

/// Joins `room`, waiting out rate limits a few times; logs the outcome.
fn join(api: &Api, room: &str) {
    for _ in 0..5 {
        match api.join(room) {
            Ok(()) => {
                log::info!("matrix: joined room {room}");
                return;
            }
            Err(ApiError::RateLimited(d)) => std::thread::sleep(d.min(Duration::from_secs(30))),
            Err(e) => {
                log::warn!("matrix: room {room}: could not join: {e}");
                return;
            }
        }
    }
    log::warn!("matrix: room {room}: could not join: rate limited five times");
}

/// Long-polls `/sync`. The first sync learns the rooms (its events are the backlog); with a
/// stored position (`resume`) the next one continues from there, so what was written while
/// the bridge was down is answered.
fn run_sync(
    api: &Api,
    me: &str,
    config: &MatrixConfig,
    tx: &Sender<FromSync>,
    mut resume: Option<String>,
) {
    let mut state = SyncState::new(me, config.max_rooms, 10_000);
    let mut since: Option<String> = None;
    let mut backoff = Duration::ZERO;
    let first_filter = sync::filter(1);
    let filter = sync::filter(100);
    // Synapse caches a sync answer for two minutes by its request (user, device, since,
    // timeout, filter, …): a restarted bridge's first sync, identical to its predecessor's,
    // would get that stale answer (an invite since joined, an old position). A first sync
    // returns at once whatever its timeout, so a timeout of this process's own makes the
    // request new.
    let unique = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
        .wrapping_add(u64::from(std::process::id()));
    let first_timeout = Duration::from_millis(1 + unique % 100_000);
    loop {
        let (f, timeout) = match since {
            None => (&first_filter, first_timeout),
            Some(_) => (&filter, config.sync_timeout),
        };
        let answer = match api.sync(since.as_deref(), f, timeout) {
            Ok(v) => v,
            Err(e) if e.is_unauthorized() => {
                let _ = tx.send(FromSync::Fatal(format!(
                    "the homeserver refused the access token ({e})"
                )));
                return;
            }
            Err(ApiError::RateLimited(d)) => {
                log::info!("matrix: sync rate limited, waiting {d:?}");
                std::thread::sleep(d.min(Duration::from_secs(60)));
                continue;
            }
            Err(e) => {
                backoff = (backoff * 2).clamp(Duration::from_millis(500), Duration::from_secs(30));
                log::warn!("matrix: sync failed: {e}; trying again in {backoff:?}");
                std::thread::sleep(backoff);
                continue;
            }
        };
        backoff = Duration::ZERO;
        let first = since.is_none();
        let Some(next) = answer["next_batch"].as_str() else {
            log::warn!("matrix: a sync answer without next_batch; trying again");
            std::thread::sleep(Duration::from_secs(1));
            continue;
        };
        let items = state.absorb(&answer);
        log::debug!(
            "matrix: sync {} → {next}: {} item(s)",
            since.as_deref().unwrap_or("(first)"),
            items.len()
        );
        let resuming = first && resume.is_some();
        since = match resume.take().filter(|_| first) {
            Some(stored) => {
                log::info!("matrix: continuing from the stored sync position");
                // The learning sync's events come again from the stored position.
                state.forget_seen();
                Some(stored)
            }
            None => Some(next.to_owned()),
        };
        for item in items {
            let sent = match item {
                Incoming::Invite(room) => {
                    if state.can_join() {
                        join(api, &room);
                    } else {
                        log::warn!(
                            "matrix: room {room}: invite ignored, {} rooms joined already (--max-rooms)",
                            state.room_count()
                        );
                    }
                    Ok(())
                }
                Incoming::Message(m) => {
                    let joined = match state.joined(&m.room) {
                        Some(n) => Some(n),
                        None => match api.joined_count(&m.room) {
                            Ok(n) => {
                                state.set_joined(&m.room, n);
                                Some(n)
                            }
                            Err(e) => {
                                log::warn!(
                                    "matrix: room {}: member count unknown ({e}); taken as a group",
                                    m.room
                                );
                                None
                            }
                        },
                    };
                    let kind = joined.map_or(ChatKind::Group, ChatKind::from_joined);
                    tx.send(FromSync::Message(m, kind))
                }
                Incoming::Refused {
                    room,
                    event_id,
                    why,
                } => tx.send(FromSync::Refused {
                    room,
                    event_id,
                    why,
                }),
            };
            if sent.is_err() {
                return;
            }
        }
        if first && tx.send(FromSync::Ready).is_err() {
            return;
        }
        if !resuming && tx.send(FromSync::Batch(next.to_owned())).is_err() {
            return;
        }
    }
}

/// Runs the bridge until `stop` fires (`Ok`) or a fatal error (a refused access token);
/// `on_ready` gets the bot's mxid once the first sync is done and the gateway answered.
pub(crate) fn run(
    config: MatrixConfig,
    stop: &Receiver<()>,
    on_ready: &mut dyn FnMut(&str),
) -> Result<(), BridgeError> {
    let api = Api::new(
        &config.homeserver,
        &config.access_token,
        config.sync_timeout + Duration::from_secs(30),
    )?;
    let me = loop {
        match api.whoami() {
            Ok(me) => break me,
            Err(e) if e.is_unauthorized() => {
                return Err(format!(
                    "the homeserver {} refused the access token ({e})",
                    api.base()
                ));
            }
            Err(e) => {
                log::warn!("matrix: {}: {e}; trying again in 2s", api.base());
                if stop.recv_timeout(Duration::from_secs(2)).is_ok() {
                    return Ok(());
                }
            }
        }
    };
    log::info!("matrix: logged in to {} as {me}", api.base());
    // Sends are short; their bound is also the longest a shutdown waits for one.
    let send_api = Api::new(&config.homeserver, &config.access_token, SEND_TIMEOUT)?;

    let (resume, mut tracker) = match &config.state_dir {
        Some(dir) => (state::load(dir)?, Some(state::Tracker::new(dir)?)),
        None => (None, None),
    };
    let (sync_tx, sync_rx) = bounded::<FromSync>(64);
    {
        let api = api.clone();
        let me = me.clone();
        let config = config.clone();
        std::thread::Builder::new()
            .name("matrix-sync".into())
            .spawn(move || run_sync(&api, &me, &config, &sync_tx, resume))
            .map_err(|e| format!("cannot start a thread: {e}"))?;
    }
    let (mut gw, gw_rx) = Gateway::connect(config.gateway.clone());
    let hs = HttpHomeserver {
        api: send_api,
        me: me.clone(),
        typing_timeout: Duration::from_secs(30),
    };
    let mut core = Core::new(
        hs,
        &config.gateway.platform,
        config.limits,
        config.max_turns,
    );
    let channels = Channels {
        gw: &gw_rx,
        sync: &sync_rx,
        stop,
    };
    let result = main_loop(
        &mut core,
        &mut gw,
        &channels,
        &mut || on_ready(&me),
        config.gateway.max_pending,
        tracker.as_mut(),
    );
    for room in core.typing_rooms() {
        core.typing_off(&room);
    }
    let waiting = core.urgent_len();
    gw.shutdown();
    if waiting > 0 {
        log::info!(
            "matrix: {waiting} result(s) not posted yet stay with the gateway (it redelivers them to the next bridge)"
        );
    }
    log::info!(
        "matrix: stopped ({} messages, {} edits, {} identical edits skipped, {} rate-limited)",
        core.stats.messages,
        core.stats.edits,
        core.stats.identical_skipped,
        core.stats.rate_limited
    );
    result
}

/// The bound of one send to the homeserver.
const SEND_TIMEOUT: Duration = Duration::from_secs(10);

struct Channels<'a> {
    gw: &'a Receiver<GatewayEvent>,
    sync: &'a Receiver<FromSync>,
    stop: &'a Receiver<()>,
}

/// Urgent posts waiting past which the gateway's events are left unread (TCP then slows it).
const MAX_URGENT: usize = 256;

fn main_loop(
    core: &mut Core<HttpHomeserver>,
    gw: &mut Gateway,
    ch: &Channels<'_>,
    on_ready: &mut dyn FnMut(),
    max_pending: usize,
    mut tracker: Option<&mut state::Tracker>,
) -> Result<(), BridgeError> {
    let (mut synced, mut connected, mut announced) = (false, false, false);
    loop {
        if ch.stop.try_recv().is_ok() {
            log::info!("matrix: shutting down");
            return Ok(());
        }
        // Take what is there: gateway events (coalesced into the queue) and new messages.
        let now = Instant::now();
        while core.urgent_len() < MAX_URGENT {
            match ch.gw.try_recv() {
                Ok(ev) => {
                    if ev == GatewayEvent::Connected {
                        connected = true;
                    }
                    if let (GatewayEvent::Admission { id, .. }, Some(t)) = (&ev, tracker.as_mut()) {
                        t.answered(id);
                    }
                    core.on_gateway(ev, now, gw);
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    return Err("the gateway client stopped".into());
                }
            }
        }
        while gw.pending() + 1 < max_pending {
            match ch.sync.try_recv() {
                Ok(FromSync::Ready) => synced = true,
                Ok(FromSync::Message(m, kind)) => {
                    if core.on_human(&m, kind, gw)
                        && let Some(t) = tracker.as_mut()
                    {
                        t.sent(&m.event_id);
                    }
                }
                Ok(FromSync::Batch(token)) => {
                    if let Some(t) = tracker.as_mut() {
                        t.batch(&token);
                    }
                }
                Ok(FromSync::Refused {
                    room,
                    event_id,
                    why,
                }) => core.on_refused(&room, &event_id, &why),
                Ok(FromSync::Fatal(e)) => return Err(e),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    return Err("the sync thread stopped".into());
                }
            }
        }
        if synced && connected && !announced {
            announced = true;
            on_ready();
        }
        let wake = match core.step(Instant::now(), gw) {
            Ok(Step::Worked) => continue,
            Ok(Step::Idle(wake)) => wake,
            Err(e) => return Err(format!("the homeserver refused the access token ({e})")),
        };
        // Wait for news, or until the queue or a typing refresh is due. Only readiness is
        // asked here; the loop's top takes the news with try_recv.
        let mut sel = Select::new();
        sel.recv(ch.stop);
        if core.urgent_len() < MAX_URGENT {
            sel.recv(ch.gw);
        }
        if gw.pending() + 1 < max_pending {
            sel.recv(ch.sync);
        }
        match wake {
            Some(at) => {
                let _ = sel.ready_deadline(at);
            }
            None => {
                sel.ready();
            }
        }
    }
}

#[cfg(test)]
mod tests;
