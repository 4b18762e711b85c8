//! The bridge server as a cluster member (`--cluster`), mounted as the server's `cluster`
//! module (`server/mod.rs`). The seam: the server holds one `Member` and calls, in both
//! builds, `is_pending`/`start_cluster` (at registration), `cluster_report` (each journal
//! completion's cluster part, before the bridge sees it), `cluster_arrivals` (the reader's),
//! `release_drained` and `cluster_request` (the bridge's actions) and `cluster_status`.
//! Without the `cluster` feature, `off.rs` is the no-op twin.

#[cfg(feature = "cluster")]
mod member;
#[cfg(not(feature = "cluster"))]
mod off;

#[cfg(feature = "cluster")]
pub(super) use member::Member;
#[cfg(not(feature = "cluster"))]
pub(super) use off::Member;
