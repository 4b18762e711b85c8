//! A bridge's side of the attachments spool (issue 36): a platform's file streamed into the
//! gateway's spool directory — never whole in memory — its SHA-256 computed while it is
//! written and the bounds applied while it streams. Past a bound the download stops, what
//! was written is deleted, and the entry says why (`skipped`): it is never retried.

use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::{Attachment, AttachmentLimits};

/// Bytes read from the platform at a time.
const CHUNK: usize = 64 << 10;

/// What a bridge knows of a file before fetching it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Offered {
    /// Its name on the platform (cut to what the protocol allows).
    pub name: String,
    /// Its media type, if the platform said.
    pub mime: String,
    /// Its size, if the platform announced it.
    pub size: Option<u64>,
}

impl Offered {
    /// An entry for a file that is not fetched, saying why.
    pub(crate) fn skipped(&self, why: String) -> Attachment {
        Attachment {
            name: self.name.clone(),
            mime: self.mime.clone(),
            size: self.size.unwrap_or(0),
            sha256: None,
            path: None,
            skipped: Some(cut(&why, 200).to_owned()),
        }
    }

    /// Whether a bound already refuses the file on its announced size (no request made):
    /// the reason, as the entry's `skipped` says it.
    pub(crate) fn refused(&self, limits: &AttachmentLimits) -> Option<String> {
        let Some(dir) = &limits.dir else {
            return Some("the bridge has no attachments directory".into());
        };
        let size = self.size.unwrap_or(0);
        if size > limits.max_file_bytes {
            return Some(too_big(limits.max_file_bytes));
        }
        let used = crate::attachments::spool_used(dir).unwrap_or(u64::MAX);
        if used.saturating_add(size) > limits.spool_bytes {
            return Some(spool_full(limits.spool_bytes));
        }
        None
    }
}

/// `text`'s first `max` bytes at most, cut on a character boundary (the protocol bounds the
/// entry's texts in bytes).
fn cut(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

fn too_big(max: u64) -> String {
    format!("larger than --max-attachment-bytes {max}")
}

fn spool_full(max: u64) -> String {
    format!("the attachments spool is full (--attachments-bytes {max})")
}

/// A file's name as the protocol takes it: no control characters, at most 200 bytes (on a
/// character boundary), never empty.
pub(crate) fn clean_name(name: &str) -> String {
    let name: String = name.chars().filter(|c| !c.is_control()).collect();
    let name = cut(name.trim(), 200);
    if name.is_empty() {
        "file".into()
    } else {
        name.to_owned()
    }
}

/// Streams `body` into the spool as `file_name` (a name the bridge chose: unique per message
/// and entry, no `/`), bounded by `limits` as it goes. Returns the entry, with a path when
/// the whole file is there, else `skipped` saying why (nothing left behind).
pub(crate) fn store(
    limits: &AttachmentLimits,
    offered: &Offered,
    file_name: &str,
    body: &mut dyn Read,
) -> Attachment {
    let Some(dir) = &limits.dir else {
        return offered.skipped("the bridge has no attachments directory".into());
    };
    debug_assert!(!file_name.contains('/'), "a spool name is one component");
    let path = dir.join(file_name);
    let part = PathBuf::from(format!("{}.part", path.display()));
    let used = crate::attachments::spool_used(dir).unwrap_or(u64::MAX);
    let room = limits.spool_bytes.saturating_sub(used);
    // Renamed only once whole: a `.part` is never named in a message.
    let outcome = write_bounded(&part, body, limits.max_file_bytes, room).and_then(|w| match w {
        Written::Whole { .. } => std::fs::rename(&part, &path).map(|()| w),
        _ => Ok(w),
    });
    match outcome {
        Ok(Written::Whole { size, sha256 }) => Attachment {
            name: offered.name.clone(),
            mime: offered.mime.clone(),
            size,
            sha256: Some(sha256),
            path: Some(path.to_string_lossy().into_owned()),
            skipped: None,
        },
        Ok(Written::TooBig) => {
            let _ = std::fs::remove_file(&part);
            offered.skipped(too_big(limits.max_file_bytes))
        }
        Ok(Written::NoRoom) => {
            let _ = std::fs::remove_file(&part);
            offered.skipped(spool_full(limits.spool_bytes))
        }
        Err(e) => {
            let _ = std::fs::remove_file(&part);
            offered.skipped(format!("download failed: {e}"))
        }
    }
}

/// How writing one file ended.
enum Written {
    Whole {
        size: u64,
        sha256: String,
    },
    /// Past `--max-attachment-bytes`.
    TooBig,
    /// Past the spool's room.
    NoRoom,
}

fn write_bounded(part: &Path, body: &mut dyn Read, max: u64, room: u64) -> io::Result<Written> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(part)
        .or_else(|e| {
            // A `.part` of an earlier, interrupted attempt at the same entry.
            if e.kind() == io::ErrorKind::AlreadyExists {
                std::fs::remove_file(part)?;
                std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o644)
                    .open(part)
            } else {
                Err(e)
            }
        })?;
    let mut hash = Sha256::new();
    let mut size = 0u64;
    let mut buf = vec![0u8; CHUNK];
    loop {
        let n = match body.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        size += n as u64;
        if size > max {
            return Ok(Written::TooBig);
        }
        if size > room {
            return Ok(Written::NoRoom);
        }
        hash.update(&buf[..n]);
        file.write_all(&buf[..n])?;
    }
    file.sync_all()?;
    Ok(Written::Whole {
        size,
        sha256: hex(&hash.finalize()),
    })
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// Deletes the files of a message the gateway refused (they are still the bridge's: the
/// gateway never took them).
pub(crate) fn discard(entries: &[Attachment]) {
    for path in entries.iter().filter_map(|a| a.path.as_deref()) {
        let _ = std::fs::remove_file(path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(dir: &Path, max: u64, spool: u64) -> AttachmentLimits {
        AttachmentLimits {
            dir: Some(dir.to_path_buf()),
            max_file_bytes: max,
            spool_bytes: spool,
            ..AttachmentLimits::default()
        }
    }

    fn offered() -> Offered {
        Offered {
            name: "a.txt".into(),
            mime: "text/plain".into(),
            size: None,
        }
    }

    #[test]
    fn a_file_is_streamed_with_its_sha256_and_what_passes_a_bound_is_deleted() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let l = limits(tmp.path(), 5, 8);
        let a = store(&l, &offered(), "m-0", &mut &b"hello"[..]);
        assert_eq!(
            a.sha256.as_deref(),
            Some("2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824")
        );
        assert_eq!((a.size, a.skipped), (5, None));
        assert_eq!(
            std::fs::read(tmp.path().join("m-0")).expect("file"),
            b"hello"
        );
        let big = store(&l, &offered(), "m-1", &mut &b"hello!"[..]);
        assert_eq!(
            big.skipped.as_deref(),
            Some("larger than --max-attachment-bytes 5")
        );
        // 5 of the spool's 8 bytes are used: 4 more do not fit.
        let full = store(&l, &offered(), "m-2", &mut &b"abcd"[..]);
        assert_eq!(
            full.skipped.as_deref(),
            Some("the attachments spool is full (--attachments-bytes 8)")
        );
        let left: Vec<_> = std::fs::read_dir(tmp.path())
            .expect("dir")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(left, ["m-0"], "nothing of a skipped file is left behind");
        let announced = Offered {
            size: Some(6),
            ..offered()
        };
        assert_eq!(
            announced.refused(&l).as_deref(),
            Some("larger than --max-attachment-bytes 5")
        );
    }
}
