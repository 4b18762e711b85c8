//! Self-fencing (`--cluster`, docs/cluster.md "Self-fencing"): an owner that could not renew
//! a partition's lease stops that partition's turns before the lease can expire, on its own
//! clock, without waiting for the journal thread (which may be stuck in a Redis round trip).
//!
//! Each ownership pass reports every lease held with its **fence deadline**
//! ([`ClusterReport::leases`](crate::cluster::ClusterReport): the last successful renewal's
//! send time plus the lease less the margin, `Ownership::fence_at`). The bridge keeps the
//! newest one of each partition it owns; on every tick (and every journal report) a partition
//! past its deadline is handed over at once, as a lost one is: its running turns are
//! cancelled (the agent told, as `/stop` tells it; its result discarded), its held turns never
//! start, its messages stay in Redis for the next owner, which fails a started one
//! `interrupted by restart` (or runs it again with `--resume-interrupted`). The journal
//! thread is told ([`ClusterRequest::Fenced`]) and drops the lease too, so the two never
//! disagree about who owns it: a renewal it got back after the deadline is given up there as
//! well (`member/mod.rs`).

use std::collections::HashMap;
use std::time::Duration;

use super::super::Action;
use super::side::ClusterSide;
use super::{Effect, Effects, Rooms};
use crate::cluster::ClusterRequest;

/// The fence deadlines of the partitions owned here.
#[derive(Default)]
pub(in crate::server::bridge) struct Fences {
    /// Partition → the epoch of its lease and its fence deadline (the bridge's clock).
    at: HashMap<u32, (u64, Duration)>,
    /// Partitions fenced here since the start.
    fenced: u64,
}

impl Fences {
    /// The ownership pass's leases: the deadline of each partition owned here moves.
    pub(in crate::server::bridge) fn update(
        &mut self,
        leases: &[(u32, u64, Duration)],
        owned: &std::collections::HashSet<u32>,
    ) {
        for &(p, epoch, deadline) in leases {
            if owned.contains(&p) {
                self.at.insert(p, (epoch, deadline));
            }
        }
        self.at.retain(|p, _| owned.contains(p));
    }

    /// The partition was handed over: nothing to fence any more.
    pub(in crate::server::bridge) fn forget(&mut self, partition: u32) {
        self.at.remove(&partition);
    }

    /// The earliest deadline, for the shell's timer.
    pub(in crate::server::bridge) fn next(&self) -> Option<Duration> {
        self.at.values().map(|(_, at)| *at).min()
    }

    /// Partitions fenced here since the start.
    pub(in crate::server::bridge) fn count(&self) -> u64 {
        self.fenced
    }
}

impl ClusterSide {
    /// The earliest fence deadline of the partitions owned here (the bridge's next tick).
    pub(in crate::server::bridge) fn next_fence(&self) -> Option<Duration> {
        self.fences.next()
    }

    /// The owned partitions past their fence deadline now stop their turns: each is handed
    /// over, and the journal thread told.
    pub(in crate::server::bridge) fn fence(&mut self, mut rooms: Rooms<'_>) -> Effects {
        let mut fx = Effects::new();
        for (p, request) in self.fence_due(rooms.delivery.now) {
            self.hand_over(p, &mut rooms, &mut fx);
            fx.push(Effect::Act(Action::Cluster(request)));
        }
        fx
    }

    /// The owned partitions past their fence deadline at `now`, in order, each with the
    /// request that tells the journal thread; forgotten here (the caller hands each over).
    pub(super) fn fence_due(&mut self, now: Duration) -> Vec<(u32, ClusterRequest)> {
        let fences = &mut self.fences;
        let mut due: Vec<(u32, u64)> = (fences.at.iter())
            .filter(|(_, (_, at))| *at <= now)
            .map(|(p, (epoch, _))| (*p, *epoch))
            .collect();
        due.sort_unstable();
        for (p, epoch) in &due {
            fences.at.remove(p);
            fences.fenced += 1;
            log::warn!(
                "partition {p}: lease (epoch {epoch}) not renewed by its fence deadline; its running turns are stopped and it is handed over (self-fencing)"
            );
        }
        due.into_iter()
            .map(|(partition, epoch)| (partition, ClusterRequest::Fenced { partition, epoch }))
            .collect()
    }
}
