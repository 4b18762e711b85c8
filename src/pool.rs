//! A fixed-size worker pool that can replace a stuck thread without waiting for it.
//!
//! Jobs go through a crossbeam channel to `size` threads. When the reactor gives up on a
//! running job (turn abandoned, cleanup past its deadline) it calls [`Pool::replace`]: a new
//! thread is spawned at once, and the stuck one exits instead of taking more work if its job
//! ever returns, so the pool converges back to its size. Extra threads are capped.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::thread;

use crossbeam_channel::{Receiver, Sender, unbounded};

const QUEUED: u8 = 0;
const RUNNING: u8 = 1;
const DONE: u8 = 2;
const REPLACED: u8 = 3;

/// Tracks one submitted job, so the reactor can replace the thread it is stuck on.
#[derive(Clone, Debug)]
pub struct JobTicket(Arc<AtomicU8>);

/// What [`Pool::replace`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replacement {
    /// A new thread was started; the stuck one will exit when its job returns.
    Spawned,
    /// The job was not running (still queued or already done): nothing to replace.
    NotRunning,
    /// The cap on extra threads was reached, or the OS refused a thread.
    Refused,
}

struct Shared<J> {
    name: &'static str,
    rx: Receiver<(J, JobTicket)>,
    run: Box<dyn Fn(J) + Send + Sync>,
    live: AtomicUsize,
    replaced: AtomicU64,
}

/// A pool of threads running jobs of type `J`.
pub struct Pool<J: Send + 'static> {
    tx: Sender<(J, JobTicket)>,
    shared: Arc<Shared<J>>,
    size: usize,
    max_extra: usize,
}

impl<J: Send + 'static> Pool<J> {
    /// Starts `size` threads named `name` that run each job with `run`. At most `max_extra`
    /// replacement threads may be alive beyond `size`.
    pub fn new(
        name: &'static str,
        size: usize,
        max_extra: usize,
        run: impl Fn(J) + Send + Sync + 'static,
    ) -> std::io::Result<Pool<J>> {
        let (tx, rx) = unbounded();
        let shared = Arc::new(Shared {
            name,
            rx,
            run: Box::new(run),
            live: AtomicUsize::new(0),
            replaced: AtomicU64::new(0),
        });
        for _ in 0..size {
            spawn_worker(&shared, false)?;
        }
        Ok(Pool {
            tx,
            shared,
            size,
            max_extra,
        })
    }

    /// Queues a job. Never blocks.
    pub fn submit(&self, job: J) -> JobTicket {
        let ticket = JobTicket(Arc::new(AtomicU8::new(QUEUED)));
        // The receiver lives in `shared`, which we hold, so the channel cannot be closed.
        let _ = self.tx.send((job, ticket.clone()));
        ticket
    }

    /// Gives up on the thread running `ticket`'s job and starts another in its place.
    pub fn replace(&self, ticket: &JobTicket) -> Replacement {
        let live = self.shared.live.load(Ordering::SeqCst);
        if live >= self.size + self.max_extra {
            return Replacement::Refused;
        }
        if ticket
            .0
            .compare_exchange(RUNNING, REPLACED, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            return Replacement::NotRunning;
        }
        match spawn_worker(&self.shared, false) {
            Ok(()) => {
                self.shared.replaced.fetch_add(1, Ordering::Relaxed);
                Replacement::Spawned
            }
            Err(_) => Replacement::Refused,
        }
    }

    /// Starts up to `n` extra threads, within the cap, that take queued jobs and exit once
    /// the queue is empty. Shutdown uses it to close every agent at once rather than a few at
    /// a time. Returns how many started.
    pub fn burst(&self, n: usize) -> usize {
        let mut started = 0;
        while started < n && self.shared.live.load(Ordering::SeqCst) < self.size + self.max_extra {
            if spawn_worker(&self.shared, true).is_err() {
                break;
            }
            started += 1;
        }
        started
    }

    /// Threads alive now, stuck ones included.
    pub fn live_threads(&self) -> usize {
        self.shared.live.load(Ordering::Relaxed)
    }

    /// Replacement threads started so far.
    pub fn replaced(&self) -> u64 {
        self.shared.replaced.load(Ordering::Relaxed)
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

/// Starts a pool thread; with `until_idle` it exits as soon as the queue is empty.
fn spawn_worker<J: Send + 'static>(
    shared: &Arc<Shared<J>>,
    until_idle: bool,
) -> std::io::Result<()> {
    let worker = Arc::clone(shared);
    worker.live.fetch_add(1, Ordering::SeqCst);
    let spawned = thread::Builder::new()
        .name(shared.name.to_owned())
        .spawn(move || {
            lower_priority();
            loop {
                let next = if until_idle {
                    worker.rx.try_recv().ok()
                } else {
                    worker.rx.recv().ok()
                };
                let Some((job, ticket)) = next else { break };
                ticket.0.store(RUNNING, Ordering::SeqCst);
                if catch_unwind(AssertUnwindSafe(|| (worker.run)(job))).is_err() {
                    log::error!("{}: a job panicked outside its own guard", worker.name);
                }
                let finished =
                    ticket
                        .0
                        .compare_exchange(RUNNING, DONE, Ordering::SeqCst, Ordering::SeqCst);
                if finished.is_err() {
                    break; // replaced while stuck: the replacement keeps the pool at its size
                }
            }
            worker.live.fetch_sub(1, Ordering::SeqCst);
        });
    if let Err(e) = spawned {
        shared.live.fetch_sub(1, Ordering::SeqCst);
        return Err(e);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crossbeam_channel::bounded;

    #[test]
    fn a_stuck_job_is_replaced_and_the_pool_keeps_working() {
        // One thread; its first job blocks until released.
        let (done_tx, done_rx) = unbounded::<u32>();
        let (release_tx, release_rx) = bounded::<()>(0);
        let (started_tx, started_rx) = bounded::<()>(1);
        let pool = Pool::new("test-pool", 1, 1, move |n: u32| {
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
        // Cap reached: a second replacement is refused.
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
        let pool = Pool::new("test-pool", 1, 4, move |_: ()| {
            let _ = done_tx.send(());
        })
        .unwrap();
        let t = pool.submit(());
        done_rx.recv().unwrap();
        // The ticket flips to DONE just after the job's body; wait for that without sleeping.
        while t.0.load(Ordering::SeqCst) != DONE {
            std::thread::yield_now();
        }
        assert_eq!(pool.replace(&t), Replacement::NotRunning);
        assert_eq!(pool.replaced(), 0);
    }
}
