//! The ownership pass of a cluster member's journal thread (docs/cluster.md "Ownership and
//! rebalancing", "Self-fencing"): heartbeat, the planner's releases, drains, renewals and
//! acquisitions; each acquired partition loaded and reported once the fence margin has
//! passed since its acquisition; the partitions the bridge drained or fenced itself out of.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::{Acquire, Ended, Lease, Member, Place, Record, Report, cluster_tag};
use crate::journal::now_ms;

impl Member {
    /// The owned writes (`started`, outcomes) of partitions just lost, kept for another try,
    /// are dropped now and their outcomes reported unwritten: tried later, they would be
    /// written under the lease of a regain that has loaded the partition without them (a
    /// second outcome for a message rebuilt as interrupted; tests/cluster_three, two runs at
    /// once). `delivered` and `forget` stay: any instance writes them.
    pub(super) fn drop_kept_owned_writes(&mut self, lost: &[u32], c: &mut Report) {
        if lost.is_empty() || self.retry.is_empty() {
            return;
        }
        let places: Vec<Place> = self.retry.iter().map(|r| self.place(r)).collect();
        let kept = std::mem::take(&mut self.retry);
        for (r, place) in kept.into_iter().zip(places) {
            match (&r, place) {
                (Record::Started { .. } | Record::Outcome { .. }, Place::At { partition, .. })
                    if lost.contains(&partition) =>
                {
                    if let Record::Outcome { seq, .. } = r {
                        c.cluster.unwritten_outcomes.push(seq);
                    }
                }
                _ => self.retry.push(r),
            }
        }
    }

    /// The ownership pass: heartbeat, then the planner's releases, renewals and
    /// acquisitions, each gained partition loaded.
    pub(super) fn pass(&mut self, c: &mut Report) {
        if self.check_trust(c) {
            return;
        }
        let now = self.zero.elapsed();
        let registered = self.store.heartbeat().map(|live| self.own.set_live(live));
        if let Err(e) = &registered {
            log::debug!("cluster heartbeat failed: {e}");
        }
        let plan = self.own.plan(now);
        for p in &plan.lost {
            log::warn!(
                "partition {p}: lease not renewed by its fence deadline (TTL less {:?}); given up (its sessions end here, the next owner recovers them)",
                self.own.margin()
            );
        }
        self.drop_kept_owned_writes(&plan.lost, c);
        c.cluster.lost.extend(plan.lost);
        for p in &plan.drain {
            log::info!(
                "partition {p}: draining (more than the fair share of {} held): no new turn starts there; released once its running turns end",
                self.own.fair_share()
            );
        }
        c.cluster.draining.extend(plan.drain);
        for lease in plan.expired {
            log::warn!(
                "partition {}: its drain took longer than {:?}; released now (its running turns end here, the next owner recovers them)",
                lease.partition,
                self.store.drain()
            );
            if let Err(e) = self.store.release(&lease) {
                log::debug!("partition {}: release failed: {e}", lease.partition);
            }
            c.cluster.lost.push(lease.partition);
        }
        for lease in plan.release {
            match self.store.release(&lease) {
                Ok(_) => log::info!(
                    "partition {}: released (more than the fair share of {} held)",
                    lease.partition,
                    self.own.fair_share()
                ),
                // Its TTL frees it anyway.
                Err(e) => log::debug!("partition {}: release failed: {e}", lease.partition),
            }
            c.cluster.lost.push(lease.partition);
        }
        self.renew(&plan.renew, now, c);
        let mut candidates = plan.acquire;
        while !candidates.is_empty() {
            let answers = match self.store.acquire_all(&candidates) {
                Ok(answers) => answers,
                // Redis is down: the next pass tries again.
                Err(e) => {
                    log::debug!("cluster acquisitions failed: {e}");
                    break;
                }
            };
            let mut taken = 0;
            for (p, answer) in candidates.iter().zip(answers) {
                match answer {
                    Ok(Acquire::Acquired(lease)) => self.gain(lease, now, c),
                    Ok(Acquire::Taken { .. }) => taken += 1,
                    Err(e) => log::debug!("partition {p}: acquire failed: {e}"),
                }
            }
            // As many again as were taken, further on: the share is found in this pass.
            candidates = self.own.more_candidates(taken);
        }
        c.cluster.leases = (self.own.deadlines())
            .map(|(l, at)| (l.partition, l.epoch, at))
            .collect();
        // A stopped gateway's agents end at the earliest of them (`cluster/leash.rs`).
        let earliest = c.cluster.leases.iter().map(|(_, _, at)| *at).min();
        super::super::leash::extend(earliest.map(|at| self.zero + at));
        if registered.is_ok() {
            let registered_for = self.registered_for(now);
            self.registered_until = Some(Instant::now() + registered_for);
            if std::mem::take(&mut self.lapse_told) {
                log::info!("cluster: heartbeat through again: new messages are accepted");
            }
            c.cluster.registered_for = Some(registered_for);
        }
    }

    /// Whether the registry holds this instance live now by the last heartbeat that went
    /// through: accepts are written only then (`Member::commit`).
    pub(super) fn registered_now(&self) -> bool {
        self.registered_until
            .is_some_and(|until| Instant::now() < until)
    }

    /// How long the registry holds this instance live at least, by a heartbeat sent at
    /// `sent`: the lease less the time since, and a quarter lease of margin (the others
    /// judge the registry's expiry by their own clocks; the report takes a while to reach
    /// the bridge).
    fn registered_for(&self, sent: Duration) -> Duration {
        let lease = self.store.lease();
        let spent = self.zero.elapsed().saturating_sub(sent);
        lease.saturating_sub(spent + lease / 4)
    }

    /// Renews `leases` (sent at `now`): every renewal in one round trip; one answered past
    /// the fence deadline it was to move is given up.
    fn renew(&mut self, leases: &[Lease], now: Duration, c: &mut Report) {
        // Every renewal in one round trip, so the leases held expire together should this
        // instance die (a takeover waits for the last one), however loaded Redis is.
        match self.store.renew_all(leases) {
            Ok(answers) => {
                // A renewal answered past the fence deadline it was to move is too late:
                // the bridge may have fenced itself out already (at the same deadline).
                let answered = self.zero.elapsed();
                for (lease, answer) in leases.iter().zip(answers) {
                    match answer {
                        Ok(())
                            if (self.own.fence_at(lease.partition))
                                .is_some_and(|at| at <= answered) =>
                        {
                            let p = lease.partition;
                            log::warn!(
                                "partition {p}: renewed too late (past its fence deadline); given up (the next owner recovers it)"
                            );
                            self.own.fenced(p);
                            self.drop_kept_owned_writes(&[p], c);
                            c.cluster.lost.push(p);
                        }
                        Ok(()) => self.own.renewed(lease.partition, now),
                        Err(e) if e.is_fenced() => {
                            log::warn!("{e}; the partition is dropped");
                            if self.own.fenced(lease.partition) {
                                c.cluster.fenced.push(lease.partition);
                            }
                        }
                        Err(e) => {
                            log::debug!("partition {}: renewal failed: {e}", lease.partition);
                        }
                    }
                }
            }
            Err(e) => log::debug!("cluster renewals failed: {e}"),
        }
    }

    /// Releases the partitions whose drain the bridge finished (each was handed over there
    /// already) and drops those it fenced itself out of; reported `lost` so that the reader
    /// stops reading their inboxes.
    pub(super) fn release_drained(&mut self, c: &mut Report) {
        if let Some(rx) = &self.drained {
            self.to_release.extend(rx.try_iter());
        }
        for ended in std::mem::take(&mut self.to_release) {
            let p = match ended {
                Ended::Drained(p) => p,
                Ended::Fenced(p, epoch) => {
                    self.self_fenced(p, epoch, c);
                    continue;
                }
            };
            let Some(lease) = self.own.drained(p) else {
                log::debug!("partition {p}: drained, but no longer held as draining");
                continue;
            };
            match self.store.release(&lease) {
                Ok(_) => log::info!("partition {p}: drained and released"),
                // Its TTL frees it anyway.
                Err(e) => log::warn!("partition {p}: drained, but its release failed: {e}"),
            }
            c.cluster.lost.push(p);
        }
    }

    /// The bridge fenced itself out of `p`'s lease of `epoch`: dropped here too, unless
    /// another epoch is held now (lost and acquired again since), not released (its TTL
    /// ends it: the turns being stopped have until then), its kept owned writes dropped.
    pub(super) fn self_fenced(&mut self, p: u32, epoch: u64, c: &mut Report) {
        if self.own.lease(p).is_none_or(|l| l.epoch != epoch) {
            return;
        }
        log::warn!(
            "partition {p}: the bridge fenced itself out (lease not renewed by its fence deadline); dropped, left to expire"
        );
        self.own.fenced(p);
        self.drop_kept_owned_writes(&[p], c);
        c.cluster.lost.push(p);
    }

    /// A lease acquired at `sent`: held (and renewed) from now on, but loaded and reported
    /// only once the fence margin has passed, so that no turn of it starts before the
    /// previous owner's lease expired plus that margin (the previous owner stopped its
    /// turns the margin before expiry, on its own clock: docs/cluster.md "Self-fencing").
    /// Accepts into it meanwhile are reported `remote`; the load brings them.
    pub(super) fn gain(&mut self, lease: Lease, sent: Duration, c: &mut Report) {
        self.own.acquired(lease.clone(), sent);
        let margin = self.own.margin();
        if margin.is_zero() {
            self.load(lease, c);
        } else {
            self.waiting.push((lease, Instant::now() + margin));
        }
    }

    /// When the next acquired partition is to be loaded.
    pub(super) fn next_load(&self) -> Option<Instant> {
        self.waiting.iter().map(|(_, at)| *at).min()
    }

    /// Whether `partition` is held but not yet loaded ([`Member::gain`]).
    pub(super) fn is_waiting(&self, partition: u32) -> bool {
        self.waiting.iter().any(|(l, _)| l.partition == partition)
    }

    /// Loads the acquired partitions whose fence margin has passed and that are still held
    /// under the lease acquired (not lost or fenced meanwhile).
    pub(super) fn load_waiting(&mut self, c: &mut Report) {
        let now = Instant::now();
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.waiting)
            .into_iter()
            .partition(|(_, at)| *at <= now);
        self.waiting = later;
        for (lease, _) in due {
            if self.own.lease(lease.partition) == Some(&lease) {
                self.load(lease, c);
            }
        }
    }

    /// The partition of `lease` (held) is loaded and reported gained, its messages
    /// renumbered by the tags the bridge knows them by. A load that fails gives it back.
    fn load(&mut self, lease: Lease, c: &mut Report) {
        let p = lease.partition;
        match self.store.load_partition(p, now_ms()) {
            Ok(mut loaded) => {
                // Only the origins that are other live instances stay: their results go
                // there; this instance's own and a dead one's go to this one's bridges.
                let live = self.store.live_instances().unwrap_or_default();
                let me = self.store.instance().to_owned();
                loaded
                    .origins
                    .retain(|_, o| *o != me && live.iter().any(|l| l == o));
                let mut origins = HashMap::with_capacity(loaded.origins.len());
                for rm in &mut loaded.recovered.messages {
                    let seq = rm.message.seq;
                    let tag = self
                        .back
                        .get(&(p, seq))
                        .copied()
                        .unwrap_or_else(|| cluster_tag(p, seq));
                    if let Some(o) = loaded.origins.remove(&seq) {
                        origins.insert(tag, o);
                    }
                    rm.message.seq = tag;
                }
                loaded.origins = origins;
                loaded.recovered.max_seq = 0;
                log::info!(
                    "partition {p}: gained (lease {}), {} message(s) in flight",
                    lease.token,
                    loaded.recovered.messages.len()
                );
                c.cluster.gained.push((p, loaded));
            }
            Err(e) => {
                log::error!("partition {p}: gained but its load failed: {e}; released");
                self.own.fenced(p);
                let _ = self.store.release(&lease);
            }
        }
    }

    /// A graceful stop: the leases go back and the registry forgets this instance, so the
    /// others take its partitions at their next pass instead of after the TTL.
    pub(super) fn leave(&mut self) {
        let held: Vec<Lease> = self.own.held().cloned().collect();
        for lease in &held {
            let _ = self.store.release(lease);
            self.own.fenced(lease.partition);
        }
        if let Err(e) = self.store.leave() {
            log::debug!("cluster leave failed: {e}");
        }
    }
}
