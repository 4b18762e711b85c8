//! The openai agent's stored conversations in Redis (`--cluster`, docs/cluster.md "Keys"):
//! one string per session, `ts:{pN}:h:<session>` (its whole conversation as JSON,
//! `[[user, assistant], …]` oldest first), in its partition's hash tag so that the `outcome`
//! script that records a turn's outcome writes it in the same atomic step: never a
//! conversation ahead of the outcomes users saw, and never one written by a fenced owner.
//! The next owner reads it when the session's agent is created ([`history_loader`]).
//!
//! Bounds: `--history-ttl` is each key's expiry, refreshed by every write; `--history-bytes`
//! is split evenly among the partitions, each partition's conversations together kept
//! within its share by the script (least recently written deleted first, `ts:{pN}:hz`
//! orders them, `ts:{pN}:hb` holds each one's bytes and `ts:{pN}:hn` their sum); a single
//! conversation is bounded by the agent (`--history-chars`) and by its partition's share.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use redis::Value;

use super::batch::OpCall;
use super::{
    ClusterConfig, Keys, Lease, PREFIX, RedisStore, STREAM_MAXLEN, partition_of, redact_url,
    strings,
};
use crate::journal::memory::{Exchange, HistoryLimits, MemoryLoader, MemoryUpdate};
use crate::journal::{StoreError, StoredOutcome};
use crate::liveness::HistoryStatus;

/// Expired conversations whose bookkeeping one outcome script drops (bounds its work; Redis
/// deletes the keys themselves at their expiry).
const PRUNE_PER_OUTCOME: u32 = 64;
/// Connect, read and write timeout of `turnstile history export --cluster`.
#[cfg_attr(not(feature = "cli"), allow(dead_code))]
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// `session`'s conversation key, in the hash tag of the session's partition.
fn history_key(session: &str, partitions: u32) -> String {
    Keys::of(partition_of(session, partitions)).k(&format!("h:{session}"))
}

/// What the store knows of the stored conversations: their bounds, and the figures the
/// `outcome` script (or a partition's load) last answered for each partition.
#[derive(Debug, Default)]
pub(super) struct Histories {
    limits: HistoryLimits,
    /// Partition → (sessions, bytes) as last counted.
    counted: HashMap<u32, (u64, u64)>,
    evicted: u64,
    expired: u64,
}

impl Histories {
    /// A partition's share of `--history-bytes` (at least one byte).
    fn share(&self, partitions: u32) -> u64 {
        (self.limits.max_bytes / u64::from(partitions.max(1))).max(1)
    }

    /// The `outcome` script's answer `v` for `partition`: `ok` followed by the partition's
    /// sessions and bytes and what this write evicted and expired (absent without a change
    /// to a conversation).
    fn note(&mut self, partition: u32, v: &Value) {
        let a = strings(v);
        let n: Vec<u64> = a.iter().skip(1).filter_map(|s| s.parse().ok()).collect();
        if let (Some("ok"), [sessions, bytes, evicted, expired]) =
            (a.first().map(String::as_str), n.as_slice())
        {
            self.counted.insert(partition, (*sessions, *bytes));
            self.evicted += evicted;
            self.expired += expired;
        }
    }
}

/// KEYS: lease, outcome stream, then with a change to the conversation: its key, the
/// partition's order (`hz`), bytes (`hb`) and total (`hn`). ARGV: token, message key, seq,
/// head, text, tail, maxlen, instance, then with a change: `k` (keep) or `c` (clear), the
/// session, the conversation, the ttl in ms, the partition's share of the bytes, the prefix
/// of the partition's conversation keys, the prune count. Fenced unless the lease is the
/// token; a second outcome for the message changes nothing (a retried write whose first try
/// did land). The stream entry names the message's origin (whose reader wants it) and the
/// writer (`by`: an origin that wrote it itself has the result already, and its reader skips
/// the entry). The conversation is written last: a failure there leaves it behind the
/// outcome, never ahead. One `HMGET` reads what the outcome needs of the message (`st`,
/// which the accept script always writes, says it is there).
pub(super) const OUTCOME: &str = r"
local l = lease(KEYS[1])
if l ~= ARGV[1] then return {'fenced', l or ''} end
local m = redis.call('HMGET', ARGV[2], 'st', 'oh', 'o')
if not m[1] then return {'gone'} end
if m[2] then return {'again'} end
redis.call('HSET', ARGV[2], 'oh', ARGV[4], 'ot', ARGV[5], 'ol', ARGV[6])
local origin = m[3] or ''
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[7], '*', 'seq', ARGV[3], 'origin', origin, 'by', ARGV[8])
if not ARGV[9] then return {'ok'} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[12])
local evicted, expired = 0, 0
local function drop(s)
  local b = redis.call('HGET', KEYS[5], s)
  if b then
    redis.call('HDEL', KEYS[5], s)
    redis.call('DECRBY', KEYS[6], b)
  end
  redis.call('ZREM', KEYS[4], s)
  redis.call('DEL', ARGV[14] .. s)
end
for _, s in ipairs(redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now - ttl, 'LIMIT', 0, tonumber(ARGV[15]))) do
  drop(s)
  expired = expired + 1
end
drop(ARGV[10])
if ARGV[9] == 'k' then
  local b = #ARGV[10] + #ARGV[11]
  redis.call('SET', KEYS[3], ARGV[11], 'PX', ttl)
  -- Strictly after the newest, so eviction follows the write order within a millisecond.
  local newest = redis.call('ZREVRANGE', KEYS[4], 0, 0, 'WITHSCORES')[2]
  local at = now
  if newest and tonumber(newest) >= at then at = tonumber(newest) + 1 end
  redis.call('ZADD', KEYS[4], at, ARGV[10])
  redis.call('HSET', KEYS[5], ARGV[10], b)
  redis.call('INCRBY', KEYS[6], b)
  while tonumber(redis.call('GET', KEYS[6]) or '0') > tonumber(ARGV[13]) do
    local o = redis.call('ZRANGE', KEYS[4], 0, 0)
    if not o[1] then break end
    drop(o[1])
    evicted = evicted + 1
  end
end
local n = redis.call('GET', KEYS[6]) or '0'
return {'ok', tostring(redis.call('ZCARD', KEYS[4])), n, tostring(evicted), tostring(expired)}
";

impl RedisStore {
    /// Sets the stored conversations' bounds (`--history-ttl`, `--history-bytes`; default
    /// 30 days and 64 MiB): `ttl` is each conversation's expiry, refreshed by every write;
    /// `max_bytes` is split evenly among the partitions, each partition's conversations
    /// kept within their share (the least recently written deleted first).
    pub fn set_history_limits(&mut self, ttl: Duration, max_bytes: u64) {
        self.histories.limits = HistoryLimits { ttl, max_bytes };
    }

    /// The `outcome` operation: the outcome of `seq`, and with it the change it makes to its
    /// session's conversation (a session outside the lease's partition, which the bridge
    /// never builds, changes nothing).
    pub(super) fn outcome_call(&self, lease: &Lease, seq: u64, outcome: &StoredOutcome) -> OpCall {
        let keys = Keys::of(lease.partition);
        let partitions = self.cfg.partitions;
        let memory = outcome
            .memory
            .as_ref()
            .filter(|m| partition_of(&m.session, partitions) == lease.partition);
        debug_assert_eq!(memory.is_some(), outcome.memory.is_some());
        let mut names = vec![keys.k("lease"), keys.k("out")];
        if let Some(m) = memory {
            names.push(history_key(&m.session, partitions));
            names.extend(["hz", "hb", "hn"].map(|k| keys.k(k)));
        }
        let mut c = OpCall::new("o", names);
        c.arg(&lease.token)
            .arg(keys.message(seq))
            .arg(seq)
            .arg(&outcome.head)
            .arg(&outcome.text)
            .arg(&outcome.tail)
            .arg(STREAM_MAXLEN)
            .arg(&self.cfg.instance);
        if let Some(m) = memory {
            self.change_args(&mut c, &keys, m);
        }
        c
    }

    fn change_args(&self, c: &mut OpCall, keys: &Keys, m: &MemoryUpdate) {
        let h = &self.histories;
        let body = match m.exchanges.as_deref() {
            Some(e) if !e.is_empty() => serde_json::to_string(e).ok(),
            _ => None,
        };
        c.arg(if body.is_some() { "k" } else { "c" })
            .arg(&*m.session)
            .arg(body.unwrap_or_default())
            .arg(h.limits.ttl.as_millis().clamp(1, u128::from(u64::MAX)) as u64)
            .arg(h.share(self.cfg.partitions))
            .arg(keys.k("h:"))
            .arg(PRUNE_PER_OUTCOME);
    }

    /// The `outcome` script's answer for `partition`, into the figures.
    pub(super) fn note_outcome_answer(&mut self, partition: u32, v: &Value) {
        self.histories.note(partition, v);
    }

    /// Counts `partition`'s conversations as its new owner finds them.
    pub(super) fn count_history(&mut self, partition: u32) -> Result<(), StoreError> {
        let keys = Keys::of(partition);
        let (sessions, bytes): (u64, Option<u64>) = self.with("history count", |c, _| {
            redis::pipe()
                .cmd("ZCARD")
                .arg(keys.k("hz"))
                .cmd("GET")
                .arg(keys.k("hn"))
                .query(c)
        })?;
        self.histories
            .counted
            .insert(partition, (sessions, bytes.unwrap_or(0)));
        Ok(())
    }

    /// The stored conversations of the partitions in `owned` (as last counted), and what
    /// this store's writes evicted and expired since it started.
    pub fn history_status(&self, owned: impl Iterator<Item = u32>) -> HistoryStatus {
        let h = &self.histories;
        let mut s = HistoryStatus {
            evicted: h.evicted,
            expired: h.expired,
            ..HistoryStatus::default()
        };
        for p in owned {
            let (sessions, bytes) = h.counted.get(&p).copied().unwrap_or((0, 0));
            s.sessions += sessions;
            s.bytes += bytes;
        }
        s
    }
}

/// A connection of its own for the turn workers that create agents (`None` after a
/// failure: the next read reconnects).
struct Reader {
    client: redis::Client,
    con: Mutex<Option<redis::Connection>>,
    partitions: u32,
    timeout: Duration,
}

impl Reader {
    /// A connection kept from an earlier read may have been closed meanwhile (Redis's idle
    /// `timeout`, a restart): its failure is tried once more on a new one, so that a
    /// conversation is not started anew (and then overwritten) for a stale socket.
    fn read(&self, session: &str) -> Result<Vec<Exchange>, String> {
        let mut con = self.con.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(c) = con.as_mut() {
            match read_on(c, session, self.partitions) {
                Ok(v) => return Ok(v),
                Err(e) => log::debug!("session {session}: {e}; read again on a new connection"),
            }
        }
        *con = None;
        let mut c = connect(&self.client, self.timeout)?;
        let read = read_on(&mut c, session, self.partitions);
        if read.is_ok() {
            *con = Some(c);
        }
        read
    }
}

fn connect(client: &redis::Client, timeout: Duration) -> Result<redis::Connection, String> {
    client
        .get_connection_with_timeout(timeout)
        .and_then(|c| {
            c.set_read_timeout(Some(timeout))?;
            c.set_write_timeout(Some(timeout))?;
            Ok(c)
        })
        .map_err(|e| format!("redis: connect: {e}"))
}

/// `session`'s conversation (empty: none stored, or expired).
fn read_on(
    c: &mut redis::Connection,
    session: &str,
    partitions: u32,
) -> Result<Vec<Exchange>, String> {
    let body: Option<String> = redis::cmd("GET")
        .arg(history_key(session, partitions))
        .query(c)
        .map_err(|e| format!("redis: GET: {e}"))?;
    match body {
        None => Ok(Vec::new()),
        Some(b) => serde_json::from_str(&b)
            .map_err(|e| format!("the stored conversation is malformed: {e}")),
    }
}

/// `session`'s stored conversation in the cluster's Redis at `url`, read while the cluster
/// runs (`turnstile history export --cluster URL`); the partition count is the one the
/// cluster's first instance set.
#[cfg_attr(not(feature = "cli"), allow(dead_code))]
pub(crate) fn export_history(url: &str, session: &str) -> Result<Vec<Exchange>, String> {
    let shown = redact_url(url);
    let client = redis::Client::open(url).map_err(|e| format!("redis {shown}: {e}"))?;
    let mut c = connect(&client, EXPORT_TIMEOUT).map_err(|e| format!("{shown}: {e}"))?;
    let partitions: Option<u32> = redis::cmd("GET")
        .arg(format!("{PREFIX}:partitions"))
        .query(&mut c)
        .map_err(|e| format!("redis {shown}: GET: {e}"))?;
    let Some(partitions) = partitions.filter(|p| *p > 0) else {
        return Err(format!(
            "redis {shown}: no cluster has run on this database"
        ));
    };
    read_on(&mut c, session, partitions).map_err(|e| format!("{shown}: {e}"))
}

/// A loader for agent creation (on a turn worker, never the reactor), reading each
/// session's conversation from the Redis of `cfg` through a connection of its own.
#[cfg_attr(not(feature = "cli"), allow(dead_code))]
pub(crate) fn history_loader(cfg: &ClusterConfig) -> Result<MemoryLoader, StoreError> {
    let client = redis::Client::open(cfg.url.as_str()).map_err(|e| {
        StoreError::unusable(format!(
            "redis: the URL {:?} is not usable: {e}",
            cfg.shown_url()
        ))
    })?;
    let reader = Reader {
        client,
        con: Mutex::new(None),
        partitions: cfg.partitions,
        timeout: cfg.timeout,
    };
    Ok(Arc::new(move |session: &str| reader.read(session)))
}
