//! Liveness: the status snapshot, the cell readers get it from and the status-file writer.
//!
//! Only the reactor's heartbeat tick produces snapshots, so a wedged loop shows up as a stale
//! `updated_at`. Readers on any thread get the latest snapshot through a [`StatusCell`]; the
//! file is written by its own thread, never by the reactor.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{Receiver, Sender, bounded};
use serde::{Deserialize, Serialize};

use crate::agent::{AgentUsage, ModelUsage};
pub(crate) use crate::core::{CleanupCounts, MessageCounts, SessionCounts, TurnCounts};
use crate::histogram::LagSummary;
use crate::histogram::{JOURNAL_BUCKETS, LAG_BUCKETS, PromHistogram, TURN_BUCKETS};

/// The runtime's lifecycle state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum RuntimeState {
    /// Built, loop not yet running.
    #[default]
    Starting,
    /// Serving.
    Running,
    /// Shutdown in progress.
    Draining,
    /// The loop has ended.
    Stopped,
}

/// Worker thread gauges.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct WorkerCounts {
    /// Turn-pool threads alive (stuck ones included).
    pub turn: usize,
    /// Cleanup-pool threads alive (stuck ones included).
    pub cleanup: usize,
    /// Replacement threads started for stuck jobs, both pools.
    pub replaced: u64,
    /// The turn pool's threads by state.
    pub turn_threads: ThreadStates,
    /// The cleanup pool's threads by state.
    pub cleanup_threads: ThreadStates,
    /// Async agents' turns in flight as tasks on the embedder's executor (feature `async`,
    /// `Builder::new_async`); no pool thread is held for them.
    /// At most `turn_workers`, plus given-up turns whose task the executor has yet to poll.
    pub async_turns: usize,
    /// Async agents' closes in flight as tasks (at most `max_cleanup_workers`, plus
    /// given-up ones not yet polled).
    pub async_closes: usize,
}

/// A pool's live threads by state (they add up to its live count).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ThreadStates {
    /// Waiting for a job.
    pub idle: usize,
    /// Running a job.
    pub busy: usize,
    /// Given up on (a job past its deadline), replaced, still alive.
    pub stuck: usize,
}

/// The process, as the heartbeat sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ProcessInfo {
    /// Resident set size in bytes (`/proc/self/statm`; it and the CPU and descriptor figures
    /// are read at most once a second).
    pub rss_bytes: u64,
    /// User and system CPU time the process consumed, in seconds.
    pub cpu_seconds: f64,
    /// Open file descriptors.
    pub open_fds: u64,
    /// The soft limit on open file descriptors (`RLIMIT_NOFILE`).
    pub max_fds: u64,
    /// When the loop started, in seconds since the Unix epoch.
    pub started_unix_s: f64,
    /// When this snapshot was taken, in seconds since the Unix epoch.
    pub updated_unix_s: f64,
    /// The heartbeat period in seconds (a snapshot older than three is stale).
    pub tick_interval_s: f64,
}

/// Histograms kept for the metrics; not part of the JSON status.
#[derive(Clone, Debug, PartialEq)]
pub struct Histograms {
    /// Heartbeat lateness since start.
    pub loop_lag: PromHistogram,
    /// Turn durations (claim to end) since start.
    pub turn_duration: PromHistogram,
}

impl Default for Histograms {
    fn default() -> Self {
        Histograms {
            loop_lag: PromHistogram::new(LAG_BUCKETS),
            turn_duration: PromHistogram::new(TURN_BUCKETS),
        }
    }
}

/// What the hosted [`Frontend`](crate::Frontend) reports in the status snapshot
/// ([`Status::frontend`]), typed so the metrics and the readiness checks read fields, not
/// JSON paths.
///
/// In JSON it is one flat object: the bridge server's figures at its top level, the HTTP
/// endpoint's under `http`, and an embedder's own figures beside them. An embedder's
/// frontend fills [`FrontendStatus::custom`] (starting from `FrontendStatus::default()`):
/// those figures appear in `/status` and the status file as given; the metrics and the
/// readiness checks read only the typed fields.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(bound(deserialize = "'de: 'static"))]
#[non_exhaustive]
pub struct FrontendStatus {
    /// The bridge server's figures, when the bridge server is hosted.
    #[serde(flatten)]
    pub bridge: Option<BridgeStatus>,
    /// The operations HTTP endpoint's figures, when it is served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<HttpStatus>,
    /// How long the bridge server's ready connections waited for their turn (`service`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<ServiceStatus>,
    /// The platform bridges `serve` runs as its children (`[[bridge]]` tables), in table
    /// order; empty (and absent in JSON) without any.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bridges: Vec<SupervisedBridge>,
    /// Any other frontend's own figures, by name (shown, never read back).
    #[serde(flatten)]
    pub custom: BTreeMap<String, serde_json::Value>,
}

/// Where a supervised bridge is (`frontend.bridges[].state`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SupervisedState {
    /// Its process runs and has not yet connected to the gateway and its platform.
    #[default]
    Starting,
    /// Connected to the gateway (said hello) and, if it reports it, to its platform.
    Ready,
    /// Its process runs, but it reported its platform connection down (`link` op), or its
    /// connection to the gateway is gone: `reason` says why.
    Reconnecting,
    /// Its process exited; it is restarted after a backoff.
    Backoff,
}

/// One supervised bridge (a `[[bridge]]` table) in the status.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct SupervisedBridge {
    /// The table's number, from 1.
    pub index: usize,
    /// Its platform (`matrix`, `irc`, `telegram`).
    pub platform: String,
    /// Where it is.
    pub state: SupervisedState,
    /// Why it is reconnecting (what it reported), when it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Times its process was started again after an exit.
    pub restarts: u64,
    /// When it entered its state (RFC 3339, UTC).
    pub since: String,
    /// How its process last exited (`exit status: 1`, `signal: 9 …`), if it ever did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_exit: Option<String>,
    /// Its last ERROR log line (secrets redacted, cut at 512 bytes), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// The operations HTTP endpoint's figures (`frontend.http` in the status), for the metrics.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HttpStatus {
    /// Open connections.
    pub connections: usize,
    /// The connection cap.
    pub max_connections: usize,
    /// The request head bound in bytes.
    pub max_header_bytes: usize,
    /// Requests served per connection.
    pub max_requests: usize,
    /// Seconds a connection has to complete a request.
    pub idle_timeout_s: f64,
    /// Requests answered (any status).
    pub requests: u64,
    /// Connections refused at the cap.
    pub refused: u64,
    /// Requests answered `401`.
    pub unauthorized: u64,
    /// Requests answered `400`, `404`, `405` or `431`.
    pub bad_requests: u64,
    /// Connections closed for not completing a request in time.
    pub idle_closed: u64,
    /// The cap on one peer address's connections.
    pub max_per_peer: usize,
    /// Seconds a new connection has to send its first request's head.
    pub head_timeout_s: f64,
    /// Requests answered per loop pass across all connections.
    pub answers_per_pass: usize,
    /// Idle connections closed to make room for a new one (at a cap).
    pub evicted: u64,
    /// Connections closed for not sending their first request's head in time.
    pub head_timeouts: u64,
    /// New connections are served TLS (`--tls-cert`).
    pub tls: bool,
    /// Passes that ended with requests left for the next (the pass budget was spent).
    pub budget_spent: u64,
    /// `/status` and `/metrics` bodies rendered (once per snapshot each, at most).
    pub renders: u64,
}

/// The crate's version.
pub(crate) const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The git revision the binary was built from (`unknown` outside a checkout).
pub(crate) const REVISION: &str = env!("TURNSTILE_REVISION");

/// The bridge server's service delays (`frontend.service` in the status): how long a ready
/// connection waited for its turn, as its client sees it, beside the heartbeat's lag. A
/// connection that is readable waits in a round-robin queue until it is read; one with
/// output and room for it, until it is written.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ServiceStatus {
    /// Readable → read, since start.
    pub read_delay_ms: LagSummary,
    /// Readable → read, over the last 10 to 12 s (`/healthz` judges its p99).
    pub read_delay_recent_ms: LagSummary,
    /// Output ready → written, since start.
    pub write_delay_ms: LagSummary,
    /// Output ready → written, over the last 10 to 12 s (`/healthz` judges its p99).
    pub write_delay_recent_ms: LagSummary,
    /// Connections waiting to be read now.
    pub read_queue: usize,
    /// Connections waiting to be written now.
    pub write_queue: usize,
    /// Readable → read in the metrics' buckets (not in the JSON).
    #[serde(skip, default = "lag_histogram")]
    pub read_delay: PromHistogram,
    /// Output ready → written in the metrics' buckets (not in the JSON).
    #[serde(skip, default = "lag_histogram")]
    pub write_delay: PromHistogram,
}

/// An empty histogram in the loop-lag buckets (a skipped field's value when read back).
fn lag_histogram() -> PromHistogram {
    PromHistogram::new(LAG_BUCKETS)
}

/// An empty histogram in the journal-write buckets (a skipped field's value when read back).
fn journal_histogram() -> PromHistogram {
    PromHistogram::new(JOURNAL_BUCKETS)
}

impl Default for ServiceStatus {
    fn default() -> Self {
        ServiceStatus {
            read_delay_ms: LagSummary::default(),
            read_delay_recent_ms: LagSummary::default(),
            write_delay_ms: LagSummary::default(),
            write_delay_recent_ms: LagSummary::default(),
            read_queue: 0,
            write_queue: 0,
            read_delay: PromHistogram::new(LAG_BUCKETS),
            write_delay: PromHistogram::new(LAG_BUCKETS),
        }
    }
}

/// A snapshot of the runtime, refreshed by every heartbeat tick.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Status {
    /// The crate's version (`CARGO_PKG_VERSION`).
    #[serde(borrow)]
    pub version: &'static str,
    /// The git revision it was built from, or `unknown`.
    #[serde(borrow)]
    pub revision: &'static str,
    /// Process id.
    pub pid: u32,
    /// Lifecycle state.
    pub state: RuntimeState,
    /// When the reactor produced this snapshot (RFC 3339, UTC).
    pub updated_at: String,
    /// Seconds since the loop started.
    pub uptime_s: f64,
    /// Heartbeat ticks so far.
    pub ticks: u64,
    /// Heartbeat lateness since start.
    pub loop_lag_ms: LagSummary,
    /// Heartbeat lateness over the last minute (six 10 s slices).
    pub loop_lag_window_ms: LagSummary,
    /// The latest tick's lateness in milliseconds.
    pub loop_lag_last_ms: f64,
    /// The process: memory, start and snapshot times, heartbeat period.
    pub process: ProcessInfo,
    /// Sessions.
    pub sessions: SessionCounts,
    /// Turns.
    pub turns: TurnCounts,
    /// Cleanups.
    pub cleanups: CleanupCounts,
    /// Worker threads.
    pub workers: WorkerCounts,
    /// Messages.
    pub messages: MessageCounts,
    /// The runtime's rejections by reason (`queue_full`, `overloaded`, `shutting_down`); a
    /// frontend may refuse more, counted in its own figures.
    #[serde(borrow)]
    pub rejected_by_reason: BTreeMap<&'static str, u64>,
    /// What the agents consumed (tokens), when the agent factory counts it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_usage: Option<AgentUsage>,
    /// The same split by model (empty when the factory does not count usage).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub agent_usage_by_model: Vec<ModelUsage>,
    /// The agents' failed model requests by kind (connect, status, stall), when the agent
    /// factory makes requests of its own (the openai agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_failures: Option<crate::agent::AgentFailures>,
    /// Per named agent (`[[agent]]` tables and the top-level `default`), its live sessions,
    /// usage and failures; empty for a gateway of one agent.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub agents: Vec<crate::agent::AgentFigures>,
    /// The hosted frontend's own figures (the bridge server's connections, platforms,
    /// outboxes and rejections; the HTTP endpoint's), when it reports any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frontend: Option<FrontendStatus>,
    /// Histograms for the metrics.
    #[serde(skip)]
    pub histograms: Arc<Histograms>,
}

/// The latest snapshot, shared between the reactor (writer) and any reader.
#[derive(Default)]
pub(crate) struct StatusCell {
    current: Mutex<Arc<Status>>,
    changed: Condvar,
}

impl StatusCell {
    /// Publishes a snapshot and wakes waiters.
    pub(crate) fn publish(&self, status: Arc<Status>) {
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = status;
        self.changed.notify_all();
    }

    /// The latest snapshot.
    pub(crate) fn get(&self) -> Arc<Status> {
        Arc::clone(&self.current.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Waits until a published snapshot satisfies `pred`, or `timeout` passes.
    pub(crate) fn wait_for(
        &self,
        timeout: Duration,
        mut pred: impl FnMut(&Status) -> bool,
    ) -> Option<Arc<Status>> {
        let deadline = Instant::now() + timeout;
        let mut cur = self.current.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if pred(&cur) {
                return Some(Arc::clone(&cur));
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            cur = match self.changed.wait_timeout(cur, deadline - now) {
                Ok((g, _)) => g,
                Err(e) => e.into_inner().0,
            };
        }
    }
}

/// Civil-from-days (H. Hinnant): days since 1970-01-01 to (year, month, day), proleptic
/// Gregorian, for any day count.
pub(crate) fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

/// Formats a system time as RFC 3339 UTC with milliseconds, e.g. `2026-11-29T19:04:05.123Z`.
pub(crate) fn rfc3339_utc(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_millis()
    )
}

/// Writes snapshots to a file atomically (temp file, then rename) on its own thread. There is
/// no fsync: a reader always sees a whole snapshot (the rename is atomic), and after a crash
/// of the machine the file may be old or missing — a status file describes a running process
/// and is worthless after a reboot anyway, and syncing it ten times a second costs the disk.
pub(crate) struct StatusFileWriter {
    tx: Option<Sender<Arc<Status>>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl StatusFileWriter {
    /// Starts the writer thread for `path`.
    pub(crate) fn start(path: PathBuf) -> std::io::Result<StatusFileWriter> {
        // One slot: if the disk is slow, the reactor skips snapshots rather than waiting.
        let (tx, rx) = bounded::<Arc<Status>>(1);
        let thread = thread::Builder::new()
            .name("turnstile-status".into())
            .spawn(move || write_loop(&path, &rx))?;
        Ok(StatusFileWriter {
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    /// Hands a snapshot to the writer without blocking; dropped if the writer is busy.
    pub(crate) fn offer(&self, status: Arc<Status>) {
        if let Some(tx) = &self.tx {
            let _ = tx.try_send(status);
        }
    }

    /// Writes `status` as the last snapshot and waits for the writer to finish.
    pub(crate) fn finish(mut self, status: Arc<Status>) {
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(status);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn write_loop(path: &Path, rx: &Receiver<Arc<Status>>) {
    let mut failing = false;
    for status in rx.iter() {
        match write_atomically(path, &status) {
            Ok(()) if failing => {
                log::info!("status file {} is being written again", path.display());
                failing = false;
            }
            Ok(()) => {}
            Err(e) if !failing => {
                log::warn!("status file {}: write failed: {e}", path.display());
                failing = true;
            }
            Err(_) => {}
        }
    }
}

fn write_atomically(path: &Path, status: &Status) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut f = fs::File::create(&tmp)?;
    serde_json::to_writer(&mut f, status).map_err(std::io::Error::other)?;
    f.write_all(b"\n")?;
    fs::rename(&tmp, path)
}

// ---- the bridge's figures (filled by the bridge server) --------------------------------

/// One platform's figures in the status.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PlatformStatus {
    /// Connections that said hello for it.
    pub connections: usize,
    /// Terminal events waiting in its outbox.
    pub outbox_events: usize,
    /// Bytes of those events.
    pub outbox_bytes: usize,
    /// Terminal events reserved (accepted messages not yet answered, outbox included).
    pub reserved_events: usize,
    /// Bytes held for them: each one's envelope, plus the text of each result that exists
    /// and is not held (never past `--outbox-bytes`).
    pub reserved_bytes: usize,
    /// Results that exist but wait for room within `--outbox-bytes`, in order.
    pub held_events: usize,
    /// Text bytes of those results (charged when they are released).
    pub held_bytes: usize,
    /// How long no connection has said hello for it (`None` while one has).
    pub absent_ms: Option<u64>,
    /// Absent past `--outbox-stale-after`: its waiting results beyond `--outbox-stale-keep`
    /// are dropped.
    pub stale: bool,
    /// Results dropped undelivered because it was stale.
    pub stale_dropped: u64,
    /// Ids in its duplicate window.
    pub dedup_ids: usize,
    /// What its bridge last reported of its own connection to the platform (the `link` op),
    /// from the newest connection that reported; absent when none did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link: Option<LinkStatus>,
}

/// A bridge's report of its connection to its platform (`link` op, docs/protocol.md).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkStatus {
    /// Connected to the platform.
    pub up: bool,
    /// Its reason (e.g. the error that took the connection down), if it gave one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// The attachments spool's bounds and figures (`frontend.attachments`, issue 36).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct AttachmentsStatus {
    /// The spool directory (`--attachments-dir`).
    pub dir: String,
    /// Bytes its files held at the last measure (every 5 s, off the reactor).
    pub spool_used_bytes: u64,
    /// Its bound, `--attachments-bytes`: bridges skip a file that does not fit.
    pub spool_bytes: u64,
    /// `--max-attachment-bytes`.
    pub max_file_bytes: u64,
    /// `--max-attachments`.
    pub max_files: usize,
    /// Files deleted since start because their message's route ended.
    pub released: u64,
    /// Batches of files left to the start-up sweep (the janitor's queue was full).
    pub release_dropped: u64,
}

/// The bridge's figures, for the status snapshot.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct BridgeStatus {
    /// Open connections.
    pub connections: usize,
    /// Connections that have not authenticated yet.
    pub unauthenticated: usize,
    /// Platforms known.
    pub platforms: usize,
    /// Per platform.
    pub outboxes: BTreeMap<String, PlatformStatus>,
    /// Rejections by reason, the runtime's included.
    #[serde(borrow)]
    pub rejected: BTreeMap<&'static str, u64>,
    /// Connections refused or closed at a bound (too many, hello deadline, stall).
    pub connections_refused: u64,
    /// Lines answered with `error`.
    pub errors: u64,
    /// Partial replies dropped (connection gone or over its output bound).
    pub partials_dropped: u64,
    /// Typing lines dropped (no connection, or over its output bound).
    pub typing_dropped: u64,
    /// Results dropped undelivered, owed to platforms absent past `--outbox-stale-after`
    /// (beyond `--outbox-stale-keep` each); each was logged at WARN.
    pub stale_dropped: u64,
    /// Durability (`--data-dir`); absent without it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub journal: Option<JournalStatus>,
    /// Results written to `acks` connections and not yet confirmed `delivered`.
    pub awaiting_delivery: usize,
    /// New connections are served TLS (`--tls-cert`).
    pub tls: bool,
    /// The served certificate's `notAfter`, in seconds since the Unix epoch; absent without TLS.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert_not_after_unix_s: Option<i64>,
    /// Cluster membership (`--cluster`); absent without it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<ClusterStatus>,
    /// The access policy (docs/access.md): notices answered by kind, codes pending.
    #[serde(default)]
    pub access: crate::AccessFigures,
    /// The attachments spool, when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attachments: Option<AttachmentsStatus>,
}

/// A cluster member's figures (`--cluster`, docs/cluster.md): what it owns, what waits on
/// other instances, how often ownership changed hands, and its stream reader's health.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ClusterStatus {
    /// This instance's id (`--instance-id`).
    pub instance: String,
    /// Live instances in the registry, this one included, as the reader last read them
    /// (every second), by name; empty until the first read.
    pub live_instances: Vec<String>,
    /// The partition count (`--partitions`).
    pub partitions: u32,
    /// How many partitions this instance owns now (at most `partitions`).
    pub owned_partitions: usize,
    /// Which, in order.
    pub owned: Vec<u32>,
    /// Messages acked here whose outcome another instance owes (each holds its route and
    /// an outbox reservation, within the platforms' bounds).
    pub remote_waiting: usize,
    /// Messages accepted here into a partition owned here, durable, held until the stream
    /// reader has brought every message accepted before them elsewhere (per-session order
    /// across instances); they count against `--max-pending-durable` (10,000), past which
    /// a new message is refused `overloaded`.
    pub order_held: usize,
    /// Outcomes from the stream kept until their message is known here (one can come before
    /// this instance's own journal reports the message placed); at most the messages in
    /// flight plus 1,024, the oldest dropped past it.
    pub early_outcomes: usize,
    /// Of those, dropped at that bound since the start.
    pub early_outcomes_dropped: u64,
    /// Stream entries of outcomes this instance wrote itself, kept in case a write given up
    /// as unwritten (its answer lost) landed after all; at most the messages in flight plus
    /// 1,024, the oldest dropped past it (most are of writes whose answer came).
    pub own_outcome_entries: usize,
    /// Messages of owned partitions another instance accepted, waiting here for room in
    /// their platform's outbox (`--outbox-cap`) before they are queued, in order; a new
    /// message of that platform is refused `backpressure` meanwhile. At most the owned
    /// partitions' messages in Redis.
    #[serde(default)]
    pub waiting_for_room: usize,
    /// Whether what is held beyond the fair share is drained and released when another
    /// instance joins (`--cluster-rebalance`).
    pub rebalance: bool,
    /// The longest drain of a partition being released, in milliseconds
    /// (`--cluster-drain-ms`); past it the partition is released as if lost.
    pub drain_ms: u64,
    /// Partitions being drained now, in order.
    pub draining: Vec<u32>,
    /// Partitions drained and released since the start.
    pub drained_partitions: u64,
    /// The messages those drains handed over to their next owner.
    pub drained_messages: u64,
    /// Partitions gained (acquired and loaded) since the start.
    pub gained: u64,
    /// Partitions lost (a lease not renewed in time) since the start.
    pub lost: u64,
    /// Partitions fenced while owned here (another instance held the lease at a write)
    /// since the start; each ownership ends once in `lost + fenced`.
    pub fenced: u64,
    /// Partitions this instance fenced itself out of since the start: a lease not renewed
    /// by its fence deadline (the lease less `--max-clock-skew-ms`), its running turns
    /// stopped before the lease could expire (also counted in `lost`).
    #[serde(default)]
    pub self_fenced: u64,
    /// Partitions handed over in place (lost or fenced, once per ownership) since the start.
    pub handed_over_partitions: u64,
    /// The messages those hand-overs took from this instance.
    pub handed_over_messages: u64,
    /// The stream reader's failed reads of Redis (each retried).
    pub reader_failures: u64,
    /// Times the reader read again after failing (a new connection to Redis).
    pub reader_reconnects: u64,
    /// The reader's last read failed.
    pub reader_failing: bool,
    /// What the reader brought and the reactor has not taken yet (at most 4,096,
    /// `MAX_ARRIVALS`; at the bound the reader waits for room, reading nothing more).
    pub reader_arrivals: usize,
    /// The hello registry's and the forwards' requests waiting for Redis on the reader
    /// (at most 4,096, `MAX_REQUESTS`; past it a new one is dropped, with a WARN).
    pub forward_requests: usize,
    /// Of those, dropped at that bound since the start.
    pub forward_requests_dropped: u64,
    /// Results in this instance's outboxes offered to another instance (the platform's
    /// newest hello is there) and not answered yet (a subset of the outboxes' results).
    pub forwards_waiting: usize,
    /// Results another instance took from this one since the start (this one's copies
    /// dropped).
    pub forwarded_out: u64,
    /// Results taken here from another instance since the start (marked `redelivery`; one
    /// offered again and held here already is not counted again).
    pub forwarded_in: u64,
    /// Results offered here and refused since the start (no room within the platform's
    /// bounds, no connection of the platform here, no longer in Redis): they stay where
    /// they were.
    pub forwards_refused: u64,
}

/// The journal's figures in the status.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct JournalStatus {
    /// Bytes the journal's files take on disk (database, write-ahead log, mark; not the
    /// reserve), as of its last write or idle pass; absent for a store without files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_bytes: Option<u64>,
    /// How long each of the journal thread's writes took (commit, sync, mark), for the
    /// metrics.
    #[serde(skip, default = "journal_histogram")]
    pub write_seconds: PromHistogram,
    /// Records sent to the journal thread and not yet taken.
    pub queued_records: usize,
    /// Accepted messages waiting to be durable before their ack.
    pub pending_durable: usize,
    /// Terminal events waiting for their outcome record before they are sent.
    pub unjournaled_outcomes: usize,
    /// The bound on them (`--max-pending-durable`).
    pub max_pending_durable: usize,
    /// Transactions written.
    pub batches: u64,
    /// Transactions that failed.
    pub failed_batches: u64,
    /// Records kept for another try after a failed write.
    pub retrying: usize,
    /// The last write failed (new messages are rejected `storage`).
    pub failing: bool,
    /// Wake-ups of the reactor by the journal thread that reached the server on the
    /// journal's own poll token (set by the shell).
    pub wakes: u64,
    /// What start-up recovery found.
    pub recovery: RecoveryCounts,
    /// The stored conversations (the openai agent's durable history); absent for a store
    /// that keeps none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history: Option<HistoryStatus>,
}

/// The journal's stored conversations (`journal.history` in the status).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct HistoryStatus {
    /// Sessions with a stored conversation.
    pub sessions: u64,
    /// Their bytes together (bounded by `--history-bytes`).
    pub bytes: u64,
    /// Conversations deleted since the start because the total passed `--history-bytes`
    /// (least recently used first).
    pub evicted: u64,
    /// Conversations deleted since the start because nobody continued them for
    /// `--history-ttl`.
    pub expired: u64,
}

impl Default for JournalStatus {
    fn default() -> Self {
        JournalStatus {
            disk_bytes: None,
            write_seconds: PromHistogram::new(JOURNAL_BUCKETS),
            queued_records: 0,
            pending_durable: 0,
            unjournaled_outcomes: 0,
            max_pending_durable: 0,
            batches: 0,
            failed_batches: 0,
            retrying: 0,
            failing: false,
            wakes: 0,
            recovery: RecoveryCounts::default(),
            history: None,
        }
    }
}

/// What start-up recovery did, by message.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct RecoveryCounts {
    /// Messages found in the journal.
    pub messages: usize,
    /// Waiting messages submitted again, in their original order.
    pub requeued: usize,
    /// Interrupted turns run again (`--resume-interrupted`).
    pub resumed: usize,
    /// Interrupted turns failed `interrupted by restart`.
    pub interrupted: usize,
    /// Messages failed `poison` (interrupted twice).
    pub poisoned: usize,
    /// Outcomes not yet delivered, back in their outboxes.
    pub outcomes: usize,
    /// Ids in the duplicate windows.
    pub dedup_ids: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_formats_known_instants() {
        assert_eq!(rfc3339_utc(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let t = UNIX_EPOCH + Duration::from_millis(1_795_950_245_123);
        assert_eq!(rfc3339_utc(t), "2026-11-29T11:04:05.123Z");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(rfc3339_utc(leap), "2000-02-29T00:00:00.000Z");
    }

    #[test]
    fn status_file_is_replaced_atomically_with_json() {
        let dir = std::env::temp_dir().join(format!("turnstile-status-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("status.json");
        let w = StatusFileWriter::start(path.clone()).unwrap();
        let status = Status {
            pid: 7,
            ticks: 3,
            ..Status::default()
        };
        w.finish(Arc::new(status));
        let v: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(v["pid"], 7);
        assert_eq!(v["ticks"], 3);
        assert_eq!(v["state"], "starting");
        assert!(!dir.join("status.json.tmp").exists());
        let _ = fs::remove_dir_all(&dir);
    }

    /// `frontend` stays one flat object: the bridge's figures at its top, `http` beside them,
    /// an embedder's figures beside those; absent parts leave no key.
    #[test]
    fn the_frontend_status_serializes_flat() {
        let bridge = BridgeStatus {
            connections: 3,
            ..BridgeStatus::default()
        };
        let mut f = FrontendStatus {
            bridge: Some(bridge.clone()),
            http: Some(HttpStatus::default()),
            ..FrontendStatus::default()
        };
        f.custom.insert("mine".into(), serde_json::json!({"n": 1}));
        let v = serde_json::to_value(&f).unwrap();
        let mut want = serde_json::to_value(&bridge).unwrap();
        want["http"] = serde_json::to_value(HttpStatus::default()).unwrap();
        want["mine"] = serde_json::json!({"n": 1});
        assert_eq!(v, want);
        assert_eq!(v["connections"], 3);
        assert!(v.get("journal").is_none() && v.get("bridge").is_none());
        let empty = serde_json::to_value(FrontendStatus::default()).unwrap();
        assert_eq!(empty, serde_json::json!({}));
    }
}
