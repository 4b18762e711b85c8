//! A turn's outbox (issue 36, files in replies): a private directory inside the spool where an
//! agent leaves the files its reply carries. An exec agent gets it as `$TURNSTILE_OUTBOX`
//! and every regular file left at its top level is attached; a process agent gets it in the
//! `turn` line and names the files to attach in its `reply` (paths that must resolve inside
//! it). docs/agent-protocol.md.
//!
//! What is attached is moved out of the outbox into the spool itself (flat, like inbound
//! files, so the spool's measure and start-up sweep see it), then hashed from the moved file
//! opened without following links: what the agent does to the outbox afterwards changes
//! nothing. The inbound bounds apply (`--max-attachment-bytes`, `--max-attachments` per
//! reply, `--attachments-bytes` for the spool); a file past one is left out and the reply
//! says so in a line of its own, never silently. The outbox itself is removed when the turn
//! ends, whatever it still holds.

use std::io::{self, Read};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::{Attachment, AttachmentLimits, MAX_TEXT_BYTES};

/// Name prefix of outboxes and of the files moved out of them (the start-up sweep removes an
/// outbox a crash left).
pub(crate) const OUTBOX_PREFIX: &str = "out-";

/// Outboxes made by this process, for unique names.
static MADE: AtomicU64 = AtomicU64::new(0);

/// A file a process agent names in its `reply` (`attachments`, docs/agent-protocol.md).
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub(crate) struct Requested {
    /// The file: relative to the outbox, or absolute inside it.
    pub path: String,
    /// The name the chat shows (default: the file's own name).
    #[serde(default)]
    pub name: Option<String>,
    /// Its media type (default: guessed from the name's extension).
    #[serde(default)]
    pub mime: Option<String>,
}

/// What a turn's outbox gave its reply: the files attached, and one line per file left out.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Collected {
    /// Entries with a path in the spool, size and sha256.
    pub files: Vec<Attachment>,
    /// `(file left out: NAME, SIZE: why)` lines, added to the reply's text.
    pub notes: Vec<String>,
}

impl Collected {
    /// The reply's text with the notes added, one per line.
    pub(crate) fn annotate(&self, mut text: String) -> String {
        for note in &self.notes {
            if !text.is_empty() && !text.ends_with('\n') {
                text.push('\n');
            }
            text.push_str(note);
        }
        text
    }
}

/// The files a process agent's reply names, from its turn's outbox; with no outbox (the
/// gateway has no spool) each is left out, said.
pub(crate) fn take_requested(outbox: Option<Outbox>, requested: &[Requested]) -> Collected {
    match outbox {
        Some(o) => o.take_named(requested),
        None => Collected {
            files: Vec::new(),
            notes: requested
                .iter()
                .map(|r| {
                    let name = r.name.clone().unwrap_or_else(|| base_name(&r.path));
                    left_out(&name, None, "this gateway has no attachments directory")
                })
                .collect(),
        },
    }
}

/// One turn's outbox directory; dropping it removes the directory and what it still holds.
#[derive(Debug)]
pub(crate) struct Outbox {
    /// `<spool>/out-<unique>`, canonical (the spool is).
    dir: PathBuf,
    limits: AttachmentLimits,
}

impl Outbox {
    /// Makes a fresh outbox in the spool of `limits` (owner-only); `None` without a spool.
    pub(crate) fn create(limits: &AttachmentLimits) -> io::Result<Option<Outbox>> {
        use std::os::unix::fs::DirBuilderExt;
        let Some(spool) = &limits.dir else {
            return Ok(None);
        };
        let n = MADE.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir = spool.join(format!(
            "{OUTBOX_PREFIX}{}-{n}-{nanos:08x}",
            std::process::id()
        ));
        std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
        Ok(Some(Outbox {
            dir,
            limits: limits.clone(),
        }))
    }

    /// The directory, for the agent.
    pub(crate) fn path(&self) -> &Path {
        &self.dir
    }

    /// The exec agent's rule: every regular file at the outbox's top level, by name.
    /// Directories are ignored; a link or other special file is left out, said.
    pub(crate) fn take_all(self) -> Collected {
        let mut names: Vec<_> = match std::fs::read_dir(&self.dir) {
            Ok(entries) => entries
                .filter_map(Result::ok)
                .map(|e| e.file_name())
                .collect(),
            Err(e) => {
                log::warn!("outbox {}: cannot read: {e}", self.dir.display());
                Vec::new()
            }
        };
        names.sort();
        let requested = names
            .into_iter()
            .filter(|n| !self.dir.join(n).is_dir() || self.dir.join(n).is_symlink())
            .map(|n| Requested {
                path: n.to_string_lossy().into_owned(),
                name: None,
                mime: None,
            })
            .collect::<Vec<_>>();
        self.take_named(&requested)
    }

    /// The process agent's rule: the files its reply names, each inside the outbox.
    pub(crate) fn take_named(self, requested: &[Requested]) -> Collected {
        let mut out = Collected::default();
        let mut used = self
            .limits
            .dir
            .as_deref()
            .map_or(Ok(0), super::spool_used)
            .unwrap_or(u64::MAX);
        for (i, r) in requested.iter().enumerate() {
            let shown = r.name.clone().unwrap_or_else(|| base_name(&r.path));
            match self.take_one(i, r, &mut used, out.files.len()) {
                Ok(entry) => out.files.push(entry),
                Err(Left { size, why }) => out.notes.push(left_out(&shown, size, &why)),
            }
        }
        out
    }

    /// Checks, moves and hashes one file; `used` is the spool's bytes so far.
    fn take_one(
        &self,
        i: usize,
        r: &Requested,
        used: &mut u64,
        taken: usize,
    ) -> Result<Attachment, Left> {
        let left = |size, why: &str| Left {
            size,
            why: why.to_owned(),
        };
        let path = self.resolve(&r.path).ok_or_else(|| {
            left(
                None,
                "refused: the path is not inside this turn's outbox ($TURNSTILE_OUTBOX)",
            )
        })?;
        let meta = std::fs::symlink_metadata(&path)
            .map_err(|_| left(None, "refused: no such file in the outbox"))?;
        if !meta.file_type().is_file() {
            return Err(left(None, "refused: not a regular file"));
        }
        let size = Some(meta.len());
        let l = &self.limits;
        if taken >= l.max_files {
            return Err(left(
                size,
                &format!("more than --max-attachments {}", l.max_files),
            ));
        }
        if meta.len() > l.max_file_bytes {
            return Err(left(size, &too_big(l.max_file_bytes)));
        }
        if used.saturating_add(meta.len()) > l.spool_bytes {
            return Err(left(size, &spool_full(l.spool_bytes)));
        }
        let Some(dest) = self.spool_name(i) else {
            return Err(left(size, "no spool"));
        };
        std::fs::rename(&path, &dest).map_err(|e| left(size, &format!("cannot move it: {e}")))?;
        let (bytes, sha256) = match hash_no_follow(&dest, l.max_file_bytes) {
            Ok(h) => h,
            Err(e) => {
                let _ = std::fs::remove_file(&dest);
                return Err(left(size, &format!("refused: {e}")));
            }
        };
        if bytes != meta.len() {
            // Written to while it was taken (a process the agent left running): what was
            // checked is not what would be sent.
            let _ = std::fs::remove_file(&dest);
            return Err(left(
                Some(bytes),
                "refused: it changed while it was attached",
            ));
        }
        *used = used.saturating_add(bytes);
        let name = clean(r.name.as_deref().unwrap_or(&base_name(&r.path)), "file");
        let mime = match &r.mime {
            Some(m) => clean(m, ""),
            None => guess_mime(&name).to_owned(),
        };
        Ok(Attachment {
            name,
            mime,
            size: bytes,
            sha256: Some(sha256),
            path: Some(dest.to_string_lossy().into_owned()),
            skipped: None,
        })
    }

    /// `path` (relative to the outbox, or absolute) as a path inside it: no `..`, and every
    /// directory on the way resolving inside the outbox (a link out of it is refused).
    fn resolve(&self, path: &str) -> Option<PathBuf> {
        let p = Path::new(path);
        if path.is_empty() || p.components().any(|c| c == Component::ParentDir) {
            return None;
        }
        let full = if p.is_absolute() {
            p.to_path_buf()
        } else {
            self.dir.join(p)
        };
        if !full.starts_with(&self.dir) || full == self.dir {
            return None;
        }
        let parent = full.parent()?.canonicalize().ok()?;
        parent.starts_with(&self.dir).then_some(full)
    }

    /// Where the `i`th file of this reply goes: flat in the spool, named after the outbox.
    fn spool_name(&self, i: usize) -> Option<PathBuf> {
        let spool = self.limits.dir.as_ref()?;
        let own = self.dir.file_name()?.to_string_lossy();
        Some(spool.join(format!("{own}-{i}")))
    }
}

impl Drop for Outbox {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.dir)
            && e.kind() != io::ErrorKind::NotFound
        {
            log::warn!("outbox {}: not removed: {e}", self.dir.display());
        }
    }
}

/// A file left out: its size if known, and why.
struct Left {
    size: Option<u64>,
    why: String,
}

/// The line a reply gets for a file left out.
fn left_out(name: &str, size: Option<u64>, why: &str) -> String {
    let name = clean(name, "file");
    match size {
        Some(s) => format!("(file left out: {name}, {}: {why})", human_size(s)),
        None => format!("(file left out: {name}: {why})"),
    }
}

// The flags' values as given (the inbound bridges' texts say them so too).
fn too_big(max: u64) -> String {
    format!("larger than --max-attachment-bytes {max}")
}

fn spool_full(max: u64) -> String {
    format!("the attachments spool is full (--attachments-bytes {max})")
}

/// A size as people read it: `512 B`, `1.5 KiB`, `20.0 MiB`.
pub(crate) fn human_size(n: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

/// The last component of `path` (what the chat shows when the agent gives no name).
fn base_name(path: &str) -> String {
    Path::new(path)
        .file_name()
        .map_or_else(|| path.to_owned(), |n| n.to_string_lossy().into_owned())
}

/// A name or media type as the protocol takes it: no control characters, at most
/// `MAX_TEXT_BYTES` bytes on a character boundary; `empty` when nothing is left.
fn clean(text: &str, empty: &str) -> String {
    let mut s: String = text.chars().filter(|c| !c.is_control()).collect();
    crate::text::truncate(&mut s, MAX_TEXT_BYTES);
    let s = s.trim();
    if s.is_empty() {
        empty.to_owned()
    } else {
        s.to_owned()
    }
}

/// The media type of a file name's extension (the common ones; else
/// `application/octet-stream`): what picks a photo or a document on the platforms.
pub(crate) fn guess_mime(name: &str) -> &'static str {
    let ext = name
        .rsplit_once('.')
        .map(|(_, e)| e.to_ascii_lowercase())
        .unwrap_or_default();
    match ext.as_str() {
        "png" => "image/png",
        "jpg" | "jpeg" => "image/jpeg",
        "gif" => "image/gif",
        "webp" => "image/webp",
        "svg" => "image/svg+xml",
        "txt" | "log" => "text/plain",
        "md" => "text/markdown",
        "csv" => "text/csv",
        "html" | "htm" => "text/html",
        "json" => "application/json",
        "pdf" => "application/pdf",
        "zip" => "application/zip",
        "rs" | "py" | "js" | "ts" | "c" | "h" | "go" | "sh" | "toml" | "yaml" | "yml" => {
            "text/plain"
        }
        _ => "application/octet-stream",
    }
}

/// Size and SHA-256 (lowercase hex) of the regular file `path`, opened without following a
/// link; more than `max` bytes is an error (the file grew after it was checked).
fn hash_no_follow(path: &Path, max: u64) -> io::Result<(u64, String)> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Err(io::Error::other("not a regular file"));
    }
    let mut hash = Sha256::new();
    let mut size = 0u64;
    let mut buf = vec![0u8; 64 << 10];
    let mut reader = file.take(max.saturating_add(1));
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        size += n as u64;
        hash.update(&buf[..n]);
    }
    if size > max {
        return Err(io::Error::other(too_big(max)));
    }
    Ok((size, hex(&hash.finalize())))
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

#[cfg(test)]
#[path = "outbox_tests.rs"]
mod tests;
