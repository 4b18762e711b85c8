//! The bridge protocol, v1, defined once: newline-delimited JSON objects over TCP (the spec
//! in prose is `docs/protocol.md`). Both ends use this module, as `irc-proto` serves both
//! ends of IRC:
//!
//! - [`ClientOp`]: what a bridge sends (`hello`, `message`, `delivered`, `ping`). The server
//!   reads it with [`parse_line`], a typed parse that borrows from the line
//!   ([`parse`](self::parse)); a bridge writes it with [`ClientOp::line`].
//! - [`ServerOp`]: what the gateway sends. The server writes it with [`encode`] (its strings
//!   borrowed); a bridge reads it as a [`ServerLine`] (its strings owned).
//! - [`MessageFields`]: the fields of a `message`, `chat_type` typed.
//! - [`EncodedLine`]: the frame encoder of the terminal events (`reply`, `failed`) and
//!   `partial`, whose long texts are escaped on the way out, and the form they are journaled
//!   in.

use std::ops::Not;

use serde::{Deserialize, Serialize, Serializer};

use crate::attachments::Attachment;
use crate::message::ChatType;

mod line;
mod parse;
#[cfg(test)]
mod tests;

#[cfg(test)]
pub(crate) use line::EAGER_TEXT;
pub(crate) use line::{EncodedLine, TextOp, push_escaped};
pub use parse::parse_line;

/// A client line, parsed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ClientOp {
    /// Names the bridge's platform; carries the auth token.
    Hello {
        /// Default platform of the connection's messages.
        platform: Option<String>,
        /// Auth token.
        token: Option<String>,
        /// The bridge confirms terminal events with `delivered` (else they count as delivered
        /// once its TCP acknowledged them).
        #[serde(skip_serializing_if = "Not::not")]
        acks: bool,
    },
    /// The bridge has these messages' terminal events (sent after a hello with `acks`).
    Delivered {
        /// Message ids.
        ids: Vec<String>,
    },
    /// A chat message.
    Message(MessageFields),
    /// Liveness probe.
    Ping,
    /// The bridge's own connection to its platform: up, or down (and why); shown in the
    /// status. Any bridge may send it after its hello, whenever the connection changes.
    Link {
        /// Connected to the platform.
        #[serde(serialize_with = "link_state", rename = "state")]
        up: bool,
        /// Why (e.g. the error that took it down); its first [`LINK_DETAIL_MAX`] characters.
        #[serde(skip_serializing_if = "Option::is_none")]
        detail: Option<String>,
    },
    /// Asks whether a user may use the bot (the access policy's answer, `allowed` or not),
    /// before the bridge acts for them outside a message — the Matrix bridge before it
    /// accepts an invite. Answered in line order by a `may_use` server op with the same `id`.
    MayUse {
        /// The query's id, chosen by the bridge and echoed in the answer.
        id: String,
        /// Platform; `None` means the connection's hello platform.
        #[serde(skip_serializing_if = "Option::is_none")]
        platform: Option<String>,
        /// The user, as the bridge names them in a message's `user_id`.
        user_id: String,
        /// The chat the question is about (an invite's room), matched against `allow-chats`.
        #[serde(skip_serializing_if = "Option::is_none")]
        chat_id: Option<String>,
    },
}

/// Characters of a `link` op's `detail` kept (the rest is cut).
pub(crate) const LINK_DETAIL_MAX: usize = 512;

fn link_state<S: serde::Serializer>(up: &bool, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(if *up { "up" } else { "down" })
}

impl ClientOp {
    /// The op as one line, without its newline.
    // Only the bridges (feature `cli`) write client lines.
    #[cfg_attr(not(feature = "cli"), allow(dead_code))]
    pub(crate) fn line(&self) -> String {
        // Strings, a bool and JSON values: serializing cannot fail (the fallback is a line
        // the server answers with `error`, should it ever).
        serde_json::to_string(self).unwrap_or_else(|e| format!("encoding failed: {e}"))
    }
}

/// The fields of a `message` op (written without the optional fields that are `None`: the
/// protocol reads an absent field as `null`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MessageFields {
    /// Message id, unique per platform.
    pub id: String,
    /// Platform; `None` means the connection's hello platform.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub platform: Option<String>,
    /// Chat id.
    pub chat_id: String,
    /// Chat type (default dm).
    #[serde(serialize_with = "chat_type_str")]
    pub chat_type: ChatType,
    /// Sender's id on the platform (for every chat type; part of the key for groups).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user_id: Option<String>,
    /// Sender's display name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user_name: Option<String>,
    /// Thread.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub thread_id: Option<String>,
    /// Platform metadata: a JSON object, serialized (written as the object itself).
    #[serde(serialize_with = "raw_object", skip_serializing_if = "Option::is_none")]
    pub meta: Option<String>,
    /// Text (commands start with a slash).
    pub text: String,
    /// Files the bridge put in the gateway's spool (or skipped, saying why).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub attachments: Vec<Attachment>,
}

impl MessageFields {
    /// A message with only the required fields (a `dm` without user, on the connection's
    /// platform); set the others with struct update syntax.
    pub fn new(id: &str, chat_id: &str, text: &str) -> MessageFields {
        MessageFields {
            id: id.to_owned(),
            platform: None,
            chat_id: chat_id.to_owned(),
            chat_type: ChatType::Dm,
            user_id: None,
            user_name: None,
            thread_id: None,
            meta: None,
            text: text.to_owned(),
            attachments: Vec::new(),
        }
    }
}

fn chat_type_str<S: Serializer>(t: &ChatType, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(t.as_str())
}

/// `meta` holds an object serialized; on the wire it is the object. Text that is not JSON
/// goes as a string, which the server refuses (`invalid`, naming `meta`): writing a line never
/// fails.
fn raw_object<S: Serializer>(meta: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
    match meta
        .as_deref()
        .map(serde_json::from_str::<serde_json::Value>)
    {
        Some(Ok(value)) => value.serialize(s),
        Some(Err(_)) => meta.serialize(s),
        None => s.serialize_none(),
    }
}

/// A line the server cannot act on.
#[derive(Debug, PartialEq, Eq)]
pub enum LineError {
    /// Answered with `{"op":"error","detail":…}`.
    Malformed(String),
    /// A message with an id but a bad field: answered with `reject` / `invalid`.
    Invalid {
        /// The message id.
        id: String,
        /// What is wrong, naming the field.
        detail: String,
    },
}

/// Longest platform name.
pub(crate) const MAX_PLATFORM_BYTES: usize = 64;

/// Checks a platform name: 1 to 64 ASCII letters, digits, `.`, `_` or `-`.
pub(crate) fn check_platform(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= MAX_PLATFORM_BYTES
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "platform must be 1 to {MAX_PLATFORM_BYTES} characters of A-Z, a-z, 0-9, '.', '_', '-'"
        ))
    }
}

/// A server line. The server builds it with borrowed strings (`ServerOp<&str>`) and writes
/// it with [`encode`]; a bridge reads `ServerOp<String>` (in a [`ServerLine`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub(crate) enum ServerOp<S = String> {
    /// Accepted (`running`/`queued` with a position) or a `duplicate`.
    Ack {
        /// Message id.
        id: S,
        /// Session key.
        session: S,
        /// `running`, `queued` or `duplicate`.
        state: S,
        /// Messages of the session ahead of this one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        position: Option<usize>,
    },
    /// Refused.
    Reject {
        /// Message id.
        id: S,
        /// Session key, when one could be built.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        session: Option<S>,
        /// `queue_full`, `overloaded`, `shutting_down`, `invalid`, `backpressure` or `storage`.
        reason: S,
        /// Human-readable detail.
        detail: S,
    },
    /// Typing indicator on or off.
    Typing {
        /// Session key.
        session: S,
        /// Platform.
        platform: S,
        /// Chat id.
        chat_id: S,
        /// On or off.
        on: bool,
    },
    /// Terminal: the reply. The server writes it through [`EncodedLine`], which streams long
    /// texts; its tests check the two agree.
    Reply {
        /// Message id.
        id: S,
        /// Session key.
        session: S,
        /// Reply text.
        text: S,
        /// The agent's reply was longer than `--max-reply-bytes` and was cut.
        #[serde(default, skip_serializing_if = "Not::not")]
        truncated: bool,
        /// Set when the gateway's access policy answered instead of an agent: `pairing`,
        /// `denied`, `rate_limited`, `admin` or `ignored` (an empty text not to be shown).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        notice: Option<S>,
        /// Files the agent attached, in the gateway's spool (the message's entries: `name`,
        /// `mime`, `size`, `sha256`, `path`); deleted once the reply is delivered.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        attachments: Vec<Attachment>,
    },
    /// The reply so far of a running turn (best effort; the terminal `reply` has it all).
    /// Written through [`EncodedLine`], as `reply`.
    Partial {
        /// Message id.
        id: S,
        /// Session key.
        session: S,
        /// The text so far.
        text: S,
    },
    /// Terminal: cancelled.
    Cancelled {
        /// Message id.
        id: S,
        /// Session key.
        session: S,
        /// stopped, reset, interrupted, shutdown.
        reason: S,
    },
    /// Terminal: failed. Written through [`EncodedLine`], as `reply`.
    Failed {
        /// Message id.
        id: S,
        /// Session key.
        session: S,
        /// What failed.
        error: S,
    },
    /// Terminal: merged into another message's turn.
    Merged {
        /// Message id.
        id: S,
        /// Session key.
        session: S,
        /// The carrier message's id.
        into: S,
    },
    /// A line that could not be acted on.
    Error {
        /// What was wrong.
        detail: S,
    },
    /// The answer to a `may_use` query: whether its user may use the bot (an admin, a user
    /// let in, or anyone on an open platform).
    MayUse {
        /// The query's id.
        id: S,
        /// The user may use the bot.
        allowed: bool,
    },
    /// Answer to ping, with the longest line the server reads (its `--max-line-bytes`): a
    /// client bounds its own lines to it.
    Pong {
        /// The server's line limit in bytes.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_line_bytes: Option<usize>,
    },
}

/// The field the server adds to a terminal event it sends again (`"redelivery":true`), as
/// it closes the line: see the protocol's Delivery section.
pub(crate) const REDELIVERY_MARK: &[u8] = b",\"redelivery\":true}\n";

/// A server line as a bridge reads it: the op, and whether the server marked it as sent
/// before.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
// Only the bridges (feature `cli`) read server lines.
#[cfg_attr(not(feature = "cli"), allow(dead_code))]
pub(crate) struct ServerLine {
    /// What the line says.
    #[serde(flatten)]
    pub(crate) op: ServerOp<String>,
    /// A terminal event the gateway may have sent before.
    #[serde(default)]
    pub(crate) redelivery: bool,
}

impl ServerLine {
    /// Reads one line (without its newline).
    #[cfg_attr(not(feature = "cli"), allow(dead_code))]
    pub(crate) fn parse(line: &[u8]) -> Result<ServerLine, serde_json::Error> {
        serde_json::from_slice(line)
    }
}

/// Encodes a server op as one line, newline included.
pub(crate) fn encode(op: &ServerOp<&str>) -> Vec<u8> {
    // Serializing these plain structs cannot fail; fall back to an error line regardless.
    let mut line = serde_json::to_vec(op)
        .unwrap_or_else(|_| br#"{"op":"error","detail":"encoding failed"}"#.to_vec());
    line.push(b'\n');
    line
}
