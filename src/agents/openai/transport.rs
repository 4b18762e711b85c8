//! A TCP transport for ureq whose waits notice the turn's cancellation.
//!
//! ureq's own TCP connector blocks in `connect` and `read` for as long as their timeouts
//! allow, and a `/stop` must land within the stop grace even when the server goes silent in
//! the middle of a stream. So this transport never blocks for longer than [`SLICE`]: the
//! connect is non-blocking and polled, every read has a short socket timeout, and between
//! slices it checks the [`CancelToken`] of the request running on the current thread (set
//! with [`watch`]). A cancelled or timed-out request returns an error, ureq drops the
//! connection instead of pooling it, and the socket is closed.
//!
//! It also enforces the read timeout, counted from the last *content* (see
//! [`content_arrived`]), not the last byte, and the overall stream deadline.
//!
//! This uses ureq's `unversioned` transport API, which does not follow semver; the
//! dependency is pinned to a minor version for that reason.

use std::cell::{Cell, RefCell};
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::rc::Rc;
use std::time::{Duration, Instant};

use ureq::Error;
use ureq::unversioned::transport::{
    Buffers, ConnectionDetails, Connector, LazyBuffers, NextTimeout, Transport,
};

use crate::agent::CancelToken;

/// The longest a connect or read blocks before the cancellation token is checked again.
pub(super) const SLICE: Duration = Duration::from_millis(50);

/// What the transport watches while a request runs on this thread.
#[derive(Clone, Debug)]
struct Watch {
    cancel: CancelToken,
    connect_timeout: Duration,
    read_timeout: Duration,
    /// When the watch started, and the overall deadline from there.
    started: Instant,
    stream_timeout: Option<Duration>,
    /// When content last arrived (or the watch or the attempt started).
    content: Rc<Cell<Instant>>,
}

impl Watch {
    /// The error of a wait that has gone on too long at `now`, if any.
    fn expired(&self, now: Instant) -> Option<Error> {
        if let Some(t) = self.stream_timeout
            && now >= self.started + t
        {
            return Some(Error::Io(io::Error::new(
                io::ErrorKind::TimedOut,
                StreamDeadline(t),
            )));
        }
        if now >= self.content.get() + self.read_timeout {
            return Some(Error::Io(io::Error::new(
                io::ErrorKind::TimedOut,
                Stall(self.read_timeout),
            )));
        }
        None
    }

    /// The earliest of the two deadlines.
    fn next_deadline(&self) -> Instant {
        let stall = self.content.get() + self.read_timeout;
        match self.stream_timeout {
            Some(t) => stall.min(self.started + t),
            None => stall,
        }
    }
}

thread_local! {
    static CURRENT: RefCell<Option<Watch>> = const { RefCell::new(None) };
}

fn current() -> Option<Watch> {
    CURRENT.with(|c| c.borrow().clone())
}

/// Restores this thread's previous watch (usually none) when dropped.
#[must_use = "the watch ends when the guard is dropped"]
pub(super) struct WatchGuard(Option<Watch>);

impl Drop for WatchGuard {
    fn drop(&mut self) {
        let previous = self.0.take();
        CURRENT.with(|c| *c.borrow_mut() = previous);
    }
}

/// Makes requests on this thread (until the guard drops) abort when `cancel` fires, fail a
/// connect after `connect_timeout`, any wait once `read_timeout` has passed without
/// [`content_arrived`] (bytes alone do not count: SSE comments and empty deltas do not
/// keep a stalled stream alive), and any wait once `stream_timeout` has passed since now.
pub(super) fn watch(
    cancel: &CancelToken,
    connect_timeout: Duration,
    read_timeout: Duration,
    stream_timeout: Option<Duration>,
) -> WatchGuard {
    let now = Instant::now();
    let previous = CURRENT.with(|c| {
        c.borrow_mut().replace(Watch {
            cancel: cancel.clone(),
            connect_timeout,
            read_timeout,
            started: now,
            stream_timeout,
            content: Rc::new(Cell::new(now)),
        })
    });
    WatchGuard(previous)
}

/// Content arrived (a non-empty delta, or a new attempt starts): the read timeout counts
/// from now.
pub(super) fn content_arrived() {
    CURRENT.with(|c| {
        if let Some(w) = c.borrow().as_ref() {
            w.content.set(Instant::now());
        }
    });
}

/// The error a cancelled wait returns; recognised by [`is_cancel_error`].
fn cancelled() -> Error {
    Error::Io(io::Error::new(io::ErrorKind::Interrupted, CANCELLED))
}

const CANCELLED: &str = "request cancelled";

/// No content arrived for the read timeout.
#[derive(Debug)]
pub(super) struct Stall(pub Duration);

impl fmt::Display for Stall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "no content for {} s (read timeout)",
            self.0.as_secs_f64()
        )
    }
}

impl std::error::Error for Stall {}

/// The request (all its attempts and its stream) took longer than the stream timeout.
#[derive(Debug)]
pub(super) struct StreamDeadline(pub Duration);

impl fmt::Display for StreamDeadline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the reply took longer than {} s (stream timeout)",
            self.0.as_secs_f64()
        )
    }
}

impl std::error::Error for StreamDeadline {}

/// Opens [`CancellableTcp`] connections (plain TCP; TLS is chained after it).
#[derive(Debug, Default)]
pub(super) struct CancellableConnector;

impl<In: Transport> Connector<In> for CancellableConnector {
    type Out = CancellableTcp;

    fn connect(
        &self,
        details: &ConnectionDetails,
        _chained: Option<In>,
    ) -> Result<Option<CancellableTcp>, Error> {
        let watch = current();
        let budget = watch
            .as_ref()
            .map_or(Duration::from_secs(30), |w| w.connect_timeout);
        if let Some(e) = watch.as_ref().and_then(|w| w.expired(Instant::now())) {
            return Err(e);
        }
        let deadline = Instant::now() + budget;
        let deadline = watch
            .as_ref()
            .map_or(deadline, |w| deadline.min(w.next_deadline()));
        let mut last: Option<io::Error> = None;
        for addr in &details.addrs {
            match connect_one(*addr, deadline, watch.as_ref()) {
                Ok(stream) => {
                    stream.set_nodelay(true)?;
                    let config = details.config;
                    let buffers =
                        LazyBuffers::new(config.input_buffer_size(), config.output_buffer_size());
                    return Ok(Some(CancellableTcp {
                        stream,
                        buffers,
                        read_timeout_set: None,
                    }));
                }
                Err(ConnectError::Cancelled) => return Err(cancelled()),
                Err(ConnectError::TimedOut) => {
                    if let Some(e) = watch.as_ref().and_then(|w| w.expired(Instant::now())) {
                        return Err(e);
                    }
                    return Err(Error::Io(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("connect timed out after {budget:?}"),
                    )));
                }
                Err(ConnectError::Io(e)) => last = Some(e),
            }
        }
        Err(Error::Io(last.unwrap_or_else(|| {
            io::Error::new(io::ErrorKind::ConnectionRefused, "connection refused")
        })))
    }
}

enum ConnectError {
    Cancelled,
    TimedOut,
    Io(io::Error),
}

/// A non-blocking connect, polled in slices so a cancel or the deadline ends it.
fn connect_one(
    addr: SocketAddr,
    deadline: Instant,
    watch: Option<&Watch>,
) -> Result<TcpStream, ConnectError> {
    let mut stream = mio::net::TcpStream::connect(addr).map_err(ConnectError::Io)?;
    let mut poll = mio::Poll::new().map_err(ConnectError::Io)?;
    poll.registry()
        .register(&mut stream, mio::Token(0), mio::Interest::WRITABLE)
        .map_err(ConnectError::Io)?;
    let mut events = mio::Events::with_capacity(2);
    loop {
        if watch.is_some_and(|w| w.cancel.is_cancelled()) {
            return Err(ConnectError::Cancelled);
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(ConnectError::TimedOut);
        }
        match poll.poll(&mut events, Some(SLICE.min(deadline - now))) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(ConnectError::Io(e)),
        }
        if events.is_empty() {
            continue;
        }
        // Writable: either connected or failed (mio's documented check).
        if let Some(e) = stream.take_error().map_err(ConnectError::Io)? {
            return Err(ConnectError::Io(e));
        }
        match stream.peer_addr() {
            Ok(_) => break,
            Err(e) if e.kind() == io::ErrorKind::NotConnected => continue,
            Err(e) => return Err(ConnectError::Io(e)),
        }
    }
    let _ = poll.registry().deregister(&mut stream);
    let stream = TcpStream::from(stream);
    stream.set_nonblocking(false).map_err(ConnectError::Io)?;
    Ok(stream)
}

/// A plain TCP connection whose reads wait at most [`SLICE`] at a time.
pub(super) struct CancellableTcp {
    stream: TcpStream,
    buffers: LazyBuffers,
    read_timeout_set: Option<Duration>,
}

impl fmt::Debug for CancellableTcp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CancellableTcp")
            .field("peer", &self.stream.peer_addr().ok())
            .finish()
    }
}

impl Drop for CancellableTcp {
    fn drop(&mut self) {
        // Closing would do; shutting down first makes sure the peer sees the end even if a
        // descriptor was duplicated somewhere.
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

fn exact(t: &NextTimeout) -> Option<Duration> {
    if t.after.is_not_happening() {
        None
    } else {
        Some(*t.after)
    }
}

impl Transport for CancellableTcp {
    fn buffers(&mut self) -> &mut dyn Buffers {
        &mut self.buffers
    }

    fn transmit_output(&mut self, amount: usize, timeout: NextTimeout) -> Result<(), Error> {
        // Requests are small: one write with the read timeout (or ureq's) as its bound.
        let bound = exact(&timeout.for_write())
            .or_else(|| current().map(|w| w.read_timeout))
            .filter(|d| !d.is_zero())
            .unwrap_or(Duration::from_secs(30));
        self.stream.set_write_timeout(Some(bound))?;
        let output = &self.buffers.output()[..amount];
        match (&self.stream).write_all(output) {
            Ok(()) => Ok(()),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                Err(Error::Io(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("sending the request timed out after {bound:?}"),
                )))
            }
            Err(e) => Err(e.into()),
        }
    }

    fn await_input(&mut self, timeout: NextTimeout) -> Result<bool, Error> {
        let started = Instant::now();
        let ureq_bound = exact(&timeout.for_read());
        loop {
            let now = Instant::now();
            // Called once per read of a stream (once a token when the server paces them):
            // the watch is looked at in place, not cloned. A cancel wins over a timeout.
            let cancelled_now =
                CURRENT.with(|c| c.borrow().as_ref().is_some_and(|w| w.cancel.is_cancelled()));
            if cancelled_now {
                return Err(cancelled());
            }
            let waited = now - started;
            if let Some(b) = ureq_bound
                && waited >= b
            {
                return Err(Error::Timeout(timeout.reason));
            }
            let watched = CURRENT.with(|c| {
                c.borrow().as_ref().map(|w| match w.expired(now) {
                    Some(e) => Err(e),
                    None => Ok(w.next_deadline().saturating_duration_since(now)),
                })
            });
            let mut slice = SLICE;
            if let Some(b) = ureq_bound {
                slice = slice.min(b.saturating_sub(waited));
            }
            if let Some(left) = watched.transpose()? {
                slice = slice.min(left);
            }
            let slice = slice.max(Duration::from_millis(1));
            if self.read_timeout_set != Some(slice) {
                self.stream.set_read_timeout(Some(slice))?;
                self.read_timeout_set = Some(slice);
            }
            let input = self.buffers.input_append_buf();
            match (&self.stream).read(input) {
                Ok(n) => {
                    self.buffers.input_appended(n);
                    return Ok(n > 0);
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock
                            | io::ErrorKind::TimedOut
                            | io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    fn is_open(&mut self) -> bool {
        // The same probe as ureq's: a pooled connection must have nothing to read.
        if self.stream.set_nonblocking(true).is_err() {
            return false;
        }
        let mut buf = [0u8; 1];
        let open = matches!((&self.stream).read(&mut buf), Err(e) if e.kind() == io::ErrorKind::WouldBlock);
        open && self.stream.set_nonblocking(false).is_ok()
    }
}

/// Whether a ureq error (or an I/O error wrapping one) came from a cancelled wait.
pub(super) fn is_cancel_error(e: &Error) -> bool {
    match e {
        Error::Io(io) => io.kind() == io::ErrorKind::Interrupted && io.to_string() == CANCELLED,
        _ => false,
    }
}
