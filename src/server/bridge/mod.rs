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
//! Rooms, each owning its state and a `check()` of its invariants, as quinn-proto's
//! `Connection` delegates to its sub-state owners:
//! - `conns`: connections — answer queues, output, what was written and confirmed, the
//!   hello/auth bookkeeping;
//! - `platforms`: per platform — the hellos, the outbox, reservations, the duplicate window;
//! - `routes`: where a result goes (messages in flight, typing), and a message's end;
//! - `delivery`: a terminal event's way out (outcome → outbox → connection, what the peer
//!   confirmed, partial and typing lines), over `conns` and `platforms` for one input: it
//!   queues the actions that close sockets and returns what to journal as delivered;
//! - `lifecycle`: a connection's life over the delivery room (its hello, the errors and
//!   refusals it is answered with, closing and finishing it), returning the releases the
//!   bridge carries out;
//! - `admit`: the admission pipeline and the one message builder (client lines and journal
//!   recovery alike), with every refusal's wording;
//! - `durable`: what exists only with a journal (its report and recovery);
//! - `cluster`: what exists only as a cluster member (`ClusterSide`, a sibling of `durable`:
//!   the cluster's part of the journal's report, the stream reader's arrivals, hand-overs,
//!   drains, forwards), in the cluster's wing (`src/cluster/bridge/`, mounted here), with a
//!   no-op twin without the `cluster` feature;
//! - `status`: the figures for the status snapshot and what is still owed (`Backlog`);
//!   `config`: limits and timings;
//! - `audit`: the cross-room counts, checked in debug builds after every input.
//!
//! This file routes between them, as quinn-proto's one `impl Connection` does: the one
//! `impl Bridge` holds every input (a line, a runtime event, the journal's report, the
//! clock, a socket's progress), which sets the clock, asks the rooms, carries out the
//! decisions they return (`Ended`, `Rejected`, `Recovery`, `Released`, `Confirmed`, the
//! actions that close sockets), and audits; and the admission pipeline (`admit`,
//! `submit`), the one place a message crosses from the rooms into the runtime. The rooms
//! never call back into the bridge; the cluster's side returns `Effect`s (`cluster_step`).

mod access;
mod action;
mod admit;
mod audit;
// The bridge's cluster side (or its no-op twin), in the cluster's wing.
#[path = "../../cluster/bridge/mod.rs"]
mod cluster;
mod config;
mod conns;
mod delivery;
mod durable;
mod lifecycle;
mod platforms;
mod refusal;
mod routes;
mod status;

use std::collections::VecDeque;
use std::io::{self, Write};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use super::dedup::fingerprint;
use super::frame::Frame;
use crate::access::Policy;
use crate::core::{CancelReason, EventKind, MessageEvent};
use crate::journal::{Committed, Record, Recovered, RecoveredMessage, StoredMessage};
use crate::key::Key;
use crate::message::Message;
use crate::wire::{
    ClientOp, EncodedLine as Body, LineError, MessageFields, ServerOp, encode, parse_line,
};
use access::{Access, notice_line};
pub use action::Action;
use admit::{Admitted, Source, ack_line, build};
pub(crate) use cluster::Report;
use cluster::{ClusterSide, Effect};
pub use config::{BridgeConfig, TERMINAL_ENVELOPE};
use config::{HOUSEKEEPING, INTERRUPTED, POISON};
use conns::{Answer, Conns, Gate};
use delivery::Delivery;
use durable::{Durable, Recovery, recovery};
use lifecycle::error_line;
use platforms::{Claim, Platforms};
use refusal::{Refusal, duplicate_ack};
use routes::{Ended, InFlight, Phase, Rejected, Routes, Terminal};
pub use status::Backlog;
use status::{BridgeStatus, Counters};

pub use super::frame::Flushed;
pub(crate) use status::RecoveryCounts;

/// A connection's handle: a generational [`Key`], so a handle kept after its connection
/// closed never reaches the connection that reuses its slot. The shell uses its bits as the
/// socket's poll token.
pub type ConnId = Key;

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
            self.delivery().close(victim, "evicted");
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
        let op = match self.conns.gate(id, parse_line(line)) {
            Gate::Ignored => return,
            Gate::Unauthorized => {
                self.delivery().unauthorized(id);
                return audit::check(self);
            }
            Gate::Counts(op) => op,
        };
        match op {
            Ok(ClientOp::Ping) => {
                let max_line_bytes = Some(self.cfg.max_line_bytes);
                self.delivery()
                    .answer(id, encode(&ServerOp::Pong { max_line_bytes }));
            }
            Ok(ClientOp::Hello { platform, acks, .. }) => {
                if let Some(hello) = self.delivery().hello(id, platform, acks) {
                    let confirmed = hello.confirmed.actions(self.durable.as_mut());
                    self.actions.extend(confirmed);
                    if let Some(r) = hello.attached.and_then(|p| self.cluster.hello(&p)) {
                        self.actions.push_back(Action::Cluster(r));
                    }
                }
            }
            Ok(ClientOp::Delivered { ids }) => {
                let frames = self.conns.delivered(id, &ids, self.now);
                let confirmed = self.delivery().confirm_all(frames);
                self.actions
                    .extend(confirmed.actions(self.durable.as_mut()));
                self.delivery().finish_if_done(id);
            }
            Ok(ClientOp::Message(m)) => {
                let mid = m.id.clone();
                if let Err(refusal) = self.admit(id, m, now) {
                    self.stats.count_rejected(refusal.reason, 1);
                    self.delivery().answer(id, refusal.reject_line(&mid));
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
                    Ok(line) => self.delivery().answer(id, line),
                    Err(e) => self.delivery().error(id, e),
                }
            }
            Ok(ClientOp::Link { up, detail }) => {
                let link = crate::liveness::LinkStatus { up, detail };
                if let Err(e) = self.conns.set_link(id, link) {
                    self.delivery().error(id, e);
                }
            }
            Err(LineError::Malformed(detail)) => self.delivery().error(id, &detail),
            Err(LineError::Invalid { id: mid, detail }) => {
                let refusal = Refusal::invalid(detail);
                self.stats.count_rejected(refusal.reason, 1);
                self.delivery().answer(id, refusal.reject_line(&mid));
            }
        }
        audit::check(self);
    }

    /// A line from `conn` went over the limit and was discarded.
    pub fn line_too_long(&mut self, id: ConnId) {
        let max = self.cfg.max_line_bytes;
        match self.conns.get(id) {
            None => {}
            Some(c) if c.closing => {}
            Some(c) if !c.authed => self.delivery().unauthorized(id),
            Some(_) => {
                (self.delivery()).error(id, &format!("line longer than {max} bytes; discarded"))
            }
        }
        audit::check(self);
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
            self.delivery().close(id, "peer closed");
        }
        audit::check(self);
    }

    /// The socket of `conn` is gone (closed by the peer, or failed). What it had not written
    /// goes back to the front of its outbox.
    pub fn disconnected(&mut self, id: ConnId) {
        // The socket is already gone: nothing to close.
        let _ = self.delivery().forgotten(id, "disconnected");
        audit::check(self);
    }

    /// An event of the message submitted with `tag`.
    pub fn event(&mut self, tag: u64, event: MessageEvent, now: Duration) {
        self.now = now;
        let MessageEvent { id, session, kind } = event;
        if self.cluster.handed_event(tag, &kind) {
            return audit::check(self);
        }
        let max_reply = self.cfg.max_reply_bytes;
        match kind {
            EventKind::Accepted { state, position } => {
                let ack = ack_line(&id, &session, state, position);
                (self.routes).accepted(tag, ack, &mut self.platforms, &mut self.conns, now);
            }
            EventKind::Rejected(reason) => {
                let (durable, platforms) = (self.durable.as_mut(), &mut self.platforms);
                match self
                    .routes
                    .rejected(tag, reason, durable, platforms, max_reply)
                {
                    Some(Rejected::Ended(ended)) => self.end(ended),
                    Some(Rejected::Forget(action)) => self.actions.push_back(action),
                    Some(Rejected::Refuse(refusal)) => self.refuse(tag, refusal),
                    None => {}
                }
            }
            EventKind::TurnStarted(turn) => {
                let (routes, durable) = (&self.routes, self.durable.as_ref());
                // Its partition is draining: the turn stays held, unrecorded, until the
                // hand-over.
                if routes.contains(tag) && !self.cluster.turn_gate(tag, &session, routes, durable) {
                    let next = now + self.cfg.typing_refresh;
                    let started = self.routes.turn_started(tag, turn, session.clone(), next);
                    if let Some((conn, attempt)) = started {
                        if let Some(d) = &mut self.durable {
                            self.actions.push_back(d.record_start(tag, attempt, turn));
                        }
                        self.delivery().typing(conn, &session, true);
                    }
                }
            }
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
            EventKind::Finished(outcome) => {
                if let Some(mut route) = self.routes.remove(tag) {
                    self.access.charge(route.charge.take(), &outcome, now);
                    self.conns.settled(route.conn);
                    let (durable, platforms) = (self.durable.as_mut(), &mut self.platforms);
                    let ended = route.finished(tag, outcome, durable, platforms, max_reply);
                    self.end(ended);
                }
            }
        }
        audit::check(self);
    }

    /// The journal thread's report: what it releases ([`Durable::committed`], where the
    /// release rule is stated) goes out — held turns started ([`Action::StartTurn`]),
    /// durable messages submitted, terminal events sent, refusals answered, failed writes
    /// rejected `storage`.
    pub fn journaled(&mut self, c: Committed, now: Duration) {
        self.journaled_with(c, Report::default(), now);
    }

    /// [`Bridge::journaled`] with the cluster's part of the same report (a cluster member's,
    /// `ClusterLink::report`; `None` without the feature), applied first, in steps.
    pub fn journaled_with(&mut self, mut c: Committed, cluster: Report, now: Duration) {
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
        audit::check(self);
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
                let mut delivery = self.delivery();
                delivery.answer(id, error_line(&format!("no hello within {timeout:?}")));
                delivery.set_closing(id);
            }
            // Their results go back to the outbox.
            for id in self.conns.stalled_for(now, self.cfg.write_stall_timeout) {
                self.stats.connections_refused += 1;
                self.delivery().close(id, "write stalled");
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
        audit::check(self);
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
            self.delivery().finish_if_done(id);
        }
        audit::check(self);
        result
    }

    /// The peer's TCP has acknowledged the first `acked` bytes written to `conn`: the results
    /// they held are delivered and release their outbox room.
    pub fn acked(&mut self, id: ConnId, acked: u64) {
        let frames = self.conns.acked(id, acked, self.now);
        let confirmed = self.delivery().confirm_all(frames);
        self.actions
            .extend(confirmed.actions(self.durable.as_mut()));
        self.delivery().finish_if_done(id);
        audit::check(self);
    }

    /// Bytes written to `conn` so far (for the shell's acknowledgement count).
    pub fn written(&self, id: ConnId) -> u64 {
        self.conns.written(id)
    }

    /// Connections with written results not yet acknowledged.
    pub fn awaiting_ack(&self) -> Vec<ConnId> {
        self.conns.awaiting_ack()
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
            let frames = self.conns.delivered(id, &ids, self.now);
            let confirmed = self.delivery().confirm_all(frames);
            self.actions
                .extend(confirmed.actions(self.durable.as_mut()));
            self.delivery().finish_if_done(id);
            audit::check(self);
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
                // recovered at the next start. Its files stay for that start.
                let terminal = Terminal::of(tag, route, Body::Line(line));
                self.end(Ended::Terminal(Terminal {
                    files: None,
                    ..terminal
                }));
            } else {
                let frame = Frame::new(Body::Line(line), Some(route.platform.clone()));
                self.deliver_terminal(route.conn, &route.platform, frame);
            }
        }
        if let Some(d) = &mut self.durable {
            d.abandon();
        }
        audit::check(self);
    }

    /// What is still owed ([`Backlog`]): what shutdown waits for and reports.
    pub fn backlog(&self) -> Backlog {
        Backlog::of(&self.conns, &self.platforms, self.durable.as_ref())
    }

    /// Rebuilds the state a journal held at start-up (before any connection): the duplicate
    /// windows, the waiting messages submitted again in their original order, undelivered
    /// outcomes back in their outboxes (marked `redelivery`), and the turns a crash
    /// interrupted failed `interrupted by restart` — or, with `resume_interrupted`, run again
    /// unless they were interrupted twice (`poison`). `wall_now_ms` is the wall clock now;
    /// the bridge's clock must be at `now`. Logs one INFO line with the counts.
    pub fn recover(&mut self, r: Recovered, wall_now_ms: u64, now: Duration) -> RecoveryCounts {
        self.now = now;
        let mut n = RecoveryCounts {
            messages: r.messages.len(),
            ..RecoveryCounts::default()
        };
        if let Some(d) = &mut self.durable {
            d.recovering(wall_now_ms, now, n.messages);
        }
        self.routes.tags_after(r.max_seq);
        n.dedup_ids += (self.platforms).restore_dedup(r.dedup, wall_now_ms, now);
        for rm in r.messages {
            self.recover_message(rm, &mut n, now);
        }
        durable::log_recovered(&n);
        if let Some(d) = &mut self.durable {
            d.recovered_all(n);
        }
        audit::check(self);
        n
    }

    /// The figures for the status snapshot.
    pub fn status(&self) -> BridgeStatus {
        let (durable, now) = (self.durable.as_ref(), self.now);
        (self.stats).status(
            &self.cfg,
            &self.conns,
            &self.platforms,
            durable,
            &self.access,
            now,
        )
    }

    /// The access policy, for the shell, with the wall-clock time of the bridge's `now`.
    pub(in crate::server) fn access(&mut self) -> (&mut Policy, u64) {
        self.access.policy(self.now)
    }

    /// A `message` line from `conn`: admitted (a duplicate answered, a copy waiting for its
    /// original's fate, or a new message launched: submitted, or with a journal journaled
    /// first), or the refusal to answer it with.
    fn admit(&mut self, conn: ConnId, m: MessageFields, now: Duration) -> Result<(), Refusal> {
        let Some(name) = self.conns.sender_platform(conn, m.platform.as_deref())? else {
            return Ok(());
        };
        let admitted = build(&name, m, Source::Line, &self.cfg.attachments)?;
        let fp = fingerprint(&admitted.message.id);
        let (durable, routes) = (self.durable.as_ref(), &mut self.routes);
        let (cluster, cap) = (&self.cluster, self.cfg.outbox_cap);
        let (platform, claim) = self
            .platforms
            .claim(
                &name,
                fp,
                now,
                || {
                    cluster.outbox_gate(&name, cap)?;
                    durable.map_or(Ok(()), |d| d.room())
                },
                || routes.new_tag(),
            )
            .map_err(|r| r.with_session(&admitted.message.session))?;
        let Admitted { message, fields } = admitted;
        match claim {
            Claim::Duplicate => {
                let ack = duplicate_ack(&message.id, &message.session);
                self.delivery().answer(conn, ack);
            }
            Claim::CopyOf(tag) => {
                if let Some(route) = self.routes.get_mut(tag) {
                    route.copies.push(conn);
                }
                let copy = Some((message.id, message.session));
                self.conns
                    .push_answer(conn, Answer::Pending { tag, copy }, now);
            }
            Claim::New(tag) => {
                let (id, session) = (message.id.clone(), message.session.clone());
                let mut route = InFlight::new(conn, id, session, platform, fp);
                route.files = message.context.attachments.clone();
                let journaled = self.durable.is_some();
                self.routes
                    .launch(tag, route, journaled, &mut self.conns, now);
                let Some(d) = &mut self.durable else {
                    self.submit(tag, message);
                    return Ok(());
                };
                let dedup_until_ms = d.wall_ms(now + self.cfg.dedup_window);
                let stored = StoredMessage {
                    seq: tag,
                    fields,
                    dedup_until_ms,
                };
                log::debug!("message {tag} waits for the journal");
                self.actions.push_back(d.wait(tag, message, stored));
            }
        }
        Ok(())
    }

    /// Submits the message of `tag` to the runtime, or answers it with the access policy's
    /// notice ([`Routes::answered`]: acked as a turn that ran at once, then ended with the
    /// notice).
    fn submit(&mut self, tag: u64, message: Message) {
        match self.access.decide(&message, self.now) {
            Ok(charge) => {
                if let Some(route) = self.routes.get_mut(tag) {
                    route.charge = charge;
                }
                self.actions.push_back(Action::Submit { tag, message });
            }
            Err((notice, text)) => {
                let body = notice_line(&message, notice, text, self.cfg.max_reply_bytes);
                let (platforms, conns) = (&mut self.platforms, &mut self.conns);
                let answered =
                    (self.routes).answered(tag, &message, body, platforms, conns, self.now);
                if let Some(terminal) = answered {
                    self.end(Ended::Terminal(terminal));
                }
            }
        }
    }

    /// Refuses the message of `tag` (runtime refusal or journal failure): every line waiting
    /// for it gets the `reject` ([`Delivery::refused`]), and a retry of its id is new.
    fn refuse(&mut self, tag: u64, refusal: Refusal) {
        if let Some(route) = self.routes.remove(tag) {
            self.delivery().refused(tag, &route, refusal);
            self.delivery().finish_if_done(route.conn);
        }
    }

    /// One journaled message (at start-up, or of a partition gained): what [`recovery`]
    /// decides it becomes — its outcome back in its outbox, submitted again, or failed.
    fn recover_message(&mut self, rm: RecoveredMessage, n: &mut RecoveryCounts, now: Duration) {
        // Where its result goes: a connection waiting for it (a cluster partition gained
        // here), else its platform's newest hello.
        let to = self.cluster.rebound(rm.message.seq);
        let Some(platform) = self.platforms.force(rm.message.platform()) else {
            return;
        };
        let (cfg, platforms) = (&self.cfg, &mut self.platforms);
        match recovery(rm, to, platform, cfg, platforms, n, now) {
            Recovery::Outcome(to, platform, frame) => self.deliver_terminal(to, &platform, frame),
            Recovery::Failed(terminal) => self.end(Ended::Terminal(terminal)),
            Recovery::Requeue(seq, route, message) => {
                // The connection waits for it once more (settled when it ends).
                self.conns.sent(route.conn);
                self.routes.insert(seq, route);
                self.submit(seq, message);
            }
            Recovery::Dropped => {}
        }
    }

    /// Carries out a message's end ([`Ended`]): its connection finished if it has nothing
    /// left to do, or its terminal event sent on — with a journal, once its outcome record is
    /// durable: an outcome a bridge has seen must survive a crash, or recovery would answer
    /// the message again differently (`interrupted by restart`).
    fn end(&mut self, ended: Ended) {
        let t = match ended {
            Ended::Kept(conn) => return self.delivery().finish_if_done(conn),
            Ended::Terminal(t) => t,
        };
        self.actions.extend(t.files);
        let frame = Frame::new(t.body, Some(t.platform.clone())).of_message(t.seq, t.id);
        match &mut self.durable {
            None => self.deliver_terminal(t.conn, &t.platform, frame),
            Some(d) => (self.actions).push_back(d.hold_outcome(t.seq, t.conn, frame, t.memory)),
        }
    }

    /// A terminal event, stamped for the cluster, to the delivery room
    /// ([`Delivery::deliver`]).
    fn deliver_terminal(&mut self, origin: ConnId, platform: &Arc<str>, frame: Frame) {
        let frame = self.cluster.stamp(frame);
        self.delivery().deliver(origin, platform, frame);
    }

    /// The delivery room over this bridge's connections and platforms, now.
    fn delivery(&mut self) -> Delivery<'_> {
        Delivery {
            cfg: &self.cfg,
            conns: &mut self.conns,
            platforms: &mut self.platforms,
            stats: &mut self.stats,
            actions: &mut self.actions,
            now: self.now,
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
                actions: &mut self.actions,
                now: self.now,
            },
        };
        let Some(effects) = step(&mut self.cluster, rooms) else {
            return false;
        };
        for effect in effects {
            match effect {
                Effect::Finish(conn) => self.delivery().finish_if_done(conn),
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
}

// A cluster member's entry points (`--cluster`), whose arguments are the cluster's types.
#[cfg(feature = "cluster")]
impl Bridge {
    /// What the stream reader brought (an outcome of a message acked here, a message of a
    /// partition owned here, a forward...: `ClusterSide::arrived`).
    pub fn arrived(&mut self, a: crate::cluster::Arrival, now: Duration) {
        self.now = now;
        self.cluster_step(|side, rooms| Some(side.arrived(a, rooms)));
        audit::check(self);
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
