//! Whether this instance may have been taken for dead (`--cluster`, docs/cluster.md "Where
//! the result goes"): its registry entry ran out (a pause, Redis out of reach of its
//! heartbeats), so that a partition's owner found it gone and sent the results of its
//! messages itself, marked `redelivery`. The copy this instance then sends of the same
//! result, from the outcome stream, is marked too: a platform may have confirmed the
//! owner's copy already (tests/simulation_cluster, seed 175).
//!
//! Known from the journal thread's passes: each heartbeat that went through says how long
//! the registry holds this instance live at least ([`ClusterReport::registered_for`]
//! (crate::cluster::ClusterReport)). A time not covered is a **lapse**. A result is marked
//! when a lapse began after its message was placed in Redis (an owner loads or scans the
//! message only once it is there), or one may be under way now (no heartbeat heard in
//! time: the reader can bring an outcome before the pass that would tell).

use std::collections::HashMap;
use std::time::Duration;

/// This instance's registration as its heartbeats tell it, and the lapse each message
/// accepted here was placed after.
#[derive(Default)]
pub(in crate::server::bridge) struct Registration {
    /// Until when (the bridge's clock) the registry holds this instance live; `None` before
    /// the first heartbeat.
    live_until: Option<Duration>,
    /// Lapses since the start (the time before the first heartbeat counts as one).
    lapses: u64,
    /// Messages accepted here and placed in Redis: the bridge's tag → the lapses then
    /// (pruned with the cluster's `placed`).
    placed: HashMap<u64, u64>,
}

impl Registration {
    /// A heartbeat went through: live for `registered_for` from `now`. A lapse began if the
    /// last one ran out before.
    pub(in crate::server::bridge) fn heard(&mut self, registered_for: Duration, now: Duration) {
        if self.live_until.is_none_or(|until| now >= until) {
            self.lapses += 1;
        }
        self.live_until = Some(now + registered_for);
    }

    /// Message `tag` accepted here is in Redis now.
    pub(in crate::server::bridge) fn placed(&mut self, tag: u64) {
        self.placed.insert(tag, self.lapses);
    }

    /// Keeps the placements of the messages `keep` says are still known.
    pub(in crate::server::bridge) fn retain(&mut self, keep: impl Fn(u64) -> bool) {
        self.placed.retain(|&tag, _| keep(tag));
    }

    /// Whether another instance may have sent the result of message `tag` (accepted here)
    /// because it took this one for dead: a lapse since it was placed, or one now. A message
    /// whose placement is not known here any more counts as placed before every lapse.
    pub(in crate::server::bridge) fn may_be_taken_for_dead(&self, tag: u64, now: Duration) -> bool {
        let lapsing = self.live_until.is_none_or(|until| now >= until);
        lapsing || self.placed.get(&tag).is_none_or(|&then| then < self.lapses)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn a_message_placed_between_heartbeats_heard_in_time_is_not_marked() {
        let mut r = Registration::default();
        r.heard(s(2), s(0));
        r.placed(7);
        r.heard(s(2), s(1));
        assert!(!r.may_be_taken_for_dead(7, s(2)));
    }

    #[test]
    fn a_lapse_after_the_placement_marks_it_for_good() {
        let mut r = Registration::default();
        r.heard(s(2), s(0));
        r.placed(7);
        // Not heard until 5 s: the registry let it go at 2 s.
        r.heard(s(2), s(5));
        assert!(r.may_be_taken_for_dead(7, s(6)));
        r.placed(8);
        assert!(!r.may_be_taken_for_dead(8, s(6)), "placed after the lapse");
    }

    #[test]
    fn a_lapse_under_way_or_before_any_heartbeat_marks_everything() {
        let mut r = Registration::default();
        r.placed(7);
        assert!(r.may_be_taken_for_dead(7, s(0)), "no heartbeat yet");
        r.heard(s(2), s(0));
        r.placed(8);
        assert!(
            r.may_be_taken_for_dead(7, s(1)),
            "placed before registering"
        );
        assert!(!r.may_be_taken_for_dead(8, s(1)));
        assert!(r.may_be_taken_for_dead(8, s(2)), "nothing heard in time");
        assert!(r.may_be_taken_for_dead(99, s(1)), "placement unknown");
    }

    /// Pruned with the cluster's `placed` (`retain`): the placement is not known any more,
    /// so the message counts as placed before every lapse. No other test prunes: made a
    /// no-op (a cargo mutants mutant), `retain` would let the map grow without bound and a
    /// pruned message pass as placed after the last lapse.
    #[test]
    fn a_placement_pruned_is_not_known_any_more() {
        let mut r = Registration::default();
        r.heard(s(2), s(0));
        r.placed(7);
        r.placed(8);
        r.retain(|tag| tag == 8);
        assert!(r.may_be_taken_for_dead(7, s(1)), "pruned");
        assert!(!r.may_be_taken_for_dead(8, s(1)), "kept");
    }
}
