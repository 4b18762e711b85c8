//! The bridge as a cluster member (`--cluster`, docs/cluster.md): what the partitioned
//! journal reports beyond a single instance's ([`ClusterReport`]) and what the stream reader
//! brings ([`Arrival`]).
//!
//! - A message accepted here for a partition **owned elsewhere** is acked once durable
//!   (`queued`, its `position` the session's messages in flight across the cluster, as
//!   Redis counted them) and never submitted here; its
//!   route waits for the owner's outcome, which the reader brings from the outcome stream and
//!   which goes out as any terminal event (no outcome record: the owner wrote it).
//! - A **duplicate** by Redis's cluster-wide window is answered as a local duplicate is; a
//!   session with its cap in flight cluster-wide is refused `queue_full`.
//! - A **gained** partition is rebuilt as start-up recovery rebuilds the journal
//!   ([`Bridge::recover`]); a message of it this bridge was waiting for remotely is taken back
//!   from its wait first. A message accepted into an owned partition afterwards by another
//!   instance arrives from the inbox and is queued the same way; one accepted here is
//!   submitted once the reader has passed its inbox entry (`order.rs`), behind the others.
//! - A **lost or fenced** partition is **handed over** in place: its sessions leave the
//!   runtime ([`Action::HandOver`], the core's `Input::HandOver`) and every one of its
//!   messages leaves this instance with no outcome record and nothing sent, as
//!   `keep_for_restart` leaves one at a planned restart: the partition's next owner loads it
//!   from Redis. A message accepted here waits for that owner's outcome from the stream (its
//!   route and reservation stay, as for a message owned elsewhere from the start); one
//!   accepted elsewhere is forgotten here (its reservation released). Whatever the runtime
//!   still says of them (a cancelled turn's end) is discarded. A terminal event already
//!   waiting for its outcome record goes by the journal's answer: sent if the record was
//!   written under the lease, dropped if not ([`ClusterReport::unwritten_outcomes`]).
//!   The rest of the instance goes on serving.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use super::super::ConnId;
use super::super::refusal::Refusal;
use super::super::routes::{Phase, Routes, no_conn};
use super::early::{EarlyOutcomes, Kept};
use crate::cluster::{partition_of, tag_parts};
use crate::core::EventKind;
use crate::liveness::ClusterStatus;
use crate::message::SessionKey;
use crate::server::frame::Frame;

/// A message accepted here whose outcome record was given up (fenced, or its partition no
/// longer held): its result is the next owner's outcome from the stream, or its own frame if
/// the write landed after all. Its outbox reservation is kept for it.
pub(super) struct Orphan {
    /// The bridge's tag.
    pub(super) tag: u64,
    /// The connection and platform its result goes to, its id.
    pub(super) conn: ConnId,
    pub(super) platform: Arc<str>,
    pub(super) id: Arc<str>,
    /// The terminal event that waited for the record.
    pub(super) own: Frame,
}

/// The bridge's cluster state, kept with the journal's ([`super::super::durable::Durable`]).
#[derive(Default)]
pub(in crate::server) struct ClusterSide {
    /// Messages acked here and owned elsewhere: cluster tag → the bridge's tag.
    pub(super) remote: HashMap<u64, u64>,
    /// Partitions owned here (gained, not handed over since).
    pub(super) owned: HashSet<u32>,
    /// The partition count (`--partitions`): a session's partition is computed here.
    pub(super) partitions: u32,
    /// Messages accepted here and placed in Redis: the bridge's tag → the cluster tag the
    /// outcome stream names it by (kept while the message is in flight, so that a handed-over
    /// one can wait for its outcome; pruned as routes end, see `placed_room`).
    pub(super) placed: HashMap<u64, u64>,
    /// Messages handed over whose runtime events are still to come (at most one per message
    /// in flight at the hand-over; each leaves with its terminal event): all are discarded.
    pub(super) handed: HashSet<u64>,
    /// Messages accepted here whose outcome record was refused (the partition's next owner
    /// answers them): cluster tag → the bridge's tag, the connection, the platform and id
    /// their result goes to (their reservation is kept for it).
    pub(super) orphans: HashMap<u64, Orphan>,
    /// Partitions handed over, and their messages, since the start.
    pub(super) handed_over: (u64, u64),
    /// Messages run here that another instance accepted: whether their results are their
    /// live origin's (recorded, not sent here) or, their origin taken for dead, go out here
    /// marked `redelivery`.
    pub(super) elsewhere: super::elsewhere::AcceptedElsewhere,
    /// Partitions being drained to be released, and the turns they wait for.
    pub(super) drains: super::drain::Drains,
    /// The owned partitions' fence deadlines (self-fencing, `fence.rs`).
    pub(super) fences: super::fence::Fences,
    /// Outcomes from the stream that came before their message was known to wait here.
    pub(super) early: EarlyOutcomes,
    /// Outcomes this instance wrote itself whose stream entry came (see `early.rs`).
    pub(super) landed: Kept<()>,
    /// Results offered to the instance of their platform's newest hello.
    pub(super) forwards: super::forward::Forwards,
    /// Messages of a partition being rebuilt that waited here for another instance's
    /// outcome: the connection their result goes to (emptied by the rebuild).
    pub(super) rebind: HashMap<u64, ConnId>,
    /// Own accepts held behind the inboxes of owned partitions (`order.rs`).
    pub(super) order: super::order::Order,
    /// Whether this instance may have been taken for dead since a message was placed.
    pub(super) registration: super::lapse::Registration,
    /// Rebuilt messages of owned partitions waiting for outbox room.
    pub(super) waiting: super::room::WaitingForRoom,
    /// A journal report's cluster part between its steps (`report.rs`).
    pub(super) in_report: Option<super::report::InReport>,
    /// The partitions the report being applied ended (lost or fenced), regained in it or not.
    pub(super) ended: Vec<u32>,
    /// Of them, those to hand over after the rest of the report.
    pub(super) later: Vec<u32>,
}

impl ClusterSide {
    /// The partition of a message: by its place in Redis where known, else by its session.
    pub(in crate::server::bridge) fn partition_of_route(
        &self,
        tag: u64,
        session: &SessionKey,
    ) -> u32 {
        tag_parts(tag)
            .or_else(|| self.placed.get(&tag).and_then(|&ct| tag_parts(ct)))
            .map_or_else(
                || partition_of(session.as_str(), self.partitions.max(1)),
                |(p, _)| p,
            )
    }

    /// Whether the held turn of message `tag`, its `started` record written, may start: its
    /// partition is not among those the report being applied ended (lost or fenced in it; a
    /// refused `started` write must not run, tests/simulation_cluster seeds 1 and 29). A
    /// partition ended by an earlier report needs no check: its hand-over ended its held
    /// turns in the core, which ignores the release of a turn it no longer holds.
    pub(in crate::server::bridge) fn runs_here(&self, tag: u64, routes: &Routes) -> bool {
        routes.get(tag).is_none_or(|route| {
            !(self.ended).contains(&self.partition_of_route(tag, &route.session))
        })
    }

    /// Whether this instance owns a partition (`--cluster`): never under `--data-dir` alone,
    /// where a turn start pays nothing for the cluster's bookkeeping.
    pub(in crate::server::bridge) fn owns_partitions(&self) -> bool {
        !self.owned.is_empty()
    }

    /// Whether a runtime event of `tag` is one of a handed-over message's, to be discarded:
    /// its start, partials and terminal event (which ends the discarding). Its acceptance
    /// still acks it (it is durable; the ack may not have gone yet when the same report
    /// handed it over), a refusal still refuses it (and ends the discarding), a turn's end
    /// still ends its typing.
    pub(in crate::server::bridge) fn handed_event(&mut self, tag: u64, kind: &EventKind) -> bool {
        if !self.handed.contains(&tag) {
            return false;
        }
        match kind {
            EventKind::Accepted { .. } | EventKind::TurnEnded(_) => false,
            EventKind::Rejected(_) => {
                self.handed.remove(&tag);
                false
            }
            EventKind::Finished(_) => {
                self.handed.remove(&tag);
                true
            }
            EventKind::TurnStarted(_) | EventKind::Partial(_) => true,
        }
    }

    /// A terminal event about to go out here for a message another instance accepted, that
    /// instance taken for dead: marked `redelivery`, since its origin may send it as well
    /// (docs/cluster.md "Where the result goes": a result sent on an instance other than its
    /// origin's may have been seen).
    pub(in crate::server::bridge) fn mark_foreign(
        &mut self,
        mut frame: Frame,
        routes: &Routes,
    ) -> Frame {
        if self.elsewhere.take_foreign(frame.seq, routes) {
            frame.mark_redelivery();
        }
        frame
    }

    /// The result of a message accepted here, from another instance's outcome record (or a
    /// record of this one's given up and written after all): marked `redelivery` if an
    /// owner may have taken this instance for dead and sent it first (see `lapse.rs`).
    pub(super) fn mark_if_taken_for_dead(&self, mut frame: Frame, now: Duration) -> Frame {
        if self.registration.may_be_taken_for_dead(frame.seq, now) {
            frame.mark_redelivery();
        }
        frame
    }

    /// Admission's gate for a new message of `platform`: refused `backpressure` while
    /// rebuilt messages of it wait for room (see `room.rs`).
    pub(in crate::server::bridge) fn outbox_gate(
        &self,
        platform: &str,
        cap: usize,
    ) -> Result<(), Refusal> {
        self.waiting.gate(platform, cap)
    }

    /// The connection the result of a message being rebuilt goes to: the one that sent it,
    /// when it waited here for another instance's outcome (see `gained`); else none (its
    /// platform's newest hello, as for any recovered message).
    pub(in crate::server::bridge) fn rebound(&mut self, tag: u64) -> ConnId {
        self.rebind.remove(&tag).unwrap_or_else(no_conn)
    }

    /// The bridge's cluster figures, into the status: the partitions owned here, in order;
    /// messages acked here whose outcome another instance owes (each holds its route and
    /// its outbox reservation, within the platforms' bounds); outcomes from the stream kept
    /// until their message is known here, and how many were dropped at their bound (the
    /// messages in flight plus 1,024); stream entries of outcomes this instance wrote
    /// itself, kept in case a write given up as unwritten landed after all (at most the
    /// messages in flight plus 1,024; most are of writes whose answer came, dropped at the
    /// bound); partitions lost or fenced since the start, and the messages they took away
    /// from this instance (handed over to their next owner); the drains and the forwards.
    pub(in crate::server::bridge) fn fill_status(&self, s: &mut ClusterStatus) {
        let mut owned: Vec<u32> = self.owned.iter().copied().collect();
        owned.sort_unstable();
        s.owned_partitions = owned.len();
        s.owned = owned;
        s.remote_waiting = self.remote.len();
        s.order_held = self.order.held();
        (s.early_outcomes, s.early_outcomes_dropped) = self.early.counts();
        s.own_outcome_entries = self.landed.counts().0;
        s.waiting_for_room = self.waiting.len();
        (s.handed_over_partitions, s.handed_over_messages) = self.handed_over;
        s.self_fenced = self.fences.count();
        self.drains.fill_status(s);
        self.forwards.fill_status(s);
    }

    /// `--cluster`: the partition count, for the partition of a session.
    pub(in crate::server::bridge) fn set_partitions(&mut self, n: u32) {
        self.partitions = n;
    }

    /// Whether this bridge is a cluster member (`set_partitions` was called).
    pub(in crate::server::bridge) fn is_on(&self) -> bool {
        self.partitions > 0
    }

    /// The cluster tag of a message accepted here, while it is known (see `placed`).
    pub(in crate::server::bridge) fn cluster_tag_of(&self, tag: u64) -> Option<u64> {
        self.placed.get(&tag).copied()
    }

    /// The run here of message `seq` ended with its outcome record unwritten (fenced, or its
    /// partition lost): its say in where the result goes ends with it. Whoever loads the
    /// message next decides that; a stale entry saying the result is its origin's would drop
    /// the result of a rebuild here after a regain (tests/simulation_cluster, seed 356).
    pub(super) fn forget_run(&mut self, seq: u64) {
        self.elsewhere.forget(seq);
    }

    /// Whether the terminal event of `seq`, its outcome now recorded, is another instance's
    /// to send (its origin's, alive): then it goes nowhere, and the bridge gives its
    /// reservation back.
    pub(in crate::server::bridge) fn silenced(&mut self, seq: u64) -> bool {
        self.elsewhere.silenced(seq)
    }

    /// Checks, in debug builds, that the remote index and the routes agree both ways: each
    /// entry names a route waiting in phase `Remote`, and each such route has exactly one
    /// entry; that a message rebound to its connection (`rebind`) waits for room; and the
    /// index of messages accepted elsewhere.
    pub(in crate::server::bridge) fn check(&self, routes: &Routes) {
        self.elsewhere.check();
        let remote = |tag: u64| routes.get(tag).is_some_and(|r| r.phase == Phase::Remote);
        debug_assert!(
            self.remote.values().all(|&tag| remote(tag)),
            "a remote entry without its route in phase Remote"
        );
        let waiting = routes.values().filter(|r| r.phase == Phase::Remote).count();
        debug_assert_eq!(
            self.remote.len(),
            waiting,
            "remote entries and Remote routes"
        );
        debug_assert!(
            self.rebind.keys().all(|&t| self.waiting.contains(t)),
            "every rebound message was rebuilt or waits for room"
        );
    }

    /// The platforms owed a reservation by the messages whose refused outcome the next
    /// owner answers.
    pub(in crate::server::bridge) fn orphan_platforms(&self) -> impl Iterator<Item = &str> {
        self.orphans.values().map(|o| &*o.platform)
    }
}
