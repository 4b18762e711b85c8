//! The no-op twin of the server's cluster member, for a build without the `cluster`
//! feature (see `mod.rs`).

use std::io;

use crate::liveness::BridgeStatus;
use crate::server::BridgeServer;
use crate::server::bridge::Report;

/// Not a cluster member.
#[derive(Default)]
pub(in crate::server) struct Member {}

impl Member {
    pub(in crate::server) fn is_pending(&self) -> bool {
        false
    }

    pub(in crate::server) fn report(&self) -> Report {
        Report {}
    }
}

impl BridgeServer {
    pub(in crate::server) fn start_cluster(
        &mut self,
        _pipe: mio::unix::pipe::Sender,
    ) -> io::Result<()> {
        Ok(())
    }

    pub(in crate::server) fn cluster_report(&mut self) -> Report {
        Report {}
    }

    pub(in crate::server) fn release_drained(&self, _partition: u32) {}

    pub(in crate::server) fn cluster_request(&self, r: std::convert::Infallible) {
        match r {}
    }

    pub(in crate::server) fn cluster_arrivals(&mut self) {}

    pub(in crate::server) fn cluster_status(&self, _status: &mut BridgeStatus) {}
}
