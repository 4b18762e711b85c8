//! The read side of a connection: splits a byte stream into bounded lines. Nothing here
//! waits: the reader is handed whatever `Read` the shell has (a non-blocking socket).

use std::io::{self, Read};

/// What a read pass produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ReadOutcome {
    /// The source has no more data for now.
    Drained,
    /// The read budget ran out; data may remain.
    MoreLater,
    /// The peer closed its side (end of stream).
    Eof,
    /// The read failed.
    Failed,
}

/// One complete line, or a line that went over the limit (its content discarded).
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Line {
    /// A line without its newline (and without a `\r` before it).
    Complete(Vec<u8>),
    /// A line over the limit.
    TooLong,
}

/// Splits lines out of a stream, at most `max_line` bytes each (a `\r` before the newline is
/// not counted).
#[derive(Default)]
pub(super) struct LineReader {
    buf: Vec<u8>,
    /// Bytes of `buf` holding data; the rest is free space.
    filled: usize,
    /// Bytes of the data already searched for a newline.
    scanned: usize,
    /// Inside a line already reported too long: drop bytes up to its newline.
    discarding: bool,
}

const READ_CHUNK: usize = 16 * 1024;

impl LineReader {
    /// Reads up to about `budget` bytes from `src`, pushing complete lines onto `lines`. A line
    /// over `max_line` yields `Line::TooLong` once, and the rest of it up to its newline is
    /// dropped.
    pub(super) fn read_lines<R: Read + ?Sized>(
        &mut self,
        src: &mut R,
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
            if self.buf.len() - self.filled < READ_CHUNK {
                self.buf.resize(self.filled + READ_CHUNK, 0);
            }
            // Never read past the budget: the lines read are handed on in this same pass.
            let end = self.buf.len().min(self.filled + (budget - read).max(1));
            let n = match src.read(&mut self.buf[self.filled..end]) {
                Ok(0) => return ReadOutcome::Eof,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return ReadOutcome::Drained,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return ReadOutcome::Failed,
            };
            self.filled += n;
            read += n;
            self.split(max_line, lines);
        }
    }

    fn split(&mut self, max_line: usize, lines: &mut Vec<Line>) {
        let mut begin = 0;
        while let Some(pos) = self.buf[self.scanned..self.filled]
            .iter()
            .position(|&b| b == b'\n')
        {
            let end = self.scanned + pos;
            let mut line = &self.buf[begin..end];
            if line.last() == Some(&b'\r') {
                line = &line[..line.len() - 1];
            }
            if self.discarding {
                self.discarding = false;
            } else if line.len() > max_line {
                lines.push(Line::TooLong);
            } else {
                lines.push(Line::Complete(line.to_vec()));
            }
            begin = end + 1;
            self.scanned = begin;
        }
        self.scanned = self.filled;
        // A partial line may still end in "\r\n": only past max_line + 1 is it surely too long.
        if !self.discarding && self.filled - begin > max_line + 1 {
            lines.push(Line::TooLong);
            self.discarding = true;
        }
        if self.discarding {
            begin = self.filled; // drop the partial line being discarded
        }
        self.buf.copy_within(begin..self.filled, 0);
        self.filled -= begin;
        self.scanned -= begin;
        // A burst can grow the buffer; give the memory back once it is mostly idle.
        if self.filled == 0 && self.buf.len() > 4 * READ_CHUNK {
            self.buf = Vec::new();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines_of(input: &[u8], max: usize) -> Vec<Line> {
        let mut r = LineReader::default();
        let mut out = Vec::new();
        let mut src = input;
        assert_eq!(
            r.read_lines(&mut src, usize::MAX, max, &mut out),
            ReadOutcome::Eof
        );
        out
    }

    #[test]
    fn a_carriage_return_does_not_count_toward_the_limit() {
        let out = lines_of(b"abcd\r\nabcd\nabcde\r\nx\n", 4);
        assert_eq!(
            out,
            vec![
                Line::Complete(b"abcd".to_vec()),
                Line::Complete(b"abcd".to_vec()),
                Line::TooLong,
                Line::Complete(b"x".to_vec()),
            ]
        );
    }

    #[test]
    fn a_long_line_is_reported_once_and_dropped_up_to_its_newline() {
        let mut input = vec![b'a'; 100];
        input.extend_from_slice(b"\nok\n");
        let out = lines_of(&input, 10);
        assert_eq!(out, vec![Line::TooLong, Line::Complete(b"ok".to_vec())]);
    }
}
