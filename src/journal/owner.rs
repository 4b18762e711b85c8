//! Which partitions this instance owns (`--cluster`): a sans-IO planner that the journal
//! thread drives with its clock and the store's answers (docs/cluster.md, "Ownership and
//! rebalancing").
//!
//! Every pass ([`Ownership::plan`]) says what to send: renewals of the leases held, the
//! surplus to release when there are more partitions held than the fair share
//! (`ceil(partitions / live instances)`), a few free partitions to try to acquire when there
//! are fewer, and the leases to consider **lost** — those not renewed successfully for a
//! whole TTL, counted from when the last successful renewal was *sent*, so that this
//! instance gives a partition up no later than Redis can give it to another. The fenced
//! scripts catch anything written after that anyway; giving up in time keeps a paused
//! instance from running turns the new owner runs too.

use std::collections::BTreeMap;
use std::time::Duration;

use super::redis::{Lease, partition_of};

/// What one pass asks for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Leases to renew now.
    pub renew: Vec<Lease>,
    /// Leases to give up (more than the fair share is held).
    pub release: Vec<Lease>,
    /// Partitions to try to acquire.
    pub acquire: Vec<u32>,
    /// Partitions lost: not renewed for a whole TTL. Stop starting turns there, drop them.
    pub lost: Vec<u32>,
}

#[derive(Clone, Debug)]
struct Held {
    lease: Lease,
    /// When the last renewal (or the acquisition) that succeeded was sent.
    renewed_sent: Duration,
    /// When the last renewal was sent (succeeded or not yet answered).
    last_sent: Duration,
}

/// The partitions one instance holds, and when to renew, shed, take or give them up.
#[derive(Clone, Debug)]
pub struct Ownership {
    partitions: u32,
    lease: Duration,
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
}

impl Ownership {
    /// An instance that holds nothing yet.
    pub fn new(instance: &str, partitions: u32, lease: Duration) -> Ownership {
        debug_assert!(partitions > 0);
        Ownership {
            partitions,
            lease,
            held: BTreeMap::new(),
            live: 1,
            cursor: partition_of(instance, partitions),
            shed: true,
            swept: 0,
        }
    }

    /// How often [`Ownership::plan`] should run: a third of the TTL, so two renewals can
    /// fail before a lease runs out.
    pub fn pass_every(&self) -> Duration {
        self.lease / 3
    }

    /// Whether passes release the surplus over the fair share (default true). Off, an
    /// instance keeps what it holds and a joining one takes only what comes free.
    pub fn set_shed(&mut self, shed: bool) {
        self.shed = shed;
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
        // A tenth of the TTL as margin for the two clocks' rates.
        let give_up = lease.saturating_sub(lease / 10);
        let lost: Vec<u32> = self
            .held
            .iter()
            .filter(|(_, h)| now.saturating_sub(h.renewed_sent) >= give_up)
            .map(|(p, _)| *p)
            .collect();
        for p in &lost {
            self.held.remove(p);
        }
        plan.lost = lost;
        let share = self.fair_share() as usize;
        // The surplus goes from the top, so the instances' shares settle instead of swapping.
        while self.shed && self.held.len() > share {
            if let Some((_, h)) = self.held.pop_last() {
                plan.release.push(h.lease);
            }
        }
        for h in self.held.values_mut() {
            if now.saturating_sub(h.last_sent) >= lease / 3 {
                h.last_sent = now;
                plan.renew.push(h.lease.clone());
            }
        }
        self.swept = 0;
        plan.acquire = self.candidates(share.saturating_sub(self.held.len()));
        debug_assert!(!self.shed || self.held.len() <= share);
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

    /// An acquisition sent at `sent` succeeded.
    pub fn acquired(&mut self, lease: Lease, sent: Duration) {
        debug_assert!(lease.partition < self.partitions);
        self.held.insert(
            lease.partition,
            Held {
                lease,
                renewed_sent: sent,
                last_sent: sent,
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
    fn a_fenced_partition_is_dropped_and_searched_for_again_later() {
        let mut o = Ownership::new("a", 2, LEASE);
        pass_all_granted(&mut o, Duration::ZERO);
        assert!(o.fenced(1));
        assert!(!o.fenced(1));
        assert_eq!(o.plan(Duration::from_millis(100)).acquire, vec![1]);
    }
}
