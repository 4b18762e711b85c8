//! The stream reader of a cluster member (`--cluster`, docs/cluster.md "Where the result
//! goes"): a thread with a Redis connection of its own that blocks on `XREAD` — the inbox
//! of every partition this instance owns (messages other instances accepted, to queue
//! here) and the outcome stream of every partition (results of messages this instance
//! accepted, run elsewhere) — and hands what it finds to the reactor over a channel and its
//! waker. The loop never blocks on Redis; this thread does.
//!
//! Which inboxes it reads is the reactor's to say ([`Reader::own`] with the inbox position
//! of the partition's load, [`Reader::disown`]), from the journal thread's gained, lost and
//! fenced reports. The outcome streams are read from where they ended when the reader
//! started: an outcome published before that is in its message's hash, which the owner's
//! load brings back (docs/cluster.md).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError, TrySendError};

use super::store::{Fetched, Want};
use super::{FwdEntry, RedisStore, Stream, StreamEntry, cluster_tag, tag_parts};
use crate::journal::{RecoveredMessage, StoreError, StoredOutcome};
use crate::liveness::ClusterStatus;

/// How long one `XREAD` waits for an entry: also how soon a change of the owned inboxes,
/// or a stop, takes effect.
const BLOCK: Duration = Duration::from_millis(200);
/// Entries read per stream per call.
const COUNT: usize = 256;
/// How long the reader waits before trying a failed Redis again.
const RETRY: Duration = Duration::from_millis(100);
/// How often the reader reads the registry's live instances (for the status only: the
/// journal thread's pass reads its own for the fair share).
const LIVE_EVERY: Duration = Duration::from_secs(1);
/// How many reads (one a [`LIVE_EVERY`]) look for the messages of an instance that left the
/// registry.
const GONE_READS: u8 = 3;
/// Requests of the reactor (hellos, forwards, their answers) waiting for Redis at most: past
/// it a new one is dropped with a WARN (a hello: the registry names an older one until the
/// next; a forward: asked again; an answer: the forwarder keeps its copies, so the platform
/// may get a result twice, the copy taken marked `redelivery`).
pub(super) const MAX_REQUESTS: usize = 4096;
/// Live instances kept for the status at most (a registry is a handful; a runaway one must
/// not grow the snapshot without bound).
const MAX_LIVE_SHOWN: usize = 256;
/// Arrivals waiting for the reactor at most: past it the reader wakes the reactor and waits
/// for room (backpressure: it reads nothing more meanwhile, and Redis keeps the entries).
pub(super) const MAX_ARRIVALS: usize = 4096;

/// What the reader found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Arrival {
    /// A message another instance accepted into a partition this instance owns, after the
    /// partition's load: queue it unless it is known already (one this instance accepted
    /// into a partition it owned was submitted then, so it never arrives here).
    Message {
        /// Its partition.
        partition: u32,
        /// Its [`cluster_tag`].
        tag: u64,
        /// The message as stored (its `seq` is the tag), its starts and outcome so far.
        message: Box<RecoveredMessage>,
        /// The instance that accepted it.
        origin: String,
    },
    /// A message of a partition this instance owns whose origin (another instance) has left
    /// the registry since the last read: the result it was to send, or will be sent, is this
    /// instance's to send now (marked `redelivery`). Read from the partition as a load reads
    /// it, so its outcome is there if one was recorded.
    OriginGone {
        /// Its partition.
        partition: u32,
        /// Its [`cluster_tag`].
        tag: u64,
        /// The message as stored (its `seq` is the tag), its starts and outcome so far.
        message: Box<RecoveredMessage>,
    },
    /// The outcome of a message this instance accepted was written by this instance itself
    /// (it owned the partition): the entry is not fetched, since the bridge sent the result
    /// once the write's answer came; but the answer may have been lost (a broken
    /// connection, an interrupted call) and the write given up as unwritten, and then this
    /// is the proof that it landed.
    Landed {
        /// Its partition.
        partition: u32,
        /// The message's [`cluster_tag`].
        tag: u64,
    },
    /// Results another instance holds for `platform`, whose newest hello is this instance's
    /// (docs/cluster.md "Where the result goes"): the bridge takes what fits and answers
    /// ([`ClusterRequest::Took`]).
    Forwarded {
        /// The instance that holds them.
        from: String,
        /// Their platform.
        platform: String,
        /// Each result's cluster tag and its message as stored (its `seq` is the tag).
        results: Vec<(u64, Box<RecoveredMessage>)>,
        /// Results it named that are not in Redis with an outcome (delivered, forgotten).
        missing: Vec<u64>,
    },
    /// The answer to this instance's forward of `platform`'s results: the ones taken are the
    /// other instance's now (this one drops its copies), the refused ones stay here.
    Took {
        /// Their platform.
        platform: String,
        /// Taken.
        taken: Vec<u64>,
        /// Refused.
        refused: Vec<u64>,
    },
    /// The reader has passed the inbox of `partition` (owned here) up to message `seq`:
    /// every message another instance accepted into it before `seq` has arrived before
    /// this, so the owner may submit what it accepted itself up to `seq`
    /// (docs/cluster.md "Order across instances"). One per partition and read, after that
    /// read's messages.
    Reached {
        /// Its partition.
        partition: u32,
        /// The highest seq of the inbox entries read (this instance's own included).
        seq: u64,
    },
    /// The outcome of a message this instance accepted, written by the partition's owner.
    Outcome {
        /// Its partition.
        partition: u32,
        /// The message's [`cluster_tag`].
        tag: u64,
        /// The terminal line.
        outcome: StoredOutcome,
    },
}

/// What the bridge asks of the reader's connection (`Action::Cluster`), off the loop.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClusterRequest {
    /// A hello of this platform here: `ts:hello:<platform>` names this instance now.
    Hello(String),
    /// This instance holds these results (cluster tags) of `platform` in its outbox and no
    /// connection of the platform: if the newest hello is another live instance's, they are
    /// offered to it (its `ts:fwd:<instance>` stream).
    Forward {
        /// The platform.
        platform: String,
        /// The results' cluster tags.
        results: Vec<u64>,
    },
    /// The answer to instance `to`'s forward: what was taken here and what was refused.
    Took {
        /// The instance that forwarded them.
        to: String,
        /// Their platform.
        platform: String,
        /// Taken.
        taken: Vec<u64>,
        /// Refused.
        refused: Vec<u64>,
    },
    /// For the journal thread, not the reader: the bridge's message of this tag (its own
    /// numbering) had its result taken by another instance ([`super::ClusterLink::untag`]).
    Untag(u64),
    /// For the journal thread, not the reader: the bridge fenced itself out of this
    /// partition's lease of this epoch ([`super::ClusterLink::self_fenced`]).
    Fenced {
        /// The partition.
        partition: u32,
        /// The lease's epoch.
        epoch: u64,
    },
}

enum Control {
    Own(u32, String),
    Disown(u32),
    Request(ClusterRequest),
}

/// The reader thread's handle, owned by the reactor side. Dropping it stops the thread
/// within one read's wait.
pub struct Reader {
    control: Option<Sender<Control>>,
    arrivals: Receiver<Arrival>,
    thread: Option<JoinHandle<()>>,
    health: Arc<Mutex<Health>>,
}

/// The reader's figures for the status, written by its thread.
#[derive(Default)]
struct Health {
    failures: u64,
    reconnects: u64,
    failing: bool,
    live: Vec<String>,
    /// Requests waiting for Redis, and those dropped at [`MAX_REQUESTS`].
    requests: usize,
    requests_dropped: u64,
}

impl Reader {
    /// Starts reading on `store` (a connection of its own, never the journal thread's);
    /// `wake` is called after each batch of arrivals is sent. The outcome streams are read
    /// from their ends as of this call (read here, before it returns).
    pub fn start<W>(mut store: RedisStore, wake: W) -> Result<Reader, StoreError>
    where
        W: Fn() + Send + 'static,
    {
        let all: Vec<u32> = (0..store.partitions()).collect();
        let outcomes = store.stream_ends(Stream::Outcomes, &all)?;
        let fwd_after = store.fwd_end()?;
        // Control: one message per ownership change the reactor makes (bounded by the
        // partitions) and the bridge's requests (bounded on the thread, MAX_REQUESTS).
        // Arrivals: bounded (MAX_ARRIVALS); a full channel makes the reader wait, and the
        // handle's drop lets go of the receiver before it joins the thread, so a reader
        // waiting for room ends too.
        let (control, ctl) = crossbeam_channel::unbounded();
        let (tx, arrivals) = crossbeam_channel::bounded(MAX_ARRIVALS);
        let health = Arc::new(Mutex::new(Health::default()));
        let shared = Arc::clone(&health);
        let thread = std::thread::Builder::new()
            .name("turnstile-reader".into())
            .spawn(move || {
                let mut r = Reading {
                    store,
                    inboxes: BTreeMap::new(),
                    outcomes,
                    failing: false,
                    health: shared,
                    live_read: None,
                    live: None,
                    gone: BTreeMap::new(),
                    origins: BTreeSet::new(),
                    requests: VecDeque::new(),
                    fwd_after,
                };
                r.run(&ctl, &tx, &wake);
            })
            .map_err(|e| StoreError::transient(format!("cannot start the reader thread: {e}")))?;
        Ok(Reader {
            control: Some(control),
            arrivals,
            thread: Some(thread),
            health,
        })
    }

    /// Fills in the reader's figures: its failures and reconnects, the live instances.
    pub fn fill_status(&self, s: &mut ClusterStatus) {
        let h = self.health.lock().unwrap_or_else(|e| e.into_inner());
        s.reader_failures = h.failures;
        s.reader_reconnects = h.reconnects;
        s.reader_failing = h.failing;
        s.reader_arrivals = self.arrivals.len();
        s.live_instances.clone_from(&h.live);
        s.forward_requests = h.requests;
        s.forward_requests_dropped = h.requests_dropped;
    }

    /// A request of the bridge, carried out on the reader's connection.
    pub fn request(&self, r: ClusterRequest) {
        if let Some(c) = &self.control {
            let _ = c.send(Control::Request(r));
        }
    }

    /// Reads `partition`'s inbox from after `after` (its load's `inbox_after`).
    pub fn own(&self, partition: u32, after: String) {
        if let Some(c) = &self.control {
            let _ = c.send(Control::Own(partition, after));
        }
    }

    /// Stops reading `partition`'s inbox (lost or fenced).
    pub fn disown(&self, partition: u32) {
        if let Some(c) = &self.control {
            let _ = c.send(Control::Disown(partition));
        }
    }

    /// What arrived since the last call.
    pub fn arrivals(&self) -> impl Iterator<Item = Arrival> + '_ {
        self.arrivals.try_iter()
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        self.control = None;
        // A reader waiting for room in a full channel would never see the control channel
        // close: dropping the receiver ends its wait (its send fails).
        self.arrivals = crossbeam_channel::never();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Sends a read's arrivals in order, then wakes the reactor; when the channel is full, the
/// reactor is woken first (it takes what waits) and the reader waits for room. False once
/// the handle is gone.
fn send_all(found: Vec<Arrival>, tx: &Sender<Arrival>, wake: &impl Fn()) -> bool {
    for a in found {
        match tx.try_send(a) {
            Ok(()) => {}
            Err(TrySendError::Full(a)) => {
                wake();
                if tx.send(a).is_err() {
                    return false;
                }
            }
            Err(TrySendError::Disconnected(_)) => return false,
        }
    }
    wake();
    true
}

struct Reading {
    store: RedisStore,
    /// Owned partitions → the inbox position read up to.
    inboxes: BTreeMap<u32, String>,
    /// Every partition's outcome stream position.
    outcomes: Vec<String>,
    failing: bool,
    health: Arc<Mutex<Health>>,
    /// When the live instances were last read.
    live_read: Option<Instant>,
    /// The live instances as last read (`None` before the first read).
    live: Option<Vec<String>>,
    /// Instances that left the registry lately → the reads of their messages left: a read
    /// can see a message without its outcome just before its turn ends here (its result
    /// then silenced for the origin), so the next reads look again.
    gone: BTreeMap<String, u8>,
    /// The origins of the inbox messages read since the live instances were last read (at
    /// most [`MAX_LIVE_SHOWN`]): one not live at the next read has left, even if no read
    /// ever saw it live (`Reading::read_live`).
    origins: BTreeSet<String>,
    /// The bridge's requests not yet carried out (at most [`MAX_REQUESTS`]).
    requests: VecDeque<ClusterRequest>,
    /// This instance's forward stream, read up to.
    fwd_after: String,
}

/// The gone origins' messages whose origin is still absent from a registry read made after
/// their partition's load: one present there came back before the load (a pause, an outage of
/// Redis) and may have accepted what the load found.
fn confirmed_gone(candidates: Vec<(String, Arrival)>, live_after: &[String]) -> Vec<Arrival> {
    candidates
        .into_iter()
        .filter(|(origin, _)| !live_after.contains(origin))
        .map(|(_, arrival)| arrival)
        .collect()
}

impl Reading {
    fn run(&mut self, ctl: &Receiver<Control>, tx: &Sender<Arrival>, wake: &impl Fn()) {
        loop {
            if !self.control(ctl) {
                return;
            }
            match self.read_all(ctl) {
                Ok(found) => {
                    if self.failing {
                        log::info!("cluster stream reads succeed again");
                        self.failing = false;
                        self.health(|h| {
                            h.reconnects += 1;
                            h.failing = false;
                        });
                    }
                    let mut found = found;
                    found.extend(self.read_live());
                    if found.is_empty() {
                        continue;
                    }
                    if !send_all(found, tx, wake) {
                        return;
                    }
                }
                Err(e) => {
                    if !self.failing {
                        log::error!("cluster stream read failed: {e}; retrying");
                        self.failing = true;
                    }
                    self.health(|h| {
                        h.failures += 1;
                        h.failing = true;
                    });
                    // The wait is on the control channel, so a stop ends it at once; what
                    // it receives meanwhile is applied, never dropped.
                    match ctl.recv_timeout(RETRY) {
                        Ok(c) => self.apply(c),
                        Err(RecvTimeoutError::Disconnected) => return,
                        Err(RecvTimeoutError::Timeout) => {}
                    }
                }
            }
        }
    }

    fn health(&self, f: impl FnOnce(&mut Health)) {
        f(&mut self.health.lock().unwrap_or_else(|e| e.into_inner()));
    }

    /// Reads the registry's live instances every [`LIVE_EVERY`], for the status and for the
    /// instances that left it since the last read: the messages they accepted into owned
    /// partitions ([`Arrival::OriginGone`]). A failure leaves the last list, so the next
    /// read finds the same instances gone (the next stream read counts the failure if Redis
    /// is gone).
    fn read_live(&mut self) -> Vec<Arrival> {
        if self.live_read.is_some_and(|t| t.elapsed() < LIVE_EVERY) {
            return Vec::new();
        }
        self.live_read = Some(Instant::now());
        let Ok(mut live) = self.store.live_instances() else {
            return Vec::new();
        };
        // By name: the registry's order (by expiry) changes with every heartbeat.
        live.sort_unstable();
        let me = self.store.instance().to_owned();
        // An origin read since counts as seen live: it wrote its accept only while its
        // registry entry held (`Member::commit`), so one absent now left after (seed 518:
        // an owner started while Redis was out of reach never saw the origin live).
        let seen = std::mem::take(&mut self.origins);
        let left: BTreeSet<String> = (self.live.iter().flatten())
            .chain(&seen)
            .filter(|i| **i != me && !live.contains(i))
            .cloned()
            .collect();
        for i in left {
            self.gone.insert(i, GONE_READS);
        }
        // One that came back is alive again (a pause): its results are its own.
        self.gone.retain(|i, _| !live.contains(i));
        let gone: Vec<String> = self.gone.keys().cloned().collect();
        let Ok(found) = self.gone_origins(&gone) else {
            return Vec::new();
        };
        for reads in self.gone.values_mut() {
            *reads -= 1;
        }
        self.gone.retain(|_, reads| *reads > 0);
        let mut shown = live.clone();
        shown.truncate(MAX_LIVE_SHOWN);
        self.health(|h| h.live = shown);
        self.live = Some(live);
        found
    }

    /// The messages of the owned partitions whose origin is one of `gone`.
    fn gone_origins(&mut self, gone: &[String]) -> Result<Vec<Arrival>, StoreError> {
        let mut out = Vec::new();
        if gone.is_empty() {
            return Ok(out);
        }
        let owned: Vec<u32> = self.inboxes.keys().copied().collect();
        let mut candidates = Vec::new();
        for p in owned {
            let loaded = self.store.load_partition(p, crate::journal::now_ms())?;
            for mut m in loaded.recovered.messages {
                let seq = m.message.seq;
                let Some(origin) = loaded.origins.get(&seq).filter(|o| gone.contains(o)) else {
                    continue;
                };
                let tag = cluster_tag(p, seq);
                m.message.seq = tag;
                let arrival = Arrival::OriginGone {
                    partition: p,
                    tag,
                    message: Box::new(m),
                };
                candidates.push((origin.clone(), arrival));
            }
        }
        // The registry read again, after the loads: an origin whose heartbeat went through
        // between the first read and a load may have accepted a message the load found (it
        // accepts only while registered, `Member::commit`), so it is live at this read and
        // its messages stay its own (docs/cluster.md, "An accept just after a woken
        // instance's heartbeat").
        let live_after = self.store.live_instances()?;
        self.gone.retain(|i, _| !live_after.contains(i));
        out.extend(confirmed_gone(candidates, &live_after));
        if !out.is_empty() {
            log::warn!(
                "instance(s) {gone:?} left the registry: {} of their messages in partitions owned here are answered here",
                out.len()
            );
        }
        Ok(out)
    }

    /// Applies the reactor's changes of the owned inboxes; false once the handle is gone.
    fn control(&mut self, ctl: &Receiver<Control>) -> bool {
        loop {
            match ctl.try_recv() {
                Ok(c) => self.apply(c),
                Err(TryRecvError::Empty) => return true,
                Err(TryRecvError::Disconnected) => return false,
            }
        }
    }

    fn apply(&mut self, c: Control) {
        match c {
            Control::Own(p, after) => {
                self.inboxes.insert(p, after);
            }
            Control::Disown(p) => {
                self.inboxes.remove(&p);
            }
            Control::Request(r) => self.queue(r),
        }
    }

    /// One blocking read of every stream, the messages and outcomes it names fetched.
    fn read_once(&mut self, ctl: &Receiver<Control>) -> Result<Vec<Arrival>, StoreError> {
        let mut cursors: Vec<(Stream, u32, String)> = self
            .inboxes
            .iter()
            .map(|(p, after)| (Stream::Inbox, *p, after.clone()))
            .collect();
        cursors.extend(
            self.outcomes
                .iter()
                .enumerate()
                .map(|(p, after)| (Stream::Outcomes, p as u32, after.clone())),
        );
        let entries = self.store.read_mixed(&cursors, COUNT, Some(BLOCK))?;
        // A partition disowned while the read waited brings nothing more: what the
        // reactor said before an entry was read holds for it.
        self.control(ctl);
        let me = self.store.instance().to_owned();
        // Entries are fetched only for what this instance wants: its owned inboxes but for
        // what it accepted itself (submitted then), the outcomes of what it accepted that
        // another instance wrote (one it wrote itself is only named: `Arrival::Landed`).
        let wanted: Vec<(Stream, u32, u64)> = entries
            .iter()
            .filter(|(s, e)| match s {
                Stream::Inbox => self.inboxes.contains_key(&e.partition) && e.origin != me,
                Stream::Outcomes => e.origin == me && e.by != me,
            })
            .map(|(s, e)| (*s, e.partition, e.seq))
            .collect();
        // An inbox entry's whole message, an outcome entry's outcome alone.
        let at: Vec<(u32, u64, Want)> = (wanted.iter())
            .map(|(s, p, seq)| match s {
                Stream::Inbox => (*p, *seq, Want::Message),
                Stream::Outcomes => (*p, *seq, Want::Outcome),
            })
            .collect();
        let fetched = self.store.fetch_wanted(&at)?;
        // Positions move only once the fetch succeeded: a failure reads the entries again.
        for (s, e) in &entries {
            match s {
                Stream::Inbox => {
                    if let Some(after) = self.inboxes.get_mut(&e.partition) {
                        after.clone_from(&e.id);
                    }
                }
                Stream::Outcomes => {
                    if let Some(after) = self.outcomes.get_mut(e.partition as usize) {
                        after.clone_from(&e.id);
                    }
                }
            }
        }
        let reached = self.reached(&entries);
        let mut out = Vec::with_capacity(wanted.len() + reached.len());
        out.extend(
            entries
                .iter()
                .filter(|(s, e)| *s == Stream::Outcomes && e.origin == me && e.by == me)
                .map(|(_, e)| Arrival::Landed {
                    partition: e.partition,
                    tag: cluster_tag(e.partition, e.seq),
                }),
        );
        for ((_, p, seq), found) in wanted.into_iter().zip(fetched) {
            let tag = cluster_tag(p, seq);
            match found {
                // Accepted here while owned here: the bridge submitted it then.
                Fetched::Message(_, origin) if origin == me => {}
                Fetched::Message(mut message, origin) => {
                    message.message.seq = tag;
                    self.seen_origin(&origin);
                    out.push(Arrival::Message {
                        partition: p,
                        tag,
                        message,
                        origin,
                    });
                }
                Fetched::Outcome(outcome) => out.push(Arrival::Outcome {
                    partition: p,
                    tag,
                    outcome,
                }),
                // Gone: delivered or forgotten meanwhile; nothing to do.
                Fetched::Missing => {}
            }
        }
        // After the messages they follow.
        out.extend(reached);
        Ok(out)
    }

    /// Notes `origin` for the next read of the live instances (bounded: a registry is a
    /// handful of instances).
    fn seen_origin(&mut self, origin: &str) {
        if self.origins.len() < MAX_LIVE_SHOWN && !self.origins.contains(origin) {
            self.origins.insert(origin.to_owned());
        }
    }

    /// How far this read went in each owned inbox: the highest seq of its entries, whoever
    /// accepted them (the entries are in seq order: the accept script numbers and appends
    /// in one step). An entry of another instance's counts too, so that an own entry
    /// trimmed before it was read (`MAXLEN ~`) is passed all the same.
    fn reached(&self, entries: &[(Stream, StreamEntry)]) -> Vec<Arrival> {
        let mut reached: BTreeMap<u32, u64> = BTreeMap::new();
        for (s, e) in entries {
            if *s == Stream::Inbox && self.inboxes.contains_key(&e.partition) {
                let r = reached.entry(e.partition).or_insert(e.seq);
                *r = (*r).max(e.seq);
            }
        }
        (reached.into_iter())
            .map(|(partition, seq)| Arrival::Reached { partition, seq })
            .collect()
    }
}

/// The hello registry and the forwards (docs/cluster.md "Where the result goes").
impl Reading {
    /// One pass: the streams (blocking), then the bridge's requests, then this instance's
    /// forward stream. A failure leaves every position and request as it was.
    fn read_all(&mut self, ctl: &Receiver<Control>) -> Result<Vec<Arrival>, StoreError> {
        let mut found = self.read_once(ctl)?;
        // What the streams brought goes to the bridge whatever follows: their positions
        // moved. A failure here is counted and tried again at the next pass.
        match self.serve_requests().and_then(|()| self.read_forwards()) {
            Ok(more) => found.extend(more),
            Err(e) => {
                log::debug!("cluster: hello registry or forwards: {e}; trying again");
                self.health(|h| h.failures += 1);
            }
        }
        Ok(found)
    }

    fn queue(&mut self, r: ClusterRequest) {
        if self.requests.len() >= MAX_REQUESTS {
            log::warn!(
                "cluster: {MAX_REQUESTS} requests wait for Redis already; dropped: {r:?} (a hello is recorded at the next one, a forward asked again, an answer's results stay with their forwarder)"
            );
            self.health(|h| h.requests_dropped += 1);
            return;
        }
        self.requests.push_back(r);
        let n = self.requests.len();
        self.health(|h| h.requests = n);
    }

    /// Carries out the bridge's requests in order; one that fails stays first.
    fn serve_requests(&mut self) -> Result<(), StoreError> {
        let me = self.store.instance().to_owned();
        while let Some(r) = self.requests.front().cloned() {
            match r {
                ClusterRequest::Hello(platform) => {
                    self.store
                        .set_hellos(&[platform], crate::journal::now_ms())?;
                }
                ClusterRequest::Forward { platform, results } => {
                    // A value that is not an instance's (written by something else) names
                    // nobody: the results stay here, and the requests behind go on.
                    let to = match self.store.hello_of(&platform) {
                        Ok(to) => to.map(|(i, _)| i),
                        Err(e) if e.is_transient() => return Err(e),
                        Err(e) => {
                            log::warn!(
                                "platform {platform}: the hello registry's key is unreadable ({e}); its results stay here"
                            );
                            None
                        }
                    };
                    // Only to another live instance: a dead one's hello would strand them.
                    let live = self.live.as_ref();
                    match to {
                        Some(to) if to != me && live.is_some_and(|l| l.contains(&to)) => {
                            log::debug!(
                                "platform {platform}: {} result(s) offered to {to}, its newest hello's instance",
                                results.len()
                            );
                            let e = FwdEntry::Forward {
                                from: me.clone(),
                                platform,
                                results,
                            };
                            self.store.fwd_add(&to, &e)?;
                        }
                        to => log::debug!(
                            "platform {platform}: {} result(s) kept here: its newest hello is {to:?}",
                            results.len()
                        ),
                    }
                }
                ClusterRequest::Untag(_) | ClusterRequest::Fenced { .. } => {}
                ClusterRequest::Took {
                    to,
                    platform,
                    taken,
                    refused,
                } => {
                    let e = FwdEntry::Took {
                        from: me.clone(),
                        platform,
                        taken,
                        refused,
                    };
                    self.store.fwd_add(&to, &e)?;
                }
            }
            self.requests.pop_front();
        }
        self.health(|h| h.requests = 0);
        Ok(())
    }

    /// This instance's forward stream since the last read: forwards to take (their messages
    /// fetched) and answers to its own.
    fn read_forwards(&mut self) -> Result<Vec<Arrival>, StoreError> {
        let entries = self.store.fwd_read(&self.fwd_after, COUNT)?;
        let mut out = Vec::with_capacity(entries.len());
        let mut after = None;
        for (id, e) in entries {
            after = Some(id);
            match e {
                Some(FwdEntry::Forward {
                    from,
                    platform,
                    results,
                }) => {
                    let at: Vec<(u32, u64)> =
                        results.iter().filter_map(|&t| tag_parts(t)).collect();
                    let fetched = self.store.fetch(&at)?;
                    let mut found = Vec::new();
                    let mut missing: Vec<u64> = results
                        .iter()
                        .copied()
                        .filter(|&t| tag_parts(t).is_none())
                        .collect();
                    for ((p, seq), m) in at.into_iter().zip(fetched) {
                        let tag = cluster_tag(p, seq);
                        match m {
                            Some((mut m, _)) if m.outcome.is_some() => {
                                m.message.seq = tag;
                                found.push((tag, Box::new(m)));
                            }
                            _ => missing.push(tag),
                        }
                    }
                    out.push(Arrival::Forwarded {
                        from,
                        platform,
                        results: found,
                        missing,
                    });
                }
                Some(FwdEntry::Took {
                    platform,
                    taken,
                    refused,
                    ..
                }) => out.push(Arrival::Took {
                    platform,
                    taken,
                    refused,
                }),
                None => {}
            }
        }
        // Moved only once every fetch succeeded: a failure reads the entries again.
        if let Some(after) = after {
            self.fwd_after = after;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/cluster.md "An accept just after a woken instance's heartbeat": a message whose
    /// origin the registry's second read (after the load) lists is not answered as a gone
    /// origin's; one whose origin is still absent is.
    #[test]
    fn an_origin_live_again_after_the_load_keeps_its_messages() {
        let arrival = |seq| Arrival::Reached { partition: 3, seq };
        let candidates = vec![
            ("b:1".to_owned(), arrival(1)),
            ("c:2".to_owned(), arrival(2)),
            ("b:1".to_owned(), arrival(3)),
        ];
        assert_eq!(
            confirmed_gone(candidates.clone(), &["b:1".to_owned()]),
            vec![arrival(2)]
        );
        assert_eq!(
            confirmed_gone(candidates, &[]),
            vec![arrival(1), arrival(2), arrival(3)]
        );
    }
}
