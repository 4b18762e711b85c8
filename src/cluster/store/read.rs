//! The reads of a partition's inbox and outcome streams.

use std::collections::HashMap;
use std::time::Duration;

use redis::Value;

use super::{Keys, RedisStore, Stream, StreamEntry, malformed, text};
use crate::journal::StoreError;

impl RedisStore {
    /// Reads `stream` of each `(partition, after id)` in `cursors`: up to `count` entries of
    /// each, waiting up to `block` for the first if there are none (`None`: no wait). A
    /// blocking read holds the connection, so the reader has a store (a connection) of its
    /// own, on a thread of its own, never the journal thread's.
    pub fn read(
        &mut self,
        stream: Stream,
        cursors: &[(u32, String)],
        count: usize,
        block: Option<Duration>,
    ) -> Result<Vec<StreamEntry>, StoreError> {
        let mixed: Vec<(Stream, u32, String)> = cursors
            .iter()
            .map(|(p, after)| (stream, *p, after.clone()))
            .collect();
        Ok(self
            .read_mixed(&mixed, count, block)?
            .into_iter()
            .map(|(_, e)| e)
            .collect())
    }

    /// As [`RedisStore::read`], for streams of both kinds in one call (one blocking wait for
    /// whichever has an entry first): each `(stream, partition, after id)`; every entry
    /// comes with the kind of stream it was read from.
    pub fn read_mixed(
        &mut self,
        cursors: &[(Stream, u32, String)],
        count: usize,
        block: Option<Duration>,
    ) -> Result<Vec<(Stream, StreamEntry)>, StoreError> {
        if cursors.is_empty() {
            return Ok(Vec::new());
        }
        let mut by_key: HashMap<String, (Stream, u32)> = HashMap::new();
        let mut cmd = redis::cmd("XREAD");
        cmd.arg("COUNT").arg(count.max(1));
        if let Some(b) = block {
            cmd.arg("BLOCK").arg(b.as_millis().max(1) as u64);
        }
        cmd.arg("STREAMS");
        for (stream, p, _) in cursors {
            let key = Keys::of(*p).k(stream_name(*stream));
            cmd.arg(&key);
            by_key.insert(key, (*stream, *p));
        }
        for (_, _, after) in cursors {
            cmd.arg(after);
        }
        // A blocking read may wait `block` beyond the usual round trip.
        let timeout = self.cfg.timeout + block.unwrap_or_default();
        let v: Value = self.with("read", |c, _| {
            c.set_read_timeout(Some(timeout))?;
            let v = cmd.query(c);
            c.set_read_timeout(Some(timeout - block.unwrap_or_default()))?;
            v
        })?;
        let mut out = Vec::new();
        let streams = match v {
            Value::Nil => return Ok(out),
            Value::Array(s) => s,
            Value::Map(m) => m
                .into_iter()
                .map(|(k, v)| Value::Array(vec![k, v]))
                .collect(),
            _ => return Err(malformed("read")),
        };
        for st in streams {
            let Value::Array(kv) = st else {
                return Err(malformed("read: stream"));
            };
            let [key, Value::Array(entries)] = kv.as_slice() else {
                return Err(malformed("read: stream"));
            };
            let (stream, partition) = text(key)
                .and_then(|k| by_key.get(&k).copied())
                .ok_or_else(|| malformed("read: stream key"))?;
            for e in entries {
                let Value::Array(e) = e else {
                    return Err(malformed("read: entry"));
                };
                let [id, Value::Array(fields)] = e.as_slice() else {
                    return Err(malformed("read: entry"));
                };
                let mut entry = StreamEntry {
                    partition,
                    id: text(id).ok_or_else(|| malformed("read: entry id"))?,
                    seq: 0,
                    origin: String::new(),
                    by: String::new(),
                };
                for f in fields.chunks(2) {
                    match (f.first().and_then(text).as_deref(), f.get(1).and_then(text)) {
                        (Some("seq"), Some(v)) => {
                            entry.seq = v.parse().map_err(|_| malformed("read: seq"))?;
                        }
                        (Some("origin"), Some(v)) => entry.origin = v,
                        (Some("by"), Some(v)) => entry.by = v,
                        _ => {}
                    }
                }
                out.push((stream, entry));
            }
        }
        Ok(out)
    }

    /// The last entry id of `stream` of each of `partitions` (`0-0` for an empty one): where
    /// a reader that must miss nothing from now on starts.
    pub fn stream_ends(
        &mut self,
        stream: Stream,
        partitions: &[u32],
    ) -> Result<Vec<String>, StoreError> {
        let mut pipe = redis::pipe();
        for p in partitions {
            pipe.cmd("XREVRANGE")
                .arg(Keys::of(*p).k(stream_name(stream)))
                .arg("+")
                .arg("-")
                .arg("COUNT")
                .arg(1);
        }
        let answers: Vec<Value> = self.with("stream ends", |c, _| pipe.query(c))?;
        if answers.len() != partitions.len() {
            return Err(malformed("stream ends"));
        }
        answers
            .iter()
            .map(|v| match v {
                Value::Array(entries) => match entries.first() {
                    None => Ok("0-0".to_string()),
                    Some(Value::Array(e)) => e
                        .first()
                        .and_then(text)
                        .ok_or_else(|| malformed("stream ends")),
                    Some(_) => Err(malformed("stream ends")),
                },
                _ => Err(malformed("stream ends")),
            })
            .collect()
    }
}

fn stream_name(stream: Stream) -> &'static str {
    match stream {
        Stream::Inbox => "in",
        Stream::Outcomes => "out",
    }
}
