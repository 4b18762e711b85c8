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
//!   fills the message and continues in a new one. Rejections go first, then results and
//!   first lines, then partial edits, the chats taking turns at each; after three rate-limit
//!   strikes on one reply its partials stop and only the result is shown. `typing` events
//!   become `sendChatAction` (in the forum topic, [`topics`]); a message queued behind a
//!   running turn gets a 👀 reaction ([`received`]), the lowest-priority call.
//! - **Limits**: a 429 stops every call for its `retry_after` (capped at
//!   [`MAX_RETRY_AFTER`](api::MAX_RETRY_AFTER)); other failures back off exponentially up to 30 s. Replies streamed
//!   at once are bounded ([`TelegramConfig::max_views`]: partials beyond are not shown; results
//!   always are).
//! - The bot token is part of every API URL: it is never logged, and every error text is
//!   passed through [`redact`](crate::platforms::secrets::redact).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, bounded, select};
use serde_json::{Value, json};

use super::BridgeError;
use super::gateway::{Gateway, GatewayConfig, GatewayEvent};
use api::{ApiError, BotApi, HttpBotApi};
use offset::OffsetStore;
use poll::{Inbound, poll_updates};
use render::{Renderer, Step};

mod api;
mod files;
mod offset;
mod poll;
mod received;
mod render;
#[cfg(test)]
mod tests;
mod topics;
mod update;
mod upload;

/// Time a non-polling API call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest wait after a failed call (doubling from 1 s).
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Settings of the Telegram bridge.
#[derive(Clone)]
pub(crate) struct TelegramConfig {
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
    /// Markdown shown as Telegram HTML, or the text as it is.
    pub format: super::markdown::Format,
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
    pub(crate) fn new(gateway: GatewayConfig, api_base: &str, bot_token: &str) -> TelegramConfig {
        TelegramConfig {
            gateway,
            api_base: api_base.trim_end_matches('/').to_owned(),
            bot_token: bot_token.to_owned(),
            state_dir: None,
            poll_timeout: Duration::from_secs(30),
            edit_interval: Duration::from_secs(1),
            max_views: 256,
            format: super::markdown::Format::default(),
        }
    }
}

/// Runs the Telegram bridge until `stop` fires (or is dropped). `on_ready` gets `@username`
/// once the bot token was accepted and the gateway connected.
pub(crate) fn run(
    config: TelegramConfig,
    stop: &Receiver<()>,
    on_ready: &mut dyn FnMut(&str),
) -> Result<(), BridgeError> {
    super::secrets::register(config.gateway.token.as_deref().unwrap_or_default());
    super::secrets::register(&config.bot_token);
    serve(config, stop, on_ready).map_err(|e| super::secrets::redact(&e).into_owned())
}

/// [`run`] once the secrets are registered.
fn serve(
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
    let Some(username) = bot_username(&mut api, stop)? else {
        return Ok(());
    };
    info_redacted!("telegram: bot @{username}, update offset {offset:?}");
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
    // The gateway client may be blocked handing an event to a full channel nobody reads any
    // more: dropping the receivers ends such sends, so the join in `shutdown` cannot hang.
    drop(gateway_rx);
    drop(inbound_rx);
    gateway.shutdown();
    result
}

/// `getMe`, retried until it works: the token is good, and the bot's username (for
/// `/cmd@bot` and the ready line). `None` when `stop` fired while waiting.
fn bot_username(api: &mut HttpBotApi, stop: &Receiver<()>) -> Result<Option<String>, BridgeError> {
    let mut backoff = Duration::from_secs(1);
    let me = loop {
        // A Bot API that accepts and never answers must not hold a SIGTERM.
        let answer = {
            let mut api = api.clone();
            super::interruptible(stop, "telegram-getme", move || {
                api.call("getMe", &json!({}), CALL_TIMEOUT)
            })?
        };
        let Some(answer) = answer else {
            return Ok(None);
        };
        match answer {
            Ok(me) => break me,
            Err(ApiError::Unauthorized(d)) => {
                return Err(format!("the Bot API refused the bot token: {d}"));
            }
            Err(e) => {
                let wait = match e {
                    ApiError::RetryAfter(d) => d,
                    _ => backoff,
                };
                warn_limited!("telegram: getMe failed: {e}; retrying in {wait:?}");
                if stop.recv_timeout(wait).is_ok() {
                    return Ok(None);
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    };
    Ok(Some(
        me.get("username")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned(),
    ))
}

#[allow(clippy::too_many_arguments)]
/// The main thread: gateway events and the poller's news in, Bot API calls out, until
/// `stop`.
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
    let mut renderer =
        Renderer::new(config.edit_interval, config.max_views).with_format(config.format);
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
            on_inbound(&mut renderer, inbound)?;
        }
        if stop.try_recv().is_ok() {
            return Ok(());
        }
        let wake = match renderer.step(api, Instant::now())? {
            Step::Worked(done) => {
                confirm_shown(gateway, done);
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
                Ok(inbound) => on_inbound(&mut renderer, inbound)?,
                Err(_) => return Err("the polling thread stopped".into()),
            },
            default(timeout) => {}
        }
    }
}

/// Results fully shown are confirmed to the gateway.
fn confirm_shown(gateway: &Gateway, done: Vec<String>) {
    for id in done {
        debug_redacted!("telegram: result {id} shown");
        gateway.delivered(&id);
    }
}

/// What the poller said: a rejection to tell its chat, or the end of the bridge.
fn on_inbound(renderer: &mut Renderer, inbound: Inbound) -> Result<(), BridgeError> {
    match inbound {
        Inbound::Rejected {
            chat_id,
            topic,
            reply_to,
            text,
        } => renderer.notice((&chat_id, topic), reply_to, &text),
        Inbound::Queued {
            chat_id,
            message_id,
        } => renderer.received.queued(&chat_id, message_id),
        Inbound::Fatal(e) => return Err(e),
    }
    Ok(())
}

/// A gateway event for the renderer (or the ready line).
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
        GatewayEvent::Typing {
            chat_id,
            session,
            on,
        } => renderer.typing(&chat_id, &session, on),
        GatewayEvent::Disconnected { .. }
        | GatewayEvent::Admission { .. }
        | GatewayEvent::Error { .. } => {}
    }
}
