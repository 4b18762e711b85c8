//! Loading the journal at start-up: the messages in flight (a row failing its checksum is
//! quarantined, the others load) and the duplicate window.

use super::*;
use crate::journal::mark::MARK_FILE;
use crate::message::ChatType;
use crate::wire::MessageFields;

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

    pub(super) fn load_once(&mut self, now: u64) -> Result<Recovered, StoreError> {
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
            .db()
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
        let db = self.db();
        let mut stmt = db
            .prepare(
                "SELECT seq, platform, id, chat_type, chat_id, thread_id, user_id, user_name, meta,
                 text, dedup_until, sum, starts, outcome, attachments FROM messages ORDER BY seq",
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
        let conn = Arc::clone(&self.conn);
        let mut db = lock(&conn);
        let tx = db.transaction().map_err(&fail)?;
        for d in bad {
            tx.prepare_cached(
                "INSERT INTO quarantine (seq, platform, id, chat_type, chat_id, thread_id, user_id,
                 user_name, meta, text, dedup_until, sum, starts, outcome, reason, at,
                 attachments) SELECT seq, platform, id, chat_type, chat_id, thread_id, user_id,
                 user_name, meta, text, dedup_until, sum, starts, outcome, ?2, ?3, attachments
                 FROM messages WHERE seq = ?1",
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
        let db = self.db();
        let mut stmt = db
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

/// The `attachments` column: NULL (none, or a row from before the column) or the JSON list.
fn attachments_column(text: Option<String>) -> rusqlite::Result<Vec<crate::Attachment>> {
    let Some(text) = text else {
        return Ok(Vec::new());
    };
    serde_json::from_str::<serde_json::Value>(&text)
        .map_err(|e| e.to_string())
        .and_then(crate::attachments::parse_list)
        .map_err(|e| {
            rusqlite::Error::FromSqlConversionFailure(14, rusqlite::types::Type::Text, e.into())
        })
}

fn message_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<MessageRow> {
    let seq: i64 = row.get(0)?;
    let chat_type: String = row.get(3)?;
    let chat_type = ChatType::parse(&chat_type).ok_or_else(|| {
        let e = format!("chat_type {chat_type:?} is not dm, group, channel or thread");
        rusqlite::Error::FromSqlConversionFailure(3, rusqlite::types::Type::Text, e.into())
    })?;
    let fields = MessageFields {
        id: row.get(2)?,
        platform: Some(row.get(1)?),
        chat_id: row.get(4)?,
        chat_type,
        user_id: row.get(6)?,
        user_name: row.get(7)?,
        thread_id: row.get(5)?,
        meta: row.get(8)?,
        text: row.get(9)?,
        attachments: attachments_column(row.get(14)?)?,
    };
    let message = StoredMessage {
        seq: seq as u64,
        fields,
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
