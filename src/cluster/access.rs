//! The access policy's state in Redis (`--cluster`): the [`SharedStore`] the policy's sharing
//! thread pushes its changes to and pulls the merged state from (`access/shared.rs`). All
//! keys carry the hash tag `{access}`, one per platform and kind, merged per user:
//!
//! - `ts:{access}:platforms`: the platforms with state (a set);
//! - `…:users:<platform>`: user → `allow` | `deny` (the latest verdict wins);
//! - `…:codes:<platform>`: code → `<expires_ms> <user>` (expired ones pruned on each pull);
//! - `…:rate:<platform>`: user → `<tokens> <at_ms>`, a token bucket every instance's takes
//!   are subtracted from (a script refills it first; entries untouched for a day are pruned);
//! - `…:tokens:<platform>:<day>`: user → tokens spent on that UTC day (`HINCRBY`; the key
//!   expires two days later).
//!
//! What a pull reads is bounded as the policy's state is (`state.rs`: users, codes, tracked
//! users), and [`PlatformState::trim`] cuts a merged state to those bounds.

use std::collections::HashMap;
use std::time::Duration;

use redis::Script;

use super::ClusterConfig;
use crate::access::shared::{Changes, SharedStore};
use crate::access::state::{Bucket, DAY_MS, DayTokens, Pending, PlatformState, Snapshot};

/// How long a Redis call may take before the sync fails (and is tried again next period).
const TIMEOUT: Duration = Duration::from_secs(2);
/// Platforms a pull reads at most (the policy's own cap).
const MAX_PLATFORMS: usize = 64;

/// Subtracts takes from buckets, each refilled to now first: KEYS[1] the rate hash; ARGV[1]
/// now (ms), then (user, taken, count, per_ms) per user.
const TAKE: &str = r"
local now = tonumber(ARGV[1])
for i = 2, #ARGV, 4 do
  local user, n = ARGV[i], tonumber(ARGV[i + 1])
  local full, per = tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
  local tokens, at = full, now
  local v = redis.call('HGET', KEYS[1], user)
  if v then
    local sp = string.find(v, ' ')
    tokens, at = tonumber(string.sub(v, 1, sp - 1)), tonumber(string.sub(v, sp + 1))
  end
  if now > at then
    tokens = math.min(full, tokens + (now - at) * full / per)
    at = now
  end
  redis.call('HSET', KEYS[1], user, string.format('%.6f %d', tokens - n, at))
end
return 1
";

/// The policy's state in the cluster's Redis.
pub(crate) struct RedisAccess {
    client: redis::Client,
    con: Option<redis::Connection>,
    take: Script,
}

/// The shared store of the cluster `cfg` names (connected at first use).
pub(crate) fn access_store(cfg: &ClusterConfig) -> Result<Box<dyn SharedStore>, String> {
    let client = redis::Client::open(cfg.url.as_str())
        .map_err(|e| format!("redis {}: {e}", cfg.shown_url()))?;
    Ok(Box::new(RedisAccess {
        client,
        con: None,
        take: Script::new(TAKE),
    }))
}

fn key(kind: &str, platform: &str) -> String {
    format!("ts:{{access}}:{kind}:{platform}")
}

/// A hash's fields as `HGETALL` answers them.
type Fields = HashMap<String, String>;

const PLATFORMS: &str = "ts:{access}:platforms";

impl RedisAccess {
    fn con(&mut self) -> redis::RedisResult<&mut redis::Connection> {
        if self.con.is_none() {
            let c = self.client.get_connection_with_timeout(TIMEOUT)?;
            c.set_read_timeout(Some(TIMEOUT))?;
            c.set_write_timeout(Some(TIMEOUT))?;
            self.con = Some(c);
        }
        self.con
            .as_mut()
            .ok_or_else(|| redis::RedisError::from((redis::ErrorKind::Io, "no connection")))
    }

    fn push(&mut self, changes: &Changes, now_ms: u64) -> redis::RedisResult<()> {
        let take = self.take.clone();
        let c = self.con()?;
        for (platform, ch) in changes {
            let mut p = redis::pipe();
            p.atomic().cmd("SADD").arg(PLATFORMS).arg(platform).ignore();
            for (user, allowed) in &ch.verdicts {
                let v = if *allowed { "allow" } else { "deny" };
                p.cmd("HSET")
                    .arg(key("users", platform))
                    .arg(user)
                    .arg(v)
                    .ignore();
            }
            for code in &ch.codes_removed {
                p.cmd("HDEL").arg(key("codes", platform)).arg(code).ignore();
            }
            for pd in &ch.codes_added {
                let v = format!("{} {}", pd.expires_ms, pd.user);
                p.cmd("HSET")
                    .arg(key("codes", platform))
                    .arg(&pd.code)
                    .arg(v)
                    .ignore();
            }
            for (user, (day, n)) in &ch.spent {
                let k = format!("{}:{day}", key("tokens", platform));
                p.cmd("HINCRBY").arg(&k).arg(user).arg(*n).ignore();
                p.cmd("EXPIRE")
                    .arg(&k)
                    .arg(2 * DAY_MS / 1000 + 3600)
                    .ignore();
            }
            p.query::<()>(c)?;
            if !ch.taken.is_empty() {
                let mut inv = take.key(key("rate", platform));
                inv.arg(now_ms);
                for (user, (n, count, per_ms)) in &ch.taken {
                    inv.arg(user).arg(*n).arg(*count).arg(*per_ms);
                }
                inv.invoke::<()>(c)?;
            }
        }
        Ok(())
    }

    fn pull(&mut self, now_ms: u64) -> redis::RedisResult<Snapshot> {
        let c = self.con()?;
        let platforms: Vec<String> = redis::cmd("SMEMBERS").arg(PLATFORMS).query(c)?;
        let mut snap = Snapshot::default();
        let day = now_ms / DAY_MS;
        for platform in platforms.into_iter().take(MAX_PLATFORMS) {
            let (users, codes, rate, tokens): (Fields, Fields, Fields, HashMap<String, u64>) =
                redis::pipe()
                    .cmd("HGETALL")
                    .arg(key("users", &platform))
                    .cmd("HGETALL")
                    .arg(key("codes", &platform))
                    .cmd("HGETALL")
                    .arg(key("rate", &platform))
                    .cmd("HGETALL")
                    .arg(format!("{}:{day}", key("tokens", &platform)))
                    .query(c)?;
            let mut st = PlatformState::default();
            for (user, v) in users {
                if v == "allow" {
                    st.approved.insert(user);
                } else {
                    st.denied.insert(user);
                }
            }
            let mut stale = Vec::new();
            for (code, v) in codes {
                match v.split_once(' ').map(|(e, u)| (e.parse::<u64>(), u)) {
                    Some((Ok(expires_ms), user)) if expires_ms > now_ms => {
                        st.pending.push(Pending {
                            code,
                            user: user.to_owned(),
                            expires_ms,
                        })
                    }
                    _ => stale.push(code),
                }
            }
            if !stale.is_empty() {
                redis::cmd("HDEL")
                    .arg(key("codes", &platform))
                    .arg(&stale)
                    .query::<()>(c)?;
            }
            let mut old = Vec::new();
            for (user, v) in rate {
                let parsed = v
                    .split_once(' ')
                    .map(|(t, a)| (t.parse::<f64>(), a.parse::<u64>()));
                match parsed {
                    Some((Ok(tokens), Ok(at_ms))) if at_ms.saturating_add(DAY_MS) > now_ms => {
                        st.buckets.insert(
                            user,
                            Bucket {
                                tokens,
                                at_ms,
                                taken: 0,
                            },
                        );
                    }
                    _ => old.push(user),
                }
            }
            if !old.is_empty() {
                redis::cmd("HDEL")
                    .arg(key("rate", &platform))
                    .arg(&old)
                    .query::<()>(c)?;
            }
            for (user, used) in tokens {
                st.tokens.insert(
                    user,
                    DayTokens {
                        day,
                        used,
                        unpushed: 0,
                    },
                );
            }
            st.trim();
            snap.platforms.insert(platform, st);
        }
        Ok(snap)
    }
}

impl SharedStore for RedisAccess {
    fn sync(&mut self, changes: &Changes, now_ms: u64) -> Result<Snapshot, String> {
        let r = self.push(changes, now_ms).and_then(|()| self.pull(now_ms));
        if r.is_err() {
            // The next call reconnects.
            self.con = None;
        }
        r.map_err(|e| e.to_string())
    }
}
