//! The connection thread: opens the TCP connection, says hello, reads lines until the
//! connection ends, and reconnects with capped exponential backoff.

use std::io::{self, Read};
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::wire::ClientOp;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use super::hold;
use super::protocol::{LineResult, handle_line};
use super::{GatewayEvent, Shared, write_line};
use crate::platforms::tls::Wire;

/// Longest gateway line accepted: a 1 MiB reply escaped as JSON fits many times over; a
/// longer line is a broken peer and ends the connection.
pub(crate) const MAX_GATEWAY_LINE_BYTES: usize = 16 << 20;
/// Silence after which the client sends a `ping`.
const PING_AFTER: Duration = Duration::from_secs(30);
/// Silence after which the connection is considered dead and replaced.
const DEAD_AFTER: Duration = Duration::from_secs(75);
/// How long a read blocks before the stop flag and the ping timer are checked.
const READ_SLICE: Duration = Duration::from_millis(250);
/// A write taking longer than this ends the connection (the gateway stopped reading).
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Time to open a TCP connection to the gateway.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// A connection that stayed up this long resets the backoff even without a pong.
const STABLE_AFTER: Duration = Duration::from_secs(10);

/// The connection thread: connect, hello, read; reconnect with backoff; until shutdown or
/// until the bridge dropped its receiver.
pub(super) fn run_connection(shared: &Shared, events: &Sender<GatewayEvent>, stop: &Receiver<()>) {
    let config = &shared.config;
    let mut backoff = config.initial_backoff.max(Duration::from_millis(1));
    let mut attempt: u32 = 0;
    while !shared.stopping.load(Ordering::SeqCst) {
        attempt += 1;
        let started = Instant::now();
        let result = match open(&config.addr) {
            Ok(stream) => serve_connection(shared, stream, events),
            Err(e) => Err(e),
        };
        if shared.stopping.load(Ordering::SeqCst) {
            break;
        }
        let (confirmed, reason) = match result {
            Ok(ConnectionEnd::ReceiverGone) => return,
            Ok(ConnectionEnd::Closed { confirmed, reason }) => (confirmed, reason),
            Err(e) => (false, e),
        };
        {
            let mut state = shared.lock();
            state.lost_connection();
        }
        if confirmed || started.elapsed() >= STABLE_AFTER {
            backoff = config.initial_backoff.max(Duration::from_millis(1));
            attempt = 1;
        }
        if confirmed {
            // A full channel must not hold a stopping client: the send gives way to `stop`.
            let disconnected = GatewayEvent::Disconnected {
                reason: reason.clone(),
            };
            crossbeam_channel::select! {
                send(events, disconnected) -> sent => if sent.is_err() { return },
                recv(stop) -> _ => break,
            }
        }
        warn_limited!(
            "gateway {}: {reason}; reconnecting in {backoff:?} (attempt {attempt})",
            config.addr
        );
        match stop.recv_timeout(backoff) {
            Ok(()) | Err(RecvTimeoutError::Disconnected) => break,
            Err(RecvTimeoutError::Timeout) => {}
        }
        // Messages held past --max-hold while the gateway is away end here.
        for event in give_up_expired(shared) {
            crossbeam_channel::select! {
                send(events, event) -> sent => if sent.is_err() { return },
                recv(stop) -> _ => return,
            }
        }
        backoff = (backoff * 2).min(config.max_backoff.max(Duration::from_millis(1)));
    }
}

/// Takes out the messages held past [`GatewayConfig::max_hold`](super::GatewayConfig):
/// their waiters are told, and the events for the bridge returned.
fn give_up_expired(shared: &Shared) -> Vec<GatewayEvent> {
    let expired = hold::expire(&mut shared.lock(), &shared.config, Instant::now());
    expired
        .into_iter()
        .map(|(pending, admission)| {
            for w in pending.waiters {
                let _ = w.try_send(admission.clone());
            }
            GatewayEvent::Admission {
                id: pending.id,
                admission,
            }
        })
        .collect()
}

/// How often a connection looks for held messages due again or given up.
const HOLD_TICK: Duration = Duration::from_millis(100);

/// How one connection ended.
enum ConnectionEnd {
    /// The bridge dropped its event receiver: the client has nobody to work for.
    ReceiverGone,
    /// The connection ended; `confirmed` if its hello had been answered.
    Closed { confirmed: bool, reason: String },
}

/// Opens a TCP connection to the first of `addr`'s addresses that answers.
fn open(addr: &str) -> Result<TcpStream, String> {
    super::super::connect_tcp(addr, CONNECT_TIMEOUT)
}

/// One connection: sets the socket up, says hello (sending every unanswered message again),
/// then reads until the connection ends.
fn serve_connection(
    shared: &Shared,
    stream: TcpStream,
    events: &Sender<GatewayEvent>,
) -> Result<ConnectionEnd, String> {
    let reader = setup_socket(&stream)?;
    let (wire, reader): (Wire, Box<dyn Read + Send>) = match &shared.config.tls {
        None => (Wire::Plain(stream), Box::new(reader)),
        Some(tls) => {
            let config = &shared.config;
            let name = config.tls_name.as_deref();
            let (wire, reader) = super::super::tls::handshake(
                stream,
                reader,
                &config.addr,
                name,
                tls,
                CONNECT_TIMEOUT,
            )?;
            (wire, Box::new(reader))
        }
    };
    say_hello(shared, wire)?;
    Ok(Reader::new(shared, reader, events).run())
}

/// Nagle off, the write timeout, the read slice; returns the reading half.
fn setup_socket(stream: &TcpStream) -> Result<TcpStream, String> {
    let io_err = |e: io::Error| format!("socket setup failed: {e}");
    stream.set_nodelay(true).map_err(io_err)?;
    stream
        .set_write_timeout(Some(WRITE_TIMEOUT))
        .map_err(io_err)?;
    stream.set_read_timeout(Some(READ_SLICE)).map_err(io_err)?;
    stream.try_clone().map_err(io_err)
}

/// Installs the writing half in the shared state and writes the hello, the ping that
/// confirms it, and every message still waiting for its answer, in order.
fn say_hello(shared: &Shared, stream: Wire) -> Result<(), String> {
    let config = &shared.config;
    let mut state = shared.lock();
    state.conn = Some(stream);
    state.connected = false;
    let hello = ClientOp::Hello {
        platform: Some(config.platform.clone()),
        token: config.token.clone(),
        acks: true,
    }
    .line();
    // The pong to this ping confirms the hello: with a token, a refused hello is
    // answered `error` and closed instead.
    let mut ok = write_line(&mut state, &hello) && write_line(&mut state, &ClientOp::Ping.line());
    if let Some((_, link)) = state.link.clone() {
        ok = ok && write_line(&mut state, &link);
    }
    let again = state.pending.len();
    for i in 0..again {
        ok = ok && state.write_pending(i);
    }
    if !ok {
        return Err("the gateway closed the connection during the hello".into());
    }
    if again > 0 {
        log::info!("gateway: sent {again} unanswered message(s) again after reconnecting");
    }
    Ok(())
}

/// The reading side of one connection: splits the bytes into lines and watches the silence.
struct Reader<'a> {
    shared: &'a Shared,
    reader: Box<dyn Read + Send>,
    events: &'a Sender<GatewayEvent>,
    /// The hello was answered (a `pong` came).
    confirmed: bool,
    /// Bytes read and not yet ended by a newline.
    buf: Vec<u8>,
    last_heard: Instant,
    /// A ping was sent for the current silence.
    pinged: bool,
    /// The last `error` line's detail: the reason, should the gateway close right after it.
    error_detail: Option<String>,
    /// When held messages were last looked at.
    last_tick: Instant,
}

impl<'a> Reader<'a> {
    /// A reader for a connection whose hello was just written.
    fn new(
        shared: &'a Shared,
        reader: Box<dyn Read + Send>,
        events: &'a Sender<GatewayEvent>,
    ) -> Self {
        Reader {
            shared,
            reader,
            events,
            confirmed: false,
            buf: Vec::new(),
            last_heard: Instant::now(),
            pinged: false,
            error_detail: None,
            last_tick: Instant::now(),
        }
    }

    /// The connection ended with `reason`.
    fn closed(&self, reason: String) -> ConnectionEnd {
        ConnectionEnd::Closed {
            confirmed: self.confirmed,
            reason,
        }
    }

    /// Reads until shutdown, the end of the connection, or the bridge gone.
    fn run(mut self) -> ConnectionEnd {
        let mut chunk = vec![0u8; 64 * 1024];
        loop {
            if self.shared.stopping.load(Ordering::SeqCst) {
                return self.closed("shutting down".into());
            }
            if let Some(end) = self.on_tick() {
                return end;
            }
            let step = match self.reader.read(&mut chunk) {
                Ok(0) => {
                    let reason = match self.error_detail.take() {
                        Some(d) => format!("the gateway closed the connection: {d}"),
                        None => "the gateway closed the connection".into(),
                    };
                    Some(self.closed(reason))
                }
                Ok(n) => self.on_bytes(&chunk[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock
                            | io::ErrorKind::TimedOut
                            | io::ErrorKind::Interrupted
                    ) =>
                {
                    self.on_silence()
                }
                Err(e) => Some(self.closed(format!("reading from the gateway failed: {e}"))),
            };
            if let Some(end) = step {
                return end;
            }
        }
    }

    /// Now and then: held messages due are sent again (once the hello is confirmed), and
    /// those held too long are given up (their bridge told).
    fn on_tick(&mut self) -> Option<ConnectionEnd> {
        let now = Instant::now();
        if now.saturating_duration_since(self.last_tick) < HOLD_TICK {
            return None;
        }
        self.last_tick = now;
        if self.confirmed {
            hold::resend_due(&mut self.shared.lock(), now);
        }
        for event in give_up_expired(self.shared) {
            if self.events.send(event).is_err() {
                return Some(ConnectionEnd::ReceiverGone);
            }
        }
        None
    }

    /// Handles every complete line in what was read; `Some` ends the connection.
    fn on_bytes(&mut self, bytes: &[u8]) -> Option<ConnectionEnd> {
        self.last_heard = Instant::now();
        self.pinged = false;
        self.buf.extend_from_slice(bytes);
        let mut start = 0;
        while let Some(nl) = self.buf[start..].iter().position(|&b| b == b'\n') {
            let line = &self.buf[start..start + nl];
            start += nl + 1;
            match handle_line(self.shared, line, &mut self.confirmed, self.events) {
                LineResult::Continue => {}
                LineResult::Error(detail) => self.error_detail = Some(detail),
                LineResult::ReceiverGone => return Some(ConnectionEnd::ReceiverGone),
            }
        }
        self.buf.drain(..start);
        if self.buf.len() > MAX_GATEWAY_LINE_BYTES {
            return Some(self.closed(format!(
                "the gateway sent a line longer than {MAX_GATEWAY_LINE_BYTES} bytes"
            )));
        }
        None
    }

    /// A read slice passed without bytes: ping after a while, give up after longer.
    fn on_silence(&mut self) -> Option<ConnectionEnd> {
        let silent = self.last_heard.elapsed();
        if silent >= DEAD_AFTER {
            return Some(self.closed(format!("no answer from the gateway for {silent:?}")));
        }
        if silent >= PING_AFTER && !self.pinged {
            self.pinged = true;
            write_line(&mut self.shared.lock(), &ClientOp::Ping.line());
        }
        None
    }
}
