//! The [`Renderer`]: gateway results, partials, notices and typing as Bot API calls, in
//! order of urgency and under the rate limits.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::api::{ApiError, BotApi, chat_param, send_params};
use super::received::Received;
use super::topics::{in_topic, topic_of_session};
use super::update::{chat_of, reply_target};
use super::upload::{MAX_UPLOAD_TRIES, Outgoing, UPLOAD_TIMEOUT, not_sent};
use super::{CALL_TIMEOUT, MAX_BACKOFF};
use crate::platforms::BridgeError;
use crate::platforms::gateway::{TerminalEvent, TerminalOutcome};
use crate::platforms::markdown::{self, Format};
use crate::platforms::split::{TELEGRAM_LIMIT, split};

/// Rate-limit strikes on one reply after which its partials are no longer shown.
pub(super) const MAX_STRIKES: u32 = 3;
/// Rejection notices waiting to be sent at most.
pub(crate) const MAX_NOTICES: usize = 1000;
/// Replies waiting to be shown at most, as a multiple of `max_views`.
pub(crate) const MAX_PENDING_FACTOR: usize = 4;

/// One reply being shown: the Telegram messages it spans and what is still to show.
#[derive(Debug)]
struct View {
    chat_id: String,
    /// The forum topic the reply goes in, if any.
    topic: Option<i64>,
    reply_to: Option<i64>,
    /// Messages posted so far and the text each shows.
    posted: Vec<(i64, String)>,
    /// The newest partial not shown yet (older ones are dropped).
    partial: Option<String>,
    /// The result, once it came: shown before any partial of any reply.
    result: Option<String>,
    last_edit: Option<Instant>,
    strikes: u32,
    /// The text the posted pieces were rendered from (a cancelled reply keeps it).
    source: String,
    /// The result's files still to send, after its text (issue 36).
    files: VecDeque<Outgoing>,
    /// Lines for files that could not be sent, told in the chat after the last one.
    file_notes: Vec<String>,
}

impl View {
    /// The text the reply should show now: its result (`final_`) or newest partial; never
    /// empty (Telegram refuses an empty message).
    fn text_to_show(&self, final_: bool) -> String {
        let text = if final_ {
            self.result.clone()
        } else {
            self.partial.clone()
        }
        .unwrap_or_default();
        if text.trim().is_empty() {
            "[empty reply]".to_owned()
        } else {
            text
        }
    }

    /// Shows piece `i` (Telegram HTML with `html`): edits the message already posted for
    /// it, or posts a new one (the first replying to the user's message). Returns the
    /// message's id.
    fn show_piece(
        &self,
        api: &mut dyn BotApi,
        i: usize,
        piece: &str,
        html: bool,
    ) -> Result<i64, ApiError> {
        if let Some((message_id, _)) = self.posted.get(i) {
            let mut params = json!({
                "chat_id": chat_param(&self.chat_id), "message_id": message_id, "text": piece,
            });
            if html {
                params["parse_mode"] = json!("HTML");
            }
            return api
                .call("editMessageText", &params, CALL_TIMEOUT)
                .map(|_| *message_id);
        }
        let reply_to = if i == 0 { self.reply_to } else { None };
        let mut params = send_params(&self.chat_id, piece, reply_to);
        in_topic(&mut params, self.topic);
        if html {
            params["parse_mode"] = json!("HTML");
        }
        api.call("sendMessage", &params, CALL_TIMEOUT)
            .and_then(|m| {
                m.get("message_id").and_then(Value::as_i64).ok_or_else(|| {
                    ApiError::Transient("sendMessage: the answer has no message_id".into())
                })
            })
    }

    /// Piece `i` now shows `piece` in message `message_id`.
    fn record(&mut self, i: usize, message_id: i64, piece: &str) {
        if i < self.posted.len() {
            self.posted[i].1 = piece.to_owned();
        } else {
            self.posted.push((message_id, piece.to_owned()));
        }
    }
}

/// A text for a chat that is not a reply (a rejection): sent before partials.
#[derive(Debug)]
struct Notice {
    chat_id: String,
    topic: Option<i64>,
    reply_to: Option<i64>,
    text: String,
    /// Later notices for the same chat folded into this one while it waited.
    more: usize,
}

/// What [`Renderer::step`] did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Nothing to do before this instant (or before a new event, when `None`).
    Idle(Option<Instant>),
    /// Made progress; these results are now fully shown (confirm them to the gateway).
    Worked(Vec<String>),
}

/// The reply side of the bridge: turns gateway events into Bot API calls, under the rate
/// limits. Separate from the I/O so that its choices (what goes first, what is coalesced)
/// are tested with a scripted API.
#[derive(Debug)]
pub(crate) struct Renderer {
    views: HashMap<String, View>,
    /// Ids in arrival order (a chat's replies go out in this order).
    order: VecDeque<String>,
    /// Chats with a reply, in the order their turn comes: replies are served one chat at a
    /// time, so one chat's burst of replies cannot hold another chat's first one.
    round: VecDeque<String>,
    notices: VecDeque<Notice>,
    /// Chats (and forum topics) whose typing indicator should be (re)sent.
    typing: VecDeque<(String, Option<i64>)>,
    /// Queued messages to mark ("I have it"): the lowest-priority calls.
    pub(super) received: Received,
    paused_until: Option<Instant>,
    backoff: Duration,
    edit_interval: Duration,
    max_views: usize,
    format: Format,
}

impl Renderer {
    /// An empty renderer, showing texts as they are ([`Format::Plain`]; see
    /// [`with_format`](Self::with_format)).
    pub(crate) fn new(edit_interval: Duration, max_views: usize) -> Renderer {
        Renderer {
            views: HashMap::new(),
            order: VecDeque::new(),
            round: VecDeque::new(),
            notices: VecDeque::new(),
            typing: VecDeque::new(),
            received: Received::default(),
            paused_until: None,
            backoff: Duration::from_secs(1),
            edit_interval,
            max_views: max_views.max(1),
            format: Format::Plain,
        }
    }

    /// This renderer showing replies in `format` (Markdown as Telegram HTML, or plain).
    pub(crate) fn with_format(self, format: Format) -> Renderer {
        Renderer { format, ..self }
    }

    /// A partial reply: kept as the newest text to show for `id` (older pending ones go).
    pub(crate) fn partial(&mut self, id: &str, session: &str, text: &str) {
        if let Some(view) = self.views.get_mut(id) {
            if view.result.is_none() && view.strikes < MAX_STRIKES {
                view.partial = Some(text.to_owned());
            }
            return;
        }
        if self.views.len() >= self.max_views {
            debug_redacted!(
                "telegram: {} replies streaming; partial of {id} not shown",
                self.max_views
            );
            return;
        }
        let Some(chat_id) = chat_of(session) else {
            return;
        };
        let topic = topic_of_session(session);
        self.insert_view(id, (chat_id, topic), Some(text.to_owned()), None);
    }

    /// A result to show for `id`; `false` when there is nothing to show (a merge), and the
    /// result is handled already.
    pub(crate) fn result(&mut self, result: &TerminalEvent) -> bool {
        // A reply's files are uploaded after its text (`send_files`), not named in it.
        let Some(mut text) = result.outcome.text_without_files() else {
            return false;
        };
        let files: VecDeque<Outgoing> = result
            .outcome
            .files()
            .iter()
            .cloned()
            .map(Outgoing::new)
            .collect();
        if let Some(view) = self.views.get_mut(&result.id) {
            view.files = files;
            // A turn cancelled or failed after partials were shown keeps what was shown,
            // with the marker appended as its last edit.
            if !matches!(result.outcome, TerminalOutcome::Reply { .. }) && !view.posted.is_empty() {
                text = format!("{}\n{text}", view.source);
            }
            view.partial = None;
            view.result = Some(text);
            return true;
        }
        let Some(chat_id) = chat_of(&result.session) else {
            error_limited!(
                "telegram: result {} has a session key that names no chat ({}); dropped",
                result.id,
                result.session
            );
            return false;
        };
        let topic = topic_of_session(&result.session);
        self.insert_view(&result.id, (chat_id, topic), None, Some(text));
        if let Some(view) = self.views.get_mut(&result.id) {
            view.files = files;
        }
        true
    }

    fn insert_view(
        &mut self,
        id: &str,
        (chat_id, topic): (String, Option<i64>),
        partial: Option<String>,
        result: Option<String>,
    ) {
        if !self.round.contains(&chat_id) {
            self.round.push_back(chat_id.clone());
        }
        debug_assert!(self.round.iter().filter(|c| **c == chat_id).count() == 1);
        self.views.insert(
            id.to_owned(),
            View {
                chat_id,
                topic,
                reply_to: reply_target(id),
                posted: Vec::new(),
                partial,
                result,
                last_edit: None,
                strikes: 0,
                source: String::new(),
                files: VecDeque::new(),
                file_notes: Vec::new(),
            },
        );
        self.order.push_back(id.to_owned());
    }

    /// Forgets reply `id`, and its chat's turn when it was the chat's last reply.
    fn remove_view(&mut self, id: &str) {
        let Some(view) = self.views.remove(id) else {
            return;
        };
        self.order.retain(|o| o != id);
        if !self.views.values().any(|v| v.chat_id == view.chat_id) {
            self.round.retain(|c| *c != view.chat_id);
        }
        debug_assert!(self.round.len() <= self.views.len());
    }

    /// The oldest reply matching `pick` of the first chat in the round that has one; that
    /// chat's turn moves to the end of the round.
    fn next_in_round(&mut self, pick: impl Fn(&View) -> bool) -> Option<String> {
        let mut first_of_chat: HashMap<&str, &str> = HashMap::new();
        for id in &self.order {
            if let Some(view) = self.views.get(id)
                && pick(view)
            {
                first_of_chat
                    .entry(view.chat_id.as_str())
                    .or_insert(id.as_str());
            }
        }
        let at = self
            .round
            .iter()
            .position(|c| first_of_chat.contains_key(c.as_str()))?;
        let id = first_of_chat.get(self.round[at].as_str())?.to_string();
        if let Some(chat) = self.round.remove(at) {
            self.round.push_back(chat);
        }
        Some(id)
    }

    /// A typing event for a chat (in a forum topic, when its session is one).
    pub(crate) fn typing(&mut self, chat_id: &str, session: &str, on: bool) {
        let at = (chat_id.to_owned(), topic_of_session(session));
        self.typing.retain(|c| *c != at);
        if on {
            self.typing.push_back(at);
        }
    }

    /// A text for a chat outside any reply (a rejection). At most [`MAX_NOTICES`] wait; past
    /// that the oldest is dropped with a WARN (its rejection was logged when it happened).
    pub(crate) fn notice(
        &mut self,
        (chat_id, topic): (&str, Option<i64>),
        reply_to: Option<i64>,
        text: &str,
    ) {
        // Coalesced per chat: one notice waits per chat, the others are counted in it, so a
        // flood of refusals costs a chat one message, not one each.
        if let Some(waiting) = self.notices.iter_mut().find(|n| n.chat_id == chat_id) {
            waiting.more += 1;
            return;
        }
        if self.notices.len() >= MAX_NOTICES
            && let Some(old) = self.notices.pop_front()
        {
            warn_limited!(
                "telegram: {MAX_NOTICES} notices waiting; the oldest, for chat {}, is dropped",
                old.chat_id
            );
        }
        self.notices.push_back(Notice {
            chat_id: chat_id.to_owned(),
            topic,
            reply_to,
            text: text.to_owned(),
            more: 0,
        });
    }

    /// Notices waiting to be sent.
    #[cfg(test)]
    pub(super) fn notices_waiting(&self) -> usize {
        self.notices.len()
    }

    /// Whether more gateway events may be taken: replies waiting to be shown stay under
    /// [`MAX_PENDING_FACTOR`] times `max_views`, so a Bot API that is down for long makes the
    /// gateway keep its results (it owes them until `delivered`) instead of this process.
    pub(crate) fn has_room(&self) -> bool {
        self.views.len() < self.max_views.saturating_mul(MAX_PENDING_FACTOR)
    }

    /// Does the most urgent piece of work: a notice, then a result, then a due partial, then
    /// a typing indicator. Errors other than an unauthorized token are handled here (a
    /// pause, a retry later, or — for a call that can never work — a WARN and moving on).
    pub(crate) fn step(&mut self, api: &mut dyn BotApi, now: Instant) -> Result<Step, BridgeError> {
        if let Some(until) = self.paused_until {
            if until > now {
                return Ok(Step::Idle(Some(until)));
            }
            self.paused_until = None;
        }
        if !self.notices.is_empty() {
            return self.send_notice(api, now);
        }
        // A result, or the first line of a reply not shown yet, goes before the edits of
        // replies already shown; the chats take turns.
        if let Some(id) = self
            .next_in_round(|v| v.result.is_some() || (v.posted.is_empty() && v.partial.is_some()))
        {
            let final_ = self.views.get(&id).is_some_and(|v| v.result.is_some());
            return self.render(api, &id, now, final_);
        }
        let (due, next_due) = self.due_partial(now);
        if let Some(id) = due {
            return self.render(api, &id, now, false);
        }
        if let Some(at) = self.typing.pop_front() {
            self.send_typing(api, at, now)?;
            return Ok(Step::Worked(Vec::new()));
        }
        // Nothing else is due now: a mark costs a reply at most one call's wait.
        if let Some((chat_id, params)) = self.received.next() {
            self.send_mark(api, &chat_id, &params, now)?;
            return Ok(Step::Worked(Vec::new()));
        }
        Ok(Step::Idle(next_due))
    }

    /// Sends the oldest notice; it stays first in line when the call is to be retried.
    fn send_notice(&mut self, api: &mut dyn BotApi, now: Instant) -> Result<Step, BridgeError> {
        let Some(notice) = self.notices.front() else {
            return Ok(Step::Worked(Vec::new()));
        };
        let text = match notice.more {
            0 => notice.text.clone(),
            n => format!("{} (and {n} more message(s) not accepted)", notice.text),
        };
        let mut params = send_params(&notice.chat_id, &text, notice.reply_to);
        in_topic(&mut params, notice.topic);
        if let Err(e) = api.call("sendMessage", &params, CALL_TIMEOUT) {
            let what = format!("notice to chat {}", notice.chat_id);
            if !self.handle_error(&e, now, &what)? {
                return Ok(Step::Worked(Vec::new()));
            }
        }
        self.backoff = Duration::from_secs(1);
        self.notices.pop_front();
        Ok(Step::Worked(Vec::new()))
    }

    /// A reply with a partial whose edit interval has passed (the chats taking turns), and
    /// otherwise when the next one will be due.
    fn due_partial(&mut self, now: Instant) -> (Option<String>, Option<Instant>) {
        let interval = self.edit_interval;
        let due_at = move |v: &View| v.last_edit.map_or(now, |t| t + interval);
        if let Some(id) = self.next_in_round(|v| v.partial.is_some() && due_at(v) <= now) {
            return (Some(id), None);
        }
        let next_due = self
            .views
            .values()
            .filter(|v| v.partial.is_some())
            .map(due_at)
            .min();
        (None, next_due)
    }

    /// Shows the typing indicator in `chat_id`.
    fn send_typing(
        &mut self,
        api: &mut dyn BotApi,
        (chat_id, topic): (String, Option<i64>),
        now: Instant,
    ) -> Result<(), BridgeError> {
        let mut params = json!({"chat_id": chat_param(&chat_id), "action": "typing"});
        in_topic(&mut params, topic);
        if let Err(e) = api.call("sendChatAction", &params, CALL_TIMEOUT) {
            // Best effort: a lost typing indicator is not retried (the gateway refreshes
            // it), but a rate limit still pauses everything.
            if let ApiError::RetryAfter(_) | ApiError::Unauthorized(_) = e {
                self.handle_error(&e, now, &format!("typing in chat {chat_id}"))?;
            } else {
                debug_redacted!("telegram: typing in chat {chat_id} failed: {e}");
            }
        }
        Ok(())
    }

    /// Marks a queued message (best effort: never retried; a rate limit still pauses).
    fn send_mark(
        &mut self,
        api: &mut dyn BotApi,
        chat_id: &str,
        params: &Value,
        now: Instant,
    ) -> Result<(), BridgeError> {
        match api.call("setMessageReaction", params, CALL_TIMEOUT) {
            Ok(_) => debug_redacted!("telegram: a queued message of chat {chat_id} marked"),
            Err(e @ (ApiError::RetryAfter(_) | ApiError::Unauthorized(_))) => {
                self.handle_error(&e, now, &format!("a mark in chat {chat_id}"))?;
            }
            Err(e) => debug_redacted!("telegram: a mark in chat {chat_id} failed: {e}"),
        }
        Ok(())
    }

    /// Handles a failed call: `Ok(true)` when the work should be dropped (it can never
    /// succeed), `Ok(false)` when it is kept for later.
    fn handle_error(
        &mut self,
        e: &ApiError,
        now: Instant,
        what: &str,
    ) -> Result<bool, BridgeError> {
        // A wait counts from the answer, not from when the call started.
        let now = now.max(Instant::now());
        match e {
            ApiError::RetryAfter(d) => {
                warn_limited!("telegram: rate limited ({what}); waiting {d:?} as asked");
                self.paused_until = Some(now + *d);
                Ok(false)
            }
            ApiError::Transient(d) => {
                warn_limited!(
                    "telegram: {what} failed: {d}; retrying in {:?}",
                    self.backoff
                );
                self.paused_until = Some(now + self.backoff);
                self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
                Ok(false)
            }
            ApiError::Permanent(d) => {
                warn_limited!("telegram: {what} refused: {d}; not retried");
                Ok(true)
            }
            ApiError::Unauthorized(d) => Err(format!("the Bot API refused the bot token: {d}")),
        }
    }

    /// Brings the Telegram messages of reply `id` to its result (`final_`) or newest partial.
    fn render(
        &mut self,
        api: &mut dyn BotApi,
        id: &str,
        now: Instant,
        final_: bool,
    ) -> Result<Step, BridgeError> {
        let Some(view) = self.views.get_mut(id) else {
            return Ok(Step::Worked(Vec::new()));
        };
        view.source = view.text_to_show(final_);
        let html = self.format == Format::Markdown;
        let pieces: Vec<String> = if html {
            markdown::telegram(&view.source)
        } else {
            split(&view.source, TELEGRAM_LIMIT)
                .into_iter()
                .map(str::to_owned)
                .collect()
        };
        // A result that is only files shows no text of its own.
        let files_only = final_
            && !view.files.is_empty()
            && view.result.as_deref().is_some_and(|t| t.trim().is_empty());
        let pieces = if files_only {
            Vec::new()
        } else if pieces.is_empty() {
            vec!["[empty reply]".to_owned()]
        } else {
            pieces
        };
        let what = format!("reply {id} in chat {}", view.chat_id);
        for (i, piece) in pieces.iter().enumerate() {
            if view.posted.get(i).is_some_and(|(_, shown)| shown == piece) {
                continue;
            }
            match view.show_piece(api, i, piece, html) {
                Ok(message_id) => {
                    view.record(i, message_id, piece);
                    self.backoff = Duration::from_secs(1);
                }
                Err(ApiError::Permanent(d)) if d.contains("message is not modified") => {
                    if i < view.posted.len() {
                        view.posted[i].1 = piece.clone();
                    }
                }
                Err(e) => return self.piece_failed(id, i, final_, &e, now, &what),
            }
        }
        if final_ && let Some(wait) = self.send_files(api, id, now)? {
            return Ok(wait);
        }
        self.rendered(id, now, final_)
    }

    /// Sends reply `id`'s files once its text is shown, one upload each (issue 36): `Some`
    /// while one waits to be tried again; `None` once every file is sent or given up, a
    /// file given up told in the chat (never retried forever: [`MAX_UPLOAD_TRIES`]).
    fn send_files(
        &mut self,
        api: &mut dyn BotApi,
        id: &str,
        now: Instant,
    ) -> Result<Option<Step>, BridgeError> {
        loop {
            let Some(view) = self.views.get_mut(id) else {
                return Ok(None);
            };
            let Some(next) = view.files.front_mut() else {
                return self.send_file_notes(api, id, now);
            };
            let (method, field) = match next.method() {
                Ok(call) => call,
                Err(why) => {
                    let note = not_sent(&next.file, &why);
                    view.files.pop_front();
                    view.file_notes.push(note);
                    continue;
                }
            };
            let mut params = json!({"chat_id": chat_param(&view.chat_id)});
            in_topic(&mut params, view.topic);
            let what = format!(
                "file {} of reply {id} in chat {}",
                next.file.name, view.chat_id
            );
            match api.upload(method, &params, field, &next.file, UPLOAD_TIMEOUT) {
                Ok(_) => {
                    debug_redacted!("telegram: {what} sent ({method})");
                    view.files.pop_front();
                    self.backoff = Duration::from_secs(1);
                }
                Err(ApiError::Permanent(d)) if method == "sendPhoto" => {
                    debug_redacted!("telegram: {what}: {d}; sending it as a document");
                    next.as_document = true;
                }
                Err(e @ ApiError::Permanent(_)) => {
                    warn_limited!("telegram: {what} refused: {e}; the chat is told");
                    view.file_notes.push(not_sent(&next.file, &e.to_string()));
                    view.files.pop_front();
                }
                Err(e) => {
                    next.tries += 1;
                    if next.tries >= MAX_UPLOAD_TRIES {
                        warn_limited!(
                            "telegram: {what} failed {MAX_UPLOAD_TRIES} times ({e}); the chat is told"
                        );
                        let why = format!("failed {MAX_UPLOAD_TRIES} times: {e}");
                        view.file_notes.push(not_sent(&next.file, &why));
                        view.files.pop_front();
                    }
                    self.handle_error(&e, now, &what)?;
                    return Ok(Some(Step::Worked(Vec::new())));
                }
            }
        }
    }

    /// Tells the chat of reply `id` which files could not be sent, in one message.
    fn send_file_notes(
        &mut self,
        api: &mut dyn BotApi,
        id: &str,
        now: Instant,
    ) -> Result<Option<Step>, BridgeError> {
        let Some(view) = self.views.get_mut(id) else {
            return Ok(None);
        };
        if view.file_notes.is_empty() {
            return Ok(None);
        }
        let mut params = send_params(&view.chat_id, &view.file_notes.join("\n"), None);
        in_topic(&mut params, view.topic);
        let what = format!("the files' notice of reply {id} in chat {}", view.chat_id);
        match api.call("sendMessage", &params, CALL_TIMEOUT) {
            Ok(_) => view.file_notes.clear(),
            Err(e) => {
                if !self.handle_error(&e, now, &what)? {
                    return Ok(Some(Step::Worked(Vec::new())));
                }
                if let Some(view) = self.views.get_mut(id) {
                    view.file_notes.clear();
                }
            }
        }
        Ok(None)
    }

    /// A piece of reply `id` could not be shown: a rate limit is a strike against its
    /// partials; a refusal for good gives the piece up ([`give_up`](Self::give_up)).
    fn piece_failed(
        &mut self,
        id: &str,
        at: usize,
        final_: bool,
        e: &ApiError,
        now: Instant,
        what: &str,
    ) -> Result<Step, BridgeError> {
        if let (ApiError::RetryAfter(_), Some(view)) = (e, self.views.get_mut(id)) {
            view.strikes += 1;
            if view.strikes >= MAX_STRIKES && view.partial.take().is_some() {
                warn_limited!(
                    "telegram: {what}: rate limited {MAX_STRIKES} times; only its final text will be shown"
                );
            }
        }
        let permanent = matches!(e, ApiError::Permanent(_));
        let drop = self.handle_error(e, now, what)?;
        if permanent && drop {
            return Ok(self.give_up(id, at, final_));
        }
        Ok(Step::Worked(Vec::new()))
    }

    /// Every piece of reply `id` shows its text: a result is done (confirm it), a partial
    /// waits for the next edit interval.
    fn rendered(&mut self, id: &str, now: Instant, final_: bool) -> Result<Step, BridgeError> {
        let view = self
            .views
            .get_mut(id)
            .ok_or_else(|| "internal: view vanished".to_owned())?;
        view.last_edit = Some(now);
        if final_ {
            self.remove_view(id);
            return Ok(Step::Worked(vec![id.to_owned()]));
        }
        view.partial = None;
        Ok(Step::Worked(Vec::new()))
    }

    /// A call for reply `id` was refused for good at piece `at`: an edit is replaced by a new
    /// message (the old one may be gone or too old to edit); a new message that cannot be
    /// sent ends the reply (logged: the chat is gone or the bot was removed).
    fn give_up(&mut self, id: &str, at: usize, final_: bool) -> Step {
        let Some(view) = self.views.get_mut(id) else {
            return Step::Worked(Vec::new());
        };
        if at < view.posted.len() {
            // Edit refused: post the rest as new messages from here on.
            view.posted.truncate(at);
            view.reply_to = None;
            return Step::Worked(Vec::new());
        }
        if at == 0 && view.reply_to.is_some() {
            // The message replied to may be deleted: try once more without replying.
            view.reply_to = None;
            return Step::Worked(Vec::new());
        }
        warn_limited!(
            "telegram: reply {id} cannot be shown in chat {}; dropped",
            view.chat_id
        );
        if final_ {
            self.remove_view(id);
            Step::Worked(vec![id.to_owned()])
        } else {
            view.partial = None;
            view.strikes = MAX_STRIKES;
            Step::Worked(Vec::new())
        }
    }
}
