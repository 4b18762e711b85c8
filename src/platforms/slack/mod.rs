//! `turnstile bridge slack`: a Slack app in front of the gateway, over Socket Mode (events
//! in, [`socket`]) and the Web API (replies out, [`api`]).
//!
//! - **In**: DMs and `app_mention`s become gateway messages ([`event`]). An envelope is
//!   acknowledged only once the gateway answered its message, so an event the gateway never
//!   got is redelivered by Slack (`retry_attempt`); a redelivered one carries the same id and
//!   the gateway answers `duplicate`: nothing runs twice.
//! - **Out**: the shared [`Renderer`](super::replies::Renderer): `chat.postMessage` in the
//!   message's thread, `chat.update` for partials, pieces of 4,000 characters, at most one
//!   post and one update a second per channel, a 429's `Retry-After` honoured.
//! - **Restart**: Slack redelivers the events it had no ack for (a few retries over some
//!   minutes), so what came while the bridge was down is answered once it is back, within
//!   that window; the bridge keeps no state of its own.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, bounded, select};
use serde_json::{Value, json};

use super::gateway::{Admission, Gateway, GatewayConfig, GatewayEvent, SendError};
use super::replies::{CallError, Renderer, ReplyApi, Step};
use api::WebApi;
use socket::{Inbound, run_socket};

mod api;
mod event;
mod socket;

/// Envelopes read and not yet acknowledged at most; past it Socket Mode is not read.
const MAX_UNACKED: usize = 1024;

/// Why the Slack bridge stopped.
#[derive(Debug)]
pub(crate) enum SlackError {
    /// Slack refused a token: a setting must change (exit 2).
    Fatal(String),
    /// Anything else (exit 1).
    Failed(String),
}

/// Settings of the Slack bridge.
#[derive(Clone)]
pub(crate) struct SlackConfig {
    /// The gateway (platform `slack`).
    pub gateway: GatewayConfig,
    /// Base URL of the Web API, `https://slack.com/api`.
    pub api_base: String,
    /// The app-level token (`xapp-…`, Socket Mode). Never logged.
    pub app_token: String,
    /// The bot token (`xoxb-…`, the Web API). Never logged.
    pub bot_token: String,
    /// Least time between two partial edits of one reply.
    pub edit_interval: Duration,
    /// Replies streamed at once.
    pub max_views: usize,
}

impl std::fmt::Debug for SlackConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlackConfig")
            .field("gateway", &self.gateway)
            .field("api_base", &self.api_base)
            .finish_non_exhaustive()
    }
}

impl SlackConfig {
    /// Defaults: one partial edit per second per reply, 256 streamed replies.
    pub(crate) fn new(gateway: GatewayConfig, api_base: &str, app: &str, bot: &str) -> SlackConfig {
        SlackConfig {
            gateway,
            api_base: api_base.trim_end_matches('/').to_owned(),
            app_token: app.to_owned(),
            bot_token: bot.to_owned(),
            edit_interval: Duration::from_secs(1),
            max_views: 256,
        }
    }
}

/// Runs the Slack bridge until `stop` fires.
pub(crate) fn run(
    config: SlackConfig,
    stop: &Receiver<()>,
    on_ready: &mut dyn FnMut(&str),
) -> Result<(), SlackError> {
    super::secrets::register(config.gateway.token.as_deref().unwrap_or_default());
    super::secrets::register(&config.app_token);
    super::secrets::register(&config.bot_token);
    let redact = |e: String| super::secrets::redact(&e).into_owned();
    serve(config, stop, on_ready).map_err(|e| match e {
        SlackError::Fatal(e) => SlackError::Fatal(redact(e)),
        SlackError::Failed(e) => SlackError::Failed(redact(e)),
    })
}

/// `auth.test` with the bot token, retried: the bot's user id and name.
fn whoami(
    config: &SlackConfig,
    stop: &Receiver<()>,
) -> Result<Option<(String, String)>, SlackError> {
    let mut backoff = Duration::from_secs(1);
    loop {
        let answer = {
            let mut api = WebApi::new(&config.api_base, &config.bot_token, &config.app_token);
            super::interruptible(stop, "slack-auth-test", move || {
                api.call("auth.test", &json!({}), false)
            })
            .map_err(SlackError::Failed)?
        };
        let Some(answer) = answer else {
            return Ok(None);
        };
        let wait = match answer {
            Ok(v) => {
                let field = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
                return match (field("user_id"), field("user")) {
                    (Some(id), name) => Ok(Some((id, name.unwrap_or_default()))),
                    _ => Err(SlackError::Failed("auth.test: no user_id".into())),
                };
            }
            Err(CallError::Unauthorized(d)) => {
                return Err(SlackError::Fatal(format!(
                    "Slack refused the bot token ({d}): install the app and copy its Bot User OAuth Token (OAuth & Permissions)"
                )));
            }
            Err(CallError::Wait(t)) => t.saturating_duration_since(Instant::now()),
            Err(e) => {
                warn_limited!("slack: auth.test failed: {e}; retrying in {backoff:?}");
                backoff
            }
        };
        if stop.recv_timeout(wait).is_ok() {
            return Ok(None);
        }
        backoff = (backoff * 2).min(Duration::from_secs(30));
    }
}

fn serve(
    config: SlackConfig,
    stop: &Receiver<()>,
    on_ready: &mut dyn FnMut(&str),
) -> Result<(), SlackError> {
    if config.app_token.trim().is_empty() || config.bot_token.trim().is_empty() {
        return Err(SlackError::Fatal("a Slack token is empty".into()));
    }
    let Some((me, name)) = whoami(&config, stop)? else {
        return Ok(());
    };
    info_redacted!("slack: bot {name} ({me})");
    let (gateway, gateway_rx) = Gateway::connect(config.gateway.clone());
    let stopping = Arc::new(AtomicBool::new(false));
    let (inbound_tx, inbound_rx) = bounded(MAX_UNACKED);
    let (acks_tx, acks_rx) = bounded(MAX_UNACKED);
    {
        let stopping = Arc::clone(&stopping);
        let api = WebApi::new(&config.api_base, &config.bot_token, &config.app_token);
        let me = me.clone();
        std::thread::Builder::new()
            .name("slack-socket".into())
            .spawn(move || run_socket(api, &me, &inbound_tx, &acks_rx, &stopping))
            .map_err(|e| SlackError::Failed(format!("cannot start the Socket Mode thread: {e}")))?;
    }
    let mut bridge = Bridge {
        renderer: Renderer::new(config.edit_interval, config.max_views),
        api: WebApi::new(&config.api_base, &config.bot_token, &config.app_token),
        gateway: gateway.clone(),
        unacked: HashMap::new(),
        acks: acks_tx,
        connected: false,
        socket_up: false,
        ready: false,
    };
    let result = bridge.main_loop(&gateway_rx, &inbound_rx, stop, &mut || on_ready(&name));
    stopping.store(true, Ordering::SeqCst);
    drop(gateway_rx);
    drop(inbound_rx);
    gateway.shutdown();
    result
}

struct Bridge {
    renderer: Renderer,
    api: WebApi,
    gateway: Gateway,
    /// Message id → the envelopes (a first delivery and redeliveries) waiting for its answer.
    unacked: HashMap<String, Vec<String>>,
    acks: Sender<String>,
    connected: bool,
    socket_up: bool,
    ready: bool,
}

impl Bridge {
    fn main_loop(
        &mut self,
        gateway_rx: &Receiver<GatewayEvent>,
        inbound_rx: &Receiver<Inbound>,
        stop: &Receiver<()>,
        on_ready: &mut dyn FnMut(),
    ) -> Result<(), SlackError> {
        loop {
            while let Ok(e) = gateway_rx.try_recv() {
                self.on_event(e);
            }
            while self.unacked.len() < MAX_UNACKED
                && let Ok(i) = inbound_rx.try_recv()
            {
                self.on_inbound(i)?;
            }
            if !self.ready && self.connected && self.socket_up {
                self.ready = true;
                on_ready();
            }
            if stop.try_recv().is_ok() {
                return Ok(());
            }
            let wake = match self.renderer.step(&mut self.api, Instant::now()) {
                Ok(Step::Worked(done)) => {
                    for id in done {
                        self.gateway.delivered(&id);
                    }
                    continue;
                }
                Ok(Step::Idle(w)) => w,
                Err(e) => return Err(SlackError::Fatal(e)),
            };
            let timeout = wake
                .map(|w| w.saturating_duration_since(Instant::now()))
                .unwrap_or(Duration::from_secs(5))
                .min(Duration::from_secs(5));
            let never = crossbeam_channel::never();
            let inbound = if self.unacked.len() < MAX_UNACKED {
                inbound_rx
            } else {
                &never
            };
            select! {
                recv(stop) -> _ => return Ok(()),
                recv(gateway_rx) -> e => match e {
                    Ok(e) => self.on_event(e),
                    Err(_) => return Err(SlackError::Failed("the gateway client stopped".into())),
                },
                recv(inbound) -> i => match i {
                    Ok(i) => self.on_inbound(i)?,
                    Err(_) => return Err(SlackError::Failed("the Socket Mode thread stopped".into())),
                },
                default(timeout) => {}
            }
        }
    }

    fn on_inbound(&mut self, inbound: Inbound) -> Result<(), SlackError> {
        match inbound {
            Inbound::Up => self.socket_up = true,
            Inbound::Fatal(e) => return Err(SlackError::Fatal(e)),
            Inbound::Event {
                envelope_id,
                message,
            } => {
                self.unacked
                    .entry(message.id.clone())
                    .or_default()
                    .push(envelope_id);
                match self.gateway.send(&message) {
                    Ok(()) => {}
                    // Not acknowledged: Slack delivers it again later.
                    Err(SendError::TooManyPending(_)) => {
                        self.unacked.remove(&message.id);
                    }
                    Err(e) => {
                        self.answered(&message.id);
                        let thread = event::thread_of(&message.id).map(str::to_owned);
                        self.renderer.notice(
                            &message.chat_id,
                            thread.as_deref(),
                            &format!("[not accepted: {e}]"),
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// The gateway answered message `id`: its envelopes are acknowledged.
    fn answered(&mut self, id: &str) {
        for envelope in self.unacked.remove(id).unwrap_or_default() {
            let _ = self.acks.try_send(envelope);
        }
    }

    fn on_event(&mut self, event: GatewayEvent) {
        match event {
            GatewayEvent::Connected => self.connected = true,
            GatewayEvent::Admission { id, admission } => {
                self.answered(&id);
                if let Admission::Rejected { reason, detail, .. } = admission {
                    warn_limited!(
                        "slack: message {id} rejected by the gateway: {reason} ({detail})"
                    );
                    let channel = id.strip_prefix("sl-").and_then(|r| r.split('-').next());
                    if let Some(channel) = channel {
                        let thread = event::thread_of(&id).map(str::to_owned);
                        self.renderer.notice(
                            channel,
                            thread.as_deref(),
                            &format!("[not accepted ({reason}): {detail}]"),
                        );
                    }
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
            GatewayEvent::Typing { .. }
            | GatewayEvent::Disconnected { .. }
            | GatewayEvent::Error { .. } => {}
        }
    }
}
