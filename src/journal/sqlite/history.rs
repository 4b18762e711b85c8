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
            // Strictly after every row, so eviction's order is the write order even for
            // writes in one millisecond (or after the clock stepped back); past 1,000
            // conversation writes a second it runs ahead of the clock by the excess,
            // which only delays a TTL sweep.
            let newest: Option<i64> = tx
                .prepare_cached("SELECT MAX(touched) FROM history")?
                .query_row([], |r| r.get(0))?;
            let touched = (now_ms as i64).max(newest.map_or(0, |n| n.saturating_add(1)));
            debug_assert!(newest.is_none_or(|n| touched > n));
            tx.prepare_cached(
                "INSERT OR REPLACE INTO history (session, body, bytes, touched, sum)
                 VALUES (?1, ?2, ?3, ?4, ?5)",
            )?
            .execute(params![
                session,
                body,
                bytes as i64,
                touched,
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::SqliteStore;
    use super::*;
    use crate::journal::{Record, Store, StoredMessage, StoredOutcome, now_ms};
    use crate::message::ChatType;
    use crate::wire::MessageFields;

    fn accepted(seq: u64) -> Record {
        let fields = MessageFields {
            id: format!("m{seq}"),
            platform: None,
            chat_id: "c".into(),
            chat_type: ChatType::Dm,
            user_id: None,
            user_name: None,
            thread_id: None,
            meta: None,
            text: "hi".into(),
            attachments: Vec::new(),
        };
        Record::Accepted(StoredMessage::new(seq, "t", fields, now_ms() + 60_000))
    }

    /// The outcome of `seq` that leaves `session`'s conversation at `exchanges`.
    fn remembering(seq: u64, session: &str, exchanges: &[(&str, &str)]) -> Record {
        let exchanges = exchanges
            .iter()
            .map(|(u, a)| ((*u).to_owned(), (*a).to_owned()))
            .collect();
        Record::Outcome {
            seq,
            outcome: StoredOutcome {
                head: b"{\"op\":\"reply\"}\n".to_vec(),
                memory: Some(MemoryUpdate::keep(session, exchanges)),
                ..StoredOutcome::default()
            },
        }
    }

    fn stored(store: &SqliteStore, session: &str) -> Vec<Exchange> {
        (store.memory_loader())(session).expect("readable")
    }

    fn pairs(v: &[(&str, &str)]) -> Vec<Exchange> {
        v.iter()
            .map(|(u, a)| ((*u).to_owned(), (*a).to_owned()))
            .collect()
    }

    #[test]
    fn a_conversation_commits_with_its_outcome_or_not_at_all() {
        let dir = tempfile::tempdir().expect("dir");
        let mut store = SqliteStore::open(dir.path()).expect("open");
        store.write(&[accepted(1)]).expect("accepted");
        // A crash between the conversation's write and the commit: the transaction aborts
        // at its last statement (the commit counter), after the conversation was written.
        store
            .db()
            .execute_batch(
                "CREATE TEMP TRIGGER crash BEFORE UPDATE ON meta
                 BEGIN SELECT RAISE(ABORT, 'crash before the commit'); END;",
            )
            .expect("trigger");
        let outcome = remembering(1, "t:dm:c", &[("hi", "hello")]);
        assert!(store.write(std::slice::from_ref(&outcome)).is_err());
        store
            .db()
            .execute_batch("DROP TRIGGER crash")
            .expect("drop");
        assert_eq!(stored(&store, "t:dm:c"), Vec::<Exchange>::new());
        assert_eq!(store.history().map(|h| h.sessions), Some(0));
        drop(store);
        let mut store = SqliteStore::open(dir.path()).expect("reopen");
        let loaded = store.load(now_ms()).expect("load");
        assert_eq!(loaded.messages[0].outcome, None, "no outcome either");
        assert_eq!(stored(&store, "t:dm:c"), Vec::<Exchange>::new());
        // The same batch once it commits: both, and the conversation survives a reopen.
        store.write(&[outcome]).expect("outcome");
        drop(store);
        let mut store = SqliteStore::open(dir.path()).expect("reopen");
        assert!(
            store.load(now_ms()).expect("load").messages[0]
                .outcome
                .is_some()
        );
        assert_eq!(stored(&store, "t:dm:c"), pairs(&[("hi", "hello")]));
        let h = store.history().expect("figures");
        assert_eq!(h.sessions, 1);
        assert_eq!(h.bytes, row_bytes("t:dm:c", r#"[["hi","hello"]]"#));
        // `/new`'s clear rides its outcome the same way.
        store.write(&[accepted(2)]).expect("accepted");
        let clear = Record::Outcome {
            seq: 2,
            outcome: StoredOutcome {
                memory: Some(MemoryUpdate::clear("t:dm:c")),
                ..StoredOutcome::default()
            },
        };
        store.write(&[clear]).expect("cleared");
        assert_eq!(stored(&store, "t:dm:c"), Vec::<Exchange>::new());
        assert_eq!(store.history().map(|h| (h.sessions, h.bytes)), Some((0, 0)));
        // A conversation the agent emptied (one exchange past `--history-chars`) keeps no row.
        store.write(&[accepted(3)]).expect("accepted");
        store
            .write(&[remembering(3, "t:dm:c", &[])])
            .expect("outcome");
        assert_eq!(store.history().map(|h| (h.sessions, h.bytes)), Some((0, 0)));
    }

    #[test]
    fn past_the_total_bound_the_least_recently_continued_conversations_go() {
        let dir = tempfile::tempdir().expect("dir");
        let mut store = SqliteStore::open(dir.path()).expect("open");
        let one = row_bytes("t:dm:a", r#"[["q","0123456789"]]"#);
        store
            .set_history_limits(HistoryLimits {
                ttl: Duration::from_secs(3600),
                max_bytes: 2 * one,
            })
            .expect("limits");
        for (seq, s) in [(1, "a"), (2, "b"), (3, "c")] {
            store.write(&[accepted(seq)]).expect("accepted");
            let session = format!("t:dm:{s}");
            store
                .write(&[remembering(seq, &session, &[("q", "0123456789")])])
                .expect("outcome");
            let h = store.history().expect("figures");
            assert!(h.bytes <= 2 * one, "{h:?}");
        }
        let h = store.history().expect("figures");
        assert_eq!((h.sessions, h.bytes, h.evicted), (2, 2 * one, 1));
        assert_eq!(stored(&store, "t:dm:a"), Vec::<Exchange>::new(), "oldest");
        assert_eq!(stored(&store, "t:dm:c"), pairs(&[("q", "0123456789")]));
        // A conversation continued is the most recent again: `b` now outlives `c`.
        store.write(&[accepted(4)]).expect("accepted");
        store
            .write(&[remembering(4, "t:dm:b", &[("q", "0123456789")])])
            .expect("outcome");
        store.write(&[accepted(5)]).expect("accepted");
        store
            .write(&[remembering(5, "t:dm:d", &[("q", "0123456789")])])
            .expect("outcome");
        assert!(!stored(&store, "t:dm:b").is_empty());
        assert_eq!(stored(&store, "t:dm:c"), Vec::<Exchange>::new());
        assert_eq!(store.history().map(|h| h.evicted), Some(2));
    }

    #[test]
    fn writes_in_one_millisecond_or_after_the_clock_stepped_back_keep_their_order() {
        let mut conn = Connection::open_in_memory().expect("db");
        conn.execute_batch(SCHEMA).expect("schema");
        let one = row_bytes("t:dm:a", r#"[["q","0123456789"]]"#);
        let mut figures = HistoryStatus::default();
        let tx = conn.transaction().expect("tx");
        let keep = |s: &str| MemoryUpdate::keep(s, vec![("q".into(), "0123456789".into())]);
        // One instant for a, b, c; then b again with the clock a second back; then d.
        for (s, at) in [("a", 5_000), ("b", 5_000), ("c", 5_000), ("b", 4_000)] {
            apply(&tx, &keep(&format!("t:dm:{s}")), at, &mut figures).expect("apply");
        }
        apply(&tx, &keep("t:dm:d"), 5_000, &mut figures).expect("apply");
        evict(&tx, 2 * one, &mut figures).expect("evict");
        let left: Vec<String> = tx
            .prepare("SELECT session FROM history ORDER BY session")
            .expect("select")
            .query_map([], |r| r.get(0))
            .expect("rows")
            .collect::<rusqlite::Result<_>>()
            .expect("read");
        assert_eq!(left, ["t:dm:b", "t:dm:d"], "the two written last stay");
        assert_eq!(figures.evicted, 2);
    }

    #[test]
    fn a_conversation_nobody_continued_for_the_ttl_is_swept() {
        let dir = tempfile::tempdir().expect("dir");
        let mut store = SqliteStore::open(dir.path()).expect("open");
        let ttl = Duration::from_secs(3600);
        store
            .set_history_limits(HistoryLimits {
                ttl,
                max_bytes: 1 << 20,
            })
            .expect("limits");
        store.write(&[accepted(1)]).expect("accepted");
        store
            .write(&[remembering(1, "t:dm:a", &[("q", "a")])])
            .expect("outcome");
        store.sweep_history(now_ms()).expect("sweep");
        assert_eq!(store.history().map(|h| h.sessions), Some(1), "not yet");
        let later = now_ms() + ttl.as_millis() as u64 + 1;
        store.sweep_history(later).expect("sweep");
        let h = store.history().expect("figures");
        assert_eq!((h.sessions, h.bytes, h.expired), (0, 0, 1));
        assert_eq!(stored(&store, "t:dm:a"), Vec::<Exchange>::new());
    }

    #[test]
    fn a_scribbled_conversation_is_refused_not_guessed() {
        let dir = tempfile::tempdir().expect("dir");
        let mut store = SqliteStore::open(dir.path()).expect("open");
        store.write(&[accepted(1)]).expect("accepted");
        store
            .write(&[remembering(1, "t:dm:a", &[("q", "a")])])
            .expect("outcome");
        store
            .db()
            .execute("UPDATE history SET body = '[[\"q\",\"b\"]]'", [])
            .expect("scribble");
        let e = (store.memory_loader())("t:dm:a").expect_err("refused");
        assert!(e.contains("checksum"), "{e}");
    }
}
