//! The server's durability, set before it runs: a journal on a local store
//! ([`BridgeServer::with_journal`]), or a cluster member's in Redis
//! ([`BridgeServer::with_cluster`], the cluster's shell `crate::cluster::shell::Member`).

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Duration;

use super::{BridgeServer, RecoveryCounts};
use crate::journal::{JournalConfig, Store, StoreError};

impl BridgeServer {
    /// Turns durability on: loads what `store` holds and rebuilds the bridge's state from it
    /// (the bridge's config must have `journal` set), then journals to it from a thread once
    /// the server is registered. A store that cannot be read is an error: the gateway must
    /// not start over a journal it cannot trust.
    pub fn with_journal<S: Store + 'static>(
        mut self,
        mut store: S,
        cfg: JournalConfig,
    ) -> Result<(BridgeServer, RecoveryCounts), StoreError> {
        if !self.bridge.config().journal {
            return Err(StoreError::unusable(
                "the bridge config does not have journal set",
            ));
        }
        let wall = crate::journal::now_ms();
        let recovered = store.load(wall)?;
        // A message whose turn has not ended still needs its files, a reply not yet delivered
        // the files its agent attached; every other file in the spool is an orphan of the
        // last run.
        let mut keep: HashSet<PathBuf> = recovered
            .messages
            .iter()
            .filter(|m| m.outcome.is_none())
            .flat_map(|m| &m.message.fields.attachments)
            .filter_map(|a| a.path.as_deref().map(PathBuf::from))
            .collect();
        keep.extend(
            recovered
                .messages
                .iter()
                .filter_map(|m| m.outcome.clone())
                .flat_map(|o| crate::wire::EncodedLine::from_stored(o).attachment_paths())
                .map(PathBuf::from),
        );
        self.sweep_spool(&keep);
        let counts = self.bridge.recover(recovered, wall, Duration::ZERO);
        self.store = Some((Box::new(store), cfg));
        Ok((self, counts))
    }

    /// Removes the spool's files (`--attachments-dir`) that no message in `keep` names: the
    /// orphans of an earlier run. Called once, before the server runs; a failure is logged
    /// (the spool's bound still holds: a bridge skips what does not fit).
    pub(crate) fn sweep_spool(&self, keep: &HashSet<PathBuf>) {
        let Some(dir) = &self.bridge.config().attachments.dir else {
            return;
        };
        match crate::attachments::sweep(dir, keep) {
            Ok(0) => {}
            Ok(n) => log::info!(
                "attachments: removed {n} orphan file(s) from {}",
                dir.display()
            ),
            Err(e) => log::warn!("attachments: cannot sweep {}: {e}", dir.display()),
        }
    }

    /// Makes the server a cluster member (`--cluster`, docs/cluster.md): messages are
    /// journaled in Redis through `journal` (its own connection) and the partitions' streams
    /// read through `reader` (a second connection); at most `session_cap` messages of one
    /// session are in flight across the cluster. The bridge's config must have `journal`
    /// set. Nothing is loaded here: partitions are loaded as they are gained, once the
    /// server runs.
    #[cfg(feature = "cluster")]
    pub fn with_cluster(
        mut self,
        journal: crate::cluster::RedisStore,
        reader: crate::cluster::RedisStore,
        session_cap: usize,
        cfg: JournalConfig,
    ) -> Result<BridgeServer, StoreError> {
        if !self.bridge.config().journal {
            return Err(StoreError::unusable(
                "the bridge config does not have journal set",
            ));
        }
        self.cluster = super::Member::new(journal, reader, session_cap, cfg);
        // The bridge's clock starts at zero with the server.
        self.bridge.set_wall_clock(crate::journal::now_ms());
        self.bridge.set_partitions(self.cluster.partitions());
        Ok(self)
    }
}
