//! The bridge's connections: each one's answer queue and output, what it wrote and what its
//! peer has confirmed, and the hello/auth bookkeeping (the token, the unauthenticated counts).
//! Nothing here knows platforms or routes; the bridge moves frames between them.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Write};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use super::super::frame::{Flushed, Frame, write_frames};
use super::refusal::Refusal;
use super::{BridgeConfig, ConnId};
use crate::auth::Token;
use crate::key::Slots;
use crate::liveness::LinkStatus;
use crate::logfmt::LogBudget;
use crate::logfmt::{WARN_BURST, WARN_PER_SEC};
use crate::message::SessionKey;
use crate::wire::{ClientOp, check_platform};

/// An answer to one line, in line order.
pub(super) enum Answer {
    Ready(Frame),
    /// Waits for the runtime's admission of `tag`; `copy` is a duplicate line's id and
    /// session (`None`: the line that was submitted).
    Pending {
        tag: u64,
        copy: Option<(Arc<str>, SessionKey)>,
    },
}

/// What a connection's line counts as ([`Conns::gate`]).
pub(super) enum Gate<T> {
    /// Nothing: the connection is gone or closing.
    Ignored,
    /// The connection failed to authenticate: answered `unauthorized`, and closing.
    Unauthorized,
    /// The line, to act on.
    Counts(T),
}

/// One client connection of the bridge protocol. Read outside this room, changed only by
/// [`Conns`].
pub(super) struct Client {
    pub(super) peer: IpAddr,
    pub(super) authed: bool,
    /// The platform of its hello.
    pub(super) platform: Option<Arc<str>>,
    /// What it last reported of its own connection to its platform (`link`).
    pub(super) link: Option<LinkStatus>,
    /// No further line counts; closed once its output is written.
    pub(super) closing: bool,
    /// The peer shut down its sending side.
    pub(super) read_closed: bool,
    pub(super) opened: Duration,
    answers: VecDeque<Answer>,
    out: VecDeque<Frame>,
    /// Bytes (as accounted by `Body::size`) of the ready answers and `out`.
    queued: usize,
    /// Messages it sent that have no terminal event yet.
    pub(super) outstanding: usize,
    /// Last time output was written, or output appeared on an idle connection.
    last_progress: Duration,
    /// Bytes written to the socket so far.
    written: u64,
    /// Results written to the socket but not yet acknowledged by the peer's TCP, with the
    /// byte offset their pass ended at; they keep their reservation and go back to the
    /// outbox if the connection dies first (a peer that closed answers with a reset, never
    /// an acknowledgement: this is also how a half-close is told from a close).
    unconfirmed: VecDeque<(u64, Frame)>,
    /// Its hello asked for `acks`: results written wait here for its `delivered`.
    acks: bool,
    /// Results written to an `acks` connection and not yet confirmed, in order.
    awaiting: VecDeque<Frame>,
    dirty: bool,
}

impl Client {
    fn new(peer: IpAddr, authed: bool, now: Duration) -> Client {
        Client {
            peer,
            authed,
            platform: None,
            link: None,
            closing: false,
            read_closed: false,
            opened: now,
            answers: VecDeque::new(),
            out: VecDeque::new(),
            queued: 0,
            outstanding: 0,
            last_progress: now,
            written: 0,
            unconfirmed: VecDeque::new(),
            acks: false,
            awaiting: VecDeque::new(),
            dirty: false,
        }
    }

    /// Nothing queued to write and no answer waiting.
    pub(super) fn idle(&self) -> bool {
        self.out.is_empty() && self.answers.is_empty()
    }

    /// It has output (or unacknowledged results) and took none of it since `now - timeout`.
    pub(super) fn stalled(&self, now: Duration, timeout: Duration) -> bool {
        (!self.idle() || !self.unconfirmed.is_empty()) && now >= self.last_progress + timeout
    }

    /// Nothing is left to deliver to it: idle, nothing outstanding, every result confirmed.
    pub(super) fn drained(&self) -> bool {
        self.idle()
            && self.outstanding == 0
            && self.unconfirmed.is_empty()
            && self.awaiting.is_empty()
    }

    /// Every terminal event it holds (queued, written and unconfirmed, awaiting `delivered`).
    fn terminals(&self) -> impl Iterator<Item = &Frame> {
        let ready = self.answers.iter().filter_map(|a| match a {
            Answer::Ready(f) => Some(f),
            Answer::Pending { .. } => None,
        });
        self.unconfirmed
            .iter()
            .map(|(_, f)| f)
            .chain(self.awaiting.iter())
            .chain(self.out.iter())
            .chain(ready)
            .filter(|f| f.terminal_for.is_some())
    }

    /// Its undelivered terminal events, in order, ready to be written again elsewhere: what
    /// an `acks` bridge was sent but did not confirm is marked a redelivery (it may have it),
    /// and so is every result of a message placed in Redis (`--cluster`: while it waited
    /// here, its outcome may have gone out from another copy and been confirmed, its
    /// partition's owner or this instance's rebuild of the partition sending it; e.g. a
    /// connection gone quiet, closed for its stalled write long after: tests/
    /// simulation_cluster, seed 11).
    fn into_undelivered(mut self) -> Vec<Frame> {
        let mut rescued: Vec<Frame> = self
            .awaiting
            .drain(..)
            .map(|mut f| {
                f.mark_redelivery();
                f
            })
            .collect();
        rescued.extend(self.unconfirmed.drain(..).map(|(_, f)| f));
        rescued.extend(self.out.drain(..).filter(|f| f.terminal_for.is_some()));
        rescued.extend(self.answers.drain(..).filter_map(|a| match a {
            Answer::Ready(f) if f.terminal_for.is_some() => Some(f),
            _ => None,
        }));
        for f in &mut rescued {
            // A result another instance could be forwarded (it has a cluster tag) may have
            // reached the platform from there.
            if f.cluster != 0 {
                f.mark_redelivery();
            }
            f.rewind();
        }
        rescued
    }
}

/// What is left of a connection once it is forgotten.
pub(super) struct Gone {
    pub(super) peer: IpAddr,
    /// The platform of its hello.
    pub(super) platform: Option<Arc<str>>,
    /// Its undelivered terminal events, in order, for their outboxes.
    pub(super) undelivered: Vec<Frame>,
}

/// The connections and their hello bookkeeping.
pub(super) struct Conns {
    slots: Slots<Client>,
    /// Required in a hello when set (kept as a digest).
    token: Option<Token>,
    unauthenticated: usize,
    /// Connections waiting for their hello by their peer's prefix ([`peer_prefix`]).
    unauth_by_peer: HashMap<IpAddr, usize>,
    /// Refusals, evictions and missed hellos a peer can cause at will: one budget for them
    /// all, so that no client floods the log.
    refusal_log: LogBudget,
    /// Connections whose output changed since the shell last asked.
    dirty: Vec<ConnId>,
    max_write_buffer: usize,
}

impl Conns {
    pub(super) fn new(cfg: &BridgeConfig) -> Conns {
        Conns {
            slots: Slots::new(),
            token: cfg.auth_token.as_deref().map(Token::new),
            unauthenticated: 0,
            unauth_by_peer: HashMap::new(),
            refusal_log: LogBudget::new(WARN_BURST, WARN_PER_SEC),
            dirty: Vec::new(),
            max_write_buffer: cfg.max_write_buffer,
        }
    }

    /// Replaces the token (see `Bridge::set_auth_token`); false when refused.
    pub(super) fn set_token(&mut self, token: Option<&str>) -> bool {
        match (token, self.token.is_some()) {
            (Some(t), true) => {
                self.token = Some(Token::new(t));
                true
            }
            (None, false) => true,
            _ => false,
        }
    }

    /// A hello must carry the token.
    pub(super) fn token_required(&self) -> bool {
        self.token.is_some()
    }

    pub(super) fn token_matches(&self, guess: &str) -> bool {
        self.token.as_ref().is_some_and(|t| t.matches(guess))
    }

    /// Opens a connection from `peer`, or says which bound refuses it. Call
    /// [`Conns::victim_for`] first: at a cap on waiting connections, one of them makes room.
    pub(super) fn open(
        &mut self,
        peer: IpAddr,
        now: Duration,
        cfg: &BridgeConfig,
    ) -> Result<ConnId, String> {
        if self.slots.len() >= cfg.max_connections {
            return Err(format!("too many connections ({})", cfg.max_connections));
        }
        let authed = self.token.is_none();
        if !authed {
            if self.unauthenticated >= cfg.max_unauthenticated {
                return Err(format!(
                    "too many connections waiting for their hello ({})",
                    cfg.max_unauthenticated
                ));
            }
            let prefix = peer_prefix(peer);
            let from_peer = self.unauth_by_peer.get(&prefix).copied().unwrap_or(0);
            if from_peer >= cfg.max_unauthenticated_per_peer {
                return Err(format!(
                    "too many connections from {prefix}/{} waiting for their hello ({})",
                    prefix_len(prefix),
                    cfg.max_unauthenticated_per_peer
                ));
            }
            self.unauthenticated += 1;
            *self.unauth_by_peer.entry(prefix).or_insert(0) += 1;
        }
        Ok(self.slots.insert(Client::new(peer, authed, now)))
    }

    /// The waiting connection (no hello yet) to close so that one from `peer` fits, and the
    /// cap it makes room under; `None` when no cap on waiting connections is reached (or
    /// none waits). At `peer`'s prefix cap: that prefix's oldest. At the global cap (or the
    /// connection cap): the oldest of the prefix holding the most waiting connections, so a
    /// client spread over many addresses evicts its own connections before a bridge's, and
    /// a bridge re-connecting is evicted only by as many newer ones as the cap holds.
    pub(super) fn victim_for(
        &self,
        peer: IpAddr,
        cfg: &BridgeConfig,
    ) -> Option<(ConnId, &'static str)> {
        if self.token.is_none() || self.unauthenticated == 0 {
            return None;
        }
        let prefix = peer_prefix(peer);
        let of_prefix = self.unauth_by_peer.get(&prefix).copied().unwrap_or(0);
        // `Some(p)`: only prefix `p`; `None`: the prefixes holding the most.
        let (why, only) = if of_prefix >= cfg.max_unauthenticated_per_peer {
            ("its address prefix's cap", Some(prefix))
        } else if self.unauthenticated >= cfg.max_unauthenticated
            || self.slots.len() >= cfg.max_connections
        {
            ("the cap on waiting connections", None)
        } else {
            return None;
        };
        let most = self.unauth_by_peer.values().copied().max().unwrap_or(0);
        let eligible = |p: IpAddr| match only {
            Some(only) => p == only,
            None => self.unauth_by_peer.get(&p) == Some(&most),
        };
        self.slots
            .iter()
            .filter(|(_, c)| !c.authed && eligible(peer_prefix(c.peer)))
            .min_by_key(|(id, c)| (c.opened, id.to_bits()))
            .map(|(id, _)| (id, why))
    }

    /// What a line `parsed` from `id` counts as under the hello rules (isolation): nothing
    /// from a connection that is gone or closing; before a hello that authenticates, only a
    /// hello carrying the token; after it, a hello must carry the token again if one is set.
    pub(super) fn gate<T>(
        &self,
        id: ConnId,
        parsed: Result<ClientOp, T>,
    ) -> Gate<Result<ClientOp, T>> {
        let Some(conn) = self.get(id) else {
            return Gate::Ignored;
        };
        if conn.closing {
            return Gate::Ignored;
        }
        let hello_token = match &parsed {
            Ok(ClientOp::Hello { token, .. }) => Some(token.as_deref()),
            _ => None,
        };
        let authorized = match hello_token {
            None => conn.authed,
            Some(Some(t)) if !conn.authed => self.token_matches(t),
            Some(None) if !conn.authed => false,
            Some(token) => !self.token_required() || token.is_some_and(|t| self.token_matches(t)),
        };
        if authorized {
            Gate::Counts(parsed)
        } else {
            Gate::Unauthorized
        }
    }

    /// Whether a line about a refusal a peer caused may be logged now: `Some(n)`, with the
    /// `n` such lines suppressed before it.
    pub(super) fn refusal_log(&mut self) -> Option<u64> {
        self.refusal_log.allow(std::time::Instant::now())
    }

    /// Connections that did not say hello within `timeout` of opening, each logged (rate
    /// limited: a peer causes it): the bridge answers them with an error and closes them.
    pub(super) fn late_hellos(&mut self, now: Duration, timeout: Duration) -> Vec<ConnId> {
        let late: Vec<(ConnId, IpAddr)> = (self.slots.iter())
            .filter(|(_, c)| !c.authed && !c.closing && now >= c.opened + timeout)
            .map(|(id, c)| (id, c.peer))
            .collect();
        for &(id, peer) in &late {
            if let Some(n) = self.refusal_log() {
                let more = crate::logfmt::suppressed_note(n);
                log::warn!(
                    "connection {id} from {peer}: no hello within {timeout:?}; closing{more}"
                );
            }
        }
        late.into_iter().map(|(id, _)| id).collect()
    }

    /// Connections that took none of their output for `timeout`, each logged: the bridge
    /// closes them (their results go back to the outbox).
    pub(super) fn stalled_for(&self, now: Duration, timeout: Duration) -> Vec<ConnId> {
        let stalled: Vec<ConnId> = (self.slots.iter())
            .filter(|(_, c)| c.stalled(now, timeout))
            .map(|(id, _)| id)
            .collect();
        for &id in &stalled {
            if let Some(c) = self.get(id) {
                log::warn!(
                    "connection {} from {}: took no output for {:?}; closing (its results go back to the outbox)",
                    id,
                    c.peer,
                    timeout
                );
            }
        }
        stalled
    }

    /// The platform a message from `id` is for (`None`: no such connection): the one its
    /// line names, else its hello's; with a token, only its hello's.
    pub(super) fn sender_platform(
        &self,
        id: ConnId,
        named: Option<&str>,
    ) -> Result<Option<String>, Refusal> {
        let Some(c) = self.get(id) else {
            return Ok(None);
        };
        let hello = c.platform.as_deref();
        let Some(name) = named.or(hello) else {
            return Err(Refusal::no_platform());
        };
        if self.token_required() && hello != Some(name) {
            return Err(Refusal::not_its_platform(hello));
        }
        check_platform(name).map_err(Refusal::invalid)?;
        Ok(Some(name.to_owned()))
    }

    /// Forgets a connection; what the bridge still needs of it.
    pub(super) fn remove(&mut self, id: ConnId) -> Option<Gone> {
        let mut conn = self.slots.remove(id)?;
        if !conn.authed {
            self.count_authenticated(conn.peer);
        }
        Some(Gone {
            peer: conn.peer,
            platform: conn.platform.take(),
            undelivered: conn.into_undelivered(),
        })
    }

    /// `id` said a valid hello: it counts as authenticated from now on.
    pub(super) fn authenticate(&mut self, id: ConnId) {
        let Some(conn) = self.slots.get_mut(id) else {
            return;
        };
        if !std::mem::replace(&mut conn.authed, true) {
            let peer = conn.peer;
            self.count_authenticated(peer);
        }
    }

    fn count_authenticated(&mut self, peer: IpAddr) {
        debug_assert!(self.unauthenticated > 0);
        self.unauthenticated -= 1;
        let prefix = peer_prefix(peer);
        if let Some(n) = self.unauth_by_peer.get_mut(&prefix) {
            debug_assert!(*n > 0);
            *n -= 1;
            if *n == 0 {
                self.unauth_by_peer.remove(&prefix);
            }
        }
    }

    /// Sets whether `id`'s results wait for its `delivered`; switching acks off returns what
    /// waited, now delivered as it would have been without acks (its TCP has taken it).
    pub(super) fn set_acks(&mut self, id: ConnId, acks: bool) -> Vec<Frame> {
        let Some(conn) = self.slots.get_mut(id) else {
            return Vec::new();
        };
        let released = if acks != conn.acks {
            conn.awaiting.drain(..).collect()
        } else {
            Vec::new()
        };
        conn.acks = acks;
        released
    }

    /// `id` sent a message that is now in flight.
    pub(super) fn sent(&mut self, id: ConnId) {
        if let Some(c) = self.slots.get_mut(id) {
            c.outstanding += 1;
        }
    }

    /// A message `id` sent is no longer in flight (finished, refused or abandoned).
    pub(super) fn settled(&mut self, id: ConnId) {
        if let Some(c) = self.slots.get_mut(id) {
            c.outstanding -= 1;
        }
    }

    /// No further line of `id` counts; the platform of its hello, which it leaves.
    pub(super) fn set_closing(&mut self, id: ConnId) -> Option<Arc<str>> {
        let conn = self.slots.get_mut(id)?;
        conn.closing = true;
        let platform = conn.platform.take();
        self.mark_dirty(id);
        platform
    }

    /// The peer of `id` shut down its sending side; the platform of its hello, which it
    /// leaves (it reads its own events still, but no longer takes the platform's backlog).
    pub(super) fn half_close(&mut self, id: ConnId) -> Option<Arc<str>> {
        let conn = self.slots.get_mut(id)?;
        conn.read_closed = true;
        log::debug!(
            "connection {} from {}: peer half-closed; {} message(s) outstanding",
            id,
            conn.peer,
            conn.outstanding
        );
        conn.platform.take()
    }

    /// `id` said hello for `platform` (or none); the platform it said hello for before.
    pub(super) fn set_platform(
        &mut self,
        id: ConnId,
        platform: Option<Arc<str>>,
    ) -> Option<Arc<str>> {
        let conn = self.slots.get_mut(id)?;
        std::mem::replace(&mut conn.platform, platform)
    }

    /// `id`'s report of its platform connection; refused before a hello with a platform.
    pub(super) fn set_link(&mut self, id: ConnId, link: LinkStatus) -> Result<(), &'static str> {
        let conn = self.slots.get_mut(id).ok_or("no such connection")?;
        if conn.platform.is_none() {
            return Err("link: say hello with a platform first");
        }
        conn.link = Some(link);
        Ok(())
    }

    /// The newest report of each platform's connections that reported (the most recently
    /// opened connection's, when several did).
    pub(super) fn links(&self) -> HashMap<&str, &LinkStatus> {
        let mut by_platform: HashMap<&str, (Duration, &LinkStatus)> = HashMap::new();
        for (_, c) in self.slots.iter() {
            if let (Some(p), Some(link)) = (c.platform.as_deref(), c.link.as_ref()) {
                let newer = by_platform.get(p).is_none_or(|(at, _)| c.opened >= *at);
                if newer {
                    by_platform.insert(p, (c.opened, link));
                }
            }
        }
        by_platform.into_iter().map(|(p, (_, l))| (p, l)).collect()
    }

    pub(super) fn get(&self, id: ConnId) -> Option<&Client> {
        self.slots.get(id)
    }

    pub(super) fn len(&self) -> usize {
        self.slots.len()
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (ConnId, &Client)> + '_ {
        self.slots.iter()
    }

    pub(super) fn unauthenticated(&self) -> usize {
        self.unauthenticated
    }

    /// Open, not closing, and under its output bound: best-effort lines may go to it.
    pub(super) fn has_room(&self, id: ConnId) -> bool {
        self.slots
            .get(id)
            .is_some_and(|c| !c.closing && c.queued < self.max_write_buffer)
    }

    /// Under its output bound (closing or not).
    pub(super) fn under_bound(&self, id: ConnId) -> bool {
        self.slots
            .get(id)
            .is_some_and(|c| c.queued < self.max_write_buffer)
    }

    /// Open and not closing.
    pub(super) fn is_open(&self, id: ConnId) -> bool {
        self.slots.get(id).is_some_and(|c| !c.closing)
    }

    pub(super) fn wants_read(&self, id: ConnId) -> bool {
        self.slots
            .get(id)
            .is_some_and(|c| !c.closing && !c.read_closed && c.queued < self.max_write_buffer)
    }

    pub(super) fn has_output(&self, id: ConnId) -> bool {
        self.slots.get(id).is_some_and(|c| !c.out.is_empty())
    }

    pub(super) fn written(&self, id: ConnId) -> u64 {
        self.slots.get(id).map_or(0, |c| c.written)
    }

    pub(super) fn awaiting_ack(&self) -> Vec<ConnId> {
        self.slots
            .iter()
            .filter(|(_, c)| !c.unconfirmed.is_empty())
            .map(|(id, _)| id)
            .collect()
    }

    /// Results written to `acks` connections and not yet confirmed.
    pub(super) fn awaiting_delivery(&self) -> usize {
        self.slots.iter().map(|(_, c)| c.awaiting.len()).sum()
    }

    /// Queues a frame behind the connection's earlier answers.
    pub(super) fn push(&mut self, id: ConnId, frame: Frame, now: Duration) {
        self.push_answer(id, Answer::Ready(frame), now);
    }

    pub(super) fn push_answer(&mut self, id: ConnId, answer: Answer, now: Duration) {
        let Some(conn) = self.slots.get_mut(id) else {
            return;
        };
        if conn.idle() {
            // The stall clock starts when output appears, not when the connection last wrote.
            conn.last_progress = now;
        }
        match answer {
            Answer::Ready(frame) => {
                conn.queued += frame.body.size();
                if conn.answers.is_empty() {
                    conn.out.push_back(frame);
                } else {
                    conn.answers.push_back(Answer::Ready(frame));
                }
            }
            pending => conn.answers.push_back(pending),
        }
        self.mark_dirty(id);
    }

    /// Fills `id`'s answers waiting for `tag`, then releases the ready ones in order.
    pub(super) fn resolve(
        &mut self,
        id: ConnId,
        tag: u64,
        mut line: impl FnMut(Option<(&str, &SessionKey)>) -> Vec<u8>,
    ) {
        let Some(conn) = self.slots.get_mut(id) else {
            return;
        };
        for a in conn.answers.iter_mut() {
            if let Answer::Pending { tag: t, copy } = a
                && *t == tag
            {
                let bytes = line(copy.as_ref().map(|(i, k)| (&**i, k)));
                conn.queued += bytes.len();
                *a = Answer::Ready(Frame::line(bytes));
            }
        }
        while let Some(Answer::Ready(_)) = conn.answers.front() {
            if let Some(Answer::Ready(f)) = conn.answers.pop_front() {
                conn.out.push_back(f);
            }
        }
        self.mark_dirty(id);
    }

    /// Takes backlog frames from `next` while `id`'s output is under its bound; whether any
    /// moved.
    pub(super) fn fill(
        &mut self,
        id: ConnId,
        now: Duration,
        mut next: impl FnMut() -> Option<Frame>,
    ) -> bool {
        let Some(conn) = self.slots.get_mut(id) else {
            return false;
        };
        let mut moved = false;
        while conn.queued < self.max_write_buffer {
            let Some(frame) = next() else {
                break;
            };
            if conn.idle() {
                conn.last_progress = now;
            }
            conn.queued += frame.body.size();
            if conn.answers.is_empty() {
                conn.out.push_back(frame);
            } else {
                conn.answers.push_back(Answer::Ready(frame));
            }
            moved = true;
        }
        if moved {
            self.mark_dirty(id);
        }
        moved
    }

    /// Writes `id`'s queued output into `w`, at most `budget` bytes; the bytes written and
    /// how far it got. Written results start waiting for their confirmation.
    pub(super) fn write_out<W: Write + ?Sized>(
        &mut self,
        id: ConnId,
        w: &mut W,
        budget: usize,
        now: Duration,
    ) -> io::Result<(usize, Flushed)> {
        let Some(conn) = self.slots.get_mut(id) else {
            return Ok((0, Flushed::All));
        };
        let queued = &mut conn.queued;
        let (unconfirmed, before) = (&mut conn.unconfirmed, conn.written);
        let (acks, awaiting) = (conn.acks, &mut conn.awaiting);
        let (n, how) = write_frames(&mut conn.out, w, budget, |f, at| {
            *queued -= f.body.size();
            if f.terminal_for.is_some() {
                if acks {
                    // Delivered once the bridge says so.
                    awaiting.push_back(f);
                } else {
                    // Delivered once the peer's TCP acknowledges its last byte.
                    unconfirmed.push_back((before + at as u64, f));
                }
            }
        })?;
        if n > 0 {
            conn.last_progress = now;
        }
        conn.written += n as u64;
        Ok((n, how))
    }

    /// The results the peer's TCP has acknowledged (its first `acked` bytes): delivered.
    pub(super) fn acked(&mut self, id: ConnId, acked: u64, now: Duration) -> Vec<Frame> {
        let Some(conn) = self.slots.get_mut(id) else {
            return Vec::new();
        };
        debug_assert!(acked <= conn.written);
        let mut done = Vec::new();
        while conn
            .unconfirmed
            .front()
            .is_some_and(|(end, _)| *end <= acked)
        {
            if let Some((_, f)) = conn.unconfirmed.pop_front() {
                done.push(f);
            }
        }
        if !done.is_empty() {
            conn.last_progress = now;
        }
        done
    }

    /// The results an `acks` connection confirmed with `delivered` (by message id).
    pub(super) fn delivered(&mut self, id: ConnId, ids: &[String], now: Duration) -> Vec<Frame> {
        let Some(conn) = self.slots.get_mut(id) else {
            return Vec::new();
        };
        let mut done = Vec::new();
        for mid in ids {
            if let Some(i) = conn
                .awaiting
                .iter()
                .position(|f| f.msg_id.as_deref() == Some(mid.as_str()))
                && let Some(f) = conn.awaiting.remove(i)
            {
                done.push(f);
            }
        }
        if !done.is_empty() {
            conn.last_progress = now;
        }
        done
    }

    pub(super) fn mark_dirty(&mut self, id: ConnId) {
        if let Some(c) = self.slots.get_mut(id)
            && !c.dirty
        {
            c.dirty = true;
            self.dirty.push(id);
        }
    }

    /// `id` has had its write turn this wake: only new output marks it again.
    pub(super) fn clear_dirty(&mut self, id: ConnId) {
        if let Some(c) = self.slots.get_mut(id) {
            c.dirty = false;
        }
    }

    pub(super) fn take_dirty(&mut self) -> Vec<ConnId> {
        let mut dirty = std::mem::take(&mut self.dirty);
        // A connection written since it was marked (its flag cleared) has had its turn.
        dirty.retain(|id| {
            self.slots
                .get_mut(*id)
                .is_some_and(|c| std::mem::replace(&mut c.dirty, false))
        });
        dirty
    }

    /// The terminal events the connections hold (queued, or written and not yet
    /// confirmed).
    pub(super) fn terminals(&self) -> impl Iterator<Item = &Frame> {
        self.slots.iter().flat_map(|(_, c)| c.terminals())
    }

    /// The platforms owed a reservation by the terminal events the connections hold.
    pub(super) fn terminals_by_platform(&self) -> impl Iterator<Item = &str> {
        self.terminals().filter_map(|f| f.terminal_for.as_deref())
    }

    /// Checks, in debug builds, this room's own counts: queued bytes, the unauthenticated
    /// totals, acks.
    pub(super) fn check(&self) {
        let mut unauth = 0;
        for (id, c) in &self.slots {
            unauth += usize::from(!c.authed);
            debug_assert!(c.acks || c.awaiting.is_empty());
            let ready = c.answers.iter().filter_map(|a| match a {
                Answer::Ready(f) => Some(f),
                Answer::Pending { .. } => None,
            });
            let queued: usize = c.out.iter().chain(ready).map(|f| f.body.size()).sum();
            debug_assert_eq!(queued, c.queued, "connection {} queued bytes", id);
        }
        debug_assert_eq!(unauth, self.unauthenticated);
        debug_assert_eq!(
            self.unauth_by_peer.values().sum::<usize>(),
            self.unauthenticated
        );
    }
}

/// The address prefix the per-peer cap on waiting connections counts by: an IPv4 /24, an
/// IPv6 /64 (what one host or one site is usually given, so that a client cannot multiply its
/// share by using its neighbouring addresses); an IPv4-mapped IPv6 address as its IPv4.
pub(super) fn peer_prefix(peer: IpAddr) -> IpAddr {
    match peer {
        IpAddr::V4(v4) => IpAddr::V4((u32::from(v4) & !0xff).into()),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => peer_prefix(IpAddr::V4(v4)),
            None => IpAddr::V6((u128::from(v6) & !((1u128 << 64) - 1)).into()),
        },
    }
}

/// The length of the prefixes [`peer_prefix`] makes, for messages.
fn prefix_len(prefix: IpAddr) -> u8 {
    if prefix.is_ipv4() { 24 } else { 64 }
}

#[cfg(test)]
mod prefix_tests {
    use super::peer_prefix;
    use std::net::IpAddr;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("an address")
    }

    #[test]
    fn the_per_peer_cap_counts_ipv4_by_24_and_ipv6_by_64() {
        assert_eq!(peer_prefix(ip("10.1.2.3")), ip("10.1.2.0"));
        assert_eq!(peer_prefix(ip("10.1.2.255")), ip("10.1.2.0"));
        assert_ne!(peer_prefix(ip("10.1.3.1")), peer_prefix(ip("10.1.2.1")));
        assert_eq!(
            peer_prefix(ip("2001:db8:1:2:aaaa::1")),
            ip("2001:db8:1:2::")
        );
        assert_ne!(peer_prefix(ip("2001:db8:1:3::1")), ip("2001:db8:1:2::"));
        assert_eq!(peer_prefix(ip("::ffff:10.1.2.3")), ip("10.1.2.0"));
    }
}
