//! The bridge server as a cluster member (`--cluster`, docs/cluster.md): the journal thread
//! on Redis ([`Journal::start_cluster`]) and the stream reader ([`Reader`]) both wake the
//! reactor through the journal's pipe; each journal completion's cluster part comes from
//! the [`ClusterLink`], and the reader is told which inboxes to read from its gained, lost
//! and fenced partitions before the bridge sees them.
//!
//! A lost or fenced partition's sessions end in place (the bridge hands them over, see
//! `cluster/bridge/side.rs`); the rest of the instance goes on serving.

use std::io;
use std::sync::Arc;

use crate::cluster::{ClusterLink, ClusterReport, ClusterRequest, Reader, RedisStore};
use crate::journal::{Journal, JournalConfig, StoreError, now_ms};
use crate::liveness::{BridgeStatus, ClusterStatus};
use crate::server::BridgeServer;

/// A cluster member's parts: until `register`, then while serving.
#[derive(Default)]
pub(in crate::server) struct Member {
    pending: Option<Pending>,
    reader: Option<Reader>,
    /// The journal thread's cluster side: its reports, the drains' ends, the untags.
    link: Option<ClusterLink>,
    /// `--instance-id`, `--partitions`, `--cluster-rebalance` and `--cluster-drain-ms`, for
    /// the status.
    instance: String,
    partitions: u32,
    rebalance: bool,
    drain: std::time::Duration,
    /// Partitions gained, lost and fenced since the start, as the journal reported them
    /// (fenced: only those owned here then, and not lost in the same report, so that each
    /// ownership ends once in `lost + fenced`).
    gained: u64,
    lost: u64,
    fenced: u64,
}

struct Pending {
    journal: RedisStore,
    reader: RedisStore,
    session_cap: usize,
    cfg: JournalConfig,
}

impl Member {
    pub(in crate::server) fn is_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// The cluster's part of the journal completion just taken (one per completion, in
    /// order; empty without a cluster journal).
    pub(in crate::server) fn report(&self) -> ClusterReport {
        self.link
            .as_ref()
            .map(ClusterLink::report)
            .unwrap_or_default()
    }
}

impl BridgeServer {
    /// Makes the server a cluster member: messages are journaled in Redis through
    /// `journal` (its own connection) and the partitions' streams read through `reader` (a
    /// second connection); at most `session_cap` messages of one session are in flight
    /// across the cluster. The bridge's config must have `journal` set. Nothing is loaded
    /// here: partitions are loaded as they are gained, once the server runs.
    pub fn with_cluster(
        mut self,
        journal: RedisStore,
        reader: RedisStore,
        session_cap: usize,
        cfg: JournalConfig,
    ) -> Result<BridgeServer, StoreError> {
        if !self.bridge.config().journal {
            return Err(StoreError::unusable(
                "the bridge config does not have journal set",
            ));
        }
        // The bridge's clock starts at zero with the server.
        self.bridge.set_wall_clock(now_ms());
        self.bridge.set_partitions(journal.partitions());
        self.cluster.instance = journal.instance().to_owned();
        self.cluster.partitions = journal.partitions();
        self.cluster.rebalance = journal.rebalance();
        self.cluster.drain = journal.drain();
        self.cluster.pending = Some(Pending {
            journal,
            reader,
            session_cap,
            cfg,
        });
        Ok(self)
    }

    /// Starts the journal thread and the reader, both waking the reactor through `pipe`.
    pub(in crate::server) fn start_cluster(
        &mut self,
        pipe: mio::unix::pipe::Sender,
    ) -> io::Result<()> {
        let Some(p) = self.cluster.pending.take() else {
            return Ok(());
        };
        let pipe = Arc::new(pipe);
        let waker = |pipe: Arc<mio::unix::pipe::Sender>| {
            move || {
                use std::io::Write as _;
                match (&*pipe).write(&[1]) {
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => log::error!("cannot wake the reactor for the cluster: {e}"),
                }
            }
        };
        let reader = Reader::start(p.reader, waker(pipe.clone()))
            .map_err(|e| io::Error::other(e.message))?;
        let (journal, link) = Journal::start_cluster(p.journal, p.cfg, p.session_cap, waker(pipe))?;
        self.journal = Some(journal);
        self.cluster.link = Some(link);
        self.cluster.reader = Some(reader);
        Ok(())
    }

    /// The cluster's part of the journal completion just taken, once the reader was told
    /// of it ([`BridgeServer::forward`]).
    pub(in crate::server) fn cluster_report(&mut self) -> ClusterReport {
        let r = self.cluster.report();
        self.forward(&r);
        r
    }

    /// Before the bridge sees a report: the reader reads the inboxes of the partitions
    /// gained, from their loads' positions, and no more those lost or fenced.
    fn forward(&mut self, c: &ClusterReport) {
        // A record of a partition not held is reported fenced at each write: not an
        // ownership ending.
        let owned = if c.fenced.is_empty() {
            Vec::new()
        } else {
            self.bridge.cluster_status().owned
        };
        let m = &mut self.cluster;
        m.gained += c.gained.len() as u64;
        m.lost += c.lost.len() as u64;
        m.fenced += c
            .fenced
            .iter()
            .filter(|p| owned.contains(p) && !c.lost.contains(p))
            .count() as u64;
        let Some(r) = &self.cluster.reader else {
            return;
        };
        for (p, loaded) in &c.gained {
            r.own(*p, loaded.inbox_after.clone());
        }
        for p in c.lost.iter().chain(&c.fenced) {
            r.disown(*p);
        }
    }

    /// The bridge drained partition `p`: the journal thread releases its lease.
    pub(in crate::server) fn release_drained(&self, p: u32) {
        if let Some(l) = &self.cluster.link {
            l.release_drained(p);
        }
    }

    /// The bridge's request for the reader's connection (the hello registry, forwards).
    pub(in crate::server) fn cluster_request(&self, r: ClusterRequest) {
        match (r, &self.cluster.link, &self.cluster.reader) {
            (ClusterRequest::Untag(tag), Some(l), _) => l.untag(tag),
            (ClusterRequest::Untag(_), None, _) | (_, _, None) => {}
            (r, _, Some(reader)) => reader.request(r),
        }
    }

    /// What the reader brought goes to the bridge.
    pub(in crate::server) fn cluster_arrivals(&mut self) {
        if let Some(r) = &self.cluster.reader {
            let arrivals: Vec<_> = r.arrivals().collect();
            for a in arrivals {
                self.bridge.arrived(a, self.now);
            }
        }
    }

    /// The cluster's figures in the bridge's status (nothing without `--cluster`).
    pub(in crate::server) fn cluster_status(&self, status: &mut BridgeStatus) {
        let m = &self.cluster;
        if m.instance.is_empty() {
            return;
        }
        let mut s = ClusterStatus {
            instance: m.instance.clone(),
            partitions: m.partitions,
            gained: m.gained,
            lost: m.lost,
            fenced: m.fenced,
            rebalance: m.rebalance,
            drain_ms: m.drain.as_millis() as u64,
            ..self.bridge.cluster_status()
        };
        debug_assert!(s.owned.len() <= m.partitions as usize);
        if let Some(r) = &m.reader {
            r.fill_status(&mut s);
        }
        status.cluster = Some(s);
    }
}
