//! The Prometheus text exposition format 0.0.4: families with their help and type, samples
//! with escaped labels, histograms; what `metrics` writes a status snapshot with.

use std::fmt::Write;

use crate::histogram::PromHistogram;

/// Escapes a label value (backslash, double quote, newline).
pub(crate) fn escape_label(v: &str) -> String {
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

pub(super) fn number(v: f64) -> String {
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
pub(crate) struct Exposition {
    out: String,
}

impl Exposition {
    /// An empty exposition.
    pub(crate) fn new() -> Exposition {
        Exposition::default()
    }

    fn family(&mut self, name: &str, kind: &str, help: &str) {
        // Ours carry the prefix; the process collector's standard names do not.
        debug_assert!(
            name.starts_with("turnstile_") || name.starts_with("process_"),
            "{name} lacks the prefix"
        );
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
    /// An info metric: one gauge sample of 1 whose labels carry the information.
    pub(crate) fn info(&mut self, name: &str, help: &str, labels: &[(&str, &str)]) {
        self.family(name, "gauge", help);
        self.sample(name, labels, 1.0);
    }

    pub(crate) fn counter(&mut self, name: &str, help: &str, value: f64) {
        self.counters(name, help, &[(&[][..], value)]);
    }

    /// A counter family with labelled samples.
    pub(crate) fn counters(&mut self, name: &str, help: &str, samples: &[(&[(&str, &str)], f64)]) {
        debug_assert!(name.ends_with("_total"), "counter {name} must end _total");
        self.family(name, "counter", help);
        for (labels, v) in samples {
            self.sample(name, labels, *v);
        }
    }

    /// A counter family with one label whose values are known only at run time.
    pub(crate) fn counters_by(
        &mut self,
        name: &str,
        help: &str,
        key: &str,
        samples: &[(&str, f64)],
    ) {
        let labels: Vec<[(&str, &str); 1]> = samples.iter().map(|&(v, _)| [(key, v)]).collect();
        let samples: Vec<(&[(&str, &str)], f64)> = labels
            .iter()
            .zip(samples)
            .map(|(l, &(_, n))| (&l[..], n))
            .collect();
        self.counters(name, help, &samples);
    }

    /// A gauge without labels.
    pub(crate) fn gauge(&mut self, name: &str, help: &str, value: f64) {
        self.gauges(name, help, &[(&[][..], value)]);
    }

    /// A gauge family with labelled samples.
    pub(crate) fn gauges(&mut self, name: &str, help: &str, samples: &[(&[(&str, &str)], f64)]) {
        self.family(name, "gauge", help);
        for (labels, v) in samples {
            self.sample(name, labels, *v);
        }
    }

    /// A gauge family with one label whose values are known only at run time.
    pub(crate) fn gauges_by(&mut self, name: &str, help: &str, key: &str, samples: &[(&str, f64)]) {
        let labels: Vec<[(&str, &str); 1]> = samples.iter().map(|&(v, _)| [(key, v)]).collect();
        let samples: Vec<(&[(&str, &str)], f64)> = labels
            .iter()
            .zip(samples)
            .map(|(l, &(_, n))| (&l[..], n))
            .collect();
        self.gauges(name, help, &samples);
    }

    /// A histogram family (`_bucket`, `_sum`, `_count`).
    pub(crate) fn histogram(&mut self, name: &str, help: &str, h: &PromHistogram) {
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
    pub(crate) fn finish(self) -> String {
        self.out
    }
}
