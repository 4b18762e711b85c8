//! A session's durable conversation (the built-in openai agent's history with `--data-dir`):
//! the change an outcome record makes to it, how an agent reads it back, and its bounds.
//!
//! The change rides on the outcome ([`super::StoredOutcome::memory`]) and is written in the
//! outcome's own transaction, so the stored conversation is never ahead of the outcomes
//! users saw: a crash before the commit loses both, after it keeps both.

use std::borrow::Cow;
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

/// One line of a conversation's export, one exchange: what `turnstile history export` prints
/// and what the HTTP endpoint's `GET /history` answers, a JSON object a line, oldest first:
/// `{"session":"…","user":"…","assistant":"…"}`.
#[derive(serde::Serialize, serde::Deserialize)]
struct ExportLine<'a> {
    #[serde(borrow)]
    session: Cow<'a, str>,
    #[serde(borrow)]
    user: Cow<'a, str>,
    #[serde(borrow)]
    assistant: Cow<'a, str>,
}

/// `session`'s exchanges as export lines, each ending in a newline (empty: none stored).
pub(crate) fn export_lines(session: &str, exchanges: &[Exchange]) -> String {
    let mut out = String::new();
    for (user, assistant) in exchanges {
        let line = ExportLine {
            session: session.into(),
            user: user.as_str().into(),
            assistant: assistant.as_str().into(),
        };
        // Strings only: serializing cannot fail.
        if let Ok(text) = serde_json::to_string(&line) {
            out.push_str(&text);
            out.push('\n');
        }
    }
    out
}

/// Export lines read back (`turnstile history export --http`), refusing a line that is not
/// one or that names another session than `session`.
// Only the CLI (feature `cli`) reads them.
#[cfg_attr(not(feature = "cli"), allow(dead_code))]
pub(crate) fn read_export_lines(session: &str, text: &str) -> Result<Vec<Exchange>, String> {
    let mut exchanges = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line: ExportLine<'_> = serde_json::from_str(line)
            .map_err(|e| format!("line {} is not an exchange: {e}", n + 1))?;
        if line.session != session {
            return Err(format!(
                "line {} is of session {:?}, not {session:?}",
                n + 1,
                line.session
            ));
        }
        exchanges.push((line.user.into_owned(), line.assistant.into_owned()));
    }
    Ok(exchanges)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// What the endpoint writes the CLI reads back, escapes and all; a line of another
    /// session, or not a line at all, is refused.
    #[test]
    fn export_lines_round_trip_and_name_their_session() {
        let session = "matrix:group:!r%3Ahs:user:@a%3Ahs";
        let exchanges = vec![
            ("quote \" and\nnewline".to_owned(), "é ✓".to_owned()),
            ("2".to_owned(), String::new()),
        ];
        let text = export_lines(session, &exchanges);
        assert_eq!(text.lines().count(), 2);
        assert!(text.starts_with(r#"{"session":"matrix:group:!r%3Ahs:user:@a%3Ahs","user":"quote \" and\nnewline","assistant":"é ✓"}"#), "{text}");
        assert_eq!(read_export_lines(session, &text), Ok(exchanges));
        assert_eq!(export_lines(session, &[]), "");
        assert_eq!(read_export_lines(session, ""), Ok(Vec::new()));
        let other = read_export_lines("cli:dm:local", &text).expect_err("another session");
        assert!(other.contains("line 1 is of session"), "{other}");
        let cut = read_export_lines(session, &text[..text.len() - 5]).expect_err("cut short");
        assert!(cut.starts_with("line 2 is not an exchange"), "{cut}");
    }
}
