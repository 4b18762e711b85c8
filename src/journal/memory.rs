//! A session's durable conversation (the built-in openai agent's history with `--data-dir`):
//! the change an outcome record makes to it, how an agent reads it back, and its bounds.
//!
//! The change rides on the outcome ([`super::StoredOutcome::memory`]) and is written in the
//! outcome's own transaction, so the stored conversation is never ahead of the outcomes
//! users saw: a crash before the commit loses both, after it keeps both.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// One exchange: what the user said, what the model answered.
pub(crate) type Exchange = (String, String);

/// Reads a session's stored conversation, oldest exchange first (empty: none stored). Runs
/// on a turn worker when the session's agent is created; it may wait for the journal's
/// commit in progress. Kept by the SQLite journal (`--data-dir`) and by the Redis store
/// (`--cluster`, `cluster/store/history.rs`).
#[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
pub(crate) type MemoryLoader = Arc<dyn Fn(&str) -> Result<Vec<Exchange>, String> + Send + Sync>;

/// Default `--history-ttl`: a conversation nobody continued for 30 days is forgotten.
#[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
pub(crate) const DEFAULT_HISTORY_TTL: Duration = Duration::from_secs(30 * 24 * 3600);
/// Default `--history-bytes`, the stored conversations together: 64 MiB. A full conversation
/// under the default `--history-chars` (24,000) is about 25 KB of JSON, so this keeps ~2,600
/// full ones (many more short ones) on any disk that holds the gateway at all.
#[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
pub(crate) const DEFAULT_HISTORY_BYTES: u64 = 64 << 20;

/// The bounds of the stored conversations, enforced by the journal (with `--cluster`, by the
/// Redis store: `max_bytes` split evenly among the partitions).
#[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HistoryLimits {
    /// A conversation untouched this long is deleted (swept by the journal thread).
    pub(crate) ttl: Duration,
    /// The stored conversations' bytes together; past it, the least recently used go.
    pub(crate) max_bytes: u64,
}

impl Default for HistoryLimits {
    fn default() -> Self {
        HistoryLimits {
            ttl: DEFAULT_HISTORY_TTL,
            max_bytes: DEFAULT_HISTORY_BYTES,
        }
    }
}

/// The change an outcome record makes to its session's stored conversation: the whole
/// conversation as it now is (already within the agent's bounds), or cleared (`/new`).
#[derive(Clone, PartialEq, Eq)]
pub struct MemoryUpdate {
    pub(crate) session: Arc<str>,
    /// Oldest first; `None`: cleared.
    pub(crate) exchanges: Option<Arc<[Exchange]>>,
}

impl MemoryUpdate {
    /// `session`'s conversation is now `exchanges`.
    pub(crate) fn keep(session: &str, exchanges: Vec<Exchange>) -> MemoryUpdate {
        MemoryUpdate {
            session: session.into(),
            exchanges: Some(exchanges.into()),
        }
    }

    /// `session`'s conversation is gone (`/new`).
    pub(crate) fn clear(session: &str) -> MemoryUpdate {
        MemoryUpdate {
            session: session.into(),
            exchanges: None,
        }
    }
}

/// [`MemoryUpdate::keep`], for the benchmarks (`turnstile::internal::journal`).
pub fn kept_conversation(session: &str, exchanges: Vec<Exchange>) -> MemoryUpdate {
    MemoryUpdate::keep(session, exchanges)
}

impl fmt::Debug for MemoryUpdate {
    /// The session and the size, never the conversation's text.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.exchanges {
            Some(e) => write!(f, "MemoryUpdate({}: {} exchanges)", self.session, e.len()),
            None => write!(f, "MemoryUpdate({}: cleared)", self.session),
        }
    }
}
