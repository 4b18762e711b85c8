//! The stored conversations in the journal's database: one row per session (its whole
//! conversation as JSON, `[[user, assistant], …]` oldest first), written in the transaction
//! of the outcome that changed it ([`super::SqliteStore::commit`]), read back when the
//! session's agent is created, bounded in total bytes (least recently written go first) and
//! by inactivity (the journal thread's housekeeping sweeps them).

use std::path::Path;
use std::sync::{Arc, Mutex};

use rusqlite::{Connection, OpenFlags, OptionalExtension, Transaction, params};

use super::{FILE_NAME, lock};
use crate::journal::checksum;
use crate::journal::memory::{Exchange, HistoryLimits, MemoryLoader, MemoryUpdate};
use crate::liveness::HistoryStatus;

/// The table; created by every open, so a journal from before it gains it.
pub(super) const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS history (
    session TEXT PRIMARY KEY, body TEXT NOT NULL, bytes INTEGER NOT NULL,
    touched INTEGER NOT NULL, sum INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS history_touched ON history (touched);
";

/// Rows deleted per statement when the total passes its bound.
const EVICT_STEP: i64 = 64;

fn row_sum(session: &str, body: &str) -> i64 {
    checksum(&[session.as_bytes(), body.as_bytes()]) as i64
}

/// What a row counts against `--history-bytes`: its key and its body.
fn row_bytes(session: &str, body: &str) -> u64 {
    (session.len() + body.len()) as u64
}

/// Applies one outcome's change inside its transaction; `figures` follow the table.
pub(super) fn apply(
    tx: &Transaction<'_>,
    update: &MemoryUpdate,
    now_ms: u64,
    figures: &mut HistoryStatus,
) -> rusqlite::Result<()> {
    let session = &*update.session;
    let old: Option<i64> = tx
        .prepare_cached("SELECT bytes FROM history WHERE session = ?1")?
        .query_row([session], |r| r.get(0))
        .optional()?;
    if let Some(bytes) = old {
        figures.sessions = figures.sessions.saturating_sub(1);
        figures.bytes = figures.bytes.saturating_sub(bytes as u64);
    }
    match update.exchanges.as_deref() {
        Some(exchanges) if !exchanges.is_empty() => {
            let body = serde_json::to_string(exchanges).unwrap_or_else(|_| "[]".into());
            let bytes = row_bytes(session, &body);
            tx.prepare_cached(
                "INSERT OR REPLACE INTO history (session, body, bytes, touched, sum)
                 VALUES (?1, ?2, ?3, ?4, ?5)",
            )?
            .execute(params![
                session,
                body,
                bytes as i64,
                now_ms as i64,
                row_sum(session, &body)
            ])?;
            figures.sessions += 1;
            figures.bytes += bytes;
        }
        _ => {
            tx.prepare_cached("DELETE FROM history WHERE session = ?1")?
                .execute([session])?;
        }
    }
    Ok(())
}

/// Deletes the least recently written conversations while the total passes `max_bytes`
/// (inside the transaction that wrote past it, counted as evicted).
pub(super) fn evict(
    tx: &Transaction<'_>,
    max_bytes: u64,
    figures: &mut HistoryStatus,
) -> rusqlite::Result<()> {
    while figures.bytes > max_bytes && figures.sessions > 0 {
        let oldest: Vec<(String, i64)> = tx
            .prepare_cached(
                "SELECT session, bytes FROM history ORDER BY touched, session LIMIT ?1",
            )?
            .query_map([EVICT_STEP], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<rusqlite::Result<_>>()?;
        if oldest.is_empty() {
            // The counters said more than the table holds: follow the table.
            *figures = HistoryStatus {
                evicted: figures.evicted,
                expired: figures.expired,
                ..HistoryStatus::default()
            };
            break;
        }
        for (session, bytes) in oldest {
            if figures.bytes <= max_bytes {
                break;
            }
            tx.prepare_cached("DELETE FROM history WHERE session = ?1")?
                .execute([&session])?;
            figures.sessions = figures.sessions.saturating_sub(1);
            figures.bytes = figures.bytes.saturating_sub(bytes as u64);
            figures.evicted += 1;
        }
    }
    Ok(())
}

/// Deletes the conversations untouched for `limits.ttl` (counted as expired), then counts
/// the table again.
pub(super) fn expire(
    conn: &Connection,
    limits: &HistoryLimits,
    now_ms: u64,
    figures: &mut HistoryStatus,
) -> rusqlite::Result<()> {
    let before = now_ms.saturating_sub(limits.ttl.as_millis() as u64);
    let gone = conn
        .prepare_cached("DELETE FROM history WHERE touched < ?1")?
        .execute([before as i64])?;
    figures.expired += gone as u64;
    count(conn, figures)
}

/// Sets the sessions and bytes from the table.
pub(super) fn count(conn: &Connection, figures: &mut HistoryStatus) -> rusqlite::Result<()> {
    let (sessions, bytes): (i64, i64) = conn.query_row(
        "SELECT count(*), coalesce(sum(bytes), 0) FROM history",
        [],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )?;
    figures.sessions = sessions as u64;
    figures.bytes = bytes as u64;
    Ok(())
}

/// `session`'s stored conversation (empty: none); a row that fails its checksum is an
/// error, never a guess.
pub(super) fn read(conn: &Connection, session: &str) -> Result<Vec<Exchange>, String> {
    let row: Option<(String, i64)> = conn
        .prepare_cached("SELECT body, sum FROM history WHERE session = ?1")
        .and_then(|mut s| {
            s.query_row([session], |r| Ok((r.get(0)?, r.get(1)?)))
                .optional()
        })
        .map_err(|e| format!("cannot read the stored conversation: {e}"))?;
    let Some((body, sum)) = row else {
        return Ok(Vec::new());
    };
    if row_sum(session, &body) != sum {
        return Err("the stored conversation fails its checksum".into());
    }
    serde_json::from_str(&body).map_err(|e| format!("the stored conversation is malformed: {e}"))
}

/// A loader for agent creation, reading through the journal's own connection.
pub(super) fn loader(conn: &Arc<Mutex<Connection>>) -> MemoryLoader {
    let conn = Arc::clone(conn);
    Arc::new(move |session: &str| read(&lock(&conn), session))
}

/// `session`'s stored conversation in the journal of `dir`, opened read-only (for
/// `turnstile history export`).
pub(crate) fn export(dir: &Path, session: &str) -> Result<Vec<Exchange>, String> {
    let path = dir.join(FILE_NAME);
    if !path.exists() {
        return Err(format!("{} does not exist", path.display()));
    }
    let conn = Connection::open_with_flags(
        &path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let has_table: bool = conn
        .query_row(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'history'",
            [],
            |r| r.get::<_, i64>(0),
        )
        .map(|n| n > 0)
        .map_err(|e| busy_or(&path, &e))?;
    if !has_table {
        return Ok(Vec::new());
    }
    read(&conn, session).map_err(|e| format!("{}: {e}", path.display()))
}

fn busy_or(path: &Path, e: &rusqlite::Error) -> String {
    match e.sqlite_error_code() {
        Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked) => format!(
            "{} is held by a running gateway (the journal is locked while it runs)",
            path.display()
        ),
        _ => format!("cannot read {}: {e}", path.display()),
    }
}
