//! The process's own figures for the status — memory, CPU time, descriptors — read from
//! procfs and the kernel (no disk), at most once a second by the heartbeat.

/// One reading of the process's figures.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct ProcSample {
    /// Resident set size in bytes.
    pub(super) rss_bytes: u64,
    /// User and system CPU time consumed, in seconds.
    pub(super) cpu_seconds: f64,
    /// Open file descriptors.
    pub(super) open_fds: u64,
    /// The soft limit on open file descriptors.
    pub(super) max_fds: u64,
}

impl ProcSample {
    /// Reads every figure; one that cannot be read keeps its value from `previous`.
    pub(super) fn read(previous: ProcSample) -> ProcSample {
        ProcSample {
            rss_bytes: read_rss().unwrap_or(previous.rss_bytes),
            cpu_seconds: cpu_seconds().unwrap_or(previous.cpu_seconds),
            open_fds: open_fds().unwrap_or(previous.open_fds),
            max_fds: max_fds().unwrap_or(previous.max_fds),
        }
    }
}

/// The resident set size in bytes, from `/proc/self/statm`.
fn read_rss() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * u64::try_from(page).ok()?)
}

fn cpu_seconds() -> Option<f64> {
    // SAFETY: getrusage writes only into the zeroed struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return None;
    }
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Some(secs(u.ru_utime) + secs(u.ru_stime))
}

/// Counting `/proc/self/fd` would read one entry per descriptor on the reactor (tens of
/// thousands under load); since Linux 6.2 the directory's size is the count, so that is
/// tried first and the listing is the fallback.
fn open_fds() -> Option<u64> {
    let size = std::fs::metadata("/proc/self/fd").ok()?.len();
    if size > 0 {
        return Some(size);
    }
    let entries = std::fs::read_dir("/proc/self/fd").ok()?;
    // The listing's own descriptor is one of the entries.
    Some((entries.count() as u64).saturating_sub(1))
}

fn max_fds() -> Option<u64> {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only into the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) } != 0 {
        return None;
    }
    Some(l.rlim_cur)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn the_figures_are_read_and_see_a_new_descriptor() {
        let before = ProcSample::read(ProcSample::default());
        // The same figure as the kernel's own VmRSS line, within what the process grows by
        // between the two reads.
        let status = std::fs::read_to_string("/proc/self/status").expect("status");
        let vm_rss_kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .expect("VmRSS");
        let kib = before.rss_bytes / 1024;
        assert!(
            kib * 2 > vm_rss_kib && kib < vm_rss_kib * 2,
            "{kib} KiB against VmRSS {vm_rss_kib} KiB"
        );
        assert!(before.max_fds > 0);
        assert!(before.open_fds >= 3, "{before:?}");
        // Burn a little CPU so the clock moves past its resolution.
        let mut x = 0u64;
        while cpu_seconds().unwrap_or(0.0) <= before.cpu_seconds {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(1));
        }
        let files: Vec<std::fs::File> = (0..8)
            .map(|_| std::fs::File::open("/proc/self/stat").expect("open"))
            .collect();
        assert!(files.iter().all(|f| f.as_raw_fd() >= 0));
        let after = ProcSample::read(before);
        // Other tests' threads open and close files too: at least this test's eight are seen.
        assert!(after.cpu_seconds > before.cpu_seconds);
        assert!(after.open_fds >= 8, "{after:?}");
    }
}
