//! Server-sent events as OpenAI-compatible servers stream them, and the chunks they carry.
//!
//! Lines end with `\n` (a trailing `\r` is dropped); an event is its `data:` lines joined
//! with `\n`, dispatched at a blank line (or at the end of the stream); lines starting with
//! `:` are comments (keep-alives); other fields (`event:`, `id:`, `retry:`) are ignored.
//! Every line and the whole stream are bounded, so a hostile or broken server cannot make
//! the reader buffer without limit.

use std::borrow::Cow;
use std::fmt;
use std::io::{self, BufRead};
use std::marker::PhantomData;

use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, SeqAccess, Visitor};

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
    /// The event being assembled; reused, so an event costs no allocation once the
    /// buffers have grown to the stream's line size.
    data: String,
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
            data: String::new(),
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

    /// Reads the next line, without its ending, into `self.line`; `false` at the end of
    /// the stream.
    fn next_line(&mut self) -> Result<bool, SseError> {
        self.line.clear();
        if self.eof {
            return Ok(false);
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
                    return Ok(false);
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
        Ok(true)
    }

    /// The next event's data, or `None` at the end of the stream. The text is the reader's
    /// own buffer, valid until the next call.
    pub(super) fn next_event(&mut self) -> Result<Option<&str>, SseError> {
        self.data.clear();
        let mut any = false;
        loop {
            if !self.next_line()? {
                return Ok(any.then_some(self.data.as_str()));
            }
            let line = std::str::from_utf8(&self.line).map_err(|_| SseError::NotUtf8)?;
            if line.is_empty() {
                if any {
                    return Ok(Some(self.data.as_str()));
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
                if any {
                    self.data.push('\n');
                }
                self.data.push_str(value);
                any = true;
            }
        }
    }
}

/// One `chat.completion.chunk`, reduced to what the agent uses, borrowing its text from
/// the event where it can: a token costs no allocation (the first choice alone is
/// decoded; the other choices and unknown fields are skipped without being built).
#[derive(Debug, Default, Deserialize)]
pub(super) struct Chunk<'a> {
    /// The first choice (the agent asks for one).
    #[serde(default, borrow)]
    pub choices: First<Choice<'a>>,
    /// Token counts (the last chunk, with `stream_options.include_usage`).
    #[serde(default)]
    pub usage: Option<Usage>,
    /// An error reported inside the stream.
    #[serde(default)]
    pub error: Option<ApiError>,
}

/// A choice of a chunk.
#[derive(Debug, Default, Deserialize)]
pub(super) struct Choice<'a> {
    /// The new text.
    #[serde(default, borrow)]
    pub delta: Option<Delta<'a>>,
    /// Set on the choice's last chunk.
    #[serde(default, borrow)]
    pub finish_reason: Option<Text<'a>>,
}

/// The text a chunk adds.
#[derive(Debug, Default, Deserialize)]
pub(super) struct Delta<'a> {
    /// Reply text (absent or null on role-only and tool chunks).
    #[serde(default, borrow)]
    pub content: Option<Text<'a>>,
}

/// A JSON string, borrowed from the event unless it has escapes. (serde's own `Cow`
/// inside an `Option` always copies.)
#[derive(Debug, Default)]
pub(super) struct Text<'a>(pub Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Text<'a>, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Text<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V)
    }
}

/// The first element of a JSON array, the others skipped unbuilt; `None` when it is empty.
#[derive(Debug)]
pub(super) struct First<T>(pub Option<T>);

impl<T> Default for First<T> {
    fn default() -> First<T> {
        First(None)
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for First<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<First<T>, D::Error> {
        struct V<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = First<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<First<T>, A::Error> {
                let first = seq.next_element::<T>()?;
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(First(first))
            }
        }
        d.deserialize_seq(V(PhantomData))
    }
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
pub(super) enum Event<'a> {
    /// `data: [DONE]`.
    Done,
    /// A chunk.
    Chunk(Chunk<'a>),
}

/// Decodes an event's data; `Err` describes why it is not a chunk.
pub(super) fn decode(data: &str) -> Result<Event<'_>, String> {
    if data.trim() == "[DONE]" {
        return Ok(Event::Done);
    }
    serde_json::from_str::<Chunk<'_>>(data)
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
            out.push(e.to_owned());
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
        assert_eq!(r.next_event().ok().flatten(), Some("12345"));
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
        assert_eq!(r.next_event().ok().flatten(), Some("x"));
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
        let content = |c: &Chunk<'_>| {
            c.choices
                .0
                .as_ref()
                .and_then(|c| c.delta.as_ref())
                .and_then(|d| d.content.as_ref())
                .map(|t| t.0.to_string())
        };
        assert_eq!(content(&c).as_deref(), Some("Hi"));
        let borrowed = |c: &Chunk<'_>| {
            c.choices
                .0
                .as_ref()
                .and_then(|c| c.delta.as_ref())
                .and_then(|d| d.content.as_ref())
                .is_some_and(|t| matches!(t.0, Cow::Borrowed(_)))
        };
        assert!(borrowed(&c), "a token without escapes is not copied");
        // Plain text is borrowed from the event; escapes are decoded into a copy.
        let Ok(Event::Chunk(c)) = decode(r#"{"choices":[{"delta":{"content":"a\nb"}}]}"#) else {
            panic!("not a chunk")
        };
        assert_eq!(content(&c).as_deref(), Some("a\nb"));
        assert!(!borrowed(&c));
        // The first choice is the one read; later ones are skipped.
        let Ok(Event::Chunk(c)) =
            decode(r#"{"choices":[{"delta":{"content":"one"}},{"delta":{"content":"two"}}]}"#)
        else {
            panic!("not a chunk")
        };
        assert_eq!(content(&c).as_deref(), Some("one"));
        assert!(matches!(
            decode(r#"{"choices":[{"delta":{"content":"x"},"finish_reason":"stop"}]}"#),
            Ok(Event::Chunk(Chunk {
                choices: First(Some(Choice {
                    finish_reason: Some(_),
                    ..
                })),
                ..
            }))
        ));
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
        assert!(decode(r#"{"choices":[{"delta":{"content":7}}]}"#).is_err());
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
