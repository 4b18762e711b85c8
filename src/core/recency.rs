//! Recency order of idle cached agents, for LRU eviction and the idle sweep.
//!
//! Caching an agent appends (seq, slot); taking it out of the cache only counts the entry as
//! dead, so the per-turn cost is one append to a hot tail, whatever the number of sessions.
//! Dead entries are skipped at the front and compacted away once they outnumber live ones.

use std::collections::VecDeque;

use crate::key::Key;

/// Below this size compaction is not worth its pass.
const COMPACT_MIN: usize = 1024;

#[derive(Debug, Default)]
pub(super) struct RecencyQueue {
    order: VecDeque<(u64, Key)>,
    next_seq: u64,
    /// Entries that are still the current cache entry of their slot.
    pub(super) live: usize,
}

impl RecencyQueue {
    /// Appends a newly cached agent's slot; returns its sequence number.
    pub(super) fn push(&mut self, slot: Key) -> u64 {
        self.next_seq += 1;
        self.order.push_back((self.next_seq, slot));
        self.live += 1;
        self.next_seq
    }

    /// Counts one entry as dead; `is_live(seq, slot)` tells live entries apart when compacting.
    pub(super) fn remove(&mut self, mut is_live: impl FnMut(u64, Key) -> bool) {
        self.live -= 1;
        if self.order.len() >= COMPACT_MIN && self.order.len() > 2 * self.live {
            self.order.retain(|&(seq, slot)| is_live(seq, slot));
        }
    }

    /// The oldest live entry's slot, dropping dead entries in front of it.
    pub(super) fn oldest(&mut self, mut is_live: impl FnMut(u64, Key) -> bool) -> Option<Key> {
        while let Some(&(seq, slot)) = self.order.front() {
            if is_live(seq, slot) {
                return Some(slot);
            }
            self.order.pop_front();
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn dead_entries_are_skipped_and_compacted() {
        let mut q = RecencyQueue::default();
        let mut slots = crate::key::Slots::new();
        let keys: Vec<Key> = (0..3).map(|i| slots.insert(i)).collect();
        // slot -> its current live seq
        let mut current: HashMap<Key, u64> = HashMap::new();
        for round in 0..10_000usize {
            let slot = keys[round % 3];
            if let Some(_old) = current.remove(&slot) {
                let cur = current.clone();
                q.remove(|seq, s| cur.get(&s) == Some(&seq));
            }
            current.insert(slot, q.push(slot));
        }
        assert_eq!(q.live, 3);
        assert!(
            q.order.len() < 2 * COMPACT_MIN,
            "kept {} entries for 3 live",
            q.order.len()
        );
        // The oldest live entry is the least recently cached slot.
        let cur = current.clone();
        assert_eq!(
            q.oldest(|seq, s| cur.get(&s) == Some(&seq)),
            Some(keys[10_000 % 3])
        );
    }
}

/// Mutation-testing guarantees (issue 9 §3): compaction starts exactly when dead entries
/// are the majority of at least `COMPACT_MIN`, and keeps the live ones.
#[cfg(test)]
mod mutant_tests {
    use super::*;

    #[test]
    fn compaction_starts_when_dead_entries_are_a_majority_of_a_large_queue() {
        let mut slots = crate::key::Slots::new();
        let keys: Vec<Key> = (0..COMPACT_MIN).map(|i| slots.insert(i)).collect();
        let mut q = RecencyQueue::default();
        let seqs: Vec<u64> = keys.iter().map(|&k| q.push(k)).collect();
        assert_eq!(seqs[..3], [1, 2, 3]);
        // Entries 0..half die one by one; at exactly half dead nothing is dropped.
        let half = COMPACT_MIN / 2;
        for dead in 1..=half {
            q.remove(|seq, _| seq > dead as u64);
        }
        assert_eq!((q.live, q.order.len()), (half, COMPACT_MIN));
        q.remove(|seq, _| seq > half as u64 + 1);
        assert_eq!((q.live, q.order.len()), (half - 1, half - 1));
        assert_eq!(
            q.oldest(|seq, _| seq > half as u64 + 1),
            Some(keys[half + 1])
        );
    }

    #[test]
    fn a_small_queue_is_not_compacted() {
        let mut slots = crate::key::Slots::new();
        let keys: Vec<Key> = (0..4).map(|i| slots.insert(i)).collect();
        let mut q = RecencyQueue::default();
        for &k in &keys {
            q.push(k);
        }
        for _ in 0..3 {
            q.remove(|seq, _| seq == 4);
        }
        assert_eq!((q.live, q.order.len()), (1, 4));
        assert_eq!(q.oldest(|seq, _| seq == 4), Some(keys[3]));
        assert_eq!(q.order.len(), 1);
    }
}
