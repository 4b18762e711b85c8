//! The cluster's operations on the connections' room (`--cluster`): a result found by its
//! cluster tag (forwards), a rescued result marked. Mounted as a child of
//! `server/bridge/conns.rs`, whose fields it reads; without the feature, no-ops.

use crate::server::frame::Frame;

/// A result rescued from a dying connection that another instance could be forwarded (it
/// has a cluster tag) is marked `redelivery`: it may have reached the platform from there.
pub(super) fn mark_rescued(f: &mut Frame) {
    if f.cluster != 0 {
        f.mark_redelivery();
    }
}

#[cfg(feature = "cluster")]
impl super::Conns {
    /// Whether a connection holds the result of cluster tag `tag` (queued, or written and
    /// not yet confirmed).
    pub(in crate::server::bridge) fn holds_cluster(&self, tag: u64) -> bool {
        self.slots
            .iter()
            .any(|(_, c)| c.terminals().any(|f| f.cluster == tag))
    }
}
