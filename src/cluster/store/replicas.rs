//! `--cluster-min-replicas N`: a batch of writes counts as written only once `N` replicas
//! have it (Redis `WAIT`), so that a failover to one of them loses no acknowledged message.
//! Redis replication is asynchronous; `WAIT` makes the writer wait for it, it does not make
//! the replica fsync (docs/cluster.md, "Replicas and failover").

use super::{RedisStore, StoreError};

impl RedisStore {
    /// With [`ClusterConfig::min_replicas`](super::ClusterConfig::min_replicas) above 0: waits
    /// (at most half the round-trip timeout and a sixth of the lease) until that many replicas have every write this
    /// connection made; fewer is a transient error (the batch is not acked: accepts are
    /// rejected `storage`, other records tried again).
    pub(super) fn wait_replicas(&mut self) -> Result<(), StoreError> {
        let want = self.cfg.min_replicas;
        if want == 0 {
            return Ok(());
        }
        // Short of the lease: a wait blocks the journal thread, whose ownership pass renews
        // the leases every third of it.
        let within = (self.cfg.timeout / 2).min(self.cfg.lease / 6);
        let within = within.as_millis().max(1) as u64;
        let got: i64 = self.with("WAIT", |c, _| {
            redis::cmd("WAIT").arg(want).arg(within).query(c)
        })?;
        if got < i64::from(want) {
            return Err(StoreError::transient(format!(
                "redis {}: {got} of the {want} replicas required (--cluster-min-replicas) confirmed the writes within {within} ms",
                self.cfg.shown_url()
            )));
        }
        Ok(())
    }
}
