//! Durability: the journal of accepted messages, their turns, outcomes and deliveries.
//!
//! With `--data-dir`, every message is written to a [`Store`] before it is acknowledged, and
//! everything that happens to it afterwards (its turn started, its terminal outcome, the
//! bridge's confirmation that it received that outcome) is recorded too, so that a restart
//! after a crash can rebuild the queues, put undelivered outcomes back into their outboxes
//! and tell which turns were interrupted. A message leaves the store once its outcome is
//! delivered, so the store holds what is in flight (plus the duplicate window's ids).
//!
//! All writes happen on the journal thread ([`Journal`]), never on the reactor: it takes
//! every record queued, writes them in one transaction, syncs, and reports back over a
//! channel and a `mio::Waker` (group commit).
//!
//! The [`Store`] trait is small on purpose: a replicated log can implement the same five
//! operations (append accepted, mark started, record outcome, mark delivered, load); its
//! two provided methods (idle housekeeping, size on disk) need not be written. A
//! [`StoreError`]'s kind says whether a failure may pass ([`StoreErrorKind::Transient`]:
//! a full disk) or the journal cannot be trusted ([`StoreErrorKind::Untrusted`]: records
//! acknowledged as durable are missing), which start-up tells apart (exit 1 or 2).

#[cfg(feature = "sqlite")]
mod mark;
pub(crate) mod memory;
#[cfg(feature = "sqlite")]
mod sqlite;
pub(crate) mod thread;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::liveness::HistoryStatus;
use crate::wire::MessageFields;

pub use memory::MemoryUpdate;
#[cfg(feature = "sqlite")]
pub use sqlite::SqliteStore;
#[cfg(feature = "sqlite")]
pub(crate) use sqlite::history::export as export_history;
pub use thread::{Committed, Journal, JournalConfig};

/// A message as it was accepted: enough to rebuild it exactly. Its fields are the protocol's
/// [`MessageFields`], with `platform` always set (the connection's hello platform when the
/// line named none); stores write them in the columns they always had (`chat_type` by its
/// name).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredMessage {
    /// Journal order: the bridge's route tag, increasing across restarts.
    pub seq: u64,
    /// The message's fields (`platform` set).
    pub fields: MessageFields,
    /// Wall-clock time (ms since the Unix epoch) until which the id is a duplicate.
    pub dedup_until_ms: u64,
}

impl StoredMessage {
    /// The record of the message `fields` on `platform`, journaled as `seq`.
    pub fn new(
        seq: u64,
        platform: &str,
        mut fields: MessageFields,
        dedup_until_ms: u64,
    ) -> StoredMessage {
        fields.platform = Some(platform.to_owned());
        StoredMessage {
            seq,
            fields,
            dedup_until_ms,
        }
    }

    /// The platform (empty if `fields.platform` was left unset).
    pub fn platform(&self) -> &str {
        self.fields.platform.as_deref().unwrap_or("")
    }

    /// The platform's message id.
    pub fn id(&self) -> &str {
        &self.fields.id
    }
}

/// A terminal line as it goes out: `head`, then `text` escaped as a JSON string body, then
/// `tail` (a short line is all `head`, with `text` and `tail` empty).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct StoredOutcome {
    /// Bytes before the text.
    pub head: Vec<u8>,
    /// The raw text, escaped when written.
    pub text: String,
    /// Bytes after the text (newline included).
    pub tail: Vec<u8>,
    /// What the outcome changes in its session's stored conversation, written in the same
    /// transaction (the openai agent's history with `--data-dir`); not part of the line, and
    /// not read back with it.
    pub memory: Option<MemoryUpdate>,
}

/// One journal record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// A message was accepted (its `ack` waits for this record to be durable).
    Accepted(StoredMessage),
    /// The message's turn started; `attempt` counts its starts, this one included (idempotent:
    /// a retried write sets the same value).
    Started {
        /// The message.
        seq: u64,
        /// Starts so far.
        attempt: u32,
    },
    /// The message's terminal event.
    Outcome {
        /// The message.
        seq: u64,
        /// The line.
        outcome: StoredOutcome,
    },
    /// The bridge has the outcome: the message leaves the journal (its id stays in the
    /// duplicate window until that expires).
    Delivered {
        /// The message.
        seq: u64,
    },
    /// The runtime refused the message after it was journaled: it leaves the journal and the
    /// duplicate window (the bridge was told `reject`, so a retry is new).
    Forget {
        /// The message.
        seq: u64,
    },
}

impl Record {
    /// The message the record is about.
    pub fn seq(&self) -> u64 {
        match self {
            Record::Accepted(m) => m.seq,
            Record::Started { seq, .. }
            | Record::Outcome { seq, .. }
            | Record::Delivered { seq }
            | Record::Forget { seq } => *seq,
        }
    }
}

/// A message found in the store at start-up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecoveredMessage {
    /// The message.
    pub message: StoredMessage,
    /// How many times its turn started (0: it was waiting).
    pub starts: u32,
    /// Its terminal event, if it had one that was not delivered.
    pub outcome: Option<StoredOutcome>,
}

/// What the store held at start-up.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Recovered {
    /// Messages not yet delivered, in journal order.
    pub messages: Vec<RecoveredMessage>,
    /// The duplicate window: (platform, id, until in ms since the epoch), unexpired ones only,
    /// in-flight messages included.
    pub dedup: Vec<(String, String, u64)>,
    /// The highest sequence number ever journaled (new ones continue after it).
    pub max_seq: u64,
}

/// How a caller should take a [`StoreError`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// May go away by itself (the disk is full, an I/O error, the file is locked by another
    /// process): a write is tried again, and a start-up that meets it may be retried (the
    /// CLI exits 1, which a supervisor restarts).
    Transient,
    /// The journal cannot be trusted: records acknowledged as durable are missing (its
    /// mark says more was committed than the database holds), or a file of the journal
    /// cannot be read at all. Starting would drop acknowledged messages silently, so start-up
    /// refuses until an operator acts (the CLI exits 2).
    Untrusted,
    /// The journal cannot be used as configured: another schema version, a directory that
    /// cannot be created, a bridge without `journal` set (the CLI exits 2).
    Unusable,
    /// A partitioned store (`--cluster`) refused an owner's write (`started`, an outcome,
    /// a lease renewal) because the partition's lease is no longer the caller's: nothing was
    /// written, and the caller must drop the partition (its new owner rebuilds it).
    Fenced,
}

/// A store failure: a write that did not become durable, or a store that cannot be read;
/// its kind says whether trying again can help.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreError {
    /// How to take it.
    pub kind: StoreErrorKind,
    /// What failed, naming the file.
    pub message: String,
}

impl StoreError {
    /// A failure that may go away by itself.
    pub fn transient(message: impl Into<String>) -> StoreError {
        StoreError {
            kind: StoreErrorKind::Transient,
            message: message.into(),
        }
    }

    /// A journal that cannot be trusted (start-up must refuse).
    pub fn untrusted(message: impl Into<String>) -> StoreError {
        StoreError {
            kind: StoreErrorKind::Untrusted,
            message: message.into(),
        }
    }

    /// A journal that cannot be used as configured.
    pub fn unusable(message: impl Into<String>) -> StoreError {
        StoreError {
            kind: StoreErrorKind::Unusable,
            message: message.into(),
        }
    }

    /// An owner's write refused: the partition's lease is another's (nothing was written).
    pub fn fenced(message: impl Into<String>) -> StoreError {
        StoreError {
            kind: StoreErrorKind::Fenced,
            message: message.into(),
        }
    }

    /// Whether the write was refused because the caller no longer owns the partition.
    pub fn is_fenced(&self) -> bool {
        self.kind == StoreErrorKind::Fenced
    }

    /// Whether trying again later may succeed (start-up: exit 1 rather than 2).
    pub fn is_transient(&self) -> bool {
        self.kind == StoreErrorKind::Transient
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for StoreError {}

/// Where the journal lives. Implementations must make [`Store::write`] atomic (all records
/// of a batch or none) and durable when it returns `Ok`.
pub trait Store: Send {
    /// Appends a batch of records in one transaction and syncs it (append accepted, mark
    /// started, record outcome, mark delivered).
    fn write(&mut self, batch: &[Record]) -> Result<(), StoreError>;

    /// Reads what survives, for start-up recovery; `now_ms` (ms since the epoch) drops
    /// expired duplicate-window ids. A damaged store is an error, never a guess.
    fn load(&mut self, now_ms: u64) -> Result<Recovered, StoreError>;

    /// Housekeeping while nothing is written: the journal thread calls it once its queue
    /// has been empty for [`JournalConfig::idle_after`] after a write (the SQLite store
    /// checkpoints its write-ahead log and gives freed pages back). Returns
    /// [`Store::disk_bytes`] after it. Best effort: a failure is logged, not returned.
    fn idle(&mut self) -> Option<u64> {
        self.disk_bytes()
    }

    /// The bytes the store takes on disk, if it has files (the status and the metrics show
    /// them).
    fn disk_bytes(&self) -> Option<u64> {
        None
    }

    /// Its stored conversations' figures (`journal.history` in the status), if it keeps
    /// them ([`StoredOutcome::memory`]).
    fn history(&self) -> Option<HistoryStatus> {
        None
    }
}

impl<S: Store + ?Sized> Store for Box<S> {
    fn write(&mut self, batch: &[Record]) -> Result<(), StoreError> {
        (**self).write(batch)
    }
    fn load(&mut self, now_ms: u64) -> Result<Recovered, StoreError> {
        (**self).load(now_ms)
    }
    fn idle(&mut self) -> Option<u64> {
        (**self).idle()
    }
    fn disk_bytes(&self) -> Option<u64> {
        (**self).disk_bytes()
    }
    fn history(&self) -> Option<HistoryStatus> {
        (**self).history()
    }
}

/// The model state every store must reproduce: what [`Store::load`] returns after a batch
/// sequence. [`MemStore`] is this, and the proptest compares the SQLite store against it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Model {
    messages: BTreeMap<u64, RecoveredMessage>,
    dedup: BTreeMap<(String, String), u64>,
    max_seq: u64,
}

impl Model {
    /// Applies one record.
    pub fn apply(&mut self, r: &Record) {
        match r {
            Record::Accepted(m) => {
                self.max_seq = self.max_seq.max(m.seq);
                self.dedup.insert(
                    (m.platform().to_owned(), m.id().to_owned()),
                    m.dedup_until_ms,
                );
                self.messages.insert(
                    m.seq,
                    RecoveredMessage {
                        message: m.clone(),
                        starts: 0,
                        outcome: None,
                    },
                );
            }
            Record::Started { seq, attempt } => {
                if let Some(m) = self.messages.get_mut(seq) {
                    m.starts = *attempt;
                }
            }
            Record::Outcome { seq, outcome } => {
                if let Some(m) = self.messages.get_mut(seq) {
                    // The line only: the conversation change is not read back with it.
                    m.outcome = Some(StoredOutcome {
                        memory: None,
                        ..outcome.clone()
                    });
                }
            }
            Record::Delivered { seq } => {
                self.messages.remove(seq);
            }
            Record::Forget { seq } => {
                if let Some(m) = self.messages.remove(seq) {
                    let (p, id) = (m.message.platform(), m.message.id());
                    self.dedup.remove(&(p.to_owned(), id.to_owned()));
                }
            }
        }
    }

    /// What a load at `now_ms` returns.
    pub fn recovered(&self, now_ms: u64) -> Recovered {
        Recovered {
            messages: self.messages.values().cloned().collect(),
            dedup: self
                .dedup
                .iter()
                .filter(|(_, until)| **until > now_ms)
                .map(|((p, i), until)| (p.clone(), i.clone(), *until))
                .collect(),
            max_seq: self.max_seq,
        }
    }
}

/// A store in memory, shared between clones: a "restart" opens a clone of the same store.
/// For tests and for embedding without a disk.
#[derive(Clone, Default)]
pub struct MemStore {
    state: Arc<Mutex<Model>>,
}

impl MemStore {
    /// An empty store.
    pub fn new() -> MemStore {
        MemStore::default()
    }
}

impl Store for MemStore {
    fn write(&mut self, batch: &[Record]) -> Result<(), StoreError> {
        let mut m = self
            .state
            .lock()
            .map_err(|_| StoreError::transient("memory store poisoned"))?;
        for r in batch {
            m.apply(r);
        }
        Ok(())
    }

    fn load(&mut self, now_ms: u64) -> Result<Recovered, StoreError> {
        let m = self
            .state
            .lock()
            .map_err(|_| StoreError::transient("memory store poisoned"))?;
        Ok(m.recovered(now_ms))
    }
}

/// A store that fails every write while its switch is on: how the tests inject a full or
/// failing disk.
pub struct FaultyStore<S> {
    inner: S,
    failing: Arc<AtomicBool>,
}

impl<S: Store> FaultyStore<S> {
    /// Wraps `inner`; returns the switch (true: writes fail with "injected fault").
    pub fn new(inner: S) -> (FaultyStore<S>, Arc<AtomicBool>) {
        let failing = Arc::new(AtomicBool::new(false));
        (
            FaultyStore {
                inner,
                failing: failing.clone(),
            },
            failing,
        )
    }
}

impl<S: Store> Store for FaultyStore<S> {
    fn write(&mut self, batch: &[Record]) -> Result<(), StoreError> {
        if self.failing.load(Ordering::SeqCst) {
            return Err(StoreError::transient(
                "injected fault: no space left on device",
            ));
        }
        self.inner.write(batch)
    }

    fn load(&mut self, now_ms: u64) -> Result<Recovered, StoreError> {
        self.inner.load(now_ms)
    }

    fn idle(&mut self) -> Option<u64> {
        self.inner.idle()
    }

    fn disk_bytes(&self) -> Option<u64> {
        self.inner.disk_bytes()
    }

    fn history(&self) -> Option<HistoryStatus> {
        self.inner.history()
    }
}

/// Wall-clock milliseconds since the Unix epoch (0 if the clock is before it).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// FNV-1a, 64 bits: a checksum over a record's fields, so that a scribbled row is refused at
/// load instead of rebuilding a message nobody sent. Not a defence against an adversary.
#[cfg(any(feature = "sqlite", test))]
pub(crate) fn checksum(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        // The length first, so that moving bytes between fields changes the sum.
        for b in (p.len() as u64).to_le_bytes().iter().chain(p.iter()) {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::checksum;

    #[test]
    fn the_checksum_sees_every_bit_and_where_bytes_are() {
        let zero = checksum(&[&[0]]);
        for bit in 0..8 {
            assert_ne!(checksum(&[&[1 << bit]]), zero, "bit {bit}");
        }
        assert_ne!(checksum(&[b"ab", b""]), checksum(&[b"a", b"b"]));
        assert_ne!(checksum(&[b"ab"]), checksum(&[b"ba"]));
    }
}
