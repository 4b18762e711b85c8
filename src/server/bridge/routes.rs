//! Where a result goes: each message in flight, by its tag, with the connection that sent it
//! (or none: recovered from the journal), and where each running turn's typing goes; and a
//! message's end — finished, refused by the runtime — as a decision ([`Ended`],
//! [`Rejected`]) the bridge carries out (`Bridge::end`: the terminal event to the journal
//! first, else to the delivery room).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use super::super::dedup::Fingerprint;
use super::super::sharded::Sharded;
use super::conns::{Answer, Conns};
use super::delivery::{failed_line, terminal_line};
use super::durable::Durable;
use super::platforms::Platforms;
use super::refusal::{Refusal, not_readmitted};
use super::{Action, ConnId};
use crate::core::{Outcome, RejectReason, TurnId};
use crate::journal::MemoryUpdate;
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

/// A message's terminal event on its way out ([`Bridge::end`](super::Bridge)): with a
/// journal once its outcome record is durable.
pub(super) struct Terminal {
    pub(super) seq: u64,
    /// The connection that sent the message (or [`no_conn`]).
    pub(super) conn: ConnId,
    pub(super) platform: Arc<str>,
    pub(super) id: Arc<str>,
    pub(super) body: EncodedLine,
    /// The change to the session's stored conversation, committed with the outcome record
    /// (dropped without a journal).
    pub(super) memory: Option<MemoryUpdate>,
    /// The action that deletes the message's files from the spool, its route having ended.
    pub(super) files: Option<Action>,
}

impl Terminal {
    /// The terminal event `body` of the message of `seq`, whose route `route` ended.
    pub(super) fn of(seq: u64, route: InFlight, body: EncodedLine) -> Terminal {
        Terminal {
            seq,
            files: route.release_files(),
            conn: route.conn,
            platform: route.platform,
            id: route.id,
            body,
            memory: None,
        }
    }
}

/// How a message's route ended, for the bridge to carry out.
// Built and carried out at once, once per message, never stored: a box would only add an
// allocation per message.
#[allow(clippy::large_enum_variant)]
pub(super) enum Ended {
    /// A graceful shutdown kept it in the journal for the next start
    /// ([`Durable::keep_for_restart`]): its connection may now be finished.
    Kept(ConnId),
    /// Its terminal event goes out.
    Terminal(Terminal),
}

/// What the runtime's refusal of a message decides.
pub(super) enum Rejected {
    /// A recovered message's route ended (acknowledged by an earlier process, it gets a
    /// terminal event, or stays in the journal at shutdown).
    Ended(Ended),
    /// With a journal: answered once this `forget` record is durable (else a crash brings it
    /// back).
    Forget(Action),
    /// Without one: refused now.
    Refuse(Refusal),
}

impl InFlight {
    /// The message of `seq` finished with `outcome` (its route removed, its budget charged,
    /// its connection settled): kept for the next start if a graceful shutdown cancelled it
    /// with a journal, else its terminal event, its text cut to `max_reply` bytes.
    pub(super) fn finished(
        self,
        seq: u64,
        mut outcome: Outcome,
        durable: Option<&mut Durable>,
        platforms: &mut Platforms,
        max_reply: usize,
    ) -> Ended {
        if outcome == Outcome::Cancelled(crate::CancelReason::Shutdown)
            && let Some(d) = durable
        {
            return Ended::Kept(d.keep_for_restart(self, platforms));
        }
        let memory = match &mut outcome {
            Outcome::Reply(reply) => reply.take_memory(),
            _ => None,
        };
        let body = terminal_line(&self.id, self.session.as_str(), outcome, max_reply);
        Ended::Terminal(Terminal {
            memory,
            ..Terminal::of(seq, self, body)
        })
    }
}

impl Routes {
    /// A new message from `conn` takes its route (in its first phase: journaling with a
    /// journal) and its place in its connection's answers.
    pub(super) fn launch(
        &mut self,
        tag: u64,
        mut route: InFlight,
        journaled: bool,
        conns: &mut Conns,
        now: Duration,
    ) {
        if journaled {
            route.phase = Phase::Journaling;
        }
        let conn = route.conn;
        self.insert(tag, route);
        conns.sent(conn);
        conns.push_answer(conn, Answer::Pending { tag, copy: None }, now);
    }

    /// The turn `turn` of the message of `tag` started: it counts as a start, and its
    /// typing goes to the message's connection, refreshed at `next`. The connection and the
    /// attempt (for its `started` record), or `None` without the route.
    pub(super) fn turn_started(
        &mut self,
        tag: u64,
        turn: TurnId,
        session: SessionKey,
        next: Duration,
    ) -> Option<(ConnId, u32)> {
        let route = self.get_mut(tag)?;
        route.starts += 1;
        let (conn, attempt) = (route.conn, route.starts);
        self.typing_started(turn, conn, session, next);
        Some((conn, attempt))
    }

    /// The runtime refused the message of `tag` for `reason`: what that decides (see
    /// [`Rejected`]); a recovered message's `failed` is cut to `max_reply` bytes.
    pub(super) fn rejected(
        &mut self,
        tag: u64,
        reason: RejectReason,
        durable: Option<&mut Durable>,
        platforms: &mut Platforms,
        max_reply: usize,
    ) -> Option<Rejected> {
        if self.get(tag).is_some_and(|r| r.recovered) {
            let route = self.remove(tag)?;
            // `--cluster`: loaded (a partition gained, an inbox arrival) as this instance
            // stops: it stays in the journal for the next owner, as a queued one does.
            if reason == RejectReason::ShuttingDown
                && let Some(d) = durable
            {
                let conn = d.keep_for_restart(route, platforms);
                return Some(Rejected::Ended(Ended::Kept(conn)));
            }
            // Acknowledged by the process before the restart: it gets a terminal event.
            let why = not_readmitted(reason.as_str());
            log::warn!("session {}: message {} {why}", route.session, route.id);
            let body = failed_line(&route.id, route.session.as_str(), why, max_reply);
            return Some(Rejected::Ended(Ended::Terminal(Terminal::of(
                tag, route, body,
            ))));
        }
        Some(match durable {
            Some(d) => {
                if let Some(route) = self.get_mut(tag) {
                    route.phase = Phase::Refusing;
                }
                Rejected::Forget(d.record_forget(tag, Refusal::runtime(reason)))
            }
            None => Rejected::Refuse(Refusal::runtime(reason)),
        })
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
