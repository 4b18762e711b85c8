//! The Gateway session kept in `--state-dir`, so a restarted bridge resumes it and Discord
//! replays what came while it was down (within the session's lifetime), and how far the
//! gateway has the messages: the sequence saved is one below the oldest message not yet
//! answered by the gateway, so a restart replays every message the gateway may lack.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use super::shard::Session;
use crate::platforms::BridgeError;

/// The session file, `<state-dir>/discord-session`.
#[derive(Debug)]
pub(crate) struct SessionStore {
    path: Option<PathBuf>,
}

impl SessionStore {
    /// Keeps the session in `dir` (created if missing), or nowhere.
    pub(crate) fn new(dir: Option<&Path>) -> Result<SessionStore, BridgeError> {
        let path = match dir {
            Some(d) => {
                std::fs::create_dir_all(d)
                    .map_err(|e| format!("cannot create --state-dir {}: {e}", d.display()))?;
                Some(d.join("discord-session"))
            }
            None => None,
        };
        Ok(SessionStore { path })
    }

    /// The saved session, if any. A damaged file is an error (remove it to start anew).
    pub(crate) fn load(&self) -> Result<Option<Session>, BridgeError> {
        let Some(path) = &self.path else {
            return Ok(None);
        };
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => {
                return Err(format!(
                    "cannot read the state file {}: {e}",
                    path.display()
                ));
            }
        };
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        let field = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
        match (
            field("session_id"),
            field("resume_url"),
            v.get("seq").and_then(Value::as_u64),
        ) {
            (Some(session_id), Some(resume_url), Some(seq)) => Ok(Some(Session {
                session_id,
                resume_url,
                seq,
            })),
            _ => Err(format!(
                "the state file {} is damaged; remove it to start a new session",
                path.display()
            )),
        }
    }

    /// Saves `session` atomically (a temporary file, synced, renamed over the old one).
    pub(crate) fn save(&self, session: &Session) -> Result<(), String> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let tmp = path.with_extension("tmp");
        let body = json!({"session_id": session.session_id, "resume_url": session.resume_url, "seq": session.seq});
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            writeln!(f, "{body}")?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)?;
            if let Some(dir) = path.parent() {
                std::fs::File::open(dir)?.sync_all()?;
            }
            Ok(())
        };
        write().map_err(|e| format!("cannot write the state file {}: {e}", path.display()))
    }
}

/// The messages of the current session the gateway has not answered yet, by sequence.
#[derive(Debug, Default)]
pub(crate) struct Progress {
    unanswered: BTreeMap<u64, String>,
    by_id: HashMap<String, (u64, String)>,
}

impl Progress {
    /// A new session: earlier sequence numbers mean nothing in it.
    pub(crate) fn reset(&mut self) {
        self.unanswered.clear();
        self.by_id.clear();
    }

    /// Message `id` of `channel`, dispatch `seq`, was handed to the gateway.
    pub(crate) fn handed(&mut self, seq: u64, id: &str, channel: &str) {
        if self.by_id.contains_key(id) {
            return;
        }
        self.unanswered.insert(seq, id.to_owned());
        self.by_id.insert(id.to_owned(), (seq, channel.to_owned()));
        debug_assert_eq!(self.unanswered.len(), self.by_id.len());
    }

    /// The gateway answered `id`: its channel, if it was one of this session's.
    pub(crate) fn answered(&mut self, id: &str) -> Option<String> {
        let (seq, channel) = self.by_id.remove(id)?;
        self.unanswered.remove(&seq);
        debug_assert_eq!(self.unanswered.len(), self.by_id.len());
        Some(channel)
    }

    /// The sequence a restart may resume from: everything at or below it is answered.
    /// `last_seq` is the newest received, read before the latest messages were taken in.
    pub(crate) fn safe_seq(&self, last_seq: u64) -> u64 {
        match self.unanswered.keys().next() {
            Some(oldest) => oldest.saturating_sub(1).min(last_seq),
            None => last_seq,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_safe_sequence_stays_below_the_oldest_unanswered_message() {
        let mut p = Progress::default();
        assert_eq!(p.safe_seq(3), 3);
        p.handed(4, "dc-1", "c");
        p.handed(6, "dc-2", "c");
        assert_eq!(p.safe_seq(7), 3);
        assert_eq!(p.answered("dc-2").as_deref(), Some("c"));
        assert_eq!(p.safe_seq(7), 3);
        assert_eq!(p.answered("dc-1").as_deref(), Some("c"));
        assert_eq!(p.safe_seq(7), 7);
        assert_eq!(p.answered("dc-1"), None);
    }

    #[test]
    fn a_saved_session_loads_back_and_a_damaged_file_is_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SessionStore::new(Some(dir.path())).expect("store");
        assert_eq!(store.load().expect("load"), None);
        let s = Session {
            session_id: "abc".into(),
            resume_url: "wss://r".into(),
            seq: 42,
        };
        store.save(&s).expect("save");
        assert_eq!(store.load().expect("load"), Some(s));
        std::fs::write(dir.path().join("discord-session"), "x").expect("write");
        assert!(store.load().is_err());
    }
}
