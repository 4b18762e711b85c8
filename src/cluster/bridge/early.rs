//! Outcomes that came from the stream before the bridge knew their message waits for one
//! (`--cluster`, docs/cluster.md "Where the result goes").
//!
//! The owner's outcome can reach this instance's reader before this instance's own journal
//! thread has reported the message placed: Redis serves the owner's blocked `XREAD`, the
//! owner's turn and its outcome write while the rest of this instance's pipelined batch is
//! still executing, and the two threads' channels are read in one order only. Likewise an
//! outcome written by the partition's next owner can come while the turn of a paused owner
//! still runs here (its own record is refused later). Such an outcome is kept here and
//! given to its message once the bridge learns it waits ([`EarlyOutcomes::take`]); dropping
//! it would leave an acked message unanswered for good.
//!
//! The same holds for an entry of an outcome this instance wrote itself ([`Arrival::Landed`]
//! (crate::cluster::Arrival)), kept without its text: it proves that a write whose answer
//! was lost (the connection broke, a signal interrupted it) did land, so that the terminal
//! event held for it is sent when the journal thread later gives that write up.
//!
//! Bounded: at most `bound` are kept (the caller passes the messages in flight plus
//! [`EARLY_SLACK`]; each kept one that matters belongs to a route in flight). Past it the
//! oldest go first, counted and logged: the stale kinds (an outcome whose message this
//! instance rebuilt from a load meanwhile, the entry of an own write whose answer came) are
//! never taken.

use std::collections::HashMap;

use crate::journal::StoredOutcome;

/// Kept beyond the messages in flight.
pub(in crate::server::bridge) const EARLY_SLACK: usize = 1024;

/// Outcomes from the stream kept for their message, by its cluster tag.
pub(in crate::server::bridge) type EarlyOutcomes = Kept<StoredOutcome>;

/// Entries kept by the message's cluster tag, the oldest dropped past a bound.
pub(in crate::server::bridge) struct Kept<T> {
    /// Cluster tag → (arrival order, what came).
    kept: HashMap<u64, (u64, T)>,
    /// The next arrival's order.
    next: u64,
    /// Dropped at the bound since the start.
    dropped: u64,
}

impl<T> Default for Kept<T> {
    fn default() -> Self {
        Kept {
            kept: HashMap::new(),
            next: 0,
            dropped: 0,
        }
    }
}

impl<T> Kept<T> {
    /// Keeps what came for `tag` until its message is known to want it; past `bound`, drops
    /// the oldest down to three quarters of it. Returns how many it dropped.
    pub(in crate::server::bridge) fn keep(&mut self, tag: u64, outcome: T, bound: usize) -> u64 {
        self.kept.insert(tag, (self.next, outcome));
        self.next += 1;
        if self.kept.len() <= bound.max(1) {
            return 0;
        }
        let room = (bound.max(1) * 3 / 4).max(1) as u64;
        let oldest_kept = self.next.saturating_sub(room);
        let before = self.kept.len();
        self.kept.retain(|_, (order, _)| *order >= oldest_kept);
        let dropped = (before - self.kept.len()) as u64;
        self.dropped += dropped;
        debug_assert!(self.kept.len() as u64 <= room);
        dropped
    }

    /// What came for `tag`, if it came already.
    pub(in crate::server::bridge) fn take(&mut self, tag: u64) -> Option<T> {
        self.kept.remove(&tag).map(|(_, o)| o)
    }

    /// How many are kept, and how many were dropped at the bound since the start.
    pub(in crate::server::bridge) fn counts(&self) -> (usize, u64) {
        (self.kept.len(), self.dropped)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(text: &str) -> StoredOutcome {
        StoredOutcome {
            head: b"{".to_vec(),
            text: text.into(),
            tail: b"}\n".to_vec(),
            memory: None,
        }
    }

    #[test]
    fn a_kept_outcome_is_taken_once() {
        let mut e = EarlyOutcomes::default();
        e.keep(7, outcome("a"), 10);
        assert_eq!(e.take(7).map(|o| o.text), Some("a".to_owned()));
        assert_eq!(e.take(7), None);
        assert_eq!(e.counts(), (0, 0));
    }

    #[test]
    fn past_the_bound_the_oldest_go_and_are_counted() {
        let mut e = EarlyOutcomes::default();
        for t in 0..8 {
            e.keep(t, outcome("x"), 8);
        }
        assert_eq!(e.counts(), (8, 0), "at the bound nothing goes");
        e.keep(8, outcome("x"), 8);
        // Down to three quarters: the six newest stay.
        assert_eq!(e.counts(), (6, 3));
        for t in 0..3 {
            assert_eq!(e.take(t), None, "{t} is among the oldest");
        }
        for t in 3..9 {
            assert!(e.take(t).is_some(), "{t} is among the newest");
        }
    }

    /// `keep` says how many it dropped (the caller's WARN): none up to the bound, then those
    /// that went down to three quarters of it (no other test reads what it returns).
    #[test]
    fn keep_returns_how_many_went() {
        let mut e = Kept::<()>::default();
        for t in 0..4 {
            assert_eq!(e.keep(t, (), 4), 0, "{t} within the bound");
        }
        assert_eq!(
            e.keep(4, (), 4),
            2,
            "five past a bound of four: down to three"
        );
        assert_eq!(e.counts(), (3, 2));
    }
}
