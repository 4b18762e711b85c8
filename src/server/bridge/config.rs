//! The bridge's limits and timings, and the constants its rooms share.

use std::time::Duration;

/// Outbox room a terminal event may need beyond its text: the JSON envelope with the id and
/// the session key (each escaped), generously.
pub const TERMINAL_ENVELOPE: usize = 8 * 1024;
/// How often deadlines (hello, write stall, typing) and expiry are checked.
pub(super) const HOUSEKEEPING: Duration = Duration::from_millis(100);

/// Limits and timings of the bridge.
#[derive(Clone, Debug)]
pub struct BridgeConfig {
    /// Required in a client's hello when set.
    pub auth_token: Option<String>,
    /// Open connections; beyond it a new one gets an error line and is closed.
    pub max_connections: usize,
    /// Connections that have not yet authenticated (only with a token), in all; at the cap
    /// the oldest waiting one (of the prefix holding the most) is closed for a newcomer.
    pub max_unauthenticated: usize,
    /// Connections that have not yet authenticated, per address prefix (IPv4 /24, IPv6 /64).
    pub max_unauthenticated_per_peer: usize,
    /// Time a connection has to authenticate (only with a token).
    pub hello_timeout: Duration,
    /// Longest accepted line.
    pub max_line_bytes: usize,
    /// Output queued on a connection past which its reads pause and best-effort lines
    /// (typing, partials) are dropped; also how much outbox backlog it is fed at a time.
    pub max_write_buffer: usize,
    /// Bytes written to one connection per wake.
    pub write_budget: usize,
    /// A connection with output that takes none of it for this long is closed (its terminal
    /// events go back to the outbox).
    pub write_stall_timeout: Duration,
    /// Platforms known at once (with connections, pending results or remembered ids).
    pub max_platforms: usize,
    /// Terminal events one platform may have undelivered (reserved at admission).
    pub outbox_cap: usize,
    /// Bytes one platform may hold for undelivered terminal events: each accepted message's
    /// envelope ([`TERMINAL_ENVELOPE`]) plus each result's text once it exists. Never passed:
    /// a result that does not fit is held, in order, until room frees.
    pub outbox_bytes: usize,
    /// A platform no connection has said hello for during this long is stale: its waiting
    /// results beyond the newest [`outbox_stale_keep`](Self::outbox_stale_keep) are dropped
    /// (each with a WARN, counted in the status).
    pub outbox_stale_after: Duration,
    /// Waiting results a stale platform keeps.
    pub outbox_stale_keep: usize,
    /// Longest reply text (the turn worker cuts replies there; the bridge reserves for it).
    pub max_reply_bytes: usize,
    /// How long an accepted (platform, id) is remembered.
    pub dedup_window: Duration,
    /// Ids one platform may have remembered at once.
    pub dedup_max: usize,
    /// Typing refresh period while a turn runs.
    pub typing_refresh: Duration,
    /// Durability is on (`--data-dir`): messages are journaled ([`Action::Journal`](super::Action::Journal)) and
    /// acknowledged only once durable.
    pub journal: bool,
    /// Accepted messages waiting for the journal at once; beyond, `reject` `overloaded`.
    pub max_pending_durable: usize,
    /// At recovery, run again the turns a crash interrupted (else they fail `interrupted by
    /// restart`); a message interrupted twice fails `poison` either way.
    pub resume_interrupted: bool,
    /// Who may talk to the bot, and how much ([`AccessConfig`](crate::AccessConfig)): by
    /// default (an embedder's) every platform is open; `turnstile serve` pairs strangers on
    /// `matrix`, `irc` and `telegram` unless its `[access.*]` tables say otherwise.
    pub access: crate::AccessConfig,
    /// Files a message may name: the spool directory and its bounds (a message naming a path
    /// outside it, or too many files, is refused `invalid`).
    pub attachments: crate::AttachmentLimits,
}

impl Default for BridgeConfig {
    fn default() -> Self {
        BridgeConfig {
            auth_token: None,
            max_connections: 1024,
            max_unauthenticated: 256,
            max_unauthenticated_per_peer: 32,
            hello_timeout: Duration::from_secs(5),
            max_line_bytes: 65_536,
            max_write_buffer: 1 << 20,
            write_budget: 256 * 1024,
            write_stall_timeout: Duration::from_secs(60),
            max_platforms: 16,
            outbox_cap: 10_000,
            outbox_bytes: 256 << 20,
            outbox_stale_after: Duration::from_secs(3600),
            outbox_stale_keep: 1000,
            max_reply_bytes: crate::reactor::DEFAULT_MAX_REPLY_BYTES,
            dedup_window: Duration::from_secs(600),
            dedup_max: 1_000_000,
            typing_refresh: Duration::from_secs(4),
            journal: false,
            max_pending_durable: DEFAULT_MAX_PENDING_DURABLE,
            resume_interrupted: false,
            access: crate::AccessConfig::default(),
            attachments: crate::AttachmentLimits::default(),
        }
    }
}

/// Default of [`BridgeConfig::max_pending_durable`].
const DEFAULT_MAX_PENDING_DURABLE: usize = 10_000;
/// The failure of a turn that was running when the process died.
pub(super) const INTERRUPTED: &str = "interrupted by restart";
/// The failure of a message whose turn a restart interrupted twice (the restart-loop breaker).
pub(super) const POISON: &str =
    "poison: its turn was interrupted by a restart twice; not run again";
