//! Liveness: the loop-lag histogram, the status snapshot and the status-file writer.
//!
//! Only the reactor's heartbeat tick produces snapshots, so a wedged loop shows up as a stale
//! `updated_at`. Readers on any thread get the latest snapshot through a [`StatusCell`]; the
//! file is written by its own thread, never by the reactor.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{Receiver, Sender, bounded};
use serde::Serialize;

use crate::agent::AgentUsage;
pub(crate) use crate::core::{CleanupCounts, MessageCounts, SessionCounts, TurnCounts};
use crate::ops::metrics::{LAG_BUCKETS, PromHistogram, TURN_BUCKETS};

/// Exact buckets below this many microseconds; log-linear above.
const LINEAR: u64 = 16;
/// Sub-buckets per power of two (precision 1/8 = 12.5 %).
const SUB_BITS: u32 = 3;
const BUCKETS: usize = 16 + 61 * 8;

/// A histogram of durations with log-linear microsecond buckets (12.5 % precision).
#[derive(Clone)]
pub(crate) struct LagHistogram {
    counts: Box<[u64; BUCKETS]>,
    total: u64,
    max_us: u64,
}

impl Default for LagHistogram {
    fn default() -> Self {
        LagHistogram {
            counts: Box::new([0; BUCKETS]),
            total: 0,
            max_us: 0,
        }
    }
}

impl std::fmt::Debug for LagHistogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LagHistogram(n={}, max={}us)", self.total, self.max_us)
    }
}

fn bucket_of(us: u64) -> usize {
    if us < LINEAR {
        return us as usize;
    }
    let exp = 63 - us.leading_zeros(); // >= 4
    let sub = (us >> (exp - SUB_BITS)) & ((1 << SUB_BITS) - 1);
    (LINEAR as usize) + ((exp - 4) as usize) * (1 << SUB_BITS) + sub as usize
}

/// The largest value that falls in bucket `b`.
fn bucket_high(b: usize) -> u64 {
    if (b as u64) < LINEAR {
        return b as u64;
    }
    let i = b - LINEAR as usize;
    let exp = (i >> SUB_BITS) as u32 + 4;
    let sub = (i & ((1 << SUB_BITS) - 1)) as u64;
    let low = (1u64 << exp) + (sub << (exp - SUB_BITS));
    low.saturating_add((1u64 << (exp - SUB_BITS)) - 1)
}

impl LagHistogram {
    /// Records one sample.
    pub(crate) fn record(&mut self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        self.counts[bucket_of(us)] += 1;
        self.total += 1;
        self.max_us = self.max_us.max(us);
    }

    /// Samples recorded.
    #[cfg(test)]
    pub(crate) fn count(&self) -> u64 {
        self.total
    }

    /// The largest sample.
    pub(crate) fn max(&self) -> Duration {
        Duration::from_micros(self.max_us)
    }

    /// An upper bound (within 12.5 %) of the `q` quantile, `q` in 0..=1; zero when empty.
    pub(crate) fn quantile(&self, q: f64) -> Duration {
        if self.total == 0 {
            return Duration::ZERO;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (b, &n) in self.counts.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return Duration::from_micros(bucket_high(b).min(self.max_us));
            }
        }
        self.max()
    }

    /// Adds `other`'s samples to this histogram.
    pub(crate) fn merge(&mut self, other: &LagHistogram) {
        for (a, b) in self.counts.iter_mut().zip(other.counts.iter()) {
            *a += b;
        }
        self.total += other.total;
        self.max_us = self.max_us.max(other.max_us);
    }

    /// Forgets every sample.
    pub(crate) fn clear(&mut self) {
        self.counts.fill(0);
        self.total = 0;
        self.max_us = 0;
    }

    /// p50, p99 and max in milliseconds.
    pub(crate) fn summary(&self) -> LagSummary {
        // Whole microseconds divided once, so the JSON shows 0.169 rather than 0.16899999.
        let ms = |d: Duration| d.as_micros() as f64 / 1000.0;
        LagSummary {
            p50: ms(self.quantile(0.5)),
            p99: ms(self.quantile(0.99)),
            max: ms(self.max()),
        }
    }
}

/// Slices of a [`LagWindow`].
const WINDOW_SLICES: u64 = 6;

/// Loop lag over a sliding window: the samples of the last `WINDOW_SLICES` slices of
/// `slice` each (with 10 s slices, the last 50 to 60 s), so a wedge an hour into the run
/// shows in the percentiles as it would in the first minute.
#[derive(Clone, Debug)]
pub(crate) struct LagWindow {
    slice: Duration,
    /// Per ring position: the slice number it holds, and its samples.
    slices: Vec<(u64, LagHistogram)>,
}

impl LagWindow {
    /// A window of six slices of `slice` (60 s with 10 s slices).
    pub(crate) fn new(slice: Duration) -> LagWindow {
        debug_assert!(!slice.is_zero(), "a window slice must be positive");
        LagWindow {
            slice,
            slices: (0..WINDOW_SLICES)
                .map(|_| (u64::MAX, LagHistogram::default()))
                .collect(),
        }
    }

    fn slice_of(&self, now: Duration) -> u64 {
        (now.as_nanos() / self.slice.as_nanos().max(1)) as u64
    }

    /// Records a sample taken at `now` (monotonic, non-decreasing).
    pub(crate) fn record(&mut self, now: Duration, lag: Duration) {
        let n = self.slice_of(now);
        let (held, h) = &mut self.slices[(n % WINDOW_SLICES) as usize];
        if *held != n {
            *held = n;
            h.clear();
        }
        h.record(lag);
    }

    /// The samples of the slices still inside the window at `now`.
    pub(crate) fn merged(&self, now: Duration) -> LagHistogram {
        let n = self.slice_of(now);
        let mut out = LagHistogram::default();
        for (held, h) in &self.slices {
            if *held <= n && n - *held < WINDOW_SLICES {
                out.merge(h);
            }
        }
        out
    }
}

/// Percentiles of loop lag in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
#[non_exhaustive]
pub struct LagSummary {
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
}

/// The runtime's lifecycle state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
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
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
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
}

/// A pool's live threads by state (they add up to its live count).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct ThreadStates {
    /// Waiting for a job.
    pub idle: usize,
    /// Running a job.
    pub busy: usize,
    /// Given up on (a job past its deadline), replaced, still alive.
    pub stuck: usize,
}

/// The process, as the heartbeat sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct ProcessInfo {
    /// Resident set size in bytes (`/proc/self/statm`, read at most once a second).
    pub rss_bytes: u64,
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

/// A snapshot of the runtime, refreshed by every heartbeat tick.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Status {
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
    /// Heartbeat lateness over the last minute (see [`LagWindow`]).
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
    pub rejected_by_reason: std::collections::BTreeMap<&'static str, u64>,
    /// What the agents consumed (tokens), when the agent factory counts it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent_usage: Option<AgentUsage>,
    /// The hosted frontend's own figures (the bridge server's connections, platforms,
    /// outboxes and rejections), when it reports any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frontend: Option<serde_json::Value>,
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

/// Formats a system time as RFC 3339 UTC with milliseconds, e.g. `2026-11-29T19:04:05.123Z`.
pub(crate) fn rfc3339_utc(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil-from-days (H. Hinnant): days since 1970-01-01 to year, month, day.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_quantiles_are_tight_upper_bounds() {
        let mut h = LagHistogram::default();
        for us in 1..=1000u64 {
            h.record(Duration::from_micros(us));
        }
        let p50 = h.quantile(0.5).as_micros() as f64;
        let p99 = h.quantile(0.99).as_micros() as f64;
        assert!((500.0..=500.0 * 1.125).contains(&p50), "p50 {p50}");
        assert!((990.0..=1000.0).contains(&p99), "p99 {p99}");
        assert_eq!(h.max(), Duration::from_micros(1000));
        assert_eq!(h.count(), 1000);
    }

    #[test]
    fn every_bucket_holds_the_values_mapped_to_it() {
        for us in [
            0u64,
            1,
            15,
            16,
            17,
            31,
            32,
            1000,
            123_456,
            u64::MAX / 2,
            u64::MAX,
        ] {
            let b = bucket_of(us);
            assert!(b < BUCKETS);
            assert!(
                bucket_high(b) >= us,
                "{us} above its bucket's high {}",
                bucket_high(b)
            );
            if b > 0 {
                assert!(bucket_high(b - 1) < us, "{us} also fits bucket {}", b - 1);
            }
        }
    }

    #[test]
    fn the_lag_window_forgets_slices_older_than_a_minute() {
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        let mut w = LagWindow::new(s(10));
        w.record(s(5), ms(900)); // slice 0
        w.record(s(15), ms(1)); // slice 1
        assert_eq!(w.merged(s(15)).count(), 2);
        assert_eq!(
            w.merged(s(59)).max(),
            ms(900),
            "slice 0 is still in the window at 59 s"
        );
        let later = w.merged(s(60));
        assert_eq!(later.count(), 1, "slice 0 left the window at 60 s");
        assert_eq!(later.max(), ms(1));
        // Slice 6 reuses slice 0's ring position and starts empty.
        w.record(s(61), ms(2));
        let m = w.merged(s(61));
        assert_eq!((m.count(), m.max()), (2, ms(2)));
        assert_eq!(w.merged(s(200)).count(), 0);
    }

    #[test]
    fn merge_and_clear() {
        let mut a = LagHistogram::default();
        let mut b = LagHistogram::default();
        a.record(Duration::from_micros(10));
        b.record(Duration::from_micros(500));
        b.record(Duration::from_micros(20));
        a.merge(&b);
        assert_eq!(a.count(), 3);
        assert_eq!(a.max(), Duration::from_micros(500));
        assert_eq!(a.quantile(0.5), Duration::from_micros(21), "20 µs's bucket");
        a.clear();
        assert_eq!((a.count(), a.max()), (0, Duration::ZERO));
        assert_eq!(a.quantile(0.5), Duration::ZERO);
    }

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
}
