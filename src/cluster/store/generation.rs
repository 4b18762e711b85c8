//! The cluster's generation and each partition's high-water mark: trust Redis or refuse. The first instance to find a database
//! without one names it (`ts:generation`, random) and writes it into every partition
//! (`ts:{pN}:gen`); every accept presents the generation its instance joined, and the
//! accept script refuses one that differs. A Redis that lost its data (FLUSHALL, a new
//! empty Redis on the same address, a failover to a replica that never had it) has no
//! generation, or another: the instance stops accepting instead of acking messages into a
//! database that has forgotten the ones before (the single-node journal's `journal.mark`
//! refuses the same way). Each store also keeps the highest seq it has seen of each
//! partition (its accepts, its loads): an accept, a load or a pass that finds a partition's
//! count below it meets an older copy (restarted from an older file, a failover to a replica
//! that lagged) and is refused the same way. The refusal is sticky for the process: an operator restarts the
//! instances, and the first to start names a new generation.

use redis::Value;

use super::{Keys, PREFIX, RedisStore, StoreError, malformed, strings};

/// The database's generation key (read at start-up and by every ownership pass).
fn generation_key() -> String {
    format!("{PREFIX}:generation")
}

/// 64 random bits in hex (the kernel's `getrandom(2)`, the clock's nanoseconds if it refuses).
fn new_generation() -> String {
    let mut buf = [0u8; 8];
    // SAFETY: getrandom(2) writes at most `buf.len()` bytes into `buf`.
    let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n != 8 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        buf = (nanos ^ u64::from(std::process::id()).rotate_left(32)).to_ne_bytes();
    }
    format!("{:016x}", u64::from_ne_bytes(buf))
}

impl RedisStore {
    /// At start-up: the database's generation, named now if it has none, and written into
    /// every partition that lacks it (a first instance that died half-way is completed).
    pub(super) fn check_generation(&mut self) -> Result<(), StoreError> {
        let key = generation_key();
        let candidate = new_generation();
        let (_, got): (Value, Option<String>) = self.with("generation", |c, _| {
            redis::pipe()
                .cmd("SET")
                .arg(&key)
                .arg(&candidate)
                .arg("NX")
                .cmd("GET")
                .arg(&key)
                .query(c)
        })?;
        let generation = got.ok_or_else(|| malformed("generation"))?;
        if generation == candidate {
            log::info!(
                "redis {}: a new cluster generation {generation} (the database had none)",
                self.cfg.shown_url()
            );
        }
        let n = self.cfg.partitions;
        let answers = self.pipelined("partition generations", n as usize, |_, pipe| {
            for p in 0..n {
                pipe.cmd("SET")
                    .arg(Keys::of(p).k("gen"))
                    .arg(&generation)
                    .arg("NX");
            }
        })?;
        if let Some(Value::ServerError(e)) =
            answers.iter().find(|v| matches!(v, Value::ServerError(_)))
        {
            return Err(StoreError::transient(format!(
                "redis: partition generations: {}",
                e.details().unwrap_or(e.code())
            )));
        }
        self.generation = generation;
        Ok(())
    }

    /// The generation this instance joined.
    pub fn generation(&self) -> &str {
        &self.generation
    }

    /// Why Redis is no longer trusted (its data lost or replaced), once found; never
    /// cleared for the life of the process.
    pub fn distrusted(&self) -> Option<&str> {
        self.distrust.as_deref()
    }

    /// Whether the database still has the generation this instance joined (each ownership
    /// pass asks, so that an idle instance notices too); a missing or other one is
    /// [`RedisStore::distrusted`] from now on.
    pub fn check_generation_holds(&mut self) -> Result<(), StoreError> {
        let key = generation_key();
        let marked: Vec<u32> = self.marks.keys().copied().collect();
        let (got, counts): (Option<String>, Vec<Option<u64>>) =
            self.with("generation", |c, _| {
                let got = redis::cmd("GET").arg(&key).query(c)?;
                if marked.is_empty() {
                    return Ok((got, Vec::new()));
                }
                let mut counts = redis::pipe();
                for p in &marked {
                    counts.cmd("GET").arg(Keys::of(*p).k("seq"));
                }
                Ok((got, counts.query(c)?))
            })?;
        if got.as_deref() != Some(self.generation.as_str()) {
            self.distrust_for(&key, got.as_deref());
            return Ok(());
        }
        for (p, count) in marked.into_iter().zip(counts) {
            let _ = self.note_count(p, count.unwrap_or(0));
        }
        Ok(())
    }

    /// An accept's answer `v` for partition `p`: a new seq raises the partition's mark;
    /// `generation` and `older` record the distrust.
    pub(super) fn note_accept_answer(&mut self, p: u32, v: &Value) {
        let a = strings(v);
        match (a.first().map(String::as_str), a.get(1)) {
            (Some("new"), Some(seq)) => {
                if let Ok(seq) = seq.parse::<u64>() {
                    let mark = self.marks.entry(p).or_insert(0);
                    *mark = (*mark).max(seq);
                }
            }
            (Some("generation"), found) => {
                let found = found.filter(|g| !g.is_empty()).cloned();
                self.distrust_for(&Keys::of(p).k("gen"), found.as_deref());
            }
            (Some("older"), Some(count)) => {
                let _ = self.note_count(p, count.parse().unwrap_or(0));
            }
            _ => {}
        }
    }

    /// Partition `p`'s count as Redis has it now (a load, a pass): below this store's mark,
    /// Redis is an older copy (distrusted, `Err`); else the mark follows it.
    pub(super) fn note_count(&mut self, p: u32, count: u64) -> Result<(), StoreError> {
        let mark = self.marks.entry(p).or_insert(0);
        if count >= *mark {
            *mark = count;
            return Ok(());
        }
        let seen = *mark;
        if self.distrust.is_none() {
            self.distrust = Some(format!(
                "redis {}: the cluster's data is older than this instance has seen (partition {p} counts {count} messages, this instance saw {seen}): a restart from an older file, or a failover to a replica that lagged; messages acknowledged since are lost, and no new one is accepted: restart the instances to go on from this data",
                self.cfg.shown_url()
            ));
        }
        Err(StoreError::untrusted(
            self.distrust.clone().unwrap_or_default(),
        ))
    }

    fn distrust_for(&mut self, key: &str, found: Option<&str>) {
        if self.distrust.is_some() {
            return;
        }
        let found = found.map_or_else(|| "none".to_owned(), |g| format!("generation {g}"));
        self.distrust = Some(format!(
            "redis {}: the cluster's data is gone or replaced ({key} holds {found}, this instance joined generation {}): FLUSHALL, a new empty Redis, or a failover to a replica that never had it; messages acknowledged before are lost, and no new one is accepted: restart the instances to begin a new generation",
            self.cfg.shown_url(),
            self.generation
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generations_differ() {
        assert_ne!(new_generation(), new_generation());
        assert_eq!(new_generation().len(), 16);
    }
}
