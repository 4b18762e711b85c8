//! A min-heap of deadlines with lazy cancellation.
//!
//! Timers are never removed when they become moot (a turn that ends before its timeout):
//! the owner marks them stale, and the heap is compacted once stale entries dominate, so
//! memory stays proportional to live timers at any turn rate.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

/// A deadline queue; `K` says what fires.
#[derive(Debug)]
pub struct TimerQueue<K: Ord> {
    heap: BinaryHeap<Reverse<(Duration, u64, K)>>,
    seq: u64,
    stale: usize,
}

impl<K: Ord> Default for TimerQueue<K> {
    fn default() -> Self {
        TimerQueue {
            heap: BinaryHeap::new(),
            seq: 0,
            stale: 0,
        }
    }
}

/// Below this size compaction is not worth its pass.
const COMPACT_MIN: usize = 1024;

impl<K: Ord> TimerQueue<K> {
    /// Schedules `kind` at `at`. Equal deadlines fire in insertion order.
    pub fn insert(&mut self, at: Duration, kind: K) {
        self.seq += 1;
        self.heap.push(Reverse((at, self.seq, kind)));
    }

    /// The earliest deadline, stale or not.
    pub fn next_deadline(&self) -> Option<Duration> {
        self.heap.peek().map(|Reverse((at, _, _))| *at)
    }

    /// Removes and returns the earliest timer due at `now`.
    pub fn pop_due(&mut self, now: Duration) -> Option<K> {
        match self.heap.peek() {
            Some(Reverse((at, _, _))) if *at <= now => self.heap.pop().map(|Reverse((_, _, k))| k),
            _ => None,
        }
    }

    /// Notes that one queued timer no longer matters; when stale timers are the majority,
    /// keeps only those `is_live` accepts.
    pub fn mark_stale(&mut self, is_live: impl FnMut(&K) -> bool) {
        self.stale += 1;
        if self.heap.len() >= COMPACT_MIN && self.stale * 2 > self.heap.len() {
            let mut is_live = is_live;
            self.heap.retain(|Reverse((_, _, k))| is_live(k));
            self.stale = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fires_in_deadline_then_insertion_order() {
        let mut q = TimerQueue::default();
        q.insert(Duration::from_millis(20), 'b');
        q.insert(Duration::from_millis(10), 'a');
        q.insert(Duration::from_millis(20), 'c');
        assert_eq!(q.next_deadline(), Some(Duration::from_millis(10)));
        assert_eq!(q.pop_due(Duration::from_millis(9)), None);
        assert_eq!(q.pop_due(Duration::from_millis(25)), Some('a'));
        assert_eq!(q.pop_due(Duration::from_millis(25)), Some('b'));
        assert_eq!(q.pop_due(Duration::from_millis(25)), Some('c'));
        assert!(q.heap.is_empty());
    }

    #[test]
    fn stale_timers_are_compacted_away() {
        let mut q = TimerQueue::default();
        for i in 0..10_000u32 {
            q.insert(Duration::from_secs(600), i);
            // Every timer but the last 10 becomes stale, as turns end long before timeouts.
            if i >= 10 {
                q.mark_stale(|k| *k >= i - 9 && *k <= i);
            }
        }
        assert!(
            q.heap.len() < 2 * COMPACT_MIN,
            "heap kept {} timers",
            q.heap.len()
        );
    }
}
