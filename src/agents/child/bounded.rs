//! Bounded reads of an agent's pipes: its output kept up to a cap, its stdout split into lines
//! of bounded length, its stderr logged in bounded lines at a bounded rate. However much an
//! agent writes, the gateway's memory and log stay within these bounds.

use std::fs::File;
use std::io::{self, Read};
use std::thread;

use crate::logfmt::{LogBudget, relay_lines};
use crate::message::SessionKey;

/// Bytes read from one pipe per call, so one flooding pipe cannot starve the rest of a poll
/// loop (or the cancel check).
pub(crate) const READ_BUDGET: usize = 1 << 20;
/// Longest stderr line logged; the rest of the line is dropped.
const STDERR_LINE_MAX: usize = 512;
/// stderr lines logged at once per agent stream, then this many per second.
const STDERR_BURST: f64 = 50.0;
const STDERR_PER_SEC: f64 = 10.0;

/// What one non-blocking read pass found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReadState {
    /// The pipe is empty for now.
    WouldBlock,
    /// Stopped before the pipe was empty (the budget was used, or a line is complete):
    /// read again without waiting.
    More,
    /// Every writer closed the pipe.
    Eof,
}

fn read_some(r: &mut File, budget: usize, mut sink: impl FnMut(&[u8])) -> io::Result<ReadState> {
    let mut chunk = [0u8; 64 * 1024];
    let mut done = 0;
    while done < budget {
        match r.read(&mut chunk) {
            Ok(0) => return Ok(ReadState::Eof),
            Ok(n) => {
                done += n;
                sink(&chunk[..n]);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(ReadState::WouldBlock),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(ReadState::More)
}

/// Grows `v` to hold `extra` more bytes without its capacity ever passing `cap` (plain
/// `extend` may double it past the bound).
fn reserve_within(v: &mut Vec<u8>, extra: usize, cap: usize) {
    let want = v.len() + extra;
    if want > v.capacity() {
        let target = want.max(v.len().saturating_mul(2)).min(cap.max(want));
        v.reserve_exact(target - v.len());
    }
}

/// An agent's output, kept up to a cap; the rest is read (so the writer never blocks) and
/// discarded, and counted.
#[derive(Debug)]
pub(crate) struct OutputBuf {
    data: Vec<u8>,
    cap: usize,
    total: u64,
}

impl OutputBuf {
    /// Keeps at most `cap` bytes.
    pub(crate) fn new(cap: usize) -> OutputBuf {
        OutputBuf {
            data: Vec::new(),
            cap,
            total: 0,
        }
    }

    /// Reads what `r` (non-blocking) has now, at most `budget` bytes.
    pub(crate) fn read_from(&mut self, r: &mut File, budget: usize) -> io::Result<ReadState> {
        let (data, cap, total) = (&mut self.data, self.cap, &mut self.total);
        read_some(r, budget, |bytes| {
            *total += bytes.len() as u64;
            let take = cap.saturating_sub(data.len()).min(bytes.len());
            reserve_within(data, take, cap);
            data.extend_from_slice(&bytes[..take]);
        })
    }

    /// The bytes kept.
    #[cfg(test)]
    pub(crate) fn kept(&self) -> &[u8] {
        &self.data
    }

    /// Bytes read in all, kept or not.
    #[cfg(test)]
    pub(crate) fn total(&self) -> u64 {
        self.total
    }

    /// Bytes of memory the buffer holds (its capacity): never more than the cap.
    #[cfg(test)]
    pub(crate) fn buffered(&self) -> usize {
        self.data.capacity()
    }

    /// Whether output was discarded.
    pub(crate) fn truncated(&self) -> bool {
        self.total > self.data.len() as u64
    }

    /// The kept bytes.
    pub(crate) fn into_vec(self) -> Vec<u8> {
        self.data
    }
}

/// Splits an agent's stdout into lines of at most `max` bytes; a longer line is an error,
/// reported once it passes the bound, never buffered past it.
#[derive(Debug)]
pub(crate) struct LineBuf {
    buf: Vec<u8>,
    start: usize,
    /// Where to look for the next newline (everything before it was searched).
    scan: usize,
    max: usize,
}

/// A line longer than the limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LineTooLong {
    /// The limit in bytes.
    pub max: usize,
}

impl LineBuf {
    /// Lines of at most `max` bytes (without the newline).
    pub(crate) fn new(max: usize) -> LineBuf {
        LineBuf {
            buf: Vec::new(),
            start: 0,
            scan: 0,
            max,
        }
    }

    /// Bytes read and not yet taken as lines.
    pub(super) fn pending(&self) -> usize {
        self.buf.len() - self.start
    }

    /// Reads what `r` (non-blocking) has now, at most `budget` bytes. Returns early (with
    /// [`ReadState::More`]) as soon as a line is complete, and stops reading once the
    /// unfinished line is past the limit, so the buffer stays within `max` plus one chunk.
    pub(crate) fn read_from(&mut self, r: &mut File, budget: usize) -> io::Result<ReadState> {
        if self.start > 0 && self.start * 2 >= self.buf.len() {
            self.buf.drain(..self.start);
            self.scan -= self.start;
            self.start = 0;
        }
        const CHUNK: usize = 64 * 1024;
        let mut done = 0;
        while done < budget && self.pending() <= self.max {
            reserve_within(&mut self.buf, CHUNK, self.max.saturating_add(2 * CHUNK));
            let len = self.buf.len();
            self.buf.resize(len + CHUNK, 0);
            let got = r.read(&mut self.buf[len..]);
            self.buf.truncate(len + *got.as_ref().unwrap_or(&0));
            match got {
                Ok(0) => return Ok(ReadState::Eof),
                Ok(n) => {
                    done += n;
                    if self.buf[len..].contains(&b'\n') {
                        return Ok(ReadState::More);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    return Ok(ReadState::WouldBlock);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(ReadState::More)
    }

    /// The next complete line (without its newline), if one is buffered.
    pub(crate) fn next_line(&mut self) -> Option<Result<Vec<u8>, LineTooLong>> {
        match self.buf[self.scan..].iter().position(|&b| b == b'\n') {
            Some(i) => {
                let end = self.scan + i;
                self.scan = end + 1;
                let line = &self.buf[self.start..end];
                if line.len() > self.max {
                    self.start = self.scan;
                    return Some(Err(LineTooLong { max: self.max }));
                }
                let line = line.to_vec();
                self.start = self.scan;
                Some(Ok(line))
            }
            None => {
                self.scan = self.buf.len();
                if self.pending() > self.max {
                    Some(Err(LineTooLong { max: self.max }))
                } else {
                    None
                }
            }
        }
    }

    /// Bytes of memory the buffer holds.
    #[cfg(test)]
    pub(crate) fn buffered(&self) -> usize {
        self.buf.capacity()
    }
}

/// Logs an agent's stderr at INFO with its session key, on a thread of its own until end of
/// file: lines cut to 512 bytes, at most 50 at once then 10 a second (what is dropped is
/// counted in the log). stderr never reaches the chat.
pub(crate) fn log_stderr(stderr: File, session: SessionKey) {
    let key = session.clone();
    let spawned = thread::Builder::new()
        .name("turnstile-agent-stderr".into())
        .spawn(move || log_lines(stderr, &session));
    if let Err(e) = spawned {
        log::error!(
            "session {key}: cannot start an agent stderr reader thread: {e}; its stderr is discarded"
        );
    }
}

/// One agent's stderr into the log at INFO, its lines cut at [`STDERR_LINE_MAX`], at most
/// what the budget allows.
fn log_lines(stderr: File, session: &SessionKey) {
    let budget = LogBudget::new(STDERR_BURST, STDERR_PER_SEC);
    let dropped = relay_lines(stderr, STDERR_LINE_MAX, budget, |line, cut, dropped| {
        if dropped > 0 {
            log::info!("session {session}: {dropped} agent stderr line(s) not logged (rate limit)");
        }
        let text = String::from_utf8_lossy(line);
        let more = if cut { " …" } else { "" };
        log::info!("session {session}: agent stderr: {text}{more}");
    });
    if dropped > 0 {
        log::info!(
            "session {session}: {dropped} more agent stderr line(s) not logged (rate limit)"
        );
    }
}
