//! The data directory's lock: `turnstile.lock`, held with `flock(2)` for the process's
//! lifetime and holding the holder's pid, so that a second gateway on the same `--data-dir`
//! is refused before it binds anything, naming the process that has it. The kernel drops a
//! `flock` when its holder dies (even by SIGKILL): a file left behind by a dead process is
//! stale and simply taken over.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The lock file's name inside the data directory.
pub(super) const LOCK_FILE: &str = "turnstile.lock";

/// A held lock; dropping it (closing the file) releases it.
#[derive(Debug)]
pub(super) struct DirLock {
    /// Kept open: the `flock` lives as long as this descriptor.
    _file: File,
}

/// Why the lock was not taken.
#[derive(Debug)]
pub(super) enum LockError {
    /// Another process holds it; `pid` as that process wrote it (absent if unreadable).
    Held { path: PathBuf, pid: Option<u32> },
    /// The directory or the file could not be created, opened or written.
    Io { path: PathBuf, error: io::Error },
}

impl std::fmt::Display for LockError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LockError::Held {
                path,
                pid: Some(pid),
            } => write!(
                f,
                "{} is held by pid {pid}: another gateway is using this data directory",
                path.display()
            ),
            LockError::Held { path, pid: None } => write!(
                f,
                "{} is held by another process: another gateway is using this data directory",
                path.display()
            ),
            LockError::Io { path, error } => write!(f, "cannot lock {}: {error}", path.display()),
        }
    }
}

impl LockError {
    /// The OS error behind it, if any (what the exit-code classification looks at).
    pub(super) fn io_error(&self) -> Option<&io::Error> {
        match self {
            LockError::Held { .. } => None,
            LockError::Io { error, .. } => Some(error),
        }
    }
}

/// Takes the lock of `dir` (creating the directory if needed) and writes this process's pid
/// into it.
pub(super) fn lock(dir: &Path) -> Result<DirLock, LockError> {
    let path = dir.join(LOCK_FILE);
    let io_err = |error| LockError::Io {
        path: path.clone(),
        error,
    };
    std::fs::create_dir_all(dir).map_err(|error| LockError::Io {
        path: dir.to_owned(),
        error,
    })?;
    // Not truncated on open: the holder's pid must stay readable until the lock is ours.
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .map_err(io_err)?;
    // SAFETY: flock(2) on a descriptor this function owns.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let error = io::Error::last_os_error();
        if error.raw_os_error() == Some(libc::EWOULDBLOCK) {
            let mut text = String::new();
            let pid = file
                .read_to_string(&mut text)
                .ok()
                .and_then(|_| text.trim().parse().ok());
            return Err(LockError::Held { path, pid });
        }
        return Err(io_err(error));
    }
    file.set_len(0).map_err(io_err)?;
    file.rewind().map_err(io_err)?;
    writeln!(file, "{}", std::process::id()).map_err(io_err)?;
    Ok(DirLock { _file: file })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A second lock on the same directory is refused naming the holder's pid, even from the
    /// same process (each `open` is its own file description); once released it is free, and
    /// a file left behind with no holder is taken over.
    #[test]
    fn a_held_lock_names_its_holder_and_a_stale_one_is_taken() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = dir.path().join("data");
        let held = lock(&data).expect("first lock");
        match lock(&data) {
            Err(LockError::Held { pid, .. }) => assert_eq!(pid, Some(std::process::id())),
            other => panic!("expected Held, got {other:?}"),
        }
        drop(held);
        std::fs::write(data.join(LOCK_FILE), "999999999\n").expect("stale file");
        let again = lock(&data).expect("a stale file is taken");
        let text = std::fs::read_to_string(data.join(LOCK_FILE)).expect("read");
        assert_eq!(text.trim(), std::process::id().to_string());
        drop(again);
    }
}
