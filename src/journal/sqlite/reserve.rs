//! `journal.reserve`: space set aside while the disk has room, released on a full disk so
//! that outcomes and deliveries (which free space) can still be written.

use std::fs::File;
use std::path::{Path, PathBuf};

use super::{RESERVE_BYTES, RESERVE_FILE};

/// Bytes free for an unprivileged writer on the file system holding `dir`.
fn available(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs(3) writes into the zeroed struct it is given; `c` is a valid C string.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// `journal.reserve`: [`RESERVE_BYTES`] allocated while the disk has room, released when it
/// is full.
pub(super) struct Reserve {
    pub(super) path: PathBuf,
    pub(super) held: bool,
}

impl Reserve {
    pub(super) fn new(dir: &Path) -> Reserve {
        Reserve {
            path: dir.join(RESERVE_FILE),
            held: false,
        }
    }

    /// Allocates the reserve (really: blocks, not a sparse file); false if the disk has no
    /// room for it and `headroom` bytes more. Taken back after a full disk with a headroom
    /// of its own size: otherwise the space it just gave up would be all it finds, and the
    /// journal would take a new message with nothing left to write its outcome in.
    pub(super) fn acquire(&mut self, headroom: u64) -> bool {
        if self.held {
            return true;
        }
        if headroom > 0
            && self
                .path
                .parent()
                .and_then(available)
                .is_some_and(|free| free < RESERVE_BYTES + headroom)
        {
            return false;
        }
        let allocate = || -> std::io::Result<()> {
            let f = File::options()
                .write(true)
                .create(true)
                .truncate(false)
                .open(&self.path)?;
            use std::os::fd::AsRawFd;
            // SAFETY: posix_fallocate(3) on a file descriptor this function owns.
            let rc = unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, RESERVE_BYTES as i64) };
            match rc {
                0 => Ok(()),
                libc::EOPNOTSUPP | libc::EINVAL => {
                    // No fallocate here: write the zeros (a copy-on-write file system may
                    // still share them, which is the best it offers).
                    use std::io::Write;
                    let mut w = &f;
                    w.write_all(&vec![0u8; RESERVE_BYTES as usize])?;
                    f.sync_all()
                }
                e => Err(std::io::Error::from_raw_os_error(e)),
            }
        };
        match allocate() {
            Ok(()) => {
                self.held = true;
                true
            }
            Err(e) => {
                // What it got is given back: a half reserve would only take the room.
                let _ = std::fs::remove_file(&self.path);
                log::debug!("journal reserve {}: {e}", self.path.display());
                false
            }
        }
    }

    /// Gives the reserve's space back to the file system.
    pub(super) fn release(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            log::error!(
                "cannot release the journal reserve {}: {e}",
                self.path.display()
            );
        }
        if self.held {
            log::warn!(
                "the disk under the journal is full: released its reserve ({} KiB) so that outcomes and deliveries can be written; new messages are rejected `storage` until space returns",
                RESERVE_BYTES >> 10
            );
        }
        self.held = false;
    }
}
