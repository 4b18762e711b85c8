//! The registry of live instances (`ts:instances`) and each instance id's claim: one process
//! per `--instance-id`. Two processes with one id would each take the other's messages for
//! their own (an inbox entry whose origin is the owner itself is skipped), so the messages
//! one of them acks are never run; the second process is refused at start-up instead.

use std::time::{Duration, Instant};

use redis::Value;

use super::{PREFIX, RedisStore, StoreError, malformed, strings};

/// This process's claim on its instance id, as [`RedisStore`] keeps it.
pub(super) struct Claim {
    /// The claim's value: the host, the pid and a random part (two containers' pid 1 differ).
    holder: String,
    /// The other holder last seen by a heartbeat (logged once per change).
    lost_to: Option<String>,
}

/// The registry's key.
fn instances_key() -> String {
    format!("{PREFIX}:instances")
}

/// The claim's key of `instance`. Its hash tag is the registry's key, so that the heartbeat
/// script touches one hash slot (a key without braces hashes whole: `ts:instances` and
/// `{ts:instances}:…` share a slot).
fn claim_key(instance: &str) -> String {
    format!("{{{PREFIX}:instances}}:id:{instance}")
}

/// The machine's name (`localhost` if it has none that can be read).
fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname(2) writes at most `buf.len()` bytes into `buf`.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    match std::str::from_utf8(&buf[..end]) {
        Ok(name) if rc == 0 && !name.is_empty() => name.to_owned(),
        _ => "localhost".to_owned(),
    }
}

/// 32 random bits from the kernel (`getrandom(2)`); the clock's nanoseconds if it refuses.
fn random_u32() -> u32 {
    let mut buf = [0u8; 4];
    // SAFETY: getrandom(2) writes at most `buf.len()` bytes into `buf`.
    let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n == 4 {
        return u32::from_ne_bytes(buf);
    }
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos())
}

/// The default `--instance-id`: `hostname:pid:` and 8 random hex digits. The host and pid
/// alone repeat: in containers every gateway is pid 1, often on the same host name.
#[cfg_attr(not(feature = "cli"), allow(dead_code))] // `serve --cluster`'s default
pub(crate) fn default_instance_id() -> String {
    format!("{}:{}:{:08x}", hostname(), std::process::id(), random_u32())
}

impl RedisStore {
    /// Claims this instance's id for this process, renewed by every [`RedisStore::heartbeat`]
    /// after. A claim found held is waited for for one lease (a crashed process's, restarted
    /// at once, expires by then); one still held after that is renewed by a live process:
    /// refused, [`Unusable`](crate::journal::StoreErrorKind::Unusable), naming the id and its
    /// holder. `Err` transient when Redis could not be asked.
    pub fn claim_instance(&mut self) -> Result<(), StoreError> {
        let holder = format!(
            "pid {} on {} ({:08x})",
            std::process::id(),
            hostname(),
            random_u32()
        );
        let (key, ttl) = (claim_key(&self.cfg.instance), self.ttl_ms());
        // A holder alive renews within a third of the lease: past a whole one and a margin,
        // the claim still there is a live process's.
        let give_up = Instant::now() + self.cfg.lease + self.cfg.lease / 4;
        let mut told = false;
        loop {
            let (_, held): (Value, Option<String>) = self.with("claim", |c, _| {
                redis::pipe()
                    .cmd("SET")
                    .arg(&key)
                    .arg(&holder)
                    .arg("NX")
                    .arg("PX")
                    .arg(ttl)
                    .cmd("GET")
                    .arg(&key)
                    .query(c)
            })?;
            let other = match held {
                Some(h) if h == holder => {
                    self.claim = Some(Claim {
                        holder,
                        lost_to: None,
                    });
                    return Ok(());
                }
                Some(h) => h,
                // Expired between the two commands: claimed at the next try.
                None => "nobody".to_owned(),
            };
            if Instant::now() >= give_up {
                return Err(StoreError::unusable(format!(
                    "--instance-id {:?} is live in the cluster registry, held by {other} (renewed for longer than the {:?} lease): two processes with one id would each skip the other's messages; give each instance its own id (the default is unique)",
                    self.cfg.instance, self.cfg.lease
                )));
            }
            if !told {
                told = true;
                log::info!(
                    "--instance-id {:?} is held by {other}: waiting up to {:?} for it to expire (a process restarted after a crash)",
                    self.cfg.instance,
                    self.cfg.lease
                );
            }
            // A poll of Redis for the old holder's claim to expire: at start-up, on serve's
            // main thread before the reactor exists, bounded by `give_up` (1.25 leases, 3.75 s
            // at the default); it orders nothing in a test. A SIGTERM meanwhile is caught (the
            // server registered its signals) and acted on once the loop starts, so shutdown
            // waits at most this bound.
            std::thread::sleep((self.cfg.lease / 10).max(Duration::from_millis(10)));
        }
    }

    /// Registers this instance as live for one lease (and renews its claim) and answers how
    /// many are (itself included): the fair share's divisor. A claim another process holds
    /// now (this one was paused past its lease while a twin started) is an ERROR, logged
    /// once per holder; this instance is then not registered.
    pub fn heartbeat(&mut self) -> Result<u32, StoreError> {
        let (instance, ttl) = (self.cfg.instance.clone(), self.ttl_ms());
        let keys = [instances_key(), claim_key(&instance)];
        let holder = self
            .claim
            .as_ref()
            .map_or("", |c| c.holder.as_str())
            .to_owned();
        let v: Value = self.with("heartbeat", |c, s| {
            s.heartbeat
                .key(&keys[0])
                .key(&keys[1])
                .arg(&instance)
                .arg(ttl)
                .arg(&holder)
                .invoke(c)
        })?;
        let (n, other) = match &v {
            Value::Array(a) => (
                a.first().and_then(|n| match n {
                    Value::Int(n) => u32::try_from(*n).ok(),
                    _ => None,
                }),
                strings(&a.get(1).cloned().unwrap_or(Value::Nil)),
            ),
            _ => (None, Vec::new()),
        };
        let other = other.into_iter().next().filter(|o| !o.is_empty());
        if let Some(claim) = &mut self.claim
            && claim.lost_to != other
        {
            if let Some(o) = &other {
                log::error!(
                    "--instance-id {instance:?} is now held by {o}, a second process with this id: messages either acks may never run; stop one of them"
                );
            }
            claim.lost_to = other;
        }
        n.ok_or_else(|| malformed("heartbeat"))
    }

    /// The instances registered live now (by this host's clock: a heartbeat's expiry is
    /// Redis's, so a skew between the two shifts the answer by as much).
    pub fn live_instances(&mut self) -> Result<Vec<String>, StoreError> {
        let key = instances_key();
        let now = crate::journal::now_ms();
        self.with("instances", |c, _| {
            redis::cmd("ZRANGEBYSCORE")
                .arg(&key)
                .arg(now)
                .arg("+inf")
                .query(c)
        })
    }

    /// Leaves the registry (a graceful stop): the others' shares grow at their next pass,
    /// and the id is free for a new process at once.
    pub fn leave(&mut self) -> Result<(), StoreError> {
        let instance = self.cfg.instance.clone();
        let keys = [instances_key(), claim_key(&instance)];
        let holder = self
            .claim
            .as_ref()
            .map_or("", |c| c.holder.as_str())
            .to_owned();
        let _: i64 = self.with("leave", |c, s| {
            s.leave
                .key(&keys[0])
                .key(&keys[1])
                .arg(&instance)
                .arg(&holder)
                .invoke(c)
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_ids_of_one_host_and_pid_differ() {
        let (a, b) = (default_instance_id(), default_instance_id());
        assert_ne!(a, b);
        let prefix = format!("{}:{}:", hostname(), std::process::id());
        assert!(a.starts_with(&prefix), "{a}");
        assert_eq!(a.len(), prefix.len() + 8, "{a}");
    }

    #[test]
    fn the_claim_shares_the_registrys_hash_slot() {
        // Redis hashes the text between the first `{` and the next `}`, or the whole key.
        assert!(claim_key("gw-a").starts_with(&format!("{{{}}}", instances_key())));
    }
}
