//! `serve`'s exit codes, decided here and nowhere else: 0 a clean stop; 1 a failure worth
//! retrying (a forced stop, a shutdown whose journal could not finish, a start-up error that
//! may pass by itself: a full or failing disk, no memory or descriptors); 2 a configuration
//! error, which restarting does not fix (bad flags or values, a data directory locked by
//! another gateway, unwritable or holding a journal that cannot be trusted). The shipped
//! systemd unit restarts on 1 and not on 2 (`RestartPreventExitStatus=2`).

use std::io;

use crate::cli::USAGE_ERROR;
use crate::journal::StoreError;

/// A failure that restarting may cure.
pub(super) const RETRYABLE: i32 = 1;

/// A start-up failure, with the class that picks its exit code.
#[derive(Debug)]
pub(super) enum StartError {
    /// Fixing the configuration (or the machine) is needed: exit 2.
    Config(String),
    /// May pass by itself (the disk, memory, descriptors): exit 1.
    Transient(String),
}

impl StartError {
    /// The process exit code.
    pub(super) fn code(&self) -> i32 {
        match self {
            StartError::Config(_) => USAGE_ERROR,
            StartError::Transient(_) => RETRYABLE,
        }
    }
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StartError::Config(e) => f.write_str(e),
            StartError::Transient(e) => write!(f, "{e} (may pass: exiting 1 to be restarted)"),
        }
    }
}

impl From<String> for StartError {
    /// Settings that were refused: a configuration error.
    fn from(e: String) -> StartError {
        StartError::Config(e)
    }
}

/// Whether an OS error may pass by itself: no space or quota, an I/O error, no memory, no
/// descriptors, interrupted. Everything else (permissions, not a directory, a read-only
/// file system, no such path) needs someone to act.
pub(super) fn io_is_transient(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(
            libc::ENOSPC
                | libc::EDQUOT
                | libc::EIO
                | libc::ENOMEM
                | libc::EMFILE
                | libc::ENFILE
                | libc::EAGAIN
                | libc::EINTR
        )
    )
}

/// The class of an OS error, `message` being what to say.
pub(super) fn io_error(e: &io::Error, message: String) -> StartError {
    if io_is_transient(e) {
        StartError::Transient(message)
    } else {
        StartError::Config(message)
    }
}

/// The class of a journal error at start-up, as the journal classed it: transient (a full
/// disk, an I/O error, a busy file) exits 1; a journal that cannot be trusted or used as
/// configured (records missing, a damaged file, another schema version) exits 2 — the gateway
/// never starts over a journal it cannot trust.
pub(super) fn store_error(e: &StoreError, what: impl std::fmt::Display) -> StartError {
    let message = format!("{what}: {e}");
    if e.is_transient() {
        StartError::Transient(message)
    } else {
        StartError::Config(message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_errors_are_classed_by_what_a_restart_can_cure() {
        let class = |e: StoreError| store_error(&e, "--data-dir d").code();
        assert_eq!(class(StoreError::transient("database or disk is full")), 1);
        assert_eq!(class(StoreError::untrusted("d/journal.mark: 3 missing")), 2);
        assert_eq!(class(StoreError::unusable("schema version 9")), 2);
        assert_eq!(
            StartError::from("--queue-cap: must be at least 1".to_owned()).code(),
            2
        );
        let full = io::Error::from_raw_os_error(libc::ENOSPC);
        assert_eq!(io_error(&full, "x".into()).code(), 1);
        let ro = io::Error::from_raw_os_error(libc::EROFS);
        assert_eq!(io_error(&ro, "x".into()).code(), 2);
    }
}
