//! `turnstile bridge irc`: an IRC bot in front of the gateway.
//!
//! - In a channel the bot answers lines addressed to it (`NICK: text` or `NICK, text`), as a
//!   `group` message keyed per sender (`user_id` = the sender's nick); a private message to
//!   the bot is a `dm` (chat = the sender's nick). `!stop`, `!new`, `!reset`, `!status` are
//!   the gateway's commands.
//! - A result is sent as PRIVMSG lines, each at most 512 bytes **as the server relays it**
//!   (with the `:nick!user@host` prefix the bot learns from the welcome), split at newlines
//!   and spaces and never inside a UTF-8 sequence; a reply longer than
//!   [`IrcConfig::max_reply_lines`] lines ends with a note saying how much was left out. In a
//!   channel the first line starts with `sender: `.
//! - Lines leave through a token bucket ([`IrcConfig::flood_burst`] at once, then one per
//!   [`IrcConfig::flood_interval`]) so the server's flood protection never drops the bot.
//!   Partials are not shown (IRC has no edits). A result is confirmed to the gateway
//!   (`delivered`) once its last line was written to the server; lines not yet written when
//!   the server connection drops are sent after the reconnect.
//! - `--tls`: rustls (the TLS stack ureq already brings), the certificate checked against
//!   the system's roots or the CAs of [`IrcConfig::tls_ca_file`].
//! - Where a network requires it, the bot logs in ([`Login`]): the server password (`PASS`),
//!   SASL PLAIN or EXTERNAL (the TLS client certificate of [`IrcConfig::tls_client_cert`]),
//!   NickServ `IDENTIFY`; the secrets from environment variables, never logged.
//! - A nick in use gets an alternate (`NICK_`, `NICK_2`, …); PINGs are answered and the bot
//!   pings a silent server; a lost server is reconnected with capped exponential backoff.

use std::path::PathBuf;
use std::time::Duration;

use std::net::{Shutdown, TcpStream};
use std::sync::{Arc, Mutex};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, bounded, select};

use super::BridgeError;
use super::gateway::{Gateway, GatewayConfig};
pub(crate) use login::Login;
use session::IrcSession;
use transport::tls_config;

mod flood;
mod login;
mod session;
#[cfg(test)]
mod tests;
mod transport;
mod wire;

/// Server lines read and not yet handled at most.
const SERVER_INPUT_CAPACITY: usize = 256;
/// How long a stopping bridge's loop may stay busy (a write to a server that stopped
/// reading) before its server socket is shut down under it.
const STOP_GRACE: Duration = Duration::from_secs(1);

/// The current server socket, shared with the stop watcher.
pub(super) type SocketSlot = Arc<Mutex<Option<TcpStream>>>;

/// Forwards `stop` to the loop (the returned receiver). Should the loop still be running
/// [`STOP_GRACE`] later — blocked writing to a server that stopped reading — the watcher
/// shuts the server socket down, which ends that write: SIGTERM exits promptly in every
/// state. The loop's end is told by dropping the returned sender.
fn watch_stop(
    stop: &Receiver<()>,
    socket: SocketSlot,
) -> Result<(Receiver<()>, Sender<()>), BridgeError> {
    let (forward_tx, forward_rx) = bounded(1);
    let (done_tx, done_rx) = bounded::<()>(0);
    let stop = stop.clone();
    std::thread::Builder::new()
        .name("irc-stop".into())
        .spawn(move || {
            select! {
                recv(stop) -> _ => {}
                recv(done_rx) -> _ => return,
            }
            let _ = forward_tx.send(());
            if let Err(RecvTimeoutError::Timeout) = done_rx.recv_timeout(STOP_GRACE) {
                warn_limited!(
                    "irc: still busy {STOP_GRACE:?} after the stop; closing the server connection"
                );
                if let Some(s) = socket.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                    let _ = s.shutdown(Shutdown::Both);
                }
            }
        })
        .map_err(|e| format!("cannot start a thread: {e}"))?;
    Ok((forward_rx, done_tx))
}

/// Settings of the IRC bridge.
#[derive(Clone, Debug)]
pub(crate) struct IrcConfig {
    /// The gateway (platform `irc`).
    pub gateway: GatewayConfig,
    /// `HOST:PORT` of the IRC server.
    pub server: String,
    /// Speak TLS to the server (certificate checked against the system's roots).
    pub tls: bool,
    /// Trust only the CA certificates of this PEM file for TLS (a private server).
    pub tls_ca_file: Option<PathBuf>,
    /// The client certificate (PEM chain) and its key offered over TLS, for SASL EXTERNAL
    /// or a network that checks certificates (CertFP).
    pub tls_client_cert: Option<(PathBuf, PathBuf)>,
    /// The nick to register (alternates if it is taken).
    pub nick: String,
    /// Channels to join.
    pub channels: Vec<String>,
    /// Lines sent at once before pacing starts.
    pub flood_burst: u32,
    /// One more line per this interval once the burst is used.
    pub flood_interval: Duration,
    /// Lines of one reply at most (the last one says what was left out).
    pub max_reply_lines: usize,
    /// Markdown shown as plain text without the markup, or the text as it is.
    pub format: super::markdown::Format,
    /// Reply lines waiting to be sent at most; at the bound no new result is taken from the
    /// gateway (it keeps them in its outbox) until lines have left.
    pub max_queued_lines: usize,
    /// First wait before reconnecting to the server; doubles up to `max_backoff`.
    pub initial_backoff: Duration,
    /// Longest wait between server reconnection attempts.
    pub max_backoff: Duration,
    /// The server password, SASL PLAIN, NickServ: how the bot logs in (secrets redacted).
    pub login: Login,
}

impl IrcConfig {
    /// Defaults: a burst of 5 lines then one a second, 40 lines per reply, 2,000 queued lines,
    /// backoff 1 s doubling to 60 s.
    pub(crate) fn new(
        gateway: GatewayConfig,
        server: &str,
        nick: &str,
        channels: Vec<String>,
    ) -> Self {
        IrcConfig {
            gateway,
            server: server.to_owned(),
            tls: false,
            tls_ca_file: None,
            tls_client_cert: None,
            nick: nick.to_owned(),
            channels,
            flood_burst: 5,
            flood_interval: Duration::from_secs(1),
            max_reply_lines: 40,
            format: super::markdown::Format::default(),
            max_queued_lines: 2000,
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(60),
            login: Login::default(),
        }
    }

    /// Checks what the server would refuse anyway, with a clear message.
    pub(crate) fn validate(&self) -> Result<(), BridgeError> {
        let bad_nick = self.nick.is_empty()
            || self.nick.len() > 30
            || self
                .nick
                .starts_with(|c: char| c.is_ascii_digit() || c == '-')
            || !self
                .nick
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_[]\\`^{}|".contains(c));
        if bad_nick {
            return Err(format!(
                "--nick {:?} is not a valid IRC nick (1 to 30 of A-Z a-z 0-9 - _ [ ] \\ ` ^ {{ }} |, not starting with a digit or -)",
                self.nick
            ));
        }
        for c in &self.channels {
            let ok = c.len() >= 2
                && c.len() <= 50
                && c.starts_with(['#', '&', '+', '!'])
                && !c.contains([' ', ',', '\x07', '\r', '\n', '\0']);
            if !ok {
                return Err(format!(
                    "--channel {c:?} is not a channel name (starts with #, &, + or !; no space or comma)"
                ));
            }
        }
        if self.flood_burst == 0 {
            return Err("--flood-burst must be at least 1".into());
        }
        if self.login.sasl_external && self.tls_client_cert.is_none() {
            return Err(
                "--sasl-external needs a client certificate (--tls-client-cert, --tls-client-key)"
                    .into(),
            );
        }
        self.login.validate()?;
        Ok(())
    }
}

/// Runs the IRC bridge until `stop` fires (or is dropped). `on_ready` is called once, with
/// the bot's nick, when both the gateway and the server (channels joined) are connected.
pub(crate) fn run(
    config: IrcConfig,
    stop: &Receiver<()>,
    on_ready: &mut dyn FnMut(&str),
) -> Result<(), BridgeError> {
    super::secrets::register(config.gateway.token.as_deref().unwrap_or_default());
    serve(config, stop, on_ready).map_err(|e| super::secrets::redact(&e).into_owned())
}

/// [`run`] once the secrets are registered.
fn serve(
    config: IrcConfig,
    stop: &Receiver<()>,
    on_ready: &mut dyn FnMut(&str),
) -> Result<(), BridgeError> {
    config.validate()?;
    let tls = if config.tls {
        let identity = config
            .tls_client_cert
            .as_ref()
            .map(|(c, k)| (c.as_path(), k.as_path()));
        Some(tls_config(config.tls_ca_file.as_deref(), identity)?)
    } else {
        None
    };
    let (gateway, gateway_rx) = Gateway::connect(config.gateway.clone());
    // Bounded: a flooding server fills it, then its reader thread waits, then TCP slows the
    // server down; the bridge's memory does not grow with the flood.
    let (server_tx, server_rx) = bounded(SERVER_INPUT_CAPACITY);
    let socket = Arc::new(Mutex::new(None));
    let (stop, _done) = watch_stop(stop, Arc::clone(&socket))?;
    let mut bridge = IrcSession::new(&config, gateway, server_tx, tls, socket);
    let result = bridge.run_loop(&stop, &server_rx, &gateway_rx, on_ready);
    // The gateway client may be blocked handing an event to a full channel nobody reads any
    // more: dropping the receivers ends such sends, so the join in `quit` cannot hang.
    drop(gateway_rx);
    drop(server_rx);
    bridge.quit();
    result
}
