//! The gateway server: the bridge protocol over TCP, hosted on the reactor as a
//! [`Frontend`].
//!
//! Two halves, as quinn-proto and quinn split QUIC: [`Bridge`] (`bridge/`, one room per kind
//! of state) is the protocol's state machine — connections by handle, platforms, outboxes,
//! routes, duplicates, every bound — and does no I/O; [`BridgeServer`] (this file) is the mio
//! shell that only moves bytes: it accepts sockets, splits what it reads into lines, hands
//! them to the bridge with the time, submits what the bridge asks, and writes each
//! connection's output within a budget per wake. Signals arrive through `signal-hook-mio` on
//! the same poll.

pub(crate) mod bridge;
mod dedup;
mod durability;
mod fair;
mod frame;
mod lines;
mod sharded;
mod shutdown;
mod sockets;
mod sys;

use std::fmt;
use std::io::{self, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use mio::event::Event;
use mio::net::{TcpListener, TcpStream};
use mio::{Interest, Poll, Registry, Token};

use crate::cluster::shell::Member;
use crate::core::MessageEvent;
use crate::journal::{Journal, JournalConfig, Store};
use crate::liveness::{FrontendStatus, ServiceStatus};
use crate::reactor::{Ctx, Frontend};
use crate::tls::{ServerTls, Transport};
use crate::tokens::{BRIDGE_LISTENER as LISTENER, JOURNAL, SIGNALS};
pub(crate) use bridge::RecoveryCounts;
pub use bridge::{Action, Bridge, BridgeConfig, ConnId, Flushed};
use fair::{DelayStats, FairQueue};
use lines::{Line, LineReader, ReadOutcome};
use sockets::{Socket, SocketTable, token};
#[cfg(feature = "cli")]
pub(crate) use sys::raise_fd_limit;
use sys::{open_spare, out_of_fds, reset_on_close, unacknowledged};

/// Bytes read from one connection per pass, so one flood cannot starve the rest.
const READ_BUDGET: usize = 8 * 1024;
/// Time the shell spends reading and handing lines to the bridge per loop iteration; what
/// is left is read on the next iteration, which follows at once. Keeps each wake short.
/// Readable connections take turns in a [`FairQueue`]: one that used its read budget goes
/// to the back, the ones a pass did not reach are first in the next, so a connection waits
/// at most one round of the others' budgets whatever they send.
const READ_TIME: Duration = Duration::from_micros(200);
/// Time spent writing per loop iteration, likewise (and in the same round-robin order).
const WRITE_TIME: Duration = Duration::from_micros(200);
/// One slice of the recent service-delay window (six slices: the last 10 to 12 s).
pub(super) const SERVICE_SLICE: Duration = Duration::from_secs(2);
/// Connections accepted per wake.
const ACCEPT_BATCH: usize = 256;
/// Accepting again after the process ran out of descriptors.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);
/// How often connections with unacknowledged results are asked how far the peer has read.
const ACK_POLL: Duration = Duration::from_millis(20);

/// Settings of the bridge server: the bridge's bounds and the shell's timings.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The protocol's bounds.
    pub bridge: BridgeConfig,
    /// Time allowed to flush output to clients after shutdown.
    pub flush_budget: Duration,
    /// After that, how long shutdown waits at most for the `delivered` confirmations of
    /// the results written to `acks` bridges (so they are journaled as delivered, and not
    /// sent again after a restart). The binary sets `--drain-timeout`.
    pub delivery_wait: Duration,
    /// Exit with code 1 if shutdown has not finished this long after the first signal.
    pub watchdog: Duration,
    /// Handle SIGTERM, SIGINT (shutdown) and SIGHUP (ignored).
    pub handle_signals: bool,
    /// Allow a non-loopback address without an auth token.
    pub allow_insecure_bind: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            bridge: BridgeConfig::default(),
            flush_budget: Duration::from_secs(5),
            delivery_wait: Duration::from_secs(5),
            watchdog: Duration::from_secs(120),
            handle_signals: true,
            allow_insecure_bind: false,
        }
    }
}

/// Why the server asks its host to end the process now instead of waiting for the loop.
///
/// The library never exits the process itself: the server sends one of these on the channel
/// from [`BridgeServer::forced_stops`], and the program that hosts it decides (the `turnstile`
/// binary kills every agent process group and exits with code 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ForcedStop {
    /// A second SIGINT/SIGTERM arrived while shutting down.
    SecondSignal,
    /// Shutdown ran past the watchdog's limit ([`ServerConfig::watchdog`]).
    WatchdogExpired,
}

impl fmt::Display for ForcedStop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ForcedStop::SecondSignal => "a second shutdown signal arrived",
            ForcedStop::WatchdogExpired => "shutdown ran past the watchdog's limit",
        })
    }
}

/// The TCP bridge server: the mio shell around a [`Bridge`].
pub struct BridgeServer {
    bridge: Bridge,
    flush_budget: Duration,
    delivery_wait: Duration,
    watchdog_limit: Duration,
    listener: TcpListener,
    /// The certificate new connections are served TLS with; none: plain TCP.
    tls: Option<ServerTls>,
    /// A handle on the reactor's poll registry, for sockets accepted later.
    registry: Option<Registry>,
    signals: Option<signal_hook_mio::v1_0::Signals>,
    signals_seen: usize,
    watchdog: Option<Sender<()>>,
    /// Where a forced stop is announced to the host ([`BridgeServer::forced_stops`]).
    forced: (Sender<ForcedStop>, crossbeam_channel::Receiver<ForcedStop>),
    /// Set when shutdown could not write every journal record
    /// ([`BridgeServer::journal_unfinished`]).
    journal_unfinished: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Sockets by their connection's key (index), the key's bits being their poll token, so
    /// a readiness event for a closed socket never reaches the one that reuses its slot.
    sockets: SocketTable,
    /// Connections readable and not yet read (round-robin across wakes).
    read_queue: FairQueue,
    /// Connections with output to write and room to write it (round-robin across wakes).
    write_queue: FairQueue,
    /// Readable → read.
    read_delay: DelayStats,
    /// Output waiting (writable or new output) → written.
    write_delay: DelayStats,
    /// Submissions the bridge asked for outside a step that could make them.
    deferred: Vec<Action>,
    /// Out of descriptors: accept again at this time.
    accept_retry: Option<Duration>,
    /// A descriptor held in reserve, given up to accept and refuse a connection with an
    /// error line when the process has run out.
    spare_fd: Option<std::fs::File>,
    now: Duration,
    lines: Vec<Line>,
    next_ack_poll: Duration,
    /// The store, until `register` starts the journal thread on it.
    store: Option<(Box<dyn Store>, JournalConfig)>,
    journal: Option<Journal>,
    /// The read end of the journal thread's wake-up pipe.
    journal_wake: Option<mio::unix::pipe::Receiver>,
    /// Readiness events on the journal's token (status: `journal.wakes`).
    journal_wakes: u64,
    /// `--cluster`: the reader and what starts with the server.
    /// The cluster member's parts (`--cluster`; inert otherwise).
    cluster: Member,
    /// Deletes ended messages' files from the spool, off the reactor (with a spool only).
    janitor: Option<crate::attachments::Janitor>,
}

impl BridgeServer {
    /// Binds `addr` (non-blocking). A non-loopback address without a token is refused unless
    /// `allow_insecure_bind` is set.
    pub fn bind(addr: SocketAddr, cfg: ServerConfig) -> io::Result<BridgeServer> {
        if !addr.ip().is_loopback() && cfg.bridge.auth_token.is_none() {
            if !cfg.allow_insecure_bind {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "refusing to listen on non-loopback {addr} without an auth token (set --auth-token, or --allow-insecure-bind)"
                    ),
                ));
            }
            log::warn!(
                "listening on non-loopback {addr} without an auth token (--allow-insecure-bind): anyone who can reach it can talk to the agent"
            );
        }
        let listener = TcpListener::bind(addr)?;
        let signals = if cfg.handle_signals {
            Some(signal_hook_mio::v1_0::Signals::new([
                libc::SIGTERM,
                libc::SIGINT,
                libc::SIGHUP,
            ])?)
        } else {
            None
        };
        let janitor = match &cfg.bridge.attachments.dir {
            Some(dir) => Some(crate::attachments::Janitor::start(dir.clone())?),
            None => None,
        };
        let mut bridge = Bridge::new(cfg.bridge);
        bridge.set_wall_clock(crate::journal::now_ms());
        bridge.access().0.log_summary();
        Ok(BridgeServer {
            bridge,
            flush_budget: cfg.flush_budget,
            delivery_wait: cfg.delivery_wait,
            watchdog_limit: cfg.watchdog,
            listener,
            tls: None,
            registry: None,
            signals,
            signals_seen: 0,
            watchdog: None,
            forced: crossbeam_channel::bounded(2),
            journal_unfinished: std::sync::Arc::default(),
            sockets: SocketTable::default(),
            read_queue: FairQueue::default(),
            write_queue: FairQueue::default(),
            read_delay: DelayStats::default(),
            write_delay: DelayStats::default(),
            deferred: Vec::new(),
            accept_retry: None,
            spare_fd: open_spare(),
            now: Duration::ZERO,
            lines: Vec::new(),
            next_ack_poll: Duration::ZERO,
            store: None,
            journal: None,
            journal_wake: None,
            journal_wakes: 0,
            cluster: Member::default(),
            janitor,
        })
    }

    /// Keeps the access policy's approvals and counters in `dir/access.json` (read now;
    /// written from then on by a thread of its own, never the reactor), so they survive a
    /// restart. Call it with the journal's directory (`--data-dir`).
    pub fn persist_access(&mut self, dir: &std::path::Path) -> io::Result<()> {
        self.bridge.access().0.persist_in(dir)
    }

    /// Shares the access policy's state across a cluster through `store` (`serve
    /// --cluster`): loaded now, merged both ways by a thread of its own from then on.
    #[cfg(feature = "cli")] // set up by `serve --cluster`
    pub(crate) fn share_access(
        &mut self,
        store: Box<dyn crate::access::shared::SharedStore>,
    ) -> io::Result<()> {
        self.bridge.access().0.share(store)
    }

    /// Runs an access policy admin command (`approve CODE`, `allow USER`, `deny USER`,
    /// `pending`, `users`, `usage [USER]`) for `platform`, as `turnstile access` asks it
    /// over the HTTP endpoint; the answer's text, or why there is none.
    #[cfg(feature = "cli")] // called by `turnstile access` through serve's HTTP endpoint
    pub(crate) fn access_command(
        &mut self,
        platform: &str,
        command: &str,
    ) -> Result<String, String> {
        let (policy, wall_ms) = self.bridge.access();
        policy.operate(platform, command, wall_ms)
    }

    fn on_journal(&mut self) {
        if let Some(r) = &mut self.journal_wake {
            // Edge-triggered: drain every wake-up byte.
            let mut buf = [0u8; 256];
            while matches!(io::Read::read(r, &mut buf), Ok(n) if n > 0) {}
        }
        let Some(j) = &self.journal else {
            return;
        };
        let done: Vec<_> = j.completions().collect();
        for c in done {
            let report = self.cluster.take_report(&self.bridge, self.now);
            self.bridge.journaled_with(c, report, self.now);
        }
        self.cluster.arrivals(&mut self.bridge, self.now);
    }

    /// Replaces the auth token for hellos from now on (a reload); false when the change
    /// needs a restart (adding or removing a token).
    pub fn set_auth_token(&mut self, token: Option<&str>) -> bool {
        self.bridge.set_auth_token(token)
    }

    /// Where the server announces that the process should end now (a second signal, the
    /// shutdown watchdog). The host must act on it from a thread other than the reactor's,
    /// since the loop may be wedged: see [`ForcedStop`].
    pub fn forced_stops(&self) -> crossbeam_channel::Receiver<ForcedStop> {
        self.forced.1.clone()
    }

    /// Set once the server has stopped if its journal could not write every record within
    /// the flush budget: the host should exit non-zero (the `turnstile` binary exits 1, a
    /// failure worth retrying). What was not written is recovered at the next start as
    /// after a crash.
    pub fn journal_unfinished(&self) -> std::sync::Arc<std::sync::atomic::AtomicBool> {
        self.journal_unfinished.clone()
    }

    /// Serves TLS with `tls` to the connections accepted from now on (those open keep what
    /// they have: a reload of the certificate reaches new connections); `None`: plain TCP.
    #[cfg(feature = "tls")]
    pub fn set_tls(&mut self, tls: Option<ServerTls>) {
        self.tls = tls;
    }

    /// The bound address (useful with port 0).
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    fn accept(&mut self) {
        self.accept_retry = None;
        for _ in 0..ACCEPT_BATCH {
            match self.listener.accept() {
                Ok((stream, peer)) => self.admit(stream, peer),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if out_of_fds(&e) => {
                    // Give up the spare descriptor to take the connection and tell it why it
                    // is refused; without a spare, retry on a timer (the listener is
                    // edge-triggered: no new event comes for connections already queued).
                    let Some(spare) = self.spare_fd.take() else {
                        log::error!("accept failed: {e}; retrying in {ACCEPT_RETRY:?}");
                        self.accept_retry = Some(self.now + ACCEPT_RETRY);
                        return;
                    };
                    drop(spare);
                    if let Ok((mut stream, peer)) = self.listener.accept() {
                        if self.tls.is_none() {
                            let _ = stream.write(&encode_error("too many open files; retry later"));
                        }
                        log::warn!("refused connection from {peer}: out of file descriptors ({e})");
                    }
                    self.spare_fd = open_spare();
                    if self.spare_fd.is_none() {
                        self.accept_retry = Some(self.now + ACCEPT_RETRY);
                        return;
                    }
                }
                Err(e) => {
                    log::error!("accept failed: {e}; retrying in {ACCEPT_RETRY:?}");
                    self.accept_retry = Some(self.now + ACCEPT_RETRY);
                    return;
                }
            }
        }
        // More may be queued: come back on the next wake.
        self.accept_retry = Some(self.now);
    }

    fn admit(&mut self, mut stream: TcpStream, peer: SocketAddr) {
        if self.registry.is_none() {
            return;
        }
        let id = match self.bridge.connect(peer.ip(), self.now) {
            Ok(id) => id,
            Err(line) => {
                // A TLS client cannot read a plain line before its handshake: it sees the
                // connection closed (the status counts the refusal).
                if self.tls.is_none() {
                    let _ = stream.write(&line);
                }
                return;
            }
        };
        // A waiting connection evicted for this one: its socket goes before this one's
        // takes a slot (it may be the same).
        self.run_actions(None);
        let Some(registry) = self.registry.as_ref() else {
            return;
        };
        let _ = stream.set_nodelay(true);
        if let Err(e) = registry.register(
            &mut stream,
            token(id),
            Interest::READABLE | Interest::WRITABLE,
        ) {
            log::error!("cannot register connection from {peer}: {e}");
            self.bridge.disconnected(id);
            return;
        }
        let stream = match Transport::accept(stream, self.tls.as_ref()) {
            Ok(t) => t,
            Err(e) => {
                log::error!("cannot start TLS for the connection from {peer}: {e}");
                self.bridge.disconnected(id);
                return;
            }
        };
        self.sockets.insert(Socket {
            id,
            peer,
            stream,
            reader: LineReader::default(),
            read_paused: false,
            eof: false,
            opened: self.now,
        });
        log::debug!("connection opened conn={id} peer={peer}");
    }

    /// Reads one budget from `id` and hands its lines to the bridge; true when the budget
    /// ran out with data left (the connection goes to the back of the read queue).
    fn read(&mut self, id: ConnId, ctx: &mut Ctx<'_>) -> bool {
        let Some(sock) = self.sockets.get_mut(id) else {
            return false;
        };
        if sock.eof {
            return false;
        }
        if !self.bridge.wants_read(id) {
            sock.read_paused = true;
            return false;
        }
        let max_line = self.bridge.config().max_line_bytes;
        let mut lines = std::mem::take(&mut self.lines);
        let outcome = sock
            .reader
            .read_lines(&mut sock.stream, READ_BUDGET, max_line, &mut lines);
        for line in lines.drain(..) {
            match line {
                Line::Complete(bytes) => self.bridge.line(id, &bytes, self.now),
                Line::TooLong => self.bridge.line_too_long(id),
            }
        }
        self.lines = lines;
        let again = match outcome {
            ReadOutcome::Drained => false,
            ReadOutcome::MoreLater => true,
            ReadOutcome::Eof => {
                if let Some(s) = self.sockets.get_mut(id) {
                    s.eof = true;
                }
                self.bridge.read_closed(id);
                false
            }
            ReadOutcome::Failed => {
                self.bridge.disconnected(id);
                self.drop_socket(id);
                false
            }
        };
        self.run_actions(Some(ctx));
        again && self.sockets.get(id).is_some()
    }

    /// One read pass over the queue, within [`READ_TIME`].
    fn read_pass(&mut self, ctx: &mut Ctx<'_>) {
        let mut queue = std::mem::take(&mut self.read_queue);
        let started = Instant::now();
        queue.pass(
            || started.elapsed() < READ_TIME,
            |id, since| {
                if self.sockets.get(id).is_none() {
                    return false;
                }
                self.read_delay.record(self.now, since.elapsed());
                self.read(id, ctx)
            },
        );
        self.read_queue = queue;
    }

    /// Carries out the bridge's requests: submissions (only with a step's context) and closes.
    fn run_actions(&mut self, mut ctx: Option<&mut Ctx<'_>>) {
        let journal = self.bridge.config().journal;
        if let Some(ctx) = ctx.as_deref_mut() {
            for action in self.deferred.drain(..) {
                match action {
                    Action::Submit { tag, message } if journal => ctx.submit_held(message, tag),
                    Action::Submit { tag, message } => ctx.submit(message, tag),
                    Action::StartTurn(turn) => ctx.release_turn(turn),
                    Action::HandOver(sessions) => ctx.hand_over(sessions),
                    _ => {}
                }
            }
        }
        while let Some(action) = self.bridge.poll_action() {
            match (action, ctx.as_deref_mut()) {
                // With a journal a turn runs only once its `started` record is durable.
                (Action::Submit { tag, message }, Some(ctx)) if journal => {
                    ctx.submit_held(message, tag);
                }
                (Action::Submit { tag, message }, Some(ctx)) => ctx.submit(message, tag),
                (Action::StartTurn(turn), Some(ctx)) => ctx.release_turn(turn),
                (deferred @ (Action::Submit { .. } | Action::StartTurn(_)), None) => {
                    self.deferred.push(deferred);
                }
                (Action::HandOver(sessions), Some(ctx)) => ctx.hand_over(sessions),
                // In order with the submissions deferred before it.
                (deferred @ Action::HandOver(_), None) => self.deferred.push(deferred),
                (Action::ReleasePartition(p), _) => self.cluster.release_drained(p),
                (Action::Cluster(r), _) => self.cluster.request(r),
                (Action::Close(id), _) => self.drop_socket(id),
                (Action::ReleaseFiles(paths), _) => match &self.janitor {
                    Some(j) => j.release(paths),
                    None => log::debug!("no spool janitor: {} file(s) kept", paths.len()),
                },
                (Action::Journal(r), _) => match &self.journal {
                    Some(j) => j.send(r),
                    None => log::error!("no journal thread; record {} not written", r.seq()),
                },
                (Action::Reset(id), _) => {
                    if let Some(sock) = self.sockets.get(id) {
                        reset_on_close(sock.stream.tcp());
                    }
                    self.drop_socket(id);
                }
            }
        }
    }

    fn drop_socket(&mut self, id: ConnId) {
        let Some(mut sock) = self.sockets.remove(id) else {
            return;
        };
        log::debug!("connection closed conn={id} peer={}", sock.peer);
        if let Some(registry) = &self.registry {
            let _ = registry.deregister(sock.stream.tcp_mut());
        }
    }

    /// Asks the poll to report the socket again: with edge-triggered readiness this is how a
    /// connection whose budget ran out (or whose reads were paused) gets its next turn.
    fn rearm(&mut self, id: ConnId) {
        if let (Some(registry), Some(sock)) = (&self.registry, self.sockets.get_mut(id)) {
            let _ = registry.reregister(
                sock.stream.tcp_mut(),
                token(id),
                Interest::READABLE | Interest::WRITABLE,
            );
        }
    }

    /// Tells the bridge how far the peer has acknowledged what was written.
    fn poll_ack(&mut self, id: ConnId) {
        let Some(sock) = self.sockets.get(id) else {
            return;
        };
        if sock.stream.tls_queued() {
            // Some of it is still in TLS, not even on the socket: nothing new is acknowledged.
            return;
        }
        let written = self.bridge.written(sock.id);
        // Without the figure, count everything written as delivered (as a plain write would).
        // With TLS the figure is of ciphertext, a little more than the plaintext it carries:
        // acknowledgements come a little late, never early.
        let pending = unacknowledged(sock.stream.tcp()).unwrap_or(0).min(written);
        self.bridge.acked(sock.id, written - pending);
    }

    /// Writes one budget of `id`'s output; true when the budget ran out with output left.
    fn write_conn(&mut self, id: ConnId) -> bool {
        let Some(sock) = self.sockets.get_mut(id) else {
            return false;
        };
        // TLS may hold ciphertext from an earlier pass (or the handshake) for the socket.
        let result = match sock.stream.flush_tls() {
            Ok(()) => self.bridge.write(id, &mut sock.stream, self.now),
            Err(e) => Err(e),
        };
        if result.is_ok() {
            self.poll_ack(id);
        }
        let again = match result {
            Ok(Flushed::Budget) => true,
            Ok(Flushed::All | Flushed::Blocked) => false,
            Err(e) => {
                log::debug!("connection {}: write failed: {e}", id);
                self.bridge.disconnected(id);
                self.drop_socket(id);
                return false;
            }
        };
        if let Some(sock) = self.sockets.get_mut(id)
            && sock.read_paused
            && self.bridge.wants_read(id)
        {
            sock.read_paused = false;
            if sock.stream.is_tls() {
                // Plaintext may wait in TLS's buffer, which no readiness event announces.
                self.read_queue.push(id, Instant::now());
            }
            self.rearm(id);
        }
        again
    }

    fn on_signal(&mut self, ctx: &mut Ctx<'_>) {
        let Some(signals) = &mut self.signals else {
            return;
        };
        let received: Vec<i32> = signals.pending().collect();
        for sig in received {
            if sig == libc::SIGHUP {
                log::info!("received SIGHUP: reloading the configuration");
                ctx.request_reload();
                continue;
            }
            self.signals_seen += 1;
            let name = if sig == libc::SIGINT {
                "SIGINT"
            } else {
                "SIGTERM"
            };
            if self.signals_seen > 1 {
                log::error!("received a second signal ({name}); stopping now");
                self.write_what_we_can();
                let _ = self.forced.0.try_send(ForcedStop::SecondSignal);
                continue;
            }
            log::info!("received {name}: shutting down (a second signal exits at once)");
            ctx.request_shutdown();
            self.watchdog = Some(arm_watchdog(self.watchdog_limit, self.forced.0.clone()));
        }
    }

    /// Before a forced exit: every running message gets `cancelled: shutdown` and each
    /// connection one write pass, without waiting.
    fn write_what_we_can(&mut self) {
        self.bridge.abandon_all();
        for id in self.sockets.ids() {
            let _ = self.write_conn(id);
        }
    }
}

fn encode_error(detail: &str) -> Vec<u8> {
    crate::wire::encode(&crate::wire::ServerOp::Error { detail })
}

/// Starts a thread that announces [`ForcedStop::WatchdogExpired`] if the returned sender is
/// still alive after `limit`. Dropping the sender disarms it.
fn arm_watchdog(limit: Duration, forced: Sender<ForcedStop>) -> Sender<()> {
    let (tx, rx) = crossbeam_channel::bounded::<()>(0);
    let spawned = std::thread::Builder::new()
        .name("turnstile-watchdog".into())
        .spawn(move || {
            if rx.recv_timeout(limit) == Err(crossbeam_channel::RecvTimeoutError::Timeout) {
                log::error!(
                    "shutdown watchdog: still alive {limit:?} after the shutdown signal; stopping now"
                );
                let _ = forced.try_send(ForcedStop::WatchdogExpired);
            }
        });
    if let Err(e) = spawned {
        log::error!("cannot start the shutdown watchdog: {e}");
    }
    tx
}

impl Frontend for BridgeServer {
    fn register(&mut self, registry: &Registry) -> io::Result<()> {
        registry.register(&mut self.listener, LISTENER, Interest::READABLE)?;
        self.registry = Some(registry.try_clone()?);
        if let Some(signals) = &mut self.signals {
            registry.register(signals, SIGNALS, Interest::READABLE)?;
        }
        if let Some((store, cfg)) = self.store.take() {
            // A pipe rather than a second `mio::Waker` (one per poll; the reactor has its own).
            let (sender, mut receiver) = mio::unix::pipe::new()?;
            registry.register(&mut receiver, JOURNAL, Interest::READABLE)?;
            let wake = move || {
                use std::io::Write as _;
                match (&sender).write(&[1]) {
                    // Full: the reactor has wake-ups to read already.
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => log::error!("cannot wake the reactor for the journal: {e}"),
                }
            };
            self.journal = Some(Journal::start(store, cfg, wake)?);
            self.journal_wake = Some(receiver);
        }
        if self.cluster.is_pending() {
            let (sender, mut receiver) = mio::unix::pipe::new()?;
            registry.register(&mut receiver, JOURNAL, Interest::READABLE)?;
            self.journal_wake = Some(receiver);
            if let Some(journal) = self.cluster.start(sender)? {
                self.journal = Some(journal);
            }
        }
        Ok(())
    }

    fn on_ready(&mut self, event: &Event, ctx: &mut Ctx<'_>) {
        self.now = ctx.now();
        match event.token() {
            LISTENER => self.accept(),
            SIGNALS => self.on_signal(ctx),
            JOURNAL => {
                self.journal_wakes += 1;
                self.on_journal();
                self.run_actions(Some(ctx));
            }
            Token(bits) => {
                let id = ConnId::from_bits(bits as u64);
                let gone = event.is_error() || event.is_write_closed();
                if let Some(sock) = self.sockets.get(id)
                    && sock.eof
                    && gone
                {
                    // A reset after end of stream: the peer had closed both ways, so what
                    // was written since goes back to the outbox.
                    self.bridge.disconnected(id);
                    self.drop_socket(id);
                    return;
                }
                if self.sockets.get(id).is_none() {
                    return;
                }
                let at = Instant::now();
                if event.is_readable() || event.is_read_closed() || event.is_error() {
                    self.read_queue.push(id, at);
                }
                // Every writable event, output or not: writing also feeds a connection its
                // platform's backlog.
                if event.is_writable() {
                    self.write_queue.push(id, at);
                }
            }
        }
    }

    fn on_wake(&mut self, ctx: &mut Ctx<'_>) -> Option<Duration> {
        self.now = ctx.now();
        if self.accept_retry.is_some_and(|t| t <= self.now) {
            self.accept();
        }
        if !self.read_queue.is_empty() {
            self.read_pass(ctx);
        }
        // Also here, should a wake have been coalesced with another event.
        self.on_journal();
        let next = self.bridge.tick(self.now);
        self.close_late_handshakes();
        if self.now >= self.next_ack_poll {
            self.next_ack_poll = self.now + ACK_POLL;
            for id in self.bridge.awaiting_ack() {
                self.poll_ack(id);
            }
        }
        self.run_actions(Some(ctx));
        let ack_poll = (!self.bridge.awaiting_ack().is_empty()).then_some(self.next_ack_poll);
        let soon = [Some(next), self.accept_retry, ack_poll]
            .into_iter()
            .flatten()
            .fold(next, Duration::min);
        if self.read_queue.is_empty() {
            Some(soon)
        } else {
            Some(self.now)
        }
    }

    fn deliver(&mut self, tag: u64, event: MessageEvent) {
        self.bridge.event(tag, event, self.now);
    }

    fn flush(&mut self) {
        let started = Instant::now();
        let mut queue = std::mem::take(&mut self.write_queue);
        // Connections that used their budget wait at the back until the flush is over, so
        // none is written twice in one wake.
        let mut again = Vec::new();
        loop {
            let now = Instant::now();
            for id in self.bridge.take_dirty() {
                queue.push(id, now);
            }
            if queue.is_empty() || started.elapsed() >= WRITE_TIME {
                break;
            }
            queue.pass(
                || started.elapsed() < WRITE_TIME,
                |id, since| {
                    if self.sockets.get(id).is_none() {
                        return false;
                    }
                    self.write_delay.record(self.now, since.elapsed());
                    if self.write_conn(id) {
                        again.push(id);
                    }
                    false
                },
            );
            self.run_actions(None);
        }
        let now = Instant::now();
        for id in again {
            queue.push_busy(id, now);
        }
        // What is left waits for the next wake: the poll reports it again at once.
        let left: Vec<ConnId> = queue.ids().collect();
        self.write_queue = queue;
        for id in left {
            self.rearm(id);
        }
    }

    fn finish(&mut self, poll: &mut Poll) {
        self.shut_down(poll);
    }

    fn status(&self) -> Option<FrontendStatus> {
        let mut status = self.bridge.status();
        status.tls = self.tls.is_some();
        status.tls_cert_not_after_unix_s = self.tls.as_ref().and_then(ServerTls::not_after_unix_s);
        self.cluster.fill_status(&self.bridge, &mut status);
        if let (Some(a), Some(j)) = (&mut status.attachments, &self.janitor) {
            (a.spool_used_bytes, a.released, a.release_dropped) = j.figures();
        }
        if let Some(j) = &mut status.journal {
            j.wakes = self.journal_wakes;
            if let Some(journal) = &self.journal {
                j.disk_bytes = journal.disk_bytes();
                j.history = journal.history();
                j.write_seconds = journal.write_seconds();
            }
        }
        Some(FrontendStatus {
            bridge: Some(status),
            service: Some(ServiceStatus {
                read_delay_ms: self.read_delay.all.summary(),
                read_delay_recent_ms: self.read_delay.recent.merged(self.now).summary(),
                write_delay_ms: self.write_delay.all.summary(),
                write_delay_recent_ms: self.write_delay.recent.merged(self.now).summary(),
                read_queue: self.read_queue.len(),
                write_queue: self.write_queue.len(),
                read_delay: self.read_delay.buckets.clone(),
                write_delay: self.write_delay.buckets.clone(),
            }),
            ..FrontendStatus::default()
        })
    }
}
