//! The hello registry and the forward streams (docs/cluster.md "Where the result goes"):
//! `ts:hello:<platform>` names the instance of the platform's newest hello, and
//! `ts:fwd:<instance>` carries the results other instances forward to it, and its answers
//! to the forwards it was sent.
//!
//! The newest hello is the last `SET` Redis applied: Redis orders the writes, so no two
//! clocks are compared; the time written with it (the writer's clock, ms since the epoch) is
//! only shown.

use redis::Value;

use super::{Keys, PREFIX, RedisStore, malformed, text};
use crate::cluster::tag_parts;
use crate::journal::StoreError;

/// The bound on each instance's forward stream (`MAXLEN ~`): the oldest entries are trimmed
/// past it. An entry trimmed unread costs nothing lost: the results it named stay with the
/// instance that forwarded them, which asks again.
pub const FWD_MAXLEN: usize = 10_000;

/// One entry of an instance's forward stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FwdEntry {
    /// `from` holds these results (cluster tags) of `platform`, whose newest hello is the
    /// reading instance's: it may take them.
    Forward {
        /// The instance that holds them.
        from: String,
        /// Their platform.
        platform: String,
        /// Their cluster tags.
        results: Vec<u64>,
    },
    /// `from` answers a forward: what it took (the forwarder drops its copies), what it
    /// refused (they stay with the forwarder).
    Took {
        /// The instance that was forwarded them.
        from: String,
        /// Their platform.
        platform: String,
        /// Taken.
        taken: Vec<u64>,
        /// Refused (no room, no connection of the platform there, gone).
        refused: Vec<u64>,
    },
}

/// KEYS: a message's hash. ARGV: the instance that took its result. A result taken by a
/// forward has the taker as its origin from then on, while its message is in Redis: should
/// the taker die before its bridge confirmed it, the partition's owner finds a message
/// whose origin left the registry (`Arrival::OriginGone`) and sends its result again,
/// marked (tests/simulation_cluster, seed 23: the offerer had dropped its copy, the owner
/// never reloads, and the result was never answered). A message delivered meanwhile (its
/// hash gone) is left gone.
const ADOPT: &str = r"
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[1], 'o', ARGV[1])
end
return 0
";

fn hello_key(platform: &str) -> String {
    format!("{PREFIX}:hello:{platform}")
}

fn fwd_key(instance: &str) -> String {
    format!("{PREFIX}:fwd:{instance}")
}

fn tags(v: &[u64]) -> String {
    v.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
}

fn parse_tags(s: &str) -> Result<Vec<u64>, StoreError> {
    s.split(',')
        .filter(|t| !t.is_empty())
        .map(|t| t.parse().map_err(|_| malformed("forward: tags")))
        .collect()
}

impl RedisStore {
    /// Records that this instance had a hello of each of `platforms` just now (one round
    /// trip): each key's value is `<instance> <now_ms>`.
    pub fn set_hellos(&mut self, platforms: &[String], now_ms: u64) -> Result<(), StoreError> {
        if platforms.is_empty() {
            return Ok(());
        }
        let value = format!("{} {now_ms}", self.instance());
        let mut pipe = redis::pipe();
        for p in platforms {
            pipe.cmd("SET").arg(hello_key(p)).arg(&value).ignore();
        }
        self.with("hello", |c, _| pipe.query::<()>(c))
    }

    /// The instance of `platform`'s newest hello and the time it wrote (its own clock).
    pub fn hello_of(&mut self, platform: &str) -> Result<Option<(String, u64)>, StoreError> {
        let key = hello_key(platform);
        let v: Value = self.with("hello of", |c, _| redis::cmd("GET").arg(&key).query(c))?;
        if v == Value::Nil {
            return Ok(None);
        }
        let s = text(&v).ok_or_else(|| malformed("hello of"))?;
        let (instance, at) = s.rsplit_once(' ').ok_or_else(|| malformed("hello of"))?;
        let at = at.parse().map_err(|_| malformed("hello of: time"))?;
        Ok(Some((instance.to_owned(), at)))
    }

    /// Adds `entry` to instance `to`'s forward stream. An answer first makes this instance
    /// the origin of each message it took (see [`ADOPT`]), in the same round trip.
    pub fn fwd_add(&mut self, to: &str, entry: &FwdEntry) -> Result<(), StoreError> {
        let mut pipe = redis::pipe();
        if let FwdEntry::Took { from, taken, .. } = entry {
            for &tag in taken {
                if let Some((partition, seq)) = tag_parts(tag) {
                    let key = Keys::of(partition).message(seq);
                    pipe.cmd("EVAL")
                        .arg(ADOPT)
                        .arg(1)
                        .arg(key)
                        .arg(from)
                        .ignore();
                }
            }
        }
        let mut cmd = redis::cmd("XADD");
        cmd.arg(fwd_key(to))
            .arg("MAXLEN")
            .arg("~")
            .arg(FWD_MAXLEN)
            .arg("*");
        match entry {
            FwdEntry::Forward {
                from,
                platform,
                results,
            } => {
                cmd.arg("kind").arg("fwd").arg("from").arg(from);
                cmd.arg("platform")
                    .arg(platform)
                    .arg("a")
                    .arg(tags(results));
            }
            FwdEntry::Took {
                from,
                platform,
                taken,
                refused,
            } => {
                cmd.arg("kind").arg("took").arg("from").arg(from);
                cmd.arg("platform").arg(platform).arg("a").arg(tags(taken));
                cmd.arg("b").arg(tags(refused));
            }
        }
        pipe.add_command(cmd).ignore();
        let _: Value = self.with("forward", |c, _| pipe.query(c))?;
        Ok(())
    }

    /// The last entry id of this instance's forward stream (`0-0` when empty): where its
    /// reader starts.
    pub fn fwd_end(&mut self) -> Result<String, StoreError> {
        let key = fwd_key(self.instance());
        let v: Value = self.with("forward end", |c, _| {
            redis::cmd("XREVRANGE")
                .arg(&key)
                .arg("+")
                .arg("-")
                .arg("COUNT")
                .arg(1)
                .query(c)
        })?;
        match v {
            Value::Array(e) => match e.first() {
                None => Ok("0-0".into()),
                Some(Value::Array(e)) => e
                    .first()
                    .and_then(text)
                    .ok_or_else(|| malformed("forward end")),
                Some(_) => Err(malformed("forward end")),
            },
            _ => Err(malformed("forward end")),
        }
    }

    /// Up to `count` entries of this instance's forward stream after `after`, each with its
    /// id (no wait). An entry of an unknown kind or shape is `None` (skipped, so that one
    /// bad entry never stops the stream).
    pub fn fwd_read(
        &mut self,
        after: &str,
        count: usize,
    ) -> Result<Vec<(String, Option<FwdEntry>)>, StoreError> {
        let key = fwd_key(self.instance());
        let v: Value = self.with("forward read", |c, _| {
            redis::cmd("XRANGE")
                .arg(&key)
                .arg(format!("({after}"))
                .arg("+")
                .arg("COUNT")
                .arg(count.max(1))
                .query(c)
        })?;
        let Value::Array(entries) = v else {
            return Err(malformed("forward read"));
        };
        let mut out = Vec::with_capacity(entries.len());
        for e in entries {
            let Value::Array(e) = e else {
                return Err(malformed("forward read: entry"));
            };
            let [id, Value::Array(fields)] = e.as_slice() else {
                return Err(malformed("forward read: entry"));
            };
            let id = text(id).ok_or_else(|| malformed("forward read: id"))?;
            out.push((id, entry_of(fields)));
        }
        Ok(out)
    }
}

fn entry_of(fields: &[Value]) -> Option<FwdEntry> {
    let mut get = std::collections::HashMap::new();
    for f in fields.chunks(2) {
        if let (Some(k), Some(v)) = (f.first().and_then(text), f.get(1).and_then(text)) {
            get.insert(k, v);
        }
    }
    let field = |k: &str| get.get(k).cloned().unwrap_or_default();
    let (from, platform) = (field("from"), field("platform"));
    let tags = |k: &str| {
        parse_tags(&field(k))
            .map_err(|e| log::warn!("cluster: a forward entry skipped: {}", e.message))
            .ok()
    };
    match get.get("kind").map(String::as_str) {
        Some("fwd") => Some(FwdEntry::Forward {
            from,
            platform,
            results: tags("a")?,
        }),
        Some("took") => Some(FwdEntry::Took {
            from,
            platform,
            taken: tags("a")?,
            refused: tags("b")?,
        }),
        _ => None,
    }
}
