//! The cluster's part of a journal report ([`ClusterReport`], `ClusterLink::report`),
//! applied before the rest of the report in steps (`report_step`), each of whose effects
//! the bridge applies before it asks for the next: the messages the report answers (acked
//! as owned elsewhere, duplicates, refused for a full session); then each gained partition,
//! rebuilt as recovery rebuilds the journal (its room measured after the previous one's
//! rebuild); then the fences and the order holds. After the rest of the report
//! (`after_report`): the partitions it ended are handed over and the drains move on.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Duration;

use super::super::refusal::{Refusal, duplicate_ack};
use super::super::routes::no_conn;
use super::side::{ClusterSide, Orphan};
use super::{Effect, Effects, Rooms};
use crate::cluster::{ClusterReport, LoadedPartition, tag_parts};
use crate::core::RejectReason;
use crate::journal::{Committed, Recovered, now_ms};
use crate::server::frame::Frame;
use crate::wire::EncodedLine as Body;

/// A journal report's cluster part between its steps.
#[derive(Default)]
pub(super) struct InReport {
    /// The report, until the first step takes it.
    report: Option<ClusterReport>,
    /// The first step is done: the next one prunes and plans the gains.
    answered: bool,
    /// Partitions gained, to rebuild one per step (each with whether its old ownership was
    /// handed over already, when it was ended and regained in one pass).
    gained: VecDeque<(u32, LoadedPartition, bool)>,
    /// The report's fence deadlines, ahead counts and partitions to drain.
    leases: Vec<(u32, u64, Duration)>,
    ahead: HashMap<u64, usize>,
    draining: Vec<u32>,
}

impl ClusterSide {
    /// The cluster's part of the journal report about to be applied (none without the
    /// feature): taken in steps by `report_step`.
    pub(in crate::server::bridge) fn take_report(&mut self, report: ClusterReport) {
        self.in_report = Some(InReport {
            report: Some(report),
            ..InReport::default()
        });
        self.ended.clear();
        self.later.clear();
    }

    /// The next step of the report taken (`take_report`), on the rest of the journal's report
    /// `c` (less the outcomes not written, less the messages placed in partitions fenced out,
    /// and less the own accepts held behind their inbox: `order.rs`); none once done.
    pub(in crate::server::bridge) fn report_step(
        &mut self,
        c: &mut Committed,
        mut rooms: Rooms<'_>,
    ) -> Option<Effects> {
        let mut fx = Effects::new();
        let mut step = self.in_report.take()?;
        if let Some(report) = step.report.take() {
            self.report_answers(c, report, &mut step, &mut rooms, &mut fx);
        } else if !step.answered {
            step.answered = true;
            self.prune_placed(&rooms);
        } else if let Some((p, loaded, handed)) = step.gained.pop_front() {
            if !handed && self.later.contains(&p) {
                // Lost (or fenced) and gained again in one pass (a paused instance waking):
                // what it held under the old lease goes first, then the load rebuilds the
                // partition; handed over after the gain, the rebuilt sessions would end and
                // the partition count as not owned while its lease is held
                // (tests/simulation_cluster, seed 37).
                self.later.retain(|&q| q != p);
                self.hand_over(p, &mut rooms, &mut fx);
                step.gained.push_front((p, loaded, true));
            } else {
                self.owned.insert(p);
                self.order.loaded(p, &loaded, &self.placed);
                self.gained(p, loaded, &mut rooms, &mut fx);
            }
        } else {
            self.report_end(c, &step, &mut rooms, &mut fx);
            return Some(fx);
        }
        self.in_report = Some(step);
        Some(fx)
    }

    /// The report's first step: the messages it answers. Accepted into a partition this
    /// bridge fenced itself out of before the journal thread heard of it, a message is owned
    /// elsewhere now, its next owner runs it; an outcome not written is never sent (the
    /// partition's new owner answers the message).
    fn report_answers(
        &mut self,
        c: &mut Committed,
        mut r: ClusterReport,
        step: &mut InReport,
        rooms: &mut Rooms<'_>,
        fx: &mut Effects,
    ) {
        let routes = &*rooms.routes;
        let gained: Vec<u32> = r.gained.iter().map(|(p, _)| *p).collect();
        let fenced_out = |tag: &u64| {
            routes.get(*tag).is_some_and(|route| {
                let p = self.partition_of_route(*tag, &route.session);
                self.is_on() && !self.owned.contains(&p) && !gained.contains(&p)
            })
        };
        let moved: Vec<u64> = c.durable.iter().copied().filter(fenced_out).collect();
        if !moved.is_empty() {
            c.durable.retain(|t| !moved.contains(t));
            r.remote.extend(moved);
        }
        for seq in &r.unwritten_outcomes {
            self.unwritten(*seq, rooms);
        }
        c.outcomes.retain(|seq| !r.unwritten_outcomes.contains(seq));
        let now = rooms.delivery.now;
        if let Some(registered_for) = r.registered_for {
            self.registration.heard(registered_for, now);
        }
        for &(tag, _) in &r.placed {
            self.registration.placed(tag);
        }
        let placed: HashMap<u64, u64> = r.placed.iter().copied().collect();
        step.ahead = r.ahead.iter().copied().collect();
        for tag in r.remote {
            let position = step.ahead.get(&tag).copied();
            self.acked_remote(tag, placed.get(&tag).copied(), position, rooms, fx);
        }
        for tag in r.duplicates {
            self.cluster_duplicate(tag, rooms, fx);
        }
        for tag in r.session_full {
            if let Some(d) = rooms.durable.as_deref_mut() {
                d.forget_waiting(tag);
            }
            fx.push(Effect::Refuse(
                tag,
                Refusal::runtime(RejectReason::QueueFull),
            ));
        }
        self.placed.extend(placed);
        self.drains.ask(r.draining.clone());
        // Every partition the report ends, regained in it or not (no turn held under the old
        // lease starts: `runs_here`); those not regained are handed over after the rest of
        // the report (`after_report`): a message of one of them made durable by the same
        // report is then submitted before its session is handed over, and ends with it.
        let mut ended: Vec<u32> = r.lost.into_iter().chain(r.fenced).collect();
        ended.sort_unstable();
        ended.dedup();
        self.later = ended.clone();
        self.ended = ended;
        step.gained = r.gained.into_iter().map(|(p, l)| (p, l, false)).collect();
        step.leases = r.leases;
        step.draining = r.draining;
    }

    /// The cluster tags of messages no longer in flight are forgotten (bounded by the
    /// messages in flight).
    fn prune_placed(&mut self, rooms: &Rooms<'_>) {
        if self.placed.len() <= 2 * rooms.routes.len() + 64 {
            return;
        }
        // A result held for its outcome record still needs its cluster tag, to be
        // forwarded should its connection be gone (`forward.rs`).
        let durable = rooms.durable.as_deref();
        let held: HashSet<u64> = (self.placed.keys().copied())
            .filter(|&t| durable.is_some_and(|d| d.is_unjournaled(t)))
            .collect();
        let (routes, orphans) = (&rooms.routes, &self.orphans);
        self.placed.retain(|&tag, ct| {
            routes.contains(tag) || orphans.contains_key(ct) || held.contains(&tag)
        });
        let placed = &self.placed;
        self.registration.retain(|tag| placed.contains_key(&tag));
    }

    /// The report's last step: the pass's deadlines, then those already past (a report late
    /// to the reactor: handed over with the ended ones, no held turn of theirs released);
    /// the own accepts held for a partition to drain are acked as waiting for its next
    /// owner, and those of the report's durable messages that must wait for the reader are
    /// held (`order.rs`).
    fn report_end(
        &mut self,
        c: &mut Committed,
        step: &InReport,
        rooms: &mut Rooms<'_>,
        fx: &mut Effects,
    ) {
        self.fences.update(&step.leases, &self.owned);
        for (p, request) in self.fence_due(rooms.delivery.now) {
            fx.push(Effect::Act(super::super::Action::Cluster(request)));
            if !self.ended.contains(&p) {
                self.ended.push(p);
                self.later.push(p);
            }
        }
        for &p in &step.draining {
            self.unhold(p, rooms, fx);
        }
        self.hold_for_order(c, &step.ahead, &step.draining, rooms.routes);
    }

    /// After the rest of the report: the partitions it ended and did not regain are handed
    /// over, and the drains move on (an outcome record made durable may end one).
    pub(in crate::server::bridge) fn after_report(&mut self, mut rooms: Rooms<'_>) -> Effects {
        let mut fx = Effects::new();
        for p in std::mem::take(&mut self.later) {
            self.hand_over(p, &mut rooms, &mut fx);
        }
        self.ended.clear();
        self.drain_step(&mut rooms, &mut fx);
        fx
    }

    /// The outcome record of `seq` was not written (fenced, or its partition no longer held):
    /// its terminal event is never sent. Accepted here, the message waits for the next
    /// owner's outcome from the stream instead (its reservation kept); else its reservation
    /// is released.
    fn unwritten(&mut self, seq: u64, rooms: &mut Rooms<'_>) {
        self.forget_run(seq);
        let Some(d) = rooms.durable.as_deref_mut() else {
            return;
        };
        let Some((conn, frame)) = d.take_unjournaled(seq) else {
            return;
        };
        let Some(platform) = frame.terminal_for.clone() else {
            return;
        };
        let delivery = &mut rooms.delivery;
        if let (Some(&ct), Some(id)) = (self.placed.get(&seq), frame.msg_id.clone()) {
            // The write was given up after a try whose answer was lost, yet it landed: the
            // record is this very frame's.
            if self.landed.take(ct).is_some() {
                log::debug!("message {seq}: its outcome write landed after all; sent");
                let frame = self.mark_if_taken_for_dead(frame, delivery.now);
                self.deliver(delivery, conn, &platform, frame);
                return;
            }
            // The next owner's outcome may have come while the turn still ran here.
            if let Some(outcome) = self.early.take(ct) {
                let frame = Frame::new(Body::from_stored(outcome), Some(platform.clone()))
                    .of_message(seq, id);
                let frame = self.mark_if_taken_for_dead(frame, delivery.now);
                self.deliver(delivery, conn, &platform, frame);
                return;
            }
            let orphan = Orphan {
                tag: seq,
                conn,
                platform,
                id,
                own: frame,
            };
            self.orphans.insert(ct, orphan);
            return;
        }
        delivery.platforms.unreserve(&platform, None);
        delivery.platforms.maybe_free(&platform);
    }

    /// Redis's window says another instance has the id: answered as a local duplicate.
    fn cluster_duplicate(&mut self, tag: u64, rooms: &mut Rooms<'_>, fx: &mut Effects) {
        if let Some(d) = rooms.durable.as_deref_mut() {
            d.forget_waiting(tag);
        }
        let Some(route) = rooms.routes.remove(tag) else {
            return;
        };
        let delivery = &mut rooms.delivery;
        // Still a duplicate here for the rest of the window.
        let now = delivery.now;
        delivery
            .platforms
            .dedup_accepted(&route.platform, route.fp, now);
        delivery.platforms.unreserve(&route.platform, None);
        delivery.release_held(&route.platform);
        delivery.conns.settled(route.conn);
        for &c in std::iter::once(&route.conn).chain(&route.copies) {
            delivery.conns.resolve(c, tag, |copy| match copy {
                None => duplicate_ack(&route.id, &route.session),
                Some((cid, ckey)) => duplicate_ack(cid, ckey),
            });
        }
        delivery.platforms.maybe_free(&route.platform);
        fx.push(Effect::Finish(route.conn));
    }

    /// A partition now owned here, rebuilt as recovery does; messages of it this bridge
    /// waited for remotely leave their wait first (their results go to the connection that
    /// sent them, if it is still open; else to the platform, as a recovered message's do).
    fn gained(&mut self, p: u32, loaded: LoadedPartition, rooms: &mut Rooms<'_>, fx: &mut Effects) {
        let mut messages = Vec::with_capacity(loaded.recovered.messages.len());
        for rm in loaded.recovered.messages {
            let tag = rm.message.seq;
            // The load brings its outcome, if any: one kept from the stream is stale.
            let ct = tag_parts(tag)
                .map(|_| tag)
                .or_else(|| self.placed.get(&tag).copied());
            if let Some(ct) = ct {
                self.early.take(ct);
            }
            // Its result is held here for its outcome record, still on its way to the
            // journal thread when the partition was lost and taken again: the record is
            // written under the new lease and the result goes then; rebuilding it would
            // answer it a second time (`interrupted`).
            let durable = rooms.durable.as_deref();
            if durable.is_some_and(|d| d.is_unjournaled(tag)) {
                continue;
            }
            // Accepted here, it waited for another instance's outcome (its remote entry is
            // by the cluster tag its placement gave), or its outcome record was refused here
            // before: the load answers it now, on the connection that sent it.
            let ct = self.placed.get(&tag).copied();
            let waited = ct.is_some_and(|ct| self.remote.remove(&ct).is_some());
            let orphan = ct.and_then(|ct| self.orphans.remove(&ct));
            let mut to = no_conn();
            let delivery = &mut rooms.delivery;
            if let Some(o) = orphan {
                delivery.platforms.unreserve(&o.platform, None);
                to = o.conn;
            }
            if waited && let Some(route) = rooms.routes.remove(tag) {
                delivery.platforms.unreserve(&route.platform, None);
                delivery.conns.settled(route.conn);
                to = route.conn;
            }
            if rooms.routes.contains(tag) {
                continue;
            }
            // Accepted by another live instance: the result goes there, by the stream.
            if loaded.origins.contains_key(&tag) {
                if rm.outcome.is_some() {
                    // Published when it was written; the origin's reader has it.
                    continue;
                }
                self.elsewhere.origin_alive(tag);
            } else if tag_parts(tag).is_some() && rm.outcome.is_none() {
                // Accepted by an instance taken for dead: its result goes out here, marked.
                // (One with its outcome already is marked by the rebuild.)
                self.elsewhere.origin_dead(tag);
            }
            if to != no_conn() {
                self.rebind.insert(tag, to);
            }
            messages.push(rm);
        }
        log::info!(
            "partition {p}: gained, {} message(s) to rebuild",
            messages.len()
        );
        let r = Recovered {
            messages: self.room_now(p, messages, rooms.delivery.platforms),
            dedup: loaded.recovered.dedup,
            max_seq: 0,
        };
        fx.push(Effect::Recover(r, now_ms()));
    }
}
