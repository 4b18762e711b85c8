//! Fair service: ready connections take turns (round-robin across wakes, each at most once
//! in the queue), and how long they waited for their turn.

use std::collections::{HashSet, VecDeque};
use std::time::{Duration, Instant};

use super::SERVICE_SLICE;
use crate::histogram::{LAG_BUCKETS, LagHistogram, LagWindow, PromHistogram};
use crate::server::bridge::ConnId;

/// Connections waiting for their turn (to be read, or written), in order, each at most once,
/// with the time it began to wait. A pass serves from the front, at most the connections
/// queued when it began; one that used its budget goes to the back; those it did not reach
/// stay at the front for the next pass. So between two turns of a connection every other one
/// gets at most one turn: no connection can starve another.
#[derive(Default)]
pub(super) struct FairQueue {
    order: VecDeque<(ConnId, Instant)>,
    queued: HashSet<ConnId>,
}

impl FairQueue {
    /// Queues `id` at the back, waiting since `at`; no-op (its place and time kept) when it
    /// is already queued.
    pub(super) fn push(&mut self, id: ConnId, at: Instant) {
        if self.queued.insert(id) {
            self.order.push_back((id, at));
        }
    }

    pub(super) fn pop(&mut self) -> Option<(ConnId, Instant)> {
        let (id, at) = self.order.pop_front()?;
        self.queued.remove(&id);
        Some((id, at))
    }

    pub(super) fn len(&self) -> usize {
        self.order.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    pub(super) fn ids(&self) -> impl Iterator<Item = ConnId> + '_ {
        self.order.iter().map(|&(id, _)| id)
    }

    /// One pass: serves connections from the front while `more_time()` (the first always).
    /// `serve(id, waited_since)` returns true when the connection used its budget and has
    /// more: it goes to the back (waiting from now), behind everyone queued, and is served
    /// again in this pass only if time is left once they have had their turn. So a pass
    /// with one busy connection uses the whole time on it (a lone flooder is read as fast as
    /// before), and with many each gets one turn before any gets a second.
    /// Returns the turns served.
    pub(super) fn pass(
        &mut self,
        mut more_time: impl FnMut() -> bool,
        mut serve: impl FnMut(ConnId, Instant) -> bool,
    ) -> usize {
        let mut served = 0;
        while !self.is_empty() && (served == 0 || more_time()) {
            let Some((id, since)) = self.pop() else {
                break;
            };
            served += 1;
            if serve(id, since) {
                self.push(id, Instant::now());
            }
        }
        served
    }
}

/// How long ready connections waited for their turn: since start, over the recent window,
/// and in the metrics' buckets.
pub(super) struct DelayStats {
    pub(super) all: LagHistogram,
    pub(super) recent: LagWindow,
    pub(super) buckets: PromHistogram,
}

impl Default for DelayStats {
    fn default() -> Self {
        DelayStats {
            all: LagHistogram::default(),
            recent: LagWindow::new(SERVICE_SLICE),
            buckets: PromHistogram::new(LAG_BUCKETS),
        }
    }
}

impl DelayStats {
    pub(super) fn record(&mut self, now: Duration, waited: Duration) {
        self.all.record(waited);
        self.recent.record(now, waited);
        self.buckets.record(waited);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: u64) -> Vec<ConnId> {
        (1..=n).map(ConnId::from_bits).collect()
    }

    /// Serves passes of `per_pass` connections each; `busy` always use their budget (they
    /// flood), the rest are done after one turn. Returns the order of service.
    fn passes(q: &mut FairQueue, per_pass: usize, rounds: usize, busy: &[ConnId]) -> Vec<ConnId> {
        let mut order = Vec::new();
        for _ in 0..rounds {
            let mut left = per_pass;
            q.pass(
                || {
                    left = left.saturating_sub(1);
                    left > 0
                },
                |id, _| {
                    order.push(id);
                    busy.contains(&id)
                },
            );
        }
        order
    }

    /// Twenty flooding connections and a quiet one that becomes readable behind them: with
    /// three served per pass, the quiet one is served before any flooder's second turn.
    #[test]
    fn a_connection_behind_flooders_is_served_within_one_round() {
        let all = ids(21);
        let (flooders, quiet) = (&all[..20], all[20]);
        let mut q = FairQueue::default();
        let t = Instant::now();
        for &id in flooders {
            q.push(id, t);
        }
        // Fresh readiness of the flooders (edge-triggered: every new packet) keeps no one's
        // place: they are queued already.
        q.push(quiet, t);
        for &id in flooders {
            q.push(id, t);
        }
        assert_eq!(q.len(), 21, "no duplicates");
        let order = passes(&mut q, 3, 7, flooders);
        assert_eq!(order.len(), 21);
        assert_eq!(order[..20], *flooders, "in the order they became readable");
        assert_eq!(order[20], quiet);
        // The flooders, still busy, come round again in the same order; the quiet one left.
        let next = passes(&mut q, 4, 5, flooders);
        assert_eq!(next, flooders);
        assert!(!q.ids().any(|id| id == quiet));
    }

    /// Those a pass did not reach are first in the next; the one that used its budget goes
    /// behind them, and is served again in the same pass only after every other one had its
    /// turn.
    #[test]
    fn a_pass_leaves_the_unreached_first_and_sends_the_busy_to_the_back() {
        let all = ids(4);
        let mut q = FairQueue::default();
        let t = Instant::now();
        for &id in &all {
            q.push(id, t);
        }
        assert_eq!(passes(&mut q, 2, 1, &all), all[..2]);
        assert_eq!(
            q.ids().collect::<Vec<_>>(),
            [all[2], all[3], all[0], all[1]]
        );
        // Time for six turns, one connection busy: the others once each, then it again
        // (twice: nobody else is waiting).
        assert_eq!(
            passes(&mut q, 6, 1, &all[..1]),
            [all[2], all[3], all[0], all[1], all[0], all[0]]
        );
        assert_eq!(q.ids().collect::<Vec<_>>(), [all[0]]);
        // The first is always served, even out of time.
        assert_eq!(passes(&mut q, 0, 1, &[]), [all[0]]);
        assert!(q.is_empty());
    }
}
