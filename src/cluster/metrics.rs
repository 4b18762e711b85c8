//! The cluster member's metrics (`--cluster`, docs/cluster.md): ownership, what waits on
//! other instances, hand-overs and the stream reader, from the status's
//! [`ClusterStatus`]. Kept apart from `metrics` so that the cluster's families stay in one
//! place.

use super::exposition::Exposition;
use crate::liveness::ClusterStatus;

/// The cluster's families. The instance id is a label of the info metric only (one value
/// per process); the owned partitions' list stays in the JSON (a label per partition would
/// multiply the series by `--partitions`).
pub(super) fn render_cluster(e: &mut Exposition, c: &ClusterStatus) {
    e.info(
        "turnstile_cluster_info",
        "This cluster member's instance id (`--instance-id`).",
        &[("instance", &c.instance)],
    );
    e.gauge(
        "turnstile_cluster_live_instances",
        "Live instances in the registry, this one included, as last read.",
        c.live_instances.len() as f64,
    );
    e.gauge(
        "turnstile_cluster_partitions",
        "The partition count (`--partitions`).",
        f64::from(c.partitions),
    );
    e.gauge(
        "turnstile_cluster_partitions_owned",
        "Partitions this instance owns now.",
        c.owned_partitions as f64,
    );
    e.gauge(
        "turnstile_cluster_remote_waiting",
        "Messages acked here whose outcome another instance owes.",
        c.remote_waiting as f64,
    );
    e.gauge(
        "turnstile_cluster_early_outcomes",
        "Outcomes from the stream kept until their message is known here.",
        c.early_outcomes as f64,
    );
    e.gauge(
        "turnstile_cluster_own_outcome_entries",
        "Stream entries of outcomes this instance wrote, kept in case a write given up as unwritten landed.",
        c.own_outcome_entries as f64,
    );
    e.counter(
        "turnstile_cluster_early_outcomes_dropped_total",
        "Outcomes from the stream dropped at their bound (the messages in flight plus 1,024).",
        c.early_outcomes_dropped as f64,
    );
    e.gauge(
        "turnstile_cluster_partitions_draining",
        "Partitions being drained now, to be released to another instance.",
        c.draining.len() as f64,
    );
    e.counter(
        "turnstile_cluster_drained_partitions_total",
        "Partitions drained and released (the fair share shrank).",
        c.drained_partitions as f64,
    );
    e.counter(
        "turnstile_cluster_drained_messages_total",
        "Messages those drains handed over to their next owner.",
        c.drained_messages as f64,
    );
    e.counters(
        "turnstile_cluster_partition_changes_total",
        "Partitions gained (acquired and loaded), lost (lease not renewed in time) and fenced while owned (another instance held the lease at a write).",
        &[
            (&[("change", "gained")][..], c.gained as f64),
            (&[("change", "lost")][..], c.lost as f64),
            (&[("change", "fenced")][..], c.fenced as f64),
        ],
    );
    e.counter(
        "turnstile_cluster_handed_over_partitions_total",
        "Partitions handed over in place (lost or fenced).",
        c.handed_over_partitions as f64,
    );
    e.counter(
        "turnstile_cluster_handed_over_messages_total",
        "Messages those hand-overs took from this instance.",
        c.handed_over_messages as f64,
    );
    e.counter(
        "turnstile_cluster_reader_failures_total",
        "Failed reads of the cluster's streams (each retried).",
        c.reader_failures as f64,
    );
    e.counter(
        "turnstile_cluster_reader_reconnects_total",
        "Times the stream reader read again after failing.",
        c.reader_reconnects as f64,
    );
    e.gauge(
        "turnstile_cluster_reader_failing",
        "1 while the stream reader's last read failed.",
        f64::from(u8::from(c.reader_failing)),
    );
    render_forwards(e, c);
}

/// The hello registry's forwards (docs/cluster.md "Where the result goes").
fn render_forwards(e: &mut Exposition, c: &ClusterStatus) {
    e.gauge(
        "turnstile_cluster_forward_requests",
        "Hello and forward requests waiting for Redis on the reader (at most 4,096).",
        c.forward_requests as f64,
    );
    e.counter(
        "turnstile_cluster_forward_requests_dropped_total",
        "Hello and forward requests dropped at their bound.",
        c.forward_requests_dropped as f64,
    );
    e.gauge(
        "turnstile_cluster_forwards_waiting",
        "Results offered to the instance of their platform's newest hello, not answered yet.",
        c.forwards_waiting as f64,
    );
    e.counters(
        "turnstile_cluster_forwarded_results_total",
        "Results taken by another instance (out), taken here (in), and refused here (refused).",
        &[
            (&[("way", "out")][..], c.forwarded_out as f64),
            (&[("way", "in")][..], c.forwarded_in as f64),
            (&[("way", "refused")][..], c.forwards_refused as f64),
        ],
    );
}

#[cfg(test)]
mod tests {
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
            gained: 7,
            lost: 8,
            fenced: 9,
            handed_over_partitions: 10,
            handed_over_messages: 11,
            reader_failures: 12,
            reader_reconnects: 13,
            reader_failing: true,
            early_outcomes: 14,
            early_outcomes_dropped: 15,
            own_outcome_entries: 40,
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
        render_cluster(&mut e, &c);
        let text = e.finish();
        for line in [
            "turnstile_cluster_info{instance=\"a\\\"1\"} 1",
            "turnstile_cluster_live_instances 3",
            "turnstile_cluster_partitions 64",
            "turnstile_cluster_partitions_owned 5",
            "turnstile_cluster_remote_waiting 6",
            "turnstile_cluster_partition_changes_total{change=\"gained\"} 7",
            "turnstile_cluster_partition_changes_total{change=\"lost\"} 8",
            "turnstile_cluster_partition_changes_total{change=\"fenced\"} 9",
            "turnstile_cluster_handed_over_partitions_total 10",
            "turnstile_cluster_handed_over_messages_total 11",
            "turnstile_cluster_reader_failures_total 12",
            "turnstile_cluster_reader_reconnects_total 13",
            "turnstile_cluster_reader_failing 1",
            "turnstile_cluster_early_outcomes 14",
            "turnstile_cluster_early_outcomes_dropped_total 15",
            "turnstile_cluster_partitions_draining 2",
            "turnstile_cluster_own_outcome_entries 40",
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
