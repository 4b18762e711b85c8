//! Waiting for the gateway's next status snapshot without sleeping: an inotify watch on the
//! directory of its `--status-file`, which the gateway rewrites (write, then rename) each
//! time it takes a snapshot. A test checks the status, and if it does not show what the
//! test waits for yet, blocks until the next snapshot is written.
#![allow(dead_code)]

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::{Duration, Instant};

/// An inotify watch on one directory.
pub struct SnapshotWatch {
    fd: OwnedFd,
}

impl SnapshotWatch {
    /// Watches `dir` for files written or renamed into it. Made before the gateway starts,
    /// so its first snapshot is not missed.
    pub fn new(dir: &Path) -> SnapshotWatch {
        // SAFETY: inotify_init1 takes flags only; a valid fd or -1 comes back.
        let raw = unsafe { libc::inotify_init1(libc::IN_CLOEXEC | libc::IN_NONBLOCK) };
        assert!(
            raw >= 0,
            "inotify_init1: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: a fresh descriptor that is ours.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).expect("a path");
        // SAFETY: a valid inotify fd and a NUL-terminated path.
        let wd = unsafe {
            libc::inotify_add_watch(
                fd.as_raw_fd(),
                path.as_ptr(),
                libc::IN_CLOSE_WRITE | libc::IN_MOVED_TO,
            )
        };
        assert!(
            wd >= 0,
            "inotify_add_watch {}: {}",
            dir.display(),
            std::io::Error::last_os_error()
        );
        SnapshotWatch { fd }
    }

    /// Blocks until a file in the directory is written, or until `deadline`; false then.
    pub fn next_before(&self, deadline: Instant) -> bool {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut pfd = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = libc::c_int::try_from(left.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n <= 0 {
            return false;
        }
        // Drain what is queued: any write is a new snapshot.
        let mut buf = [0u8; 4096];
        // SAFETY: reading into a local buffer of its length.
        while unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) } > 0 {}
        true
    }

    /// [`SnapshotWatch::next_before`] with a timeout.
    pub fn next_within(&self, timeout: Duration) -> bool {
        self.next_before(Instant::now() + timeout)
    }
}
