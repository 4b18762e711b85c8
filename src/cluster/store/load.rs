//! The load of one partition by its new owner, and the message hash read back.

use std::collections::HashMap;

use redis::Value;

use super::{Keys, LoadedPartition, RedisStore, bytes, malformed, text};
use crate::journal::{Recovered, RecoveredMessage, StoreError, StoredMessage, StoredOutcome};
use crate::message::ChatType;
use crate::wire::MessageFields;

impl RedisStore {
    /// One partition as a new owner rebuilds it: an atomic snapshot of its messages in
    /// flight (in seq order, with their starts and outcomes), its live duplicate window and
    /// its inbox position. A message that cannot be read back is an error, never a guess.
    pub fn load_partition(
        &mut self,
        partition: u32,
        now_ms: u64,
    ) -> Result<LoadedPartition, StoreError> {
        let keys = Keys::of(partition);
        let v: Value = self.with("load", |c, s| {
            s.load
                .key(keys.k("seq"))
                .key(keys.k("q"))
                .key(keys.k("dedupx"))
                .key(keys.k("in"))
                .arg(keys.k("m:"))
                .arg(now_ms)
                .invoke(c)
        })?;
        let Value::Array(parts) = v else {
            return Err(malformed("load"));
        };
        let [max_seq, last, msgs, live] = parts.as_slice() else {
            return Err(malformed("load"));
        };
        let max_seq = text(max_seq)
            .and_then(|s| s.parse::<u64>().ok())
            .ok_or_else(|| malformed("load: seq"))?;
        self.note_count(partition, max_seq)?;
        let inbox_after = text(last).ok_or_else(|| malformed("load: inbox"))?;
        let mut out = LoadedPartition {
            recovered: Recovered {
                max_seq,
                ..Recovered::default()
            },
            origins: HashMap::new(),
            inbox_after,
        };
        let Value::Array(msgs) = msgs else {
            return Err(malformed("load: messages"));
        };
        for entry in msgs {
            let (seq, fields) = match entry {
                Value::Array(pair) => match pair.as_slice() {
                    [seq, Value::Array(fields)] => (text(seq), fields),
                    _ => return Err(malformed("load: message")),
                },
                _ => return Err(malformed("load: message")),
            };
            let seq: u64 = seq
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| malformed("load: message seq"))?;
            let (rm, origin) = message_of(partition, seq, fields)?;
            // An in-flight id's window is its message's own (the accept script no longer
            // writes it into `dedupx`).
            out.recovered.dedup.push((
                rm.message.platform().to_string(),
                rm.message.id().to_string(),
                rm.message.dedup_until_ms,
            ));
            out.origins.insert(seq, origin);
            out.recovered.messages.push(rm);
        }
        let Value::Array(live) = live else {
            return Err(malformed("load: window"));
        };
        for pair in live.chunks(2) {
            let [member, score] = pair else {
                return Err(malformed("load: window"));
            };
            let member = text(member).ok_or_else(|| malformed("load: window"))?;
            let Some((platform, id)) = member.split_once('\n') else {
                return Err(malformed("load: window id"));
            };
            let score = text(score).ok_or_else(|| malformed("load: window"))?;
            // `+inf`: an older version's in-flight id, taken from its message above.
            let Ok(until) = score.parse::<u64>() else {
                continue;
            };
            out.recovered
                .dedup
                .push((platform.to_string(), id.to_string(), until));
        }
        // The status counts its conversations from now on; a failed count is no failed load.
        if let Err(e) = self.count_history(partition) {
            log::debug!("partition {partition}: its conversations were not counted: {e}");
        }
        Ok(out)
    }

    /// The messages at `(partition, seq)` as stored, with their origins, in one round trip:
    /// `None` for one that has left the store (delivered or forgotten meanwhile).
    pub fn fetch(
        &mut self,
        at: &[(u32, u64)],
    ) -> Result<Vec<Option<(RecoveredMessage, String)>>, StoreError> {
        let wanted: Vec<(u32, u64, Want)> =
            at.iter().map(|&(p, s)| (p, s, Want::Message)).collect();
        Ok((self.fetch_wanted(&wanted)?.into_iter())
            .map(|f| match f {
                Fetched::Message(m, origin) => Some((*m, origin)),
                Fetched::Outcome(_) | Fetched::Missing => None,
            })
            .collect())
    }

    /// What the reader wants of each message at `(partition, seq)`, in one round trip: the
    /// whole message (`HGETALL`) or its outcome's three fields alone (`HMGET`: an origin
    /// sends the result, the rest of the hash it has).
    pub(crate) fn fetch_wanted(
        &mut self,
        at: &[(u32, u64, Want)],
    ) -> Result<Vec<Fetched>, StoreError> {
        if at.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for (p, seq, want) in at {
            let key = Keys::of(*p).message(*seq);
            match want {
                Want::Message => pipe.cmd("HGETALL").arg(key),
                Want::Outcome => pipe.cmd("HMGET").arg(key).arg("oh").arg("ot").arg("ol"),
            };
        }
        let answers: Vec<Value> = self.with("fetch", |c, _| pipe.query(c))?;
        if answers.len() != at.len() {
            return Err(malformed("fetch"));
        }
        at.iter()
            .zip(&answers)
            .map(|((p, seq, want), v)| match want {
                Want::Message => Ok(match message_answer(*p, *seq, v)? {
                    Some((m, origin)) => Fetched::Message(Box::new(m), origin),
                    None => Fetched::Missing,
                }),
                Want::Outcome => outcome_answer(v),
            })
            .collect()
    }
}

/// What the reader wants of a message an entry named ([`RedisStore::fetch_wanted`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Want {
    /// The whole message as stored, with its origin (an inbox entry: the owner queues it).
    Message,
    /// Its outcome alone (an outcome entry: its origin sends the result).
    Outcome,
}

/// A message as [`RedisStore::fetch_wanted`] found it.
#[derive(Debug)]
pub(crate) enum Fetched {
    /// The whole message, with the instance that accepted it.
    Message(Box<RecoveredMessage>, String),
    /// Its outcome.
    Outcome(StoredOutcome),
    /// Gone (delivered or forgotten meanwhile), or without an outcome.
    Missing,
}

/// An `HGETALL`'s answer: the message, or `None` for one that has left the store.
fn message_answer(
    p: u32,
    seq: u64,
    v: &Value,
) -> Result<Option<(RecoveredMessage, String)>, StoreError> {
    match v {
        Value::Array(f) if f.is_empty() => Ok(None),
        Value::Map(m) if m.is_empty() => Ok(None),
        Value::Array(f) => message_of(p, seq, f).map(Some),
        Value::Map(m) => {
            let flat: Vec<Value> = m.iter().flat_map(|(k, v)| [k.clone(), v.clone()]).collect();
            message_of(p, seq, &flat).map(Some)
        }
        _ => Err(malformed("fetch")),
    }
}

/// An `HMGET` of a message's `oh`, `ot`, `ol`: its outcome once all three are written.
fn outcome_answer(v: &Value) -> Result<Fetched, StoreError> {
    let Value::Array(f) = v else {
        return Err(malformed("fetch: outcome"));
    };
    match f.as_slice() {
        [Value::Nil, ..] | [_, Value::Nil, _] | [_, _, Value::Nil] => Ok(Fetched::Missing),
        [head, text, tail] => match (bytes(head), bytes(text), bytes(tail)) {
            (Some(head), Some(text), Some(tail)) => Ok(Fetched::Outcome(StoredOutcome {
                head,
                text: String::from_utf8_lossy(&text).into_owned(),
                tail,
                memory: None,
            })),
            _ => Err(malformed("fetch: outcome")),
        },
        _ => Err(malformed("fetch: outcome")),
    }
}

/// A message hash as stored by the accept script.
fn message_of(
    partition: u32,
    seq: u64,
    fields: &[Value],
) -> Result<(RecoveredMessage, String), StoreError> {
    let mut f: HashMap<String, Vec<u8>> = HashMap::new();
    for pair in fields.chunks(2) {
        let [k, v] = pair else {
            return Err(malformed("load: message fields"));
        };
        match (text(k), bytes(v)) {
            (Some(k), Some(v)) => {
                f.insert(k, v);
            }
            _ => return Err(malformed("load: message fields")),
        }
    }
    let s = |k: &str| f.get(k).map(|v| String::from_utf8_lossy(v).into_owned());
    let need = |k: &str| {
        s(k).ok_or_else(|| {
            StoreError::untrusted(format!(
                "redis: partition {partition}, message {seq}: field {k} is missing"
            ))
        })
    };
    let num = |k: &str| -> Result<u64, StoreError> {
        need(k)?.parse().map_err(|_| {
            StoreError::untrusted(format!(
                "redis: partition {partition}, message {seq}: field {k} is not a number"
            ))
        })
    };
    // In the order the fields were always read (the first missing one is named).
    let (platform, id, chat_type) = (need("p")?, need("i")?, need("ct")?);
    let chat_type = ChatType::parse(&chat_type).ok_or_else(|| {
        StoreError::untrusted(format!(
            "redis: partition {partition}, message {seq}: field ct is not a chat type"
        ))
    })?;
    let fields = MessageFields {
        id,
        platform: Some(platform),
        chat_id: need("c")?,
        chat_type,
        user_id: s("u"),
        user_name: s("un"),
        thread_id: s("th"),
        meta: s("meta"),
        text: need("tx")?,
        attachments: match s("att") {
            None => Vec::new(),
            Some(text) => serde_json::from_str(&text)
                .map_err(|e| e.to_string())
                .and_then(crate::attachments::parse_list)
                .map_err(|e| {
                    StoreError::untrusted(format!(
                        "redis: partition {partition}, message {seq}: field att: {e}"
                    ))
                })?,
        },
    };
    let message = StoredMessage {
        seq,
        fields,
        dedup_until_ms: num("du")?,
    };
    let outcome = match (f.get("oh"), s("ot"), f.get("ol")) {
        (Some(head), Some(text), Some(tail)) => Some(StoredOutcome {
            head: head.clone(),
            text,
            tail: tail.clone(),
            memory: None,
        }),
        _ => None,
    };
    let starts = u32::try_from(num("st")?).map_err(|_| malformed("load: starts"))?;
    Ok((
        RecoveredMessage {
            message,
            starts,
            outcome,
        },
        s("o").unwrap_or_default(),
    ))
}
