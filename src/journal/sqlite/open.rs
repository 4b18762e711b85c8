//! Opening the journal: the connection and its settings, the schema version, and the check
//! against the mark (a database holding fewer commits than were acknowledged is refused).

use std::path::Path;
use std::sync::{Arc, Mutex};

use rusqlite::{Connection, OptionalExtension};

use super::history;
use super::reserve::Reserve;
use super::{
    FILE_NAME, RESERVE_BYTES, SCHEMA, SCHEMA_VERSION, SqliteStore, WAL_LIMIT, WAL_NAME, WAL_PAGES,
    err, io_kind, is_full,
};
use crate::journal::mark::{Found, MARK_FILE, Mark, MarkFile};
use crate::journal::memory::HistoryLimits;
use crate::journal::{StoreError, StoreErrorKind};
use crate::liveness::HistoryStatus;

/// An error while opening, and whether the disk was full (then the reserve is released and
/// the open tried once more).
type OpenError = (StoreError, bool);

/// Maps a SQLite error to an [`OpenError`] naming `what` failed on `path`.
fn failed<'a>(
    what: &'static str,
    path: &'a Path,
    otherwise: StoreErrorKind,
) -> impl Fn(rusqlite::Error) -> OpenError + 'a {
    move |e| {
        let full = is_full(&e);
        (err(what, path, otherwise)(e), full)
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
    fn open_once(dir: &Path) -> Result<SqliteStore, OpenError> {
        let path = dir.join(FILE_NAME);
        let mark_error = |e: std::io::Error| {
            let full = e.raw_os_error() == Some(libc::ENOSPC);
            (
                StoreError {
                    kind: io_kind(&e),
                    message: format!("cannot write {}: {e}", dir.join(MARK_FILE).display()),
                },
                full,
            )
        };
        // A new journal gets its mark before its database exists: a database found without
        // its mark is then one that lost it (or one from before marks existed).
        if !path.exists() && matches!(MarkFile::read(dir), Ok(Found::Missing)) {
            MarkFile::create(dir, &Mark::default()).map_err(mark_error)?;
        }
        let conn = Connection::open(&path).map_err(failed(
            "cannot open the journal",
            &path,
            StoreErrorKind::Unusable,
        ))?;
        configure(&conn).map_err(failed(
            "cannot open the journal",
            &path,
            StoreErrorKind::Untrusted,
        ))?;
        let versioned = check_version(&conn, &path)?;
        let (state, counted) = read_state(&conn).map_err(failed(
            "cannot read the journal",
            &path,
            StoreErrorKind::Untrusted,
        ))?;
        let older = versioned && !counted;
        check_mark(dir, &path, counted, older, &state).map_err(|e| (e, false))?;
        if !versioned || !counted {
            // Written only once the mark agreed: a refused database stays as it was found.
            conn.execute_batch(&format!(
                "BEGIN; INSERT OR IGNORE INTO meta (k, v) VALUES ('version', {SCHEMA_VERSION}); \
                 INSERT OR IGNORE INTO meta (k, v) VALUES ('commits', 0); COMMIT;"
            ))
            .map_err(failed(
                "cannot write the journal",
                &path,
                StoreErrorKind::Transient,
            ))?;
        }
        add_attachments_column(&conn).map_err(failed(
            "cannot write the journal",
            &path,
            StoreErrorKind::Transient,
        ))?;
        // The mark now says what the database holds (after a reset, an upgrade, or a crash
        // between a commit and its mark).
        let mark = MarkFile::create(dir, &state).map_err(mark_error)?;
        let mut history = HistoryStatus::default();
        history::count(&conn, &mut history).map_err(failed(
            "cannot read the journal",
            &path,
            StoreErrorKind::Untrusted,
        ))?;
        Ok(SqliteStore {
            conn: Arc::new(Mutex::new(conn)),
            path,
            dir: dir.to_path_buf(),
            batches: 0,
            state,
            mark,
            reserve: Reserve::new(dir),
            dirty: true,
            quarantined: 0,
            history,
            history_limits: HistoryLimits::default(),
        })
    }
}

/// The connection's settings and the schema.
fn configure(conn: &Connection) -> rusqlite::Result<()> {
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
    conn.execute_batch(history::SCHEMA)
}

/// Adds the `attachments` column (issue 36) to a journal written before it: an optional
/// column, NULL in old rows, so they load as messages without files.
fn add_attachments_column(conn: &Connection) -> rusqlite::Result<()> {
    for table in ["messages", "quarantine"] {
        let has: i64 = conn.query_row(
            "SELECT COUNT(*) FROM pragma_table_info(?1) WHERE name = 'attachments'",
            [table],
            |r| r.get(0),
        )?;
        if has == 0 {
            conn.execute_batch(&format!("ALTER TABLE {table} ADD COLUMN attachments TEXT"))?;
        }
    }
    Ok(())
}

/// Whether the journal has a schema version (a new one has none: it is written once the
/// mark agreed); refuses one written by another version.
fn check_version(conn: &Connection, path: &Path) -> Result<bool, OpenError> {
    let version: Option<i64> = conn
        .query_row("SELECT v FROM meta WHERE k = 'version'", [], |r| r.get(0))
        .optional()
        .map_err(failed(
            "cannot read the journal",
            path,
            StoreErrorKind::Untrusted,
        ))?;
    match version {
        None => Ok(false),
        Some(SCHEMA_VERSION) => Ok(true),
        Some(v) => Err((
            StoreError::unusable(format!(
                "{}: journal schema version {v}, this build reads {SCHEMA_VERSION}",
                path.display()
            )),
            false,
        )),
    }
}

/// What the database holds (commits, highest sequence, rows in flight), and whether it
/// counts its commits at all (a journal older than the mark does not).
fn read_state(conn: &Connection) -> rusqlite::Result<(Mark, bool)> {
    let read = |sql: &str| -> rusqlite::Result<Option<i64>> {
        conn.query_row(sql, [], |r| r.get(0)).optional()
    };
    let commits = read("SELECT v FROM meta WHERE k = 'commits'")?;
    let max_seq = read("SELECT v FROM meta WHERE k = 'max_seq'")?.unwrap_or(0);
    let in_flight = read("SELECT count(*) FROM messages")?.unwrap_or(0);
    let state = Mark {
        commits: u64::try_from(commits.unwrap_or(0)).unwrap_or(0),
        max_seq: u64::try_from(max_seq).unwrap_or(0),
        in_flight: u64::try_from(in_flight).unwrap_or(0),
    };
    Ok((state, commits.is_some()))
}

/// Refuses a database that holds less than its mark says was durable, and one without a mark
/// unless it is `older` than marks (it has a schema version but counts no commits).
fn check_mark(
    dir: &Path,
    db: &Path,
    counted: bool,
    older: bool,
    held: &Mark,
) -> Result<(), StoreError> {
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
        Found::Missing if older => Ok(()),
        Found::Missing => Err(StoreError::untrusted(format!(
            "the journal cannot be trusted: {} exists but {} is missing (a new journal gets its mark first, and this is not a journal from before marks existed); like a copy of the database file alone, without its write-ahead log {} and its mark, it may lack acknowledged messages. Restore the three together from one backup; or, to start from the database as it is and lose what is missing, create {} empty (zero bytes)",
            db.display(),
            mark_path.display(),
            wal.display(),
            mark_path.display()
        ))),
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
