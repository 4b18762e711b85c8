//! The bridge protocol as a sans-IO state machine, as the core is for sessions.
//!
//! [`Bridge`] owns everything the server knows about its clients — connections by handle,
//! per-platform state (the connections that said hello, the outbox, reservations, the
//! duplicate window), message routes and typing — and nothing that does I/O. The shell
//! (`super::BridgeServer`, on the reactor) feeds it connections, complete lines, runtime
//! events and the time, and carries out what it asks: submit a message ([`Action::Submit`]),
//! drop a socket ([`Action::Close`]), write a connection's output into a socket
//! ([`Bridge::write`]). quinn-proto's `Endpoint` versus the I/O in `quinn` is the model: every
//! rule below is tested without a socket (`tests/bridge.rs`).
//!
//! Rules:
//! - **One answer per line, in order.** Each message line takes a place in its connection's
//!   answer queue when read; the runtime's admission fills it, and answers leave in line
//!   order. A copy of an id still awaiting admission is answered with the original's fate
//!   (`duplicate` if accepted, the same `reject` if not).
//! - **Bounded everywhere, with an explicit answer**: connections, connections waiting for
//!   their hello (a deadline and a per-address cap), platforms (validated names, a cap, freed
//!   when empty), each platform's outbox in events and bytes (an accepted message reserves
//!   its result's envelope until that result is delivered, the result's text is charged when
//!   it exists, and one that does not fit is held, in order, until room frees: the bound is
//!   never passed and nothing is dropped for room; a full one answers `backpressure`; only a
//!   platform absent past `outbox_stale_after` loses its oldest results, each logged), each
//!   platform's duplicate window (full: `backpressure`, never evicted early), output per
//!   connection (reads pause; best-effort lines are dropped).
//! - **Delivery**: a terminal event goes to the connection that sent the message; if it has
//!   gone, to its platform's outbox, which feeds the newest connection that said hello for
//!   the platform as fast as that connection reads. A result is delivered once the peer's
//!   TCP acknowledges it ([`Bridge::acked`]); what a dying connection had not delivered goes
//!   back to the *front* of its outbox, in order. A half-closed client keeps getting its
//!   events until none is outstanding.
//! - **Isolation**: with a token, only a hello carrying it authenticates, a connection acts
//!   only for the platform its hello named, and after `unauthorized` no further line counts.
//!
//! Rooms, each owning its state and a `check()` of its invariants (run, in debug builds,
//! after every input, with the cross-room counts checked here in `audit`), as quinn-proto's
//! `Connection` delegates to its sub-state owners:
//! - `conns`: connections — answer queues, output, what was written and confirmed, the
//!   hello/auth bookkeeping;
//! - `platforms`: per platform — the hellos, the outbox, reservations, the duplicate window;
//! - `routes`: where a result goes (messages in flight, typing), and a message's end;
//! - `delivery`: a terminal event's way out (outcome → outbox → connection, what the peer
//!   confirmed, partial and typing lines), over `conns` and `platforms` for one input: it
//!   returns what to journal as delivered;
//! - `admit`: the admission pipeline and the one message builder (client lines and journal
//!   recovery alike), with every refusal's wording;
//! - `durable`: what exists only with a journal (`Option<Durable>`), the journal's report
//!   and recovery;
//! - `cluster`: what exists only as a cluster member (`ClusterSide`, a sibling of `durable`:
//!   the cluster's part of the journal's report, the stream reader's arrivals, hand-overs,
//!   drains, forwards), in the cluster's wing (`src/cluster/bridge/`, mounted here), with a
//!   no-op twin without the `cluster` feature;
//! - `status`: the figures for the status snapshot;
//! - `config`: limits and timings.
//!
//! This file routes between them: every input is a `Bridge` method (`handle_*` for lines
//! and runtime events) that sets the clock, delegates, and audits.

mod access;
mod admit;
// The bridge's cluster side (or its no-op twin), in the cluster's wing.
#[path = "../../cluster/bridge/mod.rs"]
mod cluster;
mod config;
mod conns;
mod delivery;
mod durable;
mod platforms;
mod refusal;
mod routes;
mod status;

use std::collections::{HashMap, VecDeque};
use std::io::{self, Write};
use std::net::IpAddr;
use std::time::Duration;

use super::frame::Frame;
use crate::core::{CancelReason, EventKind, MessageEvent, RejectReason, TurnId};
use crate::journal::{Committed, Record};
use crate::key::Key;
use crate::message::{Message, SessionKey};
use crate::wire::{
    ClientOp, EncodedLine as Body, LineError, ServerOp, check_platform, encode, parse_line,
};
use access::Access;
pub(crate) use cluster::Report;
use cluster::{ClusterSide, Effect};
pub use config::{BridgeConfig, TERMINAL_ENVELOPE};
use config::{HOUSEKEEPING, INTERRUPTED, POISON};
use conns::Conns;
use delivery::failed_line;
use durable::Durable;
use platforms::Platforms;
use refusal::Refusal;
use routes::{Phase, Routes};
use status::Counters;

pub use super::frame::Flushed;
pub(crate) use status::RecoveryCounts;

/// A connection's handle: a generational [`Key`], so a handle kept after its connection
/// closed never reaches the connection that reuses its slot. The shell uses its bits as the
/// socket's poll token.
pub type ConnId = Key;

/// What the bridge asks of its shell.
#[derive(Debug)]
pub enum Action {
    /// Submit to the runtime; its events come back through [`Bridge::event`] with `tag`.
    Submit {
        /// The route tag.
        tag: u64,
        /// The message.
        message: Message,
    },
    /// Close the connection's socket; the bridge has forgotten it.
    Close(ConnId),
    /// Reset the connection (close discarding unsent data): results written to it and not
    /// acknowledged went back to the outbox, so nothing more of them may reach the peer.
    Reset(ConnId),
    /// Write a record to the journal; accepted messages are confirmed through
    /// [`Bridge::journaled`].
    Journal(Record),
    /// With a journal, messages are submitted held (`Ctx::submit_held`): this turn's
    /// `started` record is durable, so it may now be handed to an agent
    /// (`Ctx::release_turn`).
    StartTurn(TurnId),
    /// `--cluster`: these sessions' partition is no longer this instance's: they leave the
    /// runtime (`Ctx::hand_over`); their messages' events are discarded from now on.
    HandOver(Vec<SessionKey>),
    /// `--cluster`: this drained partition may be released (its turns ended, its sessions
    /// were handed over): tell the journal thread (`ClusterLink::release_drained`).
    ReleasePartition(u32),
    /// `--cluster`: a request for the stream reader's connection (the hello registry, a
    /// forward of results and its answer; `Reader::request`). Without the feature, none
    /// can be made (`Infallible`).
    Cluster(cluster::Request),
    /// These files (in the spool, checked at admission) belong to messages whose route
    /// ended: delete them, off the reactor.
    ReleaseFiles(Vec<String>),
}

/// The bridge protocol's state machine. See the module documentation.
pub struct Bridge {
    cfg: BridgeConfig,
    /// Connections, their output and their hello state.
    conns: Conns,
    /// Platforms: outboxes, reservations, duplicate windows.
    platforms: Platforms,
    /// Messages in flight and where their results (and typing) go.
    routes: Routes,
    /// What exists only with a journal (`cfg.journal`).
    durable: Option<Durable>,
    /// What exists only as a cluster member (`--cluster`; inert otherwise).
    cluster: ClusterSide,
    actions: VecDeque<Action>,
    stats: Counters,
    next_housekeeping: Duration,
    /// The time of the latest input.
    now: Duration,
    /// Who may talk to the bot, and how much (`access::Policy`, on the wall clock).
    access: Access,
}

fn error_line(detail: &str) -> Vec<u8> {
    encode(&ServerOp::Error { detail })
}

impl Bridge {
    /// A bridge with no connection.
    pub fn new(cfg: BridgeConfig) -> Bridge {
        Bridge {
            conns: Conns::new(&cfg),
            platforms: Platforms::new(&cfg),
            routes: Routes::default(),
            durable: cfg.journal.then(|| Durable::new(cfg.max_pending_durable)),
            cluster: ClusterSide::default(),
            access: Access::new(cfg.access.clone()),
            cfg,
            actions: VecDeque::new(),
            stats: Counters::default(),
            next_housekeeping: Duration::ZERO,
            now: Duration::ZERO,
        }
    }

    /// Sets the wall clock: `epoch_ms` is the wall-clock time (ms since the Unix epoch) at
    /// time zero of the bridge's clock (used only with a journal).
    pub fn set_wall_clock(&mut self, epoch_ms: u64) {
        self.access.set_wall_clock(epoch_ms);
        if let Some(d) = &mut self.durable {
            d.set_wall_clock(epoch_ms);
        }
    }

    /// The settings.
    pub fn config(&self) -> &BridgeConfig {
        &self.cfg
    }

    /// Replaces the auth token (a reload): hellos from now on are checked against it;
    /// connections already authenticated stay so. `None` (no token) is refused when a token
    /// was set, since connections admitted without one would skip the hello deadline's
    /// bookkeeping; going from none to a token needs a restart too (returns false).
    pub fn set_auth_token(&mut self, token: Option<&str>) -> bool {
        let ok = self.conns.set_token(token);
        if ok && let Some(t) = token {
            self.cfg.auth_token = Some(t.to_owned());
        }
        ok
    }

    /// A new connection from `peer`, or the error line to write before closing it.
    /// At a cap on connections waiting for their hello, the oldest waiting one of the
    /// largest address prefix is closed for it ([`Action::Close`]: run it before taking the
    /// new socket).
    pub fn connect(&mut self, peer: IpAddr, now: Duration) -> Result<ConnId, Vec<u8>> {
        if let Some((victim, why)) = self.conns.victim_for(peer, &self.cfg) {
            self.stats.connections_refused += 1;
            if let Some(old) = self.conns.get(victim).map(|c| c.peer)
                && let Some(n) = self.conns.refusal_log()
            {
                let more = crate::logfmt::suppressed_note(n);
                log::warn!(
                    "closed connection {victim} from {old} (no hello yet) for one from {peer}: {why}{more}"
                );
            }
            self.close(victim, "evicted", true);
        }
        self.conns.open(peer, now, &self.cfg).map_err(|why| {
            self.stats.connections_refused += 1;
            if let Some(n) = self.conns.refusal_log() {
                let more = crate::logfmt::suppressed_note(n);
                log::warn!("refused connection from {peer}: {why}{more}");
            }
            error_line(&why)
        })
    }

    /// Whether the shell should read from `conn` now: not while its output is over its bound
    /// (the client is not reading), nor once it is closing or half-closed.
    pub fn wants_read(&self, conn: ConnId) -> bool {
        self.conns.wants_read(conn)
    }

    /// Whether `conn` has output waiting.
    pub fn has_output(&self, conn: ConnId) -> bool {
        self.conns.has_output(conn)
    }

    /// Connections whose output changed since the last call: the shell should write them.
    pub fn take_dirty(&mut self) -> Vec<ConnId> {
        self.conns.take_dirty()
    }

    /// The next thing the shell must do.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// One complete line from `conn` (without its newline).
    pub fn line(&mut self, id: ConnId, line: &[u8], now: Duration) {
        self.now = now;
        self.handle_line(id, line, now);
        self.audit();
    }

    fn handle_line(&mut self, id: ConnId, line: &[u8], now: Duration) {
        let Some(conn) = self.conns.get(id) else {
            return;
        };
        if conn.closing {
            return;
        }
        let parsed = parse_line(line);
        if !conn.authed {
            match parsed {
                Ok(ClientOp::Hello {
                    platform,
                    token: Some(t),
                    acks,
                }) if self.conns.token_matches(&t) => self.hello(id, platform, acks),
                _ => self.unauthorized(id),
            }
            return;
        }
        match parsed {
            Ok(ClientOp::Ping) => {
                let max_line_bytes = Some(self.cfg.max_line_bytes);
                self.answer(id, encode(&ServerOp::Pong { max_line_bytes }));
            }
            Ok(ClientOp::Hello {
                platform,
                token,
                acks,
            }) => {
                if self.conns.token_required()
                    && !token.is_some_and(|t| self.conns.token_matches(&t))
                {
                    self.unauthorized(id);
                } else {
                    self.hello(id, platform, acks);
                }
            }
            Ok(ClientOp::Delivered { ids }) => {
                for f in self.conns.delivered(id, &ids, self.now) {
                    self.confirm(f);
                }
                self.maybe_finish(id);
            }
            Ok(ClientOp::Message(m)) => {
                let mid = m.id.clone();
                if let Err(refusal) = self.admit(id, m, now) {
                    self.stats.count_rejected(refusal.reason, 1);
                    self.answer(id, refusal.reject_line(&mid));
                }
            }
            Ok(ClientOp::MayUse {
                id: q,
                platform,
                user_id,
                chat_id,
            }) => {
                let hello = self.conns.get(id).and_then(|c| c.platform.as_deref());
                let (platform, chat) = (platform.as_deref(), chat_id.as_deref());
                match (self.access).may_use(hello, &q, platform, &user_id, chat) {
                    Ok(line) => self.answer(id, line),
                    Err(e) => self.error(id, e),
                }
            }
            Ok(ClientOp::Link { up, detail }) => {
                let link = crate::liveness::LinkStatus { up, detail };
                if let Err(e) = self.conns.set_link(id, link) {
                    self.error(id, e);
                }
            }
            Err(LineError::Malformed(detail)) => self.error(id, &detail),
            Err(LineError::Invalid { id: mid, detail }) => {
                let refusal = Refusal::invalid(detail);
                self.stats.count_rejected(refusal.reason, 1);
                self.answer(id, refusal.reject_line(&mid));
            }
        }
    }

    /// A line from `conn` went over the limit and was discarded.
    pub fn line_too_long(&mut self, id: ConnId) {
        match self.conns.get(id) {
            None => {}
            Some(c) if c.closing => {}
            Some(c) if !c.authed => self.unauthorized(id),
            Some(_) => {
                let max = self.cfg.max_line_bytes;
                self.error(id, &format!("line longer than {max} bytes; discarded"));
            }
        }
        self.audit();
    }

    /// The peer of `conn` shut down its sending side. It keeps getting its events until none
    /// is outstanding.
    pub fn read_closed(&mut self, id: ConnId) {
        if let Some(p) = self.conns.half_close(id) {
            self.platforms.detach(&p, id);
            self.delivery().refill_newest(&p);
            self.platforms.maybe_free(&p);
        }
        if self
            .conns
            .get(id)
            .is_some_and(|c| c.outstanding == 0 && c.idle())
        {
            self.close(id, "peer closed", true);
        }
        self.audit();
    }

    /// The socket of `conn` is gone (closed by the peer, or failed). What it had not written
    /// goes back to the front of its outbox.
    pub fn disconnected(&mut self, id: ConnId) {
        self.close(id, "disconnected", false);
        self.audit();
    }

    /// An event of the message submitted with `tag`.
    pub fn event(&mut self, tag: u64, event: MessageEvent, now: Duration) {
        self.now = now;
        let MessageEvent { id, session, kind } = event;
        if self.cluster.handed_event(tag, &kind) {
            return self.audit();
        }
        match kind {
            EventKind::Accepted { state, position } => {
                self.handle_accepted(tag, (&id, &session), state, position, now);
            }
            EventKind::Rejected(reason) => self.handle_rejected(tag, reason),
            EventKind::TurnStarted(turn) => self.turn_started(tag, turn, session, now),
            EventKind::Partial(text) => {
                // To the message's connection if it has room; else dropped.
                let target = self.routes.get(tag).map(|r| r.conn);
                self.delivery().partial(target, &id, session.as_str(), text);
            }
            EventKind::TurnEnded(turn) => {
                if let Some(t) = self.routes.typing_ended(turn) {
                    self.delivery().typing(t.conn, &t.session, false);
                }
            }
            EventKind::Finished(outcome) => self.finished(tag, &id, &session, outcome),
        }
        self.audit();
    }

    fn handle_rejected(&mut self, tag: u64, reason: RejectReason) {
        if self.routes.get(tag).is_some_and(|r| r.recovered) {
            // `--cluster`: loaded (a partition gained, an inbox arrival) as this instance
            // stops: it stays in the journal for the next owner, as a queued one does.
            if reason == RejectReason::ShuttingDown
                && let Some(d) = &mut self.durable
                && let Some(route) = self.routes.remove(tag)
            {
                let conn = d.keep_for_restart(route, &mut self.platforms);
                return self.maybe_finish(conn);
            }
            // Acknowledged by the process before the restart: it gets a terminal event.
            let Some(route) = self.routes.remove(tag) else {
                return;
            };
            let why = refusal::not_readmitted(reason.as_str());
            log::warn!("session {}: message {} {why}", route.session, route.id);
            self.actions.extend(route.release_files());
            let max = self.cfg.max_reply_bytes;
            let body = failed_line(&route.id, route.session.as_str(), why, max);
            return self.terminal(tag, route.conn, &route.platform, route.id, body, None);
        }
        match &mut self.durable {
            // Answered once its `forget` record is durable (else a crash brings it back).
            Some(d) => {
                if let Some(route) = self.routes.get_mut(tag) {
                    route.phase = Phase::Refusing;
                }
                let action = d.record_forget(tag, Refusal::runtime(reason));
                self.actions.push_back(action);
            }
            None => self.refuse(tag, Refusal::runtime(reason)),
        }
    }

    fn turn_started(&mut self, tag: u64, turn: TurnId, session: SessionKey, now: Duration) {
        if !self.routes.contains(tag) {
            return;
        }
        // Its partition is draining: the turn stays held, unrecorded, until the hand-over.
        let durable = self.durable.as_ref();
        if (self.cluster).turn_gate(tag, &session, &self.routes, durable) {
            return;
        }
        let Some(route) = self.routes.get_mut(tag) else {
            return;
        };
        route.starts += 1;
        let (conn, attempt) = (route.conn, route.starts);
        if let Some(d) = &mut self.durable {
            self.actions.push_back(d.record_start(tag, attempt, turn));
        }
        self.delivery().typing(conn, &session, true);
        let next = now + self.cfg.typing_refresh;
        self.routes.typing_started(turn, conn, session, next);
    }

    /// The journal thread's report: what it releases ([`Durable::committed`], where the
    /// release rule is stated) goes out — held turns started ([`Action::StartTurn`]),
    /// durable messages submitted, terminal events sent, refusals answered, failed writes
    /// rejected `storage`.
    pub fn journaled(&mut self, c: Committed, now: Duration) {
        self.journal_report(c, Report::default(), now);
    }

    /// [`Bridge::journaled`] with the cluster's part of the same report (a cluster member's,
    /// `ClusterLink::report`; none without the feature), applied first, in steps.
    pub(in crate::server) fn journal_report(
        &mut self,
        mut c: Committed,
        cluster: Report,
        now: Duration,
    ) {
        self.now = now;
        self.cluster.take_report(cluster);
        while self.cluster_step(|side, rooms| side.report_step(&mut c, rooms)) {}
        let Some(d) = &mut self.durable else {
            return;
        };
        let released = d.committed(c);
        for (turn, seq) in released.starts {
            // A turn of a partition lost or fenced (in this report or before) stays held and
            // leaves with its session's hand-over: its `started` write may have been
            // refused, and the next owner runs the message.
            if !self.cluster.runs_here(seq, &self.routes) {
                log::debug!("message {seq}: its partition is not owned here; turn not started");
                continue;
            }
            self.actions.push_back(Action::StartTurn(turn));
        }
        for (tag, message) in released.submit {
            if let Some(route) = self.routes.get_mut(tag) {
                route.phase = Phase::Submitted;
            }
            self.submit(tag, message);
        }
        for (conn, frame) in released.outcomes {
            if self.cluster.silenced(frame.seq) {
                if let Some(platform) = &frame.terminal_for {
                    self.delivery().give_back(platform);
                }
                continue;
            }
            let frame = self.cluster.mark_foreign(frame, &self.routes);
            if let Some(platform) = frame.terminal_for.clone() {
                self.deliver_terminal(conn, &platform, frame);
            }
        }
        for (seq, refusal) in released.forgotten {
            self.refuse(seq, refusal);
        }
        for seq in released.failed {
            log::debug!("message {seq}: journal write failed; rejected storage");
            self.refuse(seq, Refusal::storage(released.error.as_deref()));
        }
        self.cluster_step(|side, rooms| Some(side.after_report(rooms)));
        self.audit();
    }

    /// Fires the bridge's deadlines; returns when it next needs to be called.
    pub fn tick(&mut self, now: Duration) -> Duration {
        self.now = now;
        // `--cluster`: partitions past their lease's fence deadline stop their turns now.
        self.cluster_step(|side, rooms| Some(side.fence(rooms)));
        if now >= self.next_housekeeping {
            self.next_housekeeping = now + HOUSEKEEPING;
            let timeout = self.cfg.hello_timeout;
            for id in self.conns.late_hellos(now, timeout) {
                self.stats.connections_refused += 1;
                self.answer(id, error_line(&format!("no hello within {timeout:?}")));
                self.set_closing(id);
            }
            // Their results go back to the outbox.
            for id in self.conns.stalled_for(now, self.cfg.write_stall_timeout) {
                self.stats.connections_refused += 1;
                self.close(id, "write stalled", true);
            }
            for (conn, session) in self.routes.typing_due(now, self.cfg.typing_refresh) {
                self.delivery().typing(conn, &session, true);
            }
            self.platforms.expire(now);
            // Stale results dropped (`Delivery::drop_stale`) leave the journal.
            for seq in self.delivery().drop_stale() {
                if let Some(d) = &mut self.durable {
                    self.actions.push_back(d.record(Record::Delivered { seq }));
                }
            }
            // `--cluster`: rebuilt messages waiting for room; results offered elsewhere.
            while self.cluster_step(|side, rooms| side.rebuild_next(rooms)) {}
            self.cluster_step(|side, rooms| Some(side.offer(rooms)));
            self.access.maybe_save(now);
        }
        self.audit();
        (self.cluster.next_fence())
            .map_or(self.next_housekeeping, |t| t.min(self.next_housekeeping))
    }

    /// Writes `conn`'s output into `w`, at most the write budget, feeding it its platform's
    /// backlog as it goes. A write error is returned; the shell then calls
    /// [`Bridge::disconnected`].
    pub fn write<W: Write + ?Sized>(
        &mut self,
        id: ConnId,
        w: &mut W,
        now: Duration,
    ) -> io::Result<Flushed> {
        self.now = now;
        let budget = self.cfg.write_budget;
        let result = self.delivery().write(id, w, budget);
        if matches!(result, Ok(Flushed::All)) {
            self.maybe_finish(id);
        }
        self.audit();
        result
    }

    /// The peer's TCP has acknowledged the first `acked` bytes written to `conn`: the results
    /// they held are delivered and release their outbox room.
    pub fn acked(&mut self, id: ConnId, acked: u64) {
        for f in self.conns.acked(id, acked, self.now) {
            self.confirm(f);
        }
        self.maybe_finish(id);
        self.audit();
    }

    /// Bytes written to `conn` so far (for the shell's acknowledgement count).
    pub fn written(&self, id: ConnId) -> u64 {
        self.conns.written(id)
    }

    /// Connections with written results not yet acknowledged.
    pub fn awaiting_ack(&self) -> Vec<ConnId> {
        self.conns.awaiting_ack()
    }

    /// Results written to `acks` connections and not yet confirmed with `delivered`.
    pub fn awaiting_delivery(&self) -> usize {
        self.conns.awaiting_delivery()
    }

    /// A line from `id` after the runtime stopped, while shutdown waits for confirmations:
    /// a `delivered` line is taken (its results are journaled as delivered); any other line
    /// is left unanswered (a bridge sends a message it got no answer for again, to the next
    /// start).
    pub fn confirmation_line(&mut self, id: ConnId, line: &[u8]) {
        if !self.conns.get(id).is_some_and(|c| c.authed && !c.closing) {
            return;
        }
        if let Ok(ClientOp::Delivered { ids }) = parse_line(line) {
            for f in self.conns.delivered(id, &ids, self.now) {
                self.confirm(f);
            }
            self.maybe_finish(id);
            self.audit();
        }
    }

    /// Forced exit: every message still running gets `cancelled: shutdown` on its own
    /// connection, if that is still open, so the shell can write what it can before exiting.
    pub fn abandon_all(&mut self) {
        for (tag, route) in self.routes.drain_in_order() {
            self.conns.settled(route.conn);
            let line = encode(&ServerOp::Cancelled {
                id: &route.id,
                session: route.session.as_str(),
                reason: CancelReason::Shutdown.as_str(),
            });
            let journaled = self.durable.is_some() && route.phase != Phase::Journaling;
            if journaled {
                // Best effort: the process exits now, and what the journal does not take is
                // recovered at the next start.
                let body = Body::Line(line);
                self.terminal(tag, route.conn, &route.platform, route.id, body, None);
            } else {
                let frame = Frame::new(Body::Line(line), Some(route.platform.clone()));
                self.deliver_terminal(route.conn, &route.platform, frame);
            }
        }
        if let Some(d) = &mut self.durable {
            d.abandon();
        }
        self.audit();
    }

    /// Terminal events waiting for their outcome record to be durable.
    pub fn unjournaled(&self) -> usize {
        self.durable.as_ref().map_or(0, Durable::unjournaled)
    }

    /// Terminal events still waiting in outboxes (or for their outcome record).
    pub fn outboxed(&self) -> usize {
        self.platforms.outboxed() + self.unjournaled()
    }

    fn hello(&mut self, id: ConnId, platform: Option<String>, acks: bool) {
        let new = match platform {
            None => None,
            Some(name) => {
                if let Err(detail) = check_platform(&name) {
                    return self.error(id, &format!("hello: {detail}"));
                }
                let Some(p) = self.platforms.open(&name) else {
                    let max = self.cfg.max_platforms;
                    let detail =
                        format!("hello refused: {max} platforms are active (--max-platforms)");
                    return self.error(id, &detail);
                };
                Some(p)
            }
        };
        if self.conns.get(id).is_none() {
            return;
        }
        let old = self.conns.set_platform(id, new.clone());
        for f in self.conns.set_acks(id, acks) {
            self.confirm(f);
        }
        self.conns.authenticate(id);
        if let Some(old) = &old {
            self.platforms.detach(old, id);
        }
        if let Some(new) = &new {
            self.platforms.attach(new, id);
            if let Some(r) = self.cluster.hello(new) {
                self.actions.push_back(Action::Cluster(r));
            }
        }
        if let Some(old) = old {
            self.platforms.maybe_free(&old);
        }
        self.delivery().refill(id);
    }

    fn unauthorized(&mut self, id: ConnId) {
        if let Some(peer) = self.conns.get(id).map(|c| c.peer)
            && let Some(n) = self.conns.refusal_log()
        {
            let more = crate::logfmt::suppressed_note(n);
            log::warn!("connection {id} from {peer}: unauthorized; closing{more}");
        }
        self.stats.count_rejected("unauthorized", 1);
        self.answer(id, error_line("unauthorized"));
        self.set_closing(id);
    }

    /// No further line of `id` counts; it closes once its output is written.
    fn set_closing(&mut self, id: ConnId) {
        if let Some(p) = self.conns.set_closing(id) {
            self.platforms.detach(&p, id);
            self.platforms.maybe_free(&p);
        }
    }

    fn error(&mut self, id: ConnId, detail: &str) {
        self.stats.errors += 1;
        self.answer(id, error_line(detail));
    }

    fn answer(&mut self, id: ConnId, line: Vec<u8>) {
        self.conns.push(id, Frame::line(line), self.now);
    }

    /// Closes a connection that has nothing left to do: closing and written out, or
    /// half-closed with nothing outstanding and every result acknowledged.
    fn maybe_finish(&mut self, id: ConnId) {
        let Some(c) = self.conns.get(id) else {
            return;
        };
        if c.closing && c.idle() {
            self.close(id, "closed after error", true);
        } else if c.read_closed && c.drained() {
            self.close(id, "peer closed", true);
        }
    }

    /// Forgets a connection; its unwritten terminal events go back to the front of their
    /// outboxes, in order.
    fn close(&mut self, id: ConnId, why: &str, emit: bool) {
        let Some((peer, moved)) = self.delivery().forget(id) else {
            return;
        };
        log::debug!(
            "connection {} from {} closed: {why}; {moved} undelivered terminal event(s) back to the outbox",
            id,
            peer
        );
        if emit {
            self.actions.push_back(if moved > 0 {
                Action::Reset(id)
            } else {
                Action::Close(id)
            });
        }
    }

    /// One step of the cluster side over the rooms lent to it, then what it decided carried
    /// out, in order; false if it had no step to take.
    fn cluster_step(
        &mut self,
        step: impl FnOnce(&mut ClusterSide, cluster::Rooms<'_>) -> Option<cluster::Effects>,
    ) -> bool {
        let rooms = cluster::Rooms {
            routes: &mut self.routes,
            durable: self.durable.as_mut(),
            delivery: delivery::Delivery {
                cfg: &self.cfg,
                conns: &mut self.conns,
                platforms: &mut self.platforms,
                stats: &mut self.stats,
                now: self.now,
            },
        };
        let Some(effects) = step(&mut self.cluster, rooms) else {
            return false;
        };
        for effect in effects {
            match effect {
                Effect::Finish(conn) => self.maybe_finish(conn),
                Effect::Submit(tag, message) => self.submit(tag, message),
                Effect::Refuse(tag, refusal) => self.refuse(tag, refusal),
                Effect::Recover(r, wall_ms) => {
                    let _ = self.recover(r, wall_ms, self.now);
                }
                Effect::Rebuild(rm) => {
                    self.recover_message(rm, &mut RecoveryCounts::default(), self.now);
                }
                Effect::Act(action) => self.actions.push_back(action),
            }
        }
        true
    }

    /// Checks, in debug builds, each room's invariants and that every count across rooms
    /// matches what it counts: each reservation is a route, a result on a connection, or a
    /// result in an outbox (or waiting for its outcome record).
    fn audit(&self) {
        // O(state): skipped in release builds, and past a small size so that debug builds of
        // large scenarios stay fast.
        if !cfg!(debug_assertions) || self.routes.len() + self.conns.len() + self.outboxed() > 1_000
        {
            return;
        }
        self.conns.check();
        self.routes.check();
        let mut owed: HashMap<&str, usize> = HashMap::new();
        for r in self.routes.values() {
            *owed.entry(&*r.platform).or_insert(0) += 1;
            debug_assert!(self.platforms.contains(&r.platform));
        }
        let held = self.conns.terminals_by_platform();
        let journaled = self.durable.iter().flat_map(|d| d.terminals_by_platform());
        let orphans = self.cluster.orphan_platforms();
        for p in held.chain(journaled).chain(orphans) {
            *owed.entry(p).or_insert(0) += 1;
        }
        for (id, c) in self.conns.iter() {
            let sent = self.routes.values().filter(|r| r.conn == id).count();
            debug_assert_eq!(sent, c.outstanding, "connection {} outstanding", id);
            if let Some(p) = &c.platform {
                debug_assert!(self.platforms.has_hello(p, id));
            }
        }
        for (name, c) in self.platforms.hellos() {
            let conn = self.conns.get(c);
            debug_assert!(conn.is_some_and(|conn| conn.platform.as_deref() == Some(name)));
        }
        if let Some(d) = &self.durable {
            d.check(&self.routes);
        }
        // Each route's phase agrees with the index that holds it in that phase, both ways
        // (`Durable::check` and `ClusterSide::check` look from the other side).
        let d = self.durable.as_ref();
        for (tag, r) in self.routes.tags() {
            let waiting = d.is_some_and(|d| d.is_waiting(tag));
            debug_assert_eq!(r.phase == Phase::Journaling, waiting, "message {tag} phase");
            let forgetting = d.is_some_and(|d| d.is_forgetting(tag));
            debug_assert_eq!(
                r.phase == Phase::Refusing,
                forgetting,
                "message {tag} phase"
            );
        }
        self.cluster.check(&self.routes);
        let recovered = self.durable.as_ref().map_or(0, Durable::recovered);
        self.platforms.check(&owed, recovered);
    }
}

// A cluster member's entry points (`--cluster`), whose arguments are the cluster's types.
#[cfg(feature = "cluster")]
impl Bridge {
    /// [`Bridge::journaled`] for a cluster member: `cluster` is the cluster's part of the same
    /// report (`ClusterLink::report`), applied first.
    pub fn journaled_with(
        &mut self,
        c: Committed,
        cluster: crate::cluster::ClusterReport,
        now: Duration,
    ) {
        self.journal_report(c, cluster, now);
    }

    /// What the stream reader brought (an outcome of a message acked here, a message of a
    /// partition owned here, a forward...: `ClusterSide::arrived`).
    pub fn arrived(&mut self, a: crate::cluster::Arrival, now: Duration) {
        self.now = now;
        self.cluster_step(|side, rooms| Some(side.arrived(a, rooms)));
        self.audit();
    }

    /// `--cluster`: the bridge's figures in the cluster's status (`ClusterSide::fill_status`).
    pub fn cluster_status(&self) -> crate::liveness::ClusterStatus {
        let mut s = crate::liveness::ClusterStatus::default();
        self.cluster.fill_status(&mut s);
        s
    }

    /// `--cluster`: the partition count, for the partition of a session.
    pub fn set_partitions(&mut self, n: u32) {
        if self.durable.is_some() {
            self.cluster.set_partitions(n);
        }
    }
}
