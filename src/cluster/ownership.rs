//! Which partitions this instance owns (`--cluster`): a sans-IO planner that the journal
//! thread drives with its clock and the store's answers (docs/cluster.md, "Ownership and
//! rebalancing").
//!
//! Every pass ([`Ownership::plan`]) says what to send: renewals of the leases held, the
//! surplus to release (or, with [`Ownership::set_drain`], to drain first) when there are
//! more partitions held than the fair share (`ceil(partitions / live instances)`), a few free partitions to try to acquire when there
//! are fewer, and the leases to consider **lost** — those not renewed successfully for a
//! TTL less the **fence margin** ([`Ownership::fence_at`]), counted from when the last
//! successful renewal was *sent*, so that this instance gives a partition up (and stops its
//! turns: the bridge fences itself at the same deadline) before Redis can give it to
//! another. The fenced scripts catch anything written after that anyway; giving up in time
//! keeps an owner cut off from Redis from running turns the next owner runs too.

use std::collections::BTreeMap;
use std::time::Duration;

use super::store::{Lease, partition_of};

/// The fence margin when none is configured: a tenth of the lease.
pub(crate) fn default_margin(lease: Duration) -> Duration {
    lease / 10
}

/// What one pass asks for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Leases to renew now.
    pub renew: Vec<Lease>,
    /// Leases to give up now (more than the fair share is held, and no drain is asked for:
    /// see [`Ownership::set_drain`]).
    pub release: Vec<Lease>,
    /// Partitions to drain before they are given up (more than the fair share is held and
    /// [`Ownership::set_drain`] is on): they stay held and renewed until
    /// [`Ownership::drained`] or the drain's bound.
    pub drain: Vec<u32>,
    /// Drains past their bound: give these up now, as if lost (their running turns end
    /// here without outcomes; the next owner recovers them).
    pub expired: Vec<Lease>,
    /// Partitions to try to acquire.
    pub acquire: Vec<u32>,
    /// Partitions lost: not renewed by their fence deadline ([`Ownership::fence_at`]).
    /// Stop starting turns there, drop them.
    pub lost: Vec<u32>,
}

#[derive(Clone, Debug)]
struct Held {
    lease: Lease,
    /// When the last renewal (or the acquisition) that succeeded was sent.
    renewed_sent: Duration,
    /// When the last renewal was sent (succeeded or not yet answered).
    last_sent: Duration,
    /// Since when it is drained to be given up (see [`Plan::drain`]).
    draining: Option<Duration>,
}

/// The partitions one instance holds, and when to renew, shed, take or give them up.
#[derive(Clone, Debug)]
pub struct Ownership {
    partitions: u32,
    lease: Duration,
    /// The fence margin: a lease is given up this long before it can expire.
    margin: Duration,
    held: BTreeMap<u32, Held>,
    /// Live instances, this one included, as the registry last said.
    live: u32,
    /// Where the search for free partitions goes on (starts at a hash of the name, so
    /// instances do not race for the same ones).
    cursor: u32,
    /// Whether a pass releases what is held beyond the fair share.
    shed: bool,
    /// Partitions the search for free ones has looked at in this pass.
    swept: u32,
    /// With shedding: drain the surplus first, for at most this long (None: release at once).
    drain: Option<Duration>,
}

impl Ownership {
    /// An instance that holds nothing yet.
    pub fn new(instance: &str, partitions: u32, lease: Duration) -> Ownership {
        debug_assert!(partitions > 0);
        Ownership {
            partitions,
            lease,
            margin: default_margin(lease),
            held: BTreeMap::new(),
            live: 1,
            cursor: partition_of(instance, partitions),
            shed: true,
            swept: 0,
            drain: None,
        }
    }

    /// How often [`Ownership::plan`] should run: a third of the TTL, so two renewals can
    /// fail before a lease runs out.
    pub fn pass_every(&self) -> Duration {
        self.lease / 3
    }

    /// The fence margin (default [`default_margin`]: a tenth of the lease): a lease not
    /// renewed successfully is given up, and its partition's turns stopped, at `lease −
    /// margin` after the last successful renewal was sent; and a gained partition starts no
    /// turn until `margin` after its acquisition. It covers the clocks' disagreement over
    /// one lease and the time a turn takes to stop (docs/cluster.md, "Self-fencing").
    pub fn set_margin(&mut self, margin: Duration) {
        debug_assert!(margin < self.lease / 3, "checked at start-up");
        self.margin = margin;
    }

    /// The fence margin ([`Ownership::set_margin`]).
    pub fn margin(&self) -> Duration {
        self.margin
    }

    /// When `partition`, if held, must have stopped its turns unless a renewal sent before
    /// then succeeds: the last successful renewal's (or the acquisition's) send time plus
    /// the lease less the margin, on the planner's clock. The pass gives it up then, and the
    /// bridge fences itself then without waiting for the pass.
    pub fn fence_at(&self, partition: u32) -> Option<Duration> {
        self.held
            .get(&partition)
            .map(|h| h.renewed_sent + self.lease.saturating_sub(self.margin))
    }

    /// Every held lease with its [`Ownership::fence_at`] deadline.
    pub fn deadlines(&self) -> impl Iterator<Item = (&Lease, Duration)> {
        let keep = self.lease.saturating_sub(self.margin);
        self.held
            .values()
            .map(move |h| (&h.lease, h.renewed_sent + keep))
    }

    /// Whether passes release the surplus over the fair share (default true). Off, an
    /// instance keeps what it holds and a joining one takes only what comes free.
    pub fn set_shed(&mut self, shed: bool) {
        self.shed = shed;
    }

    /// Whether the surplus is drained before it is released, and for how long at most
    /// (default `None`: released at once). A draining partition stays held and renewed
    /// until [`Ownership::drained`] says its drain is over, or until `limit` has passed
    /// since it began ([`Plan::expired`]); it counts as held for the acquisitions (an
    /// instance never holds more than it did) and not for the surplus (it is not picked
    /// twice).
    pub fn set_drain(&mut self, limit: Option<Duration>) {
        self.drain = limit;
    }

    /// Whether `partition` is held and being drained.
    pub fn is_draining(&self, partition: u32) -> bool {
        self.held
            .get(&partition)
            .is_some_and(|h| h.draining.is_some())
    }

    /// The drain of `partition` is over: it is no longer held, and its lease is returned to
    /// be released. `None` if it is not held or not draining (a lost, fenced or expired
    /// drain already gave it up).
    pub fn drained(&mut self, partition: u32) -> Option<Lease> {
        if !self.is_draining(partition) {
            return None;
        }
        self.held.remove(&partition).map(|h| h.lease)
    }

    /// The registry's count of live instances (this one included; at least 1).
    pub fn set_live(&mut self, live: u32) {
        self.live = live.max(1);
    }

    /// The partitions this instance should hold: `ceil(partitions / live)`.
    pub fn fair_share(&self) -> u32 {
        self.partitions.div_ceil(self.live)
    }

    /// The partitions held now, in order.
    pub fn held(&self) -> impl Iterator<Item = &Lease> {
        self.held.values().map(|h| &h.lease)
    }

    /// The lease of `partition`, if it is held now.
    pub fn lease(&self, partition: u32) -> Option<&Lease> {
        self.held.get(&partition).map(|h| &h.lease)
    }

    /// Whether `partition` is held now.
    pub fn holds(&self, partition: u32) -> bool {
        self.held.contains_key(&partition)
    }

    /// The pass at `now` (the caller's monotonic clock).
    pub fn plan(&mut self, now: Duration) -> Plan {
        let mut plan = Plan::default();
        let lease = self.lease;
        let lost: Vec<u32> = self
            .held
            .keys()
            .filter(|p| self.fence_at(**p).is_some_and(|at| now >= at))
            .copied()
            .collect();
        for p in &lost {
            self.held.remove(p);
        }
        plan.lost = lost;
        let share = self.fair_share() as usize;
        // The surplus goes from the top, so the instances' shares settle instead of swapping.
        if self.shed {
            self.shed_surplus(now, share, &mut plan);
        }
        for h in self.held.values_mut() {
            if now.saturating_sub(h.last_sent) >= lease / 3 {
                h.last_sent = now;
                plan.renew.push(h.lease.clone());
            }
        }
        self.swept = 0;
        plan.acquire = self.candidates(share.saturating_sub(self.held.len()));
        debug_assert!(!self.shed || self.kept() <= share);
        debug_assert!(self.drain.is_some() || self.held.values().all(|h| h.draining.is_none()));
        plan
    }

    /// Up to `n` more partitions to try in this pass, after some of its acquisitions found
    /// theirs taken: the search goes on from where it stopped, so one pass finds every free
    /// partition it wants (a takeover does not wait a pass for each taken one it met). A
    /// pass tries each partition at most once.
    pub fn more_candidates(&mut self, n: usize) -> Vec<u32> {
        self.candidates(n)
    }

    fn candidates(&mut self, mut want: usize) -> Vec<u32> {
        let mut found = Vec::new();
        while want > 0 && self.swept < self.partitions {
            let p = self.cursor;
            self.cursor = (self.cursor + 1) % self.partitions;
            self.swept += 1;
            if !self.held.contains_key(&p) {
                found.push(p);
                want -= 1;
            }
        }
        found
    }

    /// Held partitions not being drained.
    fn kept(&self) -> usize {
        self.held.values().filter(|h| h.draining.is_none()).count()
    }

    /// Releases (or starts draining) what is held beyond `share`, highest first, and gives
    /// up the drains past their bound.
    fn shed_surplus(&mut self, now: Duration, share: usize, plan: &mut Plan) {
        let Some(limit) = self.drain else {
            while self.held.len() > share {
                if let Some((_, h)) = self.held.pop_last() {
                    plan.release.push(h.lease);
                }
            }
            return;
        };
        let mut kept = self.kept();
        for (p, h) in self.held.iter_mut().rev() {
            if kept <= share {
                break;
            }
            if h.draining.is_none() {
                h.draining = Some(now);
                plan.drain.push(*p);
                kept -= 1;
            }
        }
        let expired: Vec<u32> = self
            .held
            .iter()
            .filter(|(_, h)| h.draining.is_some_and(|t| now.saturating_sub(t) >= limit))
            .map(|(p, _)| *p)
            .collect();
        for p in expired {
            if let Some(h) = self.held.remove(&p) {
                plan.expired.push(h.lease);
            }
        }
    }

    /// An acquisition sent at `sent` succeeded.
    pub fn acquired(&mut self, lease: Lease, sent: Duration) {
        debug_assert!(lease.partition < self.partitions);
        self.held.insert(
            lease.partition,
            Held {
                lease,
                renewed_sent: sent,
                last_sent: sent,
                draining: None,
            },
        );
    }

    /// A renewal of `partition` sent at `sent` succeeded.
    pub fn renewed(&mut self, partition: u32, sent: Duration) {
        if let Some(h) = self.held.get_mut(&partition) {
            h.renewed_sent = h.renewed_sent.max(sent);
        }
    }

    /// The store refused a write or renewal of `partition` as fenced: it is another's.
    /// True if it was held (the caller drops it).
    pub fn fenced(&mut self, partition: u32) -> bool {
        self.held.remove(&partition).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_millis(3000);

    fn lease(p: u32, epoch: u64) -> Lease {
        Lease {
            partition: p,
            token: format!("a:{epoch}"),
            epoch,
        }
    }

    /// One pass where every acquisition succeeds (the store is empty) and every renewal too.
    fn pass_all_granted(o: &mut Ownership, now: Duration) -> Plan {
        let plan = o.plan(now);
        for p in &plan.acquire {
            o.acquired(lease(*p, 1), now);
        }
        for l in &plan.renew {
            o.renewed(l.partition, now);
        }
        plan
    }

    #[test]
    fn alone_it_takes_every_partition_and_a_second_instance_halves_its_share() {
        let mut o = Ownership::new("a", 8, LEASE);
        let plan = pass_all_granted(&mut o, Duration::ZERO);
        assert_eq!(plan.acquire.len(), 8);
        assert_eq!(o.held().count(), 8);
        o.set_live(2);
        let plan = o.plan(Duration::from_millis(1000));
        assert_eq!(
            plan.release.iter().map(|l| l.partition).collect::<Vec<_>>(),
            vec![7, 6, 5, 4],
            "the surplus goes from the top"
        );
        assert_eq!(o.held().count(), 4);
        assert_eq!(plan.renew.len(), 4, "what is kept is renewed");
        assert!(plan.acquire.is_empty());
        o.set_live(3);
        assert_eq!(o.fair_share(), 3);
        assert_eq!(o.plan(Duration::from_millis(2000)).release.len(), 1);
    }

    #[test]
    fn a_lease_not_renewed_for_its_ttl_is_given_up_before_redis_can_give_it_away() {
        let mut o = Ownership::new("a", 2, LEASE);
        pass_all_granted(&mut o, Duration::ZERO);
        // The renewals are sent but never answered (Redis is unreachable)...
        let plan = o.plan(Duration::from_millis(1000));
        assert_eq!(plan.renew.len(), 2);
        assert!(plan.lost.is_empty());
        // ...so the last success is still the acquisition at 0: before 0 + TTL (less the
        // margin), the partitions are dropped.
        let plan = o.plan(Duration::from_millis(2700));
        assert_eq!(plan.lost, vec![0, 1]);
        assert_eq!(o.held().count(), 0);
        // And it tries to take them again.
        assert_eq!(plan.acquire.len(), 2);
    }

    /// Self-fencing: the deadline is the last successful renewal's send time plus the lease
    /// less the margin, the pass gives the lease up exactly then, and a renewal moves it.
    #[test]
    fn the_fence_deadline_is_the_lease_less_the_margin_after_the_last_renewal_sent() {
        let mut o = Ownership::new("a", 1, LEASE);
        assert_eq!(o.margin(), Duration::from_millis(300), "a tenth by default");
        o.set_margin(Duration::from_millis(500));
        pass_all_granted(&mut o, Duration::ZERO);
        let t = Duration::from_millis;
        assert_eq!(o.fence_at(0), Some(t(2500)));
        o.renewed(0, t(1000));
        assert_eq!(o.fence_at(0), Some(t(3500)));
        assert_eq!(
            o.deadlines()
                .map(|(l, at)| (l.partition, at))
                .collect::<Vec<_>>(),
            vec![(0, t(3500))]
        );
        assert!(o.plan(t(3499)).lost.is_empty());
        assert_eq!(o.plan(t(3500)).lost, vec![0]);
        assert_eq!(o.fence_at(0), None);
    }

    #[test]
    fn a_clock_jump_past_the_ttl_loses_everything_at_once() {
        let mut o = Ownership::new("a", 4, LEASE);
        pass_all_granted(&mut o, Duration::ZERO);
        let plan = o.plan(Duration::from_secs(60));
        assert_eq!(plan.lost.len(), 4);
        assert!(plan.renew.is_empty(), "a lost lease is not renewed");
    }

    #[test]
    fn renewals_go_every_third_of_the_ttl_and_success_moves_the_deadline() {
        let mut o = Ownership::new("a", 1, LEASE);
        pass_all_granted(&mut o, Duration::ZERO);
        assert!(o.plan(Duration::from_millis(500)).renew.is_empty());
        let t = Duration::from_millis(1000);
        assert_eq!(o.plan(t).renew.len(), 1);
        o.renewed(0, t);
        // 2.9 s after the acquisition but 1.9 s after the renewal: still held.
        let plan = o.plan(Duration::from_millis(2900));
        assert!(plan.lost.is_empty());
        assert!(o.holds(0));
    }

    #[test]
    fn without_shedding_the_surplus_is_kept_and_renewed() {
        let mut o = Ownership::new("a", 4, LEASE);
        o.set_shed(false);
        pass_all_granted(&mut o, Duration::ZERO);
        o.set_live(2);
        let plan = o.plan(Duration::from_millis(1000));
        assert!(plan.release.is_empty());
        assert_eq!((plan.renew.len(), o.held().count()), (4, 4));
        assert!(plan.acquire.is_empty());
    }

    /// A pass whose candidates were taken searches on for as many again, never one it
    /// tried or holds, and stops once every partition was looked at.
    #[test]
    fn a_pass_searches_on_past_taken_partitions_each_once() {
        let mut o = Ownership::new("a", 8, LEASE);
        o.set_live(2);
        let first = o.plan(Duration::ZERO).acquire;
        assert_eq!(first.len(), 4, "the share");
        o.acquired(lease(first[0], 1), Duration::ZERO);
        // Three were taken: three more, further on.
        let more = o.more_candidates(3);
        assert_eq!(more.len(), 3);
        assert!(
            more.iter().all(|p| !first.contains(p)),
            "{first:?} {more:?}"
        );
        let rest = o.more_candidates(3);
        assert_eq!(rest.len(), 1, "one partition left unlooked-at");
        let mut all: Vec<u32> = [first, more, rest].concat();
        all.sort_unstable();
        assert_eq!(all, (0..8).collect::<Vec<_>>());
        assert!(
            o.more_candidates(3).is_empty(),
            "the pass has looked at them all"
        );
        // The next pass searches afresh.
        assert_eq!(o.plan(Duration::from_millis(1)).acquire.len(), 3);
    }

    #[test]
    fn with_a_drain_the_surplus_stays_held_and_renewed_until_drained_and_is_picked_once() {
        let mut o = Ownership::new("a", 4, LEASE);
        o.set_drain(Some(Duration::from_secs(30)));
        pass_all_granted(&mut o, Duration::ZERO);
        o.set_live(2);
        let plan = o.plan(Duration::from_millis(1000));
        assert_eq!(plan.drain, vec![3, 2], "the surplus goes from the top");
        assert!(plan.release.is_empty() && plan.expired.is_empty());
        assert_eq!(plan.renew.len(), 4, "a draining partition is renewed too");
        assert!(plan.acquire.is_empty());
        assert!(o.is_draining(3) && o.is_draining(2) && !o.is_draining(1));
        for l in &plan.renew {
            o.renewed(l.partition, Duration::from_millis(1000));
        }
        // The next pass picks nothing again and still renews the draining ones.
        let plan = o.plan(Duration::from_millis(2000));
        assert!(plan.drain.is_empty(), "{plan:?}");
        assert_eq!(plan.renew.len(), 4);
        assert_eq!(o.drained(3).map(|l| l.partition), Some(3));
        assert_eq!(o.drained(3), None, "once");
        assert_eq!(o.drained(1), None, "a kept partition is not released");
        assert_eq!(
            o.held().map(|l| l.partition).collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
        // Its share is full with the draining one: nothing is acquired meanwhile.
        assert!(o.plan(Duration::from_millis(3000)).acquire.is_empty());
    }

    #[test]
    fn a_drain_past_its_bound_is_given_up_at_once() {
        let mut o = Ownership::new("a", 2, LEASE);
        o.set_drain(Some(Duration::from_millis(1500)));
        pass_all_granted(&mut o, Duration::ZERO);
        o.set_live(2);
        let t = |ms| Duration::from_millis(ms);
        assert_eq!(o.plan(t(1000)).drain, vec![1]);
        o.renewed(0, t(1000));
        o.renewed(1, t(1000));
        assert!(o.plan(t(2400)).expired.is_empty(), "within the bound");
        o.renewed(0, t(2400));
        o.renewed(1, t(2400));
        let plan = o.plan(t(2500));
        assert_eq!(
            plan.expired.iter().map(|l| l.partition).collect::<Vec<_>>(),
            vec![1]
        );
        assert!(!o.holds(1) && o.holds(0));
        assert_eq!(o.drained(1), None, "already given up");
    }

    #[test]
    fn a_draining_partition_not_renewed_in_time_is_lost_like_any_other() {
        let mut o = Ownership::new("a", 2, LEASE);
        o.set_drain(Some(Duration::from_secs(30)));
        pass_all_granted(&mut o, Duration::ZERO);
        o.set_live(2);
        assert_eq!(o.plan(Duration::from_millis(1000)).drain, vec![1]);
        let plan = o.plan(Duration::from_millis(2800));
        assert_eq!(plan.lost, vec![0, 1]);
        assert_eq!(o.drained(1), None);
    }

    #[test]
    fn a_fenced_partition_is_dropped_and_searched_for_again_later() {
        let mut o = Ownership::new("a", 2, LEASE);
        pass_all_granted(&mut o, Duration::ZERO);
        assert!(o.fenced(1));
        assert!(!o.fenced(1));
        assert_eq!(o.plan(Duration::from_millis(100)).acquire, vec![1]);
    }
}
