//! The bridge's cluster side (`--cluster`), mounted as the bridge's `cluster` module
//! (`server/bridge/mod.rs`), so that it works on the bridge's rooms without widening them.
//!
//! The seam: the bridge holds one [`ClusterSide`] beside its `Durable` (the cluster's state:
//! remote waits, owned partitions, hand-overs, orphans, drains, forwards, early outcomes).
//! `ClusterSide`'s own hooks, the same in both builds, take what they read as arguments and
//! return what the bridge is to do, never calling back:
//! - on an input: `handed_event` (a handed-over message's runtime event is discarded),
//!   `turn_gate` (a turn of a draining partition stays held; given the routes and the
//!   journal side), `hello` and `offers` (the requests for the reader to send);
//! - on the journal's report: `runs_here` (a held turn of an ended partition stays held),
//!   `silenced` (a result another instance sends: the bridge gives its reservation back)
//!   and `mark_foreign` (a result released by its outcome record);
//! - on a result's way out: `stamp`; on recovery: `rebound`; in the audit: `check` (the
//!   remote index against the routes, both ways) and `orphan_platforms`; in the status:
//!   `fill_status` (through `Bridge::cluster_status`).
//!
//! What still works on several of the bridge's rooms at once stays `impl Bridge` here, so
//! this folder is mounted as the bridge's `cluster` module: `cluster_part` (the [`Report`]
//! applied before the rest), `hand_over` and `drain_step` (after the rest), and the
//! reader's `arrived`, `forwarded` and `took`.
//!
//! Without the `cluster` feature, `off.rs` is the no-op twin of all of it; with it:
//! - `side`: the state and the report's and the reader's effects;
//! - `drain`: a planned release (a partition drained before it is handed over);
//! - `fence`: self-fencing (a partition past its lease's fence deadline is handed over);
//! - `forward`: results offered to, and taken from, the instance of a platform's newest hello
//!   (the outboxes' own operations by cluster tag are the platforms room's);
//! - `early`: outcomes from the stream that came before their message was known to wait;
//! - `order`: own accepts held behind the inbox of their partition (per-session order
//!   across instances);
//! - `lapse`: whether this instance may have been taken for dead (its results marked);
//! - `room`: rebuilt messages of owned partitions waiting for outbox room.

#[cfg(feature = "cluster")]
mod drain;
#[cfg(feature = "cluster")]
mod early;
#[cfg(feature = "cluster")]
mod fence;
#[cfg(feature = "cluster")]
mod forward;
#[cfg(feature = "cluster")]
mod lapse;
#[cfg(not(feature = "cluster"))]
mod off;
#[cfg(feature = "cluster")]
mod order;
#[cfg(feature = "cluster")]
mod room;
#[cfg(feature = "cluster")]
mod side;

#[cfg(not(feature = "cluster"))]
pub(crate) use off::Report;
#[cfg(not(feature = "cluster"))]
pub(in crate::server) use off::{ClusterSide, Request};
#[cfg(feature = "cluster")]
pub(in crate::server) use side::ClusterSide;

/// The cluster's part of a journal report (`crate::cluster::ClusterReport`; without the
/// feature, nothing).
#[cfg(feature = "cluster")]
pub(crate) type Report = crate::cluster::ClusterReport;
/// A request of the bridge for the stream reader's connection (without the feature, none).
#[cfg(feature = "cluster")]
pub(in crate::server) type Request = crate::cluster::ClusterRequest;
