//! Files that travel with a message: the entry a bridge sends (`attachments` in the bridge
//! protocol, docs/protocol.md), the spool directory those files live in, and the bounds on
//! both.
//!
//! A bridge downloads a platform's file into the spool and names it in the message; the
//! gateway admits only paths inside the spool (a hostile bridge must not make an agent read
//! `/etc/shadow`), passes the entries to the agent, and deletes the files once the turn that
//! used them ended. Files no accepted message names are orphans, removed at start-up.

use std::io;
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

/// One file of a message, as the bridge protocol carries it and an agent receives it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Attachment {
    /// The file's name on the platform (shown to the agent; never used as a path).
    pub name: String,
    /// Its media type as the platform said it (`image/png`, `text/plain`, …).
    #[serde(default)]
    pub mime: String,
    /// Its size in bytes (as downloaded, or as the platform announced it when skipped).
    #[serde(default)]
    pub size: u64,
    /// SHA-256 of its bytes, lowercase hex (absent when skipped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// Where it is: an absolute path inside the gateway's spool (absent when skipped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Why the file is not there (a bound, a failed download): the entry is kept so the agent
    /// knows a file was sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
}

/// Longest `name`, `mime` or `skipped` text, in bytes.
const MAX_TEXT_BYTES: usize = 256;

/// The spool and its bounds (`--attachments-dir`, `--max-attachment-bytes`,
/// `--max-attachments`, `--attachments-bytes`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttachmentLimits {
    /// The spool directory, absolute and canonical; `None`: no spool, so a message naming a
    /// file path is refused (entries without a path are still passed on).
    pub dir: Option<PathBuf>,
    /// Entries one message may carry (default 10); more are refused `invalid`.
    pub max_files: usize,
    /// Largest file (default 20 MiB): a bridge skips a larger one, the gateway refuses it.
    pub max_file_bytes: u64,
    /// Bytes the spool may hold in all (default 1 GiB): a bridge skips a file that does not
    /// fit.
    pub spool_bytes: u64,
}

/// Default of [`AttachmentLimits::max_files`].
pub(crate) const DEFAULT_MAX_ATTACHMENTS: usize = 10;
/// Default of [`AttachmentLimits::max_file_bytes`] (20 MiB).
pub(crate) const DEFAULT_MAX_ATTACHMENT_BYTES: u64 = 20 << 20;
/// Default of [`AttachmentLimits::spool_bytes`] (1 GiB).
pub(crate) const DEFAULT_SPOOL_BYTES: u64 = 1 << 30;

impl Default for AttachmentLimits {
    fn default() -> Self {
        AttachmentLimits {
            dir: None,
            max_files: DEFAULT_MAX_ATTACHMENTS,
            max_file_bytes: DEFAULT_MAX_ATTACHMENT_BYTES,
            spool_bytes: DEFAULT_SPOOL_BYTES,
        }
    }
}

impl AttachmentLimits {
    /// Checks a message's entries as a bridge sent them: their count, their texts, and that
    /// every path is a regular file inside the spool, no larger than the bound and of the size
    /// the entry says. The error names what is wrong (it goes back to the bridge).
    ///
    /// Runs on the reactor at admission: a few `stat`-level calls per named file (at most
    /// `max_files`), never a read of the file.
    pub(crate) fn check(&self, entries: &[Attachment]) -> Result<(), String> {
        if entries.len() > self.max_files {
            return Err(format!(
                "attachments: more than --max-attachments {}",
                self.max_files
            ));
        }
        for (i, a) in entries.iter().enumerate() {
            check_entry(a).map_err(|e| format!("attachments[{i}]: {e}"))?;
            if let Some(path) = &a.path {
                self.check_path(path, a.size)
                    .map_err(|e| format!("attachments[{i}]: {e}"))?;
            }
        }
        Ok(())
    }

    /// `path` is a regular file inside the spool (after following every link), of `size`
    /// bytes, within the per-file bound.
    fn check_path(&self, path: &str, size: u64) -> Result<(), String> {
        let Some(root) = &self.dir else {
            return Err("path given but the gateway has no attachments directory".into());
        };
        let path = Path::new(path);
        if !path.is_absolute() || path.components().any(|c| c == Component::ParentDir) {
            return Err("path must be absolute, without '..'".into());
        }
        let outside = || "path is not inside the gateway's attachments directory".to_owned();
        // Lexically first: a path that does not even name the spool is refused without a look
        // at the disk (and without saying whether it exists).
        if !path.starts_with(root) {
            return Err(outside());
        }
        let real = path
            .canonicalize()
            .map_err(|_| "path does not exist".to_owned())?;
        if !real.starts_with(root) || real == *root {
            return Err(outside());
        }
        let meta = std::fs::metadata(&real).map_err(|_| "path does not exist".to_owned())?;
        if !meta.is_file() {
            return Err("path is not a regular file".into());
        }
        if meta.len() > self.max_file_bytes {
            return Err(format!(
                "file larger than --max-attachment-bytes {}",
                self.max_file_bytes
            ));
        }
        if meta.len() != size {
            return Err(format!("size says {size} but the file has {}", meta.len()));
        }
        Ok(())
    }
}

fn check_entry(a: &Attachment) -> Result<(), String> {
    let text = |field: &str, value: &str, empty_ok: bool| {
        if (!empty_ok && value.is_empty())
            || value.len() > MAX_TEXT_BYTES
            || value.chars().any(char::is_control)
        {
            Err(format!(
                "{field} must be {} to {MAX_TEXT_BYTES} bytes without control characters",
                usize::from(!empty_ok)
            ))
        } else {
            Ok(())
        }
    };
    text("name", &a.name, false)?;
    text("mime", &a.mime, true)?;
    if let Some(s) = &a.skipped {
        text("skipped", s, false)?;
    }
    if let Some(h) = &a.sha256
        && (h.len() != 64 || !h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
    {
        return Err("sha256 must be 64 lowercase hex digits".into());
    }
    match (&a.path, &a.skipped) {
        (Some(_), Some(_)) => {
            Err("an entry has a path or says why it was skipped, not both".into())
        }
        (None, None) => Err("an entry needs a path, or skipped saying why it has none".into()),
        (Some(_), None) if a.sha256.is_none() => Err("a path needs its sha256".into()),
        _ => Ok(()),
    }
}

/// Parses a list of entries from JSON (the journal's column, the protocol's field).
pub(crate) fn parse_list(value: serde_json::Value) -> Result<Vec<Attachment>, String> {
    serde_json::from_value(value).map_err(|e| {
        format!("attachments must be a list of {{name, mime, size, sha256, path}} objects: {e}")
    })
}

/// The entries as the JSON list agents receive (`TURNSTILE_ATTACHMENTS`, the journal's
/// column).
pub(crate) fn to_json(entries: &[Attachment]) -> String {
    // Strings and numbers: serializing cannot fail.
    serde_json::to_string(entries).unwrap_or_else(|_| "[]".into())
}

/// Creates the spool directory (owner-only) if needed and returns its canonical path.
// The binary's (feature `cli`) and the tests'.
#[cfg_attr(not(feature = "cli"), allow(dead_code))]
pub(crate) fn open_spool(dir: &Path) -> io::Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    dir.canonicalize()
}

/// Bytes held by the spool's regular files (a bridge checks it before a download; the
/// status shows it). The spool is flat: subdirectories are not counted.
pub(crate) fn spool_used(dir: &Path) -> io::Result<u64> {
    let mut used = 0u64;
    for entry in std::fs::read_dir(dir)? {
        let meta = entry?.metadata()?;
        if meta.is_file() {
            used = used.saturating_add(meta.len());
        }
    }
    Ok(used)
}

/// Removes the spool's regular files that `keep` does not name (orphans of a previous run)
/// and the turn outboxes a crash left; returns how many went. Files still being written
/// (`*.part`) are left alone.
pub(crate) fn sweep(dir: &Path, keep: &std::collections::HashSet<PathBuf>) -> io::Result<usize> {
    let mut removed = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        if entry.file_type()?.is_dir()
            && entry
                .file_name()
                .to_string_lossy()
                .starts_with(outbox::OUTBOX_PREFIX)
        {
            std::fs::remove_dir_all(&path)?;
            removed += 1;
            continue;
        }
        let partial = path.extension().is_some_and(|e| e == "part");
        if entry.file_type()?.is_file() && !partial && !keep.contains(&path) {
            std::fs::remove_file(&path)?;
            removed += 1;
        }
    }
    Ok(removed)
}

mod janitor;
mod outbox;
#[cfg(test)]
mod tests;

pub(crate) use janitor::Janitor;
#[cfg_attr(not(feature = "cli"), allow(unused_imports))] // the bridges' (feature `cli`)
pub(crate) use outbox::human_size;
pub(crate) use outbox::{Outbox, Requested, take_requested};
