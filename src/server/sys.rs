//! What the bridge server asks of the operating system: the open-file limit, a spare
//! descriptor for refusing at EMFILE, unacknowledged bytes (`SIOCOUTQ`), reset on close.

use std::io;

use mio::net::TcpStream;

/// Raises the soft limit on open files to the hard limit; returns (old, new) soft limits.
#[cfg_attr(not(feature = "cli"), allow(dead_code))]
pub(crate) fn raise_fd_limit() -> io::Result<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let old = lim.rlim_cur;
    if lim.rlim_cur < lim.rlim_max {
        lim.rlim_cur = lim.rlim_max;
        // SAFETY: as above.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok((old, lim.rlim_cur))
}

/// A descriptor held in reserve for accepting (and refusing) at the descriptor limit.
pub(super) fn open_spare() -> Option<std::fs::File> {
    std::fs::File::open("/dev/null").ok()
}

/// Bytes written to `stream` that the peer's TCP has not acknowledged yet (`SIOCOUTQ`).
pub(super) fn unacknowledged(stream: &TcpStream) -> Option<u64> {
    use std::os::fd::AsRawFd;
    let mut n: libc::c_int = 0;
    // SAFETY: TIOCOUTQ (SIOCOUTQ on a TCP socket) stores one int through the pointer.
    let rc = unsafe { libc::ioctl(stream.as_raw_fd(), libc::TIOCOUTQ, &mut n) };
    (rc == 0).then(|| u64::try_from(n).unwrap_or(0))
}

/// Makes the coming close send a reset and discard unsent data (`SO_LINGER` 0).
pub(super) fn reset_on_close(stream: &TcpStream) {
    use std::os::fd::AsRawFd;
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt with a pointer to a local linger struct and its size.
    unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

/// The process or the system is out of descriptors.
pub(super) fn out_of_fds(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}
