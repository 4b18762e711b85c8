//! The ownership pass's lease operations for many partitions in one round trip: with 64
//! partitions, one fsync'd round trip per lease made a loaded instance's renewals straggle
//! over seconds, so its leases expired seconds apart after a kill and the takeover waited
//! for the last of them.

use redis::Value;

use super::{Acquire, Keys, Lease, RedisStore, StoreError, malformed, strings};

impl RedisStore {
    /// Renews every lease of `leases` by one TTL, pipelined; each answer on its own (a
    /// fenced one hides none of the others). `Err` only when Redis could not be asked.
    pub fn renew_all(
        &mut self,
        leases: &[Lease],
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        let ttl = self.ttl_ms();
        let answers = self.pipelined("renew", leases.len(), |s, pipe| {
            for l in leases {
                pipe.add_command(s.evalsha(
                    &s.scripts.renew,
                    &[Keys::of(l.partition).k("lease")],
                    |c| {
                        c.arg(&l.token).arg(ttl);
                    },
                ));
            }
        })?;
        Ok(leases
            .iter()
            .zip(&answers)
            .map(|(l, v)| {
                refused(v, "renew")?;
                self.owned_verdict(v, l, "renew").map(|_| ())
            })
            .collect())
    }

    /// Tries to acquire every partition of `partitions`, pipelined; each answer on its own.
    pub fn acquire_all(
        &mut self,
        partitions: &[u32],
    ) -> Result<Vec<Result<Acquire, StoreError>>, StoreError> {
        let (instance, ttl) = (self.cfg.instance.clone(), self.ttl_ms());
        let answers = self.pipelined("acquire", partitions.len(), |s, pipe| {
            for p in partitions {
                let keys = Keys::of(*p);
                pipe.add_command(s.evalsha(
                    &s.scripts.acquire,
                    &[keys.k("lease"), keys.k("epoch")],
                    |c| {
                        c.arg(&instance).arg(ttl);
                    },
                ));
            }
        })?;
        Ok(partitions
            .iter()
            .zip(&answers)
            .map(|(p, v)| {
                refused(v, "acquire")?;
                acquire_verdict(*p, v)
            })
            .collect())
    }

    /// One pipeline of `n` commands built by `build`, each answered on its own, the answers
    /// checked for number; a flushed script cache (SCRIPT FLUSH, a failover) drops the
    /// connection so that the next one reloads the scripts.
    pub(super) fn pipelined(
        &mut self,
        what: &str,
        n: usize,
        build: impl FnOnce(&RedisStore, &mut redis::Pipeline),
    ) -> Result<Vec<Value>, StoreError> {
        if n == 0 {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        build(self, &mut pipe);
        let answers: Vec<Value> = self.with(what, |c, _| pipe.query(c))?;
        if answers.len() != n {
            return Err(malformed(what));
        }
        if answers
            .iter()
            .any(|v| matches!(v, Value::ServerError(e) if e.code() == "NOSCRIPT"))
        {
            self.con = None;
        }
        Ok(answers)
    }

    /// `EVALSHA` of `script` on `keys`, its arguments added by `args`.
    pub(super) fn evalsha(
        &self,
        script: &redis::Script,
        keys: &[String],
        args: impl FnOnce(&mut redis::Cmd),
    ) -> redis::Cmd {
        let mut c = redis::cmd("EVALSHA");
        c.arg(script.get_hash()).arg(keys.len()).arg(keys);
        args(&mut c);
        c
    }
}

/// A script's error answer (NOSCRIPT, OOM, a read-only replica): not applied.
pub(super) fn refused(v: &Value, what: &str) -> Result<(), StoreError> {
    match v {
        Value::ServerError(e) => Err(StoreError::transient(format!(
            "redis: {what}: {}",
            e.details().unwrap_or(e.code())
        ))),
        _ => Ok(()),
    }
}

/// The acquire script's answer for `partition`.
pub(super) fn acquire_verdict(partition: u32, v: &Value) -> Result<Acquire, StoreError> {
    let a = strings(v);
    match (a.first().map(String::as_str), a.get(1), a.get(2)) {
        (Some("acquired"), Some(token), Some(epoch)) => Ok(Acquire::Acquired(Lease {
            partition,
            token: token.clone(),
            epoch: epoch.parse().map_err(|_| malformed("acquire"))?,
        })),
        (Some("taken"), Some(holder), _) => Ok(Acquire::Taken {
            holder: holder.clone(),
        }),
        _ => Err(malformed("acquire")),
    }
}
