//! A worker pool that grows on demand up to a cap and can give up on a stuck thread without
//! waiting for it.
//!
//! Jobs go through a crossbeam channel. `size` threads always run; when a job is queued and
//! no thread is idle, another is started (up to `max_threads` working threads), and threads
//! beyond `size` retire after `keepalive` without work. When the reactor gives up on a running
//! job (turn abandoned, cleanup past its deadline) it calls [`Pool::replace`]: that thread no
//! longer counts toward the cap, so the next job gets a fresh thread at once, and the stuck
//! one exits if its job ever returns. Given-up threads still alive are capped too.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::thread;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, unbounded};

const QUEUED: u8 = 0;
const RUNNING: u8 = 1;
const DONE: u8 = 2;
const REPLACED: u8 = 3;

/// Tracks one submitted job, so the reactor can give up on the thread it is stuck on.
#[derive(Clone, Debug)]
pub(crate) struct JobTicket(Arc<AtomicU8>);

/// What [`Pool::replace`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Replacement {
    /// The thread no longer counts toward the pool's cap; it exits when its job returns.
    Spawned,
    /// The job was not running (still queued or already done): nothing to replace.
    NotRunning,
    /// The cap on given-up threads still alive was reached.
    Refused,
}

/// How many threads a pool runs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PoolSize {
    /// Threads that always run.
    pub min: usize,
    /// Working threads at most (given-up ones excluded).
    pub max: usize,
    /// Given-up (stuck) threads that may stay alive beyond `max`.
    pub max_stuck: usize,
    /// How long a thread beyond `min` waits for work before it retires.
    pub keepalive: Duration,
}

type Job<J> = (J, JobTicket);

struct Shared<J> {
    name: &'static str,
    size: PoolSize,
    rx: Receiver<Job<J>>,
    run: Box<dyn Fn(J) + Send + Sync>,
    /// Threads alive, given-up ones included.
    live: AtomicUsize,
    /// Threads waiting for a job.
    idle: AtomicUsize,
    /// Jobs sent and not yet taken.
    queued: AtomicUsize,
    /// Given-up threads still alive.
    stuck: AtomicUsize,
    replaced: AtomicU64,
}

impl<J> Shared<J> {
    fn working(&self) -> usize {
        self.live
            .load(SeqCst)
            .saturating_sub(self.stuck.load(SeqCst))
    }
}

/// A pool of threads running jobs of type `J`.
pub(crate) struct Pool<J: Send + 'static> {
    tx: Sender<Job<J>>,
    shared: Arc<Shared<J>>,
}

impl<J: Send + 'static> Pool<J> {
    /// Starts `size.min` threads named `name` that run each job with `run`.
    pub(crate) fn new(
        name: &'static str,
        size: PoolSize,
        run: impl Fn(J) + Send + Sync + 'static,
    ) -> std::io::Result<Pool<J>> {
        // Bounded by the core: jobs are sent only for turns it started (its running-turn
        // cap) and agents it retired (its cleanup cap), never straight from a peer.
        let (tx, rx) = unbounded();
        let shared = Arc::new(Shared {
            name,
            size,
            rx,
            run: Box::new(run),
            live: AtomicUsize::new(0),
            idle: AtomicUsize::new(0),
            queued: AtomicUsize::new(0),
            stuck: AtomicUsize::new(0),
            replaced: AtomicU64::new(0),
        });
        for _ in 0..size.min {
            // On failure `tx` drops with the error, so the threads started so far exit.
            spawn_worker(&shared)?;
        }
        Ok(Pool { tx, shared })
    }

    /// Queues a job, starting a thread if none is idle and the cap allows. Never blocks.
    pub(crate) fn submit(&self, job: J) -> JobTicket {
        let ticket = JobTicket(Arc::new(AtomicU8::new(QUEUED)));
        let s = &self.shared;
        // Counted before the idle check, and a retiring thread un-counts itself as idle
        // before it checks this count: either it stays for the job or we start a thread.
        let queued = s.queued.fetch_add(1, SeqCst) + 1;
        // The receiver lives in `shared`, which we hold, so the channel cannot be closed.
        let _ = self.tx.send((job, ticket.clone()));
        if queued > s.idle.load(SeqCst)
            && s.working() < s.size.max
            && let Err(e) = spawn_worker(s)
        {
            log::error!("{}: cannot start a thread: {e}", s.name);
        }
        ticket
    }

    /// Gives up on the thread running `ticket`'s job: it stops counting toward the cap (the
    /// next job gets another thread) and exits if its job ever returns.
    pub(crate) fn replace(&self, ticket: &JobTicket) -> Replacement {
        let s = &self.shared;
        if s.stuck.load(SeqCst) >= s.size.max_stuck {
            return Replacement::Refused;
        }
        if ticket
            .0
            .compare_exchange(RUNNING, REPLACED, SeqCst, SeqCst)
            .is_err()
        {
            return Replacement::NotRunning;
        }
        s.stuck.fetch_add(1, SeqCst);
        s.replaced.fetch_add(1, SeqCst);
        // Keep `min` threads ready for work even before the next submission.
        if s.working() < s.size.min
            && let Err(e) = spawn_worker(s)
        {
            log::error!("{}: cannot start a replacement thread: {e}", s.name);
        }
        Replacement::Spawned
    }

    /// Threads alive now, stuck ones included.
    pub(crate) fn live_threads(&self) -> usize {
        self.shared.live.load(SeqCst)
    }

    /// Threads given up on (replaced) and still alive.
    pub(crate) fn stuck_threads(&self) -> usize {
        self.shared.stuck.load(SeqCst)
    }

    /// Threads waiting for a job.
    pub(crate) fn idle_threads(&self) -> usize {
        self.shared.idle.load(SeqCst)
    }

    /// Threads given up on so far.
    pub(crate) fn replaced(&self) -> u64 {
        self.shared.replaced.load(SeqCst)
    }
}

/// Nice value of pool threads relative to the process: on a busy machine the scheduler then
/// favours the reactor thread, so agent work cannot delay the loop and its heartbeat.
const WORKER_NICE: libc::c_int = 5;

fn lower_priority() {
    // SAFETY: gettid and setpriority take no pointers; on Linux, PRIO_PROCESS with a thread
    // id sets that thread's nice value. Failure (e.g. a seccomp filter) only loses the hint.
    unsafe {
        let tid = libc::gettid();
        let current = libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t);
        let _ = libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, current + WORKER_NICE);
    }
}

/// Starts a pool thread.
fn spawn_worker<J: Send + 'static>(shared: &Arc<Shared<J>>) -> std::io::Result<()> {
    let worker = Arc::clone(shared);
    worker.live.fetch_add(1, SeqCst);
    let spawned = thread::Builder::new()
        .name(shared.name.to_owned())
        .spawn(move || {
            lower_priority();
            work(&worker);
        });
    if let Err(e) = spawned {
        shared.live.fetch_sub(1, SeqCst);
        return Err(e);
    }
    Ok(())
}

/// A pool thread's life: take jobs until the pool is dropped, it retires for lack of work,
/// or it was given up on while stuck.
fn work<J>(s: &Shared<J>) {
    loop {
        s.idle.fetch_add(1, SeqCst);
        let next = s.rx.recv_timeout(s.size.keepalive);
        s.idle.fetch_sub(1, SeqCst);
        let (job, ticket) = match next {
            Ok(job) => job,
            Err(RecvTimeoutError::Timeout) => {
                if s.queued.load(SeqCst) == 0 && retire(s) {
                    return;
                }
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => break,
        };
        s.queued.fetch_sub(1, SeqCst);
        ticket.0.store(RUNNING, SeqCst);
        if catch_unwind(AssertUnwindSafe(|| (s.run)(job))).is_err() {
            log::error!("{}: a job panicked outside its own guard", s.name);
        }
        if ticket
            .0
            .compare_exchange(RUNNING, DONE, SeqCst, SeqCst)
            .is_err()
        {
            // Given up on while stuck: a replacement took this thread's place.
            s.stuck.fetch_sub(1, SeqCst);
            break;
        }
    }
    s.live.fetch_sub(1, SeqCst);
}

/// Leaves the pool if more than `min` working threads remain; true if this thread retired.
fn retire<J>(s: &Shared<J>) -> bool {
    s.live
        .fetch_update(SeqCst, SeqCst, |live| {
            (live.saturating_sub(s.stuck.load(SeqCst)) > s.size.min).then(|| live - 1)
        })
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crossbeam_channel::bounded;

    fn size(min: usize, max: usize, max_stuck: usize) -> PoolSize {
        PoolSize {
            min,
            max,
            max_stuck,
            keepalive: Duration::from_secs(3600),
        }
    }

    #[test]
    fn a_stuck_job_is_replaced_and_the_pool_keeps_working() {
        // One thread; its first job blocks until released.
        let (done_tx, done_rx) = unbounded::<u32>();
        let (release_tx, release_rx) = bounded::<()>(0);
        let (started_tx, started_rx) = bounded::<()>(1);
        let pool = Pool::new("test-pool", size(1, 1, 1), move |n: u32| {
            if n == 0 {
                let _ = started_tx.send(());
                let _ = release_rx.recv();
            }
            let _ = done_tx.send(n);
        })
        .unwrap();
        let stuck = pool.submit(0);
        started_rx.recv().unwrap();
        assert_eq!(pool.replace(&stuck), Replacement::Spawned);
        assert_eq!(pool.live_threads(), 2);
        // The replacement runs new work while the first thread is still stuck.
        pool.submit(1);
        assert_eq!(done_rx.recv().unwrap(), 1);
        // Cap on given-up threads reached: a second replacement is refused.
        let other = pool.submit(2);
        assert_eq!(done_rx.recv().unwrap(), 2);
        assert_eq!(pool.replace(&other), Replacement::Refused);
        // The stuck job returns; its thread retires, so the pool is back to one thread.
        release_tx.send(()).unwrap();
        assert_eq!(done_rx.recv().unwrap(), 0);
        pool.submit(3);
        assert_eq!(done_rx.recv().unwrap(), 3);
        assert_eq!(pool.replaced(), 1);
    }

    #[test]
    fn replacing_a_finished_job_does_nothing() {
        let (done_tx, done_rx) = unbounded::<()>();
        let pool = Pool::new("test-pool", size(1, 1, 4), move |_: ()| {
            let _ = done_tx.send(());
        })
        .unwrap();
        let t = pool.submit(());
        done_rx.recv().unwrap();
        // The ticket flips to DONE just after the job's body; wait for that without sleeping.
        while t.0.load(SeqCst) != DONE {
            std::thread::yield_now();
        }
        assert_eq!(pool.replace(&t), Replacement::NotRunning);
        assert_eq!(pool.replaced(), 0);
    }

    #[test]
    fn a_burst_of_jobs_grows_the_pool_to_its_cap_at_once() {
        // Eight jobs that each wait until all eight run: with fewer than eight threads at
        // once this never completes (the barrier would hang the test).
        let barrier = Arc::new(std::sync::Barrier::new(8));
        let (done_tx, done_rx) = unbounded::<()>();
        let pool = Pool::new("test-pool", size(2, 8, 0), move |_: ()| {
            barrier.wait();
            let _ = done_tx.send(());
        })
        .unwrap();
        for _ in 0..8 {
            pool.submit(());
        }
        for _ in 0..8 {
            done_rx.recv_timeout(Duration::from_secs(20)).unwrap();
        }
        assert!(pool.live_threads() <= 8);
    }

    #[test]
    fn a_job_sent_as_the_thread_falls_asleep_is_not_slept_through() {
        // One thread, an hour's keepalive: each job is sent just as the thread goes back to
        // sleep after the previous one. A lost wake-up leaves a job queued with its thread
        // asleep, and the receive below fails after 20 s instead of returning at once.
        let (done_tx, done_rx) = unbounded::<u32>();
        let pool = Pool::new("test-pool", size(1, 1, 0), move |n: u32| {
            let _ = done_tx.send(n);
        })
        .unwrap();
        for n in 0..5_000 {
            pool.submit(n);
            assert_eq!(done_rx.recv_timeout(Duration::from_secs(20)), Ok(n));
        }
    }

    #[test]
    fn dropping_the_pool_ends_its_sleeping_threads_after_the_queued_jobs() {
        let (done_tx, done_rx) = unbounded::<u32>();
        let (release_tx, release_rx) = bounded::<()>(0);
        let pool = Pool::new("test-pool", size(2, 2, 0), move |n: u32| {
            if n == 0 {
                let _ = release_rx.recv();
            }
            let _ = done_tx.send(n);
        })
        .unwrap();
        let shared = Arc::clone(&pool.shared);
        pool.submit(0);
        pool.submit(1);
        assert_eq!(done_rx.recv_timeout(Duration::from_secs(20)), Ok(1));
        // Job 0 still blocks one thread; the other sleeps (an hour's keepalive). Job 2 is
        // queued when the pool goes, and still runs.
        pool.submit(2);
        drop(pool);
        release_tx.send(()).unwrap();
        let mut done: Vec<u32> = (0..2)
            .map(|_| done_rx.recv_timeout(Duration::from_secs(20)).unwrap())
            .collect();
        done.sort_unstable();
        assert_eq!(done, [0, 2]);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while shared.live.load(SeqCst) > 0 && std::time::Instant::now() < deadline {
            std::thread::yield_now();
        }
        assert_eq!(
            shared.live.load(SeqCst),
            0,
            "a sleeping thread outlived its pool"
        );
    }

    #[test]
    fn threads_beyond_the_minimum_retire_when_idle() {
        let (done_tx, done_rx) = unbounded::<()>();
        let barrier = Arc::new(std::sync::Barrier::new(4));
        let pool = Pool::new(
            "test-pool",
            PoolSize {
                keepalive: Duration::from_millis(1),
                ..size(1, 4, 0)
            },
            move |_: ()| {
                barrier.wait();
                let _ = done_tx.send(());
            },
        )
        .unwrap();
        for _ in 0..4 {
            pool.submit(());
        }
        for _ in 0..4 {
            done_rx.recv_timeout(Duration::from_secs(20)).unwrap();
        }
        // Retirement is the threads' own doing; wait for it without sleeping.
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while pool.live_threads() > 1 && std::time::Instant::now() < deadline {
            std::thread::yield_now();
        }
        assert_eq!(pool.live_threads(), 1, "extra threads did not retire");
    }
}
