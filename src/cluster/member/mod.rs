//! The journal thread of a cluster member (`--cluster`, docs/cluster.md): the same channel
//! of [`Record`]s and the same [`Committed`] reports as the single-instance thread
//! (`journal/thread.rs`), written to a [`RedisStore`] instead, with the ownership pass on the
//! same thread. What the partitioned store says beyond a [`Committed`] is a [`ClusterReport`],
//! sent on a channel of its own ([`ClusterLink`]) just before the completion it belongs to:
//! one per completion, so the reactor pairs them in order ([`ClusterLink::report`]). The Redis client is blocking; it runs here, never on the reactor.
//!
//! Each batch becomes one pipelined [`RedisStore::write`] (group commit: one round trip,
//! one answer per record). A failed accept is reported `failed` (the bridge rejects it
//! `storage`); every other record that failed transiently is kept and written again with
//! the next batch (they are idempotent); an owned write (`started`, an outcome) refused as
//! fenced is dropped and its partition reported `fenced`.
//!
//! Tags. The bridge numbers the messages it accepts itself (its route tags) and keeps using
//! that number in every later record; Redis numbers them per partition. This thread keeps
//! the map between the two for the messages this instance accepted (reported in
//! [`ClusterReport::placed`], removed once delivered or forgotten). A message this instance
//! did not accept reaches the bridge through a gained partition with its **cluster tag**
//! ([`cluster_tag`]: the top bit set, the partition and the partition's seq), which this
//! thread decodes without a map: the two kinds of tag cannot collide, since the bridge's
//! own count never reaches 2^63.
//!
//! The ownership pass runs every [`Ownership::pass_every`] (a third of the lease), between
//! batches: heartbeat, the instances gone from the registry (their messages' written
//! outcomes in partitions held here are reported), the surplus named to drain (the bridge
//! says when a drain is over, on a channel of its own: [`ClusterLink::release_drained`]; past
//! `ClusterConfig::drain` the partition is released anyway), renew, acquire free partitions
//! and load each one gained. Gained, draining, lost (drained and released, past the drain's
//! bound, or not renewed in time) and fenced partitions go to the reactor in the next
//! [`ClusterReport`].

mod pass;
mod trust;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};

use super::{
    Accept, Acquire, Done, Lease, LoadedPartition, Op, Ownership, RedisStore, partition_of,
};
use crate::journal::thread::Gauges;
use crate::journal::{
    Committed, Journal, JournalConfig, Record, StoreError, StoredMessage, now_ms,
};
use crate::message::SessionKey;

/// The top bit of a [`cluster_tag`].
const CLUSTER_BIT: u64 = 1 << 63;
/// Bits of the partition's seq in a cluster tag (10^12 messages per partition).
const SEQ_BITS: u32 = 40;

/// The tag of message `seq` of `partition` for a bridge that did not accept it: the top bit
/// set, then the partition, then the seq (below 2^40).
pub fn cluster_tag(partition: u32, seq: u64) -> u64 {
    debug_assert!(seq < 1 << SEQ_BITS && u64::from(partition) < 1 << (63 - SEQ_BITS));
    CLUSTER_BIT | (u64::from(partition) << SEQ_BITS) | (seq & ((1 << SEQ_BITS) - 1))
}

/// The `(partition, seq)` of a [`cluster_tag`]; `None` for a bridge's own tag.
pub fn tag_parts(tag: u64) -> Option<(u32, u64)> {
    (tag & CLUSTER_BIT != 0).then(|| {
        let p = (tag & !CLUSTER_BIT) >> SEQ_BITS;
        (p as u32, tag & ((1 << SEQ_BITS) - 1))
    })
}

/// What a cluster member's journal thread reports beyond the single-instance [`Committed`].
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ClusterReport {
    /// Accepted messages now durable in Redis: (the bridge's tag, the message's
    /// [`cluster_tag`]); the outcome stream and a later load name them by the latter.
    pub placed: Vec<(u64, u64)>,
    /// Of those, the ones whose partition another instance owns: they are not in
    /// [`Committed::durable`] (not to be submitted here); ack them and wait for their
    /// outcome on the stream.
    pub remote: Vec<u64>,
    /// Of the placed ones, each one's session's messages in flight across the cluster when
    /// it was accepted (the bridge's tag, the count): the ack's `position` of one acked
    /// remote (a remote one, or an own one handed over before its turn to be submitted).
    pub ahead: Vec<(u64, usize)>,
    /// Accepted messages Redis refused as duplicates (the cluster-wide window): nothing was
    /// written.
    pub duplicates: Vec<u64>,
    /// Accepted messages refused because their session has the cap in flight, cluster-wide.
    pub session_full: Vec<u64>,
    /// Partitions this instance now owns, each as loaded: its messages numbered by the tag
    /// the bridge knows them by (its own for those it accepted, else the cluster tag); its
    /// `origins` only those accepted by *another live* instance (their results go there),
    /// by the same tag; `max_seq` is 0 (the partition's count is not a bridge tag).
    pub gained: Vec<(u32, LoadedPartition)>,
    /// Partitions to drain (more than the fair share held): start no new turn there, let
    /// the running ones end and their outcomes be written, hand the partition over, then
    /// tell the thread ([`ClusterLink::release_drained`]). Messages accepted into it from now on
    /// are reported `remote` (its next owner runs them).
    pub draining: Vec<u32>,
    /// Partitions given up (a drained partition released, a drain past its bound, a lease
    /// not renewed in time): stop starting turns there and end their sessions without
    /// outcome records (a drained one's were handed over already).
    pub lost: Vec<u32>,
    /// Partitions whose owned write (`started`, an outcome, a renewal) was refused because
    /// another instance holds the lease: the write was dropped; as `lost`.
    pub fenced: Vec<u32>,
    /// Of this batch's outcome records, those not written (fenced, or their partition no
    /// longer held): their terminal events must never be sent (the new owner answers).
    pub unwritten_outcomes: Vec<u64>,
    /// Every lease held after an ownership pass: (partition, epoch, fence deadline on the
    /// reactor's clock once the shell converted it, the member's before): past the deadline
    /// without a newer one, the bridge stops the partition's turns and hands it over on its
    /// own (self-fencing, docs/cluster.md), and tells the thread
    /// ([`ClusterLink::self_fenced`]). Empty in a report without a pass: nothing changed.
    pub leases: Vec<(u32, u64, Duration)>,
    /// A pass's heartbeat went through: the registry holds this instance live for at least
    /// this long after the report was sent (the lease less the pass's time since the
    /// heartbeat was sent and a quarter lease of margin for the instances' clocks). Past it,
    /// unheard again, another instance may take this one for dead and send the results of
    /// its messages itself (`cluster/bridge/lapse.rs`).
    pub registered_for: Option<Duration>,
}

/// The reactor's side of a cluster member's journal thread, beside its [`Journal`]: the
/// cluster's report of each completion, and the two requests the bridge makes of the thread.
pub struct ClusterLink {
    drained: Sender<Ended>,
    untagged: Sender<u64>,
    reports: Receiver<ClusterReport>,
    /// The member's clock's zero ([`ClusterLink::zero`]).
    zero: Instant,
}

impl ClusterLink {
    /// The cluster's part of the journal's next completion: call it once for each
    /// [`Committed`] taken from the [`Journal`], in order (the thread sends each report just
    /// before its completion, so it is always there).
    pub fn report(&self) -> ClusterReport {
        let r = self.reports.try_recv();
        debug_assert!(r.is_ok(), "a completion without its cluster report");
        r.unwrap_or_default()
    }

    /// The result of the bridge's message `tag` was taken by another instance, which writes
    /// its `delivered` by the message's place in Redis: the thread forgets the tag's place
    /// (nothing is written; it would never see a `delivered` of this tag).
    pub fn untag(&self, tag: u64) {
        if self.untagged.send(tag).is_err() {
            log::debug!("message {tag}: untagged, but the journal thread is gone");
        }
    }

    /// The drain of `partition` is over (its running turns ended, their outcomes are
    /// written, its sessions were handed over): the thread releases its lease now. Ignored
    /// for a partition the thread does not hold as draining.
    pub fn release_drained(&self, partition: u32) {
        if self.drained.send(Ended::Drained(partition)).is_err() {
            log::debug!("partition {partition}: drained, but the journal thread is gone");
        }
    }

    /// The bridge fenced itself out of `partition` (its lease of `epoch` passed its fence
    /// deadline before a renewal was reported): the thread drops that lease without
    /// releasing it (the turns being stopped get the rest of the lease to end) and reports
    /// the partition lost. Ignored if the thread holds another epoch of it, or none.
    pub fn self_fenced(&self, partition: u32, epoch: u64) {
        if self.drained.send(Ended::Fenced(partition, epoch)).is_err() {
            log::debug!("partition {partition}: fenced, but the journal thread is gone");
        }
    }

    /// The clock of the fence deadlines in [`ClusterReport::leases`]: they count from here.
    pub fn zero(&self) -> Instant {
        self.zero
    }
}

/// What the bridge ended of a partition, for the thread.
#[derive(Clone, Copy, Debug)]
enum Ended {
    /// Drained: release the lease ([`ClusterLink::release_drained`]).
    Drained(u32),
    /// Fenced by the bridge: drop this epoch's lease ([`ClusterLink::self_fenced`]).
    Fenced(u32, u64),
}

impl Journal {
    /// Starts a cluster member's journal thread on `store`: records become pipelined Redis
    /// writes, and the thread owns partitions (heartbeat, renew, acquire, release, load).
    /// `session_cap` is the cluster-wide bound of messages in flight per session. On
    /// [`Journal::finish`] it writes what is queued, then releases its leases and leaves
    /// the registry, so that the others take its partitions at once.
    pub fn start_cluster<W>(
        store: RedisStore,
        cfg: JournalConfig,
        session_cap: usize,
        wake: W,
    ) -> std::io::Result<(Journal, ClusterLink)>
    where
        W: Fn() + Send + 'static,
    {
        // Drained: one per partition released (bounded by the partitions). Untagged: one per
        // message whose tag is forgotten, and reports: one per completion; both bounded by
        // the journal's records, which the bridge's journal room bounds.
        let (drained_tx, drained) = crossbeam_channel::unbounded();
        let (untagged_tx, untagged) = crossbeam_channel::unbounded();
        let (reports_tx, reports) = crossbeam_channel::unbounded();
        let zero = Instant::now();
        let journal = Journal::spawn(None, move |rx, done, stopped, gauges| {
            let mut own = Ownership::new(store.instance(), store.partitions(), store.lease());
            own.set_margin(store.fence_margin());
            // The surplus over the fair share is drained by the bridge before it is
            // released: no turn running there is cut off (docs/cluster.md, "Shedding").
            // Without rebalancing an instance keeps what it holds.
            if store.rebalance() {
                own.set_drain(Some(store.drain()));
            } else {
                own.set_shed(false);
            }
            let mut m = Member {
                drained: Some(drained),
                untagged: Some(untagged),
                store,
                cfg,
                session_cap,
                gauges,
                own,
                zero,
                next_pass: Instant::now(),
                tags: HashMap::new(),
                back: HashMap::new(),
                retry: Vec::new(),
                failing: false,
                distrusted: false,
                registered_until: None,
                lapse_told: false,
                closed: false,
                to_release: Vec::new(),
                waiting: Vec::new(),
            };
            let out = Out {
                done,
                reports: reports_tx,
            };
            m.run(&rx, &out, &stopped, &wake);
            m.leave();
        })?;
        let link = ClusterLink {
            drained: drained_tx,
            untagged: untagged_tx,
            reports,
            zero,
        };
        Ok((journal, link))
    }
}

/// One report of the thread: the journal's completion and the cluster's part of it
/// (dereferences to the former).
#[derive(Debug, Default, PartialEq, Eq)]
struct Report {
    base: Committed,
    cluster: ClusterReport,
}

impl std::ops::Deref for Report {
    type Target = Committed;
    fn deref(&self) -> &Committed {
        &self.base
    }
}

impl std::ops::DerefMut for Report {
    fn deref_mut(&mut self) -> &mut Committed {
        &mut self.base
    }
}

/// Where the thread's reports go: the cluster's part first, then the completion.
struct Out {
    done: Sender<Committed>,
    reports: Sender<ClusterReport>,
}

impl Out {
    /// False once the reactor side is gone.
    fn send(&self, r: Report) -> bool {
        self.reports.send(r.cluster).is_ok() && self.done.send(r.base).is_ok()
    }
}

/// The thread's state between batches.
struct Member {
    /// Partitions whose drain the bridge finished ([`ClusterLink::release_drained`]) or
    /// that it fenced itself out of ([`ClusterLink::self_fenced`]); `None` once the sender
    /// is gone.
    drained: Option<Receiver<Ended>>,
    /// Tags whose message's result another instance took ([`ClusterLink::untag`]).
    untagged: Option<Receiver<u64>>,
    store: RedisStore,
    cfg: JournalConfig,
    session_cap: usize,
    gauges: Arc<Gauges>,
    own: Ownership,
    /// The planner's clock starts here.
    zero: Instant,
    next_pass: Instant,
    /// The bridge's tag of each message it accepted → its partition and seq in Redis.
    tags: HashMap<u64, (u32, u64)>,
    /// The reverse of `tags`.
    back: HashMap<(u32, u64), u64>,
    /// Records of a failed write, tried again first (accepts never are).
    retry: Vec<Record>,
    failing: bool,
    /// Redis lost its data or was replaced (`trust.rs`): nothing more is written or owned.
    distrusted: bool,
    /// Until when (this thread's clock) the registry holds this instance live at least, by
    /// the last heartbeat that went through (`pass.rs`, `Member::registered_for`); `None`
    /// before the first. Outside it no accept is written: an owner whose reader never saw
    /// this instance live, or saw it leave, would keep the result for an origin that may
    /// die unnoticed, or answer the message itself while this one waits for it
    /// (tests/simulation_cluster, seeds 382 and 518; tests/cluster_serve's pause).
    registered_until: Option<Instant>,
    /// The WARN of the current lapse was logged.
    lapse_told: bool,
    /// The sender is gone: write what is left, then stop.
    closed: bool,
    /// What the bridge ended, to apply after the next batch.
    to_release: Vec<Ended>,
    /// Partitions acquired, waiting for the fence margin to pass before they are loaded
    /// (`pass.rs`, `Member::gain`): the lease, and when.
    waiting: Vec<(Lease, Instant)>,
}

/// Where a record goes in Redis: its partition and seq, or (an accept) its session.
enum Place {
    Accept {
        partition: u32,
        session: String,
    },
    At {
        partition: u32,
        seq: u64,
    },
    /// Not writable: a tag never placed, or a session key that cannot be built.
    Nowhere,
}

impl Member {
    fn run(&mut self, rx: &Receiver<Record>, out: &Out, stopped: &Receiver<()>, wake: &impl Fn()) {
        loop {
            let mut c = Report::default();
            let load = self.next_load().is_some_and(|at| Instant::now() >= at);
            if Instant::now() >= self.next_pass || load {
                if Instant::now() >= self.next_pass {
                    self.pass(&mut c);
                    self.next_pass = Instant::now() + self.own.pass_every();
                }
                self.load_waiting(&mut c);
                // At once, not after the wait for records: a gained partition's messages
                // and a lost one's end must not wait for traffic.
                if c != Report::default() {
                    // The pass wrote nothing: records kept for another try are still not
                    // written, and the bridge must not release the turns that wait for
                    // them (tests/simulation_cluster, seed 1).
                    c.retrying = self.retry.len();
                    if !out.send(std::mem::take(&mut c)) {
                        return;
                    }
                    wake();
                }
            }
            // A batch is always reported, even one of kept records alone that now went
            // through: the bridge releases what waited for a successful write.
            let batch = self.next_batch(rx);
            let wrote = batch.is_some();
            if let Some((batch, kept)) = batch {
                self.commit(batch, kept, &mut c);
            }
            self.release_drained(&mut c);
            let owned = self.own.held().map(|l| l.partition);
            (self.gauges).publish_history(Some(self.store.history_status(owned)));
            if wrote || c != Report::default() {
                if !out.send(c) {
                    return;
                }
                wake();
            }
            if self.closed && self.retry.is_empty() {
                return;
            }
            if self.closed
                && self.failing
                && stopped.recv_timeout(self.cfg.retry_every) == Err(RecvTimeoutError::Disconnected)
            {
                // Shutting down with Redis failing: the caller's finish() bounds the wait.
                return;
            }
        }
    }

    /// The kept records, then what arrives before the next ownership pass is due (up to
    /// `max_batch` new ones); `None` if there is nothing to write.
    fn next_batch(&mut self, rx: &Receiver<Record>) -> Option<(Vec<Record>, usize)> {
        let mut batch = std::mem::take(&mut self.retry);
        let kept = batch.len();
        let next = self
            .next_load()
            .map_or(self.next_pass, |at| at.min(self.next_pass));
        let mut wait = next.saturating_duration_since(Instant::now());
        if kept > 0 {
            wait = wait.min(self.cfg.retry_every);
        }
        if !self.closed {
            let never = crossbeam_channel::never();
            let drained = self.drained.as_ref().unwrap_or(&never);
            let never_tag = crossbeam_channel::never();
            let untagged = self.untagged.as_ref().unwrap_or(&never_tag);
            crossbeam_channel::select! {
                recv(rx) -> r => match r {
                    Ok(r) => batch.push(r),
                    Err(_) => self.closed = true,
                },
                recv(drained) -> p => match p {
                    Ok(p) => self.to_release.push(p),
                    Err(_) => self.drained = None,
                },
                recv(untagged) -> t => match t {
                    Ok(t) => {
                        if let Some(at) = self.tags.remove(&t) {
                            self.back.remove(&at);
                        }
                    }
                    Err(_) => self.untagged = None,
                },
                default(wait) => {}
            }
        }
        while batch.len() < self.cfg.max_batch.max(1) + kept && !self.closed {
            match rx.try_recv() {
                Ok(r) => batch.push(r),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => self.closed = true,
            }
        }
        (!batch.is_empty()).then_some((batch, kept))
    }

    fn place(&self, r: &Record) -> Place {
        let tagged = |tag: u64| {
            tag_parts(tag)
                .or_else(|| self.tags.get(&tag).copied())
                .map_or(Place::Nowhere, |(partition, seq)| Place::At {
                    partition,
                    seq,
                })
        };
        match r {
            Record::Accepted(m) => match session_of(m) {
                Some(session) => Place::Accept {
                    partition: partition_of(&session, self.store.partitions()),
                    session,
                },
                None => Place::Nowhere,
            },
            Record::Started { seq, .. }
            | Record::Outcome { seq, .. }
            | Record::Delivered { seq }
            | Record::Forget { seq } => tagged(*seq),
        }
    }

    /// `batch` as it may be written: while the registry may not hold this instance live
    /// (`Member::registered_now`), its accepts are left out, refused `storage` as while Redis
    /// is out of reach.
    fn accepts_refused_unless_registered(
        &mut self,
        batch: Vec<Record>,
        c: &mut Report,
    ) -> Vec<Record> {
        if self.registered_now() {
            return batch;
        }
        let refused = c.failed.len();
        let batch: Vec<Record> = (batch.into_iter())
            .filter(|r| match r {
                Record::Accepted(m) => {
                    c.failed.push(m.seq);
                    false
                }
                _ => true,
            })
            .collect();
        // Once a lapse (a peer's messages must not flood the log).
        if c.failed.len() > refused && self.registered_until.is_some() && !self.lapse_told {
            self.lapse_told = true;
            log::warn!(
                "cluster: this instance's registry entry may have lapsed (no heartbeat through in time): new messages are rejected `storage` until one is"
            );
        }
        batch
    }

    /// Writes one batch in one round trip and reports each record's fate in `c`.
    fn commit(&mut self, batch: Vec<Record>, kept: usize, c: &mut Report) {
        c.taken += batch.len() - kept;
        if self.distrusted {
            self.refuse(batch, c);
            return;
        }
        let batch = self.accepts_refused_unless_registered(batch, c);
        let places: Vec<Place> = batch.iter().map(|r| self.place(r)).collect();
        let ops = to_ops(&batch, &places, &self.own, self.session_cap);
        let started = Instant::now();
        let sent: Vec<Op<'_>> = ops.iter().map(|(_, op)| *op).collect();
        let result = self.store.write(&sent, now_ms());
        self.gauges.record(started.elapsed());
        let written: Vec<usize> = ops.iter().map(|(i, _)| *i).collect();
        drop(sent);
        drop(ops);
        let mut retry = vec![false; batch.len()];
        let mut error: Option<String> = None;
        match result {
            Err(e) => {
                for i in &written {
                    retry[*i] = true;
                    if let Record::Accepted(m) = &batch[*i] {
                        c.failed.push(m.seq);
                    }
                }
                error = Some(e.message);
            }
            Ok(answers) => {
                for (i, answer) in written.iter().zip(answers) {
                    if let Err(e) = self.answered(&batch[*i], &places[*i], answer, c) {
                        retry[*i] = true;
                        error.get_or_insert(e.message);
                    }
                }
            }
        }
        // Only the outcome records written are reported (kept ones included, once they go
        // through): the bridge sends a result once its record is, and a report that wrote
        // nothing (the ownership pass's) must not release one whose record failed and is
        // kept (found by tests/cluster_three's Redis restart: results went out with no
        // outcome record).
        for i in &written {
            if let (false, Record::Outcome { seq, .. }) = (retry[*i], &batch[*i])
                && !c.cluster.unwritten_outcomes.contains(seq)
            {
                c.outcomes.push(*seq);
            }
        }
        // What was not sent: an owned write of a partition not held (fenced: dropped), an
        // accept without a session key (failed), a record of a tag never placed.
        let mut was_sent = vec![false; batch.len()];
        for i in &written {
            was_sent[*i] = true;
        }
        for ((r, place), _) in batch
            .iter()
            .zip(&places)
            .zip(&was_sent)
            .filter(|(_, sent)| !**sent)
        {
            match (r, place) {
                (Record::Accepted(m), _) => {
                    log::error!("message {}: no session key; rejected storage", m.id());
                    c.failed.push(m.seq);
                }
                (_, Place::At { partition, .. }) => {
                    c.cluster.fenced.push(*partition);
                    if let Record::Outcome { seq, .. } = r {
                        c.cluster.unwritten_outcomes.push(*seq);
                    }
                }
                _ => log::debug!("record of message {}: never placed; dropped", r.seq()),
            }
        }
        self.settle(batch, &retry, error, c);
        self.note_distrust(c);
    }

    /// One record's answer: its effect on `c` and on the maps; `Err` to try it again.
    fn answered(
        &mut self,
        r: &Record,
        place: &Place,
        answer: Result<Done, StoreError>,
        c: &mut Report,
    ) -> Result<(), StoreError> {
        match (r, place, answer) {
            (Record::Accepted(m), Place::Accept { partition, .. }, Ok(Done::Accepted(a))) => {
                match a {
                    Accept::New { seq, ahead } => {
                        self.tags.insert(m.seq, (*partition, seq));
                        self.back.insert((*partition, seq), m.seq);
                        c.cluster.placed.push((m.seq, cluster_tag(*partition, seq)));
                        // Its position for every ack: one the bridge reports as owned
                        // elsewhere after all (it fenced itself out meanwhile) needs it.
                        c.cluster.ahead.push((m.seq, ahead));
                        // A draining partition queues nothing new here: its next owner
                        // loads the message, and this bridge waits for its outcome.
                        let (p, own) = (*partition, &self.own);
                        if own.holds(p) && !own.is_draining(p) && !self.is_waiting(p) {
                            c.durable.push(m.seq);
                        } else {
                            c.cluster.remote.push(m.seq);
                        }
                    }
                    Accept::Duplicate => c.cluster.duplicates.push(m.seq),
                    Accept::SessionFull => c.cluster.session_full.push(m.seq),
                }
                Ok(())
            }
            (Record::Accepted(m), _, other) => {
                c.failed.push(m.seq);
                match other {
                    Err(e) => Err(e),
                    Ok(_) => Err(StoreError::untrusted(
                        "redis: accept: not an accept's answer",
                    )),
                }
            }
            (_, Place::At { partition, .. }, Err(e)) if e.is_fenced() => {
                log::warn!("{e}; the partition is dropped");
                self.own.fenced(*partition);
                c.cluster.fenced.push(*partition);
                if let Record::Outcome { seq, .. } = r {
                    c.cluster.unwritten_outcomes.push(*seq);
                }
                Ok(())
            }
            (Record::Delivered { seq } | Record::Forget { seq }, _, Ok(_)) => {
                if let Some(at) = self.tags.remove(seq) {
                    self.back.remove(&at);
                }
                Ok(())
            }
            (_, _, answer) => answer.map(|_| ()),
        }
    }

    /// Keeps what must be tried again (never an accept), logs the change between failing
    /// and working once each, tidies the report.
    fn settle(
        &mut self,
        batch: Vec<Record>,
        retry: &[bool],
        error: Option<String>,
        c: &mut Report,
    ) {
        self.retry = batch
            .into_iter()
            .zip(retry)
            .filter(|(r, again)| **again && !matches!(r, Record::Accepted(_)))
            .map(|(r, _)| r)
            .collect();
        debug_assert!(
            self.retry.iter().all(|r| !matches!(r, Record::Accepted(_))),
            "an accept is never written twice"
        );
        c.retrying = self.retry.len();
        match (&error, self.failing) {
            (Some(e), false) => {
                log::error!(
                    "cluster journal write failed: {e}; new messages are rejected `storage` until writes succeed again"
                );
                self.failing = true;
            }
            (None, true) => {
                log::info!("cluster journal writes succeed again; accepting messages");
                self.failing = false;
            }
            _ => {}
        }
        c.error = error;
        c.cluster.fenced.sort_unstable();
        c.cluster.fenced.dedup();
    }
}

/// The operations of a batch, each with the index of its record; an owned write of a
/// partition not held and a record without a place are left out.
fn to_ops<'a>(
    batch: &'a [Record],
    places: &'a [Place],
    own: &'a Ownership,
    session_cap: usize,
) -> Vec<(usize, Op<'a>)> {
    let mut ops: Vec<(usize, Op<'_>)> = Vec::with_capacity(batch.len());
    for (i, (r, place)) in batch.iter().zip(places).enumerate() {
        let op = match (r, place) {
            (Record::Accepted(message), Place::Accept { partition, session }) => Op::Accept {
                partition: *partition,
                session,
                message,
                session_cap,
            },
            (Record::Started { attempt, .. }, Place::At { partition, seq }) => {
                match own.lease(*partition) {
                    Some(lease) => Op::Started {
                        lease,
                        seq: *seq,
                        attempt: *attempt,
                    },
                    None => continue,
                }
            }
            (Record::Outcome { outcome, .. }, Place::At { partition, seq }) => {
                match own.lease(*partition) {
                    Some(lease) => Op::Outcome {
                        lease,
                        seq: *seq,
                        outcome,
                    },
                    None => continue,
                }
            }
            (Record::Delivered { .. }, Place::At { partition, seq }) => Op::Delivered {
                partition: *partition,
                seq: *seq,
            },
            (Record::Forget { .. }, Place::At { partition, seq }) => Op::Forget {
                partition: *partition,
                seq: *seq,
            },
            _ => continue,
        };
        ops.push((i, op));
    }
    ops
}

/// The session key of a stored message, as the bridge built it when it admitted it.
fn session_of(m: &StoredMessage) -> Option<String> {
    let f = &m.fields;
    SessionKey::new(
        m.platform(),
        f.chat_type,
        &f.chat_id,
        f.thread_id.as_deref(),
        f.user_id.as_deref(),
    )
    .ok()
    .map(|k| k.as_str().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::ChatType;
    use crate::wire::MessageFields;

    #[test]
    fn a_cluster_tag_gives_back_its_partition_and_seq_and_never_looks_like_a_bridges() {
        for (p, seq) in [(0, 1), (63, 12_345), (1 << 20, (1 << SEQ_BITS) - 1)] {
            let t = cluster_tag(p, seq);
            assert_eq!(tag_parts(t), Some((p, seq)));
        }
        assert_eq!(tag_parts(1), None);
        assert_eq!(tag_parts(u64::MAX >> 1), None);
        assert_ne!(cluster_tag(1, 2), cluster_tag(2, 1));
    }

    #[test]
    fn the_session_of_a_stored_message_is_the_bridges_key() {
        let fields = MessageFields {
            chat_type: ChatType::Group,
            user_id: Some("u".into()),
            ..MessageFields::new("m", "g:1", "hi")
        };
        let m = StoredMessage::new(1, "telegram", fields, 0);
        let key =
            SessionKey::new("telegram", ChatType::Group, "g:1", None, Some("u")).expect("key");
        assert_eq!(session_of(&m).as_deref(), Some(key.as_str()));
        let mut bad = m;
        bad.fields.chat_id = String::new();
        assert_eq!(session_of(&bad), None);
    }
}
