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
//! - A nick in use gets an alternate (`NICK_`, `NICK_2`, …); PINGs are answered and the bot
//!   pings a silent server; a lost server is reconnected with capped exponential backoff.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, never, select, unbounded};

use super::gateway::{Admission, Gateway, GatewayConfig, GatewayEvent, OutgoingMessage};
use super::split::irc_lines;
use super::{BridgeError, map_command};
use crate::message::{ChatType, SessionKey};

/// Longest IRC line on the wire, CRLF included (RFC 1459/2812).
pub const IRC_MAX_LINE: usize = 512;
/// Longest line read from the server before it is cut (IRCv3 tags may make lines longer
/// than 512; anything past this is a broken server).
const MAX_READ_LINE: usize = 8192;
/// Alternate nicks tried at one registration before giving up on that connection.
const MAX_NICK_ATTEMPTS: u32 = 10;
/// Silence after which the bot pings the server; twice this and it reconnects.
const PING_AFTER: Duration = Duration::from_secs(90);
/// Time to connect to the IRC server.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// A write to the server blocked this long ends the connection.
const WRITE_TIMEOUT: Duration = Duration::from_secs(15);

/// Settings of the IRC bridge.
#[derive(Clone, Debug)]
pub struct IrcConfig {
    /// The gateway (platform `irc`).
    pub gateway: GatewayConfig,
    /// `HOST:PORT` of the IRC server.
    pub server: String,
    /// Speak TLS to the server (certificate checked against the system's roots).
    pub tls: bool,
    /// Trust only the CA certificates of this PEM file for TLS (a private server).
    pub tls_ca_file: Option<PathBuf>,
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
    /// Reply lines waiting to be sent at most; at the bound no new result is taken from the
    /// gateway (it keeps them in its outbox) until lines have left.
    pub max_queued_lines: usize,
    /// First wait before reconnecting to the server; doubles up to `max_backoff`.
    pub initial_backoff: Duration,
    /// Longest wait between server reconnection attempts.
    pub max_backoff: Duration,
}

impl IrcConfig {
    /// Defaults: a burst of 5 lines then one a second, 40 lines per reply, 2,000 queued lines,
    /// backoff 1 s doubling to 60 s.
    pub fn new(gateway: GatewayConfig, server: &str, nick: &str, channels: Vec<String>) -> Self {
        IrcConfig {
            gateway,
            server: server.to_owned(),
            tls: false,
            tls_ca_file: None,
            nick: nick.to_owned(),
            channels,
            flood_burst: 5,
            flood_interval: Duration::from_secs(1),
            max_reply_lines: 40,
            max_queued_lines: 2000,
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(60),
        }
    }

    /// Checks what the server would refuse anyway, with a clear message.
    pub fn validate(&self) -> Result<(), BridgeError> {
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
        Ok(())
    }
}

/// One parsed IRC line.
#[derive(Debug, PartialEq, Eq)]
pub struct IrcLine<'a> {
    /// The source (`nick!user@host` or a server name), without the colon.
    pub prefix: Option<&'a str>,
    /// The command or numeric, e.g. `PRIVMSG`, `001`.
    pub command: &'a str,
    /// The parameters; the trailing one (after ` :`) may contain spaces.
    pub params: Vec<&'a str>,
}

/// Parses one IRC line (without CRLF); IRCv3 tags are skipped. `None` for an empty line.
pub fn parse_line(line: &str) -> Option<IrcLine<'_>> {
    let mut rest = line.trim_end_matches(['\r', '\n']);
    if rest.starts_with('@') {
        rest = rest.split_once(' ').map_or("", |(_, r)| r);
    }
    let mut prefix = None;
    if let Some(p) = rest.strip_prefix(':') {
        let (pre, r) = p.split_once(' ')?;
        prefix = Some(pre);
        rest = r;
    }
    let rest = rest.trim_start_matches(' ');
    let (head, trailing) = match rest.split_once(" :") {
        Some((h, t)) => (h, Some(t)),
        None => match rest.strip_prefix(':') {
            Some(t) => ("", Some(t)),
            None => (rest, None),
        },
    };
    let mut words = head.split(' ').filter(|w| !w.is_empty());
    let command = words.next()?;
    let mut params: Vec<&str> = words.collect();
    params.extend(trailing);
    Some(IrcLine {
        prefix,
        command,
        params,
    })
}

/// The nick of a `nick!user@host` prefix.
fn nick_of(prefix: &str) -> &str {
    prefix.split(['!', '@']).next().unwrap_or(prefix)
}

/// The `n`th alternate of a taken nick: `NICK_`, then `NICK_2`, `NICK_3`, …
pub fn alternate_nick(base: &str, n: u32) -> String {
    if n <= 1 {
        format!("{base}_")
    } else {
        format!("{base}_{n}")
    }
}

/// Where a chat line came from and what it asked, once it is for the bot.
#[derive(Debug, PartialEq, Eq)]
pub struct Addressed {
    /// The chat: the channel, or the sender's nick for a private message.
    pub chat_id: String,
    /// `group` in a channel, `dm` in private.
    pub chat_type: ChatType,
    /// The sender's nick.
    pub sender: String,
    /// The text with the address removed and `!` commands mapped.
    pub text: String,
}

/// Decides whether a PRIVMSG from `sender` to `target` is for the bot (`own_nick`): a private
/// message, or a channel line starting with `own_nick:` / `own_nick,` (IRC nicks compare
/// case-insensitively). CTCP (`\x01…`) and empty texts are not.
pub fn addressed(own_nick: &str, sender: &str, target: &str, text: &str) -> Option<Addressed> {
    if text.starts_with('\x01') {
        return None;
    }
    let is_channel = target.starts_with(['#', '&', '+', '!']);
    let (chat_id, chat_type, body) = if is_channel {
        let head = text.get(..own_nick.len())?;
        if !head.eq_ignore_ascii_case(own_nick) {
            return None;
        }
        let rest = &text[own_nick.len()..];
        let body = rest.strip_prefix([':', ','])?;
        (target.to_owned(), ChatType::Group, body)
    } else if target.eq_ignore_ascii_case(own_nick) {
        (sender.to_owned(), ChatType::Dm, text)
    } else {
        return None;
    };
    let body = body.trim();
    if body.is_empty() {
        return None;
    }
    Some(Addressed {
        chat_id,
        chat_type,
        sender: sender.to_owned(),
        text: map_command(body).into_owned(),
    })
}

/// Where a result goes: the PRIVMSG target and, in a channel, whom to address. Built from the
/// session key, so results owed from before a restart of the bridge find their chat too.
#[derive(Debug, PartialEq, Eq, Clone)]
pub struct Route {
    /// Channel or nick.
    pub target: String,
    /// The nick the first line starts with (`nick: `), in a channel.
    pub addressee: Option<String>,
}

/// The route of a session key (`irc:group:#chan:user:ann` → `#chan`, addressed to `ann`;
/// `irc:dm:ann` → `ann`).
pub fn route_of(session: &str) -> Option<Route> {
    let key = SessionKey::from_str(session).ok()?;
    Some(match key.chat_type() {
        ChatType::Group => Route {
            target: key.chat_id().to_owned(),
            addressee: key.user_id().map(str::to_owned),
        },
        _ => Route {
            target: key.chat_id().to_owned(),
            addressee: None,
        },
    })
}

/// Bytes of text one PRIVMSG to `target` may carry so that the line the server relays —
/// `:<source> PRIVMSG <target> :<text>\r\n`, `source` being `nick!user@host` — stays within
/// 512 bytes.
pub fn text_budget(source_len: usize, target: &str) -> usize {
    let overhead = 1 + source_len + 1 + "PRIVMSG ".len() + target.len() + " :".len() + 2;
    IRC_MAX_LINE.saturating_sub(overhead)
}

/// A reply as the PRIVMSG texts to send, at most `max_lines` (the last one then says what
/// was left out).
pub fn reply_lines(route: &Route, text: &str, budget: usize, max_lines: usize) -> Vec<String> {
    let text = match &route.addressee {
        Some(nick) => format!("{nick}: {text}"),
        None => text.to_owned(),
    };
    let mut lines = irc_lines(&text, budget.max(16));
    if lines.is_empty() {
        lines.push("[empty reply]".into());
    }
    let max_lines = max_lines.max(2);
    if lines.len() > max_lines {
        let left: usize = lines[max_lines - 1..].iter().map(String::len).sum();
        lines.truncate(max_lines - 1);
        lines.push(format!(
            "[{left} more bytes not shown: the reply is too long for IRC]"
        ));
    }
    lines
}

/// A line waiting for the flood bucket.
struct OutLine {
    target: String,
    text: String,
    /// The result this line ends: confirmed to the gateway once it is written.
    completes: Option<String>,
}

/// What the server-reading thread reports.
enum ServerInput {
    Line(u64, String),
    Closed(u64, String),
}

/// One connection to the IRC server.
struct ServerConn {
    generation: u64,
    writer: Wire,
    /// The TCP socket under `writer`, to shut it down (which also ends the reader).
    socket: TcpStream,
    registered: bool,
    nick: String,
    nick_attempts: u32,
    /// Length of `nick!user@host` as the server relays it.
    source_len: usize,
    unresolved_channels: usize,
    last_heard: Instant,
    pinged: bool,
}

impl ServerConn {
    fn send_raw(&mut self, line: &str) -> io::Result<()> {
        log::debug!("irc: -> {}", line.split(' ').next().unwrap_or(""));
        let mut bytes = Vec::with_capacity(line.len() + 2);
        bytes.extend_from_slice(line.as_bytes());
        bytes.extend_from_slice(b"\r\n");
        match &mut self.writer {
            Wire::Plain(s) => s.write_all(&bytes),
            Wire::Tls(tls) => {
                let mut tls = tls.lock().unwrap_or_else(|e| e.into_inner());
                tls.write_all(&bytes)?;
                tls.flush()
            }
        }
    }
}

impl Drop for ServerConn {
    fn drop(&mut self) {
        let _ = self.socket.shutdown(Shutdown::Both);
    }
}

type TlsStream = rustls::StreamOwned<rustls::ClientConnection, TcpStream>;

/// The writing side of a server connection: plain TCP, or TLS (shared with the reader, which
/// holds the lock only while data is there to read).
enum Wire {
    Plain(TcpStream),
    Tls(Arc<Mutex<TlsStream>>),
}

/// How long a TLS read holds the stream's lock waiting for more bytes.
const TLS_READ_SLICE: Duration = Duration::from_millis(20);

/// The reading side of a TLS connection: waits for the socket in `poll(2)` without the lock,
/// then reads under it (and keeps reading while rustls has decrypted data buffered).
struct TlsReader {
    stream: Arc<Mutex<TlsStream>>,
    /// The descriptor polled: `_socket`'s, which this reader keeps open.
    fd: std::os::fd::RawFd,
    _socket: TcpStream,
    draining: bool,
}

impl Read for TlsReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if !self.draining {
            let mut pfd = libc::pollfd {
                fd: self.fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd, whose descriptor `_socket` keeps open.
            let rc = unsafe { libc::poll(&mut pfd, 1, 1000) };
            if rc < 0 {
                let e = io::Error::last_os_error();
                return if e.kind() == io::ErrorKind::Interrupted {
                    Err(io::ErrorKind::WouldBlock.into())
                } else {
                    Err(e)
                };
            }
            if rc == 0 {
                return Err(io::ErrorKind::WouldBlock.into());
            }
        }
        let mut tls = self.stream.lock().unwrap_or_else(|e| e.into_inner());
        match tls.read(buf) {
            Ok(n) => {
                self.draining = n > 0;
                Ok(n)
            }
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(0),
            Err(e) => {
                self.draining = false;
                Err(e)
            }
        }
    }
}

/// The TLS settings: the roots of `ca_file` (PEM) if given, else the operating system's.
pub fn tls_config(ca_file: Option<&Path>) -> Result<Arc<rustls::ClientConfig>, BridgeError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS set-up failed: {e}"))?;
    let config = match ca_file {
        Some(path) => {
            use rustls_pki_types::CertificateDer;
            use rustls_pki_types::pem::PemObject;
            let bad = |e: &dyn std::fmt::Display| format!("--tls-ca-file {}: {e}", path.display());
            let mut roots = rustls::RootCertStore::empty();
            for cert in CertificateDer::pem_file_iter(path).map_err(|e| bad(&e))? {
                roots.add(cert.map_err(|e| bad(&e))?).map_err(|e| bad(&e))?;
            }
            if roots.is_empty() {
                return Err(bad(&"no certificate in it"));
            }
            builder.with_root_certificates(roots).with_no_client_auth()
        }
        None => {
            use rustls_platform_verifier::BuilderVerifierExt;
            builder
                .with_platform_verifier()
                .map_err(|e| format!("cannot load the system's certificates: {e}"))?
                .with_no_client_auth()
        }
    };
    Ok(Arc::new(config))
}

/// The host part of `HOST:PORT` (`[v6]:port` too), the name TLS checks the certificate for.
fn host_of(server: &str) -> &str {
    let host = server.rsplit_once(':').map_or(server, |(h, _)| h);
    host.trim_start_matches('[').trim_end_matches(']')
}

/// Completes the TLS handshake on `socket` (bounded by the connect timeout).
fn tls_handshake(
    mut socket: TcpStream,
    server: &str,
    config: &Arc<rustls::ClientConfig>,
) -> Result<TlsStream, String> {
    let host = host_of(server);
    let name = rustls_pki_types::ServerName::try_from(host.to_owned())
        .map_err(|_| format!("{host} is not a name TLS can check a certificate for"))?;
    let mut conn = rustls::ClientConnection::new(Arc::clone(config), name)
        .map_err(|e| format!("TLS set-up failed: {e}"))?;
    let io_err = |e: io::Error| format!("TLS handshake with {server} failed: {e}");
    socket
        .set_read_timeout(Some(CONNECT_TIMEOUT))
        .map_err(io_err)?;
    while conn.is_handshaking() {
        conn.complete_io(&mut socket).map_err(io_err)?;
    }
    socket
        .set_read_timeout(Some(TLS_READ_SLICE))
        .map_err(io_err)?;
    Ok(rustls::StreamOwned::new(conn, socket))
}

/// A token bucket: `burst` lines at once, one more per `interval`.
struct FloodBucket {
    tokens: f64,
    burst: f64,
    interval: Duration,
    last: Instant,
}

impl FloodBucket {
    fn new(burst: u32, interval: Duration) -> FloodBucket {
        FloodBucket {
            tokens: f64::from(burst),
            burst: f64::from(burst),
            interval,
            last: Instant::now(),
        }
    }

    fn refill(&mut self, now: Instant) {
        let per = self.interval.as_secs_f64();
        let gained = if per <= 0.0 {
            self.burst
        } else {
            now.saturating_duration_since(self.last).as_secs_f64() / per
        };
        self.tokens = (self.tokens + gained).min(self.burst);
        self.last = now;
    }

    fn take(&mut self, now: Instant) -> bool {
        self.refill(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// When the next token is there.
    fn next_at(&self) -> Instant {
        let missing = (1.0 - self.tokens).max(0.0);
        self.last + self.interval.mul_f64(missing)
    }
}

struct Bridge<'a> {
    config: &'a IrcConfig,
    gateway: Gateway,
    conn: Option<ServerConn>,
    generation: u64,
    server_tx: Sender<ServerInput>,
    outbox: VecDeque<OutLine>,
    bucket: FloodBucket,
    /// Messages sent and not answered yet: where to tell a rejection.
    routes: HashMap<String, Route>,
    gateway_up: bool,
    ready: bool,
    next_id: u64,
    /// Makes message ids unique across restarts of the bridge (the gateway remembers ids
    /// for its duplicate window).
    boot: u128,
    reconnect_at: Option<Instant>,
    backoff: Duration,
    /// TLS settings, with `--tls`.
    tls: Option<Arc<rustls::ClientConfig>>,
}

/// Runs the IRC bridge until `stop` fires (or is dropped). `on_ready` is called once, with
/// the bot's nick, when both the gateway and the server (channels joined) are connected.
pub fn run(
    config: IrcConfig,
    stop: &Receiver<()>,
    on_ready: &mut dyn FnMut(&str),
) -> Result<(), BridgeError> {
    config.validate()?;
    let tls = if config.tls {
        Some(tls_config(config.tls_ca_file.as_deref())?)
    } else {
        None
    };
    let (gateway, gateway_rx) = Gateway::connect(config.gateway.clone());
    let (server_tx, server_rx) = unbounded();
    let boot = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let mut bridge = Bridge {
        config: &config,
        gateway,
        conn: None,
        generation: 0,
        server_tx,
        outbox: VecDeque::new(),
        bucket: FloodBucket::new(config.flood_burst, config.flood_interval),
        routes: HashMap::new(),
        gateway_up: false,
        ready: false,
        next_id: 0,
        boot,
        reconnect_at: Some(Instant::now()),
        backoff: config.initial_backoff,
        tls,
    };
    let result = bridge.run_loop(stop, &server_rx, &gateway_rx, on_ready);
    if let Some(mut conn) = bridge.conn.take() {
        let _ = conn.send_raw("QUIT :turnstile bridge stopping");
    }
    bridge.gateway.shutdown();
    result
}

impl Bridge<'_> {
    fn run_loop(
        &mut self,
        stop: &Receiver<()>,
        server_rx: &Receiver<ServerInput>,
        gateway_rx: &Receiver<GatewayEvent>,
        on_ready: &mut dyn FnMut(&str),
    ) -> Result<(), BridgeError> {
        loop {
            let now = Instant::now();
            if self.reconnect_at.is_some_and(|t| t <= now) {
                self.reconnect_at = None;
                self.connect_server();
            }
            self.flush_outbox();
            self.keepalive(now);
            if !self.ready
                && self.gateway_up
                && let Some(conn) = &self.conn
                && conn.registered
                && conn.unresolved_channels == 0
            {
                self.ready = true;
                on_ready(&conn.nick);
            }
            let wake = self.next_wake(now);
            // Results are taken from the gateway only while there is room for a whole reply.
            let room = self.outbox.len() + self.config.max_reply_lines.max(2)
                <= self
                    .config
                    .max_queued_lines
                    .max(self.config.max_reply_lines.max(2));
            let never_rx = never();
            let gw = if room { gateway_rx } else { &never_rx };
            select! {
                recv(stop) -> _ => return Ok(()),
                recv(server_rx) -> input => match input {
                    Ok(input) => self.on_server(input),
                    Err(_) => return Err("the IRC reader channel closed".into()),
                },
                recv(gw) -> event => match event {
                    Ok(event) => self.on_gateway(event),
                    Err(_) => return Err("the gateway client stopped".into()),
                },
                default(wake.saturating_duration_since(Instant::now())) => {}
            }
        }
    }

    fn next_wake(&self, now: Instant) -> Instant {
        let mut wake = now + Duration::from_secs(5);
        if let Some(t) = self.reconnect_at {
            wake = wake.min(t);
        }
        if !self.outbox.is_empty() && self.conn.as_ref().is_some_and(|c| c.registered) {
            wake = wake.min(self.bucket.next_at());
        }
        wake.max(now)
    }

    fn schedule_reconnect(&mut self, reason: &str) {
        self.conn = None;
        let wait = self.backoff;
        log::warn!(
            "irc {}: {reason}; reconnecting in {wait:?}",
            self.config.server
        );
        self.reconnect_at = Some(Instant::now() + wait);
        self.backoff = (self.backoff * 2).min(self.config.max_backoff);
    }

    fn connect_server(&mut self) {
        let stream = match open(&self.config.server) {
            Ok(s) => s,
            Err(e) => return self.schedule_reconnect(&e),
        };
        let setup = (|| -> io::Result<(TcpStream, TcpStream)> {
            stream.set_nodelay(true)?;
            stream.set_write_timeout(Some(WRITE_TIMEOUT))?;
            Ok((stream.try_clone()?, stream.try_clone()?))
        })();
        let (socket, reader) = match setup {
            Ok(r) => r,
            Err(e) => return self.schedule_reconnect(&format!("socket setup failed: {e}")),
        };
        let (writer, reader): (Wire, Box<dyn Read + Send>) = match &self.tls {
            None => (Wire::Plain(stream), Box::new(reader)),
            Some(config) => match tls_handshake(stream, &self.config.server, config) {
                Ok(tls) => {
                    let tls = Arc::new(Mutex::new(tls));
                    let reader = TlsReader {
                        stream: Arc::clone(&tls),
                        fd: std::os::fd::AsRawFd::as_raw_fd(&reader),
                        _socket: reader,
                        draining: false,
                    };
                    (Wire::Tls(tls), Box::new(reader))
                }
                Err(e) => return self.schedule_reconnect(&e),
            },
        };
        self.generation += 1;
        let generation = self.generation;
        let tx = self.server_tx.clone();
        let spawned = std::thread::Builder::new()
            .name("irc-reader".into())
            .spawn(move || read_server(reader, generation, &tx));
        if let Err(e) = spawned {
            return self.schedule_reconnect(&format!("cannot start the reader thread: {e}"));
        }
        let nick = self.config.nick.clone();
        let mut conn = ServerConn {
            generation,
            writer,
            socket,
            registered: false,
            source_len: conservative_source_len(&nick),
            nick,
            nick_attempts: 0,
            unresolved_channels: self.config.channels.len(),
            last_heard: Instant::now(),
            pinged: false,
        };
        let registered = conn
            .send_raw(&format!("NICK {}", conn.nick))
            .and_then(|()| conn.send_raw(&format!("USER {} 0 * :turnstile bridge", conn.nick)));
        self.conn = Some(conn);
        if let Err(e) = registered {
            self.schedule_reconnect(&format!("registration write failed: {e}"));
        }
    }

    fn keepalive(&mut self, now: Instant) {
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        let silent = now.saturating_duration_since(conn.last_heard);
        if silent >= PING_AFTER * 2 {
            return self.schedule_reconnect(&format!("no data from the server for {silent:?}"));
        }
        if silent >= PING_AFTER && !conn.pinged {
            conn.pinged = true;
            if let Err(e) = conn.send_raw("PING :turnstile") {
                self.schedule_reconnect(&format!("write failed: {e}"));
            }
        }
    }

    fn flush_outbox(&mut self) {
        loop {
            let Some(conn) = self.conn.as_mut() else {
                return;
            };
            if !conn.registered || self.outbox.is_empty() {
                return;
            }
            if !self.bucket.take(Instant::now()) {
                return;
            }
            let Some(line) = self.outbox.pop_front() else {
                return;
            };
            match conn.send_raw(&format!("PRIVMSG {} :{}", line.target, line.text)) {
                Ok(()) => {
                    if let Some(id) = line.completes {
                        log::debug!("irc: result {id} sent to {}", line.target);
                        self.gateway.delivered(&id);
                    }
                }
                Err(e) => {
                    // Not written: it goes first again after the reconnect.
                    self.outbox.push_front(line);
                    return self.schedule_reconnect(&format!("write failed: {e}"));
                }
            }
        }
    }

    fn send_now(&mut self, line: &str) {
        if let Some(conn) = self.conn.as_mut()
            && let Err(e) = conn.send_raw(line)
        {
            self.schedule_reconnect(&format!("write failed: {e}"));
        }
    }

    fn on_server(&mut self, input: ServerInput) {
        let (generation, line) = match input {
            ServerInput::Line(g, line) => (g, line),
            ServerInput::Closed(g, reason) => {
                if self.conn.as_ref().is_some_and(|c| c.generation == g) {
                    self.schedule_reconnect(&reason);
                }
                return;
            }
        };
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        if conn.generation != generation {
            return;
        }
        conn.last_heard = Instant::now();
        conn.pinged = false;
        let Some(msg) = parse_line(&line) else {
            return;
        };
        match msg.command {
            "PING" => {
                let token = msg.params.first().copied().unwrap_or("");
                self.send_now(&format!("PONG :{token}"));
            }
            "001" => {
                conn.registered = true;
                if let Some(nick) = msg.params.first() {
                    conn.nick = (*nick).to_owned();
                }
                // The welcome ends with the source the server will relay our lines with.
                let source = msg
                    .params
                    .last()
                    .and_then(|t| t.rsplit(' ').next())
                    .filter(|w| w.contains('!') && w.contains('@') && nick_of(w) == conn.nick);
                conn.source_len = match source {
                    Some(s) => s.len(),
                    None => conservative_source_len(&conn.nick),
                };
                self.backoff = self.config.initial_backoff;
                log::info!(
                    "irc {}: registered as {} (relayed as {} bytes of source)",
                    self.config.server,
                    conn.nick,
                    conn.source_len
                );
                for channel in self.config.channels.clone() {
                    self.send_now(&format!("JOIN {channel}"));
                }
            }
            "433" | "436" | "432" if !conn.registered => {
                conn.nick_attempts += 1;
                if conn.nick_attempts > MAX_NICK_ATTEMPTS {
                    return self.schedule_reconnect(&format!(
                        "no nick accepted after {MAX_NICK_ATTEMPTS} alternates of {}",
                        self.config.nick
                    ));
                }
                let alt = alternate_nick(&self.config.nick, conn.nick_attempts);
                log::warn!(
                    "irc {}: nick {} refused ({}); trying {alt}",
                    self.config.server,
                    conn.nick,
                    msg.command
                );
                conn.nick = alt.clone();
                conn.source_len = conservative_source_len(&alt);
                self.send_now(&format!("NICK {alt}"));
            }
            "NICK" => {
                if msg.prefix.map(nick_of) == Some(conn.nick.as_str())
                    && let Some(new) = msg.params.first()
                {
                    let grown = new.len() as isize - conn.nick.len() as isize;
                    conn.nick = (*new).to_owned();
                    conn.source_len = conn.source_len.saturating_add_signed(grown);
                }
            }
            "JOIN" if msg.prefix.map(nick_of) == Some(conn.nick.as_str()) => {
                conn.unresolved_channels = conn.unresolved_channels.saturating_sub(1);
                log::info!(
                    "irc {}: joined {}",
                    self.config.server,
                    msg.params.first().unwrap_or(&"?")
                );
            }
            "403" | "405" | "471" | "473" | "474" | "475" | "477" => {
                conn.unresolved_channels = conn.unresolved_channels.saturating_sub(1);
                log::error!(
                    "irc {}: cannot join {}: {}",
                    self.config.server,
                    msg.params.get(1).unwrap_or(&"?"),
                    msg.params.last().unwrap_or(&"")
                );
            }
            "KICK" => {
                if msg.params.get(1).copied() == Some(conn.nick.as_str())
                    && let Some(channel) = msg.params.first()
                {
                    log::warn!(
                        "irc {}: kicked from {channel}; joining again",
                        self.config.server
                    );
                    let join = format!("JOIN {channel}");
                    self.send_now(&join);
                }
            }
            "ERROR" => {
                log::warn!(
                    "irc {}: server error: {}",
                    self.config.server,
                    msg.params.last().unwrap_or(&"")
                );
            }
            "PRIVMSG" => {
                let (Some(prefix), Some(target), Some(text)) =
                    (msg.prefix, msg.params.first(), msg.params.get(1))
                else {
                    return;
                };
                let sender = nick_of(prefix);
                if let Some(a) = addressed(&conn.nick, sender, target, text) {
                    self.submit(a);
                }
            }
            _ => {}
        }
    }

    fn submit(&mut self, a: Addressed) {
        self.next_id += 1;
        let id = format!("irc-{:x}-{}", self.boot, self.next_id);
        let mut message = OutgoingMessage::new(&id, &a.chat_id, &a.text);
        message.chat_type = a.chat_type;
        message.user_id = Some(a.sender.clone());
        message.user_name = Some(a.sender.clone());
        let route = Route {
            target: a.chat_id.clone(),
            addressee: (a.chat_type == ChatType::Group).then(|| a.sender.clone()),
        };
        log::debug!("irc: message {id} from {} in {}", a.sender, a.chat_id);
        match self.gateway.send(&message) {
            Ok(()) => {
                self.routes.insert(id, route);
            }
            Err(e) => {
                log::warn!(
                    "irc: message from {} in {} not passed to the gateway: {e}",
                    a.sender,
                    a.chat_id
                );
                self.queue_reply(
                    &route,
                    &format!("[not accepted: {e}; please try again later]"),
                    None,
                );
            }
        }
    }

    fn queue_reply(&mut self, route: &Route, text: &str, completes: Option<String>) {
        let source_len = self.conn.as_ref().map_or_else(
            || conservative_source_len(&self.config.nick),
            |c| c.source_len,
        );
        let budget = text_budget(source_len, &route.target);
        let lines = reply_lines(route, text, budget, self.config.max_reply_lines);
        let last = lines.len().saturating_sub(1);
        for (i, text) in lines.into_iter().enumerate() {
            self.outbox.push_back(OutLine {
                target: route.target.clone(),
                text,
                completes: if i == last { completes.clone() } else { None },
            });
        }
    }

    fn on_gateway(&mut self, event: GatewayEvent) {
        match event {
            GatewayEvent::Connected => self.gateway_up = true,
            GatewayEvent::Disconnected { .. } => self.gateway_up = false,
            GatewayEvent::Admission { id, admission } => {
                let route = self.routes.remove(&id);
                if let Admission::Rejected { reason, detail, .. } = admission {
                    log::warn!("irc: message {id} rejected by the gateway: {reason} ({detail})");
                    if let Some(route) = route {
                        let text = format!("[not accepted ({reason}): {detail}]");
                        self.queue_reply(&route, &text, None);
                    }
                }
            }
            GatewayEvent::Result(result) => {
                let Some(route) = route_of(&result.session) else {
                    log::error!(
                        "irc: result {} has a session key that names no chat ({}); dropped",
                        result.id,
                        result.session
                    );
                    self.gateway.delivered(&result.id);
                    return;
                };
                match result.outcome.chat_text() {
                    Some(text) => self.queue_reply(&route, &text, Some(result.id)),
                    None => self.gateway.delivered(&result.id),
                }
            }
            GatewayEvent::Typing { .. } | GatewayEvent::Partial { .. } => {}
            GatewayEvent::Error { .. } => {}
        }
    }
}

/// Source length to assume before the server told it: the nick, a 10-byte user with `~`,
/// and a 63-byte host (the longest DNS label run a server shows).
fn conservative_source_len(nick: &str) -> usize {
    nick.len() + 1 + 11 + 1 + 63
}

fn open(addr: &str) -> Result<TcpStream, String> {
    let addrs: Vec<_> = addr
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {addr}: {e}"))?
        .collect();
    let mut last = format!("{addr} resolves to no address");
    for a in addrs {
        match TcpStream::connect_timeout(&a, CONNECT_TIMEOUT) {
            Ok(s) => return Ok(s),
            Err(e) => last = format!("cannot connect to {a}: {e}"),
        }
    }
    Err(last)
}

/// Reads server lines (bounded length, lossy UTF-8: IRC has no encoding rule) until the
/// connection ends.
fn read_server(mut stream: Box<dyn Read + Send>, generation: u64, tx: &Sender<ServerInput>) {
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = [0u8; 4096];
    let reason = loop {
        match stream.read(&mut chunk) {
            Ok(0) => break "the server closed the connection".to_owned(),
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                let mut start = 0;
                while let Some(nl) = buf[start..].iter().position(|&b| b == b'\n') {
                    let line = String::from_utf8_lossy(&buf[start..start + nl]).into_owned();
                    start += nl + 1;
                    if tx.send(ServerInput::Line(generation, line)).is_err() {
                        return;
                    }
                }
                buf.drain(..start);
                if buf.len() > MAX_READ_LINE {
                    log::warn!("irc: the server sent a line over {MAX_READ_LINE} bytes; cut");
                    buf.clear();
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::Interrupted
                        | io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                ) => {}
            Err(e) => break format!("reading from the server failed: {e}"),
        }
    };
    let _ = tx.send(ServerInput::Closed(generation, reason));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_prefix_command_and_trailing() {
        let l = parse_line(":ann!~a@host PRIVMSG #chan :bot: hello there\r").expect("line");
        assert_eq!(l.prefix, Some("ann!~a@host"));
        assert_eq!(l.command, "PRIVMSG");
        assert_eq!(l.params, ["#chan", "bot: hello there"]);
        let l = parse_line("PING :irc.example").expect("line");
        assert_eq!((l.prefix, l.command), (None, "PING"));
        assert_eq!(l.params, ["irc.example"]);
        let l = parse_line("@time=x :srv 001 bot :Welcome bot!~b@h").expect("line");
        assert_eq!(l.command, "001");
        assert_eq!(l.params, ["bot", "Welcome bot!~b@h"]);
        assert_eq!(parse_line(""), None);
    }

    #[test]
    fn channel_lines_need_the_address_and_dms_do_not() {
        let a = addressed("Bot", "ann", "#chan", "bot: !stop").expect("addressed");
        assert_eq!(
            a,
            Addressed {
                chat_id: "#chan".into(),
                chat_type: ChatType::Group,
                sender: "ann".into(),
                text: "/stop".into()
            }
        );
        assert_eq!(
            addressed("bot", "ann", "#chan", "bot, hi").expect("x").text,
            "hi"
        );
        assert_eq!(addressed("bot", "ann", "#chan", "hello bot"), None);
        assert_eq!(addressed("bot", "ann", "#chan", "botany: hi"), None);
        assert_eq!(addressed("bot", "ann", "#chan", "bot:"), None);
        let dm = addressed("bot", "ann", "bot", "!new").expect("dm");
        assert_eq!((dm.chat_id.as_str(), dm.chat_type), ("ann", ChatType::Dm));
        assert_eq!(dm.text, "/new");
        assert_eq!(addressed("bot", "ann", "bob", "hi"), None);
        assert_eq!(addressed("bot", "ann", "bot", "\x01VERSION\x01"), None);
    }

    #[test]
    fn session_keys_route_results_to_their_chat() {
        let group = SessionKey::new("irc", ChatType::Group, "#chan", None, Some("ann"))
            .expect("key")
            .to_string();
        assert_eq!(
            route_of(&group),
            Some(Route {
                target: "#chan".into(),
                addressee: Some("ann".into())
            })
        );
        let dm = SessionKey::dm("irc", "ann").expect("key").to_string();
        assert_eq!(
            route_of(&dm),
            Some(Route {
                target: "ann".into(),
                addressee: None
            })
        );
        assert_eq!(route_of("nonsense"), None);
    }

    #[test]
    fn relayed_lines_stay_within_512_bytes() {
        let source = "bot!~bot@localhost";
        let route = Route {
            target: "#chan".into(),
            addressee: Some("ann".into()),
        };
        let text = "日本語のテキスト 🎉 ".repeat(200);
        let budget = text_budget(source.len(), &route.target);
        let lines = reply_lines(&route, &text, budget, 1000);
        assert!(lines.len() > 5);
        for l in &lines {
            let wire = format!(":{source} PRIVMSG {} :{l}\r\n", route.target);
            assert!(wire.len() <= IRC_MAX_LINE, "{} bytes", wire.len());
        }
        assert!(lines[0].starts_with("ann: "));
    }

    #[test]
    fn long_replies_are_capped_with_a_note() {
        let route = Route {
            target: "ann".into(),
            addressee: None,
        };
        let lines = reply_lines(&route, &"word ".repeat(1000), 100, 5);
        assert_eq!(lines.len(), 5);
        assert!(lines[4].contains("more bytes not shown"), "{}", lines[4]);
        assert_eq!(reply_lines(&route, "", 100, 5), ["[empty reply]"]);
    }

    #[test]
    fn alternate_nicks_differ_from_the_base() {
        assert_eq!(alternate_nick("bot", 1), "bot_");
        assert_eq!(alternate_nick("bot", 2), "bot_2");
    }

    #[test]
    fn the_flood_bucket_allows_a_burst_then_paces() {
        let mut b = FloodBucket::new(2, Duration::from_secs(1));
        let t0 = b.last;
        assert!(b.take(t0) && b.take(t0));
        assert!(!b.take(t0));
        assert!(!b.take(t0 + Duration::from_millis(500)));
        assert!(b.take(t0 + Duration::from_millis(1000)));
    }
}
