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

use std::fs::File;
use std::path::{Path, PathBuf};

use rusqlite::{Connection, ErrorCode, OptionalExtension, Transaction, params};

use super::mark::{Found, MARK_FILE, Mark, MarkFile};
use super::{
    Record, Recovered, RecoveredMessage, Store, StoreError, StoreErrorKind, StoredMessage,
    StoredOutcome, checksum, now_ms,
};

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
    conn: Connection,
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

/// Bytes free for an unprivileged writer on the file system holding `dir`.
fn available(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs(3) writes into the zeroed struct it is given; `c` is a valid C string.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// `journal.reserve`: [`RESERVE_BYTES`] allocated while the disk has room, released when it
/// is full.
struct Reserve {
    path: PathBuf,
    held: bool,
}

impl Reserve {
    fn new(dir: &Path) -> Reserve {
        Reserve {
            path: dir.join(RESERVE_FILE),
            held: false,
        }
    }

    /// Allocates the reserve (really: blocks, not a sparse file); false if the disk has no
    /// room for it and `headroom` bytes more. Taken back after a full disk with a headroom
    /// of its own size: otherwise the space it just gave up would be all it finds, and the
    /// journal would take a new message with nothing left to write its outcome in.
    fn acquire(&mut self, headroom: u64) -> bool {
        if self.held {
            return true;
        }
        if headroom > 0
            && self
                .path
                .parent()
                .and_then(available)
                .is_some_and(|free| free < RESERVE_BYTES + headroom)
        {
            return false;
        }
        let allocate = || -> std::io::Result<()> {
            let f = File::options()
                .write(true)
                .create(true)
                .truncate(false)
                .open(&self.path)?;
            use std::os::fd::AsRawFd;
            // SAFETY: posix_fallocate(3) on a file descriptor this function owns.
            let rc = unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, RESERVE_BYTES as i64) };
            match rc {
                0 => Ok(()),
                libc::EOPNOTSUPP | libc::EINVAL => {
                    // No fallocate here: write the zeros (a copy-on-write file system may
                    // still share them, which is the best it offers).
                    use std::io::Write;
                    let mut w = &f;
                    w.write_all(&vec![0u8; RESERVE_BYTES as usize])?;
                    f.sync_all()
                }
                e => Err(std::io::Error::from_raw_os_error(e)),
            }
        };
        match allocate() {
            Ok(()) => {
                self.held = true;
                true
            }
            Err(e) => {
                // What it got is given back: a half reserve would only take the room.
                let _ = std::fs::remove_file(&self.path);
                log::debug!("journal reserve {}: {e}", self.path.display());
                false
            }
        }
    }

    /// Gives the reserve's space back to the file system.
    fn release(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            log::error!(
                "cannot release the journal reserve {}: {e}",
                self.path.display()
            );
        }
        if self.held {
            log::warn!(
                "the disk under the journal is full: released its reserve ({} KiB) so that outcomes and deliveries can be written; new messages are rejected `storage` until space returns",
                RESERVE_BYTES >> 10
            );
        }
        self.held = false;
    }
}

impl SqliteStore {
    /// Opens (creating if needed) the journal in `dir`, and checks it against its mark: a
    /// database holding fewer commits than were acknowledged is refused
    /// ([`StoreErrorKind::Untrusted`]). A full disk ([`StoreErrorKind::Transient`]) releases
    /// the reserve and tries once more.
    pub fn open(dir: &Path) -> Result<SqliteStore, StoreError> {
        std::fs::create_dir_all(dir).map_err(|e| StoreError {
            kind: io_kind(&e),
            message: format!("cannot create {}: {e}", dir.display()),
        })?;
        let mut reserve = Reserve::new(dir);
        let store = match SqliteStore::open_once(dir) {
            Err((e, true)) => {
                log::warn!("{e}: releasing the journal reserve and trying again");
                reserve.release();
                SqliteStore::open_once(dir).map_err(|(e, _)| e)
            }
            r => r.map_err(|(e, _)| e),
        };
        let mut store = store?;
        reserve.held = std::fs::metadata(&reserve.path).is_ok_and(|m| m.len() >= RESERVE_BYTES);
        if !reserve.acquire(0) {
            log::warn!(
                "no room for the journal reserve {} ({} KiB): new messages are rejected `storage` until there is",
                reserve.path.display(),
                RESERVE_BYTES >> 10
            );
        }
        store.reserve = reserve;
        Ok(store)
    }

    /// One try; the flag says the disk was full.
    fn open_once(dir: &Path) -> Result<SqliteStore, (StoreError, bool)> {
        let path = dir.join(FILE_NAME);
        let conn = Connection::open(&path).map_err(|e| {
            let full = is_full(&e);
            (
                err("cannot open the journal", &path, StoreErrorKind::Unusable)(e),
                full,
            )
        })?;
        let setup = || -> rusqlite::Result<()> {
            conn.pragma_update(None, "locking_mode", "EXCLUSIVE")?;
            // Only takes effect on a new file (before the tables exist).
            conn.pragma_update(None, "auto_vacuum", "INCREMENTAL")?;
            let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
            if !mode.eq_ignore_ascii_case("wal") {
                return Err(rusqlite::Error::InvalidParameterName(format!(
                    "journal_mode is {mode}, not wal"
                )));
            }
            conn.pragma_update(None, "synchronous", "FULL")?;
            conn.pragma_update(None, "wal_autocheckpoint", WAL_PAGES)?;
            conn.pragma_update(None, "journal_size_limit", WAL_LIMIT)?;
            // 16 MiB of page cache (negative: KiB), so that the rows in flight stay in memory.
            conn.pragma_update(None, "cache_size", -16384i64)?;
            conn.execute_batch(SCHEMA)?;
            Ok(())
        };
        let fail = |what: &'static str, otherwise| {
            let path = path.clone();
            move |e: rusqlite::Error| {
                let full = is_full(&e);
                (err(what, &path, otherwise)(e), full)
            }
        };
        setup().map_err(fail("cannot open the journal", StoreErrorKind::Untrusted))?;
        let version: Option<i64> = conn
            .query_row("SELECT v FROM meta WHERE k = 'version'", [], |r| r.get(0))
            .optional()
            .map_err(fail("cannot read the journal", StoreErrorKind::Untrusted))?;
        match version {
            None => {
                conn.execute(
                    "INSERT INTO meta (k, v) VALUES ('version', ?1)",
                    [SCHEMA_VERSION],
                )
                .map_err(fail("cannot write the journal", StoreErrorKind::Transient))?;
            }
            Some(SCHEMA_VERSION) => {}
            Some(v) => {
                return Err((
                    StoreError::unusable(format!(
                        "{}: journal schema version {v}, this build reads {SCHEMA_VERSION}",
                        path.display()
                    )),
                    false,
                ));
            }
        }
        let read = |sql: &str| -> rusqlite::Result<Option<i64>> {
            conn.query_row(sql, [], |r| r.get(0)).optional()
        };
        let held = (|| -> rusqlite::Result<(Option<i64>, i64, i64)> {
            Ok((
                read("SELECT v FROM meta WHERE k = 'commits'")?,
                read("SELECT v FROM meta WHERE k = 'max_seq'")?.unwrap_or(0),
                read("SELECT count(*) FROM messages")?.unwrap_or(0),
            ))
        })()
        .map_err(fail("cannot read the journal", StoreErrorKind::Untrusted))?;
        let (commits, max_seq, in_flight) = held;
        let state = Mark {
            commits: u64::try_from(commits.unwrap_or(0)).unwrap_or(0),
            max_seq: u64::try_from(max_seq).unwrap_or(0),
            in_flight: u64::try_from(in_flight).unwrap_or(0),
        };
        check_mark(dir, &path, commits.is_some(), &state).map_err(|e| (e, false))?;
        if commits.is_none() {
            conn.execute("INSERT INTO meta (k, v) VALUES ('commits', 0)", [])
                .map_err(fail("cannot write the journal", StoreErrorKind::Transient))?;
        }
        // The mark now says what the database holds (after a reset, an upgrade, or a crash
        // between a commit and its mark).
        let mark = MarkFile::create(dir, &state).map_err(|e| {
            let full = e.raw_os_error() == Some(libc::ENOSPC);
            (
                StoreError {
                    kind: io_kind(&e),
                    message: format!("cannot write {}: {e}", dir.join(MARK_FILE).display()),
                },
                full,
            )
        })?;
        Ok(SqliteStore {
            conn,
            path,
            dir: dir.to_path_buf(),
            batches: 0,
            state,
            mark,
            reserve: Reserve::new(dir),
            dirty: true,
            quarantined: 0,
        })
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

    fn housekeeping(&mut self) -> rusqlite::Result<()> {
        self.conn
            .execute("DELETE FROM dedup WHERE until <= ?1", [now_ms() as i64])?;
        self.reclaim()
    }

    /// Freed pages back to the file system, then the write-ahead log copied into the
    /// database and cut to zero bytes.
    fn reclaim(&mut self) -> rusqlite::Result<()> {
        self.conn.execute_batch("PRAGMA incremental_vacuum;")?;
        self.conn
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
    }

    /// One transaction: the records, the counters, the mark's content.
    fn commit(&mut self, batch: &[Record]) -> rusqlite::Result<Mark> {
        let tx = self.conn.transaction()?;
        for r in batch {
            write_record(&tx, r)?;
        }
        let mut next = self.state;
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
        next.commits += 1;
        tx.prepare_cached("UPDATE meta SET v = ?1 WHERE k = 'commits'")?
            .execute([next.commits as i64])?;
        let n: i64 = tx
            .prepare_cached("SELECT count(*) FROM messages")?
            .query_row([], |r| r.get(0))?;
        next.in_flight = u64::try_from(n).unwrap_or(0);
        tx.commit()?;
        Ok(next)
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

/// Refuses a database that holds less than its mark says was durable.
fn check_mark(dir: &Path, db: &Path, counted: bool, held: &Mark) -> Result<(), StoreError> {
    let mark_path = dir.join(MARK_FILE);
    let wal = dir.join(WAL_NAME);
    let found = MarkFile::read(dir).map_err(|e| StoreError {
        kind: io_kind(&e),
        message: format!("cannot read {}: {e}", mark_path.display()),
    })?;
    let restore = format!(
        "restore {}, {} and {} together from one backup; or, to start from the database as it is and lose what is missing, truncate {} to zero bytes",
        db.display(),
        wal.display(),
        mark_path.display(),
        mark_path.display()
    );
    match found {
        Found::Valid(m)
            if held.commits < m.commits
                || held.max_seq < m.max_seq
                || (held.commits == m.commits && held.in_flight < m.in_flight) =>
        {
            let what = if held.max_seq < m.max_seq {
                format!(
                    "at least {} acknowledged message(s) are missing (up to #{} were acknowledged, the database's last is #{})",
                    m.max_seq - held.max_seq,
                    m.max_seq,
                    held.max_seq
                )
            } else if held.commits < m.commits {
                format!(
                    "{} acknowledged commit(s) are missing",
                    m.commits - held.commits
                )
            } else {
                format!(
                    "{} message(s) in flight are missing",
                    m.in_flight - held.in_flight
                )
            };
            Err(StoreError::untrusted(format!(
                "the journal cannot be trusted: {} says commit {} ({} message(s) in flight) was durable, but {} holds commit {} ({} in flight): {what}. The write-ahead log {} was lost, truncated or damaged, or the database is an older copy; {restore}",
                mark_path.display(),
                m.commits,
                m.in_flight,
                db.display(),
                held.commits,
                held.in_flight,
                wal.display(),
            )))
        }
        Found::Valid(_) => Ok(()),
        Found::Missing if counted && held.commits > 0 => Err(StoreError::untrusted(format!(
            "the journal cannot be trusted: {} is missing, so nothing shows that {} holds every acknowledged message; {restore}",
            mark_path.display(),
            db.display()
        ))),
        Found::Missing => Ok(()),
        Found::Damaged => Err(StoreError::untrusted(format!(
            "the journal cannot be trusted: {} cannot be read (neither of its slots passes its checksum); {restore}",
            mark_path.display()
        ))),
        Found::Reset => {
            log::warn!(
                "{} was truncated to zero bytes: the journal {} is accepted as it is (commit {}, {} message(s) in flight)",
                mark_path.display(),
                db.display(),
                held.commits,
                held.in_flight
            );
            Ok(())
        }
    }
}
fn message_sum(m: &StoredMessage) -> u64 {
    let opt = |o: &Option<String>| o.as_deref().unwrap_or("").as_bytes().to_vec();
    let present = [
        u8::from(m.thread_id.is_some()),
        u8::from(m.user_id.is_some()),
        u8::from(m.user_name.is_some()),
        u8::from(m.meta.is_some()),
    ];
    checksum(&[
        &m.seq.to_le_bytes(),
        m.platform.as_bytes(),
        m.id.as_bytes(),
        m.chat_type.as_bytes(),
        m.chat_id.as_bytes(),
        &opt(&m.thread_id),
        &opt(&m.user_id),
        &opt(&m.user_name),
        &opt(&m.meta),
        m.text.as_bytes(),
        &m.dedup_until_ms.to_le_bytes(),
        &present,
    ])
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
    Some(StoredOutcome { head, text, tail })
}

fn write_record(tx: &Transaction<'_>, r: &Record) -> rusqlite::Result<()> {
    match r {
        Record::Accepted(m) => {
            tx.prepare_cached(
                "INSERT OR REPLACE INTO messages (seq, platform, id, chat_type, chat_id, thread_id,
                 user_id, user_name, meta, text, dedup_until, sum) VALUES
                 (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)",
            )?
            .execute(params![
                m.seq as i64,
                m.platform,
                m.id,
                m.chat_type,
                m.chat_id,
                m.thread_id,
                m.user_id,
                m.user_name,
                m.meta,
                m.text,
                m.dedup_until_ms as i64,
                message_sum(m) as i64,
            ])?;
            tx.prepare_cached(
                "INSERT OR REPLACE INTO dedup (platform, id, until) VALUES (?1, ?2, ?3)",
            )?
            .execute(params![m.platform, m.id, m.dedup_until_ms as i64])?;
        }
        Record::Started { seq, attempt } => {
            tx.prepare_cached("UPDATE messages SET starts = ?2 WHERE seq = ?1")?
                .execute(params![*seq as i64, i64::from(*attempt)])?;
        }
        Record::Outcome { seq, outcome } => {
            tx.prepare_cached("UPDATE messages SET outcome = ?2 WHERE seq = ?1")?
                .execute(params![*seq as i64, encode_outcome(outcome)])?;
        }
        Record::Delivered { seq } => {
            tx.prepare_cached("DELETE FROM messages WHERE seq = ?1")?
                .execute([*seq as i64])?;
        }
        Record::Forget { seq } => {
            tx.prepare_cached(
                "DELETE FROM dedup WHERE (platform, id) IN
                 (SELECT platform, id FROM messages WHERE seq = ?1)",
            )?
            .execute([*seq as i64])?;
            tx.prepare_cached("DELETE FROM messages WHERE seq = ?1")?
                .execute([*seq as i64])?;
        }
    }
    Ok(())
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

    fn disk_bytes(&self) -> Option<u64> {
        Some(disk_bytes(&self.path) + disk_bytes(&self.dir.join(WAL_NAME)) + self.mark.disk_bytes())
    }
}

/// A row of the messages table as stored: the message, its checksum, its outcome blob.
type MessageRow = (RecoveredMessage, i64, Option<Vec<u8>>);

/// A row that failed its checksum: its sequence number, what it names, why.
struct Damaged {
    seq: i64,
    platform: String,
    id: String,
    chat: String,
    reason: String,
}

/// A column's value as text, whatever its type (a scribbled row may hold anything).
fn shown(row: &rusqlite::Row<'_>, i: usize) -> String {
    use rusqlite::types::ValueRef;
    match row.get_ref(i) {
        Ok(ValueRef::Text(t)) => String::from_utf8_lossy(t).into_owned(),
        Ok(ValueRef::Integer(n)) => n.to_string(),
        Ok(ValueRef::Real(x)) => x.to_string(),
        Ok(ValueRef::Blob(b)) => format!("<{} bytes>", b.len()),
        Ok(ValueRef::Null) => "<null>".into(),
        Err(e) => format!("<{e}>"),
    }
}

impl SqliteStore {
    /// The error for a journal that cannot be read at all, naming the file and what is wrong.
    fn damaged(&self, what: &rusqlite::Error) -> StoreError {
        StoreError {
            kind: kind_of(what, StoreErrorKind::Untrusted),
            message: format!(
                "the journal {} cannot be read ({what}); restore it from a backup (with {} and {}), or move the journal's files away to start with an empty one",
                self.path.display(),
                WAL_NAME,
                MARK_FILE
            ),
        }
    }

    fn load_once(&mut self, now: u64) -> Result<Recovered, StoreError> {
        self.quick_check()?;
        let max_seq = self.state.max_seq;
        let (messages, damaged) = self.load_messages(max_seq)?;
        self.quarantine(&damaged, now)?;
        let mut out = Recovered {
            max_seq,
            messages,
            ..Recovered::default()
        };
        out.dedup = self.load_dedup(now)?;
        Ok(out)
    }

    fn quick_check(&self) -> Result<(), StoreError> {
        let check: String = self
            .conn
            .query_row("PRAGMA quick_check", [], |r| r.get(0))
            .map_err(|e| self.damaged(&e))?;
        if check != "ok" {
            return Err(StoreError::untrusted(format!(
                "the journal {} cannot be read (quick_check: {check}); restore it from a backup (with {} and {}), or move the journal's files away to start with an empty one",
                self.path.display(),
                WAL_NAME,
                MARK_FILE
            )));
        }
        Ok(())
    }

    /// Every journaled message in order, each checked against its checksum and `max_seq`;
    /// those that fail are returned apart.
    fn load_messages(
        &self,
        max_seq: u64,
    ) -> Result<(Vec<RecoveredMessage>, Vec<Damaged>), StoreError> {
        let damaged = |e: rusqlite::Error| self.damaged(&e);
        let mut stmt = self
            .conn
            .prepare(
                "SELECT seq, platform, id, chat_type, chat_id, thread_id, user_id, user_name, meta,
                 text, dedup_until, sum, starts, outcome FROM messages ORDER BY seq",
            )
            .map_err(damaged)?;
        let mut rows = stmt.query([]).map_err(damaged)?;
        let mut messages = Vec::new();
        let mut bad = Vec::new();
        while let Some(row) = rows.next().map_err(damaged)? {
            // The rowid is an integer whatever else a scribble did.
            let seq: i64 = row.get(0).map_err(damaged)?;
            let reason = match message_row(row) {
                Err(e) => Some(format!("unreadable: {e}")),
                Ok((mut rm, sum, outcome)) => {
                    if message_sum(&rm.message) as i64 != sum {
                        Some("fails its checksum".to_string())
                    } else if rm.message.seq > max_seq {
                        Some(format!("is after the journal's last number #{max_seq}"))
                    } else {
                        match outcome.map(|b| decode_outcome(&b)) {
                            Some(None) => Some("its outcome fails its checksum".to_string()),
                            Some(Some(o)) => {
                                rm.outcome = Some(o);
                                messages.push(rm);
                                None
                            }
                            None => {
                                messages.push(rm);
                                None
                            }
                        }
                    }
                }
            };
            if let Some(reason) = reason {
                bad.push(Damaged {
                    seq,
                    platform: shown(row, 1),
                    id: shown(row, 2),
                    chat: shown(row, 4),
                    reason,
                });
            }
        }
        Ok((messages, bad))
    }

    /// Moves damaged rows to the `quarantine` table (one transaction, counted and marked like
    /// any commit), with an ERROR for each naming its message.
    fn quarantine(&mut self, bad: &[Damaged], now: u64) -> Result<(), StoreError> {
        self.quarantined = bad.len();
        if bad.is_empty() {
            return Ok(());
        }
        let path = self.path.clone();
        let fail = err(
            "cannot quarantine a damaged row",
            &path,
            StoreErrorKind::Untrusted,
        );
        let mut next = self.state;
        let tx = self.conn.transaction().map_err(&fail)?;
        for d in bad {
            tx.prepare_cached(
                "INSERT INTO quarantine SELECT *, ?2, ?3 FROM messages WHERE seq = ?1",
            )
            .and_then(|mut s| s.execute(params![d.seq, d.reason, now as i64]))
            .map_err(&fail)?;
            tx.prepare_cached("DELETE FROM messages WHERE seq = ?1")
                .and_then(|mut s| s.execute([d.seq]))
                .map_err(&fail)?;
        }
        next.commits += 1;
        next.in_flight = next.in_flight.saturating_sub(bad.len() as u64);
        tx.execute(
            "UPDATE meta SET v = ?1 WHERE k = 'commits'",
            [next.commits as i64],
        )
        .map_err(&fail)?;
        tx.commit().map_err(&fail)?;
        self.write_mark(next)?;
        for d in bad {
            log::error!(
                "journal: message {} of platform {} (chat {}, #{}) {}: moved to the table `quarantine` of {} and not recovered; the other messages are",
                d.id,
                d.platform,
                d.chat,
                d.seq,
                d.reason,
                path.display()
            );
        }
        Ok(())
    }

    /// The duplicate-window ids still in their window at `now`.
    fn load_dedup(&self, now: u64) -> Result<Vec<(String, String, u64)>, StoreError> {
        let damaged = |e: rusqlite::Error| self.damaged(&e);
        let mut stmt = self
            .conn
            .prepare("SELECT platform, id, until FROM dedup WHERE until > ?1 ORDER BY until")
            .map_err(damaged)?;
        let rows = stmt
            .query_map([now as i64], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get::<_, i64>(2)? as u64))
            })
            .map_err(damaged)?;
        let mut dedup = rows.collect::<Result<Vec<_>, _>>().map_err(damaged)?;
        dedup.sort();
        Ok(dedup)
    }
}

fn message_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<MessageRow> {
    let seq: i64 = row.get(0)?;
    let message = StoredMessage {
        seq: seq as u64,
        platform: row.get(1)?,
        id: row.get(2)?,
        chat_type: row.get(3)?,
        chat_id: row.get(4)?,
        thread_id: row.get(5)?,
        user_id: row.get(6)?,
        user_name: row.get(7)?,
        meta: row.get(8)?,
        text: row.get(9)?,
        dedup_until_ms: row.get::<_, i64>(10)? as u64,
    };
    let sum: i64 = row.get(11)?;
    let starts: i64 = row.get(12)?;
    let outcome: Option<Vec<u8>> = row.get(13)?;
    let recovered = RecoveredMessage {
        message,
        starts: u32::try_from(starts).unwrap_or(u32::MAX),
        outcome: None,
    };
    Ok((recovered, sum, outcome))
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
