//! The bridge's session: one IRC server connection (registration, nick, joins, the
//! outbox under the flood bucket) and the gateway's events turned into lines.

use std::collections::{HashMap, HashSet};
use std::io::{self, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, never, select};

use super::flood::FloodBucket;
use super::login::Sasl;
use super::transport::{ServerInput, Wire, open, read_server, wire_up};
use super::wire::{
    Addressed, IrcLine, ReplyTarget, addressed, alternate_nick, conservative_source_len, nick_of,
    parse_line, reply_lines, route_of, text_budget,
};
use super::{IrcConfig, SocketSlot};
use crate::message::ChatType;
use crate::platforms::BridgeError;
use crate::platforms::fair::FairQueue;
use crate::platforms::gateway::{Admission, Gateway, GatewayEvent, OutgoingMessage};
use crate::platforms::markdown::{self, Format};

/// Alternate nicks tried at one registration before giving up on that connection.
const MAX_NICK_ATTEMPTS: u32 = 10;
/// The longest the QUIT of a stopping bridge may block.
const QUIT_TIMEOUT: Duration = Duration::from_millis(500);
/// Silence after which the bot pings the server; twice this and it reconnects.
const PING_AFTER: Duration = Duration::from_secs(90);

/// A line waiting for the flood bucket.
struct OutLine {
    target: String,
    text: String,
    /// The result this line ends: confirmed to the gateway once it is written.
    completes: Option<String>,
    /// The last line of a refusal notice: once it is written, its target may get another.
    notice: bool,
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
    /// Where the SASL exchange is.
    sasl: Sasl,
}

impl ServerConn {
    /// Writes one line (CRLF added).
    fn send_raw(&mut self, line: &str) -> io::Result<()> {
        debug_redacted!("irc: -> {}", line.split(' ').next().unwrap_or(""));
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

/// The bridge: the server connection, the outbox, and what it knows of the gateway.
pub(super) struct IrcSession<'a> {
    config: &'a IrcConfig,
    gateway: Gateway,
    conn: Option<ServerConn>,
    generation: u64,
    server_tx: Sender<ServerInput>,
    /// Lines to send, one queue per target served in turn: one target's long reply does not
    /// hold another's first line.
    outbox: FairQueue<OutLine>,
    /// Targets with a refusal notice waiting in the outbox: one at most each; later ones
    /// are dropped until it is written (a flood of refusals is told once, not queued).
    notices: HashSet<String>,
    bucket: FloodBucket,
    /// Messages sent and not answered yet: where to tell a rejection.
    routes: HashMap<String, ReplyTarget>,
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
    /// The current server socket, for the stop watcher.
    socket_slot: SocketSlot,
}

impl<'a> IrcSession<'a> {
    /// A bridge that connects to the server at its first loop turn.
    pub(super) fn new(
        config: &'a IrcConfig,
        gateway: Gateway,
        server_tx: Sender<ServerInput>,
        tls: Option<Arc<rustls::ClientConfig>>,
        socket_slot: SocketSlot,
    ) -> IrcSession<'a> {
        let boot = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        IrcSession {
            config,
            gateway,
            conn: None,
            generation: 0,
            server_tx,
            outbox: FairQueue::default(),
            notices: HashSet::new(),
            bucket: FloodBucket::new(config.flood_burst, config.flood_interval),
            routes: HashMap::new(),
            gateway_up: false,
            ready: false,
            next_id: 0,
            boot,
            reconnect_at: Some(Instant::now()),
            backoff: config.initial_backoff,
            tls,
            socket_slot,
        }
    }

    /// Says QUIT to the server and shuts the gateway client down.
    pub(super) fn quit(&mut self) {
        if let Some(mut conn) = self.conn.take() {
            // A server that stopped reading must not hold the exit.
            let _ = conn.socket.set_write_timeout(Some(QUIT_TIMEOUT));
            let _ = conn.send_raw("QUIT :turnstile bridge stopping");
        }
        self.gateway.shutdown();
    }

    /// Serves the server and the gateway until `stop`.
    pub(super) fn run_loop(
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

    /// When the loop must look again: a reconnect, the flood bucket's next token, or 5 s.
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

    /// Drops the connection and reconnects after the backoff (which doubles).
    fn schedule_reconnect(&mut self, reason: &str) {
        self.conn = None;
        let wait = self.backoff;
        warn_limited!(
            "irc {}: {reason}; reconnecting in {wait:?}",
            self.config.server
        );
        self.reconnect_at = Some(Instant::now() + wait);
        self.backoff = (self.backoff * 2).min(self.config.max_backoff);
        let why = crate::platforms::secrets::redact(reason).into_owned();
        self.gateway.link(false, Some(why));
    }

    /// Connects, starts the reader thread, and registers (NICK, USER).
    fn connect_server(&mut self) {
        let stream = match open(&self.config.server) {
            Ok(s) => s,
            Err(e) => return self.schedule_reconnect(&e),
        };
        let (writer, socket, reader) = match wire_up(stream, &self.config.server, self.tls.as_ref())
        {
            Ok(w) => w,
            Err(e) => return self.schedule_reconnect(&e),
        };
        *self.socket_slot.lock().unwrap_or_else(|e| e.into_inner()) = socket.try_clone().ok();
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
        let (opening, sasl) = self.config.login.opening();
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
            sasl,
        };
        let registered = opening
            .iter()
            .try_for_each(|line| conn.send_raw(line))
            .and_then(|()| conn.send_raw(&format!("NICK {}", conn.nick)))
            .and_then(|()| conn.send_raw(&format!("USER {} 0 * :turnstile bridge", conn.nick)));
        self.conn = Some(conn);
        if let Err(e) = registered {
            self.schedule_reconnect(&format!("registration write failed: {e}"));
        }
    }

    /// Pings a silent server; reconnects to one silent for twice as long.
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

    /// Writes queued lines while the flood bucket allows; a result's last line written is
    /// confirmed to the gateway.
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
            let Some(line) = self.outbox.pop() else {
                return;
            };
            match conn.send_raw(&format!("PRIVMSG {} :{}", line.target, line.text)) {
                Ok(()) => {
                    if line.notice {
                        self.notices.remove(&line.target);
                    }
                    if let Some(id) = line.completes {
                        debug_redacted!("irc: result {id} sent to {}", line.target);
                        self.gateway.delivered(&id);
                    }
                }
                Err(e) => {
                    // Not written: it goes first again after the reconnect.
                    let target = line.target.clone();
                    self.outbox.push_front(&target, line);
                    return self.schedule_reconnect(&format!("write failed: {e}"));
                }
            }
        }
    }

    /// Writes a protocol line outside the flood bucket (PONG, JOIN, NICK).
    fn send_now(&mut self, line: &str) {
        if let Some(conn) = self.conn.as_mut()
            && let Err(e) = conn.send_raw(line)
        {
            self.schedule_reconnect(&format!("write failed: {e}"));
        }
    }

    /// A line (or the end) from the server-reading thread.
    fn on_server(&mut self, input: ServerInput) {
        let Some(line) = self.current_line(input) else {
            return;
        };
        if let Some(msg) = parse_line(&line) {
            self.on_message(&msg);
        }
    }

    /// The line, if it comes from the current connection (which was just heard from); a
    /// closed current connection is reconnected.
    fn current_line(&mut self, input: ServerInput) -> Option<String> {
        let (generation, line) = match input {
            ServerInput::Line(g, line) => (g, line),
            ServerInput::Closed(g, reason) => {
                if self.conn.as_ref().is_some_and(|c| c.generation == g) {
                    self.schedule_reconnect(&reason);
                }
                return None;
            }
        };
        let conn = self.conn.as_mut()?;
        if conn.generation != generation {
            return None;
        }
        conn.last_heard = Instant::now();
        conn.pinged = false;
        Some(line)
    }

    /// Acts on one server line of the current connection.
    fn on_message(&mut self, msg: &IrcLine<'_>) {
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        let from_us = msg.prefix.map(nick_of) == Some(conn.nick.as_str());
        match msg.command {
            "PING" => {
                let token = msg.params.first().copied().unwrap_or("");
                self.send_now(&format!("PONG :{token}"));
            }
            "001" => self.on_welcome(msg),
            "433" | "436" | "432" if !conn.registered => self.on_nick_refused(msg),
            "NICK" => {
                if from_us && let Some(new) = msg.params.first() {
                    let grown = new.len() as isize - conn.nick.len() as isize;
                    conn.nick = (*new).to_owned();
                    conn.source_len = conn.source_len.saturating_add_signed(grown);
                }
            }
            "JOIN" if from_us => {
                conn.unresolved_channels = conn.unresolved_channels.saturating_sub(1);
                info_redacted!(
                    "irc {}: joined {}",
                    self.config.server,
                    msg.params.first().unwrap_or(&"?")
                );
            }
            "403" | "405" | "471" | "473" | "474" | "475" | "477" => {
                conn.unresolved_channels = conn.unresolved_channels.saturating_sub(1);
                error_limited!(
                    "irc {}: cannot join {}: {}",
                    self.config.server,
                    msg.params.get(1).unwrap_or(&"?"),
                    msg.params.last().unwrap_or(&"")
                );
            }
            "KICK" => self.on_kick(msg),
            "ERROR" => {
                warn_limited!(
                    "irc {}: server error: {}",
                    self.config.server,
                    msg.params.last().unwrap_or(&"")
                );
            }
            "PRIVMSG" => self.on_privmsg(msg),
            "CAP" | "AUTHENTICATE" | "902" | "903" | "904" | "905" | "906" | "908" => {
                let (lines, next) = self.config.login.step(
                    conn.sasl,
                    msg.command,
                    &msg.params,
                    &self.config.server,
                );
                conn.sasl = next;
                for line in lines {
                    self.send_now(&line);
                }
            }
            _ => {}
        }
    }

    /// The welcome (`001`): registered; the nick and relayed source as the server says;
    /// the channels joined.
    fn on_welcome(&mut self, msg: &IrcLine<'_>) {
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        conn.registered = true;
        self.gateway.link(true, None);
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
        info_redacted!(
            "irc {}: registered as {} (relayed as {} bytes of source)",
            self.config.server,
            conn.nick,
            conn.source_len
        );
        // A server that ignored the CAP exchange has registered the bot all the same.
        conn.sasl = Sasl::Off;
        if let Some(identify) = self.config.login.identify() {
            self.send_now(&identify);
        }
        for channel in self.config.channels.clone() {
            self.send_now(&format!("JOIN {channel}"));
        }
    }

    /// The nick was refused before registration: the next alternate, up to
    /// [`MAX_NICK_ATTEMPTS`], then a new connection.
    fn on_nick_refused(&mut self, msg: &IrcLine<'_>) {
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        conn.nick_attempts += 1;
        if conn.nick_attempts > MAX_NICK_ATTEMPTS {
            return self.schedule_reconnect(&format!(
                "no nick accepted after {MAX_NICK_ATTEMPTS} alternates of {}",
                self.config.nick
            ));
        }
        let alt = alternate_nick(&self.config.nick, conn.nick_attempts);
        warn_limited!(
            "irc {}: nick {} refused ({}); trying {alt}",
            self.config.server,
            conn.nick,
            msg.command
        );
        conn.nick = alt.clone();
        conn.source_len = conservative_source_len(&alt);
        self.send_now(&format!("NICK {alt}"));
    }

    /// Kicked from a channel: join it again.
    fn on_kick(&mut self, msg: &IrcLine<'_>) {
        let Some(conn) = self.conn.as_ref() else {
            return;
        };
        if msg.params.get(1).copied() == Some(conn.nick.as_str())
            && let Some(channel) = msg.params.first()
        {
            warn_limited!(
                "irc {}: kicked from {channel}; joining again",
                self.config.server
            );
            let join = format!("JOIN {channel}");
            self.send_now(&join);
        }
    }

    /// A PRIVMSG: passed to the gateway when it is addressed to the bot.
    fn on_privmsg(&mut self, msg: &IrcLine<'_>) {
        let Some(conn) = self.conn.as_ref() else {
            return;
        };
        let (Some(prefix), Some(target), Some(text)) =
            (msg.prefix, msg.params.first(), msg.params.get(1))
        else {
            return;
        };
        if let Some(a) = addressed(&conn.nick, nick_of(prefix), target, text) {
            let mask = prefix.to_owned();
            self.submit(a, &mask);
        }
    }

    /// Hands an addressed line to the gateway, keeping where to tell a rejection.
    /// `mask` is the sender's `nick!user@host`, for the gateway's access patterns (a nick
    /// alone is anyone's to take).
    fn submit(&mut self, a: Addressed, mask: &str) {
        self.next_id += 1;
        let id = format!("irc-{:x}-{}", self.boot, self.next_id);
        let mut message = OutgoingMessage::new(&id, &a.chat_id, &a.text);
        message.chat_type = a.chat_type;
        message.user_id = Some(a.sender.clone());
        message.user_name = Some(a.sender.clone());
        // Only lines addressed to the bot (`nick: …` in a channel) get here.
        let mut meta = serde_json::Map::new();
        meta.insert(crate::access::ADDRESSED_KEY.into(), true.into());
        meta.insert(crate::access::MASK_KEY.into(), mask.into());
        message.meta = Some(serde_json::Value::Object(meta).to_string());
        let route = ReplyTarget {
            target: a.chat_id.clone(),
            addressee: (a.chat_type == ChatType::Group).then(|| a.sender.clone()),
        };
        debug_redacted!("irc: message {id} from {} in {}", a.sender, a.chat_id);
        match self.gateway.send(&message) {
            Ok(()) => {
                self.routes.insert(id, route);
            }
            Err(e) => {
                warn_limited!(
                    "irc: message from {} in {} not passed to the gateway: {e}",
                    a.sender,
                    a.chat_id
                );
                self.queue_notice(
                    &route,
                    &format!("[not accepted: {e}; please try again later]"),
                );
            }
        }
    }

    /// Queues a refusal notice for `route`, unless one already waits for its target.
    fn queue_notice(&mut self, route: &ReplyTarget, text: &str) {
        if !self.notices.insert(route.target.clone()) {
            warn_limited!(
                "irc: a refusal notice already waits for {}; this one is not queued",
                route.target
            );
            return;
        }
        self.queue_lines(route, text, None, true);
    }

    /// Queues `text` as lines for `route`; the last one completes the result `completes`.
    fn queue_reply(&mut self, route: &ReplyTarget, text: &str, completes: Option<String>) {
        self.queue_lines(route, text, completes, false);
    }

    /// Queues `text` as lines for `route`; the last one completes the result `completes`
    /// and, with `notice`, ends a refusal notice.
    fn queue_lines(
        &mut self,
        route: &ReplyTarget,
        text: &str,
        completes: Option<String>,
        notice: bool,
    ) {
        let source_len = self.conn.as_ref().map_or_else(
            || conservative_source_len(&self.config.nick),
            |c| c.source_len,
        );
        let budget = text_budget(source_len, &route.target);
        let lines = reply_lines(route, text, budget, self.config.max_reply_lines);
        let last = lines.len().saturating_sub(1);
        for (i, text) in lines.into_iter().enumerate() {
            self.outbox.push(
                &route.target,
                OutLine {
                    target: route.target.clone(),
                    text,
                    completes: if i == last { completes.clone() } else { None },
                    notice: notice && i == last,
                },
            );
        }
    }

    /// A gateway event: readiness, rejections told to their chat, results queued.
    fn on_gateway(&mut self, event: GatewayEvent) {
        match event {
            GatewayEvent::Connected => self.gateway_up = true,
            GatewayEvent::Disconnected { .. } => self.gateway_up = false,
            GatewayEvent::Admission { id, admission } => {
                let route = self.routes.remove(&id);
                if let Admission::Rejected { reason, detail, .. } = admission {
                    warn_limited!("irc: message {id} rejected by the gateway: {reason} ({detail})");
                    if let Some(route) = route {
                        let text = format!("[not accepted ({reason}): {detail}]");
                        self.queue_notice(&route, &text);
                    }
                }
            }
            GatewayEvent::Result(result) => {
                let Some(route) = route_of(&result.session) else {
                    error_limited!(
                        "irc: result {} has a session key that names no chat ({}); dropped",
                        result.id,
                        result.session
                    );
                    self.gateway.delivered(&result.id);
                    return;
                };
                match result.outcome.chat_text() {
                    Some(text) => {
                        let text = match self.config.format {
                            Format::Markdown => markdown::plain(&text),
                            Format::Plain => text,
                        };
                        self.queue_reply(&route, &text, Some(result.id));
                    }
                    None => self.gateway.delivered(&result.id),
                }
            }
            GatewayEvent::Typing { .. } | GatewayEvent::Partial { .. } => {}
            GatewayEvent::Error { .. } => {}
        }
    }
}
