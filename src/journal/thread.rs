//! The journal thread: group commit off the reactor.
//!
//! The reactor sends records over an unbounded channel (its depth is bounded by the bridge:
//! at most `max_pending_durable` accepted messages wait, and every other record belongs to a
//! message in flight, a handful each). The thread takes everything queued (up to
//! `max_batch` records), writes it in one transaction, syncs, sends a [`Committed`] and
//! wakes the reactor.
//!
//! When a write fails, the accepted messages of the batch are reported failed (the bridge
//! rejects them `storage`, none was acknowledged) and every other record is kept and written
//! again with the next batch, or after `retry_every` if nothing new comes: they are
//! idempotent, and they are about messages that were acknowledged, which must not be lost.
//! One ERROR is logged when writes start failing and one INFO when they succeed again.
//! After a failure the kept records are written alone first, so that outcomes and
//! deliveries get through even while every batch with a new message fails (a full disk:
//! they are what frees space).
//!
//! Once the queue has been empty for `idle_after` after a write, the thread calls
//! [`Store::idle`] (the SQLite store checkpoints and gives space back), and it publishes the
//! store's size on disk after each write and each idle pass.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};

use super::{Record, Store};
use crate::histogram::{JOURNAL_BUCKETS, PromHistogram};
use crate::liveness::HistoryStatus;

/// Settings of the journal thread.
#[derive(Clone, Debug)]
pub struct JournalConfig {
    /// Most records written in one transaction.
    pub max_batch: usize,
    /// How soon a failed write is tried again when nothing new arrives.
    pub retry_every: Duration,
    /// How long the queue stays empty after a write before the store's idle housekeeping.
    pub idle_after: Duration,
}

impl Default for JournalConfig {
    fn default() -> Self {
        JournalConfig {
            max_batch: 4096,
            retry_every: Duration::from_millis(100),
            idle_after: Duration::from_millis(500),
        }
    }
}

/// What one transaction achieved.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Committed {
    /// Accepted messages now durable.
    pub durable: Vec<u64>,
    /// Accepted messages whose write failed (never durable; reject them `storage`).
    pub failed: Vec<u64>,
    /// Messages whose outcome record this transaction took (written if `error` is `None`;
    /// else kept for another try, see `retrying`). What this releases is the bridge's rule,
    /// stated where it is enforced (`Durable::committed`, server/bridge/durable.rs).
    pub outcomes: Vec<u64>,
    /// New records this transaction took off the queue (retried ones not counted again).
    pub taken: usize,
    /// Records kept for another try after a failure (0 when the write succeeded).
    pub retrying: usize,
    /// The write failed; its error.
    pub error: Option<String>,
}

/// `u64::MAX` in [`Journal::disk_bytes`]: the store has not said.
const UNKNOWN: u64 = u64::MAX;

/// What the thread measures and the reactor reads, without a lock: the store's size on
/// disk and how long its writes take.
pub(crate) struct Gauges {
    disk: AtomicU64,
    /// Writes per bucket of [`JOURNAL_BUCKETS`] (not cumulative, `+Inf` last).
    buckets: Vec<AtomicU64>,
    /// The writes' total time, in nanoseconds.
    sum_ns: AtomicU64,
    /// The store's stored conversations: sessions ([`UNKNOWN`]: the store keeps none),
    /// bytes, evicted, expired.
    history: [AtomicU64; 4],
}

impl Gauges {
    pub(crate) fn publish_history(&self, h: Option<HistoryStatus>) {
        let values = h.map_or([UNKNOWN, 0, 0, 0], |h| {
            [h.sessions, h.bytes, h.evicted, h.expired]
        });
        for (gauge, v) in self.history.iter().zip(values) {
            gauge.store(v, Ordering::Relaxed);
        }
    }

    pub(crate) fn record(&self, d: Duration) {
        let s = d.as_secs_f64();
        let i = JOURNAL_BUCKETS.partition_point(|&b| b < s);
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(
            d.as_nanos().min(u128::from(u64::MAX)) as u64,
            Ordering::Relaxed,
        );
    }
}

/// The journal thread's handle, owned by the reactor side.
pub struct Journal {
    tx: Option<Sender<Record>>,
    done: Receiver<Committed>,
    /// Dropped when the owner gives up on the thread (or is dropped): a thread waiting out
    /// a retry period on a failing store then ends at once.
    stop: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
    /// The store's size on disk as the thread last saw it, and its write times.
    gauges: Arc<Gauges>,
}

impl Journal {
    /// Starts the thread writing to `store`; `wake` is called after each completion is sent
    /// (the reactor's `mio::Waker`).
    pub fn start<S, W>(store: S, cfg: JournalConfig, wake: W) -> std::io::Result<Journal>
    where
        S: Store + 'static,
        W: Fn() + Send + 'static,
    {
        let disk = store.disk_bytes();
        let history = store.history();
        let journal = Journal::spawn(disk, move |rx, done, stopped, gauges| {
            run(store, cfg, rx, done, &stopped, wake, &gauges)
        })?;
        journal.gauges.publish_history(history);
        Ok(journal)
    }

    /// Starts `body` on the journal thread with the channels it serves: the records, the
    /// completions, the stop signal (disconnected when the owner gives up) and the gauges.
    pub(crate) fn spawn<F>(disk: Option<u64>, body: F) -> std::io::Result<Journal>
    where
        F: FnOnce(Receiver<Record>, Sender<Committed>, Receiver<()>, Arc<Gauges>) + Send + 'static,
    {
        // Bounded by the bridge: a record is sent only for a message admitted within the
        // journal's room (`Durable::room`, `--max-pending-durable`) or for one already in it
        // (its start, outcome, delivery); one completion per batch of those records.
        let (tx, rx) = crossbeam_channel::unbounded();
        let (done_tx, done) = crossbeam_channel::unbounded();
        let (stop, stopped) = crossbeam_channel::bounded(0);
        let gauges = Arc::new(Gauges {
            disk: AtomicU64::new(disk.unwrap_or(UNKNOWN)),
            buckets: (0..=JOURNAL_BUCKETS.len())
                .map(|_| AtomicU64::new(0))
                .collect(),
            sum_ns: AtomicU64::new(0),
            history: [UNKNOWN, 0, 0, 0].map(AtomicU64::new),
        });
        let seen = gauges.clone();
        let thread = std::thread::Builder::new()
            .name("turnstile-journal".into())
            .spawn(move || body(rx, done_tx, stopped, seen))?;
        Ok(Journal {
            tx: Some(tx),
            done,
            stop: Some(stop),
            thread: Some(thread),
            gauges,
        })
    }

    /// The bytes the store takes on disk, as of its last write or idle pass (None: the
    /// store does not say, e.g. in memory).
    pub fn disk_bytes(&self) -> Option<u64> {
        match self.gauges.disk.load(Ordering::Relaxed) {
            UNKNOWN => None,
            n => Some(n),
        }
    }

    /// The store's stored conversations, as of its last write or idle pass (None: the
    /// store keeps none).
    pub(crate) fn history(&self) -> Option<HistoryStatus> {
        let [sessions, bytes, evicted, expired] = self
            .gauges
            .history
            .each_ref()
            .map(|g| g.load(Ordering::Relaxed));
        (sessions != UNKNOWN).then_some(HistoryStatus {
            sessions,
            bytes,
            evicted,
            expired,
        })
    }

    /// How long the store's writes took (commit, sync, mark), since the thread started.
    pub fn write_seconds(&self) -> PromHistogram {
        let g = &self.gauges;
        PromHistogram::from_counts(
            JOURNAL_BUCKETS,
            g.buckets
                .iter()
                .map(|b| b.load(Ordering::Relaxed))
                .collect(),
            g.sum_ns.load(Ordering::Relaxed) as f64 / 1e9,
        )
    }

    /// Queues a record (never blocks).
    pub fn send(&self, r: Record) {
        if let Some(tx) = &self.tx
            && tx.send(r).is_err()
        {
            log::error!("the journal thread is gone; a record was not written");
        }
    }

    /// Records queued and not yet taken by the thread.
    pub fn queued(&self) -> usize {
        self.tx.as_ref().map_or(0, Sender::len)
    }

    /// The completions reported since the last call.
    pub fn completions(&self) -> impl Iterator<Item = Committed> + '_ {
        self.done.try_iter()
    }

    /// Stops taking records, waits up to `limit` for the thread to write what is queued, and
    /// returns the completions it reported meanwhile; false if it did not finish in time.
    pub fn finish(&mut self, limit: Duration) -> (Vec<Committed>, bool) {
        self.tx = None;
        let deadline = std::time::Instant::now() + limit;
        let mut out = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.done.recv_timeout(left) {
                Ok(c) => out.push(c),
                Err(RecvTimeoutError::Disconnected) => {
                    if let Some(t) = self.thread.take() {
                        let _ = t.join();
                    }
                    return (out, true);
                }
                Err(RecvTimeoutError::Timeout) => {
                    self.stop = None;
                    return (out, false);
                }
            }
        }
    }
}

fn run<S: Store, W: Fn()>(
    store: S,
    cfg: JournalConfig,
    rx: Receiver<Record>,
    done: Sender<Committed>,
    stopped: &Receiver<()>,
    wake: W,
    gauges: &Gauges,
) {
    let mut w = Writer {
        store,
        cfg,
        gauges,
        retry: Vec::new(),
        failing: false,
        closed: false,
        dirty: false,
    };
    loop {
        let Some((batch, kept)) = w.next_batch(&rx) else {
            return;
        };
        let c = w.commit(batch, kept);
        if done.send(c).is_err() {
            return;
        }
        wake();
        if w.closed && w.retry.is_empty() {
            return;
        }
        if w.closed && w.failing {
            // Shutting down with a failing store: one more try per retry period would keep
            // the process alive forever; the caller's finish() bounds the wait, and giving
            // up ends this wait at once.
            if stopped.recv_timeout(w.cfg.retry_every) == Err(RecvTimeoutError::Disconnected) {
                return;
            }
        }
    }
}

/// The journal thread's state between batches.
struct Writer<'g, S> {
    store: S,
    cfg: JournalConfig,
    gauges: &'g Gauges,
    /// Records of a failed write, tried again first (accepted messages are not: they were
    /// answered `storage`).
    retry: Vec<Record>,
    failing: bool,
    /// The sender is gone: write what is left, then stop.
    closed: bool,
    /// Written since the last idle pass.
    dirty: bool,
}

impl<S: Store> Writer<'_, S> {
    /// The next batch: the records kept from a failed write, then what arrived, up to
    /// `max_batch` new ones; with how many were kept. `None` once the sender is gone and
    /// nothing is left.
    fn next_batch(&mut self, rx: &Receiver<Record>) -> Option<(Vec<Record>, usize)> {
        let mut batch = std::mem::take(&mut self.retry);
        let kept = batch.len();
        if batch.is_empty() {
            batch.push(self.wait_first(rx)?);
        } else if !self.closed {
            match rx.recv_timeout(self.cfg.retry_every) {
                Ok(r) => batch.push(r),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => self.closed = true,
            }
        }
        while batch.len() < self.cfg.max_batch.max(1) + kept && !self.closed {
            match rx.try_recv() {
                Ok(r) => batch.push(r),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => self.closed = true,
            }
        }
        Some((batch, kept))
    }

    /// Blocks for the first record of a batch, giving the store its idle pass if nothing
    /// arrives for `idle_after` after a write.
    fn wait_first(&mut self, rx: &Receiver<Record>) -> Option<Record> {
        if self.dirty {
            match rx.recv_timeout(self.cfg.idle_after) {
                Ok(r) => return Some(r),
                Err(RecvTimeoutError::Timeout) => {
                    let disk = self.store.idle();
                    self.publish(disk);
                    self.dirty = false;
                }
                Err(RecvTimeoutError::Disconnected) => return None,
            }
        }
        rx.recv().ok()
    }

    fn publish(&self, disk: Option<u64>) {
        self.gauges
            .disk
            .store(disk.unwrap_or(UNKNOWN), Ordering::Relaxed);
        self.gauges.publish_history(self.store.history());
    }

    /// Writes one batch (the kept records alone first, see the module's doc) and says what
    /// became durable, what failed, what will be retried.
    fn commit(&mut self, mut batch: Vec<Record>, kept: usize) -> Committed {
        let taken = batch.len() - kept;
        let outcomes = batch[kept..]
            .iter()
            .filter_map(|r| match r {
                Record::Outcome { seq, .. } => Some(*seq),
                _ => None,
            })
            .collect();
        let mut c = Committed {
            taken,
            outcomes,
            ..Committed::default()
        };
        let started = Instant::now();
        // The new records after the kept ones, so the order of the records is the order
        // they were sent in.
        if kept > 0 && taken > 0 && self.store.write(&batch[..kept]).is_ok() {
            batch.drain(..kept);
        }
        let result = if batch.is_empty() {
            Ok(())
        } else {
            self.store.write(&batch)
        };
        self.gauges.record(started.elapsed());
        match result {
            Ok(()) => {
                if self.failing {
                    log::info!("journal writes succeed again; accepting messages");
                    self.failing = false;
                }
                self.dirty = true;
                c.durable = accepted(&batch);
            }
            Err(e) => {
                if !self.failing {
                    log::error!(
                        "journal write failed: {e}; new messages are rejected `storage` until writes succeed again"
                    );
                    self.failing = true;
                }
                c.failed = accepted(&batch);
                self.retry = batch
                    .into_iter()
                    .filter(|r| !matches!(r, Record::Accepted(_)))
                    .collect();
                c.retrying = self.retry.len();
                c.error = Some(e.message);
            }
        }
        let disk = self.store.disk_bytes();
        self.publish(disk);
        c
    }
}

fn accepted(batch: &[Record]) -> Vec<u64> {
    batch
        .iter()
        .filter_map(|r| match r {
            Record::Accepted(m) => Some(m.seq),
            _ => None,
        })
        .collect()
}
