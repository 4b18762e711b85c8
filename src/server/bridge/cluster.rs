//! The bridge as a cluster member (`--cluster`, docs/cluster.md): what the partitioned
//! journal reports beyond a single instance's ([`ClusterReport`]) and what the stream reader
//! brings ([`Arrival`]).
//!
//! - A message accepted here for a partition **owned elsewhere** is acked once durable
//!   (`queued`, no position: its queue is on another instance) and never submitted here; its
//!   route waits for the owner's outcome, which the reader brings from the outcome stream and
//!   which goes out as any terminal event (no outcome record: the owner wrote it).
//! - A **duplicate** by Redis's cluster-wide window is answered as a local duplicate is; a
//!   session with its cap in flight cluster-wide is refused `queue_full`.
//! - A **gained** partition is rebuilt as start-up recovery rebuilds the journal
//!   ([`Bridge::recover`]); a message of it this bridge was waiting for remotely is taken back
//!   from its wait first. A message accepted into an owned partition afterwards (by any
//!   instance) arrives from the inbox and is queued the same way.
//! - A **lost or fenced** partition is noted ([`Bridge::dropped_partitions`]): ending its
//!   sessions here without outcome records is the server's to do (it stops the process: the
//!   partition's new owner recovers them, as after a crash).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use super::super::frame::{Body, Frame};
use super::Bridge;
use super::admit::{Refusal, duplicate_ack};
use super::status::RecoveryCounts;
use crate::core::RejectReason;
use crate::journal::{Arrival, ClusterReport, LoadedPartition, Recovered, StoredOutcome, now_ms};
use crate::server::protocol::{ServerOp, encode};

/// The bridge's cluster state, kept with the journal's ([`super::durable::Durable`]).
#[derive(Default)]
pub(super) struct ClusterSide {
    /// Messages acked here and owned elsewhere: cluster tag → the bridge's tag.
    remote: HashMap<u64, u64>,
    /// Partitions lost or fenced since the server last asked.
    dropped: Vec<u32>,
    /// Messages run here that another live instance accepted: their terminal events are
    /// recorded (the record publishes them to that instance) and not sent here.
    silent: HashSet<u64>,
}

impl Bridge {
    /// `--cluster`: messages acked here whose outcome another instance owes (each holds its
    /// route and its outbox reservation, within the platforms' bounds).
    pub fn remote_waiting(&self) -> usize {
        self.durable.as_ref().map_or(0, |d| d.cluster.remote.len())
    }

    /// The cluster part of a journal report: called by [`Bridge::journaled`] before the rest
    /// (its tags are not among the report's `durable` and `failed`).
    pub(super) fn clustered(&mut self, r: ClusterReport, now: Duration) {
        let placed: HashMap<u64, u64> = r.placed.iter().copied().collect();
        for tag in r.remote {
            self.acked_remote(tag, placed.get(&tag).copied(), now);
        }
        for tag in r.duplicates {
            self.cluster_duplicate(tag, now);
        }
        for tag in r.session_full {
            if let Some(d) = &mut self.durable {
                d.forget_waiting(tag);
            }
            self.refuse(tag, Refusal::runtime(RejectReason::QueueFull));
        }
        for (p, loaded) in r.gained {
            self.gained(p, loaded, now);
        }
        for p in r.lost.into_iter().chain(r.fenced) {
            log::error!(
                "partition {p}: no longer this instance's (lost or fenced); its sessions must end here without outcomes"
            );
            if let Some(d) = &mut self.durable
                && !d.cluster.dropped.contains(&p)
            {
                d.cluster.dropped.push(p);
            }
        }
    }

    /// Partitions lost or fenced since the last call: the server ends their sessions.
    pub fn dropped_partitions(&mut self) -> Vec<u32> {
        self.durable
            .as_mut()
            .map(|d| std::mem::take(&mut d.cluster.dropped))
            .unwrap_or_default()
    }

    /// Durable in Redis, owned elsewhere: acked now, and its route waits for the outcome.
    fn acked_remote(&mut self, tag: u64, cluster: Option<u64>, now: Duration) {
        let Some(d) = &mut self.durable else {
            return;
        };
        let (Some(_), Some(cluster)) = (d.forget_waiting(tag), cluster) else {
            return;
        };
        d.cluster.remote.insert(cluster, tag);
        let Some(route) = self.routes.get_mut(tag) else {
            return;
        };
        let (conn, copies) = (route.conn, std::mem::take(&mut route.copies));
        self.platforms
            .dedup_accepted(&route.platform, route.fp, now);
        let ack = encode(&ServerOp::Ack {
            id: &route.id,
            session: route.session.as_str(),
            state: "queued",
            position: None,
        });
        log::debug!("message {tag} durable; its partition is owned elsewhere");
        for c in std::iter::once(conn).chain(copies) {
            self.conns.resolve(c, tag, |copy| match copy {
                None => ack.clone(),
                Some((cid, ckey)) => duplicate_ack(cid, ckey),
            });
        }
    }

    /// Redis's window says another instance has the id: answered as a local duplicate.
    fn cluster_duplicate(&mut self, tag: u64, now: Duration) {
        if let Some(d) = &mut self.durable {
            d.forget_waiting(tag);
        }
        let Some(route) = self.routes.remove(tag) else {
            return;
        };
        // Still a duplicate here for the rest of the window.
        self.platforms
            .dedup_accepted(&route.platform, route.fp, now);
        self.platforms.unreserve(&route.platform, None);
        self.release_held(&route.platform);
        self.conns.settled(route.conn);
        for &c in std::iter::once(&route.conn).chain(&route.copies) {
            self.conns.resolve(c, tag, |copy| match copy {
                None => duplicate_ack(&route.id, &route.session),
                Some((cid, ckey)) => duplicate_ack(cid, ckey),
            });
        }
        self.platforms.maybe_free(&route.platform);
        self.maybe_finish(route.conn);
    }

    /// What the stream reader brought: an outcome of a message acked here and run elsewhere,
    /// or a message accepted into a partition owned here.
    pub fn arrived(&mut self, a: Arrival, now: Duration) {
        self.now = now;
        match a {
            Arrival::Outcome { tag, outcome, .. } => {
                let local = self
                    .durable
                    .as_mut()
                    .and_then(|d| d.cluster.remote.remove(&tag));
                if let Some(local) = local {
                    self.remote_outcome(local, outcome);
                }
            }
            Arrival::Message { tag, message, .. } => {
                if self.routes.contains(tag) {
                    return;
                }
                // Accepted by another instance, alive a moment ago: its result is its own.
                if let Some(d) = &mut self.durable {
                    d.cluster.silent.insert(tag);
                }
                let mut n = RecoveryCounts::default();
                self.recover_message(*message, &mut n, now);
            }
        }
        self.audit();
    }

    /// The owner's outcome of a message acked here goes to its connection (or outbox).
    fn remote_outcome(&mut self, tag: u64, outcome: StoredOutcome) {
        let Some(route) = self.routes.remove(tag) else {
            return;
        };
        self.conns.settled(route.conn);
        let frame = Frame::new(Body::from_stored(outcome), Some(route.platform.clone()))
            .of_message(tag, route.id.clone());
        self.deliver_terminal(route.conn, &route.platform, frame);
        self.maybe_finish(route.conn);
    }

    /// Whether the terminal event `frame`, its outcome now recorded, is another instance's
    /// to send: then its reservation here is given back and it goes nowhere.
    pub(super) fn silenced(&mut self, frame: &Frame) -> bool {
        let silent = self
            .durable
            .as_mut()
            .is_some_and(|d| d.cluster.silent.remove(&frame.seq));
        if silent && let Some(platform) = &frame.terminal_for {
            self.platforms.unreserve(platform, None);
            self.release_held(platform);
            self.platforms.maybe_free(platform);
        }
        silent
    }

    /// A partition now owned here, rebuilt as recovery does; messages of it this bridge
    /// waited for remotely leave their wait first (their results go to the platform, as a
    /// recovered message's do).
    fn gained(&mut self, p: u32, loaded: LoadedPartition, now: Duration) {
        let mut messages = Vec::with_capacity(loaded.recovered.messages.len());
        for rm in loaded.recovered.messages {
            let tag = rm.message.seq;
            let waited = self.durable.as_mut().is_some_and(|d| {
                let before = d.cluster.remote.len();
                d.cluster.remote.retain(|_, t| *t != tag);
                d.cluster.remote.len() < before
            });
            if waited && let Some(route) = self.routes.remove(tag) {
                self.platforms.unreserve(&route.platform, None);
                self.conns.settled(route.conn);
                self.maybe_finish(route.conn);
            }
            if self.routes.contains(tag) {
                continue;
            }
            // Accepted by another live instance: the result goes there, by the stream.
            if loaded.origins.contains_key(&tag) {
                if rm.outcome.is_some() {
                    // Published when it was written; the origin's reader has it.
                    continue;
                }
                if let Some(d) = &mut self.durable {
                    d.cluster.silent.insert(tag);
                }
            }
            messages.push(rm);
        }
        log::info!(
            "partition {p}: gained, {} message(s) to rebuild",
            messages.len()
        );
        let r = Recovered {
            messages,
            dedup: loaded.recovered.dedup,
            max_seq: 0,
        };
        let _ = self.recover(r, now_ms(), now);
    }
}
