//! The bridge's figures for the status snapshot: the counters the bridge keeps and their
//! assembly from each room (the types live in `liveness`, with the rest of the status).

use std::collections::BTreeMap;
use std::time::Duration;

use super::access::Access;
use super::config::BridgeConfig;
use super::conns::Conns;
use super::durable::Durable;
use super::platforms::Platforms;
use crate::liveness::AttachmentsStatus;
pub(crate) use crate::liveness::{BridgeStatus, JournalStatus, PlatformStatus, RecoveryCounts};

/// What the bridge still owes, read from its rooms ([`super::Bridge::backlog`]): what a
/// shutdown waits for and reports, and what the tests watch drain.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Backlog {
    /// Terminal events waiting for their outcome record to be durable.
    pub unjournaled: usize,
    /// Terminal events still waiting in outboxes (or for their outcome record: these
    /// include `unjournaled`).
    pub outboxed: usize,
    /// Messages a graceful shutdown left in the journal for the next start.
    pub kept_for_restart: usize,
    /// Results written to `acks` connections and not yet confirmed with `delivered`.
    pub awaiting_delivery: usize,
}

impl Backlog {
    /// The counts, from each room that holds them.
    pub(super) fn of(conns: &Conns, platforms: &Platforms, durable: Option<&Durable>) -> Backlog {
        let unjournaled = durable.map_or(0, Durable::unjournaled);
        Backlog {
            unjournaled,
            outboxed: platforms.outboxed() + unjournaled,
            kept_for_restart: durable.map_or(0, Durable::kept),
            awaiting_delivery: conns.awaiting_delivery(),
        }
    }
}

/// What the bridge counts as it goes (the rest of the status is read from the rooms).
#[derive(Default)]
pub(super) struct Counters {
    rejected: BTreeMap<&'static str, u64>,
    pub(super) connections_refused: u64,
    pub(super) errors: u64,
    pub(super) partials_dropped: u64,
    pub(super) typing_dropped: u64,
    /// Results dropped undelivered: owed to a platform absent past `--outbox-stale-after`.
    pub(super) stale_dropped: u64,
}

impl Counters {
    /// `lines` lines were refused for `reason`: the one place rejections are counted.
    pub(super) fn count_rejected(&mut self, reason: &'static str, lines: u64) {
        *self.rejected.entry(reason).or_insert(0) += lines;
    }
}

impl Counters {
    /// The figures for the status snapshot: these counters and each room's figures at `now`.
    pub(super) fn status(
        &self,
        cfg: &BridgeConfig,
        conns: &Conns,
        platforms: &Platforms,
        durable: Option<&Durable>,
        access: &Access,
        now: Duration,
    ) -> BridgeStatus {
        let c = self;
        let mut outboxes = platforms.status(now);
        for (platform, link) in conns.links() {
            if let Some(p) = outboxes.get_mut(platform) {
                p.link = Some(link.clone());
            }
        }
        BridgeStatus {
            connections: conns.len(),
            unauthenticated: conns.unauthenticated(),
            platforms: platforms.len(),
            outboxes,
            rejected: c.rejected.clone(),
            connections_refused: c.connections_refused,
            errors: c.errors,
            partials_dropped: c.partials_dropped,
            typing_dropped: c.typing_dropped,
            stale_dropped: c.stale_dropped,
            journal: durable.map(Durable::status),
            awaiting_delivery: conns.awaiting_delivery(),
            // The shell knows (`BridgeServer::status`).
            tls: false,
            tls_cert_not_after_unix_s: None,
            // The shell's too (`BridgeServer::status`, with the reader's figures).
            cluster: None,
            access: access.figures(),
            attachments: cfg.attachments.dir.as_ref().map(|dir| {
                let limits = &cfg.attachments;
                AttachmentsStatus {
                    dir: dir.display().to_string(),
                    spool_bytes: limits.spool_bytes,
                    max_file_bytes: limits.max_file_bytes,
                    max_files: limits.max_files,
                    // The shell's janitor measures the rest (`BridgeServer::status`).
                    ..AttachmentsStatus::default()
                }
            }),
        }
    }
}
