//! The two histograms the heartbeat and the driver keep: log-linear microsecond buckets for
//! loop-lag quantiles (the status's p50/p99/max), and fixed-bound buckets as Prometheus
//! exposes them (the metrics). Plain data below the reactor, the status and the metrics.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Exact buckets below this many microseconds; log-linear above.
const LINEAR: u64 = 16;
/// Sub-buckets per power of two (precision 1/8 = 12.5 %).
const SUB_BITS: u32 = 3;
const BUCKETS: usize = 16 + 61 * 8;

/// A histogram of durations with log-linear microsecond buckets (12.5 % precision).
#[derive(Clone)]
pub(crate) struct LagHistogram {
    counts: Box<[u64; BUCKETS]>,
    total: u64,
    max_us: u64,
}

impl Default for LagHistogram {
    fn default() -> Self {
        LagHistogram {
            counts: Box::new([0; BUCKETS]),
            total: 0,
            max_us: 0,
        }
    }
}

impl std::fmt::Debug for LagHistogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LagHistogram(n={}, max={}us)", self.total, self.max_us)
    }
}

fn bucket_of(us: u64) -> usize {
    if us < LINEAR {
        return us as usize;
    }
    let exp = 63 - us.leading_zeros(); // >= 4
    let sub = (us >> (exp - SUB_BITS)) & ((1 << SUB_BITS) - 1);
    (LINEAR as usize) + ((exp - 4) as usize) * (1 << SUB_BITS) + sub as usize
}

/// The largest value that falls in bucket `b`.
fn bucket_high(b: usize) -> u64 {
    if (b as u64) < LINEAR {
        return b as u64;
    }
    let i = b - LINEAR as usize;
    let exp = (i >> SUB_BITS) as u32 + 4;
    let sub = (i & ((1 << SUB_BITS) - 1)) as u64;
    let low = (1u64 << exp) + (sub << (exp - SUB_BITS));
    low.saturating_add((1u64 << (exp - SUB_BITS)) - 1)
}

impl LagHistogram {
    /// Records one sample.
    pub(crate) fn record(&mut self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        self.counts[bucket_of(us)] += 1;
        self.total += 1;
        self.max_us = self.max_us.max(us);
    }

    /// Samples recorded.
    #[cfg(test)]
    pub(crate) fn count(&self) -> u64 {
        self.total
    }

    /// The largest sample.
    pub(crate) fn max(&self) -> Duration {
        Duration::from_micros(self.max_us)
    }

    /// An upper bound (within 12.5 %) of the `q` quantile, `q` in 0..=1; zero when empty.
    pub(crate) fn quantile(&self, q: f64) -> Duration {
        if self.total == 0 {
            return Duration::ZERO;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (b, &n) in self.counts.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return Duration::from_micros(bucket_high(b).min(self.max_us));
            }
        }
        self.max()
    }

    /// Adds `other`'s samples to this histogram.
    pub(crate) fn merge(&mut self, other: &LagHistogram) {
        for (a, b) in self.counts.iter_mut().zip(other.counts.iter()) {
            *a += b;
        }
        self.total += other.total;
        self.max_us = self.max_us.max(other.max_us);
    }

    /// Forgets every sample.
    pub(crate) fn clear(&mut self) {
        self.counts.fill(0);
        self.total = 0;
        self.max_us = 0;
    }

    /// p50, p99 and max in milliseconds.
    pub(crate) fn summary(&self) -> LagSummary {
        // Whole microseconds divided once, so the JSON shows 0.169 rather than 0.16899999.
        let ms = |d: Duration| d.as_micros() as f64 / 1000.0;
        LagSummary {
            p50: ms(self.quantile(0.5)),
            p99: ms(self.quantile(0.99)),
            max: ms(self.max()),
        }
    }
}

/// Slices of a [`LagWindow`].
const WINDOW_SLICES: u64 = 6;

/// Loop lag over a sliding window: the samples of the last `WINDOW_SLICES` slices of
/// `slice` each (with 10 s slices, the last 50 to 60 s), so a wedge an hour into the run
/// shows in the percentiles as it would in the first minute.
#[derive(Clone, Debug)]
pub(crate) struct LagWindow {
    slice: Duration,
    /// Per ring position: the slice number it holds, and its samples.
    slices: Vec<(u64, LagHistogram)>,
}

impl LagWindow {
    /// A window of six slices of `slice` (60 s with 10 s slices).
    pub(crate) fn new(slice: Duration) -> LagWindow {
        debug_assert!(!slice.is_zero(), "a window slice must be positive");
        LagWindow {
            slice,
            slices: (0..WINDOW_SLICES)
                .map(|_| (u64::MAX, LagHistogram::default()))
                .collect(),
        }
    }

    fn slice_of(&self, now: Duration) -> u64 {
        (now.as_nanos() / self.slice.as_nanos().max(1)) as u64
    }

    /// Records a sample taken at `now` (monotonic, non-decreasing).
    pub(crate) fn record(&mut self, now: Duration, lag: Duration) {
        let n = self.slice_of(now);
        let (held, h) = &mut self.slices[(n % WINDOW_SLICES) as usize];
        if *held != n {
            *held = n;
            h.clear();
        }
        h.record(lag);
    }

    /// The samples of the slices still inside the window at `now`.
    pub(crate) fn merged(&self, now: Duration) -> LagHistogram {
        let n = self.slice_of(now);
        let mut out = LagHistogram::default();
        for (held, h) in &self.slices {
            if *held <= n && n - *held < WINDOW_SLICES {
                out.merge(h);
            }
        }
        out
    }
}

/// Percentiles of loop lag in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct LagSummary {
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
}

/// Loop-lag buckets in seconds: 50 µs to 10 s.
pub(crate) const LAG_BUCKETS: &[f64] = &[
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
];

/// Turn-duration buckets in seconds: 5 ms to 10 minutes.
pub(crate) const TURN_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

/// Journal write (commit, sync, mark) buckets in seconds: 50 µs to 5 s.
pub(crate) const JOURNAL_BUCKETS: &[f64] = &[
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 5.0,
];

/// A histogram with fixed upper bounds (seconds), as Prometheus exposes one: per-bucket
/// counts, a sum and a count.
#[derive(Clone, Debug, PartialEq)]
pub struct PromHistogram {
    bounds: &'static [f64],
    /// Samples per bucket (not cumulative); the last slot is `+Inf`.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl PromHistogram {
    /// An empty histogram over `bounds` (ascending seconds).
    pub fn new(bounds: &'static [f64]) -> PromHistogram {
        debug_assert!(bounds.windows(2).all(|w| w[0] < w[1]), "bounds ascend");
        PromHistogram {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    /// A histogram over `bounds` with these per-bucket counts (not cumulative, `+Inf`
    /// last) and sum of samples in seconds: a snapshot of one kept elsewhere.
    pub(crate) fn from_counts(bounds: &'static [f64], counts: Vec<u64>, sum: f64) -> PromHistogram {
        debug_assert_eq!(counts.len(), bounds.len() + 1);
        PromHistogram {
            bounds,
            count: counts.iter().sum(),
            counts,
            sum,
        }
    }

    /// Records one sample.
    pub fn record(&mut self, d: Duration) {
        let s = d.as_secs_f64();
        let i = self.bounds.partition_point(|&b| b < s);
        self.counts[i] += 1;
        self.sum += s;
        self.count += 1;
    }

    /// Samples recorded.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The sum of the samples, in seconds.
    pub fn sum(&self) -> f64 {
        self.sum
    }

    /// `(upper bound, cumulative count)` per bucket, `+Inf` last.
    pub fn cumulative(&self) -> Vec<(f64, u64)> {
        let mut seen = 0;
        self.bounds
            .iter()
            .copied()
            .chain([f64::INFINITY])
            .zip(&self.counts)
            .map(|(b, &n)| {
                seen += n;
                (b, seen)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_quantiles_are_tight_upper_bounds() {
        let mut h = LagHistogram::default();
        for us in 1..=1000u64 {
            h.record(Duration::from_micros(us));
        }
        let p50 = h.quantile(0.5).as_micros() as f64;
        let p99 = h.quantile(0.99).as_micros() as f64;
        assert!((500.0..=500.0 * 1.125).contains(&p50), "p50 {p50}");
        assert!((990.0..=1000.0).contains(&p99), "p99 {p99}");
        assert_eq!(h.max(), Duration::from_micros(1000));
        assert_eq!(h.count(), 1000);
    }

    #[test]
    fn every_bucket_holds_the_values_mapped_to_it() {
        for us in [
            0u64,
            1,
            15,
            16,
            17,
            31,
            32,
            1000,
            123_456,
            u64::MAX / 2,
            u64::MAX,
        ] {
            let b = bucket_of(us);
            assert!(b < BUCKETS);
            assert!(
                bucket_high(b) >= us,
                "{us} above its bucket's high {}",
                bucket_high(b)
            );
            if b > 0 {
                assert!(bucket_high(b - 1) < us, "{us} also fits bucket {}", b - 1);
            }
        }
    }

    #[test]
    fn the_lag_window_forgets_slices_older_than_a_minute() {
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        let mut w = LagWindow::new(s(10));
        w.record(s(5), ms(900)); // slice 0
        w.record(s(15), ms(1)); // slice 1
        assert_eq!(w.merged(s(15)).count(), 2);
        assert_eq!(
            w.merged(s(59)).max(),
            ms(900),
            "slice 0 is still in the window at 59 s"
        );
        let later = w.merged(s(60));
        assert_eq!(later.count(), 1, "slice 0 left the window at 60 s");
        assert_eq!(later.max(), ms(1));
        // Slice 6 reuses slice 0's ring position and starts empty.
        w.record(s(61), ms(2));
        let m = w.merged(s(61));
        assert_eq!((m.count(), m.max()), (2, ms(2)));
        assert_eq!(w.merged(s(200)).count(), 0);
    }

    #[test]
    fn merge_and_clear() {
        let mut a = LagHistogram::default();
        let mut b = LagHistogram::default();
        a.record(Duration::from_micros(10));
        b.record(Duration::from_micros(500));
        b.record(Duration::from_micros(20));
        a.merge(&b);
        assert_eq!(a.count(), 3);
        assert_eq!(a.max(), Duration::from_micros(500));
        assert_eq!(a.quantile(0.5), Duration::from_micros(21), "20 µs's bucket");
        a.clear();
        assert_eq!((a.count(), a.max()), (0, Duration::ZERO));
        assert_eq!(a.quantile(0.5), Duration::ZERO);
    }

    #[test]
    fn histogram_buckets_are_cumulative_and_inclusive_of_their_bound() {
        let mut h = PromHistogram::new(&[0.001, 0.01]);
        h.record(Duration::from_micros(1000)); // exactly the first bound: in it
        h.record(Duration::from_micros(1001));
        h.record(Duration::from_secs(1));
        assert_eq!(
            h.cumulative(),
            vec![(0.001, 1), (0.01, 2), (f64::INFINITY, 3)]
        );
        assert_eq!(h.count(), 3);
        assert!((h.sum() - 1.002001).abs() < 1e-9, "{}", h.sum());
    }
}
