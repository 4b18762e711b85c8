//! The partitioned store on Redis (`--cluster`, feature `cluster`): the design is
//! docs/cluster.md. Sessions map to partitions ([`partition_of`]); every key of a partition
//! carries it as a hash tag (`ts:{p17}:…`) and every script touches one partition only (but
//! for the duplicate index of the id's own partition, [`ids_key`]), so a later Redis Cluster
//! can spread partitions over primaries.
//!
//! The client is blocking: it runs on the journal thread, never on the reactor. Each
//! operation is one Lua script, atomic in Redis; with `appendfsync always` (checked by
//! [`RedisStore::connect`]) its writes are on disk before Redis answers. The owner's writes
//! (`started`, outcome) check the partition's lease first and fail
//! [`StoreErrorKind::Fenced`](crate::journal::StoreErrorKind::Fenced) without changing anything when
//! the caller no longer holds it.

mod batch;
mod generation;
mod hello;
mod history;
mod leases;
mod load;
mod read;
mod registry;
mod replicas;
mod scripts;

pub use hello::{FWD_MAXLEN, FwdEntry};
#[cfg_attr(not(feature = "cli"), allow(unused_imports))]
pub(crate) use history::{export_history, history_loader};
pub(crate) use load::{Fetched, Want};
pub(crate) use registry::default_instance_id;

use std::collections::HashMap;
use std::time::Duration;

use redis::{Script, Value};

use crate::journal::{Recovered, StoreError, StoredMessage, StoredOutcome};
use history::Histories;
use scripts::{ACQUIRE, HEARTBEAT, LEAVE, LOAD, RELEASE, RENEW, Scripts, batch_source};

/// The key prefix of every key the store writes.
const PREFIX: &str = "ts";
/// Entries kept in a partition's inbox and outcome streams (`XADD … MAXLEN ~`): a reader
/// that falls further behind reloads the partition, which holds everything the streams say.
const STREAM_MAXLEN: u32 = 10_000;
/// Expired duplicate-window ids one accept in [`PRUNE_EVERY`] prunes from each of its two
/// sets (bounds the script's work; 64 an accept on average, as many as it adds at most).
const PRUNE_PER_ACCEPT: u32 = 1024;
/// The accepts of a partition of which one prunes: the one whose count before it is a
/// multiple of this.
const PRUNE_EVERY: u32 = 16;

/// `url` without its user information (`redis://***@host:port`): secrets never reach logs.
fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let end = rest.find('/').unwrap_or(rest.len());
    match rest[..end].rfind('@') {
        Some(at) => format!("{scheme}://***{}", &rest[at..]),
        None => url.to_owned(),
    }
}

/// The partition of a session: FNV-1a (64 bits) of the session key, modulo `partitions`.
/// Fixed forever: instances of different versions must agree on it.
pub fn partition_of(session: &str, partitions: u32) -> u32 {
    debug_assert!(partitions > 0);
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in session.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h % u64::from(partitions.max(1))) as u32
}

/// [`ClusterConfig::drain`]'s default.
pub(crate) const DEFAULT_DRAIN: Duration = Duration::from_secs(30);

/// How an instance joins the cluster.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// `redis://HOST:PORT[/DB]`.
    pub url: String,
    /// This instance's name in leases (`<instance>:<epoch>`); unique among live instances.
    pub instance: String,
    /// Partitions of the key space; fixed for the life of the Redis database.
    pub partitions: u32,
    /// A lease's time to live.
    pub lease: Duration,
    /// The fence margin (`--max-clock-skew-ms`; `None`: a tenth of the lease): the most an
    /// instance's clock may run behind Redis's over one lease, plus the time a turn takes
    /// to stop. An owner stops a partition's turns at `lease − margin` after its last
    /// successful renewal was sent, and a new owner starts none until `margin` after its
    /// acquisition (docs/cluster.md, "Self-fencing"). Below a third of the lease.
    pub max_clock_skew: Option<Duration>,
    /// Accept a Redis whose `appendfsync` is not `always` (an ack may then precede the
    /// fsync: a Redis crash can lose acknowledged messages).
    pub allow_lazy_fsync: bool,
    /// Connect, read and write timeout of one round trip.
    pub timeout: Duration,
    /// Longest drain of a partition released to another instance (the fair share shrank):
    /// its running turns get this long to end before it is given up as if lost (they are
    /// then failed `interrupted by restart` by the next owner). Default 30 s.
    pub drain: Duration,
    /// Whether an instance gives up what it holds beyond its fair share (drained first) when
    /// another joins (`--cluster-rebalance`). On by default; off, a joining instance takes
    /// only partitions that come free (a dead or stopped instance's).
    pub rebalance: bool,
    /// Replicas that must confirm each batch of writes (`WAIT`) before it counts as written
    /// (`--cluster-min-replicas`); 0: the primary's fsync alone. A batch they do not confirm
    /// within half of [`ClusterConfig::timeout`] or a sixth of the lease fails transiently (its accepts are
    /// rejected, its other records tried again).
    pub min_replicas: u32,
}

impl ClusterConfig {
    /// The URL as logs and errors may show it: a password (`redis://user:secret@host`) is
    /// replaced by `***`.
    pub fn shown_url(&self) -> String {
        redact_url(&self.url)
    }

    /// The defaults of `serve --cluster URL`: 64 partitions, a 3 s lease.
    pub fn new(url: impl Into<String>, instance: impl Into<String>) -> ClusterConfig {
        ClusterConfig {
            url: url.into(),
            instance: instance.into(),
            partitions: 64,
            lease: Duration::from_millis(3000),
            max_clock_skew: None,
            allow_lazy_fsync: false,
            timeout: Duration::from_secs(2),
            drain: DEFAULT_DRAIN,
            rebalance: true,
            min_replicas: 0,
        }
    }
}

/// A partition's lease as this instance holds it: the token every owned write presents.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    /// The partition.
    pub partition: u32,
    /// `<instance>:<epoch>`, as stored in Redis.
    pub token: String,
    /// The epoch: increases with every acquisition of the partition.
    pub epoch: u64,
}

/// What [`RedisStore::accept`] did with a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Accept {
    /// Durable, numbered `seq` in its partition.
    New {
        /// The partition's number for it.
        seq: u64,
        /// Its session's messages in flight across the cluster before it (its ack's
        /// `position`).
        ahead: usize,
    },
    /// Its `(platform, id)` is in the partition's duplicate window (cluster-wide).
    Duplicate,
    /// Its session has `cap` messages in flight across the cluster.
    SessionFull,
}

/// One write of [`RedisStore::write`]: what the journal's records become in a partitioned
/// store.
#[derive(Clone, Copy, Debug)]
pub enum Op<'a> {
    /// A message accepted by this instance (any partition).
    Accept {
        /// Its partition.
        partition: u32,
        /// Its session key (the cluster-wide cap counts per session).
        session: &'a str,
        /// The message.
        message: &'a StoredMessage,
        /// Most messages of the session in flight.
        session_cap: usize,
    },
    /// The owner started the message's turn (fenced).
    Started {
        /// The partition's lease as the owner holds it.
        lease: &'a Lease,
        /// The message.
        seq: u64,
        /// Starts so far.
        attempt: u32,
    },
    /// The owner's terminal outcome (fenced).
    Outcome {
        /// The partition's lease as the owner holds it.
        lease: &'a Lease,
        /// The message.
        seq: u64,
        /// The line.
        outcome: &'a StoredOutcome,
    },
    /// A bridge has the outcome (any instance).
    Delivered {
        /// The partition.
        partition: u32,
        /// The message.
        seq: u64,
    },
    /// Refused after it was accepted (any instance).
    Forget {
        /// The partition.
        partition: u32,
        /// The message.
        seq: u64,
    },
}

/// One operation's answer in [`RedisStore::write`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Done {
    /// An accept's verdict.
    Accepted(Accept),
    /// Any other write: false if the message had already left the store.
    Written(bool),
}

/// What [`RedisStore::acquire`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Acquire {
    /// The partition is this instance's until the lease runs out.
    Acquired(Lease),
    /// Another token holds it (possibly an earlier life of this instance).
    Taken {
        /// The holder's token.
        holder: String,
    },
}

/// One partition as its new owner loads it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadedPartition {
    /// The messages in flight in seq order, the live duplicate window, the partition's
    /// highest seq: the same shape as a single instance's start-up recovery.
    pub recovered: Recovered,
    /// The instance that accepted each message (where its result goes first).
    pub origins: HashMap<u64, String>,
    /// The inbox stream's last entry when the load ran (read new messages after it).
    pub inbox_after: String,
}

/// The Redis store: one connection, the scripts, the instance's name.
pub struct RedisStore {
    client: redis::Client,
    /// None after a failure: the next call reconnects.
    con: Option<redis::Connection>,
    cfg: ClusterConfig,
    scripts: Scripts,
    /// This process's claim on the instance id ([`RedisStore::claim_instance`]), renewed by
    /// each heartbeat; `None` on a store that did not claim it (the reader's, a probe's).
    claim: Option<registry::Claim>,
    /// The cluster generation this instance joined (`generation.rs`); every accept presents it.
    generation: String,
    /// Why Redis is no longer trusted, once found (sticky).
    distrust: Option<String>,
    /// The highest seq this store has seen of each partition (its accepts, its loads): a
    /// partition whose count is below it is an older copy (`generation.rs`).
    marks: HashMap<u32, u64>,
    /// The openai agent's stored conversations: bounds and figures (`history.rs`).
    histories: Histories,
}

/// Which of a partition's streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    /// `ts:{pN}:in`: one entry per accepted message (`seq`); the owner queues them.
    Inbox,
    /// `ts:{pN}:out`: one entry per outcome (`seq`, `origin`); the origin instance sends it.
    Outcomes,
}

/// One stream entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamEntry {
    /// The partition whose stream it is.
    pub partition: u32,
    /// The entry's id (read on after it).
    pub id: String,
    /// The message.
    pub seq: u64,
    /// The instance that accepted it (empty in an inbox entry written before the inbox
    /// carried it).
    pub origin: String,
    /// In an outcome entry, the instance that wrote the outcome (empty in an inbox entry,
    /// and in an outcome entry written before the stream carried it).
    pub by: String,
}

/// The keys of one partition.
struct Keys(String);

impl Keys {
    fn of(p: u32) -> Keys {
        Keys(format!("{PREFIX}:{{p{p}}}:"))
    }
    fn k(&self, what: &str) -> String {
        format!("{}{what}", self.0)
    }
    fn message(&self, seq: u64) -> String {
        format!("{}m:{seq}", self.0)
    }
}

fn dedup_member(platform: &str, id: &str) -> String {
    format!("{platform}\n{id}")
}

/// The cluster-wide index of `(platform, id)` in the duplicate window: a sorted set in the
/// partition of the id itself (not of its session), so that an id re-sent with another chat
/// is found whatever partition its session falls in.
pub(super) fn ids_key(member: &str, partitions: u32) -> String {
    Keys::of(partition_of(member, partitions)).k("ids")
}

fn transient(what: &str, e: &redis::RedisError) -> StoreError {
    StoreError::transient(format!("redis: {what}: {e}"))
}

/// A script's answer as strings (its first is the verdict).
fn strings(v: &Value) -> Vec<String> {
    match v {
        Value::Array(items) => items.iter().filter_map(text).collect(),
        other => text(other).into_iter().collect(),
    }
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        Value::Okay => Some("OK".into()),
        _ => None,
    }
}

fn bytes(v: &Value) -> Option<Vec<u8>> {
    match v {
        Value::BulkString(b) => Some(b.clone()),
        Value::SimpleString(s) => Some(s.clone().into_bytes()),
        _ => None,
    }
}

fn malformed(what: &str) -> StoreError {
    StoreError::untrusted(format!("redis: {what}: an answer of an unexpected shape"))
}

impl RedisStore {
    /// Connects, checks that Redis syncs every write before answering (`appendfsync
    /// always`, unless `allow_lazy_fsync`), and that the database's partition count (set
    /// by the first instance) is `cfg.partitions`. A Redis that cannot be reached is
    /// [`Transient`](crate::journal::StoreErrorKind::Transient); one that would ack before fsync,
    /// or of another partition count, is [`Unusable`](crate::journal::StoreErrorKind::Unusable).
    pub fn connect(cfg: ClusterConfig) -> Result<RedisStore, StoreError> {
        if cfg.partitions == 0 {
            return Err(StoreError::unusable("--partitions must be at least 1"));
        }
        let client = redis::Client::open(cfg.url.as_str()).map_err(|e| {
            StoreError::unusable(format!(
                "redis: the URL {:?} is not usable: {e}",
                cfg.shown_url()
            ))
        })?;
        let mut store = RedisStore {
            client,
            con: None,
            cfg,
            scripts: Scripts {
                batch: Script::new(&batch_source()),
                acquire: Script::new(ACQUIRE),
                renew: Script::new(RENEW),
                release: Script::new(RELEASE),
                load: Script::new(LOAD),
                heartbeat: Script::new(HEARTBEAT),
                leave: Script::new(LEAVE),
            },
            claim: None,
            generation: String::new(),
            distrust: None,
            marks: HashMap::new(),
            histories: Histories::default(),
        };
        store.check_auth()?;
        store.check_fsync()?;
        store.check_partitions()?;
        store.check_generation()?;
        Ok(store)
    }

    /// This instance's name.
    pub fn instance(&self) -> &str {
        &self.cfg.instance
    }

    /// The partition count.
    pub fn partitions(&self) -> u32 {
        self.cfg.partitions
    }

    /// A lease's time to live.
    pub fn lease(&self) -> Duration {
        self.cfg.lease
    }

    /// The fence margin ([`ClusterConfig::max_clock_skew`], a tenth of the lease unless set).
    pub fn fence_margin(&self) -> Duration {
        (self.cfg.max_clock_skew)
            .unwrap_or_else(|| super::ownership::default_margin(self.cfg.lease))
    }

    /// The longest drain of a released partition ([`ClusterConfig::drain`]).
    pub fn drain(&self) -> Duration {
        self.cfg.drain
    }

    /// Whether the surplus over the fair share is drained and released
    /// ([`ClusterConfig::rebalance`]).
    pub fn rebalance(&self) -> bool {
        self.cfg.rebalance
    }

    fn con(&mut self) -> Result<&mut redis::Connection, StoreError> {
        if self.con.is_none() {
            let t = self.cfg.timeout;
            let c = self
                .client
                .get_connection_with_timeout(t)
                .map_err(|e| transient("connect", &e))?;
            let mut c = c;
            c.set_read_timeout(Some(t))
                .and_then(|()| c.set_write_timeout(Some(t)))
                .map_err(|e| transient("set timeouts", &e))?;
            // The pipelined writes and lease passes call the scripts by hash only: load them on every new
            // connection (a restarted Redis has an empty script cache).
            let s = &self.scripts;
            for script in [&s.batch, &s.renew, &s.acquire] {
                script
                    .load(&mut c)
                    .map_err(|e| transient("SCRIPT LOAD", &e))?;
            }
            self.con = Some(c);
        }
        self.con
            .as_mut()
            .ok_or_else(|| StoreError::transient("redis: no connection"))
    }

    /// Runs `f` on the connection; a failure drops it (the next call reconnects).
    fn with<T>(
        &mut self,
        what: &str,
        f: impl FnOnce(&mut redis::Connection, &Scripts) -> redis::RedisResult<T>,
    ) -> Result<T, StoreError> {
        self.con()?;
        let (con, scripts) = match (&mut self.con, &self.scripts) {
            (Some(c), s) => (c, s),
            (None, _) => return Err(StoreError::transient("redis: no connection")),
        };
        match f(con, scripts) {
            Ok(v) => Ok(v),
            Err(e) => {
                self.con = None;
                Err(transient(what, &e))
            }
        }
    }

    /// A password Redis refuses (or one it needs and was not given) is the configuration's
    /// to fix: unusable (exit 2), where an unreachable Redis is transient (exit 1). Any other
    /// failure is left to the checks after.
    fn check_auth(&mut self) -> Result<(), StoreError> {
        let probe = self
            .client
            .get_connection_with_timeout(self.cfg.timeout)
            .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c));
        match probe {
            Err(e)
                if e.kind() == redis::ErrorKind::AuthenticationFailed
                    || matches!(e.code(), Some("NOAUTH" | "WRONGPASS" | "NOPERM")) =>
            {
                Err(StoreError::unusable(format!(
                    "redis {}: authentication refused ({e}): check the password (the `cluster` URL of the --config file)",
                    self.cfg.shown_url()
                )))
            }
            _ => Ok(()),
        }
    }

    fn check_fsync(&mut self) -> Result<(), StoreError> {
        let got: Result<Vec<String>, StoreError> = self.with("CONFIG GET appendfsync", |c, _| {
            redis::cmd("CONFIG").arg("GET").arg("appendfsync").query(c)
        });
        let setting = match got {
            Ok(v) => v.get(1).cloned(),
            // A Redis that refuses CONFIG (renamed on managed services) cannot prove it syncs.
            Err(e) if e.message.contains("ERR") => None,
            Err(e) => return Err(e),
        };
        let aof: Option<Vec<String>> = self
            .with("CONFIG GET appendonly", |c, _| {
                redis::cmd("CONFIG").arg("GET").arg("appendonly").query(c)
            })
            .ok();
        let aof_on = aof.as_ref().and_then(|v| v.get(1)).map(String::as_str) == Some("yes");
        if setting.as_deref() == Some("always") && aof_on {
            return Ok(());
        }
        let seen = format!(
            "appendonly {}, appendfsync {}",
            aof.as_ref()
                .and_then(|v| v.get(1))
                .map_or("unknown", String::as_str),
            setting.as_deref().unwrap_or("unknown")
        );
        if self.cfg.allow_lazy_fsync {
            log::warn!(
                "redis {}: {seen}: an ack may precede the fsync (--cluster-allow-lazy-fsync): a Redis crash can lose acknowledged messages",
                self.cfg.shown_url()
            );
            return Ok(());
        }
        Err(StoreError::unusable(format!(
            "redis {}: {seen}; acknowledged messages must be on disk before the ack: configure `appendonly yes` and `appendfsync always`, or pass --cluster-allow-lazy-fsync to accept the loss",
            self.cfg.shown_url()
        )))
    }

    fn check_partitions(&mut self) -> Result<(), StoreError> {
        let n = self.cfg.partitions;
        let key = format!("{PREFIX}:partitions");
        let (_, got): (Value, Option<u32>) = self.with("partitions", |c, _| {
            redis::pipe()
                .cmd("SET")
                .arg(&key)
                .arg(n)
                .arg("NX")
                .cmd("GET")
                .arg(&key)
                .query(c)
        })?;
        match got {
            Some(g) if g == n => Ok(()),
            Some(g) => Err(StoreError::unusable(format!(
                "redis {}: the cluster has {g} partitions, this instance was given --partitions {n}",
                self.cfg.shown_url()
            ))),
            None => Err(malformed("partitions")),
        }
    }

    /// Accepts a message for `partition` on behalf of any instance: cluster-wide dedup by
    /// `(platform, id)`, at most `session_cap` messages in flight for `session`; durable
    /// when it returns [`Accept::New`]. `message.seq` is ignored (the partition numbers it);
    /// `now_ms` is the wall clock (expires the window's ids).
    pub fn accept(
        &mut self,
        partition: u32,
        session: &str,
        message: &StoredMessage,
        session_cap: usize,
        now_ms: u64,
    ) -> Result<Accept, StoreError> {
        let op = Op::Accept {
            partition,
            session,
            message,
            session_cap,
        };
        match self.one(op, now_ms)? {
            Done::Accepted(a) => Ok(a),
            Done::Written(_) => Err(malformed("accept")),
        }
    }

    /// Tries to take `partition` for this instance for one lease.
    pub fn acquire(&mut self, partition: u32) -> Result<Acquire, StoreError> {
        let keys = Keys::of(partition);
        let (instance, ttl) = (self.cfg.instance.clone(), self.ttl_ms());
        let v: Value = self.with("acquire", |c, s| {
            s.acquire
                .key(keys.k("lease"))
                .key(keys.k("epoch"))
                .arg(&instance)
                .arg(ttl)
                .invoke(c)
        })?;
        leases::acquire_verdict(partition, &v)
    }

    /// Extends `lease` by one TTL; [`Fenced`](crate::journal::StoreErrorKind::Fenced) if it was lost.
    pub fn renew(&mut self, lease: &Lease) -> Result<(), StoreError> {
        let keys = Keys::of(lease.partition);
        let ttl = self.ttl_ms();
        let v: Value = self.with("renew", |c, s| {
            s.renew
                .key(keys.k("lease"))
                .arg(&lease.token)
                .arg(ttl)
                .invoke(c)
        })?;
        self.owned_verdict(&v, lease, "renew").map(|_| ())
    }

    /// Gives `lease` up (another instance may take the partition at once); false if it was
    /// no longer held.
    pub fn release(&mut self, lease: &Lease) -> Result<bool, StoreError> {
        let keys = Keys::of(lease.partition);
        let n: i64 = self.with("release", |c, s| {
            s.release.key(keys.k("lease")).arg(&lease.token).invoke(c)
        })?;
        Ok(n == 1)
    }

    /// The owner records that the turn of `seq` started (attempt `attempt`); fenced unless
    /// `lease` is still the partition's. False if the message has left the store.
    pub fn started(&mut self, lease: &Lease, seq: u64, attempt: u32) -> Result<bool, StoreError> {
        self.written(Op::Started {
            lease,
            seq,
            attempt,
        })
    }

    /// The owner records the terminal outcome of `seq` and publishes it on the partition's
    /// outcome stream; fenced unless `lease` is still the partition's. Writing it again
    /// changes nothing. False if the message has left the store.
    pub fn outcome(
        &mut self,
        lease: &Lease,
        seq: u64,
        outcome: &StoredOutcome,
    ) -> Result<bool, StoreError> {
        self.written(Op::Outcome {
            lease,
            seq,
            outcome,
        })
    }

    /// A bridge has the outcome of `seq`: the message leaves the store cluster-wide (its id
    /// stays a duplicate until its window ends). Any instance may write it. False if it had
    /// already left.
    pub fn delivered(&mut self, partition: u32, seq: u64, now_ms: u64) -> Result<bool, StoreError> {
        match self.one(Op::Delivered { partition, seq }, now_ms)? {
            Done::Written(w) => Ok(w),
            Done::Accepted(_) => Err(malformed("delivered")),
        }
    }

    /// The runtime refused `seq` after it was accepted: it leaves the store and the
    /// duplicate window (the bridge was told `reject`, so a retry is new).
    pub fn forget(&mut self, partition: u32, seq: u64, now_ms: u64) -> Result<bool, StoreError> {
        match self.one(Op::Forget { partition, seq }, now_ms)? {
            Done::Written(w) => Ok(w),
            Done::Accepted(_) => Err(malformed("forget")),
        }
    }

    fn written(&mut self, op: Op<'_>) -> Result<bool, StoreError> {
        match self.one(op, 0)? {
            Done::Written(w) => Ok(w),
            Done::Accepted(_) => Err(malformed("write")),
        }
    }

    fn one(&mut self, op: Op<'_>, now_ms: u64) -> Result<Done, StoreError> {
        self.write(&[op], now_ms)?
            .pop()
            .unwrap_or_else(|| Err(malformed("write")))
    }

    fn ttl_ms(&self) -> u64 {
        self.cfg.lease.as_millis().max(1) as u64
    }

    /// `ok` → true, `gone` → false, `fenced` → the error (logged with the holder).
    fn owned_verdict(&self, v: &Value, lease: &Lease, what: &str) -> Result<bool, StoreError> {
        let a = strings(v);
        match a.first().map(String::as_str) {
            Some("ok" | "again") => Ok(true),
            Some("gone") => Ok(false),
            Some("fenced") => {
                let holder =
                    a.get(1).map_or(
                        "nobody",
                        |h| {
                            if h.is_empty() { "nobody" } else { h.as_str() }
                        },
                    );
                Err(StoreError::fenced(format!(
                    "partition {}: {what} refused: the lease is no longer {} (now held by {holder})",
                    lease.partition, lease.token
                )))
            }
            _ => Err(malformed(what)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::partition_of;

    #[test]
    fn a_password_in_the_url_never_shows() {
        use super::redact_url;
        assert_eq!(
            redact_url("redis://:s3cret@h:6379/2"),
            "redis://***@h:6379/2"
        );
        assert_eq!(redact_url("redis://u:p@ss@h:1"), "redis://***@h:1");
        assert_eq!(redact_url("redis://h:1/0"), "redis://h:1/0");
        assert_eq!(redact_url("unix:///tmp/r.sock"), "unix:///tmp/r.sock");
    }

    #[test]
    fn the_partition_of_a_session_is_fixed_and_spread() {
        // Fixed values: a change to the hash would split a running cluster's partitions.
        assert_eq!(partition_of("", 64), (0xcbf2_9ce4_8422_2325u64 % 64) as u32);
        assert_eq!(partition_of("telegram:dm:1", 1), 0);
        let n = 16;
        let mut seen = vec![0usize; n as usize];
        for i in 0..1600 {
            seen[partition_of(&format!("telegram:dm:{i}"), n) as usize] += 1;
        }
        assert!(seen.iter().all(|&c| c > 50), "{seen:?}");
    }
}
