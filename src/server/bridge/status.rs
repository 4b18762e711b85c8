//! The bridge's figures for the status snapshot: the types the HTTP endpoint and the metrics
//! read (their fields and serde names are the wire format), the counters the bridge keeps,
//! and their assembly from each room.

use std::collections::BTreeMap;

use serde::Serialize;

use super::Bridge;

/// One platform's figures in the status.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PlatformStatus {
    /// Connections that said hello for it.
    pub connections: usize,
    /// Terminal events waiting in its outbox.
    pub outbox_events: usize,
    /// Bytes of those events.
    pub outbox_bytes: usize,
    /// Terminal events reserved (accepted messages not yet answered, outbox included).
    pub reserved_events: usize,
    /// Bytes reserved for them.
    pub reserved_bytes: usize,
    /// Ids in its duplicate window.
    pub dedup_ids: usize,
}

/// The bridge's figures, for the status snapshot.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct BridgeStatus {
    /// Open connections.
    pub connections: usize,
    /// Connections that have not authenticated yet.
    pub unauthenticated: usize,
    /// Platforms known.
    pub platforms: usize,
    /// Per platform.
    pub outboxes: BTreeMap<String, PlatformStatus>,
    /// Rejections by reason, the runtime's included.
    pub rejected: BTreeMap<&'static str, u64>,
    /// Connections refused or closed at a bound (too many, hello deadline, stall).
    pub connections_refused: u64,
    /// Lines answered with `error`.
    pub errors: u64,
    /// Partial replies dropped (connection gone or over its output bound).
    pub partials_dropped: u64,
    /// Typing lines dropped (no connection, or over its output bound).
    pub typing_dropped: u64,
    /// Durability (`--data-dir`); absent without it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub journal: Option<JournalStatus>,
    /// Results written to `acks` connections and not yet confirmed `delivered`.
    pub awaiting_delivery: usize,
}

/// The journal's figures in the status.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[non_exhaustive]
pub struct JournalStatus {
    /// Records sent to the journal thread and not yet taken.
    pub queued_records: usize,
    /// Accepted messages waiting to be durable before their ack.
    pub pending_durable: usize,
    /// Terminal events waiting for their outcome record before they are sent.
    pub unjournaled_outcomes: usize,
    /// The bound on them (`--max-pending-durable`).
    pub max_pending_durable: usize,
    /// Transactions written.
    pub batches: u64,
    /// Transactions that failed.
    pub failed_batches: u64,
    /// Records kept for another try after a failed write.
    pub retrying: usize,
    /// The last write failed (new messages are rejected `storage`).
    pub failing: bool,
    /// Wake-ups of the reactor by the journal thread that reached the server on the
    /// journal's own poll token (set by the shell).
    pub wakes: u64,
    /// What start-up recovery found.
    pub recovery: RecoveryCounts,
}

/// What start-up recovery did, by message.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct RecoveryCounts {
    /// Messages found in the journal.
    pub messages: usize,
    /// Waiting messages submitted again, in their original order.
    pub requeued: usize,
    /// Interrupted turns run again (`--resume-interrupted`).
    pub resumed: usize,
    /// Interrupted turns failed `interrupted by restart`.
    pub interrupted: usize,
    /// Messages failed `poison` (interrupted twice).
    pub poisoned: usize,
    /// Outcomes not yet delivered, back in their outboxes.
    pub outcomes: usize,
    /// Ids in the duplicate windows.
    pub dedup_ids: usize,
}

/// What the bridge counts as it goes (the rest of the status is read from the rooms).
#[derive(Default)]
pub(super) struct Counters {
    rejected: BTreeMap<&'static str, u64>,
    pub(super) connections_refused: u64,
    pub(super) errors: u64,
    pub(super) partials_dropped: u64,
    pub(super) typing_dropped: u64,
}

impl Counters {
    /// `lines` lines were refused for `reason`: the one place rejections are counted.
    pub(super) fn count_rejected(&mut self, reason: &'static str, lines: u64) {
        *self.rejected.entry(reason).or_insert(0) += lines;
    }
}

impl Bridge {
    /// The figures for the status snapshot.
    pub fn status(&self) -> BridgeStatus {
        let c = &self.stats;
        BridgeStatus {
            connections: self.conns.len(),
            unauthenticated: self.conns.unauthenticated(),
            platforms: self.platforms.len(),
            outboxes: self.platforms.status(),
            rejected: c.rejected.clone(),
            connections_refused: c.connections_refused,
            errors: c.errors,
            partials_dropped: c.partials_dropped,
            typing_dropped: c.typing_dropped,
            journal: self.durable.as_ref().map(|d| d.status()),
            awaiting_delivery: self.conns.awaiting_delivery(),
        }
    }
}
