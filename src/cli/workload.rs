//! The closed-loop workload's report, shared by the in-process benchmark and `loadgen`, with
//! the same fields as the peer's benchmark script so the lines compare field by field.

use serde::Serialize;

/// Percentiles in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub(super) struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
}

impl Percentiles {
    /// The same figures rounded to `digits` decimals.
    pub(super) fn rounded(self, digits: i32) -> Percentiles {
        Percentiles {
            p50: round(self.p50, digits),
            p99: round(self.p99, digits),
            max: round(self.max, digits),
        }
    }
}

/// One scenario's result line.
#[derive(Clone, Debug, Serialize)]
pub(super) struct Report {
    /// Which system produced the line.
    pub system: String,
    /// Scenario name.
    pub scenario: String,
    /// Concurrent sessions.
    pub sessions: usize,
    /// Messages each session sends, one after another.
    pub rounds: usize,
    /// Turn workers.
    pub workers: usize,
    /// Simulated agent work per turn.
    pub delay_ms: f64,
    /// Turns run (sessions x rounds).
    pub turns: usize,
    /// Wall time of the workload.
    pub seconds: f64,
    /// Throughput.
    pub turns_per_s: f64,
    /// Message in to reply out, as the client saw it.
    pub latency_ms: Percentiles,
    /// Message in to its `ack` (over TCP only; with `--data-dir` the ack waits for the journal).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ack_latency_ms: Option<Percentiles>,
    /// Heartbeat lateness over the run (`null` when it could not be read).
    pub loop_lag_ms: Option<Percentiles>,
    /// Resident memory of the process at the end of the run.
    pub rss_mib: f64,
}

/// The peer script's percentile: nearest rank on the sorted samples.
pub(super) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let k = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[k.min(sorted.len() - 1)]
}

/// Sorts the samples and takes p50, p99 and max.
pub(super) fn summarize(samples: &mut [f64]) -> Percentiles {
    samples.sort_by(f64::total_cmp);
    Percentiles {
        p50: percentile(samples, 50.0),
        p99: percentile(samples, 99.0),
        max: samples.last().copied().unwrap_or(0.0),
    }
}

/// Resident set size of this process in MiB (Linux; 0 elsewhere).
pub(super) fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Rounds to `digits` decimals, for readable output.
pub(super) fn round(v: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (v * f).round() / f
}

#[cfg(test)]
mod tests {
    // The benches include this file without a test harness, where the tests compile away.
    #[allow(unused_imports)]
    use super::*;

    #[test]
    fn percentiles_match_the_peer_script() {
        // Python: xs=sorted(range(1,101)); k=round(p/100*(len-1)) -> p50: xs[50]=51 (round half even: 49.5 -> 50)
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        let p = summarize(&mut v);
        assert_eq!((p.p50, p.p99, p.max), (51.0, 99.0, 100.0));
    }

    #[test]
    fn rss_is_read_from_proc() {
        assert!(rss_mib() > 0.0);
    }
}
