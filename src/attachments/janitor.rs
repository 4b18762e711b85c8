//! The spool's janitor: a thread of its own that deletes the files of messages whose route
//! ended and measures what the spool holds, so that neither happens on the reactor.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TrySendError};

use super::spool_used;

/// Batches of files waiting for the janitor; past it a batch is left to the start-up sweep
/// (counted, and logged at a rate).
const QUEUE: usize = 1024;
/// How often the spool is measured for the status.
const MEASURE_EVERY: Duration = Duration::from_secs(5);

/// What the janitor reports, read by the status.
#[derive(Default)]
struct Figures {
    /// Bytes the spool's regular files held at the last measure.
    used: AtomicU64,
    /// Files deleted after their message's route ended.
    released: AtomicU64,
    /// Batches left to the start-up sweep because the queue was full.
    dropped: AtomicU64,
}

/// The janitor of one spool directory. Dropping it lets the thread finish what it was given.
pub(crate) struct Janitor {
    tx: Option<Sender<Vec<String>>>,
    thread: Option<JoinHandle<()>>,
    figures: Arc<Figures>,
}

impl Janitor {
    /// Starts the janitor of `dir`.
    pub(crate) fn start(dir: PathBuf) -> std::io::Result<Janitor> {
        let (tx, rx) = crossbeam_channel::bounded(QUEUE);
        let figures = Arc::new(Figures::default());
        let theirs = Arc::clone(&figures);
        let thread = std::thread::Builder::new()
            .name("turnstile-spool".into())
            .spawn(move || run(&dir, &rx, &theirs))?;
        Ok(Janitor {
            tx: Some(tx),
            thread: Some(thread),
            figures,
        })
    }

    /// Hands the janitor files to delete (paths admission checked to be in the spool).
    /// Never blocks: with its queue full the files stay until the next start-up's sweep.
    pub(crate) fn release(&self, paths: Vec<String>) {
        let Some(tx) = &self.tx else { return };
        if let Err(TrySendError::Full(paths) | TrySendError::Disconnected(paths)) =
            tx.try_send(paths)
        {
            let n = self.figures.dropped.fetch_add(1, Ordering::Relaxed);
            if rarely(n) {
                log::warn!(
                    "attachments: the spool's janitor is behind; {} file(s) left for the start-up sweep ({} batch(es) so far)",
                    paths.len(),
                    n + 1
                );
            }
        }
    }

    /// (bytes in the spool at the last measure, files released, batches left behind).
    pub(crate) fn figures(&self) -> (u64, u64, u64) {
        let f = &self.figures;
        (
            f.used.load(Ordering::Relaxed),
            f.released.load(Ordering::Relaxed),
            f.dropped.load(Ordering::Relaxed),
        )
    }
}

impl Drop for Janitor {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(dir: &std::path::Path, rx: &Receiver<Vec<String>>, figures: &Figures) {
    let measure = || match spool_used(dir) {
        Ok(n) => figures.used.store(n, Ordering::Relaxed),
        Err(e) => log::warn!("attachments: cannot measure {}: {e}", dir.display()),
    };
    measure();
    let mut failed = 0u64;
    loop {
        match rx.recv_timeout(MEASURE_EVERY) {
            Ok(paths) => {
                for path in paths {
                    match std::fs::remove_file(&path) {
                        Ok(()) => {
                            figures.released.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                        Err(e) => {
                            if rarely(failed) {
                                log::warn!(
                                    "attachment {path}: not removed: {e} ({} so far)",
                                    failed + 1
                                );
                            }
                            failed += 1;
                        }
                    }
                }
                measure();
            }
            Err(RecvTimeoutError::Timeout) => measure(),
            Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// Whether the `n`th (from 0) occurrence of a repeated warning is logged: the first, then
/// one in a thousand (a peer that floods the spool cannot flood the log).
fn rarely(n: u64) -> bool {
    n.is_multiple_of(1000)
}
