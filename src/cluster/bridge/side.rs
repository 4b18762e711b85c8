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

use super::super::refusal::{Refusal, duplicate_ack};
use super::super::routes::{Phase, Routes, no_conn};
use super::super::{Action, Bridge, ConnId};
use super::early::{EARLY_SLACK, EarlyOutcomes, Kept};
use crate::cluster::{Arrival, ClusterReport, LoadedPartition, partition_of, tag_parts};
use crate::core::{EventKind, RejectReason};
use crate::journal::{Committed, Recovered, RecoveredMessage, StoredOutcome, now_ms};
use crate::liveness::ClusterStatus;
use crate::message::SessionKey;
use crate::server::frame::Frame;
use crate::wire::EncodedLine as Body;
use crate::wire::{ServerOp, encode};

/// A message accepted here whose outcome record was given up (fenced, or its partition no
/// longer held): its result is the next owner's outcome from the stream, or its own frame if
/// the write landed after all. Its outbox reservation is kept for it.
pub(in crate::server) struct Orphan {
    /// The bridge's tag.
    tag: u64,
    /// The connection and platform its result goes to, its id.
    conn: ConnId,
    platform: Arc<str>,
    id: Arc<str>,
    /// The terminal event that waited for the record.
    own: Frame,
}

/// The bridge's cluster state, kept with the journal's ([`super::super::durable::Durable`]).
#[derive(Default)]
pub(in crate::server) struct ClusterSide {
    /// Messages acked here and owned elsewhere: cluster tag → the bridge's tag.
    remote: HashMap<u64, u64>,
    /// Partitions owned here (gained, not handed over since).
    pub(in crate::server::bridge) owned: HashSet<u32>,
    /// The partition count (`--partitions`): a session's partition is computed here.
    partitions: u32,
    /// Messages accepted here and placed in Redis: the bridge's tag → the cluster tag the
    /// outcome stream names it by (kept while the message is in flight, so that a handed-over
    /// one can wait for its outcome; pruned as routes end, see `placed_room`).
    placed: HashMap<u64, u64>,
    /// Messages handed over whose runtime events are still to come (at most one per message
    /// in flight at the hand-over; each leaves with its terminal event): all are discarded.
    handed: HashSet<u64>,
    /// Messages accepted here whose outcome record was refused (the partition's next owner
    /// answers them): cluster tag → the bridge's tag, the connection, the platform and id
    /// their result goes to (their reservation is kept for it).
    orphans: HashMap<u64, Orphan>,
    /// Partitions handed over, and their messages, since the start.
    handed_over: (u64, u64),
    /// Messages run here that another live instance accepted: their terminal events are
    /// recorded (the record publishes them to that instance) and not sent here.
    silent: HashSet<u64>,
    /// Messages run here that another instance accepted and that instance was taken for dead
    /// (the load found no live origin): their results go out here, marked `redelivery`
    /// (the origin may be alive after all, paused, and send the same outcome from the
    /// stream; see `mark_foreign`). Pruned to the messages in flight.
    foreign: HashSet<u64>,
    /// Partitions being drained to be released, and the turns they wait for.
    pub(in crate::server::bridge) drains: super::drain::Drains,
    /// The owned partitions' fence deadlines (self-fencing, `fence.rs`).
    pub(in crate::server::bridge) fences: super::fence::Fences,
    /// Outcomes from the stream that came before their message was known to wait here.
    early: EarlyOutcomes,
    /// Outcomes this instance wrote itself whose stream entry came (see `early.rs`).
    landed: Kept<()>,
    /// Results offered to the instance of their platform's newest hello.
    pub(in crate::server::bridge) forwards: super::forward::Forwards,
    /// Messages of a partition being rebuilt that waited here for another instance's
    /// outcome: the connection their result goes to (emptied by the rebuild).
    rebind: HashMap<u64, ConnId>,
    /// Own accepts held behind the inboxes of owned partitions (`order.rs`).
    pub(in crate::server::bridge) order: super::order::Order,
    /// Whether this instance may have been taken for dead since a message was placed.
    registration: super::lapse::Registration,
    /// Rebuilt messages of owned partitions waiting for outbox room.
    pub(in crate::server::bridge) waiting: super::room::WaitingForRoom,
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
    /// partition is not among `ended` (lost or fenced in the report that wrote the record; a
    /// refused `started` write must not run, tests/simulation_cluster seeds 1 and 29). A
    /// partition ended by an earlier report needs no check: its hand-over ended its held
    /// turns in the core, which ignores the release of a turn it no longer holds.
    pub(in crate::server::bridge) fn runs_here(
        &self,
        tag: u64,
        routes: &Routes,
        ended: &[u32],
    ) -> bool {
        routes
            .get(tag)
            .is_none_or(|route| !ended.contains(&self.partition_of_route(tag, &route.session)))
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
        if self.foreign.remove(&frame.seq) {
            frame.mark_redelivery();
        }
        // Bounded by the messages in flight: one that left another way (handed over,
        // refused) is dropped here.
        if self.foreign.len() > routes.len() + 64 {
            self.foreign.retain(|&tag| routes.contains(tag));
        }
        frame
    }

    /// The result of a message accepted here, from another instance's outcome record (or a
    /// record of this one's given up and written after all): marked `redelivery` if an
    /// owner may have taken this instance for dead and sent it first (see `lapse.rs`).
    fn mark_if_taken_for_dead(&self, mut frame: Frame, now: Duration) -> Frame {
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
    /// message next decides that; a stale `silent` entry would drop the result of a rebuild
    /// here after a regain (tests/simulation_cluster, seed 356).
    fn forget_run(&mut self, seq: u64) {
        self.silent.remove(&seq);
        self.foreign.remove(&seq);
    }

    /// Whether the terminal event of `seq`, its outcome now recorded, is another instance's
    /// to send (its origin's, alive): then it goes nowhere, and the bridge gives its
    /// reservation back.
    pub(in crate::server::bridge) fn silenced(&mut self, seq: u64) -> bool {
        self.silent.remove(&seq)
    }

    /// Checks, in debug builds, that the remote index and the routes agree both ways: each
    /// entry names a route waiting in phase `Remote`, and each such route has exactly one
    /// entry.
    pub(in crate::server::bridge) fn check(&self, routes: &Routes) {
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
    }

    /// The platforms owed a reservation by the messages whose refused outcome the next
    /// owner answers.
    pub(in crate::server::bridge) fn orphan_platforms(&self) -> impl Iterator<Item = &str> {
        self.orphans.values().map(|o| &*o.platform)
    }
}

impl Bridge {
    /// [`Bridge::journaled`] for a cluster member: `cluster` is the cluster's part of the same
    /// report (`ClusterLink::report`), applied first.
    pub fn journaled_with(&mut self, c: Committed, cluster: ClusterReport, now: Duration) {
        self.journal_report(c, cluster, now);
    }

    /// The cluster's part of a journal report, applied before the rest (see
    /// [`Bridge::clustered`]): returns the rest of the report (less the outcomes not
    /// written, and less the own accepts held behind their inbox: `order.rs`), the
    /// partitions to hand over once the rest is applied, and every partition
    /// the report ends, regained in it or not (no turn held under the old lease starts:
    /// `runs_here`).
    pub(in crate::server::bridge) fn cluster_part(
        &mut self,
        mut c: Committed,
        mut report: ClusterReport,
        now: Duration,
    ) -> (Committed, Vec<u32>, Vec<u32>) {
        // Accepted into a partition this bridge fenced itself out of before the journal
        // thread heard of it: owned elsewhere now, its next owner runs it.
        let (cluster, routes) = (&self.cluster, &self.routes);
        let gained: Vec<u32> = report.gained.iter().map(|(p, _)| *p).collect();
        let fenced_out = |tag: &u64| {
            routes.get(*tag).is_some_and(|r| {
                let p = cluster.partition_of_route(*tag, &r.session);
                cluster.is_on() && !cluster.owned.contains(&p) && !gained.contains(&p)
            })
        };
        let moved: Vec<u64> = c.durable.iter().copied().filter(fenced_out).collect();
        if !moved.is_empty() {
            c.durable.retain(|t| !moved.contains(t));
            report.remote.extend(moved);
        }
        // Not written, so never sent: the partition's new owner answers the message.
        for seq in &report.unwritten_outcomes {
            self.unwritten(*seq);
        }
        c.outcomes
            .retain(|seq| !report.unwritten_outcomes.contains(seq));
        let ahead: HashMap<u64, usize> = report.ahead.iter().copied().collect();
        let draining = report.draining.clone();
        let (handed, ended) = self.clustered(report, now);
        for &p in &draining {
            self.unhold(p);
        }
        self.hold_for_order(&mut c, &ahead, &draining);
        (c, handed, ended)
    }

    /// The cluster part of a journal report: called by [`Bridge::journaled`] before the rest
    /// (its tags are not among the report's `durable` and `failed`). Returns the partitions
    /// lost or fenced and not regained in it, which are handed over ([`Bridge::hand_over`])
    /// after the rest: a message of one of them made durable by the same report is then
    /// submitted before its session is handed over, and ends with it. And every partition
    /// the report ends, regained or not.
    pub(in crate::server::bridge) fn clustered(
        &mut self,
        r: ClusterReport,
        now: Duration,
    ) -> (Vec<u32>, Vec<u32>) {
        if let Some(registered_for) = r.registered_for {
            self.cluster.registration.heard(registered_for, now);
        }
        for &(tag, _) in &r.placed {
            self.cluster.registration.placed(tag);
        }
        let placed: HashMap<u64, u64> = r.placed.iter().copied().collect();
        let ahead: HashMap<u64, usize> = r.ahead.iter().copied().collect();
        for tag in r.remote {
            let position = ahead.get(&tag).copied();
            self.acked_remote(tag, placed.get(&tag).copied(), position, now);
        }
        for tag in r.duplicates {
            self.cluster_duplicate(tag, now);
        }
        for tag in r.session_full {
            if let Some(d) = &mut self.durable {
                d.forget_waiting(tag);
            }
            self.refuse(tag, Refusal::runtime(RejectReason::QueueFull));
        }
        let cluster = &mut self.cluster;
        cluster.placed.extend(placed.iter().map(|(&t, &c)| (t, c)));
        if cluster.placed.len() > 2 * self.routes.len() + 64 {
            // A result held for its outcome record still needs its cluster tag, to be
            // forwarded should its connection be gone (`forward.rs`).
            let durable = self.durable.as_ref();
            let held: HashSet<u64> = (cluster.placed.keys().copied())
                .filter(|&t| durable.is_some_and(|d| d.is_unjournaled(t)))
                .collect();
            let (routes, orphans) = (&self.routes, &cluster.orphans);
            cluster.placed.retain(|&tag, ct| {
                routes.contains(tag) || orphans.contains_key(ct) || held.contains(&tag)
            });
            let placed = &cluster.placed;
            cluster.registration.retain(|tag| placed.contains_key(&tag));
        }
        cluster.drains.ask(r.draining);
        // Lost (or fenced) and gained again in one pass (a paused instance waking): what it
        // held under the old lease goes first, then the load rebuilds the partition; handed
        // over after the gain, the rebuilt sessions would end and the partition count as not
        // owned while its lease is held (tests/simulation_cluster, seed 37).
        let mut ended: Vec<u32> = r.lost.into_iter().chain(r.fenced).collect();
        ended.sort_unstable();
        ended.dedup();
        let mut later = ended.clone();
        for (p, loaded) in r.gained {
            if let Ok(i) = later.binary_search(&p) {
                later.remove(i);
                self.hand_over(p);
            }
            self.cluster.owned.insert(p);
            let cluster = &mut self.cluster;
            cluster.order.loaded(p, &loaded, &cluster.placed);
            self.gained(p, loaded, now);
        }
        // The pass's deadlines, then those already past (a report late to the reactor):
        // handed over with the ended ones, no held turn of theirs released.
        self.cluster.fences.update(&r.leases, &self.cluster.owned);
        for (p, request) in self.cluster.fence_due(now) {
            self.actions.push_back(Action::Cluster(request));
            if !ended.contains(&p) {
                ended.push(p);
                later.push(p);
            }
        }
        (later, ended)
    }

    /// `--cluster`: the bridge's figures in the cluster's status (the partitions owned, the
    /// messages waiting for another instance, hand-overs, drains, forwards; the member's
    /// and the reader's figures are the shell's).
    pub fn cluster_status(&self) -> ClusterStatus {
        let mut s = ClusterStatus::default();
        self.cluster.fill_status(&mut s);
        s
    }

    /// `--cluster`: the partition count, for the partition of a session.
    pub fn set_partitions(&mut self, n: u32) {
        if self.durable.is_some() {
            self.cluster.partitions = n;
        }
    }

    /// A partition lost or fenced (once per ownership): its messages leave this instance
    /// without outcome records, its sessions leave the runtime (see the module's notes).
    pub(in crate::server::bridge) fn hand_over(&mut self, p: u32) {
        self.unhold(p);
        if !self.cluster.owned.remove(&p) {
            return;
        }
        self.cluster.drains.forget(p);
        self.cluster.fences.forget(p);
        // Not rebuilt yet: its next owner loads them.
        for tag in self.cluster.waiting.hand_over(p) {
            let cluster = &mut self.cluster;
            cluster.silent.remove(&tag);
            cluster.foreign.remove(&tag);
            if cluster.rebind.remove(&tag).is_some() {
                log::warn!(
                    "partition {p}: message {tag}: handed over before it was rebuilt here: its result will not come to this connection"
                );
            }
        }
        let (sessions, handed, waiting) = self.hand_over_sessions(p, &HashSet::new());
        self.cluster.handed_over.0 += 1;
        self.cluster.handed_over.1 += handed as u64;
        log::warn!(
            "partition {p}: lost or fenced: {sessions} session(s) and {handed} message(s) handed over to its next owner ({waiting} accepted here wait for its outcome); this instance serves the rest"
        );
    }

    /// The messages of partition `p` leave this instance, but for those of the sessions in
    /// `keep` (see [`Bridge::hand_over`]); their sessions leave the runtime. Returns the
    /// sessions and messages handed over, and how many of those wait for the next owner's
    /// outcome.
    pub(in crate::server::bridge) fn hand_over_sessions(
        &mut self,
        p: u32,
        keep: &HashSet<SessionKey>,
    ) -> (usize, usize, usize) {
        let Some(d) = &mut self.durable else {
            return (0, 0, 0);
        };
        let cluster = &self.cluster;
        // Not a message waiting for Redis (the journal thread places it, owned or not), nor
        // one the runtime already refused (its `forget` is on its way), nor one waiting
        // for another instance already.
        let remote: HashSet<u64> = cluster.remote.values().copied().collect();
        let tags: Vec<u64> = self
            .routes
            .tags()
            .filter(|&(tag, r)| {
                cluster.partition_of_route(tag, &r.session) == p
                    && !keep.contains(&r.session)
                    && !d.is_waiting(tag)
                    && !d.is_forgetting(tag)
                    && !remote.contains(&tag)
            })
            .map(|(tag, _)| tag)
            .collect();
        let (mut sessions, mut waiting) = (Vec::<SessionKey>::new(), 0);
        let mut came = Vec::new();
        for &tag in &tags {
            let Some(route) = self.routes.get(tag) else {
                continue;
            };
            if !sessions.contains(&route.session) {
                sessions.push(route.session.clone());
            }
            let cluster = &mut self.cluster;
            cluster.handed.insert(tag);
            cluster.silent.remove(&tag);
            // Accepted here: its outcome comes from the stream, from the next owner.
            if let Some(&ct) = cluster.placed.get(&tag) {
                cluster.remote.insert(ct, tag);
                if let Some(route) = self.routes.get_mut(tag) {
                    route.phase = Phase::Remote;
                }
                waiting += 1;
                if let Some(outcome) = cluster.early.take(ct) {
                    came.push((ct, tag, outcome));
                }
                continue;
            }
            let Some(route) = self.routes.remove(tag) else {
                continue;
            };
            if route.conn != no_conn() {
                log::warn!(
                    "session {}: message {}: handed over with partition {p}, but its place in Redis is unknown here: its result will not come to this connection",
                    route.session,
                    route.id
                );
                self.conns.settled(route.conn);
            }
            self.delivery().give_back(&route.platform);
            self.maybe_finish(route.conn);
        }
        let counts = (sessions.len(), tags.len(), waiting);
        if !sessions.is_empty() {
            self.actions.push_back(Action::HandOver(sessions));
        }
        // The next owner's outcome came before the hand-over: it goes now.
        for (ct, tag, outcome) in came {
            self.cluster.remote.remove(&ct);
            self.remote_outcome(tag, outcome);
        }
        counts
    }

    /// The outcome record of `seq` was not written (fenced, or its partition no longer held):
    /// its terminal event is never sent. Accepted here, the message waits for the next
    /// owner's outcome from the stream instead (its reservation kept); else its reservation
    /// is released.
    pub(in crate::server::bridge) fn unwritten(&mut self, seq: u64) {
        self.cluster.forget_run(seq);
        let Some(d) = &mut self.durable else {
            return;
        };
        let Some((conn, frame)) = d.take_unjournaled(seq) else {
            return;
        };
        let Some(platform) = frame.terminal_for.clone() else {
            return;
        };
        if let (Some(&ct), Some(id)) = (self.cluster.placed.get(&seq), frame.msg_id.clone()) {
            // The write was given up after a try whose answer was lost, yet it landed: the
            // record is this very frame's.
            if self.cluster.landed.take(ct).is_some() {
                log::debug!("message {seq}: its outcome write landed after all; sent");
                let frame = self.cluster.mark_if_taken_for_dead(frame, self.now);
                self.deliver_terminal(conn, &platform, frame);
                return;
            }
            // The next owner's outcome may have come while the turn still ran here.
            if let Some(outcome) = self.cluster.early.take(ct) {
                let frame = Frame::new(Body::from_stored(outcome), Some(platform.clone()))
                    .of_message(seq, id);
                let frame = self.cluster.mark_if_taken_for_dead(frame, self.now);
                self.deliver_terminal(conn, &platform, frame);
                return;
            }
            let orphan = Orphan {
                tag: seq,
                conn,
                platform,
                id,
                own: frame,
            };
            self.cluster.orphans.insert(ct, orphan);
            return;
        }
        self.platforms.unreserve(&platform, None);
        self.platforms.maybe_free(&platform);
    }

    /// Durable in Redis, owned elsewhere (or handed over while held, `order.rs`): acked now
    /// (`queued`, `position` the session's messages in flight across the cluster when Redis
    /// accepted it), and its route waits for the outcome.
    pub(in crate::server::bridge) fn acked_remote(
        &mut self,
        tag: u64,
        cluster: Option<u64>,
        position: Option<usize>,
        now: Duration,
    ) {
        let Some(d) = &mut self.durable else {
            return;
        };
        let (Some(_), Some(cluster)) = (d.forget_waiting(tag), cluster) else {
            return;
        };
        self.cluster.remote.insert(cluster, tag);
        let Some(route) = self.routes.get_mut(tag) else {
            return;
        };
        route.phase = Phase::Remote;
        let (conn, copies) = (route.conn, std::mem::take(&mut route.copies));
        self.platforms
            .dedup_accepted(&route.platform, route.fp, now);
        let ack = encode(&ServerOp::Ack {
            id: &route.id,
            session: route.session.as_str(),
            state: "queued",
            position,
        });
        log::debug!("message {tag} durable; its partition is owned elsewhere");
        for c in std::iter::once(conn).chain(copies) {
            self.conns.resolve(c, tag, |copy| match copy {
                None => ack.clone(),
                Some((cid, ckey)) => duplicate_ack(cid, ckey),
            });
        }
        // Its outcome came before this report: it goes after the ack.
        if let Some(outcome) = self.cluster.early.take(cluster) {
            self.cluster.remote.remove(&cluster);
            self.remote_outcome(tag, outcome);
        }
    }

    /// Redis's window says another instance has the id: answered as a local duplicate.
    fn cluster_duplicate(&mut self, tag: u64, now: Duration) {
        if let Some(d) = &mut self.durable {
            d.forget_waiting(tag);
        }
        let Some(route) = self.routes.remove(tag) else {
            return;
        };
        // Still a duplicate here for the rest of the window.
        self.platforms
            .dedup_accepted(&route.platform, route.fp, now);
        self.platforms.unreserve(&route.platform, None);
        self.delivery().release_held(&route.platform);
        self.conns.settled(route.conn);
        for &c in std::iter::once(&route.conn).chain(&route.copies) {
            self.conns.resolve(c, tag, |copy| match copy {
                None => duplicate_ack(&route.id, &route.session),
                Some((cid, ckey)) => duplicate_ack(cid, ckey),
            });
        }
        self.platforms.maybe_free(&route.platform);
        self.maybe_finish(route.conn);
    }

    /// What the stream reader brought: an outcome of a message acked here and run elsewhere,
    /// or a message accepted into a partition owned here.
    pub fn arrived(&mut self, a: Arrival, now: Duration) {
        self.now = now;
        match a {
            Arrival::Outcome { tag, outcome, .. } => {
                let local = self.cluster.remote.remove(&tag);
                let orphan = self.cluster.orphans.remove(&tag);
                if let Some(local) = local {
                    self.remote_outcome(local, outcome);
                } else if let Some(o) = orphan {
                    let frame = Frame::new(Body::from_stored(outcome), Some(o.platform.clone()))
                        .of_message(o.tag, o.id);
                    let frame = self.cluster.mark_if_taken_for_dead(frame, now);
                    self.deliver_terminal(o.conn, &o.platform, frame);
                } else {
                    // Before the report that says its message waits here (see `early`).
                    let bound = self.routes.len() + EARLY_SLACK;
                    let dropped = self.cluster.early.keep(tag, outcome, bound);
                    if dropped > 0 {
                        log::warn!(
                            "{dropped} outcome(s) from the stream for messages not known here were dropped (more than {bound} kept); a message of them still waiting here is not answered by this instance"
                        );
                    }
                }
            }
            Arrival::Landed { tag, .. } => {
                let orphan = self.cluster.orphans.remove(&tag);
                if let Some(o) = orphan {
                    // Given up as unwritten, yet written: its own result goes.
                    log::debug!(
                        "message {}: its outcome write landed after all; sent",
                        o.tag
                    );
                    let frame = self.cluster.mark_if_taken_for_dead(o.own, now);
                    self.deliver_terminal(o.conn, &o.platform, frame);
                } else {
                    let bound = self.routes.len() + EARLY_SLACK;
                    // Most are of writes whose answer came: dropped at the bound.
                    let _ = self.cluster.landed.keep(tag, (), bound);
                }
            }
            Arrival::OriginGone {
                partition,
                tag,
                message,
            } => self.origin_gone(partition, tag, *message, now),
            Arrival::Reached { partition, seq } => self.reached(partition, seq),
            Arrival::Forwarded {
                from,
                platform,
                results,
                missing,
            } => return self.forwarded(from, platform, results, missing, now),
            Arrival::Took {
                platform,
                taken,
                refused,
            } => return self.took(&platform, &taken, &refused, now),
            Arrival::Message {
                partition,
                tag,
                message,
                ..
            } => {
                let owned = self.cluster.owned.contains(&partition)
                    && !self.cluster.drains.is_draining(partition);
                // Read before its partition was handed over (or while it drains): its next
                // owner queues it.
                if self.routes.contains(tag) || self.cluster.waiting.contains(tag) || !owned {
                    return;
                }
                // Accepted by another instance, alive a moment ago: its result is its own.
                self.cluster.silent.insert(tag);
                self.rebuild_or_wait(partition, *message, now);
            }
        }
        self.audit();
    }

    /// A message of an owned partition whose origin left the registry: its result is this
    /// instance's to send, marked `redelivery` (the origin may have sent it, or be paused and
    /// send it still). Running or queued here, its result is no longer silenced; its outcome
    /// recorded already, it goes out now, as a recovered one does.
    fn origin_gone(&mut self, partition: u32, tag: u64, message: RecoveredMessage, now: Duration) {
        if !self.cluster.owned.contains(&partition) {
            return;
        }
        if self.routes.contains(tag) || self.cluster.waiting.contains(tag) {
            if self.cluster.silent.remove(&tag) {
                self.cluster.foreign.insert(tag);
            }
            return;
        }
        let unjournaled = self.durable.as_ref().is_some_and(|d| d.is_unjournaled(tag));
        if self.cluster.silent.contains(&tag) || unjournaled {
            // Its terminal event is on its way here; it is sent once recorded.
            if self.cluster.silent.remove(&tag) {
                self.cluster.foreign.insert(tag);
            }
            return;
        }
        if message.outcome.is_some() {
            // Within the platform's outbox bound, as any rebuilt message (`room.rs`).
            self.rebuild_or_wait(partition, message, now);
        }
    }

    /// The owner's outcome of a message acked here goes to its connection (or outbox).
    fn remote_outcome(&mut self, tag: u64, outcome: StoredOutcome) {
        let Some(route) = self.routes.remove(tag) else {
            return;
        };
        self.conns.settled(route.conn);
        let frame = Frame::new(Body::from_stored(outcome), Some(route.platform.clone()))
            .of_message(tag, route.id.clone());
        let frame = self.cluster.mark_if_taken_for_dead(frame, self.now);
        self.deliver_terminal(route.conn, &route.platform, frame);
        self.maybe_finish(route.conn);
    }

    /// A partition now owned here, rebuilt as recovery does; messages of it this bridge
    /// waited for remotely leave their wait first (their results go to the connection that
    /// sent them, if it is still open; else to the platform, as a recovered message's do).
    fn gained(&mut self, p: u32, loaded: LoadedPartition, now: Duration) {
        let mut messages = Vec::with_capacity(loaded.recovered.messages.len());
        for rm in loaded.recovered.messages {
            let tag = rm.message.seq;
            // The load brings its outcome, if any: one kept from the stream is stale.
            let ct = tag_parts(tag)
                .map(|_| tag)
                .or_else(|| self.cluster.placed.get(&tag).copied());
            if let Some(ct) = ct {
                self.cluster.early.take(ct);
            }
            // Its result is held here for its outcome record, still on its way to the
            // journal thread when the partition was lost and taken again: the record is
            // written under the new lease and the result goes then; rebuilding it would
            // answer it a second time (`interrupted`).
            if self.durable.as_ref().is_some_and(|d| d.is_unjournaled(tag)) {
                continue;
            }
            // Accepted here, it waited for another instance's outcome (its remote entry is
            // by the cluster tag its placement gave), or its outcome record was refused here
            // before: the load answers it now, on the connection that sent it.
            let cluster = &mut self.cluster;
            let ct = cluster.placed.get(&tag).copied();
            let waited = ct.is_some_and(|ct| cluster.remote.remove(&ct).is_some());
            let orphan = ct.and_then(|ct| cluster.orphans.remove(&ct));
            let mut to = no_conn();
            if let Some(o) = orphan {
                self.platforms.unreserve(&o.platform, None);
                to = o.conn;
            }
            if waited && let Some(route) = self.routes.remove(tag) {
                self.platforms.unreserve(&route.platform, None);
                self.conns.settled(route.conn);
                to = route.conn;
            }
            if self.routes.contains(tag) {
                continue;
            }
            // Accepted by another live instance: the result goes there, by the stream.
            if loaded.origins.contains_key(&tag) {
                if rm.outcome.is_some() {
                    // Published when it was written; the origin's reader has it.
                    continue;
                }
                self.cluster.silent.insert(tag);
            } else if tag_parts(tag).is_some() && rm.outcome.is_none() {
                // Accepted by an instance taken for dead: its result goes out here, marked.
                // (One with its outcome already is marked by the rebuild.)
                self.cluster.foreign.insert(tag);
            }
            if to != no_conn() {
                self.cluster.rebind.insert(tag, to);
            }
            messages.push(rm);
        }
        log::info!(
            "partition {p}: gained, {} message(s) to rebuild",
            messages.len()
        );
        let r = Recovered {
            messages: self.room_now(p, messages),
            dedup: loaded.recovered.dedup,
            max_seq: 0,
        };
        let _ = self.recover(r, now_ms(), now);
        let waiting = &self.cluster.waiting;
        debug_assert!(
            self.cluster.rebind.keys().all(|&t| waiting.contains(t)),
            "every rebound message was rebuilt or waits for room"
        );
    }
}
