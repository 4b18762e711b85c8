//! Property test of the partition ownership planner (`Ownership`, issue 22) against a model
//! of Redis's leases: random interleavings of passes, clock steps, pauses (a SIGSTOPped
//! instance), kills, instances cut off from Redis (requests lost before or after they ran),
//! wrong counts of live instances and clocks running up to 5 % fast or slow.
//!
//! Checked after every pass of an instance: it believes it holds only partitions whose lease
//! in Redis is still its own (so a paused instance that wakes after losing a lease gives it
//! up before it writes; the fenced scripts are the second line), it holds at most its fair
//! share, and no two instances that have just planned hold the same partition. After the
//! storm, with every survivor connected and told the true count: within a bounded number of
//! passes every partition has exactly one owner, and Redis agrees.
//!
//! The same in the drain mode (`--cluster-rebalance`, `Ownership::set_drain`): the surplus
//! is drained, not released at once (the bridge says when a drain is over, at random steps
//! here; a drain past its bound is released as if lost), and every partition an instance
//! holds, draining or not, is still its own in Redis.
#![cfg(feature = "cluster")]

use std::time::Duration;

use proptest::prelude::*;
use turnstile::internal::cluster::{Lease, Ownership};

const TTL: Duration = Duration::from_millis(3000);

/// Redis's leases on its own clock (the model's global time).
struct Redis {
    leases: Vec<Option<(String, Duration)>>,
    epochs: Vec<u64>,
}

impl Redis {
    fn new(partitions: u32) -> Redis {
        Redis {
            leases: vec![None; partitions as usize],
            epochs: vec![0; partitions as usize],
        }
    }

    /// The lease's holder at `now` (an expired key is gone).
    fn holder(&self, p: u32, now: Duration) -> Option<&str> {
        match &self.leases[p as usize] {
            Some((token, expires)) if *expires > now => Some(token),
            _ => None,
        }
    }

    /// The ACQUIRE script: never hands back a held lease.
    fn acquire(&mut self, p: u32, instance: &str, now: Duration) -> Option<Lease> {
        if self.holder(p, now).is_some() {
            return None;
        }
        self.epochs[p as usize] += 1;
        let epoch = self.epochs[p as usize];
        let token = format!("{instance}:{epoch}");
        self.leases[p as usize] = Some((token.clone(), now + TTL));
        Some(Lease {
            partition: p,
            token,
            epoch,
        })
    }

    /// The RENEW script: only the holder's token extends it; anything else is fenced.
    fn renew(&mut self, lease: &Lease, now: Duration) -> bool {
        if self.holder(lease.partition, now) != Some(lease.token.as_str()) {
            return false;
        }
        self.leases[lease.partition as usize] = Some((lease.token.clone(), now + TTL));
        true
    }

    /// The RELEASE script: only the holder's token deletes it.
    fn release(&mut self, lease: &Lease, now: Duration) {
        if self.holder(lease.partition, now) == Some(lease.token.as_str()) {
            self.leases[lease.partition as usize] = None;
        }
    }
}

/// How an instance reaches Redis.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Link {
    Up,
    /// Requests are lost before they reach Redis.
    LostBefore,
    /// Requests run, their answers are lost.
    LostAfter,
}

struct Instance {
    name: String,
    o: Ownership,
    /// Partitions the planner named to drain whose drain the bridge has not ended yet.
    draining: Vec<u32>,
    alive: bool,
    link: Link,
    /// The instance's clock: rate (per mille) and offset against Redis's.
    rate_permille: u64,
    offset: Duration,
}

impl Instance {
    fn clock(&self, now: Duration) -> Duration {
        self.offset + now * self.rate_permille as u32 / 1000
    }
}

#[derive(Clone, Debug)]
enum Step {
    /// Redis's clock moves on (ms).
    Advance(u64),
    /// One instance's pass (renew, release, acquire, give up).
    Pass(usize),
    /// A kill -9: the instance never runs again.
    Kill(usize),
    /// How the instance reaches Redis from now on.
    Link(usize, Link),
    /// The registry's count of live instances, as the instance last read it (may be wrong).
    Live(usize, u32),
    /// The bridge ends the instance's oldest drain (its running turns are over): the
    /// journal thread releases the lease.
    DrainDone(usize),
}

fn step(instances: usize) -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0u64..=1500).prop_map(Step::Advance),
        // A long pause: a SIGSTOPped instance wakes past its leases.
        1 => (3000u64..=9000).prop_map(Step::Advance),
        8 => (0..instances).prop_map(Step::Pass),
        1 => (0..instances).prop_map(Step::Kill),
        2 => (0..instances, prop_oneof![Just(Link::Up), Just(Link::LostBefore), Just(Link::LostAfter)])
            .prop_map(|(i, l)| Step::Link(i, l)),
        2 => (0..instances, 1u32..=4).prop_map(|(i, n)| Step::Live(i, n)),
        2 => (0..instances).prop_map(Step::DrainDone),
    ]
}

/// One pass of instance `i` at Redis time `now`: the plan, carried out against `redis` as
/// the journal thread would (every request sent at the pass's instant).
fn pass(inst: &mut Instance, redis: &mut Redis, now: Duration) {
    let t = inst.clock(now);
    let plan = inst.o.plan(t);
    for lease in plan.release.iter().chain(&plan.expired) {
        if inst.link != Link::LostBefore {
            redis.release(lease, now);
        }
    }
    inst.draining.extend(&plan.drain);
    for lease in &plan.renew {
        let ran = inst.link != Link::LostBefore;
        let ok = ran && redis.renew(lease, now);
        if inst.link == Link::Up {
            if ok {
                inst.o.renewed(lease.partition, t);
            } else {
                inst.o.fenced(lease.partition);
            }
        }
    }
    // As the journal thread does: as many again as were taken, until the search ends.
    let mut candidates = plan.acquire;
    while !candidates.is_empty() {
        let mut taken = 0;
        for &p in &candidates {
            let got = if inst.link != Link::LostBefore {
                redis.acquire(p, &inst.name, now)
            } else {
                None
            };
            match got {
                Some(lease) if inst.link == Link::Up => inst.o.acquired(lease, t),
                Some(_) => {}
                None => taken += 1,
            }
        }
        candidates = inst.o.more_candidates(taken);
    }
}

/// The planner's promise, just after a pass: every partition it holds is still its own in
/// Redis, and it holds no more than its share.
fn check_after_pass(inst: &Instance, redis: &Redis, now: Duration) -> Result<(), TestCaseError> {
    for lease in inst.o.held() {
        prop_assert_eq!(
            redis.holder(lease.partition, now),
            Some(lease.token.as_str()),
            "{} believes it holds partition {} at {:?}, Redis says otherwise",
            &inst.name,
            lease.partition,
            now
        );
    }
    // Partitions being drained are held (and renewed) beyond the share until released.
    let kept = inst
        .o
        .held()
        .filter(|l| !inst.o.is_draining(l.partition))
        .count();
    prop_assert!(kept as u32 <= inst.o.fair_share());
    Ok(())
}

/// The bridge ends the instance's oldest drain: the lease goes back as the journal thread's
/// `release_drained` gives it (nothing if the partition was lost or expired meanwhile).
fn drain_done(inst: &mut Instance, redis: &mut Redis, now: Duration) {
    if inst.draining.is_empty() {
        return;
    }
    let p = inst.draining.remove(0);
    if let Some(lease) = inst.o.drained(p)
        && inst.link != Link::LostBefore
    {
        redis.release(&lease, now);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn an_owner_never_believes_a_lease_redis_gave_away_and_ownership_settles(
        partitions in 1u32..=8,
        n in 1usize..=3,
        rates in prop::collection::vec(950u64..=1050, 3),
        offsets in prop::collection::vec(0u64..=100_000, 3),
        steps in prop::collection::vec(step(3), 1..150),
        drain_ms in prop_oneof![Just(None), (100u64..=9000).prop_map(Some)],
    ) {
        let mut redis = Redis::new(partitions);
        let mut fleet: Vec<Instance> = (0..n)
            .map(|i| Instance {
                name: format!("gw{i}"),
                o: {
                    let mut o = Ownership::new(&format!("gw{i}"), partitions, TTL);
                    o.set_drain(drain_ms.map(Duration::from_millis));
                    o
                },
                draining: Vec::new(),
                alive: true,
                link: Link::Up,
                rate_permille: rates[i],
                offset: Duration::from_millis(offsets[i]),
            })
            .collect();
        let mut now = Duration::ZERO;
        for s in steps {
            match s {
                Step::Advance(ms) => now += Duration::from_millis(ms),
                Step::Pass(i) if i < n && fleet[i].alive => {
                    pass(&mut fleet[i], &mut redis, now);
                    check_after_pass(&fleet[i], &redis, now)?;
                }
                Step::Kill(i) if i < n => fleet[i].alive = false,
                Step::Link(i, l) if i < n => fleet[i].link = l,
                Step::Live(i, k) if i < n => fleet[i].o.set_live(k),
                Step::DrainDone(i) if i < n && fleet[i].alive => {
                    drain_done(&mut fleet[i], &mut redis, now);
                }
                _ => {}
            }
        }
        // Heal: every survivor connected and told the true count; passes every third of the
        // TTL. A dead instance's leases run out within a TTL; then the search for free
        // partitions (one cursor step per try) finds them within a few rounds.
        let live = fleet.iter().filter(|i| i.alive).count() as u32;
        for inst in fleet.iter_mut().filter(|i| i.alive) {
            inst.link = Link::Up;
            inst.o.set_live(live);
        }
        let rounds = 4 + 2 * partitions as usize;
        for _ in 0..rounds {
            now += TTL / 3;
            for inst in fleet.iter_mut().filter(|i| i.alive) {
                pass(inst, &mut redis, now);
                check_after_pass(inst, &redis, now)?;
                // Every drain ends once its turns do (here: at once).
                while !inst.draining.is_empty() {
                    drain_done(inst, &mut redis, now);
                }
            }
        }
        if live == 0 {
            return Ok(());
        }
        for p in 0..partitions {
            let owners: Vec<&str> = fleet
                .iter()
                .filter(|i| i.alive && i.o.holds(p))
                .map(|i| i.name.as_str())
                .collect();
            prop_assert_eq!(owners.len(), 1, "partition {} owned by {:?} after healing", p, owners);
            let token = fleet
                .iter()
                .filter(|i| i.alive)
                .find_map(|i| i.o.held().find(|l| l.partition == p))
                .map(|l| l.token.clone());
            prop_assert_eq!(redis.holder(p, now).map(str::to_owned), token);
        }
    }
}
