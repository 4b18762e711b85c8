//! `--state-dir`: the sync position (`next_batch`) kept across restarts, so messages written
//! while the bridge was down are answered when it comes back, none twice.
//!
//! A batch's token is written only once every message of that batch (and of the batches
//! before it) has been answered by the gateway (`ack`, `duplicate` or `reject`): a bridge that
//! crashes before that syncs the batch again, and the gateway's duplicate window (by event
//! id) keeps a message it already had from running twice.

use std::collections::{HashSet, VecDeque};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The file in the state directory.
const FILE: &str = "matrix-next-batch";
/// Batches waiting for their messages' answers at most; past it the two oldest merge (the
/// newer token stands for both, written once both are answered).
const MAX_BATCHES: usize = 1024;

/// Reads the stored token, if any. A token that is not plausible (empty, huge, control
/// characters) is an error naming the file.
pub(crate) fn load(dir: &Path) -> Result<Option<String>, String> {
    let path = dir.join(FILE);
    match std::fs::read_to_string(&path) {
        Ok(s) => {
            let token = s.trim();
            if token.is_empty() || token.len() > 4096 || token.chars().any(char::is_control) {
                return Err(format!(
                    "{}: not a sync token; remove the file to start from now",
                    path.display()
                ));
            }
            Ok(Some(token.to_owned()))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
    }
}

/// Which sync tokens may be written, as the gateway answers the batches' messages.
#[derive(Debug)]
pub(crate) struct Tracker {
    dir: PathBuf,
    /// Each batch's token and its messages not answered yet, oldest first.
    batches: VecDeque<(String, HashSet<String>)>,
    /// Messages handed over since the last batch marker.
    current: HashSet<String>,
    /// The last token written.
    pub written: Option<String>,
}

impl Tracker {
    /// Writes to `dir` (created if missing).
    pub(crate) fn new(dir: &Path) -> Result<Tracker, String> {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create the state directory {}: {e}", dir.display()))?;
        Ok(Tracker {
            dir: dir.to_owned(),
            batches: VecDeque::new(),
            current: HashSet::new(),
            written: None,
        })
    }

    /// Message `id` was handed to the gateway and waits for its answer.
    pub(crate) fn sent(&mut self, id: &str) {
        self.current.insert(id.to_owned());
    }

    /// The sync batch whose messages were just handed over ends with `token`.
    pub(crate) fn batch(&mut self, token: &str) {
        let ids = std::mem::take(&mut self.current);
        if self.batches.len() >= MAX_BATCHES
            && let Some((_, older)) = self.batches.pop_front()
            && let Some((_, next)) = self.batches.front_mut()
        {
            next.extend(older);
        }
        self.batches.push_back((token.to_owned(), ids));
        self.flush();
    }

    /// The gateway answered message `id`.
    pub(crate) fn answered(&mut self, id: &str) {
        self.current.remove(id);
        for (_, ids) in &mut self.batches {
            ids.remove(id);
        }
        self.flush();
    }

    /// Batches whose messages were not all answered yet.
    #[cfg(test)]
    pub(crate) fn waiting(&self) -> usize {
        self.batches.len()
    }

    fn flush(&mut self) {
        let mut token = None;
        while self.batches.front().is_some_and(|(_, ids)| ids.is_empty()) {
            token = self.batches.pop_front().map(|(t, _)| t);
        }
        if let Some(t) = token
            && self.written.as_deref() != Some(t.as_str())
        {
            match write_atomically(&self.dir.join(FILE), &t) {
                Ok(()) => {
                    debug_redacted!("matrix: sync position {t} written");
                    self.written = Some(t);
                }
                Err(e) => warn_limited!(
                    "matrix: cannot write the sync position to {}: {e} (a restart may answer recent messages late or not at all)",
                    self.dir.display()
                ),
            }
        }
    }
}

pub(crate) fn write_atomically(path: &Path, text: &str) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    if let Some(parent) = path.parent()
        && let Ok(d) = std::fs::File::open(parent)
    {
        let _ = d.sync_all();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_written_only_once_its_batch_and_the_ones_before_are_answered() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut t = Tracker::new(dir.path()).expect("tracker");
        assert_eq!(load(dir.path()), Ok(None));
        t.batch("s0"); // the catch-up batch had no message
        assert_eq!(load(dir.path()), Ok(Some("s0".into())));
        t.sent("$a");
        t.batch("s1");
        t.sent("$b");
        t.sent("$c");
        t.batch("s2");
        t.answered("$b");
        t.answered("$c");
        assert_eq!(
            load(dir.path()),
            Ok(Some("s0".into())),
            "s1 still waits for $a"
        );
        t.answered("$a");
        assert_eq!(load(dir.path()), Ok(Some("s2".into())));
        assert_eq!(t.waiting(), 0);
        t.answered("$unknown"); // harmless
        assert_eq!(t.written.as_deref(), Some("s2"));
    }

    #[test]
    fn batches_waiting_are_bounded_by_merging_the_oldest() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut t = Tracker::new(dir.path()).expect("tracker");
        t.sent("$first");
        t.batch("s0");
        for i in 1..=MAX_BATCHES + 5 {
            t.batch(&format!("s{i}"));
        }
        assert!(t.waiting() <= MAX_BATCHES);
        assert_eq!(
            load(dir.path()),
            Ok(None),
            "the first message still unanswered"
        );
        t.answered("$first");
        assert_eq!(load(dir.path()), Ok(Some(format!("s{}", MAX_BATCHES + 5))));
    }

    #[test]
    fn a_damaged_state_file_is_a_clear_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join(FILE), "bad\u{0}token").expect("write");
        let e = load(dir.path()).unwrap_err();
        assert!(e.contains("not a sync token"), "{e}");
    }
}
