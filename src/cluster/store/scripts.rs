//! The Lua scripts of the Redis store, one per operation (docs/cluster.md, "The scripts"):
//! each runs atomically in Redis and touches the keys of one partition only, but for the
//! cluster-wide `ids` index of accept and finish (the partition of the message's id).
//!
//! The per-message operations (accept, started, outcome, finish) are the bodies of one
//! script, [`batch_source`]: a journal batch's operations of one partition go to Redis as one
//! call of it, each operation with its own KEYS and ARGV as the body reads them, answered on
//! its own. Every `EVALSHA` costs Redis a few microseconds before its first command (the
//! call, its arguments' tables, its reply, its write's `MULTI`/`EXEC` in the AOF), and every
//! message made four of them.

use redis::Script;

pub(super) struct Scripts {
    pub(super) batch: Script,
    pub(super) acquire: Script,
    pub(super) renew: Script,
    pub(super) release: Script,
    pub(super) load: Script,
    pub(super) heartbeat: Script,
    pub(super) leave: Script,
}

/// The batch script: ARGV[1] is the number of operations n; then n headers of three (the
/// operation: `a` accept, `s` started, `o` outcome, `f` finish; its keys' count; its
/// arguments' count); then every operation's arguments in order. KEYS are every operation's
/// keys in order. Answers one reply per operation, in order; an operation that raises an
/// error (a key of another type) answers `{'error', message}` and the others go on, as
/// separate calls did. The lease of a partition is read once per call (`lease`): the call is
/// atomic, and no operation changes a lease.
pub(super) fn batch_source() -> String {
    format!(
        r"
local leases = {{}}
local function lease(k)
  local l = leases[k]
  if l == nil then
    l = redis.call('GET', k) or false
    leases[k] = l
  end
  return l or nil
end
local function accept(KEYS, ARGV)
{ACCEPT}
end
local function started(KEYS, ARGV)
{STARTED}
end
local function outcome(KEYS, ARGV)
{OUTCOME}
end
local function finish(KEYS, ARGV)
{FINISH}
end
local run = {{a = accept, s = started, o = outcome, f = finish}}
local n = tonumber(ARGV[1])
local out, k, a = {{}}, 1, 2 + 3 * n
for i = 1, n do
  local h = 2 + 3 * (i - 1)
  local nk, na = tonumber(ARGV[h + 1]), tonumber(ARGV[h + 2])
  local ok, r = pcall(run[ARGV[h]], {{unpack(KEYS, k, k + nk - 1)}}, {{unpack(ARGV, a, a + na - 1)}})
  if ok then
    out[i] = r
  elseif type(r) == 'table' and r.err then
    out[i] = {{'error', r.err}}
  else
    out[i] = {{'error', tostring(r)}}
  end
  k, a = k + nk, a + na
end
return out
",
        OUTCOME = super::history::OUTCOME
    )
}

/// KEYS: seq, q, dedupx, sessions, inbox, generation, ids (the id's partition's
/// cluster-wide index, [`ids_key`](super::ids_key)). ARGV: message key prefix, dedup
/// member, now, until, session, cap, stream maxlen, prune count, origin, generation, the
/// highest seq the caller has seen, prune cadence, then field/value pairs. Expired ids are
/// pruned by one accept in `cadence` (the partition's count a multiple of it), up to `prune
/// count` of each set: the same pace as a few on each accept, two `ZRANGEBYSCORE`s less on
/// the others. A partition whose generation is
/// not the caller's (its data lost or replaced) or whose count is below what the caller has
/// seen (an older copy of it) accepts nothing and answers what it has.
/// The `ids` index scores an in-flight id `+inf` (it stays a duplicate however long it
/// waits) and a finished one by its window's end; `dedupx` holds the partition's finished
/// ones only (its in-flight ids are its messages, which a load reads whole; older versions
/// scored them `+inf` there too, still found). A new message's answer carries its seq and the
/// session's messages already in flight (its `position` in the ack).
/// Every `redis.call` costs Redis a microsecond or two, for every message of every instance:
/// the generation and the count come in one `MGET`, the expired ids go in one `ZREM` each
/// (docs/cluster.md, "The scripts").
/// A body of [`batch_source`] (so is every per-message script).
pub(super) const ACCEPT: &str = r"
local gc = redis.call('MGET', KEYS[6], KEYS[1])
local g = gc[1]
if g ~= ARGV[10] then return {'generation', g or ''} end
local cur = tonumber(gc[2] or '0')
if cur < tonumber(ARGV[11]) then return {'older', tostring(cur)} end
local now = tonumber(ARGV[3])
if cur % tonumber(ARGV[12]) == 0 then
  for _, k in ipairs({KEYS[3], KEYS[7]}) do
    local old = redis.call('ZRANGEBYSCORE', k, '-inf', now, 'LIMIT', 0, tonumber(ARGV[8]))
    if old[1] then redis.call('ZREM', k, unpack(old)) end
  end
end
local s = redis.call('ZSCORE', KEYS[3], ARGV[2])
if s and tonumber(s) > now then return {'duplicate'} end
local si = redis.call('ZSCORE', KEYS[7], ARGV[2])
if si and tonumber(si) > now then return {'duplicate'} end
-- Counted first and taken back when over the cap: one command less on every accept.
local n = redis.call('HINCRBY', KEYS[4], ARGV[5], 1) - 1
if n >= tonumber(ARGV[6]) then
  redis.call('HINCRBY', KEYS[4], ARGV[5], -1)
  return {'full'}
end
local seq = redis.call('INCR', KEYS[1])
local m = ARGV[1] .. seq
redis.call('HSET', m, 'du', ARGV[4], 'st', '0', 's', ARGV[5], 'o', ARGV[9], 'ix', KEYS[7], unpack(ARGV, 13))
redis.call('ZADD', KEYS[2], seq, seq)
redis.call('ZADD', KEYS[7], '+inf', ARGV[2])
redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[7], '*', 'seq', seq, 'origin', ARGV[9])
return {'new', tostring(seq), tostring(n)}
";

/// KEYS: lease. ARGV: token, message key, attempt. Fenced unless the lease is the token.
/// Every stored message has `st` (the accept script writes it), so an `HSET` that adds the
/// field made the hash: the message had left the store, and the hash goes again (one
/// command on the usual path instead of an `EXISTS` before it).
pub(super) const STARTED: &str = r"
local l = lease(KEYS[1])
if l ~= ARGV[1] then return {'fenced', l or ''} end
if redis.call('HSET', ARGV[2], 'st', ARGV[3]) == 1 then
  redis.call('DEL', ARGV[2])
  return {'gone'}
end
return {'ok'}
";

// OUTCOME: in `history.rs`, beside the conversation it writes with the outcome.

/// KEYS: q, dedupx, sessions. ARGV: message key, seq, now, forget (1: the id leaves the
/// duplicate window too). Delivered (0) or forgotten (1): the message leaves the store.
/// The id's cluster-wide index (`ix`, named by the message) follows `dedupx`.
pub(super) const FINISH: &str = r"
local m = redis.call('HMGET', ARGV[1], 'p', 'i', 's', 'du', 'ix')
if not m[1] then return {'gone'} end
local d = m[1] .. '\n' .. m[2]
redis.call('DEL', ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[2])
if m[3] then
  local n = redis.call('HINCRBY', KEYS[3], m[3], -1)
  if n <= 0 then redis.call('HDEL', KEYS[3], m[3]) end
end
if ARGV[4] == '0' and tonumber(m[4] or '0') > tonumber(ARGV[3]) then
  redis.call('ZADD', KEYS[2], m[4], d)
  if m[5] then redis.call('ZADD', m[5], m[4], d) end
else
  redis.call('ZREM', KEYS[2], d)
  if m[5] then redis.call('ZREM', m[5], d) end
end
return {'ok'}
";

/// KEYS: lease, epoch. ARGV: instance, ttl ms. Never hands back a held lease, even to an
/// instance of the same name: a restarted process must load the partition again.
pub(super) const ACQUIRE: &str = r"
local l = redis.call('GET', KEYS[1])
if l then return {'taken', l} end
local e = redis.call('INCR', KEYS[2])
local t = ARGV[1] .. ':' .. e
redis.call('SET', KEYS[1], t, 'PX', ARGV[2])
return {'acquired', t, tostring(e)}
";

/// KEYS: lease. ARGV: token, ttl ms.
pub(super) const RENEW: &str = r"
local l = redis.call('GET', KEYS[1])
if l ~= ARGV[1] then return {'fenced', l or ''} end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {'ok'}
";

/// KEYS: lease. ARGV: token.
pub(super) const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) return 1 end
return 0
";

/// KEYS: seq, q, dedupx, inbox. ARGV: message key prefix, now. One atomic snapshot: the
/// messages in flight, the live window, the highest seq and the inbox's last id.
pub(super) const LOAD: &str = r"
local seqs = redis.call('ZRANGE', KEYS[2], 0, -1)
local msgs = {}
for _, s in ipairs(seqs) do
  msgs[#msgs + 1] = {s, redis.call('HGETALL', ARGV[1] .. s)}
end
local last = redis.call('XREVRANGE', KEYS[4], '+', '-', 'COUNT', 1)
local lastid = '0-0'
if last[1] then lastid = last[1][1] end
local live = redis.call('ZRANGEBYSCORE', KEYS[3], '(' .. ARGV[2], '+inf', 'WITHSCORES')
return {redis.call('GET', KEYS[1]) or '0', lastid, msgs, live}
";

/// KEYS: instances, the instance's claim. ARGV: instance, ttl ms, claim ('' when this store
/// claimed nothing). Registers the instance until now + ttl (Redis's clock: instances need
/// not agree on theirs), renews its claim, drops the expired ones, counts the live; answers
/// the count and the claim's other holder (empty unless a second process holds this id:
/// then nothing is registered or renewed for this one).
pub(super) const HEARTBEAT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local other = ''
if ARGV[3] ~= '' then
  local h = redis.call('GET', KEYS[2])
  if h and h ~= ARGV[3] then
    other = h
  else
    redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2])
  end
end
if other == '' then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return {redis.call('ZCARD', KEYS[1]), other}
";

/// KEYS: instances, the instance's claim. ARGV: instance, claim. A graceful stop leaves the
/// registry at once, and gives the id up if this process holds it.
pub(super) const LEAVE: &str = r"
if ARGV[2] ~= '' and redis.call('GET', KEYS[2]) == ARGV[2] then
  redis.call('DEL', KEYS[2])
end
return redis.call('ZREM', KEYS[1], ARGV[1])
";
