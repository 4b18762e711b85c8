//! The vocabulary of the core: what goes in, what comes out, and what callers observe.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

pub use super::reply::{DEFAULT_MAX_REPLY_BYTES, Reply};
use crate::key::Key;
use crate::message::{Message, MessageContext, SessionKey};

/// Identifies one agent turn; also its generation: a completion whose id is not the
/// session's current turn is stale and its result is discarded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TurnId(pub u64);

/// Identifies one cleanup job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CleanupId(pub u64);

/// Hashes the core's own ids ([`TurnId`], [`CleanupId`]) with one multiply instead of
/// SipHash: the maps keyed by them are touched several times per turn (the core's claimed
/// turns, the driver's tickets, the observer's start times), and the ids are counters the
/// core hands out, never outside input, so nobody can aim collisions at them. The odd
/// multiplier spreads sequential ids over the top bits (hashbrown's tags) and keeps the low
/// bits (its bucket index) a permutation of the ids'.
#[derive(Clone, Copy, Debug, Default)]
// Exposed to its micro-benchmark by the `bench` feature.
#[cfg_attr(not(feature = "bench"), allow(unreachable_pub))]
pub struct IdHasher(u64);

const ID_MULTIPLIER: u64 = 0x9E37_79B9_7F4A_7C15;

impl std::hash::Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is reached by the ids' derived `Hash`; this keeps any other key
        // correct (if slower).
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(ID_MULTIPLIER);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(ID_MULTIPLIER);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A map keyed by the core's ids, hashed by [`IdHasher`].
pub(crate) type IdMap<K, V> =
    std::collections::HashMap<K, V, std::hash::BuildHasherDefault<IdHasher>>;
/// A set of the core's ids, hashed by [`IdHasher`].
pub(crate) type IdSet<K> = std::collections::HashSet<K, std::hash::BuildHasherDefault<IdHasher>>;

/// How a session treats a message that arrives while its turn runs. Named in lowercase on
/// the command line and in the config file (`queue`, `interrupt`, `merge`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum BusyMode {
    /// Follow-ups run one turn each, in order.
    #[default]
    Queue,
    /// A follow-up cancels the running turn, then runs.
    Interrupt,
    /// Everything queued when a turn ends runs as one turn.
    Merge,
}

/// Limits and timeouts of the session table and scheduler.
#[derive(Clone, Debug)]
pub struct CoreConfig {
    /// Turns that may run at once (the turn pool's size).
    pub turn_workers: usize,
    /// Held turns ([`Input::SubmitHeld`]) claimed and not yet on a worker: waiting for
    /// their [`Input::Release`], or released and waiting for a free worker. They take no
    /// worker while they wait, so a journaling shell's start records are written many per
    /// commit while the workers run; past the bound further held messages wait in their
    /// queues. Default 1,024; at least 1.
    pub max_held_turns: usize,
    /// Busy-session behaviour.
    pub busy_mode: BusyMode,
    /// Messages a session may hold waiting behind its running turn.
    pub queue_cap: usize,
    /// Idle agents kept for reuse; least recently used go first.
    pub max_cached_agents: usize,
    /// An idle agent older than this is closed by the sweep.
    pub agent_idle_ttl: Duration,
    /// How often the idle sweep runs.
    pub sweep_interval: Duration,
    /// A turn running longer is abandoned (`failed: timeout`).
    pub turn_timeout: Duration,
    /// How long a cancelled turn may take to return before it is abandoned.
    pub stop_grace: Duration,
    /// How long a cleanup job may take before it counts as leaked.
    pub cleanup_timeout: Duration,
    /// How long shutdown lets running turns finish before cancelling them.
    pub drain_timeout: Duration,
    /// Messages waiting across all sessions; past it new messages are rejected `overloaded`.
    pub max_queued_messages: usize,
    /// Bytes of text waiting across all sessions; past it new messages are rejected
    /// `overloaded`.
    pub max_queued_bytes: usize,
    /// Cleanup jobs handed to the cleanup pool at once (its thread cap); the rest wait in
    /// the core's backlog without their deadline running.
    pub cleanup_concurrency: usize,
    /// Backlog length at which evictions and the idle sweep pause (the agents stay cached
    /// until it shrinks). Resets and shutdown always queue: each session has one agent.
    pub cleanup_queue_cap: usize,
}

/// The settings that may change while the core runs (a configuration reload). Each applies
/// from the next time it is read: a new message meets the new queue cap and busy mode, a turn
/// started afterwards its new timeout, a cancellation its new grace, a cleanup or drain
/// started afterwards its new deadline. What is already scheduled keeps its deadline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tunables {
    /// What a follow-up does while a turn runs.
    pub busy_mode: BusyMode,
    /// Messages a session may hold waiting (at least 1).
    pub queue_cap: usize,
    /// Turns running longer are abandoned (positive).
    pub turn_timeout: Duration,
    /// How long a cancelled turn may take to return.
    pub stop_grace: Duration,
    /// How long an agent's close() may take (positive).
    pub cleanup_timeout: Duration,
    /// How long shutdown waits for running turns.
    pub drain_timeout: Duration,
}

/// Default [`CoreConfig::max_held_turns`]: held turns waiting for their start record (or
/// for a worker) at once, each holding its claimed message's job (text and agent).
pub(crate) const DEFAULT_MAX_HELD_TURNS: usize = 1024;
/// Default [`CoreConfig::max_queued_messages`].
pub(crate) const DEFAULT_MAX_QUEUED_MESSAGES: usize = 100_000;
/// Default [`CoreConfig::max_queued_bytes`]: 256 MiB.
pub(crate) const DEFAULT_MAX_QUEUED_BYTES: usize = 256 << 20;
/// Default [`CoreConfig::cleanup_concurrency`].
pub(crate) const DEFAULT_CLEANUP_CONCURRENCY: usize = 64;
/// Default [`CoreConfig::cleanup_queue_cap`].
pub(crate) const DEFAULT_CLEANUP_QUEUE_CAP: usize = 1024;

impl CoreConfig {
    /// Changes the settings a reload may change (a queue cap of 0 taken as 1).
    pub(crate) fn retune(&mut self, t: Tunables) {
        debug_assert!(t.queue_cap > 0, "queue_cap must be at least 1");
        debug_assert!(!t.turn_timeout.is_zero() && !t.cleanup_timeout.is_zero());
        self.busy_mode = t.busy_mode;
        self.queue_cap = t.queue_cap.max(1);
        self.turn_timeout = t.turn_timeout;
        self.stop_grace = t.stop_grace;
        self.cleanup_timeout = t.cleanup_timeout;
        self.drain_timeout = t.drain_timeout;
        debug_assert_eq!(
            self.tunables(),
            Tunables {
                queue_cap: t.queue_cap.max(1),
                ..t
            }
        );
    }

    /// The settings of this configuration a reload may change.
    pub(crate) fn tunables(&self) -> Tunables {
        Tunables {
            busy_mode: self.busy_mode,
            queue_cap: self.queue_cap,
            turn_timeout: self.turn_timeout,
            stop_grace: self.stop_grace,
            cleanup_timeout: self.cleanup_timeout,
            drain_timeout: self.drain_timeout,
        }
    }
}

impl Default for CoreConfig {
    fn default() -> Self {
        CoreConfig {
            turn_workers: 16,
            max_held_turns: DEFAULT_MAX_HELD_TURNS,
            busy_mode: BusyMode::Queue,
            queue_cap: 32,
            max_cached_agents: 128,
            agent_idle_ttl: Duration::from_secs(3600),
            sweep_interval: Duration::from_secs(60),
            turn_timeout: Duration::from_secs(600),
            stop_grace: Duration::from_secs(5),
            cleanup_timeout: Duration::from_secs(30),
            drain_timeout: Duration::from_secs(30),
            max_queued_messages: DEFAULT_MAX_QUEUED_MESSAGES,
            max_queued_bytes: DEFAULT_MAX_QUEUED_BYTES,
            cleanup_concurrency: DEFAULT_CLEANUP_CONCURRENCY,
            cleanup_queue_cap: DEFAULT_CLEANUP_QUEUE_CAP,
        }
    }
}

/// Why a message was refused (it was never accepted, so this is its only answer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RejectReason {
    /// The session already holds `queue_cap` waiting messages.
    QueueFull,
    /// The runtime is shutting down.
    ShuttingDown,
    /// Every session together already holds `max_queued_messages` or `max_queued_bytes`.
    Overloaded,
}

impl RejectReason {
    /// The wire name.
    pub const fn as_str(self) -> &'static str {
        match self {
            RejectReason::QueueFull => "queue_full",
            RejectReason::ShuttingDown => "shutting_down",
            RejectReason::Overloaded => "overloaded",
        }
    }

    /// A sentence for the client.
    pub fn detail(self) -> &'static str {
        match self {
            RejectReason::QueueFull => "the session's queue is full",
            RejectReason::ShuttingDown => "the gateway is shutting down",
            RejectReason::Overloaded => {
                "the gateway holds as many queued messages as it may; retry later"
            }
        }
    }
}

/// Why a message's turn was cancelled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CancelReason {
    /// `/stop`.
    Stopped,
    /// `/new` or `/reset`.
    Reset,
    /// A follow-up in interrupt mode.
    Interrupted,
    /// The runtime shut down.
    Shutdown,
    /// The session left this runtime ([`Input::HandOver`]): another one answers the message.
    HandedOver,
}

impl CancelReason {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            CancelReason::Stopped => "stopped",
            CancelReason::Reset => "reset",
            CancelReason::Interrupted => "interrupted",
            CancelReason::Shutdown => "shutdown",
            CancelReason::HandedOver => "handed_over",
        }
    }
}

/// Why a message's turn failed.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailReason {
    /// The agent returned an error (or could not be created).
    Agent(String),
    /// The agent panicked.
    Panic(String),
    /// The turn ran past `turn_timeout` and was abandoned.
    Timeout,
}

impl fmt::Display for FailReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FailReason::Agent(e) => write!(f, "agent error: {e}"),
            FailReason::Panic(e) => write!(f, "agent panic: {e}"),
            FailReason::Timeout => f.write_str("timeout"),
        }
    }
}

/// The terminal outcome of an accepted message: exactly one per message.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// The agent's reply, or a command's result.
    Reply(Reply),
    /// The turn was cancelled, or the message was dropped from the queue on purpose.
    Cancelled(CancelReason),
    /// The turn failed.
    Failed(FailReason),
    /// The message's text ran as part of another message's turn, which gets the reply.
    Merged {
        /// The message whose turn carried this one.
        into: Arc<str>,
    },
}

/// Whether an accepted message started at once or waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum AcceptState {
    /// Its turn (or command) started in the step that accepted it.
    Running,
    /// It waits behind the session's turn or for a free worker.
    Queued,
}

/// What happened to a message.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum EventKind {
    /// Taken in; `position` counts the session's messages ahead of it.
    Accepted {
        /// Running or queued.
        state: AcceptState,
        /// The session's messages ahead of this one.
        position: usize,
    },
    /// Refused; no other event follows.
    Rejected(RejectReason),
    /// Its agent turn started.
    TurnStarted(TurnId),
    /// The reply so far, published by the running turn (best effort, throttled; the
    /// terminal reply carries the whole text).
    Partial(String),
    /// Its agent turn ended (just before the outcome).
    TurnEnded(TurnId),
    /// The terminal outcome.
    Finished(Outcome),
}

/// An event about one message, delivered to whoever submitted it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MessageEvent {
    /// The message's id.
    pub id: Arc<str>,
    /// The message's session.
    pub session: SessionKey,
    /// What happened.
    pub kind: EventKind,
}

/// What an agent turn returned, as reported by the worker that ran it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TurnResult {
    /// The reply text, already bounded by the worker.
    Reply(Reply),
    /// The agent honoured a cancellation.
    Cancelled,
    /// The agent (or its creation) failed.
    Failed(String),
    /// The agent panicked; the text is the panic message.
    Panicked(String),
}

/// Why a cleanup job runs; carried into logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CleanupContext {
    /// The idle sweep closed an agent past its TTL.
    Sweep,
    /// The cache was over `max_cached_agents`.
    Eviction,
    /// `/new` or `/reset`.
    Reset,
    /// The agent came back from an abandoned turn.
    Abandoned,
    /// The agent panicked during a turn.
    Panicked,
    /// Shutdown.
    Shutdown,
}

impl CleanupContext {
    /// The name used in logs.
    pub fn as_str(self) -> &'static str {
        match self {
            CleanupContext::Sweep => "sweep",
            CleanupContext::Eviction => "eviction",
            CleanupContext::Reset => "reset",
            CleanupContext::Abandoned => "abandoned turn",
            CleanupContext::Panicked => "panicked turn",
            CleanupContext::Shutdown => "shutdown",
        }
    }
}

/// Why a turn was abandoned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum AbandonReason {
    /// It ran past `turn_timeout`.
    Timeout,
    /// It did not return within `stop_grace` of being cancelled.
    IgnoredCancel(CancelReason),
}

/// A turn to run on the turn pool.
#[derive(Debug)]
pub struct TurnJob<A> {
    /// Its id; the completion must carry it back.
    pub turn: TurnId,
    /// The session's slot; the completion must carry it back.
    pub slot: Key,
    /// The session.
    pub session: SessionKey,
    /// The id of the message the turn answers.
    pub message_id: Arc<str>,
    /// The agent's input (several texts joined by newlines in merge mode).
    pub input: String,
    /// The sender and metadata of the message the turn answers.
    pub context: MessageContext,
    /// The session's agent, or `None` to create a fresh one on the worker.
    pub agent: Option<A>,
}

impl<A> TurnJob<A> {
    /// The worker's report that this turn returned, with the agent it ran (the one it was
    /// given, or the one the worker created; `None` if creation failed) and what it
    /// produced. The only way to build a [`TurnDone`], so it always matches its job.
    pub fn done(self, agent: Option<A>, result: TurnResult) -> TurnDone<A> {
        TurnDone {
            turn: self.turn,
            slot: self.slot,
            session: self.session,
            agent,
            result,
        }
    }

    /// Where this turn's partial replies go.
    pub fn partial_route(&self) -> PartialRoute {
        PartialRoute {
            turn: self.turn,
            slot: self.slot,
        }
    }
}

/// A turn returned from its worker; see [`TurnJob::done`].
#[derive(Debug)]
pub struct TurnDone<A> {
    pub(crate) turn: TurnId,
    pub(crate) slot: Key,
    pub(crate) session: SessionKey,
    pub(crate) agent: Option<A>,
    pub(crate) result: TurnResult,
}

impl<A> TurnDone<A> {
    /// The turn that returned.
    pub fn turn(&self) -> TurnId {
        self.turn
    }
}

/// Addresses a running turn's partial replies (cheap to copy into a publisher).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartialRoute {
    turn: TurnId,
    slot: Key,
}

impl PartialRoute {
    /// The input reporting `text` as the turn's reply so far.
    pub fn partial<R, A>(self, text: String) -> Input<R, A> {
        Input::Partial {
            turn: self.turn,
            slot: self.slot,
            text,
        }
    }
}

/// An agent to close on the cleanup pool.
#[derive(Debug)]
pub struct CleanupJob<A> {
    /// Its id; the completion must carry it back.
    pub job: CleanupId,
    /// The session the agent served.
    pub session: SessionKey,
    /// Why it is closed.
    pub context: CleanupContext,
    /// The agent.
    pub agent: A,
}

/// What shutdown achieved.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct ShutdownReport {
    /// True when every turn finished or honoured cancellation and every cleanup finished in time.
    pub clean: bool,
    /// Queued messages ended `cancelled: shutdown`.
    pub queued_cancelled: u64,
    /// Turns that ended (any outcome) after shutdown began.
    pub turns_finished: u64,
    /// Turns abandoned after shutdown began.
    pub turns_abandoned: u64,
    /// Cleanups finished after shutdown began.
    pub cleanups_done: u64,
    /// Cleanups that failed after shutdown began.
    pub cleanups_failed: u64,
    /// Cleanups that exceeded their deadline after shutdown began.
    pub cleanups_timed_out: u64,
}

/// As `key=value` fields, so a log line (text or JSON) carries them as fields.
impl fmt::Display for ShutdownReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "clean={} queued_cancelled={} turns_finished={} turns_abandoned={} cleanups_done={} cleanups_failed={} cleanups_timed_out={}",
            self.clean,
            self.queued_cancelled,
            self.turns_finished,
            self.turns_abandoned,
            self.cleanups_done,
            self.cleanups_failed,
            self.cleanups_timed_out
        )
    }
}

impl ShutdownReport {
    /// What the core did between two readings of its counters: `before` when shutdown
    /// began, `after` when it completed.
    pub fn between(before: &CoreStats, after: &CoreStats) -> ShutdownReport {
        let ended = |s: &CoreStats| s.turns.completed + s.turns.failed + s.turns.cancelled;
        let turns_abandoned = after.turns.abandoned - before.turns.abandoned;
        let cleanups_timed_out = after.cleanups.timed_out - before.cleanups.timed_out;
        ShutdownReport {
            clean: turns_abandoned == 0 && cleanups_timed_out == 0,
            queued_cancelled: after.messages.queued_cancelled - before.messages.queued_cancelled,
            turns_finished: ended(after) - ended(before),
            turns_abandoned,
            cleanups_done: after.cleanups.done - before.cleanups.done,
            cleanups_failed: after.cleanups.failed - before.cleanups.failed,
            cleanups_timed_out,
        }
    }
}

/// Input to the core.
#[derive(Debug)]
pub enum Input<R, A> {
    /// A message (or command) from a submitter; `route` says where its events go.
    Submit {
        /// The message.
        message: Message,
        /// Where its events go.
        route: R,
    },
    /// A message whose turn, once claimed, waits for [`Input::Release`] before it is handed
    /// to a worker (its [`EventKind::TurnStarted`] is emitted at the claim): a journaling
    /// submitter releases it once the turn's `started` record is durable, so that a turn
    /// never runs without a record of it (a crash then fails it `interrupted by restart`
    /// instead of running it again). A held turn takes no worker while it waits (at most
    /// [`CoreConfig::max_held_turns`] are claimed so), so that many start records go in one
    /// commit. A held turn that is cancelled or times out before it reaches a worker ends
    /// without ever reaching one.
    SubmitHeld {
        /// The message.
        message: Message,
        /// Where its events go.
        route: R,
    },
    /// The held turn may now run: its [`Effect::StartTurn`] follows in this step if a
    /// worker is free, else when one is (released turns go first, in release order).
    /// Ignored for a turn that already ended, was already released or was never held.
    Release {
        /// The turn.
        turn: TurnId,
    },
    /// A turn returned from its worker (built by [`TurnJob::done`]).
    TurnDone(TurnDone<A>),
    /// A running turn published its reply so far.
    Partial {
        /// The turn's id.
        turn: TurnId,
        /// The slot from its job.
        slot: Key,
        /// The text so far.
        text: String,
    },
    /// A cleanup job's `close()` started on a worker: its deadline runs from now.
    CleanupStarted {
        /// The job's id.
        job: CleanupId,
    },
    /// A cleanup job returned.
    CleanupDone {
        /// The job's id.
        job: CleanupId,
        /// `Err` when `close()` failed or panicked.
        result: Result<(), String>,
    },
    /// Begin a graceful shutdown.
    Shutdown,
    /// These sessions leave this runtime (`--cluster`: their partition is another
    /// instance's now): each queued or held message ends at once, and a running turn is
    /// cancelled and ends when its worker returns, all with
    /// `Finished(Cancelled(HandedOver))` whatever the turn's own result, so that nothing it
    /// did is reported as the message's outcome. Their agents are closed (`Reset`). Keys
    /// without a session are ignored.
    HandOver {
        /// The sessions.
        sessions: Vec<SessionKey>,
    },
}

/// Work the core asks its driver to do.
#[derive(Debug)]
pub enum Effect<R, A> {
    /// Deliver an event to a submitter.
    Emit {
        /// The submitter's route.
        route: R,
        /// The event.
        event: MessageEvent,
    },
    /// Run a turn on the turn pool.
    StartTurn(TurnJob<A>),
    /// Signal a running turn's cancellation token.
    CancelTurn(TurnId),
    /// A turn was given up on; its worker thread should be replaced (log at WARN).
    TurnAbandoned {
        /// The turn.
        turn: TurnId,
        /// Its session.
        session: SessionKey,
        /// Why.
        reason: AbandonReason,
    },
    /// Close an agent on the cleanup pool.
    Cleanup(CleanupJob<A>),
    /// A cleanup passed its deadline; stop waiting, replace its thread (log WARN `exceeded`).
    CleanupExceeded {
        /// The job.
        job: CleanupId,
        /// Its session.
        session: SessionKey,
        /// Why it ran.
        context: CleanupContext,
    },
    /// A cleanup's `close()` failed or panicked (log WARN `failed`).
    CleanupFailed {
        /// The job.
        job: CleanupId,
        /// Its session.
        session: SessionKey,
        /// Why it ran.
        context: CleanupContext,
        /// What went wrong.
        error: String,
    },
    /// Shutdown has finished; the driver may stop.
    ShutdownComplete(ShutdownReport),
}

/// Counters and gauges of the core, grouped as the status snapshot shows them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct CoreStats {
    /// Sessions and the agents they hold.
    pub sessions: SessionCounts,
    /// Agent turns.
    pub turns: TurnCounts,
    /// Agent cleanups.
    pub cleanups: CleanupCounts,
    /// Messages admitted and refused.
    pub messages: MessageCounts,
}

/// Session gauges.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct SessionCounts {
    /// Sessions holding a slot.
    pub total: usize,
    /// Sessions with a turn in flight.
    pub running: usize,
    /// Messages waiting in session queues.
    pub queued_messages: usize,
    /// Sessions waiting for a free turn worker.
    pub waiting_for_worker: usize,
    /// Idle agents cached (evictable).
    pub cached_agents: usize,
    /// Agents kept by sessions with work waiting for a worker (never evicted).
    pub parked_agents: usize,
    /// Times an agent was kept beyond `max_cached_agents` because its session was busy.
    pub cache_overflows: u64,
}

/// Turn counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct TurnCounts {
    /// Turns in flight (claimed, not abandoned), held ones included.
    pub in_flight: usize,
    /// Of them, held turns not yet on a worker (bounded by `max_held`).
    pub held: usize,
    /// The bound on held turns ([`CoreConfig::max_held_turns`]).
    pub max_held: usize,
    /// Turns that ended with a reply.
    pub completed: u64,
    /// Turns that ended failed (abandoned ones excluded).
    pub failed: u64,
    /// Turns that ended cancelled (abandoned ones excluded).
    pub cancelled: u64,
    /// Turns abandoned (timeout or cancellation ignored past the grace).
    pub abandoned: u64,
}

/// Cleanup counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct CleanupCounts {
    /// Jobs not yet finished nor timed out (any stage).
    pub pending: usize,
    /// Jobs waiting for `close()` to start (bounded; evictions pause when it is full).
    pub queued: usize,
    /// Jobs finished.
    pub done: u64,
    /// Jobs past their deadline (leaked).
    pub timed_out: u64,
    /// Jobs whose `close()` failed or panicked.
    pub failed: u64,
}

/// Message counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct MessageCounts {
    /// Messages accepted.
    pub accepted: u64,
    /// Messages rejected.
    pub rejected: u64,
    /// Queued messages ended `cancelled` before their turn (`/stop`, `/new`, shutdown).
    pub queued_cancelled: u64,
    /// Events that could not be handed to their sink (full or closed). Counted by the driver,
    /// which delivers events; always 0 in [`Core::stats`](super::Core::stats).
    pub events_undelivered: u64,
    /// Partial replies delivered to the message's submitter (after the worker's throttle).
    /// Counted by the driver; always 0 in [`Core::stats`](super::Core::stats).
    pub partials_forwarded: u64,
    /// Partial replies not sent to the runtime's [`Events`](crate::Events) stream because it
    /// held [`Builder::events_backlog`](crate::Builder::events_backlog) unread events (the
    /// outcome still carries the whole reply). Counted by the driver; always 0 in
    /// [`Core::stats`](super::Core::stats).
    #[serde(default)]
    pub partials_skipped: u64,
}

/// A read-only view of one session, for status and tests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionView {
    /// Its slot in the session table; stable for the session's lifetime.
    pub slot: Key,
    /// The session key.
    pub key: SessionKey,
    /// The running turn, if any.
    pub running: Option<TurnId>,
    /// When the running turn started.
    pub running_since: Option<Duration>,
    /// Messages waiting.
    pub queued: usize,
    /// Whether an agent is held between turns (idle, or parked while work waits).
    pub agent_cached: bool,
    /// Where the session's agent is.
    pub agent: AgentPhase,
    /// Whether the session waits in the ready queue for a worker.
    pub waiting_for_worker: bool,
}

/// Where a session's agent is, in its life from the factory call to the end of `close()`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum AgentPhase {
    /// None exists: the next turn creates one.
    Absent,
    /// Held between turns while the session is idle: evictable.
    Idle,
    /// Held while the session's next message waits for a worker: not evictable.
    Parked,
    /// With the running turn (or being created by it).
    InTurn,
    /// Being closed (or still held by an abandoned turn); the session's next turn waits.
    Closing,
}
