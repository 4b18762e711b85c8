//! The journal's high-water mark (`journal.mark`): after every commit, the commit number,
//! the highest sequence number and the count of messages in flight, written in place of the
//! older of two 512-byte slots and synced, before the commit's messages are acknowledged.
//!
//! It lives outside SQLite's files on purpose: a lost, truncated or scribbled write-ahead log
//! (or a database restored from an older backup) takes the commits it held with it, but not
//! the mark, so start-up sees that the database holds less than was acknowledged and refuses
//! instead of starting clean. Two slots, each with its own checksum, so that a write torn by a
//! crash leaves the previous mark readable (a mark that lags the database is fine: the check
//! is that the database holds at least what the mark says).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::checksum;

/// The file inside the data directory.
pub(super) const MARK_FILE: &str = "journal.mark";
const MAGIC: &[u8; 8] = b"TSMARK01";
/// Slot size: one sector, so that a slot's write is not split between two.
const SLOT: u64 = 512;
/// Bytes of a slot in use: magic, commits, max_seq, in_flight, checksum.
const USED: usize = 40;

/// What the mark says was durable.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Mark {
    /// Transactions committed so far (the database counts the same in its `meta` table).
    pub(super) commits: u64,
    /// The highest sequence number journaled.
    pub(super) max_seq: u64,
    /// Messages in the database after that commit.
    pub(super) in_flight: u64,
}

/// What was found on disk when the mark was opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Found {
    /// No mark file: a new journal, or one written before marks existed.
    Missing,
    /// A zero-length file: the operator's way to accept the database as it is.
    Reset,
    /// Neither slot is readable.
    Damaged,
    /// The latest readable slot.
    Valid(Mark),
}

/// The open mark file.
pub(super) struct MarkFile {
    file: File,
    path: PathBuf,
}

fn encode(m: &Mark) -> [u8; USED] {
    let mut b = [0u8; USED];
    b[..8].copy_from_slice(MAGIC);
    b[8..16].copy_from_slice(&m.commits.to_le_bytes());
    b[16..24].copy_from_slice(&m.max_seq.to_le_bytes());
    b[24..32].copy_from_slice(&m.in_flight.to_le_bytes());
    let sum = checksum(&[&b[..32]]);
    b[32..40].copy_from_slice(&sum.to_le_bytes());
    b
}

fn decode(b: &[u8]) -> Option<Mark> {
    let b = b.get(..USED)?;
    if &b[..8] != MAGIC || checksum(&[&b[..32]]).to_le_bytes() != b[32..40] {
        return None;
    }
    let word = |at: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[at..at + 8]);
        u64::from_le_bytes(w)
    };
    Some(Mark {
        commits: word(8),
        max_seq: word(16),
        in_flight: word(24),
    })
}

impl MarkFile {
    /// What the mark in `dir` holds (nothing is created: a refusal must leave no file that
    /// the next start would read differently).
    pub(super) fn read(dir: &Path) -> io::Result<Found> {
        let bytes = match std::fs::read(dir.join(MARK_FILE)) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Found::Missing),
            Err(e) => return Err(e),
        };
        if bytes.is_empty() {
            return Ok(Found::Reset);
        }
        let slots = [0, SLOT as usize].map(|at| bytes.get(at..).and_then(decode));
        Ok(match slots.iter().flatten().max_by_key(|m| m.commits) {
            Some(m) => Found::Valid(*m),
            None => Found::Damaged,
        })
    }

    /// Opens the mark in `dir` for writing and writes `m` in both slots, synced with its
    /// directory (a new name must survive a crash too, or the next start sees "missing").
    pub(super) fn create(dir: &Path, m: &Mark) -> io::Result<MarkFile> {
        let path = dir.join(MARK_FILE);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)?;
        let bytes = encode(m);
        file.write_all_at(&bytes, 0)?;
        file.write_all_at(&bytes, SLOT)?;
        file.sync_all()?;
        File::open(dir)?.sync_all()?;
        Ok(MarkFile { file, path })
    }

    /// The file.
    pub(super) fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `m` over the older slot and syncs it (data only: the file's size does not
    /// change after the first two writes).
    pub(super) fn write(&mut self, m: &Mark) -> io::Result<()> {
        let at = (m.commits % 2) * SLOT;
        self.file.write_all_at(&encode(m), at)?;
        self.file.sync_data()
    }

    /// Bytes on disk.
    pub(super) fn disk_bytes(&self) -> u64 {
        self.file.metadata().map_or(0, |m| {
            std::os::unix::fs::MetadataExt::blocks(&m).saturating_mul(512)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_latest_readable_slot_wins_and_a_torn_one_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(MarkFile::read(dir.path()).unwrap(), Found::Missing);
        let mut f = MarkFile::create(dir.path(), &Mark::default()).unwrap();
        for commits in 1..=5 {
            f.write(&Mark {
                commits,
                max_seq: commits * 10,
                in_flight: 1,
            })
            .unwrap();
        }
        drop(f);
        let mark = |commits| Mark {
            commits,
            max_seq: commits * 10,
            in_flight: 1,
        };
        assert_eq!(MarkFile::read(dir.path()).unwrap(), Found::Valid(mark(5)));
        // Commit 5 is in slot 1: tear it, and commit 4 (slot 0) is what the mark says.
        let path = dir.path().join(MARK_FILE);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[SLOT as usize + 20] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(MarkFile::read(dir.path()).unwrap(), Found::Valid(mark(4)));
        bytes[3] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(MarkFile::read(dir.path()).unwrap(), Found::Damaged);
        std::fs::write(&path, b"").unwrap();
        assert_eq!(MarkFile::read(dir.path()).unwrap(), Found::Reset);
    }
}
