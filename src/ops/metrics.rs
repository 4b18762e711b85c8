//! Prometheus metrics: fixed-bucket histograms kept by the reactor, and the text exposition
//! format 0.0.4 rendered from a status snapshot.
//!
//! Every name starts `turnstile_`; every label's values come from a bounded set (outcomes,
//! reasons, pools, states, platforms — at most `--max-platforms` of them).

use std::fmt::Write;
use std::time::Duration;

/// Loop-lag buckets in seconds: 50 µs to 10 s.
pub const LAG_BUCKETS: &[f64] = &[
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Turn-duration buckets in seconds: 5 ms to 10 minutes.
pub const TURN_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
    600.0,
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

/// Escapes a label value (backslash, double quote, newline).
pub fn escape_label(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

fn number(v: f64) -> String {
    if v == f64::INFINITY {
        "+Inf".into()
    } else if v == f64::NEG_INFINITY {
        "-Inf".into()
    } else if v.is_nan() {
        "NaN".into()
    } else {
        format!("{v}")
    }
}

/// Writes metric families in the text format: one `# HELP` and `# TYPE` per family, then
/// its samples.
#[derive(Default)]
pub struct Exposition {
    out: String,
}

impl Exposition {
    /// An empty exposition.
    pub fn new() -> Exposition {
        Exposition::default()
    }

    fn family(&mut self, name: &str, kind: &str, help: &str) {
        debug_assert!(name.starts_with("turnstile_"), "{name} lacks the prefix");
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{k}=\"{}\"", escape_label(v));
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {}", number(value));
    }

    /// A counter without labels (`name` ends `_total`).
    pub fn counter(&mut self, name: &str, help: &str, value: f64) {
        self.counters(name, help, &[(&[][..], value)]);
    }

    /// A counter family with labelled samples.
    pub fn counters(&mut self, name: &str, help: &str, samples: &[(&[(&str, &str)], f64)]) {
        debug_assert!(name.ends_with("_total"), "counter {name} must end _total");
        self.family(name, "counter", help);
        for (labels, v) in samples {
            self.sample(name, labels, *v);
        }
    }

    /// A gauge without labels.
    pub fn gauge(&mut self, name: &str, help: &str, value: f64) {
        self.gauges(name, help, &[(&[][..], value)]);
    }

    /// A gauge family with labelled samples.
    pub fn gauges(&mut self, name: &str, help: &str, samples: &[(&[(&str, &str)], f64)]) {
        self.family(name, "gauge", help);
        for (labels, v) in samples {
            self.sample(name, labels, *v);
        }
    }

    /// A histogram family (`_bucket`, `_sum`, `_count`).
    pub fn histogram(&mut self, name: &str, help: &str, h: &PromHistogram) {
        self.family(name, "histogram", help);
        let bucket = format!("{name}_bucket");
        for (le, n) in h.cumulative() {
            let le = number(le);
            self.sample(&bucket, &[("le", &le)], n as f64);
        }
        self.sample(&format!("{name}_sum"), &[], h.sum());
        self.sample(&format!("{name}_count"), &[], h.count() as f64);
    }

    /// The text.
    pub fn finish(self) -> String {
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn exposition_text() {
        let mut e = Exposition::new();
        e.counter("turnstile_ticks_total", "Ticks.", 3.0);
        e.gauges(
            "turnstile_outbox_events",
            "Outbox.",
            &[(&[("platform", "a\"b\\c\nd")][..], 2.0)],
        );
        let mut h = PromHistogram::new(&[0.5]);
        h.record(Duration::from_millis(250));
        e.histogram("turnstile_x_seconds", "X.", &h);
        assert_eq!(
            e.finish(),
            "# HELP turnstile_ticks_total Ticks.\n# TYPE turnstile_ticks_total counter\nturnstile_ticks_total 3\n\
             # HELP turnstile_outbox_events Outbox.\n# TYPE turnstile_outbox_events gauge\nturnstile_outbox_events{platform=\"a\\\"b\\\\c\\nd\"} 2\n\
             # HELP turnstile_x_seconds X.\n# TYPE turnstile_x_seconds histogram\nturnstile_x_seconds_bucket{le=\"0.5\"} 1\nturnstile_x_seconds_bucket{le=\"+Inf\"} 1\nturnstile_x_seconds_sum 0.25\nturnstile_x_seconds_count 1\n"
        );
        assert_eq!(number(f64::NEG_INFINITY), "-Inf");
        assert_eq!(number(f64::NAN), "NaN");
        assert_eq!(number(1e-5), "0.00001");
    }
}
