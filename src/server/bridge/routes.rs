//! Where a result goes: each message in flight, by its tag, with the connection that sent it
//! (or none: recovered from the journal), and where each running turn's typing goes; and
//! the bridge's delivery of partials, typing and terminal events (to the message's
//! connection, else its platform's outbox).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use super::super::dedup::Fingerprint;
use super::super::frame::Frame;
use super::super::sharded::Sharded;
use super::{Bridge, ConnId};
use crate::core::{Outcome, TurnId};
use crate::journal::Record;
use crate::key::Key;
use crate::message::SessionKey;
use crate::wire::{EncodedLine as Body, ServerOp, encode};

/// The route of a message recovered from the journal: no connection (its events go to its
/// platform's outbox). No slot ever gets this key.
pub(super) fn no_conn() -> ConnId {
    Key::from_bits(u64::MAX)
}

/// Where a message in flight is: its phase, which says which other room holds it too (the
/// bridge's `audit` checks that they agree).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    /// Waiting for its `accepted` record to be durable before it is submitted (the message
    /// waits in `Durable`; acknowledged only once durable).
    Journaling,
    /// In the runtime: queued, or its turn running (with a journal, each turn held until its
    /// `started` record is durable); recovered ones are submitted again in this phase.
    Submitted,
    /// `--cluster`: durable and acked here, its partition owned elsewhere (or handed over):
    /// waiting for the owner's outcome from the stream (`ClusterSide`'s remote index, by
    /// the cluster tag).
    Remote,
}

/// A message in flight: submitted (or waiting for the journal, or for another instance)
/// and without its terminal event yet.
pub(super) struct InFlight {
    /// Its phase.
    pub(super) phase: Phase,
    /// The connection that sent it, which gets its events while it is open.
    pub(super) conn: ConnId,
    pub(super) id: Arc<str>,
    pub(super) session: SessionKey,
    pub(super) platform: Arc<str>,
    pub(super) fp: Fingerprint,
    /// Connections holding a duplicate of this message awaiting its admission.
    pub(super) copies: Vec<ConnId>,
    /// Times its turn started (carried over from before a restart).
    pub(super) starts: u32,
    /// Recovered from the journal: its acknowledgement was sent by an earlier process.
    pub(super) recovered: bool,
}

impl InFlight {
    /// A message a connection just sent.
    pub(super) fn new(
        conn: ConnId,
        id: Arc<str>,
        session: SessionKey,
        platform: Arc<str>,
        fp: Fingerprint,
    ) -> InFlight {
        InFlight {
            phase: Phase::Submitted,
            conn,
            id,
            session,
            platform,
            fp,
            copies: Vec::new(),
            starts: 0,
            recovered: false,
        }
    }
}

/// Where a running turn's typing lines go, and when next.
pub(super) struct Typing {
    pub(super) conn: ConnId,
    pub(super) session: SessionKey,
    next: Duration,
}

/// Messages in flight by tag (the journal's sequence number too), and typing by turn.
#[derive(Default)]
pub(super) struct Routes {
    map: Sharded<InFlight>,
    /// The last tag handed out (recovery raises it past the journal's).
    last_tag: u64,
    typing: HashMap<TurnId, Typing>,
}

impl Routes {
    /// A tag never used before.
    pub(super) fn new_tag(&mut self) -> u64 {
        self.last_tag += 1;
        self.last_tag
    }

    /// Tags from now on come after `seq` (the journal's highest).
    pub(super) fn tags_after(&mut self, seq: u64) {
        self.last_tag = self.last_tag.max(seq);
    }

    pub(super) fn insert(&mut self, tag: u64, route: InFlight) {
        debug_assert!(tag <= self.last_tag || tag >> 63 == 1);
        self.map.insert(tag, route);
    }

    pub(super) fn get(&self, tag: u64) -> Option<&InFlight> {
        self.map.get(&tag)
    }

    pub(super) fn get_mut(&mut self, tag: u64) -> Option<&mut InFlight> {
        self.map.get_mut(&tag)
    }

    pub(super) fn remove(&mut self, tag: u64) -> Option<InFlight> {
        self.map.remove(&tag)
    }

    pub(super) fn contains(&self, tag: u64) -> bool {
        self.map.contains_key(&tag)
    }

    /// Every message in flight, in tag order (forced exit).
    pub(super) fn drain_in_order(&mut self) -> Vec<(u64, InFlight)> {
        let mut routes = self.map.drain();
        routes.sort_unstable_by_key(|(tag, _)| *tag);
        routes
    }

    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    /// The messages in flight, with their tags.
    pub(super) fn tags(&self) -> impl Iterator<Item = (u64, &InFlight)> {
        self.map.iter()
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &InFlight> {
        self.map.values()
    }

    /// A turn started: its typing goes to `conn` until it ends, refreshed at `next`.
    pub(super) fn typing_started(
        &mut self,
        turn: TurnId,
        conn: ConnId,
        session: SessionKey,
        next: Duration,
    ) {
        self.typing.insert(
            turn,
            Typing {
                conn,
                session,
                next,
            },
        );
    }

    /// A turn ended: where its last typing line goes.
    pub(super) fn typing_ended(&mut self, turn: TurnId) -> Option<Typing> {
        self.typing.remove(&turn)
    }

    /// The typing lines due at `now`; each is due again `refresh` later.
    pub(super) fn typing_due(
        &mut self,
        now: Duration,
        refresh: Duration,
    ) -> Vec<(ConnId, SessionKey)> {
        self.typing
            .values_mut()
            .filter(|t| t.next <= now)
            .map(|t| {
                t.next = now + refresh;
                (t.conn, t.session.clone())
            })
            .collect()
    }

    /// Checks, in debug builds, that no tag in flight is ahead of the tags handed out, that
    /// a message not recovered has the connection that sent it, and that only such a message
    /// has copies (a recovered one has no connection, but for one a cluster member waited
    /// for and rebuilt, which keeps its sender's).
    pub(super) fn check(&self) {
        for (tag, r) in self.tags() {
            // A cluster tag (the top bit) comes from another instance's accept.
            debug_assert!(
                tag <= self.last_tag || tag >> 63 == 1,
                "tag {tag} was never handed out"
            );
            debug_assert!(r.recovered || r.conn != no_conn(), "tag {tag}: no sender");
            debug_assert!(!r.recovered || r.copies.is_empty());
        }
    }
}

impl Bridge {
    /// A partial reply goes to the message's connection if it has room; else it is dropped.
    pub(super) fn partial(&mut self, tag: u64, id: &str, session: &SessionKey, text: String) {
        let target = self.routes.get(tag).map(|r| r.conn);
        let Some(conn) = target.filter(|&c| self.conns.has_room(c)) else {
            self.stats.partials_dropped += 1;
            return;
        };
        let mut text = text;
        crate::text::truncate(&mut text, self.cfg.max_reply_bytes);
        let body = Body::with_text("partial", id, session.as_str(), "text", text, "");
        self.conns.push(conn, Frame::new(body, None), self.now);
    }

    /// The message of `tag` finished: its terminal event goes out.
    pub(super) fn finished(&mut self, tag: u64, id: &str, session: &SessionKey, outcome: Outcome) {
        let Some(route) = self.routes.remove(tag) else {
            return;
        };
        self.conns.settled(route.conn);
        if self.durable.is_some() && outcome == Outcome::Cancelled(crate::CancelReason::Shutdown) {
            return self.keep_for_restart(route);
        }
        let body = terminal_body(id, session.as_str(), outcome, self.cfg.max_reply_bytes);
        self.terminal(tag, route.conn, &route.platform, route.id, body);
    }

    /// A recovered message the runtime would not take back fails with `why`.
    pub(super) fn finish_recovered(&mut self, tag: u64, why: &str) {
        let Some(route) = self.routes.remove(tag) else {
            return;
        };
        log::warn!("session {}: message {} {why}", route.session, route.id);
        let mut text = why.to_string();
        crate::text::truncate(&mut text, self.cfg.max_reply_bytes);
        let session = route.session.as_str();
        let body = Body::with_text("failed", &route.id, session, "error", text, "");
        self.terminal(tag, route.conn, &route.platform, route.id.clone(), body);
    }

    /// Sends a terminal event on — with a journal, once its outcome record is durable: an
    /// outcome a bridge has seen must survive a crash, or recovery would answer the message
    /// again differently (`interrupted by restart`).
    pub(super) fn terminal(
        &mut self,
        seq: u64,
        conn: ConnId,
        platform: &Arc<str>,
        id: Arc<str>,
        body: Body,
    ) {
        let frame = Frame::new(body, Some(platform.clone())).of_message(seq, id);
        match &mut self.durable {
            None => self.deliver_terminal(conn, platform, frame),
            Some(d) => self.actions.push_back(d.hold_outcome(seq, conn, frame)),
        }
    }

    /// Sends a terminal event to the message's connection, else its platform's outbox —
    /// once it fits the platform's `--outbox-bytes`: until then it is held, in order
    /// (its bytes are charged when it goes, released by `confirm`).
    pub(super) fn deliver_terminal(&mut self, origin: ConnId, platform: &Arc<str>, frame: Frame) {
        let frame = self.stamp_cluster(frame);
        if let Some((origin, frame)) = self.platforms.admit_result(platform, origin, frame) {
            self.send_result(origin, platform, frame);
        }
    }

    /// A charged result goes to its connection while that is open, else to the outbox.
    fn send_result(&mut self, origin: ConnId, platform: &Arc<str>, frame: Frame) {
        if self.conns.is_open(origin) {
            return self.conns.push(origin, frame, self.now);
        }
        self.platforms.push_outbox(platform, frame);
        self.refill_newest(platform);
    }

    /// Room freed on `platform`: the held results that now fit go, in order.
    pub(super) fn release_held(&mut self, platform: &Arc<str>) {
        for (origin, frame) in self.platforms.release_held(platform) {
            self.send_result(origin, platform, frame);
        }
    }

    /// Housekeeping: results owed to platforms absent past `--outbox-stale-after`, beyond
    /// the newest `--outbox-stale-keep`, are dropped — each with a WARN naming its session
    /// and message, counted in the status, and out of the journal — and their room goes to
    /// what is held.
    pub(super) fn drop_stale(&mut self, now: Duration) {
        let dropped = self.platforms.drop_stale(now);
        let mut touched: Vec<Arc<str>> = Vec::new();
        for (platform, f) in dropped {
            let id = f.msg_id.as_deref().unwrap_or("?");
            log::warn!(
                "session {}: message {id}: result dropped undelivered: platform {platform} said no hello for {:?} (--outbox-stale-after) and is owed more than {} results (--outbox-stale-keep)",
                session_of(&f.body),
                self.cfg.outbox_stale_after,
                self.cfg.outbox_stale_keep,
            );
            self.stats.stale_dropped += 1;
            if f.seq != 0 {
                self.journal(|| Record::Delivered { seq: f.seq });
            }
            if !touched.contains(&platform) {
                touched.push(platform);
            }
        }
        for p in touched {
            self.release_held(&p);
            self.platforms.maybe_free(&p);
        }
    }

    /// A terminal event was delivered (confirmed by an `acks` bridge, or acknowledged by its
    /// TCP): its reservation is released and the message leaves the journal.
    pub(super) fn confirm(&mut self, f: Frame) {
        let Some(p) = f.terminal_for else {
            return;
        };
        if f.seq != 0 {
            self.journal(|| Record::Delivered { seq: f.seq });
        }
        self.platforms.unreserve(&p, Some(&f.body));
        self.release_held(&p);
        self.platforms.maybe_free(&p);
    }

    /// Whether `id` is the newest connection that said hello for its platform and that
    /// platform has a backlog.
    pub(super) fn backlog_for(&self, id: ConnId) -> bool {
        let Some(platform) = self.conns.get(id).and_then(|c| c.platform.as_deref()) else {
            return false;
        };
        self.platforms.newest_hello(platform) == Some(id) && self.platforms.has_backlog(platform)
    }

    /// Feeds `id` its platform's backlog while its queued output is under its bound, if it is
    /// the newest connection that said hello for it.
    pub(super) fn refill(&mut self, id: ConnId) {
        if !self.backlog_for(id) {
            return;
        }
        let Some(platform) = self.conns.get(id).and_then(|c| c.platform.clone()) else {
            return;
        };
        let platforms = &mut self.platforms;
        self.conns
            .fill(id, self.now, || platforms.pop_outbox(&platform));
    }

    /// Feeds the newest connection that said hello for `platform`, if any.
    pub(super) fn refill_newest(&mut self, platform: &str) {
        if let Some(newest) = self.platforms.newest_hello(platform) {
            self.refill(newest);
        }
    }

    /// A typing line for `session`: to `conn` while it is open, else to the platform's
    /// newest connection; dropped when that one's output is over its bound.
    pub(super) fn send_typing(&mut self, conn: ConnId, session: &SessionKey, on: bool) {
        let target = Some(conn)
            .filter(|&c| self.conns.is_open(c))
            .or_else(|| self.platforms.newest_hello(session.platform()))
            .filter(|&c| self.conns.under_bound(c));
        let Some(target) = target else {
            self.stats.typing_dropped += 1;
            return;
        };
        let line = encode(&ServerOp::Typing {
            session: session.as_str(),
            platform: session.platform(),
            chat_id: session.chat_id(),
            on,
        });
        self.conns.push(target, Frame::line(line), self.now);
    }
}

/// The session a terminal event names (for a WARN): its line, or its head closed off.
fn session_of(body: &Body) -> String {
    let line: Vec<u8> = match body {
        Body::Line(l) => l.clone(),
        Body::Text { head, .. } => [head.as_slice(), b"\"}"].concat(),
    };
    serde_json::from_slice::<serde_json::Value>(&line)
        .ok()
        .and_then(|v| v.get("session")?.as_str().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

/// The terminal event of `outcome`, its text cut to `max` bytes.
fn terminal_body(id: &str, session: &str, outcome: Outcome, max: usize) -> Body {
    match outcome {
        Outcome::Reply(reply) => {
            let mut text = reply.text;
            let cut = crate::text::truncate(&mut text, max);
            let extra = if reply.truncated || cut {
                ",\"truncated\":true"
            } else {
                ""
            };
            Body::with_text("reply", id, session, "text", text, extra)
        }
        Outcome::Failed(e) => {
            let mut text = e.to_string();
            crate::text::truncate(&mut text, max);
            Body::with_text("failed", id, session, "error", text, "")
        }
        Outcome::Cancelled(r) => Body::Line(encode(&ServerOp::Cancelled {
            id,
            session,
            reason: r.as_str(),
        })),
        Outcome::Merged { into } => Body::Line(encode(&ServerOp::Merged {
            id,
            session,
            into: &into,
        })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> SessionKey {
        SessionKey::dm("telegram", "1").expect("key")
    }

    fn route(conn: ConnId) -> InFlight {
        InFlight::new(conn, "m".into(), key(), "telegram".into(), 7)
    }

    #[test]
    fn tags_are_new_and_recovery_raises_them() {
        let mut r = Routes::default();
        assert_eq!(r.new_tag(), 1);
        r.tags_after(10);
        assert_eq!(r.new_tag(), 11);
        r.tags_after(5);
        assert_eq!(r.new_tag(), 12);
        r.insert(12, route(Key::from_bits(0)));
        r.check();
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "never handed out")]
    fn check_catches_a_tag_never_handed_out() {
        let mut r = Routes::default();
        // Around `insert`'s own assertion, as a bug elsewhere would.
        r.map.insert(3, route(Key::from_bits(0)));
        r.check();
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "no sender")]
    fn check_catches_a_route_neither_recovered_nor_with_its_sender() {
        let mut r = Routes::default();
        let tag = r.new_tag();
        let mut flight = route(Key::from_bits(0));
        flight.conn = no_conn();
        r.insert(tag, flight);
        r.check();
    }

    #[test]
    fn typing_is_due_once_per_refresh() {
        let mut r = Routes::default();
        let turn = TurnId(1);
        let ms = Duration::from_millis;
        r.typing_started(turn, no_conn(), key(), ms(10));
        assert!(r.typing_due(ms(5), ms(100)).is_empty());
        assert_eq!(r.typing_due(ms(10), ms(100)).len(), 1);
        assert!(r.typing_due(ms(50), ms(100)).is_empty());
        assert!(r.typing_ended(turn).is_some());
        assert!(r.typing_due(ms(500), ms(100)).is_empty());
    }
}
