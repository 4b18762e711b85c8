//! The bridge's side of a planned release (`--cluster`, docs/cluster.md "Shedding"): the
//! journal thread holds more than the fair share and names a partition to **drain**
//! ([`ClusterReport::draining`](crate::cluster::ClusterReport)). No turn that is running
//! there is cut off:
//!
//! - no new turn starts there: a held turn of its sessions is never released (its `started`
//!   record is not written — the held-turn gate), so the next owner finds it not started;
//! - a session with no turn in progress (none started here whose outcome record is not yet
//!   durable) is handed over at once, as a lost partition's are (`ClusterSide::hand_over`): its
//!   queued and held messages end here without outcome records and stay in Redis;
//! - a session whose turn is running is handed over once that turn's outcome record is
//!   durable (and its result sent), its next message held meanwhile;
//! - messages accepted into the partition from now on are not queued here (the journal
//!   thread reports them `remote`, the reader's inbox arrivals are ignored): the next owner
//!   loads them;
//! - when no turn is left, the partition is no longer owned here and the journal thread is
//!   asked to release its lease ([`Action::ReleasePartition`]); the instance whose share grew
//!   acquires it on its next pass and loads it.
//!
//! The drain is bounded by the journal thread (`ClusterConfig::drain`, default 30 s): past
//! it the partition is released and reported lost, and handed over as any lost one (its
//! running turns cancelled; the next owner fails them `interrupted by restart`).

use std::collections::{HashMap, HashSet};

use super::super::Action;
use super::super::durable::Durable;
use super::super::routes::Routes;
use super::side::ClusterSide;
use super::{Effect, Effects, Rooms};
use crate::liveness::ClusterStatus;
use crate::message::SessionKey;

/// The drains in progress and the turns they wait for.
#[derive(Default)]
pub(in crate::server::bridge) struct Drains {
    /// Partitions being drained, and the messages handed over so far by each drain.
    draining: HashMap<u32, usize>,
    /// Partitions the journal named to drain, started at the end of its report (after the
    /// report's own submissions, as hand-overs are).
    pending: Vec<u32>,
    /// Turns whose `started` record was written here (in any owned partition): tag → its
    /// partition and session. An entry whose message has neither a route nor a terminal
    /// event waiting for its outcome record is over (pruned when seen).
    running: HashMap<u64, (u32, SessionKey)>,
    /// Partitions drained and released since the start, and the messages they handed over.
    drained: (u64, u64),
}

impl Drains {
    /// Whether `partition` is being drained.
    pub(in crate::server::bridge) fn is_draining(&self, partition: u32) -> bool {
        self.draining.contains_key(&partition)
    }

    /// The partition was handed over (lost or fenced): its drain, if any, is over.
    pub(in crate::server::bridge) fn forget(&mut self, partition: u32) {
        self.draining.remove(&partition);
        self.pending.retain(|p| *p != partition);
        self.running.retain(|_, (p, _)| *p != partition);
    }

    /// Partitions being drained now (to be released to another instance), in order; and
    /// those drained and released since the start (the fair share shrank), and the messages
    /// they handed over to their next owner.
    pub(in crate::server::bridge) fn fill_status(&self, s: &mut ClusterStatus) {
        s.draining = self.draining.keys().copied().collect();
        s.draining.sort_unstable();
        (s.drained_partitions, s.drained_messages) = self.drained;
    }

    /// The journal named these partitions to drain.
    pub(in crate::server::bridge) fn ask(&mut self, partitions: Vec<u32>) {
        self.pending.extend(partitions);
    }
}

impl ClusterSide {
    /// The held-turn gate: a turn of `tag` was claimed (its `started` record is about to be
    /// written). True if its partition is draining: the record is not written and the turn
    /// stays held until its session is handed over. Else the turn is counted as running in
    /// its partition until its outcome record is durable (an entry whose message has no
    /// route in `routes` and no terminal event waiting in `durable` is pruned). Never under
    /// `--data-dir` alone (no partition owned), where a turn start pays nothing for it.
    pub(in crate::server::bridge) fn turn_gate(
        &mut self,
        tag: u64,
        session: &SessionKey,
        routes: &Routes,
        durable: Option<&Durable>,
    ) -> bool {
        let Some(d) = durable.filter(|_| self.owns_partitions()) else {
            return false;
        };
        let p = self.partition_of_route(tag, session);
        if self.drains.is_draining(p) {
            log::debug!("session {session}: partition {p} is draining; its turn is not started");
            return true;
        }
        let running = &mut self.drains.running;
        running.insert(tag, (p, session.clone()));
        if running.len() > 2 * routes.len() + 64 {
            running.retain(|&t, _| routes.contains(t) || d.is_unjournaled(t));
        }
        false
    }
}

impl ClusterSide {
    /// Starts the drains the journal asked for and moves every drain on: hands over the
    /// sessions with no turn in progress, and finishes a drain with none left. Called at the
    /// end of each journal report (an outcome record made durable may end a drain).
    pub(super) fn drain_step(&mut self, rooms: &mut Rooms<'_>, fx: &mut Effects) {
        if rooms.durable.is_none() {
            return;
        }
        for p in std::mem::take(&mut self.drains.pending) {
            if self.owned.contains(&p) {
                self.drains.draining.entry(p).or_insert(0);
            }
        }
        if self.drains.draining.is_empty() {
            return;
        }
        let mut ps: Vec<u32> = self.drains.draining.keys().copied().collect();
        ps.sort_unstable();
        for p in ps {
            self.drain_one(p, rooms, fx);
        }
    }

    fn drain_one(&mut self, p: u32, rooms: &mut Rooms<'_>, fx: &mut Effects) {
        let Some(unjournaled) = rooms.durable.as_deref() else {
            return;
        };
        let routes = &rooms.routes;
        let busy: Vec<u64> = (self.drains.running.iter())
            .filter(|(t, (q, _))| {
                *q == p && (routes.contains(**t) || unjournaled.is_unjournaled(**t))
            })
            .map(|(t, _)| *t)
            .collect();
        let keep: HashSet<SessionKey> = busy
            .iter()
            .filter_map(|t| self.drains.running.get(t).map(|(_, s)| s.clone()))
            .collect();
        let drains = &mut self.drains;
        drains
            .running
            .retain(|t, (q, _)| *q != p || busy.contains(t));
        let (_, handed, _) = self.hand_over_sessions(p, &keep, rooms, fx);
        if rooms.durable.is_none() {
            return;
        }
        let drains = &mut self.drains;
        let so_far = drains.draining.entry(p).or_insert(0);
        *so_far += handed;
        if !busy.is_empty() {
            return;
        }
        let handed = *so_far;
        drains.draining.remove(&p);
        drains.drained.0 += 1;
        drains.drained.1 += handed as u64;
        self.owned.remove(&p);
        log::info!(
            "partition {p}: drained: no turn left running here, {handed} message(s) handed over to its next owner; its lease is released"
        );
        fx.push(Effect::Act(Action::ReleasePartition(p)));
    }
}
