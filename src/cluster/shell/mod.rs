//! The bridge server as a cluster member (`--cluster`). The seam: the server holds one
//! [`Member`] and calls, in both builds, `is_pending`/`start` (at registration; `start`
//! returns the journal thread), `take_report` (each journal completion's cluster part,
//! before the bridge sees it), `arrivals` (the reader's, fed to the bridge), `release_drained`
//! and `request` (the bridge's actions) and `fill_status`; each is given the bridge when it
//! needs it and holds nothing of the server's. Without the `cluster` feature, `off.rs` is
//! the no-op twin.

#[cfg(feature = "cluster")]
mod member;
#[cfg(not(feature = "cluster"))]
mod off;

#[cfg(feature = "cluster")]
pub(crate) use member::Member;
#[cfg(not(feature = "cluster"))]
pub(crate) use off::Member;
