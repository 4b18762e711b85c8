//! The cluster member's metrics (`--cluster`, docs/cluster.md): ownership, what waits on
//! other instances, hand-overs and the stream reader, from the status's
//! [`ClusterStatus`]. Kept apart from `metrics` so that the cluster's families stay in one
//! place.

use super::exposition::{Kind, Metric, Reading, by, labelled};
use crate::liveness::ClusterStatus;

use Kind::{Counter, Gauge};
use Reading::Value;

/// A count as a sample value.
fn n(v: usize) -> f64 {
    v as f64
}

/// The cluster's families, declared once ([`Metric`], as every other family of `/metrics`).
/// The instance id is a label of the info metric only (one value per process); the owned
/// partitions' list stays in the JSON (a label per partition would multiply the series by
/// `--partitions`). Last, the hello registry's forwards (docs/cluster.md "Where the result
/// goes").
pub(super) const CLUSTER: &[Metric<ClusterStatus>] = &[
    Metric {
        name: "turnstile_cluster_info",
        help: "This cluster member's instance id (`--instance-id`).",
        kind: Gauge,
        read: |c| labelled([([("instance", c.instance.as_str())], 1.0)]),
    },
    Metric {
        name: "turnstile_cluster_live_instances",
        help: "Live instances in the registry, this one included, as last read.",
        kind: Gauge,
        read: |c| Value(n(c.live_instances.len())),
    },
    Metric {
        name: "turnstile_cluster_partitions",
        help: "The partition count (`--partitions`).",
        kind: Gauge,
        read: |c| Value(f64::from(c.partitions)),
    },
    Metric {
        name: "turnstile_cluster_partitions_owned",
        help: "Partitions this instance owns now.",
        kind: Gauge,
        read: |c| Value(n(c.owned_partitions)),
    },
    Metric {
        name: "turnstile_cluster_remote_waiting",
        help: "Messages acked here whose outcome another instance owes.",
        kind: Gauge,
        read: |c| Value(n(c.remote_waiting)),
    },
    Metric {
        name: "turnstile_cluster_order_held",
        help: "Messages accepted here into owned partitions, held until the reader brought every earlier one.",
        kind: Gauge,
        read: |c| Value(n(c.order_held)),
    },
    Metric {
        name: "turnstile_cluster_early_outcomes",
        help: "Outcomes from the stream kept until their message is known here.",
        kind: Gauge,
        read: |c| Value(n(c.early_outcomes)),
    },
    Metric {
        name: "turnstile_cluster_own_outcome_entries",
        help: "Stream entries of outcomes this instance wrote, kept in case a write given up as unwritten landed.",
        kind: Gauge,
        read: |c| Value(n(c.own_outcome_entries)),
    },
    Metric {
        name: "turnstile_cluster_waiting_for_room",
        help: "Messages of owned partitions accepted elsewhere, waiting for room in their outbox.",
        kind: Gauge,
        read: |c| Value(n(c.waiting_for_room)),
    },
    Metric {
        name: "turnstile_cluster_early_outcomes_dropped_total",
        help: "Outcomes from the stream dropped at their bound (the messages in flight plus 1,024).",
        kind: Counter,
        read: |c| Value(c.early_outcomes_dropped as f64),
    },
    Metric {
        name: "turnstile_cluster_partitions_draining",
        help: "Partitions being drained now, to be released to another instance.",
        kind: Gauge,
        read: |c| Value(n(c.draining.len())),
    },
    Metric {
        name: "turnstile_cluster_drained_partitions_total",
        help: "Partitions drained and released (the fair share shrank).",
        kind: Counter,
        read: |c| Value(c.drained_partitions as f64),
    },
    Metric {
        name: "turnstile_cluster_drained_messages_total",
        help: "Messages those drains handed over to their next owner.",
        kind: Counter,
        read: |c| Value(c.drained_messages as f64),
    },
    Metric {
        name: "turnstile_cluster_partition_changes_total",
        help: "Partitions gained (acquired and loaded), lost (lease not renewed in time) and fenced while owned (another instance held the lease at a write).",
        kind: Counter,
        read: |c| {
            by(
                "change",
                [
                    ("gained", c.gained as f64),
                    ("lost", c.lost as f64),
                    ("fenced", c.fenced as f64),
                ],
            )
        },
    },
    Metric {
        name: "turnstile_cluster_self_fenced_total",
        help: "Partitions this instance fenced itself out of: a lease not renewed by its fence deadline, its running turns stopped before the lease could expire.",
        kind: Counter,
        read: |c| Value(c.self_fenced as f64),
    },
    Metric {
        name: "turnstile_cluster_handed_over_partitions_total",
        help: "Partitions handed over in place (lost or fenced).",
        kind: Counter,
        read: |c| Value(c.handed_over_partitions as f64),
    },
    Metric {
        name: "turnstile_cluster_handed_over_messages_total",
        help: "Messages those hand-overs took from this instance.",
        kind: Counter,
        read: |c| Value(c.handed_over_messages as f64),
    },
    Metric {
        name: "turnstile_cluster_reader_failures_total",
        help: "Failed reads of the cluster's streams (each retried).",
        kind: Counter,
        read: |c| Value(c.reader_failures as f64),
    },
    Metric {
        name: "turnstile_cluster_reader_reconnects_total",
        help: "Times the stream reader read again after failing.",
        kind: Counter,
        read: |c| Value(c.reader_reconnects as f64),
    },
    Metric {
        name: "turnstile_cluster_reader_failing",
        help: "1 while the stream reader's last read failed.",
        kind: Gauge,
        read: |c| Value(f64::from(u8::from(c.reader_failing))),
    },
    Metric {
        name: "turnstile_cluster_reader_arrivals",
        help: "What the stream reader brought and the reactor has not taken yet (at most 4,096).",
        kind: Gauge,
        read: |c| Value(n(c.reader_arrivals)),
    },
    Metric {
        name: "turnstile_cluster_forward_requests",
        help: "Hello and forward requests waiting for Redis on the reader (at most 4,096).",
        kind: Gauge,
        read: |c| Value(n(c.forward_requests)),
    },
    Metric {
        name: "turnstile_cluster_forward_requests_dropped_total",
        help: "Hello and forward requests dropped at their bound.",
        kind: Counter,
        read: |c| Value(c.forward_requests_dropped as f64),
    },
    Metric {
        name: "turnstile_cluster_forwards_waiting",
        help: "Results offered to the instance of their platform's newest hello, not answered yet.",
        kind: Gauge,
        read: |c| Value(n(c.forwards_waiting)),
    },
    Metric {
        name: "turnstile_cluster_forwarded_results_total",
        help: "Results taken by another instance (out), taken here (in), and refused here (refused).",
        kind: Counter,
        read: |c| {
            by(
                "way",
                [
                    ("out", c.forwarded_out as f64),
                    ("in", c.forwarded_in as f64),
                    ("refused", c.forwards_refused as f64),
                ],
            )
        },
    },
];

#[cfg(test)]
mod tests {
    use super::super::exposition::Exposition;
    use super::*;

    /// Every figure reaches its sample: distinct values in, each found out.
    #[test]
    fn every_cluster_figure_is_rendered() {
        let c = ClusterStatus {
            instance: "a\"1".into(),
            live_instances: vec!["a\"1".into(), "b".into(), "c".into()],
            partitions: 64,
            owned_partitions: 5,
            owned: vec![1, 2, 3, 4, 5],
            remote_waiting: 6,
            order_held: 41,
            gained: 7,
            lost: 8,
            fenced: 9,
            self_fenced: 41,
            handed_over_partitions: 10,
            handed_over_messages: 11,
            reader_failures: 12,
            reader_reconnects: 13,
            reader_failing: true,
            reader_arrivals: 42,
            early_outcomes: 14,
            early_outcomes_dropped: 15,
            own_outcome_entries: 40,
            waiting_for_room: 41,
            rebalance: true,
            drain_ms: 30_000,
            draining: vec![36, 37],
            drained_partitions: 38,
            drained_messages: 39,
            forward_requests: 16,
            forward_requests_dropped: 17,
            forwards_waiting: 18,
            forwarded_out: 19,
            forwarded_in: 20,
            forwards_refused: 21,
        };
        let mut e = Exposition::new();
        e.expose(CLUSTER, &c);
        let text = e.finish();
        // Byte for byte what the hand-written renderer gave before the table (its output
        // for this status, kept beside this file).
        assert_eq!(text, include_str!("metrics_golden.prom"));
        for line in [
            "turnstile_cluster_info{instance=\"a\\\"1\"} 1",
            "turnstile_cluster_live_instances 3",
            "turnstile_cluster_partitions 64",
            "turnstile_cluster_partitions_owned 5",
            "turnstile_cluster_remote_waiting 6",
            "turnstile_cluster_order_held 41",
            "turnstile_cluster_partition_changes_total{change=\"gained\"} 7",
            "turnstile_cluster_partition_changes_total{change=\"lost\"} 8",
            "turnstile_cluster_partition_changes_total{change=\"fenced\"} 9",
            "turnstile_cluster_self_fenced_total 41",
            "turnstile_cluster_handed_over_partitions_total 10",
            "turnstile_cluster_handed_over_messages_total 11",
            "turnstile_cluster_reader_failures_total 12",
            "turnstile_cluster_reader_reconnects_total 13",
            "turnstile_cluster_reader_failing 1",
            "turnstile_cluster_reader_arrivals 42",
            "turnstile_cluster_early_outcomes 14",
            "turnstile_cluster_early_outcomes_dropped_total 15",
            "turnstile_cluster_partitions_draining 2",
            "turnstile_cluster_own_outcome_entries 40",
            "turnstile_cluster_waiting_for_room 41",
            "turnstile_cluster_drained_partitions_total 38",
            "turnstile_cluster_drained_messages_total 39",
            "turnstile_cluster_forward_requests 16",
            "turnstile_cluster_forward_requests_dropped_total 17",
            "turnstile_cluster_forwards_waiting 18",
            "turnstile_cluster_forwarded_results_total{way=\"out\"} 19",
            "turnstile_cluster_forwarded_results_total{way=\"in\"} 20",
            "turnstile_cluster_forwarded_results_total{way=\"refused\"} 21",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
    }
}
