//! A FIFO that a process spawned by an agent writes to: the test learns when that process
//! started (it opened the write end) and when it died (every writer gone), without polling.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use crossbeam_channel::{Receiver, bounded};

/// The FIFO at `path` and its reader's two events.
pub struct FifoWatch {
    pub path: PathBuf,
    /// Fires once a writer opened the FIFO.
    pub opened: Receiver<()>,
    /// Fires once every writer closed it.
    pub eof: Receiver<()>,
}

/// Makes the FIFO `name` in `dir` (created if missing) and reads it on a thread of its own.
pub fn fifo_watch(dir: &Path, name: &str) -> FifoWatch {
    std::fs::create_dir_all(dir).expect("dir");
    let path = dir.join(name);
    let _ = std::fs::remove_file(&path);
    assert!(
        Command::new("mkfifo")
            .arg(&path)
            .status()
            .expect("mkfifo")
            .success()
    );
    let (opened_tx, opened) = bounded(1);
    let (eof_tx, eof) = bounded(1);
    let reader_path = path.clone();
    std::thread::spawn(move || {
        let mut f = std::fs::File::open(&reader_path).expect("open fifo");
        let _ = opened_tx.send(());
        let mut sink = Vec::new();
        let _ = f.read_to_end(&mut sink);
        let _ = eof_tx.send(());
    });
    FifoWatch { path, opened, eof }
}
