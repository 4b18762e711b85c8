//! The journal in SQLite (bundled, WAL mode, `synchronous=FULL`): one row per message in
//! flight, one per id in the duplicate window. Chosen over redb after measuring both with
//! group commit on this machine (BENCHMARKS.md).
//!
//! Its files in the data directory: `journal.sqlite3` (the database), `journal.sqlite3-wal`
//! (SQLite's write-ahead log: the latest commits live there until a checkpoint copies them
//! into the database), `journal.mark` (the high-water mark, [`super::mark`]) and
//! `journal.reserve` (space set aside for a full disk, below).
//!
//! Trust: every commit also counts itself in the `meta` table, and the mark, written after
//! the commit and before its acks, says how many commits were durable. Opening refuses a
//! database that holds fewer (a lost or truncated WAL, a main file restored from an older
//! backup), naming the files and what is missing. A row that fails its checksum is moved to
//! the `quarantine` table, named in an ERROR, and the other rows load.
//!
//! Bounds: the WAL is checkpointed every [`WAL_PAGES`] pages and truncated to
//! [`WAL_LIMIT`]; when the journal thread is idle, freed pages go back to the file system and
//! the WAL to zero bytes, so the files' size follows what is in flight. [`RESERVE_BYTES`] are
//! kept allocated in `journal.reserve`: on a full disk they are released so that outcomes
//! and deliveries (which free space) can still be written, and new messages are refused
//! until the reserve can be allocated again — which happens by itself once space returns.
//!
//! Here: the schema, writing a batch and the `Store` implementation; `open`: opening and the
//! check against the mark; `load`: recovery and quarantine; `reserve`: `journal.reserve`.

pub(crate) mod history;
mod load;
mod open;
mod reserve;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use rusqlite::{Connection, ErrorCode, Transaction, params};

use super::mark::{Mark, MarkFile};
use super::{
    Record, Recovered, RecoveredMessage, Store, StoreError, StoreErrorKind, StoredMessage,
    StoredOutcome, checksum, now_ms,
};
use crate::journal::memory::{HistoryLimits, MemoryLoader};
use crate::liveness::HistoryStatus;
use crate::wire::MessageFields;
use reserve::Reserve;

/// The file inside the data directory.
pub(super) const FILE_NAME: &str = "journal.sqlite3";
/// SQLite's write-ahead log, next to it.
const WAL_NAME: &str = "journal.sqlite3-wal";
/// The space set aside for a full disk.
const RESERVE_FILE: &str = "journal.reserve";
/// Its size: enough for the write-ahead log of the outcomes and deliveries of the messages
/// in flight on a small volume, and for one checkpoint.
pub(super) const RESERVE_BYTES: u64 = 1 << 20;
/// Checkpoint once the write-ahead log holds this many pages (4 KiB each).
const WAL_PAGES: i64 = 128;
/// After a checkpoint the write-ahead log is cut back to this size.
const WAL_LIMIT: i64 = 512 << 10;
/// Written in the `meta` table; a store of another version is refused.
const SCHEMA_VERSION: i64 = 1;
/// Housekeeping (expired ids out, freed pages back to the file system) every this many batches.
const HOUSEKEEPING_EVERY: u64 = 256;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS messages (
    seq INTEGER PRIMARY KEY,
    platform TEXT NOT NULL, id TEXT NOT NULL, chat_type TEXT NOT NULL, chat_id TEXT NOT NULL,
    thread_id TEXT, user_id TEXT, user_name TEXT, meta TEXT, text TEXT NOT NULL,
    dedup_until INTEGER NOT NULL, sum INTEGER NOT NULL,
    starts INTEGER NOT NULL DEFAULT 0, outcome BLOB
);
CREATE TABLE IF NOT EXISTS dedup (
    platform TEXT NOT NULL, id TEXT NOT NULL, until INTEGER NOT NULL,
    PRIMARY KEY (platform, id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS quarantine (
    seq, platform, id, chat_type, chat_id, thread_id, user_id, user_name, meta, text,
    dedup_until, sum, starts, outcome, reason TEXT, at INTEGER
);
";

/// The SQLite journal. The file is locked exclusively while it is open: a second gateway on
/// the same data directory is refused.
pub struct SqliteStore {
    /// The one connection (the file is locked exclusively): the journal thread writes
    /// through it, and agent creation reads stored conversations through it (a worker waits
    /// for the commit in progress, never the reactor).
    conn: Arc<Mutex<Connection>>,
    path: PathBuf,
    dir: PathBuf,
    batches: u64,
    /// What the last commit made durable (the mark's content).
    state: Mark,
    mark: MarkFile,
    reserve: Reserve,
    /// Whether anything was written since the last idle housekeeping.
    dirty: bool,
    /// Rows moved to `quarantine` by the last load.
    quarantined: usize,
    /// The stored conversations' figures, as of the last commit.
    history: HistoryStatus,
    /// Their bounds.
    history_limits: HistoryLimits,
}

/// How a SQLite failure is taken; `otherwise` when its code does not say.
fn kind_of(e: &rusqlite::Error, otherwise: StoreErrorKind) -> StoreErrorKind {
    let Some(code) = e.sqlite_error() else {
        return otherwise;
    };
    // SQLITE_IOERR_SHORT_READ: a file shorter than its header says, i.e. truncated.
    if code.extended_code == 522 {
        return StoreErrorKind::Untrusted;
    }
    match code.code {
        ErrorCode::DiskFull
        | ErrorCode::DatabaseBusy
        | ErrorCode::DatabaseLocked
        | ErrorCode::SystemIoFailure
        | ErrorCode::OutOfMemory => StoreErrorKind::Transient,
        ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase => StoreErrorKind::Untrusted,
        ErrorCode::CannotOpen | ErrorCode::ReadOnly | ErrorCode::PermissionDenied => {
            StoreErrorKind::Unusable
        }
        _ => otherwise,
    }
}

fn is_full(e: &rusqlite::Error) -> bool {
    e.sqlite_error_code() == Some(ErrorCode::DiskFull)
}

fn io_kind(e: &std::io::Error) -> StoreErrorKind {
    match e.raw_os_error() {
        Some(libc::ENOSPC | libc::EDQUOT | libc::EIO | libc::EAGAIN | libc::EINTR) => {
            StoreErrorKind::Transient
        }
        _ => StoreErrorKind::Unusable,
    }
}

fn err(
    what: &str,
    path: &Path,
    otherwise: StoreErrorKind,
) -> impl Fn(rusqlite::Error) -> StoreError {
    let path = path.display().to_string();
    let what = what.to_string();
    move |e| StoreError {
        kind: kind_of(&e, otherwise),
        message: format!("{what} ({path}): {e}"),
    }
}

/// Bytes a file takes on disk (0 if it does not exist).
fn disk_bytes(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| {
        std::os::unix::fs::MetadataExt::blocks(&m).saturating_mul(512)
    })
}

/// The connection, whoever panicked while holding it (SQLite rolls back an unfinished
/// transaction when the next one begins).
fn lock(conn: &Mutex<Connection>) -> MutexGuard<'_, Connection> {
    conn.lock().unwrap_or_else(|e| e.into_inner())
}

impl SqliteStore {
    fn db(&self) -> MutexGuard<'_, Connection> {
        lock(&self.conn)
    }

    /// The journal file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Rows the last load moved to the `quarantine` table (they failed their checksum).
    pub fn quarantined(&self) -> usize {
        self.quarantined
    }

    /// Whether the reserve is held (false while the disk is full: new messages are refused).
    pub fn reserve_held(&self) -> bool {
        self.reserve.held
    }

    /// Sets the stored conversations' bounds (default: [`HistoryLimits::default`]) and
    /// applies them at once.
    pub(crate) fn set_history_limits(&mut self, limits: HistoryLimits) -> Result<(), StoreError> {
        self.history_limits = limits;
        let conn = Arc::clone(&self.conn);
        let mut db = lock(&conn);
        let mut figures = self.history;
        let fail = err(
            "cannot bound the stored conversations",
            &self.path,
            StoreErrorKind::Transient,
        );
        history::expire(&db, &limits, now_ms(), &mut figures).map_err(&fail)?;
        let tx = db.transaction().map_err(&fail)?;
        history::evict(&tx, limits.max_bytes, &mut figures).map_err(&fail)?;
        tx.commit().map_err(&fail)?;
        self.history = figures;
        Ok(())
    }

    /// Reads a session's stored conversation through this store's connection, for the
    /// openai agent's factory (agent creation, on a worker).
    pub(crate) fn memory_loader(&self) -> MemoryLoader {
        history::loader(&self.conn)
    }

    fn housekeeping(&mut self) -> rusqlite::Result<()> {
        let now = now_ms();
        self.db()
            .execute("DELETE FROM dedup WHERE until <= ?1", [now as i64])?;
        self.sweep_history(now)?;
        self.reclaim()
    }

    /// Deletes the stored conversations untouched for `--history-ttl` as of `now_ms`.
    fn sweep_history(&mut self, now_ms: u64) -> rusqlite::Result<()> {
        let conn = Arc::clone(&self.conn);
        history::expire(
            &lock(&conn),
            &self.history_limits,
            now_ms,
            &mut self.history,
        )
    }

    /// Freed pages back to the file system, then the write-ahead log copied into the
    /// database and cut to zero bytes.
    fn reclaim(&mut self) -> rusqlite::Result<()> {
        let db = self.db();
        db.execute_batch("PRAGMA incremental_vacuum;")?;
        db.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
    }

    /// One transaction: the records, the counters, the mark's content. Deliveries are
    /// deleted together, a run of consecutive numbers per statement (under a flood most of a
    /// batch's deliveries are consecutive), and first, so that the pages they free take this
    /// batch's new rows: records about different messages commute. A batch where another
    /// record is about a delivered message (a retry, a test) keeps its order instead: what
    /// was gathered is deleted before that record.
    fn commit(&mut self, batch: &[Record]) -> rusqlite::Result<Mark> {
        let conn = Arc::clone(&self.conn);
        let mut db = lock(&conn);
        let tx = db.transaction()?;
        let mut next = self.state;
        // Rows in the table, counted as they come and go rather than by `count(*)`, which
        // walks the whole table on every commit.
        let mut rows = next.in_flight;
        let mut delivered: Vec<u64> = batch
            .iter()
            .filter_map(|r| match r {
                Record::Delivered { seq } => Some(*seq),
                _ => None,
            })
            .collect();
        delivered.sort_unstable();
        let apart = |r: &Record| {
            matches!(r, Record::Delivered { .. }) || delivered.binary_search(&r.seq()).is_err()
        };
        if batch.iter().all(apart) {
            rows = rows.saturating_sub(delete_runs(&tx, &mut delivered)?);
            for r in batch
                .iter()
                .filter(|r| !matches!(r, Record::Delivered { .. }))
            {
                rows = rows.saturating_add_signed(write_record(&tx, r)?);
            }
        } else {
            delivered.clear();
            for r in batch {
                match r {
                    Record::Delivered { seq } => delivered.push(*seq),
                    _ => {
                        if delivered.contains(&r.seq()) {
                            rows = rows.saturating_sub(delete_runs(&tx, &mut delivered)?);
                        }
                        rows = rows.saturating_add_signed(write_record(&tx, r)?);
                    }
                }
            }
            rows = rows.saturating_sub(delete_runs(&tx, &mut delivered)?);
        }
        // Once per transaction, not per message: sequence numbers outlive their rows.
        if let Some(max) = batch
            .iter()
            .filter_map(|r| match r {
                Record::Accepted(m) => Some(m.seq),
                _ => None,
            })
            .max()
        {
            tx.prepare_cached(
                "INSERT INTO meta (k, v) VALUES ('max_seq', ?1)
                 ON CONFLICT (k) DO UPDATE SET v = max(v, excluded.v)",
            )?
            .execute([max as i64])?;
            next.max_seq = next.max_seq.max(max);
        }
        let history = self.commit_history(&tx, batch)?;
        next.commits += 1;
        tx.prepare_cached("UPDATE meta SET v = ?1 WHERE k = 'commits'")?
            .execute([next.commits as i64])?;
        debug_assert_eq!(
            Some(rows),
            tx.query_row("SELECT count(*) FROM messages", [], |r| r.get::<_, i64>(0))
                .ok()
                .and_then(|n| u64::try_from(n).ok()),
            "the rows counted as they come and go are the rows in the table"
        );
        next.in_flight = rows;
        tx.commit()?;
        self.history = history;
        Ok(next)
    }

    /// The batch's changes to stored conversations, in the batch's order and its
    /// transaction, then the total bound; returns the figures they leave (kept only once
    /// the transaction commits).
    fn commit_history(
        &self,
        tx: &Transaction<'_>,
        batch: &[Record],
    ) -> rusqlite::Result<HistoryStatus> {
        let mut figures = self.history;
        let mut changed = false;
        for r in batch {
            if let Record::Outcome {
                outcome:
                    StoredOutcome {
                        memory: Some(update),
                        ..
                    },
                ..
            } = r
            {
                history::apply(tx, update, now_ms(), &mut figures)?;
                changed = true;
            }
        }
        if changed {
            history::evict(tx, self.history_limits.max_bytes, &mut figures)?;
        }
        debug_assert!(figures.bytes <= self.history_limits.max_bytes || !changed);
        Ok(figures)
    }

    /// Writes the mark for a commit that is durable in the database.
    fn write_mark(&mut self, next: Mark) -> Result<(), StoreError> {
        self.state = next;
        self.mark.write(&next).map_err(|e| StoreError {
            kind: StoreErrorKind::Transient,
            message: format!("cannot write {}: {e}", self.mark.path().display()),
        })
    }
}

fn message_sum(m: &StoredMessage) -> u64 {
    fn opt(o: &Option<String>) -> &[u8] {
        o.as_deref().unwrap_or("").as_bytes()
    }
    let f = &m.fields;
    let present = [
        u8::from(f.thread_id.is_some()),
        u8::from(f.user_id.is_some()),
        u8::from(f.user_name.is_some()),
        u8::from(f.meta.is_some()),
    ];
    let attachments = attachments_text(f);
    // A row without attachments sums as it did before the column existed.
    let with_files = attachments.as_deref().map(str::as_bytes);
    let parts: [&[u8]; 13] = [
        &m.seq.to_le_bytes(),
        m.platform().as_bytes(),
        f.id.as_bytes(),
        f.chat_type.as_str().as_bytes(),
        f.chat_id.as_bytes(),
        opt(&f.thread_id),
        opt(&f.user_id),
        opt(&f.user_name),
        opt(&f.meta),
        f.text.as_bytes(),
        &m.dedup_until_ms.to_le_bytes(),
        &present,
        with_files.unwrap_or_default(),
    ];
    checksum(&parts[..parts.len() - usize::from(with_files.is_none())])
}

/// The `attachments` column's text: the JSON list, or NULL when there are none.
fn attachments_text(f: &MessageFields) -> Option<String> {
    (!f.attachments.is_empty()).then(|| crate::attachments::to_json(&f.attachments))
}

/// `[head len u32][head][text len u32][text][tail][checksum u64]`, little-endian.
fn encode_outcome(o: &StoredOutcome) -> Vec<u8> {
    let mut b = Vec::with_capacity(16 + o.head.len() + o.text.len() + o.tail.len());
    b.extend_from_slice(&(o.head.len() as u32).to_le_bytes());
    b.extend_from_slice(&o.head);
    b.extend_from_slice(&(o.text.len() as u32).to_le_bytes());
    b.extend_from_slice(o.text.as_bytes());
    b.extend_from_slice(&o.tail);
    let sum = checksum(&[&b]);
    b.extend_from_slice(&sum.to_le_bytes());
    b
}

fn decode_outcome(b: &[u8]) -> Option<StoredOutcome> {
    let body_len = b.len().checked_sub(8)?;
    let (body, sum) = b.split_at(body_len);
    if checksum(&[body]).to_le_bytes() != sum {
        return None;
    }
    let take = |at: usize| -> Option<usize> {
        let bytes: [u8; 4] = body.get(at..at + 4)?.try_into().ok()?;
        Some(u32::from_le_bytes(bytes) as usize)
    };
    let head_len = take(0)?;
    let head = body.get(4..4 + head_len)?.to_vec();
    let text_at = 4 + head_len;
    let text_len = take(text_at)?;
    let text = body.get(text_at + 4..text_at + 4 + text_len)?;
    let text = String::from_utf8(text.to_vec()).ok()?;
    let tail = body.get(text_at + 4 + text_len..)?.to_vec();
    Some(StoredOutcome {
        head,
        text,
        tail,
        memory: None,
    })
}

/// Deletes the rows of `seqs` (delivered messages) a run of consecutive numbers per
/// statement, and empties `seqs`; returns the rows deleted.
fn delete_runs(tx: &Transaction<'_>, seqs: &mut Vec<u64>) -> rusqlite::Result<u64> {
    if seqs.is_empty() {
        return Ok(0);
    }
    seqs.sort_unstable();
    seqs.dedup();
    let mut stmt = tx.prepare_cached("DELETE FROM messages WHERE seq BETWEEN ?1 AND ?2")?;
    let mut gone = 0;
    let mut i = 0;
    while i < seqs.len() {
        let first = seqs[i];
        let mut last = first;
        i += 1;
        while i < seqs.len() && seqs[i] == last + 1 {
            last = seqs[i];
            i += 1;
        }
        // Every number of the run is in `seqs`: the range deletes nothing else.
        gone += stmt.execute([first as i64, last as i64])? as u64;
    }
    seqs.clear();
    Ok(gone)
}

/// Writes one record other than a delivery ([`delete_runs`] does those); returns how the
/// number of rows in `messages` changed.
fn write_record(tx: &Transaction<'_>, r: &Record) -> rusqlite::Result<i64> {
    debug_assert!(!matches!(r, Record::Delivered { .. }));
    match r {
        Record::Accepted(m) => {
            let f = &m.fields;
            let columns = params![
                m.seq as i64,
                m.platform(),
                f.id,
                f.chat_type.as_str(),
                f.chat_id,
                f.thread_id,
                f.user_id,
                f.user_name,
                f.meta,
                f.text,
                m.dedup_until_ms as i64,
                message_sum(m) as i64,
                attachments_text(f),
            ];
            // A new row, or (the same number accepted again) the old one replaced whole, its
            // starts and outcome cleared: counted apart, so the row count stays exact.
            let added = tx
                .prepare_cached(
                    "INSERT INTO messages (seq, platform, id, chat_type, chat_id, thread_id,
                     user_id, user_name, meta, text, dedup_until, sum, attachments) VALUES
                     (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)
                     ON CONFLICT (seq) DO NOTHING",
                )?
                .execute(columns)?;
            if added == 0 {
                tx.prepare_cached(
                    "UPDATE messages SET platform = ?2, id = ?3, chat_type = ?4, chat_id = ?5,
                     thread_id = ?6, user_id = ?7, user_name = ?8, meta = ?9, text = ?10,
                     dedup_until = ?11, sum = ?12, attachments = ?13, starts = 0, outcome = NULL
                     WHERE seq = ?1",
                )?
                .execute(columns)?;
            }
            tx.prepare_cached(
                "INSERT OR REPLACE INTO dedup (platform, id, until) VALUES (?1, ?2, ?3)",
            )?
            .execute(params![m.platform(), f.id, m.dedup_until_ms as i64])?;
            Ok(added as i64)
        }
        Record::Started { seq, attempt } => {
            tx.prepare_cached("UPDATE messages SET starts = ?2 WHERE seq = ?1")?
                .execute(params![*seq as i64, i64::from(*attempt)])?;
            Ok(0)
        }
        Record::Outcome { seq, outcome } => {
            tx.prepare_cached("UPDATE messages SET outcome = ?2 WHERE seq = ?1")?
                .execute(params![*seq as i64, encode_outcome(outcome)])?;
            Ok(0)
        }
        Record::Delivered { seq } => {
            let gone = tx
                .prepare_cached("DELETE FROM messages WHERE seq = ?1")?
                .execute([*seq as i64])?;
            Ok(-(gone as i64))
        }
        Record::Forget { seq } => {
            tx.prepare_cached(
                "DELETE FROM dedup WHERE (platform, id) IN
                 (SELECT platform, id FROM messages WHERE seq = ?1)",
            )?
            .execute([*seq as i64])?;
            let gone = tx
                .prepare_cached("DELETE FROM messages WHERE seq = ?1")?
                .execute([*seq as i64])?;
            Ok(-(gone as i64))
        }
    }
}

impl Store for SqliteStore {
    fn write(&mut self, batch: &[Record]) -> Result<(), StoreError> {
        let accepts = batch.iter().any(|r| matches!(r, Record::Accepted(_)));
        if !self.reserve.held && accepts {
            // Space may have come back (freed by our deliveries or by someone else).
            let _ = self.reclaim();
            if !self.reserve.acquire(RESERVE_BYTES) {
                return Err(StoreError::transient(format!(
                    "the disk under the journal is full ({} cannot be allocated again): new messages are refused until space returns",
                    self.reserve.path.display()
                )));
            }
            log::info!(
                "the journal reserve {} is allocated again: accepting messages",
                self.reserve.path.display()
            );
        }
        let next = match self.commit(batch) {
            Ok(next) => next,
            Err(e) => {
                if is_full(&e) {
                    self.reserve.release();
                    if let Err(e) = self.reclaim() {
                        log::warn!("journal checkpoint on a full disk failed: {e}");
                    }
                }
                return Err(err(
                    "journal write failed",
                    &self.path,
                    StoreErrorKind::Transient,
                )(e));
            }
        };
        // The mark after the commit, before any ack: it may lag the database (a crash in
        // between), never lead it.
        self.write_mark(next)?;
        self.dirty = true;
        self.batches += 1;
        if self.batches.is_multiple_of(HOUSEKEEPING_EVERY) || !self.reserve.held {
            // Best effort: the batch is durable whatever happens here.
            if let Err(e) = self.housekeeping() {
                log::warn!("journal housekeeping failed ({}): {e}", self.path.display());
            }
        }
        Ok(())
    }

    fn load(&mut self, now: u64) -> Result<Recovered, StoreError> {
        match self.load_once(now) {
            Err(e) if e.is_transient() && self.reserve.held => {
                // A full disk at start-up: the reserve makes room for the quarantine's write.
                self.reserve.release();
                self.load_once(now)
            }
            r => r,
        }
    }

    fn idle(&mut self) -> Option<u64> {
        if self.dirty {
            self.dirty = false;
            if let Err(e) = self.housekeeping() {
                log::warn!("journal housekeeping failed ({}): {e}", self.path.display());
            }
            if !self.reserve.held && self.reserve.acquire(RESERVE_BYTES) {
                log::info!(
                    "the journal reserve {} is allocated again: accepting messages",
                    self.reserve.path.display()
                );
            }
        }
        self.disk_bytes()
    }

    fn history(&self) -> Option<HistoryStatus> {
        Some(self.history)
    }

    fn disk_bytes(&self) -> Option<u64> {
        Some(disk_bytes(&self.path) + disk_bytes(&self.dir.join(WAL_NAME)) + self.mark.disk_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outcome_round_trips_and_a_flipped_byte_is_refused() {
        let o = StoredOutcome {
            head: b"{\"op\":\"reply\",\"text\":\"".to_vec(),
            text: "h\u{e9}llo".into(),
            tail: b"\"}\n".to_vec(),
            memory: None,
        };
        let b = encode_outcome(&o);
        assert_eq!(decode_outcome(&b), Some(o));
        for i in 0..b.len() {
            let mut c = b.clone();
            c[i] ^= 0x20;
            assert_eq!(decode_outcome(&c), None, "byte {i}");
        }
        assert_eq!(decode_outcome(&b[..b.len() - 1]), None);
        assert_eq!(decode_outcome(&[]), None);
    }
}
