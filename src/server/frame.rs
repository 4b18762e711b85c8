//! Outgoing lines, written in bounded pieces.
//!
//! A line carrying a long text (a 1 MiB reply of `"` characters escapes to 2 MiB) is not
//! encoded in one go on the reactor: it keeps its text and is escaped 16 KiB at a time as the
//! socket takes it, so no single event costs the loop more than a fraction of a millisecond.
//! Short lines are encoded at once, so that many of them go out in one vectored write.

use std::collections::VecDeque;
use std::io::{self, IoSlice, Write};
use std::sync::Arc;

use crate::wire::{EncodedLine, REDELIVERY_MARK, push_escaped};

/// Bytes of text escaped per step of a long line.
const CHUNK: usize = 16 * 1024;
/// Frames gathered into one vectored write.
const MAX_SLICES: usize = 64;

/// Where the writing of a line stands.
#[derive(Debug, Default)]
struct Cursor {
    /// 0: head (or the whole `Line`), 1: text, 2: tail.
    stage: u8,
    /// Bytes of the current stage's source consumed (text: raw bytes escaped so far).
    pos: usize,
    /// The escaped piece of text being written.
    chunk: Vec<u8>,
    /// Bytes of `chunk` written.
    chunk_pos: usize,
}

/// A line queued on a connection.
#[derive(Debug)]
pub(super) struct Frame {
    /// What to write.
    pub body: EncodedLine,
    /// A terminal event's platform: it returns to that platform's outbox if the connection
    /// goes before the whole line is written.
    pub terminal_for: Option<Arc<str>>,
    /// A terminal event's message: its journal sequence number (0: none) and id, for the
    /// `delivered` record and a bridge's `delivered` confirmation.
    pub seq: u64,
    /// The message id of a terminal event.
    pub msg_id: Option<Arc<str>>,
    /// Marked `"redelivery":true`: it may have reached the bridge before.
    pub redelivery: bool,
    /// `--cluster`: a terminal event's message as Redis knows it (its cluster tag; 0: not
    /// known), so that another instance can be forwarded it (`cluster/bridge/forward.rs`).
    /// Always 0 in a single instance (and without the `cluster` feature).
    pub cluster: u64,
    cursor: Cursor,
}

impl Frame {
    /// A line that is not a terminal event.
    pub(super) fn line(bytes: Vec<u8>) -> Frame {
        Frame::new(EncodedLine::Line(bytes), None)
    }

    /// A frame; `terminal_for` names the platform of a terminal event.
    pub(super) fn new(body: EncodedLine, terminal_for: Option<Arc<str>>) -> Frame {
        Frame {
            body,
            terminal_for,
            seq: 0,
            msg_id: None,
            redelivery: false,
            cluster: 0,
            cursor: Cursor::default(),
        }
    }

    /// The terminal event of message `id`, journaled as `seq`.
    pub(super) fn of_message(mut self, seq: u64, id: Arc<str>) -> Frame {
        self.seq = seq;
        self.msg_id = Some(id);
        self
    }

    /// Adds `"redelivery":true` to the line (once), before it is written again.
    pub(super) fn mark_redelivery(&mut self) {
        if self.redelivery {
            return;
        }
        let end = match &mut self.body {
            EncodedLine::Line(l) => l,
            EncodedLine::Text { tail, .. } => tail,
        };
        if end.ends_with(b"}\n") {
            end.truncate(end.len() - 2);
            end.extend_from_slice(REDELIVERY_MARK);
            self.redelivery = true;
        }
    }

    /// Forgets what was written, so that the line can be sent whole elsewhere.
    pub(super) fn rewind(&mut self) {
        self.cursor = Cursor::default();
    }

    /// The next bytes to write; empty when the line is done.
    fn current(&mut self) -> &[u8] {
        let c = &mut self.cursor;
        match &self.body {
            EncodedLine::Line(l) => &l[c.pos.min(l.len())..],
            EncodedLine::Text { head, text, tail } => {
                if c.stage == 0 && c.pos >= head.len() {
                    c.stage = 1;
                    c.pos = 0;
                }
                if c.stage == 1 && c.chunk_pos >= c.chunk.len() {
                    c.chunk.clear();
                    c.chunk_pos = 0;
                    if c.pos < text.len() {
                        let piece = crate::text::prefix(&text[c.pos..], CHUNK);
                        push_escaped(&mut c.chunk, piece);
                        c.pos += piece.len();
                    } else {
                        c.stage = 2;
                        c.pos = 0;
                    }
                }
                match c.stage {
                    0 => &head[c.pos..],
                    1 => &c.chunk[c.chunk_pos..],
                    _ => &tail[c.pos.min(tail.len())..],
                }
            }
        }
    }

    /// Marks `n` bytes of [`Frame::current`] written.
    fn advance(&mut self, n: usize) {
        let c = &mut self.cursor;
        match (&self.body, c.stage) {
            (EncodedLine::Text { .. }, 1) => c.chunk_pos += n,
            _ => c.pos += n,
        }
    }

    /// Whether a text line must be escaped further before its next bytes are known.
    fn is_lazy(&self) -> bool {
        matches!(self.body, EncodedLine::Text { .. })
    }
}

/// What a write pass achieved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flushed {
    /// Everything queued was written.
    All,
    /// The socket took no more.
    Blocked,
    /// The budget ran out with output left.
    Budget,
}

/// Writes frames from the front of `out` into `w`, at most about `budget` bytes, calling
/// `done` for each frame written whole (in order), with the bytes this pass had written when
/// its last byte went. Partly written frames stay at the front.
pub(super) fn write_frames<W: Write + ?Sized>(
    out: &mut VecDeque<Frame>,
    w: &mut W,
    mut budget: usize,
    mut done: impl FnMut(Frame, usize),
) -> io::Result<(usize, Flushed)> {
    let mut total = 0;
    loop {
        // Drop finished fronts (a text line whose last chunk was written).
        while out.front_mut().is_some_and(|f| f.current().is_empty()) {
            if let Some(f) = out.pop_front() {
                done(f, total);
            }
        }
        if out.is_empty() {
            return Ok((total, Flushed::All));
        }
        if budget == 0 {
            return Ok((total, Flushed::Budget));
        }
        let n = {
            let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(MAX_SLICES.min(out.len()));
            let mut gathered = 0;
            for (i, f) in out.iter_mut().enumerate() {
                // A lazy line past the front needs escaping state; write what came before it.
                if (i > 0 && f.is_lazy()) || slices.len() == MAX_SLICES || gathered >= budget {
                    break;
                }
                let lazy = f.is_lazy();
                let bytes = f.current();
                let take = bytes.len().min(budget - gathered);
                gathered += take;
                slices.push(IoSlice::new(&bytes[..take]));
                if take < bytes.len() || lazy {
                    break;
                }
            }
            match w.write_vectored(&slices) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    return Ok((total, Flushed::Blocked));
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        };
        budget = budget.saturating_sub(n);
        let mut left = n;
        while left > 0 {
            let Some(front) = out.front_mut() else { break };
            let cur = front.current().len();
            let step = left.min(cur);
            front.advance(step);
            left -= step;
            if front.current().is_empty()
                && let Some(f) = out.pop_front()
            {
                done(f, total + n - left);
            }
        }
        total += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{EAGER_TEXT, ServerOp, TextOp, encode};

    /// A writer that takes at most `cap` bytes per call and `total` bytes overall.
    struct Trickle {
        data: Vec<u8>,
        cap: usize,
        total: usize,
    }

    impl Write for Trickle {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            let n = buf.len().min(self.cap).min(self.total - self.data.len());
            if n == 0 && !buf.is_empty() {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            self.data.extend_from_slice(&buf[..n]);
            Ok(n)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn reply(text: &str, truncated: bool) -> Vec<u8> {
        encode(&ServerOp::Reply {
            id: "m\"1",
            session: "t:dm:1",
            text,
            truncated,
            notice: None,
            attachments: Vec::new(),
        })
    }

    #[test]
    fn short_and_long_texts_encode_exactly_as_serde_does() {
        for text in [
            String::new(),
            "hi".to_owned(),
            "\"".repeat(EAGER_TEXT + 1),
            "é\u{1}x".repeat(CHUNK),
        ] {
            for truncated in [false, true] {
                let body = EncodedLine::text_op(
                    TextOp::Reply { truncated },
                    "m\"1",
                    "t:dm:1",
                    text.clone(),
                );
                assert_eq!(
                    matches!(body, EncodedLine::Line(_)),
                    text.len() <= EAGER_TEXT
                );
                let mut out = VecDeque::from([Frame::new(body, None)]);
                let mut w = Trickle {
                    data: Vec::new(),
                    cap: 7_777,
                    total: usize::MAX,
                };
                let mut frames = 0;
                while !out.is_empty() {
                    write_frames(&mut out, &mut w, 5_000, |_, _| frames += 1).unwrap();
                }
                assert_eq!(frames, 1);
                assert_eq!(w.data, reply(&text, truncated));
            }
        }
    }

    #[test]
    fn a_partial_line_is_the_protocols_partial_op() {
        let body = EncodedLine::text_op(TextOp::Partial, "m", "t:dm:1", "so far".into());
        let EncodedLine::Line(line) = body else {
            panic!("short text is encoded at once")
        };
        let want = encode(&ServerOp::Partial {
            id: "m",
            session: "t:dm:1",
            text: "so far",
        });
        assert_eq!(line, want);
    }

    #[test]
    fn the_budget_and_a_full_socket_stop_a_pass_and_the_next_goes_on() {
        let lines: Vec<Vec<u8>> = (0..10)
            .map(|i| format!("line {i}\n").into_bytes())
            .collect();
        let mut out: VecDeque<Frame> = lines.iter().cloned().map(Frame::line).collect();
        let mut w = Trickle {
            data: Vec::new(),
            cap: 1000,
            total: 20,
        };
        let (n, how) = write_frames(&mut out, &mut w, 1000, |_, _| {}).unwrap();
        assert_eq!((n, how), (20, Flushed::Blocked));
        w.total = usize::MAX;
        let (n, how) = write_frames(&mut out, &mut w, 10, |_, _| {}).unwrap();
        assert_eq!((n, how), (10, Flushed::Budget));
        let mut done = 0;
        let (_, how) = write_frames(&mut out, &mut w, 1000, |_, _| done += 1).unwrap();
        assert_eq!(how, Flushed::All);
        assert_eq!(w.data, lines.concat());
        assert!(done >= 6, "{done}");
    }
}
