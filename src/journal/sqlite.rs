//! The journal in SQLite (bundled, WAL mode, `synchronous=FULL`): one row per message in
//! flight, one per id in the duplicate window. Chosen over redb after measuring both with
//! group commit on this machine (BENCHMARKS.md).

use std::path::{Path, PathBuf};

use rusqlite::{Connection, OptionalExtension, Transaction, params};

use super::{
    Record, Recovered, RecoveredMessage, Store, StoreError, StoredMessage, StoredOutcome, checksum,
    now_ms,
};

/// The file inside the data directory.
pub(super) const FILE_NAME: &str = "journal.sqlite3";
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
";

/// The SQLite journal. The file is locked exclusively while it is open: a second gateway on
/// the same data directory is refused.
pub struct SqliteStore {
    conn: Connection,
    path: PathBuf,
    batches: u64,
}

fn err(what: &str, path: &Path) -> impl Fn(rusqlite::Error) -> StoreError {
    let path = path.display().to_string();
    let what = what.to_string();
    move |e| StoreError(format!("{what} ({path}): {e}"))
}

impl SqliteStore {
    /// Opens (creating if needed) the journal in `dir`.
    pub fn open(dir: &Path) -> Result<SqliteStore, StoreError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| StoreError(format!("cannot create {}: {e}", dir.display())))?;
        let path = dir.join(FILE_NAME);
        let conn = Connection::open(&path).map_err(err("cannot open the journal", &path))?;
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
            conn.pragma_update(None, "journal_size_limit", 64i64 << 20)?;
            // 16 MiB of page cache (negative: KiB), so that the rows in flight stay in memory.
            conn.pragma_update(None, "cache_size", -16384i64)?;
            conn.execute_batch(SCHEMA)?;
            Ok(())
        };
        setup().map_err(err("cannot open the journal", &path))?;
        let version: Option<i64> = conn
            .query_row("SELECT v FROM meta WHERE k = 'version'", [], |r| r.get(0))
            .optional()
            .map_err(err("cannot read the journal", &path))?;
        match version {
            None => {
                conn.execute(
                    "INSERT INTO meta (k, v) VALUES ('version', ?1)",
                    [SCHEMA_VERSION],
                )
                .map_err(err("cannot write the journal", &path))?;
            }
            Some(SCHEMA_VERSION) => {}
            Some(v) => {
                return Err(StoreError(format!(
                    "{}: journal schema version {v}, this build reads {SCHEMA_VERSION}",
                    path.display()
                )));
            }
        }
        Ok(SqliteStore {
            conn,
            path,
            batches: 0,
        })
    }

    /// The journal file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn housekeeping(&mut self) -> rusqlite::Result<()> {
        self.conn
            .execute("DELETE FROM dedup WHERE until <= ?1", [now_ms() as i64])?;
        self.conn.execute_batch("PRAGMA incremental_vacuum(1024);")
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
        let path = self.path.clone();
        let tx = self
            .conn
            .transaction()
            .map_err(err("journal write failed", &path))?;
        for r in batch {
            write_record(&tx, r).map_err(err("journal write failed", &path))?;
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
            )
            .and_then(|mut st| st.execute([max as i64]))
            .map_err(err("journal write failed", &path))?;
        }
        tx.commit().map_err(err("journal write failed", &path))?;
        self.batches += 1;
        if self.batches.is_multiple_of(HOUSEKEEPING_EVERY) {
            // Best effort: the batch is durable whatever happens here.
            if let Err(e) = self.housekeeping() {
                log::warn!("journal housekeeping failed ({}): {e}", path.display());
            }
        }
        Ok(())
    }

    fn load(&mut self, now: u64) -> Result<Recovered, StoreError> {
        self.quick_check()?;
        let mut out = Recovered {
            max_seq: self.max_seq()?,
            ..Recovered::default()
        };
        out.messages = self.load_messages(out.max_seq)?;
        out.dedup = self.load_dedup(now)?;
        Ok(out)
    }
}

/// A row of the messages table as stored: the message, its checksum, its outcome blob.
type MessageRow = (RecoveredMessage, i64, Option<Vec<u8>>);

impl SqliteStore {
    /// The error for a journal that cannot be trusted, naming the file and what is wrong.
    fn damaged(&self, what: impl std::fmt::Display) -> StoreError {
        StoreError(format!(
            "the journal {} is damaged ({what}); move it away to start with an empty one",
            self.path.display()
        ))
    }

    fn quick_check(&self) -> Result<(), StoreError> {
        let check: String = self
            .conn
            .query_row("PRAGMA quick_check", [], |r| r.get(0))
            .map_err(|e| self.damaged(e))?;
        if check != "ok" {
            return Err(self.damaged(format_args!("quick_check: {check}")));
        }
        Ok(())
    }

    fn max_seq(&self) -> Result<u64, StoreError> {
        let max_seq: i64 = self
            .conn
            .query_row(
                "SELECT coalesce((SELECT v FROM meta WHERE k = 'max_seq'), 0)",
                [],
                |r| r.get(0),
            )
            .map_err(|e| self.damaged(e))?;
        Ok(u64::try_from(max_seq).unwrap_or(0))
    }

    /// Every journaled message in order, each checked against its checksum and `max_seq`.
    fn load_messages(&self, max_seq: u64) -> Result<Vec<RecoveredMessage>, StoreError> {
        let damaged = |e: rusqlite::Error| self.damaged(e);
        let mut stmt = self
            .conn
            .prepare(
                "SELECT seq, platform, id, chat_type, chat_id, thread_id, user_id, user_name, meta,
                 text, dedup_until, sum, starts, outcome FROM messages ORDER BY seq",
            )
            .map_err(damaged)?;
        let mut rows = stmt.query([]).map_err(damaged)?;
        let mut messages = Vec::new();
        while let Some(row) = rows.next().map_err(damaged)? {
            let (mut rm, sum, outcome) = message_row(row).map_err(damaged)?;
            let seq = rm.message.seq;
            if message_sum(&rm.message) as i64 != sum || seq > max_seq {
                return Err(self.damaged(format_args!("message {seq} fails its checksum")));
            }
            if let Some(blob) = outcome {
                rm.outcome = Some(decode_outcome(&blob).ok_or_else(|| {
                    self.damaged(format_args!(
                        "the outcome of message {seq} fails its checksum"
                    ))
                })?);
            }
            messages.push(rm);
        }
        Ok(messages)
    }

    /// The duplicate-window ids still in their window at `now`.
    fn load_dedup(&self, now: u64) -> Result<Vec<(String, String, u64)>, StoreError> {
        let damaged = |e: rusqlite::Error| self.damaged(e);
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
