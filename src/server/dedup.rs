//! One platform's duplicate window: the message ids it sent recently, so that a bridge that
//! re-sends a message (a retry after a reconnect, a platform redelivery) does not run it twice.
//!
//! Each platform has its own window with its own capacity, so one platform's flood cannot
//! evict another's ids. A full window is never trimmed early (that would let a redelivery run
//! twice): the bridge refuses new ids with `backpressure` until entries expire.
//!
//! An id is `Pending` from its submission until the runtime admits or refuses it, so a second
//! copy arriving in between is answered together with the first (one answer per line).
//! Entries are 64-bit SipHash fingerprints under a per-process random key: a false match needs
//! a 64-bit collision (about 3e-8 with 10^6 ids remembered).

use std::collections::VecDeque;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::time::Duration;

use super::sharded::{Sharded, shard_of};

/// A remembered message id.
pub(super) type Fingerprint = u64;

/// What the window knows of an id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Seen {
    /// Not seen within the window.
    New,
    /// Submitted under this tag; the runtime has not answered yet.
    Pending(u64),
    /// Accepted within the window.
    Accepted,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    Pending(u64),
    Until(Duration),
}

/// Ids of one platform, each remembered for `window` after its acceptance, at most `max`.
pub(super) struct DedupWindow {
    window: Duration,
    max: usize,
    /// Sharded so that growing to a million ids never rehashes them all in one step.
    entries: Sharded<Entry>,
    /// Accepted ids in acceptance order (hence expiry order), per shard of `entries`, so
    /// that no queue grows by copying a million entries at once either.
    order: Vec<VecDeque<(Duration, Fingerprint)>>,
    /// The shard whose expiry comes next.
    cursor: usize,
}

/// The process-wide fingerprint key.
fn hasher() -> &'static RandomState {
    static HASHER: std::sync::OnceLock<RandomState> = std::sync::OnceLock::new();
    HASHER.get_or_init(RandomState::new)
}

/// The fingerprint of a message id.
pub(super) fn fingerprint(id: &str) -> Fingerprint {
    hasher().hash_one(id)
}

impl DedupWindow {
    /// Remembers ids for `window`, at most `max` at a time.
    pub(super) fn new(window: Duration, max: usize) -> DedupWindow {
        DedupWindow {
            window,
            max,
            entries: Sharded::default(),
            order: (0..64).map(|_| VecDeque::new()).collect(),
            cursor: 0,
        }
    }

    /// What is known of `fp` at `now`.
    pub(super) fn seen(&self, fp: Fingerprint, now: Duration) -> Seen {
        match self.entries.get(&fp) {
            Some(Entry::Pending(tag)) => Seen::Pending(*tag),
            Some(Entry::Until(until)) if *until > now => Seen::Accepted,
            _ => Seen::New,
        }
    }

    /// Whether a new id would overflow the window (after expiring what is due).
    pub(super) fn is_full(&mut self, now: Duration) -> bool {
        if self.entries.len() >= self.max {
            self.expire(now, usize::MAX);
        }
        self.entries.len() >= self.max
    }

    /// Marks `fp` submitted under `tag`.
    pub(super) fn pending(&mut self, fp: Fingerprint, tag: u64) {
        debug_assert!(self.entries.len() < self.max || self.entries.contains_key(&fp));
        self.entries.insert(fp, Entry::Pending(tag));
    }

    /// The runtime accepted `fp` at `now`: remember it for the window.
    pub(super) fn accepted(&mut self, fp: Fingerprint, now: Duration) {
        let until = now + self.window;
        self.entries.insert(fp, Entry::Until(until));
        self.order[shard_of(fp)].push_back((until, fp));
    }

    /// Remembers `fp` as accepted until `until` (restored from the journal at start-up; calls
    /// must come in `until` order).
    pub(super) fn remember(&mut self, fp: Fingerprint, until: Duration) {
        self.entries.insert(fp, Entry::Until(until));
        self.order[shard_of(fp)].push_back((until, fp));
    }

    /// The runtime refused `fp`: a retry must not be mistaken for a duplicate.
    pub(super) fn forget(&mut self, fp: Fingerprint) {
        if let Some(Entry::Pending(_)) = self.entries.get(&fp) {
            self.entries.remove(&fp);
        }
    }

    /// Drops up to `budget` ids whose window has passed; returns how many were dropped.
    pub(super) fn expire(&mut self, now: Duration, budget: usize) -> usize {
        let mut dropped = 0;
        // Round the shards from where the last pass stopped, so a budget spreads fairly.
        for _ in 0..self.order.len() {
            let order = &mut self.order[self.cursor];
            while dropped < budget && order.front().is_some_and(|(until, _)| *until <= now) {
                if let Some((until, fp)) = order.pop_front()
                    && self.entries.get(&fp) == Some(&Entry::Until(until))
                {
                    self.entries.remove(&fp);
                }
                dropped += 1;
            }
            if dropped >= budget {
                break;
            }
            self.cursor = (self.cursor + 1) % self.order.len();
        }
        dropped
    }

    /// Ids remembered now (pending ones included).
    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is remembered.
    pub(super) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn an_id_is_pending_then_a_duplicate_within_the_window_only() {
        let mut w = DedupWindow::new(600 * S, 100);
        let fp = fingerprint("m-1");
        assert_eq!(w.seen(fp, S), Seen::New);
        w.pending(fp, 7);
        assert_eq!(w.seen(fp, S), Seen::Pending(7));
        w.accepted(fp, S);
        assert_eq!(w.seen(fp, 2 * S), Seen::Accepted);
        assert_eq!(w.seen(fp, 600 * S), Seen::Accepted);
        assert_eq!(
            w.seen(fp, 601 * S),
            Seen::New,
            "still a duplicate after the window"
        );
        assert_eq!(w.expire(601 * S, 10), 1);
        assert!(w.is_empty());
    }

    #[test]
    fn a_refused_id_can_be_retried_and_an_accepted_one_is_not_forgotten() {
        let mut w = DedupWindow::new(600 * S, 100);
        let fp = fingerprint("7");
        w.pending(fp, 1);
        w.forget(fp);
        assert_eq!(w.seen(fp, S), Seen::New);
        w.pending(fp, 2);
        w.accepted(fp, S);
        w.forget(fp);
        assert_eq!(w.seen(fp, S), Seen::Accepted);
    }

    #[test]
    fn a_full_window_stays_full_until_ids_expire_and_expiry_is_bounded() {
        let mut w = DedupWindow::new(10 * S, 3);
        for i in 0..3 {
            let fp = fingerprint(&i.to_string());
            w.pending(fp, i);
            w.accepted(fp, S);
        }
        assert!(w.is_full(5 * S));
        assert_eq!(w.len(), 3);
        assert_eq!(w.expire(11 * S, 2), 2);
        assert_eq!(w.len(), 1);
        assert!(!w.is_full(11 * S));
        assert!(w.is_full(5 * S) || w.len() < 3);
    }
}
