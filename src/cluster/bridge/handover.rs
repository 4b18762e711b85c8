//! A partition leaves this instance (lost, fenced, or drained: docs/cluster.md), and a
//! message accepted here comes to wait for another instance's outcome (owned elsewhere
//! from the start, or its partition handed over): see `side.rs` for the rules.

use std::collections::HashSet;
use std::sync::Arc;

use super::super::delivery::Delivery;
use super::super::refusal::duplicate_ack;
use super::super::routes::{Phase, no_conn};
use super::super::{Action, ConnId};
use super::side::ClusterSide;
use super::{Effect, Effects, Rooms};
use crate::journal::StoredOutcome;
use crate::message::SessionKey;
use crate::server::frame::Frame;
use crate::wire::EncodedLine as Body;
use crate::wire::{ServerOp, encode};

impl ClusterSide {
    /// A terminal event, stamped with its cluster tag (`stamp`), to the delivery room, as
    /// `Bridge::deliver_terminal` sends one.
    pub(super) fn deliver(
        &self,
        delivery: &mut Delivery<'_>,
        origin: ConnId,
        platform: &Arc<str>,
        frame: Frame,
    ) {
        delivery.deliver(origin, platform, self.stamp(frame));
    }

    /// A partition lost or fenced (once per ownership): its messages leave this instance
    /// without outcome records, its sessions leave the runtime (see the module's notes).
    pub(super) fn hand_over(&mut self, p: u32, rooms: &mut Rooms<'_>, fx: &mut Effects) {
        self.unhold(p, rooms, fx);
        if !self.owned.remove(&p) {
            return;
        }
        self.drains.forget(p);
        self.fences.forget(p);
        // Not rebuilt yet: its next owner loads them.
        for tag in self.waiting.hand_over(p) {
            self.elsewhere.forget(tag);
            if self.rebind.remove(&tag).is_some() {
                log::warn!(
                    "partition {p}: message {tag}: handed over before it was rebuilt here: its result will not come to this connection"
                );
            }
        }
        let (sessions, handed, waiting) = self.hand_over_sessions(p, &HashSet::new(), rooms, fx);
        self.handed_over.0 += 1;
        self.handed_over.1 += handed as u64;
        log::warn!(
            "partition {p}: lost or fenced: {sessions} session(s) and {handed} message(s) handed over to its next owner ({waiting} accepted here wait for its outcome); this instance serves the rest"
        );
    }

    /// The messages of partition `p` leave this instance, but for those of the sessions in
    /// `keep` (see `hand_over`); their sessions leave the runtime. Returns the sessions and
    /// messages handed over, and how many of those wait for the next owner's outcome.
    pub(super) fn hand_over_sessions(
        &mut self,
        p: u32,
        keep: &HashSet<SessionKey>,
        rooms: &mut Rooms<'_>,
        fx: &mut Effects,
    ) -> (usize, usize, usize) {
        let Some(d) = rooms.durable.as_deref() else {
            return (0, 0, 0);
        };
        // Not a message waiting for Redis (the journal thread places it, owned or not), nor
        // one the runtime already refused (its `forget` is on its way), nor one waiting
        // for another instance already.
        let remote: HashSet<u64> = self.remote.values().copied().collect();
        let tags: Vec<u64> = (rooms.routes.tags())
            .filter(|&(tag, r)| {
                self.partition_of_route(tag, &r.session) == p
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
            let Some(route) = rooms.routes.get(tag) else {
                continue;
            };
            if !sessions.contains(&route.session) {
                sessions.push(route.session.clone());
            }
            self.handed.insert(tag);
            self.elsewhere.not_origins(tag);
            // Accepted here: its outcome comes from the stream, from the next owner.
            if let Some(&ct) = self.placed.get(&tag) {
                self.remote.insert(ct, tag);
                if let Some(route) = rooms.routes.get_mut(tag) {
                    route.phase = Phase::Remote;
                }
                waiting += 1;
                if let Some(outcome) = self.early.take(ct) {
                    came.push((ct, tag, outcome));
                }
                continue;
            }
            let Some(route) = rooms.routes.remove(tag) else {
                continue;
            };
            if route.conn != no_conn() {
                log::warn!(
                    "session {}: message {}: handed over with partition {p}, but its place in Redis is unknown here: its result will not come to this connection",
                    route.session,
                    route.id
                );
                rooms.delivery.conns.settled(route.conn);
            }
            rooms.delivery.give_back(&route.platform);
            fx.push(Effect::Finish(route.conn));
        }
        let counts = (sessions.len(), tags.len(), waiting);
        if !sessions.is_empty() {
            fx.push(Effect::Act(Action::HandOver(sessions)));
        }
        // The next owner's outcome came before the hand-over: it goes now.
        for (ct, tag, outcome) in came {
            self.remote.remove(&ct);
            self.remote_outcome(tag, outcome, rooms, fx);
        }
        counts
    }

    /// Durable in Redis, owned elsewhere (or handed over while held, `order.rs`): acked now
    /// (`queued`, `position` the session's messages in flight across the cluster when Redis
    /// accepted it), and its route waits for the outcome.
    pub(super) fn acked_remote(
        &mut self,
        tag: u64,
        cluster: Option<u64>,
        position: Option<usize>,
        rooms: &mut Rooms<'_>,
        fx: &mut Effects,
    ) {
        let Some(d) = rooms.durable.as_deref_mut() else {
            return;
        };
        let (Some(_), Some(cluster)) = (d.forget_waiting(tag), cluster) else {
            return;
        };
        self.remote.insert(cluster, tag);
        let Some(route) = rooms.routes.get_mut(tag) else {
            return;
        };
        route.phase = Phase::Remote;
        let (conn, copies) = (route.conn, std::mem::take(&mut route.copies));
        let now = rooms.delivery.now;
        let delivery = &mut rooms.delivery;
        delivery
            .platforms
            .dedup_accepted(&route.platform, route.fp, now);
        let ack = encode(&ServerOp::Ack {
            id: &route.id,
            session: route.session.as_str(),
            state: "queued",
            position,
        });
        log::debug!("message {tag} durable; its partition is owned elsewhere");
        for c in std::iter::once(conn).chain(copies) {
            delivery.conns.resolve(c, tag, |copy| match copy {
                None => ack.clone(),
                Some((cid, ckey)) => duplicate_ack(cid, ckey),
            });
        }
        // Its outcome came before this report: it goes after the ack.
        if let Some(outcome) = self.early.take(cluster) {
            self.remote.remove(&cluster);
            self.remote_outcome(tag, outcome, rooms, fx);
        }
    }

    /// The owner's outcome of a message acked here goes to its connection (or outbox).
    pub(super) fn remote_outcome(
        &mut self,
        tag: u64,
        outcome: StoredOutcome,
        rooms: &mut Rooms<'_>,
        fx: &mut Effects,
    ) {
        let Some(route) = rooms.routes.remove(tag) else {
            return;
        };
        let delivery = &mut rooms.delivery;
        delivery.conns.settled(route.conn);
        let frame = Frame::new(Body::from_stored(outcome), Some(route.platform.clone()))
            .of_message(tag, route.id.clone());
        let frame = self.mark_if_taken_for_dead(frame, delivery.now);
        self.deliver(delivery, route.conn, &route.platform, frame);
        fx.push(Effect::Finish(route.conn));
    }
}
