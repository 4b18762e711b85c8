//! Server-sent events as OpenAI-compatible servers stream them, and the chunks they carry.
//!
//! Lines end with `\n` (a trailing `\r` is dropped); an event is its `data:` lines joined
//! with `\n`, dispatched at a blank line (or at the end of the stream); lines starting with
//! `:` are comments (keep-alives); other fields (`event:`, `id:`, `retry:`) are ignored.
//! Every line and the whole stream are bounded, so a hostile or broken server cannot make
//! the reader buffer without limit.

use std::io::{self, BufRead};

use serde::Deserialize;

/// Why the stream could not be read as events.
#[derive(Debug)]
pub(super) enum SseError {
    /// Reading failed (transport error, timeout, cancellation).
    Io(io::Error),
    /// A line longer than the line bound.
    LineTooLong(usize),
    /// More bytes than the stream bound.
    TooMuch(usize),
    /// A line that is not UTF-8.
    NotUtf8,
}

/// Reads events from a byte stream.
pub(super) struct SseReader<R> {
    inner: R,
    max_line: usize,
    max_total: usize,
    total: usize,
    line: Vec<u8>,
    eof: bool,
}

impl<R: BufRead> SseReader<R> {
    /// A reader refusing lines over `max_line` bytes and streams over `max_total` bytes.
    pub(super) fn new(inner: R, max_line: usize, max_total: usize) -> SseReader<R> {
        SseReader {
            inner,
            max_line,
            max_total,
            total: 0,
            line: Vec::new(),
            eof: false,
        }
    }

    /// The underlying reader.
    pub(super) fn into_inner(self) -> R {
        self.inner
    }

    /// Bytes read so far.
    #[cfg(test)]
    pub(crate) fn bytes_read(&self) -> usize {
        self.total
    }

    /// The next line without its ending, or `None` at the end of the stream.
    fn next_line(&mut self) -> Result<Option<&str>, SseError> {
        self.line.clear();
        if self.eof {
            return Ok(None);
        }
        loop {
            let buf = match self.inner.fill_buf() {
                Ok(b) => b,
                Err(e) if e.kind() == io::ErrorKind::Interrupted && e.get_ref().is_none() => {
                    continue;
                }
                Err(e) => return Err(SseError::Io(e)),
            };
            if buf.is_empty() {
                self.eof = true;
                if self.line.is_empty() {
                    return Ok(None);
                }
                break;
            }
            let (take, done) = match buf.iter().position(|&b| b == b'\n') {
                Some(i) => (i + 1, true),
                None => (buf.len(), false),
            };
            let content = if done { take - 1 } else { take };
            if self.line.len() + content > self.max_line {
                return Err(SseError::LineTooLong(self.max_line));
            }
            self.total += take;
            if self.total > self.max_total {
                return Err(SseError::TooMuch(self.max_total));
            }
            self.line.extend_from_slice(&buf[..content]);
            self.inner.consume(take);
            if done {
                break;
            }
        }
        if self.line.last() == Some(&b'\r') {
            self.line.pop();
        }
        std::str::from_utf8(&self.line)
            .map(Some)
            .map_err(|_| SseError::NotUtf8)
    }

    /// The next event's data, or `None` at the end of the stream.
    pub(super) fn next_event(&mut self) -> Result<Option<String>, SseError> {
        let mut data: Option<String> = None;
        loop {
            let Some(line) = self.next_line()? else {
                return Ok(data);
            };
            if line.is_empty() {
                if data.is_some() {
                    return Ok(data);
                }
                continue;
            }
            if line.starts_with(':') {
                continue;
            }
            let (field, value) = match line.split_once(':') {
                Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
                None => (line, ""),
            };
            if field == "data" {
                match &mut data {
                    Some(d) => {
                        d.push('\n');
                        d.push_str(value);
                    }
                    None => data = Some(value.to_owned()),
                }
            }
        }
    }
}

/// One `chat.completion.chunk`, reduced to what the agent uses.
#[derive(Debug, Default, Deserialize)]
pub(super) struct Chunk {
    /// The choices; the agent reads the first.
    #[serde(default)]
    pub choices: Vec<Choice>,
    /// Token counts (the last chunk, with `stream_options.include_usage`).
    #[serde(default)]
    pub usage: Option<Usage>,
    /// An error reported inside the stream.
    #[serde(default)]
    pub error: Option<ApiError>,
}

/// A choice of a chunk.
#[derive(Debug, Default, Deserialize)]
pub(super) struct Choice {
    /// The new text.
    #[serde(default)]
    pub delta: Option<Delta>,
    /// Set on the choice's last chunk.
    #[serde(default)]
    pub finish_reason: Option<String>,
}

/// The text a chunk adds.
#[derive(Debug, Default, Deserialize)]
pub(super) struct Delta {
    /// Reply text (absent or null on role-only and tool chunks).
    #[serde(default)]
    pub content: Option<String>,
}

/// Token counts.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
pub(super) struct Usage {
    /// Tokens of the prompt.
    #[serde(default)]
    pub prompt_tokens: u64,
    /// Tokens of the reply.
    #[serde(default)]
    pub completion_tokens: u64,
}

/// An error object, in a stream or an error response: `{"error": {"message": …}}`.
#[derive(Debug, Default, Deserialize)]
pub(super) struct ApiError {
    /// The server's explanation.
    #[serde(default)]
    pub message: Option<String>,
}

/// What one event means.
#[derive(Debug)]
pub(super) enum Event {
    /// `data: [DONE]`.
    Done,
    /// A chunk.
    Chunk(Chunk),
}

/// Decodes an event's data; `Err` describes why it is not a chunk.
pub(super) fn decode(data: &str) -> Result<Event, String> {
    if data.trim() == "[DONE]" {
        return Ok(Event::Done);
    }
    serde_json::from_str::<Chunk>(data)
        .map(Event::Chunk)
        .map_err(|e| format!("not a chat.completion.chunk ({e})"))
}

/// The error message of an error response body, if it has the usual shape (or is text).
pub(super) fn error_message(body: &str) -> Option<String> {
    #[derive(Deserialize)]
    struct Body {
        error: ErrorField,
    }
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum ErrorField {
        Object(ApiError),
        Text(String),
    }
    match serde_json::from_str::<Body>(body) {
        Ok(Body {
            error: ErrorField::Object(ApiError { message: Some(m) }),
        })
        | Ok(Body {
            error: ErrorField::Text(m),
        }) => Some(m),
        Ok(_) => None,
        Err(_) => {
            let text = body.trim();
            (!text.is_empty() && !text.starts_with('{') && !text.starts_with('<'))
                .then(|| text.to_owned())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(input: &str) -> Vec<String> {
        let mut r = SseReader::new(input.as_bytes(), 1024, 1 << 20);
        let mut out = Vec::new();
        while let Some(e) = r.next_event().expect("valid stream") {
            out.push(e);
        }
        out
    }

    #[test]
    fn events_are_split_at_blank_lines_and_comments_are_skipped() {
        let s = ": keep-alive\r\ndata: {\"a\":1}\r\n\r\ndata:{\"b\":2}\n\nevent: x\ndata: l1\ndata: l2\n\ndata: [DONE]";
        assert_eq!(
            events(s),
            vec!["{\"a\":1}", "{\"b\":2}", "l1\nl2", "[DONE]"]
        );
    }

    #[test]
    fn lines_and_streams_are_bounded() {
        let long = format!("data: {}\n\n", "x".repeat(100));
        let mut r = SseReader::new(long.as_bytes(), 50, 1 << 20);
        assert!(matches!(r.next_event(), Err(SseError::LineTooLong(50))));
        let many = "data: 1\n\n".repeat(100);
        let mut r = SseReader::new(many.as_bytes(), 50, 200);
        let err = loop {
            match r.next_event() {
                Ok(Some(_)) => {}
                Ok(None) => panic!("the stream bound was not enforced"),
                Err(e) => break e,
            }
        };
        assert!(matches!(err, SseError::TooMuch(200)));
        assert!(r.bytes_read() <= 200 + 9);
        let mut r = SseReader::new(&b"data: \xff\n\n"[..], 50, 200);
        assert!(matches!(r.next_event(), Err(SseError::NotUtf8)));
    }

    #[test]
    fn a_line_of_exactly_the_bound_is_accepted() {
        let line = "data: 12345";
        let input = format!("{line}\n\n");
        let mut r = SseReader::new(input.as_bytes(), line.len(), 1 << 20);
        assert_eq!(r.next_event().ok().flatten().as_deref(), Some("12345"));
    }

    /// Fails its first fill with `first`, then reads `data`.
    struct Flaky {
        first: Option<io::Error>,
        data: &'static [u8],
    }

    impl io::Read for Flaky {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = self.fill_buf()?.len().min(buf.len());
            buf[..n].copy_from_slice(&self.data[..n]);
            self.consume(n);
            Ok(n)
        }
    }

    impl BufRead for Flaky {
        fn fill_buf(&mut self) -> io::Result<&[u8]> {
            match self.first.take() {
                Some(e) => Err(e),
                None => Ok(self.data),
            }
        }
        fn consume(&mut self, n: usize) {
            self.data = &self.data[n..];
        }
    }

    #[test]
    fn a_signal_interruption_is_retried_but_a_cancelled_read_is_not() {
        let eintr = Flaky {
            first: Some(io::ErrorKind::Interrupted.into()),
            data: b"data: x\n\n",
        };
        let mut r = SseReader::new(eintr, 64, 1024);
        assert_eq!(r.next_event().ok().flatten().as_deref(), Some("x"));
        let cancelled = Flaky {
            first: Some(io::Error::new(
                io::ErrorKind::Interrupted,
                "request cancelled",
            )),
            data: b"data: x\n\n",
        };
        let mut r = SseReader::new(cancelled, 64, 1024);
        assert!(matches!(r.next_event(), Err(SseError::Io(_))));
    }

    #[test]
    fn chunks_decode_content_usage_and_done() {
        let Ok(Event::Chunk(c)) = decode(
            r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"},"finish_reason":null}]}"#,
        ) else {
            panic!("not a chunk")
        };
        assert_eq!(
            c.choices[0]
                .delta
                .as_ref()
                .and_then(|d| d.content.as_deref()),
            Some("Hi")
        );
        let Ok(Event::Chunk(c)) =
            decode(r#"{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}"#)
        else {
            panic!("not a chunk")
        };
        assert_eq!(
            c.usage,
            Some(Usage {
                prompt_tokens: 7,
                completion_tokens: 3
            })
        );
        assert!(matches!(decode(" [DONE] "), Ok(Event::Done)));
        assert!(decode("{not json").is_err());
        assert!(decode("42").is_err());
        assert!(decode(r#"{"choices":{}}"#).is_err());
    }

    #[test]
    fn error_messages_are_found_in_the_usual_shapes() {
        assert_eq!(
            error_message(r#"{"error":{"message":"invalid api key","type":"x"}}"#).as_deref(),
            Some("invalid api key")
        );
        assert_eq!(
            error_message(r#"{"error":"model \"x\" not found"}"#).as_deref(),
            Some("model \"x\" not found")
        );
        assert_eq!(
            error_message("  Bad Gateway \n").as_deref(),
            Some("Bad Gateway")
        );
        assert_eq!(error_message("<html>…</html>"), None);
        assert_eq!(error_message(r#"{"detail":"x"}"#), None);
        assert_eq!(error_message(""), None);
    }
}
