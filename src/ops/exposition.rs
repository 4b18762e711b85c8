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

/// A metric family's type, as `# TYPE` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Only goes up (the name ends `_total`).
    Counter,
    /// Goes up and down.
    Gauge,
    /// Buckets, a sum and a count.
    Histogram,
}

impl Kind {
    /// The word `# TYPE` uses.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// A sample's labels: names fixed in the declaration, values read from the figure.
pub(crate) type Labels<'a> = Vec<(&'static str, &'a str)>;

/// What a [`Metric`] read from its figure this time.
pub(crate) enum Reading<'a> {
    /// One sample without labels.
    Value(f64),
    /// Labelled samples (none: the family's head alone).
    Samples(Vec<(Labels<'a>, f64)>),
    /// A histogram's buckets, sum and count.
    Histogram(&'a crate::histogram::PromHistogram),
    /// Not exposed in this snapshot (the figure is absent from it).
    Absent,
}

/// One metric family, declared once beside the figure it reads: its name, help and kind,
/// and how its samples are read from a figure `T` (a status struct). A figure's metrics are
/// a `&[Metric<T>]` table that [`Exposition::expose`] iterates; the tests iterate the same
/// tables. Any figure can adopt it: declare a table for its struct and expose it.
pub(crate) struct Metric<T: ?Sized> {
    /// The family's name (`turnstile_…`, or a process collector's standard name).
    pub(crate) name: &'static str,
    /// Its `# HELP` text (one line).
    pub(crate) help: &'static str,
    /// Its `# TYPE`.
    pub(crate) kind: Kind,
    /// Its samples in a snapshot.
    pub(crate) read: for<'a> fn(&'a T) -> Reading<'a>,
}

/// Samples with one label each, `key` its name.
pub(crate) fn by<'a>(
    key: &'static str,
    samples: impl IntoIterator<Item = (&'a str, f64)>,
) -> Reading<'a> {
    Reading::Samples(
        samples
            .into_iter()
            .map(|(v, n)| (vec![(key, v)], n))
            .collect(),
    )
}

/// Samples with fixed labels, given as `(labels, value)`.
pub(crate) fn labelled<'a, const N: usize>(
    samples: impl IntoIterator<Item = ([(&'static str, &'a str); N], f64)>,
) -> Reading<'a> {
    Reading::Samples(samples.into_iter().map(|(l, n)| (l.to_vec(), n)).collect())
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

    /// The families of `metrics`, in order, read from `figure`.
    pub(crate) fn expose<T: ?Sized>(&mut self, metrics: &[Metric<T>], figure: &T) {
        for m in metrics {
            let samples = match (m.read)(figure) {
                Reading::Absent => continue,
                Reading::Histogram(h) => {
                    debug_assert_eq!(m.kind, Kind::Histogram, "{}", m.name);
                    self.histogram(m.name, m.help, h);
                    continue;
                }
                Reading::Value(v) => vec![(Vec::new(), v)],
                Reading::Samples(samples) => samples,
            };
            debug_assert!(
                m.kind != Kind::Counter || m.name.ends_with("_total"),
                "counter {} must end _total",
                m.name
            );
            self.family(m.name, m.kind.as_str(), m.help);
            for (labels, v) in &samples {
                self.sample(m.name, labels, *v);
            }
        }
    }

    /// The text.
    pub(crate) fn finish(self) -> String {
        self.out
    }
}
