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
use std::time::Duration;

use crate::cluster::{ClusterLink, ClusterReport, ClusterRequest, Reader, RedisStore};
use crate::journal::{Journal, JournalConfig};
use crate::liveness::{BridgeStatus, ClusterStatus};
use crate::server::bridge::Bridge;

/// A cluster member's parts: until `register`, then while serving.
#[derive(Default)]
pub(crate) struct Member {
    pending: Option<Pending>,
    reader: Option<Reader>,
    /// The journal thread's cluster side: its reports, the drains' ends, the untags.
    link: Option<ClusterLink>,
    /// `--instance-id`, `--partitions`, `--cluster-rebalance` and `--cluster-drain-ms`, for
    /// the status.
    instance: String,
    partitions: u32,
    rebalance: bool,
    drain: Duration,
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
    /// A cluster member's parts, until the server is registered (`BridgeServer::with_cluster`):
    /// messages are journaled in Redis through `journal` (its own connection) and the
    /// partitions' streams read through `reader` (a second connection); at most
    /// `session_cap` messages of one session are in flight across the cluster. Nothing is
    /// loaded here: partitions are loaded as they are gained, once the server runs.
    pub(crate) fn new(
        journal: RedisStore,
        reader: RedisStore,
        session_cap: usize,
        cfg: JournalConfig,
    ) -> Member {
        Member {
            instance: journal.instance().to_owned(),
            partitions: journal.partitions(),
            rebalance: journal.rebalance(),
            drain: journal.drain(),
            pending: Some(Pending {
                journal,
                reader,
                session_cap,
                cfg,
            }),
            ..Member::default()
        }
    }

    /// `--partitions`, for the bridge.
    pub(crate) fn partitions(&self) -> u32 {
        self.partitions
    }

    pub(crate) fn is_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// The cluster's part of the journal completion just taken (one per completion, in
    /// order; empty without a cluster journal).
    pub(crate) fn report(&self) -> ClusterReport {
        self.link
            .as_ref()
            .map(ClusterLink::report)
            .unwrap_or_default()
    }

    /// Starts the journal thread and the reader, both waking the reactor through `pipe`;
    /// returns the journal thread, which the server takes completions from.
    pub(crate) fn start(&mut self, pipe: mio::unix::pipe::Sender) -> io::Result<Option<Journal>> {
        let Some(p) = self.pending.take() else {
            return Ok(None);
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
        self.link = Some(link);
        self.reader = Some(reader);
        Ok(Some(journal))
    }

    /// The cluster's part of the journal completion just taken, once the reader was told
    /// of it ([`Member::forward`]); `bridge` says which partitions it owns.
    pub(crate) fn take_report(&mut self, bridge: &Bridge) -> ClusterReport {
        let r = self.report();
        self.forward(&r, bridge);
        r
    }

    /// Before the bridge sees a report: the reader reads the inboxes of the partitions
    /// gained, from their loads' positions, and no more those lost or fenced.
    fn forward(&mut self, c: &ClusterReport, bridge: &Bridge) {
        // A record of a partition not held is reported fenced at each write: not an
        // ownership ending.
        let owned = if c.fenced.is_empty() {
            Vec::new()
        } else {
            bridge.cluster_status().owned
        };
        self.gained += c.gained.len() as u64;
        self.lost += c.lost.len() as u64;
        self.fenced += c
            .fenced
            .iter()
            .filter(|p| owned.contains(p) && !c.lost.contains(p))
            .count() as u64;
        let Some(r) = &self.reader else {
            return;
        };
        // Ended first: a partition lost and regained in one report (a paused instance
        // waking) is read again from its new load (tests/simulation_cluster, seed 45: its
        // inbox went unread, and the messages others accepted into it never ran).
        for p in c.lost.iter().chain(&c.fenced) {
            r.disown(*p);
        }
        for (p, loaded) in &c.gained {
            r.own(*p, loaded.inbox_after.clone());
        }
    }

    /// The bridge drained partition `p`: the journal thread releases its lease.
    pub(crate) fn release_drained(&self, p: u32) {
        if let Some(l) = &self.link {
            l.release_drained(p);
        }
    }

    /// The bridge's request for the reader's connection (the hello registry, forwards).
    pub(crate) fn request(&self, r: ClusterRequest) {
        match (r, &self.link, &self.reader) {
            (ClusterRequest::Untag(tag), Some(l), _) => l.untag(tag),
            (ClusterRequest::Untag(_), None, _) | (_, _, None) => {}
            (r, _, Some(reader)) => reader.request(r),
        }
    }

    /// What the reader brought goes to `bridge`, at `now`.
    pub(crate) fn arrivals(&self, bridge: &mut Bridge, now: Duration) {
        if let Some(r) = &self.reader {
            // Those already come, no more: the reader goes on meanwhile.
            let arrivals: Vec<_> = r.arrivals().collect();
            for a in arrivals {
                bridge.arrived(a, now);
            }
        }
    }

    /// The cluster's figures in the bridge's status, the bridge's own from `bridge`
    /// (nothing without `--cluster`).
    pub(crate) fn fill_status(&self, bridge: &Bridge, status: &mut BridgeStatus) {
        if self.instance.is_empty() {
            return;
        }
        let mut s = ClusterStatus {
            instance: self.instance.clone(),
            partitions: self.partitions,
            gained: self.gained,
            lost: self.lost,
            fenced: self.fenced,
            rebalance: self.rebalance,
            drain_ms: self.drain.as_millis() as u64,
            ..bridge.cluster_status()
        };
        debug_assert!(s.owned.len() <= self.partitions as usize);
        if let Some(r) = &self.reader {
            r.fill_status(&mut s);
        }
        status.cluster = Some(s);
    }
}
