//! The content of the bot's Matrix messages: a reply's pieces (rendered from Markdown, or
//! as given), a message and an edit of one.

use serde_json::{Value, json};

use super::CHUNK_BYTES;
use crate::platforms::markdown::{self, Format, Measure, Piece, Target};
use crate::platforms::split::{Limit, split};

/// `text`'s pieces of at most `limit` bytes (HTML and body together when rendered).
pub(super) fn chunks_of(text: &str, format: Format, limit: usize) -> Vec<Piece> {
    match format {
        Format::Markdown => markdown::pieces(
            text,
            Target::Matrix,
            Measure::HtmlPlusPlainBytes,
            limit,
            usize::MAX,
        ),
        Format::Plain => split(text, Limit::Bytes(limit))
            .into_iter()
            .map(|p| Piece {
                html: String::new(),
                plain: p.to_owned(),
            })
            .collect(),
    }
}

/// The first piece of a partial (the rest comes with the final).
pub(super) fn partial_view(text: &str, format: Format) -> Piece {
    let mut pieces = chunks_of(text, format, CHUNK_BYTES - 8).into_iter();
    let mut first = pieces.next().unwrap_or_default();
    if pieces.next().is_some() {
        first.plain.push('…');
        if !first.html.is_empty() {
            first.html.push('…');
        }
    }
    first
}

/// `{msgtype, body}`, with `format` and `formatted_body` when the piece has HTML.
fn text_content(piece: &Piece, notice: bool, prefix: &str) -> Value {
    // `m.mentions` empty: whatever the agent wrote ("@room", a name) mentions nobody, so
    // it cannot ping a room with the bot's power level.
    let mut c = json!({
        "msgtype": if notice { "m.notice" } else { "m.text" },
        "body": format!("{prefix}{}", piece.plain),
        "m.mentions": {},
    });
    if !piece.html.is_empty() {
        c["format"] = json!("org.matrix.custom.html");
        c["formatted_body"] = json!(format!("{prefix}{}", piece.html));
    }
    c
}

pub(super) fn message_content(piece: &Piece, notice: bool, reply_to: Option<&str>) -> Value {
    let mut c = text_content(piece, notice, "");
    if let Some(r) = reply_to {
        c["m.relates_to"] = json!({"m.in_reply_to": {"event_id": r}});
    }
    c
}

/// A new message's content, inside `thread` (its root) when there is one.
pub(super) fn new_content(
    piece: &Piece,
    notice: bool,
    reply_to: Option<&str>,
    thread: Option<&str>,
) -> Value {
    let mut c = message_content(piece, notice, reply_to);
    if let Some(root) = thread {
        super::threads::put_in_thread(&mut c, root, reply_to);
    }
    c
}

pub(super) fn edit_content(original: &str, piece: &Piece, notice: bool) -> Value {
    let mut c = text_content(piece, notice, "* ");
    c["m.new_content"] = text_content(piece, notice, "");
    c["m.relates_to"] = json!({"rel_type": "m.replace", "event_id": original});
    c
}
