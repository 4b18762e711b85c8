//! Per-session order across instances (docs/cluster.md "Order across instances"): the owner
//! submits a partition's messages in the order its inbox stream accepted them, whichever
//! instance accepted them.
//!
//! A message another instance accepted into a partition owned here reaches the bridge
//! through the stream reader (`Arrival::Message`), in inbox order; one accepted here is
//! durable as soon as the journal thread says so, which can be before the reader has
//! brought an earlier message of the same session (seed 37 of tests/simulation_cluster: the
//! later one ran first). So an own accept is **held** until the reader has passed its inbox
//! entry (`Arrival::Reached`, after the messages of the same read) or the partition's load
//! covered it; then it is submitted, behind every earlier entry. The cost: the time for the
//! reader to read the entry, about one of its round trips.
//!
//! What is held stays where it waited for Redis (the bridge's `Durable`, not yet acked), so
//! it counts against `--max-pending-durable`: past that bound a new message is refused
//! `overloaded`. A hand-over or a drain of the partition turns each held message into one
//! acked here and waiting for the next owner's outcome (its `position` as Redis counted
//! it), as any message accepted here for a partition owned elsewhere.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use super::super::routes::{Phase, Routes};
use super::side::ClusterSide;
use super::{Effect, Effects, Rooms};
use crate::cluster::{LoadedPartition, cluster_tag, tag_parts};
use crate::journal::Committed;

/// An own accept waiting for the reader: the bridge's tag, its platform and its ack's
/// `position`.
struct Held {
    tag: u64,
    platform: Arc<str>,
    position: Option<usize>,
}

/// The reader's progress in each owned inbox and the own accepts held behind it.
#[derive(Default)]
pub(in crate::server::bridge) struct Order {
    /// Owned partition → the highest inbox seq the reader has passed or a load covered.
    reached: HashMap<u32, u64>,
    /// Own accepts into owned partitions, durable, not yet submitted, by (partition, seq).
    held: BTreeMap<(u32, u64), Held>,
}

impl Order {
    /// Own accepts held now (for the status).
    pub(in crate::server::bridge) fn held(&self) -> usize {
        self.held.len()
    }

    /// The partition was gained with `loaded`: every message in the load is rebuilt by the
    /// gain, so an own accept among them waits for nothing more (one accepted after the
    /// load has a higher seq than all of them). `placed` maps the bridge's tags to cluster
    /// tags (a loaded message accepted here bears the bridge's tag).
    pub(in crate::server::bridge) fn loaded(
        &mut self,
        p: u32,
        loaded: &LoadedPartition,
        placed: &HashMap<u64, u64>,
    ) {
        let seqs = loaded.recovered.messages.iter().filter_map(|rm| {
            let tag = rm.message.seq;
            tag_parts(tag)
                .or_else(|| placed.get(&tag).and_then(|&ct| tag_parts(ct)))
                .filter(|(q, _)| *q == p)
                .map(|(_, seq)| seq)
        });
        if let Some(top) = seqs.max() {
            self.reach(p, top);
        }
    }

    fn reach(&mut self, p: u32, seq: u64) {
        let r = self.reached.entry(p).or_insert(0);
        *r = (*r).max(seq);
    }

    /// The held messages of `p` up to `seq` that `may_go` (by platform and seq), taken out
    /// in seq order.
    fn take_through(
        &mut self,
        p: u32,
        seq: u64,
        may_go: impl Fn(&str, u64) -> bool,
    ) -> Vec<(u64, Held)> {
        let keys: Vec<(u32, u64)> = (self.held.range((p, 0)..=(p, seq)))
            .filter(|((_, s), h)| may_go(&h.platform, *s))
            .map(|(k, _)| *k)
            .collect();
        keys.into_iter()
            .filter_map(|k| self.held.remove(&k).map(|h| (k.1, h)))
            .collect()
    }
}

impl ClusterSide {
    /// Of a report's durable messages (`c.durable`), those accepted here into a partition
    /// owned here (not draining, nor named to drain by this report) whose inbox entry the
    /// reader has not passed yet, or behind which messages of the partition and platform
    /// wait for outbox room (`room.rs`), are held instead of submitted. Called once the
    /// report's gains are applied.
    pub(super) fn hold_for_order(
        &mut self,
        c: &mut Committed,
        ahead: &HashMap<u64, usize>,
        draining: &[u32],
        routes: &Routes,
    ) {
        let mut held = HashSet::new();
        for &tag in &c.durable {
            let Some((p, seq)) = self.cluster_tag_of(tag).and_then(tag_parts) else {
                continue;
            };
            let owned =
                self.owned.contains(&p) && !self.drains.is_draining(p) && !draining.contains(&p);
            let Some(platform) = routes.get(tag).map(|r| r.platform.clone()) else {
                continue;
            };
            let passed = self.order.reached.get(&p).is_some_and(|&r| r >= seq);
            if !owned || passed && !self.waiting.holds_below(p, &platform, seq) {
                continue;
            }
            log::debug!("message {tag}: held until the reader passes partition {p}'s seq {seq}");
            let position = ahead.get(&tag).copied();
            let h = Held {
                tag,
                platform,
                position,
            };
            self.order.held.insert((p, seq), h);
            held.insert(tag);
        }
        if !held.is_empty() {
            c.durable.retain(|t| !held.contains(t));
        }
        debug_assert!(
            self.order.held.len() <= routes.len(),
            "every held message has its route"
        );
    }

    /// The reader passed `p`'s inbox up to `seq` (every earlier message of it has arrived):
    /// the own accepts held up to there are submitted, in seq order.
    pub(super) fn reached(&mut self, p: u32, seq: u64, rooms: &mut Rooms<'_>, fx: &mut Effects) {
        if !self.owned.contains(&p) {
            return;
        }
        self.order.reach(p, seq);
        if self.drains.is_draining(p) {
            self.unhold(p, rooms, fx);
            return;
        }
        self.release_held(p, rooms, fx);
    }

    /// The own accepts of owned partition `p` held up to where the reader has passed are
    /// submitted, in seq order, but for those behind a message of `p` and their platform
    /// (a lower seq) waiting for outbox room: those go once it is rebuilt (seed 497 of tests/simulation_cluster, cap
    /// 16: an own accept ran before an earlier message of its session loaded with the
    /// partition and waiting for room).
    pub(super) fn release_held(&mut self, p: u32, rooms: &mut Rooms<'_>, fx: &mut Effects) {
        let Some(&seq) = self.order.reached.get(&p) else {
            return;
        };
        let waiting = &self.waiting;
        for (_, h) in
            (self.order).take_through(p, seq, |platform, s| !waiting.holds_below(p, platform, s))
        {
            let durable = rooms.durable.as_deref_mut();
            let Some(message) = durable.and_then(|d| d.forget_waiting(h.tag)) else {
                continue;
            };
            if let Some(route) = rooms.routes.get_mut(h.tag) {
                route.phase = Phase::Submitted;
            }
            fx.push(Effect::Submit(h.tag, message));
        }
    }

    /// A message another instance accepted into owned partition `p` arrived from the
    /// reader (`Arrival::Message`, cluster tag `tag`): the reader has passed every inbox
    /// entry before it, so the own accepts held below its seq are submitted first, ahead
    /// of it. Waiting for the read's `Reached` would submit them after it (seeds 425, 524
    /// and 497 of tests/simulation_cluster: the later message ran first).
    pub(super) fn reached_before(
        &mut self,
        p: u32,
        tag: u64,
        rooms: &mut Rooms<'_>,
        fx: &mut Effects,
    ) {
        if let Some((q, seq)) = tag_parts(tag)
            && q == p
            && seq > 1
        {
            self.reached(p, seq - 1, rooms, fx);
        }
    }

    /// `p` leaves this instance (handed over, or drained): each own accept held for it is
    /// acked now and waits for the next owner's outcome from the stream, as one accepted
    /// for a partition owned elsewhere; the reader's progress there is forgotten.
    pub(super) fn unhold(&mut self, p: u32, rooms: &mut Rooms<'_>, fx: &mut Effects) {
        self.order.reached.remove(&p);
        for (seq, h) in self.order.take_through(p, u64::MAX, |_, _| true) {
            let ct = Some(cluster_tag(p, seq));
            self.acked_remote(h.tag, ct, h.position, rooms, fx);
        }
    }
}
