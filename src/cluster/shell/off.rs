//! The no-op twin of the server's cluster member, for a build without the `cluster`
//! feature (see `mod.rs`).

use std::convert::Infallible;
use std::io;
use std::time::Duration;

use crate::journal::Journal;
use crate::liveness::BridgeStatus;
use crate::server::bridge::{Bridge, Report};

/// Not a cluster member.
#[derive(Default)]
pub(crate) struct Member {}

impl Member {
    pub(crate) fn is_pending(&self) -> bool {
        false
    }

    pub(crate) fn report(&self) -> Report {
        Report::default()
    }

    pub(crate) fn start(&mut self, _pipe: mio::unix::pipe::Sender) -> io::Result<Option<Journal>> {
        Ok(None)
    }

    pub(crate) fn take_report(&mut self, _bridge: &Bridge, _now: Duration) -> Report {
        Report::default()
    }

    pub(crate) fn release_drained(&self, _partition: u32) {}

    pub(crate) fn request(&self, r: Infallible) {
        match r {}
    }

    pub(crate) fn arrivals(&self, _bridge: &mut Bridge, _now: Duration) {}

    pub(crate) fn fill_status(&self, _bridge: &Bridge, _status: &mut BridgeStatus) {}
}
