//! `turnstile bridge discord`: a Discord bot in front of the gateway, over the Gateway
//! (v10, a WebSocket: [`shard`]) and the REST API ([`rest`]).
//!
//! - **In**: `MESSAGE_CREATE` from users (not bots, not itself) in DMs, and in guild channels
//!   when they mention the bot, become gateway messages `dc-<message id>` ([`event`]); one in
//!   a thread ([`threads`]) carries the thread as `thread_id` and is answered in it. A
//!   resumed session's replay, or a restart's, carries the same ids: the gateway answers
//!   `duplicate`, nothing runs twice.
//! - **Restart**: with `--state-dir` the session (id, resume URL, the sequence below the
//!   oldest message the gateway has not answered) is saved ([`state`]); a restarted bridge
//!   resumes it and Discord replays what came since, while the session lives (a few
//!   minutes). Past that Discord answers op 9 and what came meanwhile is not delivered.
//! - **Out**: the shared renderer: replies, edits, typing, notices, under the REST rate
//!   limits ([`rest`]: buckets by their hash, the global limit).
//! - The bot token goes in the Identify/Resume payloads and the `Authorization` header only:
//!   it is never logged, and every error text is redacted.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, bounded, select};
use serde_json::Value;

use super::gateway::{Admission, Gateway, GatewayConfig, GatewayEvent, OutgoingMessage, SendError};
use super::replies::{Renderer, ReplyApi, Step};
use rest::{HttpRest, Rest, RestError};
use shard::{Inbound, Session, ShardConfig, run_shard};
use state::{Progress, SessionStore};

mod event;
mod rest;
mod shard;
mod state;
mod threads;

/// Messages read from Discord and not yet handed to the gateway client at most (the
/// client's own bound is [`GatewayConfig::max_pending`]); past it the Gateway connection
/// stops being read.
const MAX_BACKLOG: usize = 1024;

/// Why the Discord bridge stopped.
#[derive(Debug)]
pub(crate) enum DiscordError {
    /// Discord refused the token or the intents: a setting must change (exit 2).
    Fatal(String),
    /// Anything else (exit 1).
    Failed(String),
}

/// Settings of the Discord bridge.
#[derive(Clone)]
pub(crate) struct DiscordConfig {
    /// The gateway (platform `discord`).
    pub gateway: GatewayConfig,
    /// Base URL of the REST API, `https://discord.com/api/v10`.
    pub api_base: String,
    /// The bot token. Never logged.
    pub bot_token: String,
    /// Where the session is kept; `None`: in memory only.
    pub state_dir: Option<PathBuf>,
    /// Least time between two partial edits of one reply.
    pub edit_interval: Duration,
    /// Replies streamed (partials shown) at once.
    pub max_views: usize,
}

impl std::fmt::Debug for DiscordConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiscordConfig")
            .field("gateway", &self.gateway)
            .field("api_base", &self.api_base)
            .field("bot_token", &"<redacted>")
            .field("state_dir", &self.state_dir)
            .finish_non_exhaustive()
    }
}

impl DiscordConfig {
    /// Defaults: one partial edit per second per reply, 256 streamed replies.
    pub(crate) fn new(gateway: GatewayConfig, api_base: &str, bot_token: &str) -> DiscordConfig {
        DiscordConfig {
            gateway,
            api_base: api_base.trim_end_matches('/').to_owned(),
            bot_token: bot_token.to_owned(),
            state_dir: None,
            edit_interval: Duration::from_secs(1),
            max_views: 256,
        }
    }
}

/// Runs the Discord bridge until `stop` fires. `on_ready` gets the bot's name once Discord
/// accepted the token and the gateway connected.
pub(crate) fn run(
    config: DiscordConfig,
    stop: &Receiver<()>,
    on_ready: &mut dyn FnMut(&str),
) -> Result<(), DiscordError> {
    super::secrets::register(config.gateway.token.as_deref().unwrap_or_default());
    super::secrets::register(&config.bot_token);
    let redact = |e: String| super::secrets::redact(&e).into_owned();
    serve(config, stop, on_ready).map_err(|e| match e {
        DiscordError::Fatal(e) => DiscordError::Fatal(redact(e)),
        DiscordError::Failed(e) => DiscordError::Failed(redact(e)),
    })
}

/// `GET /users/@me` and `GET /gateway/bot`, retried until they answer: who the bot is, the
/// Gateway URL and the start limit. `None` when `stop` fired first.
fn introduce(
    config: &DiscordConfig,
    stop: &Receiver<()>,
) -> Result<Option<ShardConfig>, DiscordError> {
    let mut backoff = Duration::from_secs(1);
    loop {
        let answer = {
            let mut rest = HttpRest::new(&config.api_base, &config.bot_token);
            super::interruptible(stop, "discord-start", move || {
                let me = rest.call("GET", "/users/@me", None)?;
                rest.call("GET", "/gateway/bot", None).map(|g| (me, g))
            })
            .map_err(DiscordError::Failed)?
        };
        let Some(answer) = answer else {
            return Ok(None);
        };
        let wait = match answer {
            Ok((me, bot)) => return shard_config(config, &me, &bot).map(Some),
            Err(RestError::Unauthorized(d)) => {
                return Err(DiscordError::Fatal(format!(
                    "Discord refused the bot token ({d}): set the token from the Developer Portal (Bot → Reset Token)"
                )));
            }
            Err(RestError::Wait(until)) => until.saturating_duration_since(Instant::now()),
            Err(e) => {
                warn_limited!("discord: the start-up calls failed: {e}; retrying in {backoff:?}");
                backoff
            }
        };
        if stop.recv_timeout(wait).is_ok() {
            return Ok(None);
        }
        backoff = (backoff * 2).min(Duration::from_secs(30));
    }
}

/// The Gateway connection's settings from the answers of `/users/@me` and `/gateway/bot`.
fn shard_config(
    config: &DiscordConfig,
    me: &Value,
    bot: &Value,
) -> Result<ShardConfig, DiscordError> {
    let text = |v: &Value, k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
    let (Some(url), Some(user_id)) = (text(bot, "url"), text(me, "id")) else {
        return Err(DiscordError::Failed(
            "the answers of /users/@me and /gateway/bot lack the bot's id or the Gateway URL"
                .into(),
        ));
    };
    let limit = |k: &str| {
        bot.pointer(&format!("/session_start_limit/{k}"))
            .and_then(Value::as_u64)
    };
    Ok(ShardConfig {
        url,
        token: config.bot_token.clone(),
        user_id,
        username: text(me, "username").unwrap_or_default(),
        starts_remaining: limit("remaining").unwrap_or(1),
        starts_reset_after: Duration::from_millis(limit("reset_after").unwrap_or(0)),
    })
}

/// [`run`] once the secrets are registered.
fn serve(
    config: DiscordConfig,
    stop: &Receiver<()>,
    on_ready: &mut dyn FnMut(&str),
) -> Result<(), DiscordError> {
    if config.bot_token.trim().is_empty() {
        return Err(DiscordError::Fatal("the bot token is empty".into()));
    }
    let store = SessionStore::new(config.state_dir.as_deref()).map_err(DiscordError::Failed)?;
    let saved = store.load().map_err(DiscordError::Failed)?;
    let Some(shard_config) = introduce(&config, stop)? else {
        return Ok(());
    };
    let me = shard_config.username.clone();
    info_redacted!("discord: bot {me} ({})", shard_config.user_id);
    let (gateway, gateway_rx) = Gateway::connect(config.gateway.clone());
    let stopping = Arc::new(AtomicBool::new(false));
    let last_seq = Arc::new(AtomicU64::new(saved.as_ref().map_or(0, |s| s.seq)));
    let (inbound_tx, inbound_rx) = bounded(MAX_BACKLOG);
    {
        let stopping = Arc::clone(&stopping);
        let last_seq = Arc::clone(&last_seq);
        let saved = saved.clone();
        std::thread::Builder::new()
            .name("discord-gateway".into())
            .spawn(move || run_shard(shard_config, saved, &inbound_tx, &stopping, &last_seq))
            .map_err(|e| DiscordError::Failed(format!("cannot start the Gateway thread: {e}")))?;
    }
    let mut bridge = Bridge {
        renderer: Renderer::new(config.edit_interval, config.max_views)
            .with_channels(event::session_channel),
        api: HttpRest::new(&config.api_base, &config.bot_token),
        gateway: gateway.clone(),
        store,
        session: saved,
        saved_seq: 0,
        progress: Progress::default(),
        backlog: std::collections::VecDeque::new(),
        last_seq,
        me,
        connected: false,
        discord_up: false,
        ready: false,
    };
    let result = bridge.main_loop(&gateway_rx, &inbound_rx, stop, on_ready);
    // The Gateway thread notices within a read slice; the process does not wait for it.
    stopping.store(true, Ordering::SeqCst);
    drop(gateway_rx);
    drop(inbound_rx);
    gateway.shutdown();
    result
}

/// The main thread's state.
struct Bridge {
    renderer: Renderer,
    api: HttpRest,
    gateway: Gateway,
    store: SessionStore,
    /// The current session (for the state file).
    session: Option<Session>,
    saved_seq: u64,
    progress: Progress,
    /// Messages the gateway client had no room for yet, in order.
    backlog: std::collections::VecDeque<(u64, OutgoingMessage)>,
    last_seq: Arc<AtomicU64>,
    /// The bot's name (the ready line).
    me: String,
    /// The gateway's hello was confirmed.
    connected: bool,
    /// Discord said READY or RESUMED.
    discord_up: bool,
    /// The ready line was printed.
    ready: bool,
}

impl Bridge {
    fn main_loop(
        &mut self,
        gateway_rx: &Receiver<GatewayEvent>,
        inbound_rx: &Receiver<Inbound>,
        stop: &Receiver<()>,
        on_ready: &mut dyn FnMut(&str),
    ) -> Result<(), DiscordError> {
        loop {
            while self.renderer.has_room() {
                match gateway_rx.try_recv() {
                    Ok(e) => self.on_event(e),
                    Err(crossbeam_channel::TryRecvError::Empty) => break,
                    Err(crossbeam_channel::TryRecvError::Disconnected) => {
                        return Err(DiscordError::Failed("the gateway client stopped".into()));
                    }
                }
            }
            // Read before the messages are taken in (see `Progress::safe_seq`).
            let last_seq = self.last_seq.load(Ordering::SeqCst);
            while self.backlog.len() < MAX_BACKLOG
                && let Ok(inbound) = inbound_rx.try_recv()
            {
                self.on_inbound(inbound)?;
            }
            self.flush_backlog();
            self.save_progress(last_seq);
            if !self.ready && self.connected && self.discord_up {
                self.ready = true;
                on_ready(&self.me);
            }
            if stop.try_recv().is_ok() {
                return Ok(());
            }
            let wake = match self.renderer.step(&mut self.api, Instant::now()) {
                Ok(Step::Worked(done)) => {
                    for id in done {
                        debug_redacted!("discord: result {id} shown");
                        self.gateway.delivered(&id);
                    }
                    continue;
                }
                Ok(Step::Idle(wake)) => wake,
                Err(e) => return Err(DiscordError::Fatal(e)),
            };
            let timeout = wake
                .map(|w| w.saturating_duration_since(Instant::now()))
                .unwrap_or(Duration::from_secs(5))
                .min(Duration::from_secs(5));
            let (never_event, never_inbound) =
                (crossbeam_channel::never(), crossbeam_channel::never());
            let events = if self.renderer.has_room() {
                gateway_rx
            } else {
                &never_event
            };
            let inbound = if self.backlog.len() < MAX_BACKLOG {
                inbound_rx
            } else {
                &never_inbound
            };
            select! {
                recv(stop) -> _ => return Ok(()),
                recv(events) -> e => match e {
                    Ok(e) => self.on_event(e),
                    Err(_) => return Err(DiscordError::Failed("the gateway client stopped".into())),
                },
                recv(inbound) -> i => match i {
                    Ok(i) => {
                        let last_seq = self.last_seq.load(Ordering::SeqCst);
                        self.on_inbound(i)?;
                        self.flush_backlog();
                        self.save_progress(last_seq);
                    }
                    Err(_) => return Err(DiscordError::Failed("the Gateway thread stopped".into())),
                },
                default(timeout) => {}
            }
        }
    }

    fn on_inbound(&mut self, inbound: Inbound) -> Result<(), DiscordError> {
        match inbound {
            Inbound::Resumed => self.discord_up = true,
            Inbound::Ready { session } => {
                info_redacted!("discord: READY, a new session");
                self.discord_up = true;
                self.progress.reset();
                self.saved_seq = 0;
                self.session = Some(session);
            }
            Inbound::Message { seq, message } => {
                let channel = event::reply_channel(&message);
                self.progress.handed(seq, &message.id, channel);
                self.backlog.push_back((seq, message));
            }
            Inbound::Fatal(e) => return Err(DiscordError::Fatal(e)),
        }
        Ok(())
    }

    /// Hands the backlog to the gateway client while it has room.
    fn flush_backlog(&mut self) {
        while let Some((_, message)) = self.backlog.front() {
            match self.gateway.send(message) {
                Ok(()) => {}
                Err(SendError::TooManyPending(_)) => return,
                Err(e) => {
                    // It can never be sent: it ends here, told to its sender.
                    let id = message.id.clone();
                    let channel = event::reply_channel(message).to_owned();
                    self.progress.answered(&id);
                    let target = event::reply_target(&id).map(str::to_owned);
                    self.renderer.notice(
                        &channel,
                        target.as_deref(),
                        &format!("[not accepted: {e}]"),
                    );
                }
            }
            self.backlog.pop_front();
        }
    }

    /// Saves the session with the sequence a restart may resume from, when it moved.
    fn save_progress(&mut self, last_seq: u64) {
        let Some(session) = &self.session else {
            return;
        };
        let seq = self.progress.safe_seq(last_seq);
        if seq <= self.saved_seq {
            return;
        }
        let session = Session {
            seq,
            ..session.clone()
        };
        match self.store.save(&session) {
            Ok(()) => self.saved_seq = seq,
            Err(e) => error_limited!("discord: {e}"),
        }
    }

    fn on_event(&mut self, event: GatewayEvent) {
        match event {
            GatewayEvent::Connected => self.connected = true,
            GatewayEvent::Admission { id, admission } => {
                let channel = self.progress.answered(&id);
                if let (Admission::Rejected { reason, detail, .. }, Some(channel)) =
                    (admission, channel)
                {
                    warn_limited!(
                        "discord: message {id} of channel {channel} rejected by the gateway: {reason} ({detail})"
                    );
                    let target = event::reply_target(&id).map(str::to_owned);
                    self.renderer.notice(
                        &channel,
                        target.as_deref(),
                        &format!("[not accepted ({reason}): {detail}]"),
                    );
                }
            }
            GatewayEvent::Partial { id, session, text } => {
                if !self.gateway.was_delivered(&id) {
                    let target = self.api.reply_target(&id);
                    self.renderer.partial(&id, &session, &text, target);
                }
            }
            GatewayEvent::Result(result) => {
                let target = self.api.reply_target(&result.id);
                if !self.renderer.result(&result, target) {
                    self.gateway.delivered(&result.id);
                }
            }
            GatewayEvent::Typing {
                session,
                chat_id,
                on,
            } => {
                let channel = event::session_channel(&session).unwrap_or(chat_id);
                self.renderer.typing(&channel, on, Instant::now());
            }
            GatewayEvent::Disconnected { .. } | GatewayEvent::Error { .. } => {}
        }
    }
}
