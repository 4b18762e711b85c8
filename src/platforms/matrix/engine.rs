//! The bridge's engine, apart from the I/O: human messages to the gateway, the gateway's
//! partials and results to Matrix posts and edits under the edit queue's pacing.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::message::{ChatType, Command, SessionKey};
use crate::platforms::edits::{EditLimits, EditQueue, Next};
use crate::platforms::gateway::{
    Admission, Gateway, GatewayEvent, OutgoingMessage, SendError, TerminalEvent, TerminalOutcome,
};
use crate::platforms::markdown::{Format, Piece};

use super::api::{Api, ApiError};
use super::content::{chunks_of, edit_content, new_content, partial_view};
use super::sync::{ChatKind, HumanMessage};
use super::{CHUNK_BYTES, STOPPED_MARKER};
#[cfg(test)]
pub(crate) use upload::MAX_UPLOAD_TRIES;
use upload::PostFiles;

#[path = "upload.rs"]
mod upload;

/// The calls the main loop makes on the homeserver (a trait so that the pacing rules are
/// tested against a scripted fake).
pub(crate) trait Homeserver {
    /// Sends an `m.room.message` with this transaction id; the new event's id.
    fn send(&mut self, room: &str, txn: &str, content: &Value) -> Result<String, ApiError>;
    /// Sets the bot's typing notice in `room`.
    fn typing(&mut self, room: &str, on: bool) -> Result<(), ApiError>;
    /// Moves the bot's read receipt in `room` to `event`.
    fn receipt(&mut self, room: &str, event: &str) -> Result<(), ApiError>;
    /// Uploads a reply's file for `room`: its `mxc://` URI, or `None` when the room is
    /// encrypted (its files are not uploaded in the clear).
    fn upload(&mut self, room: &str, file: &crate::Attachment) -> Result<Option<String>, ApiError>;
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
    /// Encrypts what goes into encrypted rooms.
    crypto: Option<super::crypto::Shared>,
}

impl HttpHomeserver {
    /// The homeserver as `me` through `api`; typing shown for 30 s per refresh.
    pub(super) fn new(
        api: Api,
        me: String,
        crypto: Option<super::crypto::Shared>,
    ) -> HttpHomeserver {
        HttpHomeserver {
            api,
            me,
            typing_timeout: Duration::from_secs(30),
            crypto,
        }
    }
}

impl Homeserver for HttpHomeserver {
    fn send(&mut self, room: &str, txn: &str, content: &Value) -> Result<String, ApiError> {
        if let Some(c) = &self.crypto
            && let Some(sealed) = super::crypto::lock(c).encrypt(&self.api, room, content)?
        {
            return self.api.send_event(room, "m.room.encrypted", txn, &sealed);
        }
        self.api.send_message(room, txn, content)
    }
    fn typing(&mut self, room: &str, on: bool) -> Result<(), ApiError> {
        self.api.typing(room, &self.me, on, self.typing_timeout)
    }
    fn receipt(&mut self, room: &str, event: &str) -> Result<(), ApiError> {
        self.api.receipt(room, event)
    }
    fn upload(&mut self, room: &str, file: &crate::Attachment) -> Result<Option<String>, ApiError> {
        if let Some(c) = &self.crypto
            && super::crypto::lock(c).is_encrypted(&self.api, room)?
        {
            return Ok(None);
        }
        self.api.upload(file).map(Some)
    }
}

/// A reply in progress: the human's message and what the bot has shown for it.
#[derive(Debug)]
struct Turn {
    room: String,
    /// The thread's root, when the human wrote in a thread: the reply goes there too.
    thread: Option<String>,
    sender: String,
    kind: ChatKind,
    command: bool,
    /// The bot's message carrying the reply, once posted.
    bot_event: Option<String>,
    /// What that message shows now.
    shown: Piece,
    /// The partial text it was rendered from (a cancelled reply keeps it).
    shown_text: String,
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
    /// The thread the post goes in (its root), if any.
    thread: Option<String>,
    reply_to: Option<String>,
    /// The pieces to show; the first replaces the bot's message when there is one.
    chunks: Vec<Piece>,
    next_chunk: usize,
    notice: bool,
    /// Transaction ids of the pieces after the first (fixed, so retries are idempotent).
    txn: String,
    /// The files the result carries, sent after its text (`upload.rs`).
    files: PostFiles,
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

/// What [`SyncEngine::step`] did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Sent (or dropped) one item; call again.
    Worked,
    /// Nothing to do before this instant (or before new input, when `None`).
    Idle(Option<Instant>),
}

/// The bridge's state: replies in progress and what waits to be sent to Matrix.
pub(crate) struct SyncEngine<H> {
    hs: H,
    platform: String,
    turns: HashMap<String, Turn>,
    turn_order: VecDeque<String>,
    max_turns: usize,
    queue: EditQueue<String, Post, String>,
    /// Results queued and not yet posted (a redelivered copy is not queued twice).
    queued_results: HashSet<String>,
    /// Rooms with a refusal notice waiting to be posted: one at most each; later ones are
    /// dropped until it is posted (a flood of refusals is told once, not queued).
    notice_rooms: HashSet<String>,
    typing: HashMap<String, Typing>,
    /// Receipts for messages queued behind a running turn ("I have it").
    received: super::received::Received,
    typing_refresh: Duration,
    txn_prefix: String,
    txn_counter: u64,
    backoff: Duration,
    /// Markdown rendered (`formatted_body`), or texts shown as they are.
    format: Format,
    /// What was sent.
    pub stats: Stats,
}

impl<H: Homeserver> SyncEngine<H> {
    /// A bridge core posting through `hs`.
    pub(crate) fn new(
        hs: H,
        platform: &str,
        limits: EditLimits,
        max_turns: usize,
    ) -> SyncEngine<H> {
        let started = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0);
        SyncEngine {
            hs,
            platform: platform.to_owned(),
            turns: HashMap::new(),
            turn_order: VecDeque::new(),
            max_turns: max_turns.max(1),
            queue: EditQueue::new(limits),
            queued_results: HashSet::new(),
            notice_rooms: HashSet::new(),
            typing: HashMap::new(),
            received: Default::default(),
            typing_refresh: Duration::from_secs(15),
            txn_prefix: format!("ts{started}-{}", std::process::id()),
            txn_counter: 0,
            backoff: Duration::ZERO,
            format: Format::Plain,
            stats: Stats::default(),
        }
    }

    /// This engine showing results and partials in `format` (as given: [`Format::Plain`]).
    pub(crate) fn with_format(self, format: Format) -> SyncEngine<H> {
        SyncEngine { format, ..self }
    }

    /// The homeserver, to script it.
    #[cfg(test)]
    pub(super) fn homeserver_mut(&mut self) -> &mut H {
        &mut self.hs
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
                        && t.thread == msg.thread
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
            warn_limited!(
                "matrix: {} replies in progress (the bound): forgot the state of {old}; its result will be posted as a new message",
                self.max_turns
            );
        }
        let first_txn = self.txn();
        self.turns.insert(
            msg.event_id.clone(),
            Turn {
                room: msg.room.clone(),
                thread: msg.thread.clone(),
                sender: msg.sender.clone(),
                kind,
                command: command.is_some(),
                bot_event: None,
                shown: Piece::default(),
                shown_text: String::new(),
                first_txn,
                first_uncertain: false,
                stopped: false,
            },
        );
        self.turn_order.push_back(msg.event_id.clone());
        let out = OutgoingMessage {
            id: msg.event_id.clone(),
            platform: None,
            chat_id: msg.room.clone(),
            chat_type: match kind {
                ChatKind::Dm => ChatType::Dm,
                ChatKind::Group => ChatType::Group,
            },
            user_id: Some(msg.sender.clone()),
            user_name: msg.sender_name.clone(),
            thread_id: msg.thread.clone(),
            meta: msg
                .to_bridge(&self.platform, kind)
                .get("meta")
                .map(|m| m.to_string()),
            text: msg.text.clone(),
            attachments: msg.media.iter().filter_map(|m| m.fetched.clone()).collect(),
        };
        debug_redacted!(
            "matrix: room {}: message {} to the gateway",
            msg.room,
            msg.event_id
        );
        if let Err(e) = gw.send(&out) {
            warn_limited!(
                "matrix: room {}: message {} not handed to the gateway: {e}",
                msg.room,
                msg.event_id
            );
            self.forget(&msg.event_id);
            self.notice(
                &msg.room,
                (Some(&msg.event_id), msg.thread.as_deref()),
                &format!("[not passed on: {e}]"),
            );
            return false;
        }
        true
    }

    /// A message the bridge refuses (too long): the human is told.
    pub(crate) fn on_refused(&mut self, room: &str, event_id: &str, why: &str) {
        warn_limited!("matrix: room {room}: message {event_id} refused: {why}");
        self.notice(room, (Some(event_id), None), &format!("[{why}]"));
    }

    /// A notice replying to `at`'s event, in `at`'s thread (if any).
    fn notice(&mut self, room: &str, at: (Option<&str>, Option<&str>), text: &str) {
        let (reply_to, thread) = at;
        if !self.notice_rooms.insert(room.to_owned()) {
            warn_limited!(
                "matrix: room {room}: a refusal notice already waits; this one is not queued"
            );
            return;
        }
        let txn = self.txn();
        self.queue.push_urgent(
            room,
            Post {
                id: None,
                room: room.to_owned(),
                thread: thread.map(str::to_owned),
                reply_to: reply_to.map(str::to_owned),
                chunks: chunks_of(text, Format::Plain, CHUNK_BYTES),
                next_chunk: 0,
                notice: true,
                txn,
                files: PostFiles::default(),
            },
        );
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
            GatewayEvent::Connected => info_redacted!("matrix: connected to the gateway"),
            GatewayEvent::Disconnected { reason } => {
                warn_limited!("matrix: gateway connection lost ({reason}); reconnecting");
                // Typing notices time out on the homeserver; the gateway sends them again.
                for t in self.typing.values_mut() {
                    t.sessions.clear();
                }
            }
            GatewayEvent::Error { detail } => warn_limited!("matrix: the gateway says: {detail}"),
            GatewayEvent::Admission { id, admission } => match admission {
                Admission::Accepted {
                    session, queued, ..
                } => {
                    debug_redacted!("matrix: {id} accepted in {session} (queued: {queued})");
                    if let (true, Some(t)) = (queued, self.turns.get(&id)) {
                        self.received.queued(&t.room, &id);
                    }
                }
                Admission::Duplicate { session } => {
                    debug_redacted!("matrix: {id} already accepted in {session}");
                }
                Admission::Rejected {
                    session,
                    reason,
                    detail,
                } => {
                    let at = self
                        .turns
                        .get(&id)
                        .map(|t| (t.room.clone(), t.thread.clone()));
                    warn_limited!(
                        "matrix: message {id} (session {}) rejected by the gateway: {reason}: {detail}",
                        session.as_deref().unwrap_or("-")
                    );
                    self.forget(&id);
                    if let Some((room, thread)) = at {
                        self.notice(
                            &room,
                            (Some(&id), thread.as_deref()),
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
                let room = turn.room.clone();
                self.queue.push_edit(&room, id, text, now);
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
            debug_redacted!("matrix: {id}: a second copy of a queued result dropped");
            return;
        }
        self.queue.cancel_edit(&id);
        let (room, thread, shown, command) = match self.turns.get(&id) {
            Some(t) => (
                t.room.clone(),
                t.thread.clone(),
                t.shown_text.clone(),
                t.command,
            ),
            None => match session.parse::<SessionKey>() {
                // A result of a message this process did not send (it restarted): the room
                // is in the session key, the human's event is the id.
                Ok(key) if key.platform() == self.platform => (
                    key.chat_id().to_owned(),
                    key.thread_id().map(str::to_owned),
                    String::new(),
                    false,
                ),
                _ => {
                    warn_limited!(
                        "matrix: result {id} for session {session}: not a Matrix room; confirmed without posting"
                    );
                    gw.delivered(&id);
                    return;
                }
            },
        };
        let text = match &outcome {
            // The files go as files (`upload.rs`), after the text.
            TerminalOutcome::Reply { .. } => outcome.text_without_files(),
            TerminalOutcome::Merged { .. } | TerminalOutcome::Ignored => None,
            TerminalOutcome::Cancelled { reason } => {
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
            TerminalOutcome::Failed { .. } => match outcome.chat_text() {
                Some(t) if !shown.is_empty() => Some(format!("{shown}\n\n{t}")),
                other => other,
            },
        };
        debug_redacted!(
            "matrix: room {room}: result of {id} ({}{})",
            match &outcome {
                TerminalOutcome::Reply { .. } => "reply",
                TerminalOutcome::Cancelled { .. } => "cancelled",
                TerminalOutcome::Failed { .. } => "failed",
                TerminalOutcome::Merged { .. } => "merged",
                TerminalOutcome::Ignored => "ignored",
            },
            if redelivery { ", redelivered" } else { "" }
        );
        let files = PostFiles::new(outcome.files());
        let Some(text) = text.filter(|t| !t.trim().is_empty() || !files.done()) else {
            self.forget(&id);
            gw.delivered(&id);
            return;
        };
        if let Some(t) = self.turns.get_mut(&id) {
            t.stopped = true; // no partial after the final
        }
        self.queued_results.insert(id.clone());
        let txn = self.txn();
        self.queue.push_urgent(
            &room.clone(),
            Post {
                id: Some(id.clone()),
                room,
                thread,
                reply_to: Some(id),
                chunks: chunks_of(&text, self.format, CHUNK_BYTES),
                next_chunk: 0,
                notice: command,
                txn,
                files,
            },
        );
    }

    fn finish(&mut self, post: &Post, gw: &mut impl GatewaySide) {
        if post.id.is_none() {
            self.notice_rooms.remove(&post.room);
        }
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
            if let Some((room, event)) = self.received.next() {
                self.send_receipt(&room, &event, now)?;
                return Ok(Step::Worked);
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
            Err(e) => debug_redacted!("matrix: room {room}: typing notice failed: {e}"),
        }
        Ok(Some(Step::Worked))
    }

    /// A receipt for a queued message still waiting (best effort, never retried).
    fn send_receipt(&mut self, room: &str, event: &str, now: Instant) -> Result<(), ApiError> {
        if !self.turns.contains_key(event) {
            return Ok(()); // answered already: the reply says more than a receipt
        }
        match self.hs.receipt(room, event) {
            Ok(()) => debug_redacted!("matrix: room {room}: queued message {event} receipted"),
            Err(e @ ApiError::RateLimited(_)) => self.failed(room, &e, now)?,
            Err(e) if e.is_unauthorized() => return Err(e),
            Err(e) => debug_redacted!("matrix: room {room}: a receipt failed: {e}"),
        }
        Ok(())
    }

    fn send_edit(&mut self, id: String, text: String, now: Instant) -> Result<(), ApiError> {
        let Some(turn) = self.turns.get(&id) else {
            return Ok(());
        };
        if turn.stopped {
            return Ok(());
        }
        let view = partial_view(&text, self.format);
        if view.plain.trim().is_empty() {
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
                new_content(&view, false, Some(&id), turn.thread.as_deref()),
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
                            Piece::default()
                        } else {
                            view
                        };
                        t.bot_event = Some(event);
                    } else {
                        self.stats.edits += 1;
                        t.shown = view;
                    }
                    t.shown_text = if t.shown.plain.is_empty() {
                        String::new()
                    } else {
                        text
                    };
                }
                debug_redacted!(
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
                    self.queue.requeue_edit(&room, id, text, now);
                } else {
                    warn_limited!(
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
            return self.send_file(post, now, gw);
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
                new_content(
                    &chunk,
                    post.notice,
                    post.reply_to.as_deref(),
                    post.thread.as_deref(),
                ),
            ),
            (None, false) => (
                format!("{}-{}", post.txn, post.next_chunk),
                new_content(&chunk, post.notice, None, post.thread.as_deref()),
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
                debug_redacted!(
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
                    let room = post.room.clone();
                    self.queue.requeue_urgent(&room, post);
                } else {
                    warn_limited!(
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
        if post.next_chunk >= post.chunks.len() && post.files.done() {
            self.finish(&post, gw);
        } else {
            let room = post.room.clone();
            self.queue.continue_urgent(&room, post);
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
                    warn_limited!(
                        "matrix: room {room}: rate limited repeatedly; sending only final replies (no edits) until it stops"
                    );
                } else {
                    info_redacted!("matrix: room {room}: rate limited, waiting {wait:?}");
                }
                Ok(())
            }
            e if e.is_transient() => {
                self.backoff =
                    (self.backoff * 2).clamp(Duration::from_millis(250), Duration::from_secs(30));
                warn_limited!(
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
