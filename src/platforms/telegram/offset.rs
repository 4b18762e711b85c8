//! The update offset, persisted so that a restarted bridge neither loses nor repeats an
//! update.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::platforms::BridgeError;

/// The update offset, kept in `<state-dir>/telegram-offset`.
#[derive(Debug)]
pub(crate) struct OffsetStore {
    path: Option<PathBuf>,
}

impl OffsetStore {
    /// Keeps the offset in `dir` (created if missing), or nowhere.
    pub(crate) fn new(dir: Option<&Path>) -> Result<OffsetStore, BridgeError> {
        let path = match dir {
            Some(d) => {
                std::fs::create_dir_all(d)
                    .map_err(|e| format!("cannot create --state-dir {}: {e}", d.display()))?;
                Some(d.join("telegram-offset"))
            }
            None => None,
        };
        Ok(OffsetStore { path })
    }

    /// The saved offset; `None` when none was saved. A damaged file is an error: starting
    /// over could process updates twice.
    pub(crate) fn load(&self) -> Result<Option<i64>, BridgeError> {
        let Some(path) = &self.path else {
            return Ok(None);
        };
        match std::fs::read_to_string(path) {
            Ok(text) => text.trim().parse::<i64>().map(Some).map_err(|_| {
                format!(
                    "the state file {} is damaged (not a number); remove it to start from Telegram's own offset",
                    path.display()
                )
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("cannot read the state file {}: {e}", path.display())),
        }
    }

    /// Saves the offset atomically (a temporary file, synced, renamed over the old one).
    pub(crate) fn save(&self, offset: i64) -> Result<(), String> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let tmp = path.with_extension("tmp");
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            writeln!(f, "{offset}")?;
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
