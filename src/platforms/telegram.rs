//! `turnstile bridge telegram`: a Telegram bot in front of the gateway, over the Bot API
//! (blocking HTTPS through ureq).
//!
//! - **Updates**: one thread long-polls `getUpdates` (`offset`, `timeout`). Each text message
//!   is handed to the gateway and the offset moves past it only once the gateway answered it
//!   (`ack` or `reject`); with `--state-dir` the offset is written (atomically) before the
//!   next poll, so a restarted bridge processes no update twice and loses none. The gateway
//!   id is `tg-<update_id>-<message_id>`: an update polled again after a crash carries the
//!   same id and the gateway answers `duplicate`. Private chats are `dm`, groups and
//!   supergroups `group` (keyed per sender); other updates are skipped (and confirmed).
//! - **Replies**: the first partial (or the result) is a `sendMessage` replying to the
//!   user's message, later partials and the result `editMessageText` (identical text is never
//!   sent; only the newest pending text per reply is kept). A text over 4,096 UTF-16 units
//!   fills the message and continues in a new one. Results and rejections go before partial
//!   edits; after three rate-limit strikes on one reply its partials stop and only the result
//!   is shown. `typing` events become `sendChatAction`.
//! - **Limits**: a 429 stops every call for its `retry_after` (capped at
//!   [`MAX_RETRY_AFTER`]); other failures back off exponentially up to 30 s. Replies streamed
//!   at once are bounded ([`TelegramConfig::max_views`]: partials beyond are not shown; results
//!   always are).
//! - The bot token is part of every API URL: it is never logged, and every error text is
//!   passed through [`redact`].

use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, bounded, select};
use serde_json::{Value, json};

use super::gateway::{
    Admission, Gateway, GatewayConfig, GatewayEvent, Outcome, OutgoingMessage, SendError,
    TerminalEvent,
};
use super::split::{TELEGRAM_LIMIT, split};
use super::{BridgeError, map_command};
use crate::message::{ChatType, SessionKey};

/// The longest `retry_after` honoured as given; a longer one is waited in this much.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(300);
/// Longest API response body read (a full `getUpdates` batch of 100 updates fits).
const MAX_RESPONSE_BYTES: u64 = 32 << 20;
/// Time a non-polling API call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest wait after a failed call (doubling from 1 s).
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// Rate-limit strikes on one reply after which its partials are no longer shown.
const MAX_STRIKES: u32 = 3;
/// Rejection notices waiting to be sent at most.
pub const MAX_NOTICES: usize = 1000;
/// Replies waiting to be shown at most, as a multiple of `max_views`.
pub const MAX_PENDING_FACTOR: usize = 4;
/// How long the poller waits for the gateway's answer before asking again.
const ANSWER_WAIT: Duration = Duration::from_secs(30);

/// Settings of the Telegram bridge.
#[derive(Clone)]
pub struct TelegramConfig {
    /// The gateway (platform `telegram`).
    pub gateway: GatewayConfig,
    /// Base URL of the Bot API, `https://api.telegram.org` (no trailing slash needed).
    pub api_base: String,
    /// The bot token. Never logged.
    pub bot_token: String,
    /// Where the update offset is kept; `None`: in memory only.
    pub state_dir: Option<PathBuf>,
    /// How long one `getUpdates` waits for updates.
    pub poll_timeout: Duration,
    /// Least time between two partial edits of one reply.
    pub edit_interval: Duration,
    /// Replies streamed (partials shown) at once.
    pub max_views: usize,
}

impl std::fmt::Debug for TelegramConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TelegramConfig")
            .field("gateway", &self.gateway)
            .field("api_base", &self.api_base)
            .field("bot_token", &"<redacted>")
            .field("state_dir", &self.state_dir)
            .field("poll_timeout", &self.poll_timeout)
            .finish_non_exhaustive()
    }
}

impl TelegramConfig {
    /// Defaults: 30 s long polls, one partial edit per second per reply, 256 streamed
    /// replies.
    pub fn new(gateway: GatewayConfig, api_base: &str, bot_token: &str) -> TelegramConfig {
        TelegramConfig {
            gateway,
            api_base: api_base.trim_end_matches('/').to_owned(),
            bot_token: bot_token.to_owned(),
            state_dir: None,
            poll_timeout: Duration::from_secs(30),
            edit_interval: Duration::from_secs(1),
            max_views: 256,
        }
    }
}

/// Replaces the bot token in `text` (an error quoting a URL) with `<bot-token>`.
pub fn redact(text: &str, token: &str) -> String {
    if token.is_empty() {
        text.to_owned()
    } else {
        text.replace(token, "<bot-token>")
    }
}

/// How a Bot API call failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ApiError {
    /// 429: call nothing before this much time passed.
    RetryAfter(Duration),
    /// 401 or 404 on the bot's URL: the token is wrong. Fatal.
    Unauthorized(String),
    /// Another 4xx: this call will never work (chat gone, message not editable, …).
    Permanent(String),
    /// Network trouble or a 5xx: try again later.
    Transient(String),
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ApiError::RetryAfter(d) => write!(f, "rate limited for {d:?}"),
            ApiError::Unauthorized(d) | ApiError::Permanent(d) | ApiError::Transient(d) => {
                f.write_str(d)
            }
        }
    }
}

/// The Bot API as the bridge uses it: one method call, JSON in, the `result` out.
pub trait BotApi {
    /// Calls `method` with `params`, waiting at most `timeout`.
    fn call(&mut self, method: &str, params: &Value, timeout: Duration) -> Result<Value, ApiError>;
}

/// The real Bot API over ureq.
pub struct HttpBotApi {
    agent: ureq::Agent,
    base: String,
    token: Arc<str>,
}

impl HttpBotApi {
    /// A client of `base` (e.g. `https://api.telegram.org`) for the bot `token`.
    pub fn new(base: &str, token: &str) -> HttpBotApi {
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .user_agent(concat!("turnstile/", env!("CARGO_PKG_VERSION")))
            .tls_config(
                ureq::tls::TlsConfig::builder()
                    .root_certs(ureq::tls::RootCerts::PlatformVerifier)
                    .build(),
            )
            .build();
        HttpBotApi {
            agent: ureq::Agent::new_with_config(config),
            base: base.trim_end_matches('/').to_owned(),
            token: token.into(),
        }
    }
}

impl BotApi for HttpBotApi {
    fn call(&mut self, method: &str, params: &Value, timeout: Duration) -> Result<Value, ApiError> {
        let url = format!("{}/bot{}/{method}", self.base, self.token);
        let transient = |e: String| ApiError::Transient(redact(&e, &self.token));
        log::debug!("telegram: calling {method}");
        let response = self
            .agent
            .post(&url)
            .config()
            .timeout_global(Some(timeout))
            .build()
            .header("Content-Type", "application/json")
            .send(params.to_string())
            .map_err(|e| transient(format!("{method}: {e}")))?;
        let status = response.status().as_u16();
        let body = response
            .into_body()
            .with_config()
            .limit(MAX_RESPONSE_BYTES)
            .read_to_string()
            .map_err(|e| transient(format!("{method}: reading the answer failed: {e}")))?;
        interpret(method, status, &body).map_err(|e| match e {
            ApiError::Transient(d) => ApiError::Transient(redact(&d, &self.token)),
            ApiError::Permanent(d) => ApiError::Permanent(redact(&d, &self.token)),
            ApiError::Unauthorized(d) => ApiError::Unauthorized(redact(&d, &self.token)),
            other => other,
        })
    }
}

/// Reads a Bot API answer: `{"ok":true,"result":…}` or `{"ok":false,"error_code":…,
/// "description":…,"parameters":{"retry_after":…}}`.
pub fn interpret(method: &str, status: u16, body: &str) -> Result<Value, ApiError> {
    let v: Value = serde_json::from_str(body).map_err(|_| {
        let what = format!("{method}: HTTP {status} with a body that is not JSON");
        if (500..600).contains(&status) || status == 429 {
            ApiError::Transient(what)
        } else if status == 401 || status == 404 {
            ApiError::Unauthorized(format!("{what} (is the bot token right?)"))
        } else {
            ApiError::Transient(what)
        }
    })?;
    if v.get("ok").and_then(Value::as_bool) == Some(true) {
        return Ok(v.get("result").cloned().unwrap_or(Value::Null));
    }
    let code = v
        .get("error_code")
        .and_then(Value::as_u64)
        .unwrap_or(u64::from(status));
    let description = v
        .get("description")
        .and_then(Value::as_str)
        .unwrap_or("no description");
    let what = format!("{method}: {code} {description}");
    Err(match code {
        429 => {
            let secs = v
                .pointer("/parameters/retry_after")
                .and_then(Value::as_f64)
                .filter(|s| s.is_finite() && *s >= 0.0)
                .unwrap_or(1.0);
            ApiError::RetryAfter(Duration::from_secs_f64(secs).min(MAX_RETRY_AFTER))
        }
        401 | 404 => ApiError::Unauthorized(format!("{what} (is the bot token right?)")),
        400..=499 => ApiError::Permanent(what),
        _ => ApiError::Transient(what),
    })
}

/// The update offset, kept in `<state-dir>/telegram-offset`.
#[derive(Debug)]
pub struct OffsetStore {
    path: Option<PathBuf>,
}

impl OffsetStore {
    /// Keeps the offset in `dir` (created if missing), or nowhere.
    pub fn new(dir: Option<&Path>) -> Result<OffsetStore, BridgeError> {
        let path = match dir {
            Some(d) => {
                std::fs::create_dir_all(d)
                    .map_err(|e| format!("cannot create --state-dir {}: {e}", d.display()))?;
                Some(d.join("telegram-offset"))
            }
            None => None,
        };
        Ok(OffsetStore { path })
    }

    /// The saved offset; `None` when none was saved. A damaged file is an error: starting
    /// over could process updates twice.
    pub fn load(&self) -> Result<Option<i64>, BridgeError> {
        let Some(path) = &self.path else {
            return Ok(None);
        };
        match std::fs::read_to_string(path) {
            Ok(text) => text.trim().parse::<i64>().map(Some).map_err(|_| {
                format!(
                    "the state file {} is damaged (not a number); remove it to start from Telegram's own offset",
                    path.display()
                )
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("cannot read the state file {}: {e}", path.display())),
        }
    }

    /// Saves the offset atomically (a temporary file, synced, renamed over the old one).
    pub fn save(&self, offset: i64) -> Result<(), String> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let tmp = path.with_extension("tmp");
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            writeln!(f, "{offset}")?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)?;
            if let Some(dir) = path.parent() {
                std::fs::File::open(dir)?.sync_all()?;
            }
            Ok(())
        };
        write().map_err(|e| format!("cannot write the state file {}: {e}", path.display()))
    }
}

/// The gateway message for one update, or `None` for an update the bridge does not handle
/// (not a text message, a channel post, from a bot). A leading `/cmd@this_bot` loses its
/// `@this_bot`, and `!stop`-style commands map to `/stop`.
pub fn update_to_message(update: &Value, bot_username: &str) -> Option<OutgoingMessage> {
    let update_id = update.get("update_id")?.as_i64()?;
    let m = update.get("message")?;
    let text = m.get("text")?.as_str()?;
    let message_id = m.get("message_id")?.as_i64()?;
    let chat = m.get("chat")?;
    let chat_id = chat.get("id")?.as_i64()?;
    let chat_type = match chat.get("type")?.as_str()? {
        "private" => ChatType::Dm,
        "group" | "supergroup" => ChatType::Group,
        _ => return None,
    };
    let from = m.get("from");
    if from
        .and_then(|f| f.get("is_bot"))
        .and_then(Value::as_bool)
        .unwrap_or(false)
    {
        return None;
    }
    let user_id = from
        .and_then(|f| f.get("id"))
        .and_then(Value::as_i64)
        .map(|i| i.to_string());
    let user_name = from.and_then(|f| {
        let first = f.get("first_name").and_then(Value::as_str).unwrap_or("");
        let last = f.get("last_name").and_then(Value::as_str).unwrap_or("");
        let name = format!("{first} {last}").trim().to_owned();
        let name = if name.is_empty() {
            f.get("username").and_then(Value::as_str)?.to_owned()
        } else {
            name
        };
        // The protocol allows 1 to 256 bytes without control characters.
        let name: String = name.chars().filter(|c| !c.is_control()).collect();
        let mut end = name.len().min(256);
        while !name.is_char_boundary(end) {
            end -= 1;
        }
        (end > 0).then(|| name[..end].to_owned())
    });
    if chat_type == ChatType::Group && user_id.is_none() {
        // An anonymous group admin: no user to key the session on.
        return None;
    }
    let mut text = text.to_owned();
    // `/stop@this_bot` (how Telegram clients send a command in a group) → `/stop`.
    if text.starts_with('/') && !bot_username.is_empty() {
        let end = text.find(char::is_whitespace).unwrap_or(text.len());
        if let Some(at) = text[..end].find('@')
            && text[at + 1..end].eq_ignore_ascii_case(bot_username)
        {
            text.replace_range(at..end, "");
        }
    }
    let text = map_command(&text).into_owned();
    let mut message = OutgoingMessage::new(
        &format!("tg-{update_id}-{message_id}"),
        &chat_id.to_string(),
        &text,
    );
    message.chat_type = chat_type;
    message.user_id = user_id;
    message.user_name = user_name;
    let mut meta = json!({"message_id": message_id});
    if let Some(r) = m
        .pointer("/reply_to_message/message_id")
        .and_then(Value::as_i64)
    {
        meta["reply_to"] = json!(r);
    }
    if let Some(u) = from.and_then(|f| f.get("username")).and_then(Value::as_str) {
        meta["username"] = json!(u);
    }
    message.meta = Some(meta);
    Some(message)
}

/// The Telegram message a gateway id (`tg-<update_id>-<message_id>`) answers.
pub fn reply_target(id: &str) -> Option<i64> {
    let rest = id.strip_prefix("tg-")?;
    let (_, message_id) = rest.split_once('-')?;
    message_id.parse().ok()
}

/// The Telegram chat of a session key (`telegram:dm:42`, `telegram:group:-100:user:7`).
pub fn chat_of(session: &str) -> Option<String> {
    SessionKey::from_str(session)
        .ok()
        .map(|k| k.chat_id().to_owned())
}

/// A chat id as the Bot API takes it: a number when it is one.
fn chat_param(chat_id: &str) -> Value {
    chat_id
        .parse::<i64>()
        .map_or_else(|_| json!(chat_id), |n| json!(n))
}

/// One reply being shown: the Telegram messages it spans and what is still to show.
#[derive(Debug)]
struct View {
    chat_id: String,
    reply_to: Option<i64>,
    /// Messages posted so far and the text each shows.
    posted: Vec<(i64, String)>,
    /// The newest partial not shown yet (older ones are dropped).
    partial: Option<String>,
    /// The result, once it came: shown before any partial of any reply.
    result: Option<String>,
    last_edit: Option<Instant>,
    strikes: u32,
}

/// A text for a chat that is not a reply (a rejection): sent before partials.
#[derive(Debug)]
struct Notice {
    chat_id: String,
    reply_to: Option<i64>,
    text: String,
}

/// What [`Renderer::step`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// Nothing to do before this instant (or before a new event, when `None`).
    Idle(Option<Instant>),
    /// Made progress; these results are now fully shown (confirm them to the gateway).
    Worked(Vec<String>),
}

/// The reply side of the bridge: turns gateway events into Bot API calls, under the rate
/// limits. Separate from the I/O so that its choices (what goes first, what is coalesced)
/// are tested with a scripted API.
#[derive(Debug)]
pub struct Renderer {
    views: HashMap<String, View>,
    /// Ids in arrival order (fairness between replies).
    order: VecDeque<String>,
    notices: VecDeque<Notice>,
    /// Chats whose typing indicator should be (re)sent.
    typing: VecDeque<String>,
    paused_until: Option<Instant>,
    backoff: Duration,
    edit_interval: Duration,
    max_views: usize,
}

impl Renderer {
    /// An empty renderer.
    pub fn new(edit_interval: Duration, max_views: usize) -> Renderer {
        Renderer {
            views: HashMap::new(),
            order: VecDeque::new(),
            notices: VecDeque::new(),
            typing: VecDeque::new(),
            paused_until: None,
            backoff: Duration::from_secs(1),
            edit_interval,
            max_views: max_views.max(1),
        }
    }

    /// A partial reply: kept as the newest text to show for `id` (older pending ones go).
    pub fn partial(&mut self, id: &str, session: &str, text: &str) {
        if let Some(view) = self.views.get_mut(id) {
            if view.result.is_none() && view.strikes < MAX_STRIKES {
                view.partial = Some(text.to_owned());
            }
            return;
        }
        if self.views.len() >= self.max_views {
            log::debug!(
                "telegram: {} replies streaming; partial of {id} not shown",
                self.max_views
            );
            return;
        }
        let Some(chat_id) = chat_of(session) else {
            return;
        };
        self.insert_view(id, chat_id, Some(text.to_owned()), None);
    }

    /// A result to show for `id`; `false` when there is nothing to show (a merge), and the
    /// result is handled already.
    pub fn result(&mut self, result: &TerminalEvent) -> bool {
        let Some(mut text) = result.outcome.chat_text() else {
            return false;
        };
        if let Some(view) = self.views.get_mut(&result.id) {
            // A turn cancelled or failed after partials were shown keeps what was shown,
            // with the marker appended as its last edit.
            if !matches!(result.outcome, Outcome::Reply { .. }) && !view.posted.is_empty() {
                let shown: String = view.posted.iter().map(|(_, t)| t.as_str()).collect();
                text = format!("{shown}\n{text}");
            }
            view.partial = None;
            view.result = Some(text);
            return true;
        }
        let Some(chat_id) = chat_of(&result.session) else {
            log::error!(
                "telegram: result {} has a session key that names no chat ({}); dropped",
                result.id,
                result.session
            );
            return false;
        };
        self.insert_view(&result.id, chat_id, None, Some(text));
        true
    }

    fn insert_view(
        &mut self,
        id: &str,
        chat_id: String,
        partial: Option<String>,
        result: Option<String>,
    ) {
        self.views.insert(
            id.to_owned(),
            View {
                chat_id,
                reply_to: reply_target(id),
                posted: Vec::new(),
                partial,
                result,
                last_edit: None,
                strikes: 0,
            },
        );
        self.order.push_back(id.to_owned());
    }

    /// A typing event for a chat.
    pub fn typing(&mut self, chat_id: &str, on: bool) {
        self.typing.retain(|c| c != chat_id);
        if on {
            self.typing.push_back(chat_id.to_owned());
        }
    }

    /// A text for a chat outside any reply (a rejection). At most [`MAX_NOTICES`] wait; past
    /// that the oldest is dropped with a WARN (its rejection was logged when it happened).
    pub fn notice(&mut self, chat_id: &str, reply_to: Option<i64>, text: &str) {
        if self.notices.len() >= MAX_NOTICES
            && let Some(old) = self.notices.pop_front()
        {
            log::warn!(
                "telegram: {MAX_NOTICES} notices waiting; the oldest, for chat {}, is dropped",
                old.chat_id
            );
        }
        self.notices.push_back(Notice {
            chat_id: chat_id.to_owned(),
            reply_to,
            text: text.to_owned(),
        });
    }

    /// Whether more gateway events may be taken: replies waiting to be shown stay under
    /// [`MAX_PENDING_FACTOR`] times `max_views`, so a Bot API that is down for long makes the
    /// gateway keep its results (it owes them until `delivered`) instead of this process.
    pub fn has_room(&self) -> bool {
        self.views.len() < self.max_views.saturating_mul(MAX_PENDING_FACTOR)
    }

    /// Whether nothing waits to be shown.
    pub fn is_idle(&self) -> bool {
        self.views.is_empty() && self.notices.is_empty() && self.typing.is_empty()
    }

    /// Does the most urgent piece of work: a notice, then a result, then a due partial, then
    /// a typing indicator. Errors other than an unauthorized token are handled here (a
    /// pause, a retry later, or — for a call that can never work — a WARN and moving on).
    pub fn step(&mut self, api: &mut dyn BotApi, now: Instant) -> Result<Step, BridgeError> {
        if let Some(until) = self.paused_until {
            if until > now {
                return Ok(Step::Idle(Some(until)));
            }
            self.paused_until = None;
        }
        if let Some(notice) = self.notices.front() {
            let params = send_params(&notice.chat_id, &notice.text, notice.reply_to);
            match api.call("sendMessage", &params, CALL_TIMEOUT) {
                Ok(_) => {}
                Err(e) => {
                    if !self.handle_error(&e, now, &format!("notice to chat {}", notice.chat_id))? {
                        return Ok(Step::Worked(Vec::new()));
                    }
                }
            }
            self.backoff = Duration::from_secs(1);
            self.notices.pop_front();
            return Ok(Step::Worked(Vec::new()));
        }
        let with_result = self
            .order
            .iter()
            .find(|id| self.views.get(*id).is_some_and(|v| v.result.is_some()))
            .cloned();
        if let Some(id) = with_result {
            return self.render(api, &id, now, true);
        }
        let mut next_due: Option<Instant> = None;
        let mut due = None;
        for id in &self.order {
            let Some(view) = self.views.get(id) else {
                continue;
            };
            if view.partial.is_none() {
                continue;
            }
            let at = view.last_edit.map_or(now, |t| t + self.edit_interval);
            if at <= now {
                due = Some(id.clone());
                break;
            }
            next_due = Some(next_due.map_or(at, |n: Instant| n.min(at)));
        }
        if let Some(id) = due {
            return self.render(api, &id, now, false);
        }
        if let Some(chat_id) = self.typing.pop_front() {
            let params = json!({"chat_id": chat_param(&chat_id), "action": "typing"});
            if let Err(e) = api.call("sendChatAction", &params, CALL_TIMEOUT) {
                // Best effort: a lost typing indicator is not retried (the gateway refreshes
                // it), but a rate limit still pauses everything.
                if let ApiError::RetryAfter(_) | ApiError::Unauthorized(_) = e {
                    self.handle_error(&e, now, &format!("typing in chat {chat_id}"))?;
                } else {
                    log::debug!("telegram: typing in chat {chat_id} failed: {e}");
                }
            }
            return Ok(Step::Worked(Vec::new()));
        }
        Ok(Step::Idle(next_due))
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
                log::warn!("telegram: rate limited ({what}); waiting {d:?} as asked");
                self.paused_until = Some(now + *d);
                Ok(false)
            }
            ApiError::Transient(d) => {
                log::warn!(
                    "telegram: {what} failed: {d}; retrying in {:?}",
                    self.backoff
                );
                self.paused_until = Some(now + self.backoff);
                self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
                Ok(false)
            }
            ApiError::Permanent(d) => {
                log::warn!("telegram: {what} refused: {d}; not retried");
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
        let text = if final_ {
            view.result.clone()
        } else {
            view.partial.clone()
        }
        .unwrap_or_default();
        let text = if text.trim().is_empty() {
            "[empty reply]".to_owned()
        } else {
            text
        };
        let pieces: Vec<String> = split(&text, TELEGRAM_LIMIT)
            .into_iter()
            .map(str::to_owned)
            .collect();
        let what = format!("reply {id} in chat {}", view.chat_id);
        for (i, piece) in pieces.iter().enumerate() {
            let outcome = if let Some((message_id, shown)) = view.posted.get(i) {
                if shown == piece {
                    continue;
                }
                let params = json!({
                    "chat_id": chat_param(&view.chat_id), "message_id": message_id, "text": piece,
                });
                api.call("editMessageText", &params, CALL_TIMEOUT)
                    .map(|_| *message_id)
            } else {
                let reply_to = if i == 0 { view.reply_to } else { None };
                let params = send_params(&view.chat_id, piece, reply_to);
                api.call("sendMessage", &params, CALL_TIMEOUT)
                    .and_then(|m| {
                        m.get("message_id").and_then(Value::as_i64).ok_or_else(|| {
                            ApiError::Transient("sendMessage: the answer has no message_id".into())
                        })
                    })
            };
            match outcome {
                Ok(message_id) => {
                    if i < view.posted.len() {
                        view.posted[i].1 = piece.clone();
                    } else {
                        view.posted.push((message_id, piece.clone()));
                    }
                    self.backoff = Duration::from_secs(1);
                }
                Err(ApiError::Permanent(d)) if d.contains("message is not modified") => {
                    if i < view.posted.len() {
                        view.posted[i].1 = piece.clone();
                    }
                }
                Err(e) => {
                    if let ApiError::RetryAfter(_) = e {
                        view.strikes += 1;
                        if view.strikes >= MAX_STRIKES && view.partial.take().is_some() {
                            log::warn!(
                                "telegram: {what}: rate limited {MAX_STRIKES} times; only its final text will be shown"
                            );
                        }
                    }
                    let permanent = matches!(e, ApiError::Permanent(_));
                    let drop = self.handle_error(&e, now, &what)?;
                    if permanent && drop {
                        return Ok(self.give_up(id, i, final_));
                    }
                    return Ok(Step::Worked(Vec::new()));
                }
            }
        }
        let view = self
            .views
            .get_mut(id)
            .ok_or_else(|| "internal: view vanished".to_owned())?;
        view.last_edit = Some(now);
        if final_ {
            self.views.remove(id);
            self.order.retain(|o| o != id);
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
        log::warn!(
            "telegram: reply {id} cannot be shown in chat {}; dropped",
            view.chat_id
        );
        if final_ {
            self.views.remove(id);
            self.order.retain(|o| o != id);
            Step::Worked(vec![id.to_owned()])
        } else {
            view.partial = None;
            view.strikes = MAX_STRIKES;
            Step::Worked(Vec::new())
        }
    }
}

fn send_params(chat_id: &str, text: &str, reply_to: Option<i64>) -> Value {
    let mut p = json!({"chat_id": chat_param(chat_id), "text": text});
    if let Some(r) = reply_to {
        p["reply_parameters"] = json!({"message_id": r, "allow_sending_without_reply": true});
    }
    p
}

/// What the poller tells the main thread.
enum Inbound {
    /// The gateway refused a message: tell the chat.
    Rejected {
        chat_id: String,
        reply_to: Option<i64>,
        text: String,
    },
    /// The poller cannot go on.
    Fatal(String),
}

/// Waits `d` unless `stop` is set first (checked every 100 ms: the poller has no channel to
/// select on while it also blocks in HTTP).
fn pause(stop: &AtomicBool, d: Duration) {
    let until = Instant::now() + d;
    while !stop.load(Ordering::SeqCst) {
        let now = Instant::now();
        if now >= until {
            return;
        }
        std::thread::park_timeout((until - now).min(Duration::from_millis(100)));
    }
}

#[allow(clippy::too_many_arguments)]
/// The update loop: poll, hand each message to the gateway, advance the offset once it was
/// answered, persist it.
fn poll_updates(
    config: &TelegramConfig,
    mut api: HttpBotApi,
    gateway: &Gateway,
    store: &OffsetStore,
    mut offset: Option<i64>,
    bot_username: &str,
    stop: &AtomicBool,
    to_main: &Sender<Inbound>,
) {
    let mut backoff = Duration::from_secs(1);
    while !stop.load(Ordering::SeqCst) {
        let mut params = json!({
            "timeout": config.poll_timeout.as_secs(),
            "allowed_updates": ["message"],
        });
        if let Some(o) = offset {
            params["offset"] = json!(o);
        }
        let updates = match api.call("getUpdates", &params, config.poll_timeout + CALL_TIMEOUT) {
            Ok(Value::Array(u)) => {
                backoff = Duration::from_secs(1);
                u
            }
            Ok(_) => {
                log::warn!("telegram: getUpdates answered something that is not a list");
                pause(stop, backoff);
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
            Err(ApiError::RetryAfter(d)) => {
                log::warn!("telegram: getUpdates rate limited; waiting {d:?}");
                pause(stop, d);
                continue;
            }
            Err(ApiError::Unauthorized(d)) => {
                let _ = to_main.send(Inbound::Fatal(format!(
                    "the Bot API refused the bot token: {d}"
                )));
                return;
            }
            Err(e) => {
                log::warn!("telegram: getUpdates failed: {e}; retrying in {backoff:?}");
                pause(stop, backoff);
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };
        for update in &updates {
            let Some(update_id) = update.get("update_id").and_then(Value::as_i64) else {
                log::warn!("telegram: an update without update_id; skipped");
                continue;
            };
            if offset.is_some_and(|o| update_id < o) {
                continue;
            }
            if let Some(message) = update_to_message(update, bot_username) {
                log::debug!("telegram: update {update_id} from chat {}", message.chat_id);
                let answer = loop {
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                    match gateway.send_and_wait(&message, ANSWER_WAIT) {
                        Ok(a) => break a,
                        Err(SendError::TimedOut) => {
                            log::warn!(
                                "telegram: no answer from the gateway for update {update_id} of chat {} yet; still waiting",
                                message.chat_id
                            );
                        }
                        Err(SendError::TooManyPending(_)) => pause(stop, Duration::from_secs(1)),
                        Err(SendError::Closed) => return,
                    }
                };
                if let Admission::Rejected { reason, detail, .. } = answer {
                    log::warn!(
                        "telegram: update {update_id} of chat {} rejected by the gateway: {reason} ({detail})",
                        message.chat_id
                    );
                    let _ = to_main.send(Inbound::Rejected {
                        chat_id: message.chat_id.clone(),
                        reply_to: reply_target(&message.id),
                        text: format!("[not accepted ({reason}): {detail}]"),
                    });
                }
            } else {
                log::debug!(
                    "telegram: update {update_id} is not a text message to handle; skipped"
                );
            }
            offset = Some(update_id + 1);
            if let Err(e) = store.save(update_id + 1) {
                // The gateway's duplicate window still keeps a restart from running it twice
                // within its window.
                log::error!("telegram: {e}");
            }
        }
    }
}

/// Runs the Telegram bridge until `stop` fires (or is dropped). `on_ready` gets `@username`
/// once the bot token was accepted and the gateway connected.
pub fn run(
    config: TelegramConfig,
    stop: &Receiver<()>,
    on_ready: &mut dyn FnMut(&str),
) -> Result<(), BridgeError> {
    if config.bot_token.trim().is_empty() {
        return Err("the bot token is empty".into());
    }
    let store = OffsetStore::new(config.state_dir.as_deref())?;
    let offset = store.load()?;
    let mut api = HttpBotApi::new(&config.api_base, &config.bot_token);
    // getMe: the token works, and the bot's username (for `/cmd@bot` and the ready line).
    let mut backoff = Duration::from_secs(1);
    let me = loop {
        match api.call("getMe", &json!({}), CALL_TIMEOUT) {
            Ok(me) => break me,
            Err(ApiError::Unauthorized(d)) => {
                return Err(format!("the Bot API refused the bot token: {d}"));
            }
            Err(e) => {
                let wait = match e {
                    ApiError::RetryAfter(d) => d,
                    _ => backoff,
                };
                log::warn!("telegram: getMe failed: {e}; retrying in {wait:?}");
                if stop.recv_timeout(wait).is_ok() {
                    return Ok(());
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    };
    let username = me
        .get("username")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned();
    log::info!("telegram: bot @{username}, update offset {offset:?}");
    let (gateway, gateway_rx) = Gateway::connect(config.gateway.clone());
    let stopping = Arc::new(AtomicBool::new(false));
    let (inbound_tx, inbound_rx) = bounded(256);
    {
        let config = config.clone();
        let gateway = gateway.clone();
        let stopping = Arc::clone(&stopping);
        let username = username.clone();
        let poll_api = HttpBotApi::new(&config.api_base, &config.bot_token);
        std::thread::Builder::new()
            .name("telegram-poll".into())
            .spawn(move || {
                poll_updates(
                    &config,
                    poll_api,
                    &gateway,
                    &store,
                    offset,
                    &username,
                    &stopping,
                    &inbound_tx,
                );
            })
            .map_err(|e| format!("cannot start the polling thread: {e}"))?;
    }
    let result = main_loop(
        &config,
        &mut api,
        &gateway,
        &gateway_rx,
        &inbound_rx,
        stop,
        &username,
        on_ready,
    );
    // The poller may be inside a long poll; the process exits without waiting for it (its
    // offset is saved after each answer, so nothing answered is lost).
    stopping.store(true, Ordering::SeqCst);
    gateway.shutdown();
    result
}

#[allow(clippy::too_many_arguments)]
fn main_loop(
    config: &TelegramConfig,
    api: &mut dyn BotApi,
    gateway: &Gateway,
    gateway_rx: &Receiver<GatewayEvent>,
    inbound_rx: &Receiver<Inbound>,
    stop: &Receiver<()>,
    username: &str,
    on_ready: &mut dyn FnMut(&str),
) -> Result<(), BridgeError> {
    let mut renderer = Renderer::new(config.edit_interval, config.max_views);
    let mut ready = false;
    loop {
        // Take everything that is there, so partials coalesce before a call is made — while
        // there is room: beyond the bound, results wait in the gateway's outbox instead.
        while renderer.has_room() {
            let event = match gateway_rx.try_recv() {
                Ok(e) => e,
                Err(crossbeam_channel::TryRecvError::Empty) => break,
                Err(crossbeam_channel::TryRecvError::Disconnected) => {
                    return Err("the gateway client stopped".into());
                }
            };
            on_event(
                &mut renderer,
                gateway,
                event,
                &mut ready,
                username,
                on_ready,
            );
        }
        while let Ok(inbound) = inbound_rx.try_recv() {
            match inbound {
                Inbound::Rejected {
                    chat_id,
                    reply_to,
                    text,
                } => renderer.notice(&chat_id, reply_to, &text),
                Inbound::Fatal(e) => return Err(e),
            }
        }
        if stop.try_recv().is_ok() {
            return Ok(());
        }
        let wake = match renderer.step(api, Instant::now())? {
            Step::Worked(done) => {
                for id in done {
                    log::debug!("telegram: result {id} shown");
                    gateway.delivered(&id);
                }
                continue;
            }
            Step::Idle(wake) => wake,
        };
        let timeout = wake
            .map(|w| w.saturating_duration_since(Instant::now()))
            .unwrap_or(Duration::from_secs(5));
        let never = crossbeam_channel::never();
        let events = if renderer.has_room() {
            gateway_rx
        } else {
            &never
        };
        select! {
            recv(stop) -> _ => return Ok(()),
            recv(events) -> event => match event {
                Ok(event) => on_event(&mut renderer, gateway, event, &mut ready, username, on_ready),
                Err(_) => return Err("the gateway client stopped".into()),
            },
            recv(inbound_rx) -> inbound => match inbound {
                Ok(Inbound::Rejected { chat_id, reply_to, text }) => renderer.notice(&chat_id, reply_to, &text),
                Ok(Inbound::Fatal(e)) => return Err(e),
                Err(_) => return Err("the polling thread stopped".into()),
            },
            default(timeout) => {}
        }
    }
}

fn on_event(
    renderer: &mut Renderer,
    gateway: &Gateway,
    event: GatewayEvent,
    ready: &mut bool,
    username: &str,
    on_ready: &mut dyn FnMut(&str),
) {
    match event {
        GatewayEvent::Connected => {
            if !*ready {
                *ready = true;
                on_ready(&format!("@{username}"));
            }
        }
        GatewayEvent::Partial { id, session, text } => {
            if !gateway.was_delivered(&id) {
                renderer.partial(&id, &session, &text);
            }
        }
        GatewayEvent::Result(result) => {
            if !renderer.result(&result) {
                gateway.delivered(&result.id);
            }
        }
        GatewayEvent::Typing { chat_id, on, .. } => renderer.typing(&chat_id, on),
        GatewayEvent::Disconnected { .. }
        | GatewayEvent::Admission { .. }
        | GatewayEvent::Error { .. } => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scripted Bot API: answers from a queue (default: success), records every call.
    struct ScriptedApi {
        answers: VecDeque<Result<Value, ApiError>>,
        calls: Vec<(String, Value)>,
        next_message_id: i64,
    }

    impl ScriptedApi {
        fn new() -> ScriptedApi {
            ScriptedApi {
                answers: VecDeque::new(),
                calls: Vec::new(),
                next_message_id: 100,
            }
        }
    }

    impl BotApi for ScriptedApi {
        fn call(&mut self, method: &str, params: &Value, _: Duration) -> Result<Value, ApiError> {
            self.calls.push((method.to_owned(), params.clone()));
            if let Some(a) = self.answers.pop_front() {
                return a;
            }
            self.next_message_id += 1;
            Ok(json!({"message_id": self.next_message_id}))
        }
    }

    fn result(id: &str, text: &str) -> TerminalEvent {
        TerminalEvent {
            id: id.into(),
            session: "telegram:dm:42".into(),
            outcome: Outcome::Reply {
                text: text.into(),
                truncated: false,
            },
            redelivery: false,
        }
    }

    fn run_until_idle(r: &mut Renderer, api: &mut ScriptedApi, now: Instant) -> Vec<String> {
        let mut done = Vec::new();
        for _ in 0..100 {
            match r.step(api, now).expect("step") {
                Step::Worked(d) => done.extend(d),
                Step::Idle(_) => return done,
            }
        }
        panic!("never idle");
    }

    #[test]
    fn under_429_only_the_newest_text_is_sent_after_the_wait() {
        let t0 = Instant::now();
        let mut r = Renderer::new(Duration::from_secs(1), 10);
        let mut api = ScriptedApi::new();
        api.answers
            .push_back(Err(ApiError::RetryAfter(Duration::from_secs(3))));
        r.partial("tg-1-7", "telegram:dm:42", "He");
        assert_eq!(r.step(&mut api, t0).expect("step"), Step::Worked(vec![]));
        // Paused: nothing is called however much arrives.
        r.partial("tg-1-7", "telegram:dm:42", "Hell");
        r.partial("tg-1-7", "telegram:dm:42", "Hello");
        assert!(r.result(&result("tg-1-7", "Hello, world")));
        // The wait counts from the 429's answer (a moment after t0).
        let paused = r.step(&mut api, t0 + Duration::from_secs(2)).expect("step");
        assert!(
            matches!(paused, Step::Idle(Some(t)) if t >= t0 + Duration::from_secs(3)),
            "{paused:?}"
        );
        assert_eq!(api.calls.len(), 1);
        let done = run_until_idle(&mut r, &mut api, t0 + Duration::from_secs(4));
        assert_eq!(done, ["tg-1-7"]);
        let sent: Vec<_> = api
            .calls
            .iter()
            .map(|(m, p)| (m.as_str(), p["text"].clone()))
            .collect();
        assert_eq!(
            sent,
            [
                ("sendMessage", json!("He")),
                ("sendMessage", json!("Hello, world"))
            ]
        );
        assert_eq!(api.calls[1].1["reply_parameters"]["message_id"], 7);
    }

    #[test]
    fn partials_edit_in_place_identical_text_is_skipped_and_results_go_first() {
        let t0 = Instant::now();
        let mut r = Renderer::new(Duration::from_secs(1), 10);
        let mut api = ScriptedApi::new();
        r.partial("tg-1-7", "telegram:dm:42", "a");
        run_until_idle(&mut r, &mut api, t0);
        // Within the edit interval the next partial waits; a result of another reply does not.
        r.partial("tg-1-7", "telegram:dm:42", "ab");
        r.result(&TerminalEvent {
            session: "telegram:dm:43".into(),
            ..result("tg-2-8", "other")
        });
        assert_eq!(run_until_idle(&mut r, &mut api, t0), ["tg-2-8"]);
        assert_eq!(api.calls.len(), 2);
        run_until_idle(&mut r, &mut api, t0 + Duration::from_secs(1));
        assert_eq!(api.calls[2].0, "editMessageText");
        assert_eq!(api.calls[2].1["text"], "ab");
        // The result equals what is shown: no call at all.
        r.result(&result("tg-1-7", "ab"));
        assert_eq!(
            run_until_idle(&mut r, &mut api, t0 + Duration::from_secs(2)),
            ["tg-1-7"]
        );
        assert_eq!(api.calls.len(), 3);
    }

    #[test]
    fn a_text_over_4096_utf16_units_continues_in_a_new_message() {
        let t0 = Instant::now();
        let mut r = Renderer::new(Duration::ZERO, 10);
        let mut api = ScriptedApi::new();
        r.partial("tg-1-7", "telegram:dm:42", "start");
        run_until_idle(&mut r, &mut api, t0);
        let long = "🎉 ".repeat(2000); // 6,000 UTF-16 units
        r.result(&result("tg-1-7", &long));
        assert_eq!(run_until_idle(&mut r, &mut api, t0), ["tg-1-7"]);
        let methods: Vec<_> = api.calls.iter().map(|(m, _)| m.as_str()).collect();
        assert_eq!(methods, ["sendMessage", "editMessageText", "sendMessage"]);
        let texts: Vec<String> = api.calls[1..]
            .iter()
            .map(|(_, p)| p["text"].as_str().expect("text").to_owned())
            .collect();
        assert!(texts.iter().all(|t| t.encode_utf16().count() <= 4096));
        assert_eq!(texts.concat(), long);
        assert!(api.calls[2].1.get("reply_parameters").is_none());
    }

    #[test]
    fn repeated_rate_limits_stop_the_partials_of_a_reply() {
        let t0 = Instant::now();
        let mut r = Renderer::new(Duration::ZERO, 10);
        let mut api = ScriptedApi::new();
        for i in 0..MAX_STRIKES {
            api.answers
                .push_back(Err(ApiError::RetryAfter(Duration::from_secs(1))));
            r.partial("tg-1-7", "telegram:dm:42", &format!("p{i}"));
            let _ = r.step(&mut api, t0 + Duration::from_secs(u64::from(i) * 2));
        }
        r.partial("tg-1-7", "telegram:dm:42", "ignored");
        assert_eq!(
            run_until_idle(&mut r, &mut api, t0 + Duration::from_secs(60)),
            Vec::<String>::new()
        );
        assert_eq!(api.calls.len(), MAX_STRIKES as usize);
        r.result(&result("tg-1-7", "final"));
        assert_eq!(
            run_until_idle(&mut r, &mut api, t0 + Duration::from_secs(60)),
            ["tg-1-7"]
        );
        assert_eq!(api.calls.last().expect("call").1["text"], "final");
    }

    #[test]
    fn a_cancelled_turn_keeps_its_shown_text_and_ends_with_the_marker() {
        let t0 = Instant::now();
        let mut r = Renderer::new(Duration::ZERO, 10);
        let mut api = ScriptedApi::new();
        r.partial("tg-1-7", "telegram:dm:42", "half an answer");
        run_until_idle(&mut r, &mut api, t0);
        r.result(&TerminalEvent {
            outcome: Outcome::Cancelled {
                reason: "stopped".into(),
            },
            ..result("tg-1-7", "")
        });
        assert_eq!(run_until_idle(&mut r, &mut api, t0), ["tg-1-7"]);
        assert_eq!(api.calls[1].0, "editMessageText");
        assert_eq!(
            api.calls[1].1["text"],
            "half an answer\n[cancelled: stopped]"
        );
    }

    #[test]
    fn pending_replies_and_notices_are_bounded() {
        let mut r = Renderer::new(Duration::ZERO, 1);
        for i in 0..MAX_PENDING_FACTOR {
            assert!(r.has_room());
            r.result(&result(&format!("tg-{i}-1"), "x"));
        }
        assert!(
            !r.has_room(),
            "results beyond the bound stay with the gateway"
        );
        for _ in 0..MAX_NOTICES + 5 {
            r.notice("42", None, "rejected");
        }
        assert_eq!(r.notices.len(), MAX_NOTICES);
    }

    #[test]
    fn updates_map_to_dm_and_group_messages() {
        let private = json!({"update_id": 5, "message": {"message_id": 9, "text": "/stop@test_bot",
            "chat": {"id": 42, "type": "private"}, "from": {"id": 7, "first_name": "Ann", "username": "ann"}}});
        let m = update_to_message(&private, "test_bot").expect("message");
        assert_eq!(
            (m.id.as_str(), m.chat_id.as_str(), m.chat_type),
            ("tg-5-9", "42", ChatType::Dm)
        );
        assert_eq!(m.text, "/stop");
        assert_eq!(m.user_name.as_deref(), Some("Ann"));
        assert_eq!(reply_target(&m.id), Some(9));
        let group = json!({"update_id": 6, "message": {"message_id": 3, "text": "hi",
            "chat": {"id": -100, "type": "supergroup"}, "from": {"id": 8, "first_name": "Bob"}}});
        let m = update_to_message(&group, "test_bot").expect("message");
        assert_eq!(
            (m.chat_type, m.user_id.as_deref()),
            (ChatType::Group, Some("8"))
        );
        let key = SessionKey::new(
            "telegram",
            m.chat_type,
            &m.chat_id,
            None,
            m.user_id.as_deref(),
        )
        .expect("key");
        assert_eq!(key.to_string(), "telegram:group:-100:user:8");
        assert_eq!(chat_of(&key.to_string()).as_deref(), Some("-100"));
        let photo = json!({"update_id": 7, "message": {"message_id": 4, "chat": {"id": 1, "type": "private"}}});
        assert_eq!(update_to_message(&photo, "test_bot"), None);
        let channel = json!({"update_id": 8, "message": {"message_id": 4, "text": "x", "chat": {"id": 1, "type": "channel"}}});
        assert_eq!(update_to_message(&channel, "test_bot"), None);
    }

    #[test]
    fn api_errors_are_classified_and_retry_after_is_read() {
        let e = interpret(
            "sendMessage",
            429,
            r#"{"ok":false,"error_code":429,"description":"Too Many Requests: retry after 3","parameters":{"retry_after":3}}"#,
        );
        assert_eq!(e, Err(ApiError::RetryAfter(Duration::from_secs(3))));
        assert!(matches!(
            interpret(
                "getMe",
                401,
                r#"{"ok":false,"error_code":401,"description":"Unauthorized"}"#
            ),
            Err(ApiError::Unauthorized(_))
        ));
        assert!(matches!(
            interpret(
                "x",
                400,
                r#"{"ok":false,"error_code":400,"description":"Bad Request: chat not found"}"#
            ),
            Err(ApiError::Permanent(_))
        ));
        assert!(matches!(
            interpret("x", 502, "<html>"),
            Err(ApiError::Transient(_))
        ));
        assert_eq!(
            interpret("x", 200, r#"{"ok":true,"result":{"a":1}}"#),
            Ok(json!({"a":1}))
        );
    }

    #[test]
    fn the_token_is_redacted_from_errors() {
        let mut api = HttpBotApi::new("http://127.0.0.1:1", "123:SECRET");
        let e = api
            .call("getMe", &json!({}), Duration::from_secs(5))
            .expect_err("nothing listens");
        assert!(!e.to_string().contains("SECRET"), "{e}");
        assert_eq!(
            redact("https://x/bot123:SECRET/getMe", "123:SECRET"),
            "https://x/bot<bot-token>/getMe"
        );
    }

    #[test]
    fn the_offset_survives_in_the_state_dir_and_a_damaged_file_is_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = OffsetStore::new(Some(dir.path())).expect("store");
        assert_eq!(store.load(), Ok(None));
        store.save(42).expect("save");
        assert_eq!(
            OffsetStore::new(Some(dir.path())).expect("store").load(),
            Ok(Some(42))
        );
        std::fs::write(dir.path().join("telegram-offset"), "garbage").expect("write");
        assert!(store.load().is_err());
    }
}
