//! The Matrix bridge: `turnstile bridge matrix --gateway HOST:PORT --homeserver URL`.
//!
//! A bot account on a homeserver, spoken to with the Client-Server API by hand over ureq
//! (no SDK, no async runtime). End-to-end encrypted rooms go through [`crypto`]: each sync
//! answer is decrypted in place before it is read, and sends into encrypted rooms are sealed.
//!
//! Threads: one long-polls `/sync` ([`sync`]), joins the rooms the bot is invited to and
//! hands the humans' messages over on a bounded channel; the gateway client
//! ([`gateway`](crate::platforms::gateway)) owns the gateway connection; this module's main
//! loop owns everything the bot sends to Matrix:
//!
//! - a reply's first partial is a new message replying to the human's event; later partials
//!   and the final text are `m.replace` edits of it (an identical text is not sent again); a
//!   cancellation is a last edit with a marker; a command's answer is an `m.notice` reply;
//! - typing is on while a turn runs (`PUT /typing`, refreshed); a message queued behind a
//!   running turn gets the bot's read receipt ([`received`]), the lowest-priority output;
//! - rate limits: a 429 waits its `retry_after_ms`; only the newest pending edit per message
//!   is kept and results and command answers go first ([`EditQueue`]); after repeated
//!   strikes no edit is sent at all, only finals;
//! - a result is confirmed to the gateway (`delivered`) once it is posted (or deliberately
//!   not), so a result redelivered after a reconnect is not posted twice.

mod answer;
pub(crate) mod api;
mod content;
pub(crate) mod crypto;
mod encrypted_file;
mod engine;
mod invites;
mod media;
mod poll;
mod received;
mod rooms;
pub(crate) mod state;
pub(crate) mod sync;
mod threads;

use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Select, TryRecvError, bounded};

use crate::platforms::BridgeError;
use crate::platforms::edits::EditLimits;
use crate::platforms::gateway::{Gateway, GatewayConfig, GatewayEvent};

use api::Api;
use engine::{HttpHomeserver, Step, SyncEngine};
use poll::{FromSync, run_sync};

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
    /// End-to-end encryption: the pickle key and the bounds.
    pub e2ee: crypto::E2eeConfig,
    /// Markdown shown as `formatted_body` HTML, or the text as it is.
    pub format: super::markdown::Format,
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
            e2ee: crypto::E2eeConfig::default(),
            format: super::markdown::Format::default(),
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
    super::secrets::register(config.gateway.token.as_deref().unwrap_or_default());
    super::secrets::register(&config.access_token);
    if let Some(key) = &config.e2ee.pickle_secret {
        super::secrets::register(key);
    }
    serve(config, stop, on_ready).map_err(|e| super::secrets::redact(&e).into_owned())
}

/// The bot's mxid (`/account/whoami`), asked until answered; `None` when `stop` fires first.
fn who_am_i(api: &Api, stop: &Receiver<()>) -> Result<Option<String>, BridgeError> {
    loop {
        // A homeserver that accepts and never answers must not hold a SIGTERM.
        let whoami = {
            let api = api.clone();
            super::interruptible(stop, "matrix-whoami", move || api.whoami())?
        };
        let Some(whoami) = whoami else {
            return Ok(None);
        };
        match whoami {
            Ok(me) => return Ok(Some(me)),
            Err(e) if e.is_unauthorized() => {
                return Err(format!(
                    "the homeserver {} refused the access token ({e})",
                    api.base()
                ));
            }
            Err(e) => {
                warn_limited!("matrix: {}: {e}; trying again in 2s", api.base());
                if stop.recv_timeout(Duration::from_secs(2)).is_ok() {
                    return Ok(None);
                }
            }
        }
    }
}

/// The bot's encryption device; `None` (logged: encrypted rooms stay unread) when the
/// homeserver refuses it.
fn start_crypto(api: &Api, me: &str, config: &MatrixConfig) -> Option<crypto::Shared> {
    match crypto::Crypto::start(api, me, config.state_dir.as_deref(), &config.e2ee) {
        Ok(c) => Some(std::sync::Arc::new(std::sync::Mutex::new(c))),
        Err(e) => {
            error_limited!("matrix: encryption off, encrypted rooms are not read: {e}");
            None
        }
    }
}

/// [`run`] once the secrets are registered.
fn serve(
    config: MatrixConfig,
    stop: &Receiver<()>,
    on_ready: &mut dyn FnMut(&str),
) -> Result<(), BridgeError> {
    let api = Api::new(
        &config.homeserver,
        &config.access_token,
        config.sync_timeout + Duration::from_secs(30),
    )?;
    let Some(me) = who_am_i(&api, stop)? else {
        return Ok(());
    };
    info_redacted!("matrix: logged in to {} as {me}", api.base());
    // Sends are short; their bound is also the longest a shutdown waits for one.
    let send_api = Api::new(&config.homeserver, &config.access_token, SEND_TIMEOUT)?;

    let (resume, mut tracker) = match &config.state_dir {
        Some(dir) => (state::load(dir)?, Some(state::Tracker::new(dir)?)),
        None => (None, None),
    };
    let crypto = start_crypto(&api, &me, &config);
    let (mut gw, gw_rx) = Gateway::connect(config.gateway.clone());
    let (sync_tx, sync_rx) = bounded::<FromSync>(64);
    // Dropped when this function returns: the sync thread's waits end with it.
    let (_stop_sync, stop_rx) = bounded::<()>(0);
    {
        let api = api.clone();
        let me = me.clone();
        let config = config.clone();
        let crypto = crypto.clone();
        let gate = invite_gate(gw.clone());
        std::thread::Builder::new()
            .name("matrix-sync".into())
            .spawn(move || {
                run_sync(
                    &api,
                    &me,
                    &config,
                    &sync_tx,
                    resume,
                    &stop_rx,
                    crypto.as_ref(),
                    gate,
                )
            })
            .map_err(|e| format!("cannot start a thread: {e}"))?;
    }
    let hs = HttpHomeserver::new(send_api, me.clone(), crypto);
    let mut core = SyncEngine::new(
        hs,
        &config.gateway.platform,
        config.limits,
        config.max_turns,
    )
    .with_format(config.format);
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
    // The gateway client may be blocked handing an event to a full channel nobody reads any
    // more: dropping the receiver ends that send, so the join in `shutdown` cannot hang.
    drop(gw_rx);
    drop(sync_rx);
    gw.shutdown();
    if waiting > 0 {
        info_redacted!(
            "matrix: {waiting} result(s) not posted yet stay with the gateway (it redelivers them to the next bridge)"
        );
    }
    info_redacted!(
        "matrix: stopped ({} messages, {} edits, {} identical edits skipped, {} rate-limited)",
        core.stats.messages,
        core.stats.edits,
        core.stats.identical_skipped,
        core.stats.rate_limited
    );
    result
}

/// How long the joiner waits for the gateway's `may_use` answer before asking again.
const MAY_USE_TIMEOUT: Duration = Duration::from_secs(10);

/// The invite check: the gateway's access policy, asked about the inviter and the room.
fn invite_gate(gw: Gateway) -> invites::Gate {
    Box::new(move |inviter, room| {
        gw.may_use(inviter, Some(room), MAY_USE_TIMEOUT)
            .map_err(|e| e.to_string())
    })
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
    core: &mut SyncEngine<HttpHomeserver>,
    gw: &mut Gateway,
    ch: &Channels<'_>,
    on_ready: &mut dyn FnMut(),
    max_pending: usize,
    mut tracker: Option<&mut state::Tracker>,
) -> Result<(), BridgeError> {
    let (mut synced, mut connected, mut announced) = (false, false, false);
    loop {
        if ch.stop.try_recv().is_ok() {
            info_redacted!("matrix: shutting down");
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
                Ok(FromSync::Link(up, why)) => gw.link(up, why),
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
