//! The frame encoder: a server line whose text may be long, as bytes — encoded at once, or a
//! JSON envelope around a text escaped on the way out (`server/frame.rs` writes it in bounded
//! pieces) — and the form the journal keeps it in.

use crate::journal::StoredOutcome;

/// Texts up to this many bytes are escaped when the line is made; longer ones as written.
pub(crate) const EAGER_TEXT: usize = 16 * 1024;

/// The bytes of one server line: encoded, or a JSON envelope around a text escaped on the way
/// out.
#[derive(Debug)]
pub(crate) enum EncodedLine {
    /// A whole encoded line, newline included.
    Line(Vec<u8>),
    /// `head` + the text as a JSON string body + `tail` (the tail holds the newline).
    Text {
        /// Everything before the text, including its opening quote.
        head: Vec<u8>,
        /// The raw text.
        text: String,
        /// The closing quote, any later fields, `}` and the newline.
        tail: Vec<u8>,
    },
}

/// The server ops whose text may be long: what [`EncodedLine::text_op`] encodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TextOp {
    /// `partial`: a part of the reply so far (`text`).
    Partial,
    /// `reply`: the final reply (`text`), marked `truncated` if it was cut.
    Reply {
        /// Whether the text was cut (by the agent or at `--max-reply-bytes`).
        truncated: bool,
    },
    /// `failed`: the message failed (`error`).
    Failed,
}

impl EncodedLine {
    /// The line of `op` for message `id` of `session` carrying `text`: the bytes `encode` makes
    /// of the same `ServerOp`, escaped at once when short, else on the way out.
    pub(crate) fn text_op(op: TextOp, id: &str, session: &str, text: String) -> EncodedLine {
        let (name, field, extra) = match op {
            TextOp::Partial => ("partial", "text", ""),
            TextOp::Reply { truncated: false } => ("reply", "text", ""),
            TextOp::Reply { truncated: true } => ("reply", "text", ",\"truncated\":true"),
            TextOp::Failed => ("failed", "error", ""),
        };
        EncodedLine::with_text(name, id, session, field, text, extra)
    }

    /// The `reply` line of message `id` with the files its agent attached: the text escaped
    /// on the way out, the entries in the tail (where [`EncodedLine::attachment_paths`] reads
    /// them back, journaled or not). Without files, [`EncodedLine::text_op`]'s line.
    pub(crate) fn reply(
        id: &str,
        session: &str,
        text: String,
        truncated: bool,
        files: &[crate::Attachment],
    ) -> EncodedLine {
        let op = TextOp::Reply { truncated };
        if files.is_empty() {
            return EncodedLine::text_op(op, id, session, text);
        }
        let mut extra = String::new();
        if truncated {
            extra.push_str(",\"truncated\":true");
        }
        extra.push_str(",\"attachments\":");
        extra.push_str(&crate::attachments::to_json(files));
        let (head, tail) = envelope("reply", id, session, "text", &extra);
        EncodedLine::Text { head, text, tail }
    }

    /// The paths of the files a `reply` line carries (none for any other line): what is
    /// deleted from the spool once the reply is delivered.
    pub(crate) fn attachment_paths(&self) -> Vec<String> {
        let EncodedLine::Text { head, tail, .. } = self else {
            return Vec::new();
        };
        if !head.starts_with(b"{\"op\":\"reply\"") || !tail.starts_with(b"\",") {
            return Vec::new();
        }
        #[derive(serde::Deserialize)]
        struct Tail {
            #[serde(default)]
            attachments: Vec<crate::Attachment>,
        }
        // The tail after the text's closing quote and comma, as an object of its own.
        let object = [b"{".as_slice(), &tail[2..]].concat();
        serde_json::from_slice::<Tail>(&object)
            .map(|t| t.attachments.into_iter().filter_map(|a| a.path).collect())
            .unwrap_or_default()
    }

    /// `{"op":<op>,"id":<id>,"session":<session>,"<field>":"<text>"<extra>}\n`, escaped at once
    /// when short, else on the way out.
    fn with_text(
        op: &str,
        id: &str,
        session: &str,
        field: &str,
        text: String,
        extra: &str,
    ) -> EncodedLine {
        let (head, tail) = envelope(op, id, session, field, extra);
        if text.len() <= EAGER_TEXT {
            let mut line = head;
            push_escaped(&mut line, &text);
            line.extend_from_slice(&tail);
            EncodedLine::Line(line)
        } else {
            EncodedLine::Text { head, text, tail }
        }
    }

    /// The parts to journal (`head`, raw `text`, `tail`).
    pub(crate) fn to_stored(&self) -> StoredOutcome {
        match self {
            EncodedLine::Line(l) => StoredOutcome {
                head: l.clone(),
                ..Default::default()
            },
            EncodedLine::Text { head, text, tail } => StoredOutcome {
                head: head.clone(),
                text: text.clone(),
                tail: tail.clone(),
                memory: None,
            },
        }
    }

    /// A journaled line.
    pub(crate) fn from_stored(o: StoredOutcome) -> EncodedLine {
        if o.text.is_empty() && o.tail.is_empty() {
            EncodedLine::Line(o.head)
        } else {
            EncodedLine::Text {
                head: o.head,
                text: o.text,
                tail: o.tail,
            }
        }
    }

    /// The bytes this line holds in memory before escaping: what an outbox accounts for.
    pub(crate) fn size(&self) -> usize {
        match self {
            EncodedLine::Line(l) => l.len(),
            EncodedLine::Text { head, text, tail } => head.len() + text.len() + tail.len(),
        }
    }
}

/// The line around a text: `{"op":<op>,"id":<id>,"session":<session>,"<field>":"` and
/// `"<extra>}\n`.
fn envelope(op: &str, id: &str, session: &str, field: &str, extra: &str) -> (Vec<u8>, Vec<u8>) {
    let mut head = Vec::with_capacity(64 + id.len() + session.len());
    head.extend_from_slice(b"{\"op\":\"");
    head.extend_from_slice(op.as_bytes());
    head.extend_from_slice(b"\",\"id\":");
    push_json_str(&mut head, id);
    head.extend_from_slice(b",\"session\":");
    push_json_str(&mut head, session);
    head.extend_from_slice(b",\"");
    head.extend_from_slice(field.as_bytes());
    head.extend_from_slice(b"\":\"");
    let mut tail = Vec::with_capacity(4 + extra.len());
    tail.push(b'"');
    tail.extend_from_slice(extra.as_bytes());
    tail.extend_from_slice(b"}\n");
    (head, tail)
}

/// Appends `s` as a JSON string, quotes included.
fn push_json_str(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    push_escaped(out, s);
    out.push(b'"');
}

/// Appends `s` escaped as the inside of a JSON string.
pub(crate) fn push_escaped(out: &mut Vec<u8>, s: &str) {
    // serde_json's escaping (quotes included) minus the quotes: one correct implementation.
    let mut quoted = Vec::with_capacity(s.len() + 2);
    if serde_json::to_writer(&mut quoted, s).is_err() || quoted.len() < 2 {
        return; // writing a &str into a Vec cannot fail
    }
    out.extend_from_slice(&quoted[1..quoted.len() - 1]);
}
