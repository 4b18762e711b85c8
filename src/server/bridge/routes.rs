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
use super::delivery::{Delivery, terminal_line};
use super::{Action, Bridge, ConnId};
use crate::core::{Outcome, TurnId};
use crate::journal::{MemoryUpdate, Record};
use crate::key::Key;
use crate::message::SessionKey;
use crate::wire::EncodedLine;

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
    /// The runtime refused it and, with a journal, its `forget` record is not durable yet
    /// (its refusal waits in `Durable`, answered once the record is written).
    Refusing,
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
    /// Its files in the spool, deleted once its route ends (issue 36).
    pub(super) files: Option<Arc<Vec<crate::Attachment>>>,
    /// Whose token budget its turn spends (the access policy's, once submitted).
    pub(super) charge: Option<crate::access::Charge>,
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
            files: None,
            charge: None,
        }
    }
}

impl InFlight {
    /// Its route ended (its terminal event exists): the action that deletes its files.
    pub(super) fn release_files(&self) -> Option<Action> {
        files_released(self.files.as_deref())
    }
}

/// The action that deletes these files from the spool, on the shell's janitor thread (none
/// without files): a message's route ended. A refused message's files stay (its bridge may
/// send it again); what a crash left is swept at the next start.
pub(super) fn files_released(files: Option<&Vec<crate::Attachment>>) -> Option<Action> {
    let paths: Vec<String> = files
        .into_iter()
        .flatten()
        .filter_map(|a| a.path.clone())
        .collect();
    (!paths.is_empty()).then_some(Action::ReleaseFiles(paths))
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
    /// The message of `tag` finished: its terminal event goes out.
    pub(super) fn finished(
        &mut self,
        tag: u64,
        id: &str,
        session: &SessionKey,
        mut outcome: Outcome,
    ) {
        let Some(mut route) = self.routes.remove(tag) else {
            return;
        };
        self.access.charge(route.charge.take(), &outcome, self.now);
        self.conns.settled(route.conn);
        if outcome == Outcome::Cancelled(crate::CancelReason::Shutdown)
            && let Some(d) = &mut self.durable
        {
            let conn = d.keep_for_restart(route, &mut self.platforms);
            return self.maybe_finish(conn);
        }
        let memory = match &mut outcome {
            Outcome::Reply(reply) => reply.take_memory(),
            _ => None,
        };
        self.actions.extend(route.release_files());
        let body = terminal_line(id, session.as_str(), outcome, self.cfg.max_reply_bytes);
        self.terminal(tag, route.conn, &route.platform, route.id, body, memory);
    }

    /// Sends a terminal event on — with a journal, once its outcome record is durable: an
    /// outcome a bridge has seen must survive a crash, or recovery would answer the message
    /// again differently (`interrupted by restart`). `memory`, the change to the session's
    /// stored conversation, commits with the outcome record (dropped without a journal).
    pub(super) fn terminal(
        &mut self,
        seq: u64,
        conn: ConnId,
        platform: &Arc<str>,
        id: Arc<str>,
        body: EncodedLine,
        memory: Option<MemoryUpdate>,
    ) {
        let frame = Frame::new(body, Some(platform.clone())).of_message(seq, id);
        match &mut self.durable {
            None => self.deliver_terminal(conn, platform, frame),
            Some(d) => self
                .actions
                .push_back(d.hold_outcome(seq, conn, frame, memory)),
        }
    }

    /// A terminal event, stamped for the cluster, to the delivery room
    /// ([`Delivery::deliver`]).
    pub(super) fn deliver_terminal(&mut self, origin: ConnId, platform: &Arc<str>, frame: Frame) {
        let frame = self.cluster.stamp(frame);
        self.delivery().deliver(origin, platform, frame);
    }

    /// A terminal event was delivered: the delivery room releases its room
    /// ([`Delivery::confirm`]), the message leaves the journal and the files its reply
    /// carried leave the spool.
    pub(super) fn confirm(&mut self, f: Frame) {
        // The files an agent attached leave the spool with their reply (issue 36).
        let sent = f.body.attachment_paths();
        if !sent.is_empty() {
            self.actions.push_back(super::Action::ReleaseFiles(sent));
        }
        if let Some(seq) = self.delivery().confirm(f)
            && let Some(d) = &mut self.durable
        {
            self.actions.push_back(d.record(Record::Delivered { seq }));
        }
    }

    /// The delivery room over this bridge's connections and platforms, now.
    pub(super) fn delivery(&mut self) -> Delivery<'_> {
        Delivery {
            cfg: &self.cfg,
            conns: &mut self.conns,
            platforms: &mut self.platforms,
            stats: &mut self.stats,
            now: self.now,
        }
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
