//! systemd's notification protocol (`sd_notify(3)`): datagrams to `$NOTIFY_SOCKET`, sent
//! without blocking from the reactor thread.
//!
//! `READY=1` once listening, `STATUS=` a one-line summary, `WATCHDOG=1` from the heartbeat
//! tick at half of `$WATCHDOG_USEC` while the loop is healthy, `STOPPING=1` on shutdown. A
//! wedged loop sends nothing, so systemd's watchdog restarts the service.

use std::io;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::Duration;

/// A connection to the service manager's notification socket.
pub(crate) struct SdNotify {
    sock: UnixDatagram,
    addr: SocketAddr,
    watchdog: Option<Duration>,
    failed: bool,
}

impl std::fmt::Debug for SdNotify {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SdNotify({:?}, watchdog {:?})", self.addr, self.watchdog)
    }
}

/// The address `$NOTIFY_SOCKET` names: a path, or `@name` for the abstract namespace.
fn address(spec: &str) -> io::Result<SocketAddr> {
    if let Some(name) = spec.strip_prefix('@') {
        use std::os::linux::net::SocketAddrExt;
        SocketAddr::from_abstract_name(name.as_bytes())
    } else if spec.starts_with('/') {
        SocketAddr::from_pathname(spec)
    } else {
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("NOTIFY_SOCKET {spec:?} is neither a path nor an abstract name"),
        ))
    }
}

/// The watchdog ping period from `$WATCHDOG_USEC` (half of it) when `$WATCHDOG_PID` is unset
/// or names `pid`.
pub(crate) fn watchdog_period(
    usec: Option<&str>,
    wd_pid: Option<&str>,
    pid: u32,
) -> Option<Duration> {
    if wd_pid.is_some_and(|p| p.trim().parse::<u32>().ok() != Some(pid)) {
        return None;
    }
    let us: u64 = usec?.trim().parse().ok().filter(|&us| us > 0)?;
    Some(Duration::from_micros(us) / 2)
}

impl SdNotify {
    /// From the environment: `None` when `$NOTIFY_SOCKET` is unset (not run by systemd).
    pub(crate) fn from_env() -> io::Result<Option<SdNotify>> {
        let Some(spec) = std::env::var_os("NOTIFY_SOCKET") else {
            return Ok(None);
        };
        let spec = spec.to_string_lossy().into_owned();
        let watchdog = watchdog_period(
            std::env::var("WATCHDOG_USEC").ok().as_deref(),
            std::env::var("WATCHDOG_PID").ok().as_deref(),
            std::process::id(),
        );
        SdNotify::new(&spec, watchdog).map(Some)
    }

    /// To the socket `spec` names, pinging the watchdog every `watchdog`.
    pub(crate) fn new(spec: &str, watchdog: Option<Duration>) -> io::Result<SdNotify> {
        let addr = address(spec)?;
        let sock = UnixDatagram::unbound()?;
        sock.set_nonblocking(true)?;
        Ok(SdNotify {
            sock,
            addr,
            watchdog,
            failed: false,
        })
    }

    /// How often to send `WATCHDOG=1`, if systemd asked for it.
    pub(crate) fn watchdog(&self) -> Option<Duration> {
        self.watchdog
    }

    /// Sends one notification (`KEY=VALUE` lines). Never blocks: a full socket drops it.
    /// The first failure is logged; later ones until a success are not.
    pub(crate) fn send(&mut self, state: &str) {
        match self.sock.send_to_addr(state.as_bytes(), &self.addr) {
            Ok(_) => self.failed = false,
            Err(e) if !self.failed => {
                log::warn!("sd_notify: cannot send to {:?}: {e}", self.addr);
                self.failed = true;
            }
            Err(_) => {}
        }
    }
}

/// Decides the watchdog pings: one per period, only from a tick whose lag is healthy.
#[derive(Clone, Debug)]
pub(crate) struct WatchdogPacer {
    period: Duration,
    next: Duration,
}

impl WatchdogPacer {
    /// Pings every `period`, the first at the first healthy tick.
    pub(crate) fn new(period: Duration) -> WatchdogPacer {
        WatchdogPacer {
            period,
            next: Duration::ZERO,
        }
    }

    /// At a tick at `now`: whether to send `WATCHDOG=1`. An unhealthy tick sends nothing
    /// and leaves the ping due, so the next healthy tick sends it.
    pub(crate) fn on_tick(&mut self, now: Duration, healthy: bool) -> bool {
        if !healthy || now < self.next {
            return false;
        }
        self.next = now + self.period;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watchdog_period_is_half_of_usec_for_this_pid() {
        assert_eq!(
            watchdog_period(Some("2000000"), None, 7),
            Some(Duration::from_secs(1))
        );
        assert_eq!(
            watchdog_period(Some("2000000"), Some("7"), 7),
            Some(Duration::from_secs(1))
        );
        assert_eq!(watchdog_period(Some("2000000"), Some("8"), 7), None);
        assert_eq!(watchdog_period(Some("0"), None, 7), None);
        assert_eq!(watchdog_period(Some("x"), None, 7), None);
        assert_eq!(watchdog_period(None, None, 7), None);
    }

    #[test]
    fn pacer_pings_once_per_period_and_only_when_healthy() {
        let mut p = WatchdogPacer::new(Duration::from_secs(1));
        let ms = Duration::from_millis;
        assert!(p.on_tick(ms(100), true));
        assert!(!p.on_tick(ms(200), true));
        assert!(!p.on_tick(ms(1099), true));
        assert!(!p.on_tick(ms(1100), false));
        assert!(p.on_tick(ms(1200), true));
        assert!(!p.on_tick(ms(2199), true));
        assert!(p.on_tick(ms(2200), true));
    }

    #[test]
    fn notifications_reach_a_path_socket() {
        let dir = std::env::temp_dir().join(format!("turnstile-notify-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("notify.sock");
        let _ = std::fs::remove_file(&path);
        let rx = UnixDatagram::bind(&path).unwrap();
        let mut n = SdNotify::new(path.to_str().unwrap(), None).unwrap();
        n.send("READY=1\nSTATUS=up");
        let mut buf = [0u8; 64];
        let len = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..len], b"READY=1\nSTATUS=up");
        assert_eq!(n.watchdog(), None);
        let w = SdNotify::new(path.to_str().unwrap(), Some(Duration::from_secs(3))).unwrap();
        assert_eq!(w.watchdog(), Some(Duration::from_secs(3)));
        assert!(format!("{w:?}").contains("notify.sock"));
        // A socket gone: the send fails without blocking or panicking, twice.
        drop(rx);
        let _ = std::fs::remove_file(&path);
        n.send("WATCHDOG=1");
        n.send("WATCHDOG=1");
        assert!(n.failed);
        assert!(SdNotify::new("relative", None).is_err());
        assert!(SdNotify::new("@turnstile-test-abstract", None).is_ok());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
