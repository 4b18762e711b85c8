//! One bridge connection: a line splitter on the read side, a bounded frame queue on the
//! write side. Sockets are non-blocking; nothing here waits.

use std::collections::VecDeque;
use std::io::{self, IoSlice, Read, Write};
use std::sync::Arc;

use mio::net::TcpStream;

/// An encoded line waiting to be written. Terminal events remember their platform, so that
/// they can move to the platform's outbox if the connection dies before writing them.
pub struct Frame {
    pub bytes: Vec<u8>,
    pub terminal_for: Option<Arc<str>>,
}

/// What a read pass produced.
pub enum ReadOutcome {
    /// The socket has no more data for now.
    Drained,
    /// The read budget ran out; data may remain.
    MoreLater,
    /// The peer closed or the socket failed.
    Closed,
}

/// One complete line, or a line that went over the limit (its content discarded).
pub enum Line {
    Complete(Vec<u8>),
    TooLong,
}

/// A client connection.
pub struct Conn {
    pub uid: u64,
    pub stream: TcpStream,
    /// The platform named by this connection's hello.
    pub platform: Option<Arc<str>>,
    pub authed: bool,
    /// Close once the output is written (after an auth failure).
    pub close_after_flush: bool,
    read_buf: Vec<u8>,
    /// Bytes of `read_buf` holding data; the rest is free space.
    filled: usize,
    /// Bytes of the data already searched for a newline.
    scanned: usize,
    discarding: bool,
    out: VecDeque<Frame>,
    out_bytes: usize,
    front_written: usize,
}

const READ_CHUNK: usize = 64 * 1024;

impl Conn {
    pub fn new(uid: u64, stream: TcpStream, authed: bool) -> Conn {
        Conn {
            uid,
            stream,
            platform: None,
            authed,
            close_after_flush: false,
            read_buf: Vec::new(),
            filled: 0,
            scanned: 0,
            discarding: false,
            out: VecDeque::new(),
            out_bytes: 0,
            front_written: 0,
        }
    }

    /// Reads up to `budget` bytes, splitting complete lines into `lines`. A line over
    /// `max_line` yields `Line::TooLong` once, and the rest of it up to its newline is dropped.
    pub fn read_lines(
        &mut self,
        budget: usize,
        max_line: usize,
        lines: &mut Vec<Line>,
    ) -> ReadOutcome {
        let mut read = 0;
        loop {
            if read >= budget {
                return ReadOutcome::MoreLater;
            }
            // The buffer is zeroed only when it grows; reads reuse its free tail.
            if self.read_buf.len() - self.filled < READ_CHUNK {
                self.read_buf.resize(self.filled + READ_CHUNK, 0);
            }
            let n = match self.stream.read(&mut self.read_buf[self.filled..]) {
                Ok(0) => return ReadOutcome::Closed,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return ReadOutcome::Drained,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return ReadOutcome::Closed,
            };
            self.filled += n;
            read += n;
            self.split(max_line, lines);
        }
    }

    fn split(&mut self, max_line: usize, lines: &mut Vec<Line>) {
        let mut begin = 0;
        while let Some(pos) = self.read_buf[self.scanned..self.filled]
            .iter()
            .position(|&b| b == b'\n')
        {
            let end = self.scanned + pos;
            if self.discarding {
                self.discarding = false;
            } else if end - begin > max_line {
                lines.push(Line::TooLong);
            } else {
                let mut line = &self.read_buf[begin..end];
                if line.last() == Some(&b'\r') {
                    line = &line[..line.len() - 1];
                }
                lines.push(Line::Complete(line.to_vec()));
            }
            begin = end + 1;
            self.scanned = begin;
        }
        self.scanned = self.filled;
        if !self.discarding && self.filled - begin > max_line {
            lines.push(Line::TooLong);
            self.discarding = true;
        }
        if self.discarding {
            begin = self.filled; // drop the partial line being discarded
        }
        self.read_buf.copy_within(begin..self.filled, 0);
        self.filled -= begin;
        self.scanned -= begin;
    }

    /// Queues a frame; returns false if the write buffer is now over `cap` bytes.
    pub fn push(&mut self, frame: Frame, cap: usize) -> bool {
        self.out_bytes += frame.bytes.len();
        self.out.push_back(frame);
        self.out_bytes <= cap
    }

    /// Bytes queued and not yet written.
    pub fn queued_bytes(&self) -> usize {
        self.out_bytes
    }

    pub fn has_output(&self) -> bool {
        !self.out.is_empty()
    }

    /// Writes as much queued output as the socket takes, in one vectored write per pass.
    pub fn write_out(&mut self) -> io::Result<()> {
        while !self.out.is_empty() {
            let n = {
                let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(self.out.len().min(64));
                for (i, f) in self.out.iter().take(64).enumerate() {
                    let skip = if i == 0 { self.front_written } else { 0 };
                    slices.push(IoSlice::new(&f.bytes[skip..]));
                }
                match self.stream.write_vectored(&slices) {
                    Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e),
                }
            };
            self.advance(n);
        }
        Ok(())
    }

    fn advance(&mut self, mut n: usize) {
        self.out_bytes -= n;
        while n > 0 {
            let Some(front) = self.out.front() else { break };
            let left = front.bytes.len() - self.front_written;
            if n >= left {
                n -= left;
                self.front_written = 0;
                self.out.pop_front();
            } else {
                self.front_written += n;
                n = 0;
            }
        }
    }

    /// Takes the terminal events not yet fully written, for the outbox.
    pub fn take_undelivered_terminals(&mut self) -> Vec<Frame> {
        self.front_written = 0;
        self.out_bytes = 0;
        self.out
            .drain(..)
            .filter(|f| f.terminal_for.is_some())
            .collect()
    }
}
