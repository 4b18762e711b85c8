//! The bridge protocol, v1: newline-delimited JSON objects over TCP (see `docs/protocol.md`).

use std::borrow::Cow;

use serde::Serialize;
use serde_json::Value;

use self::parse::{Field, Fields};
use crate::message::ChatType;

#[cfg(test)]
mod oracle;
mod parse;

/// A client line, parsed.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum ClientOp {
    /// Names the bridge's platform; carries the auth token.
    Hello {
        /// Default platform of the connection's messages.
        platform: Option<String>,
        /// Auth token.
        token: Option<String>,
        /// The bridge confirms terminal events with `delivered` (else they count as delivered
        /// once its TCP acknowledged them).
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
}

/// The fields of a `message` op.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct MessageFields {
    /// Message id, unique per platform.
    pub id: String,
    /// Platform; `None` means the connection's hello platform.
    pub platform: Option<String>,
    /// Chat id.
    pub chat_id: String,
    /// Chat type (default dm).
    pub chat_type: ChatType,
    /// Sender's id on the platform (for every chat type; part of the key for groups).
    pub user_id: Option<String>,
    /// Sender's display name.
    pub user_name: Option<String>,
    /// Platform metadata: a JSON object, serialized.
    pub meta: Option<String>,
    /// Thread.
    pub thread_id: Option<String>,
    /// Text (commands start with a slash).
    pub text: String,
}

/// A line the server cannot act on.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum LineError {
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

/// Parses one line (without its newline).
pub(super) fn parse_line(line: &[u8]) -> Result<ClientOp, LineError> {
    let mut obj = Fields::default();
    let object = parse::parse(line, &mut obj)
        .map_err(|e| LineError::Malformed(format!("invalid JSON: {e}")))?;
    if !object {
        return Err(LineError::Malformed("expected a JSON object".into()));
    }
    let op = match &obj.op {
        Field::Str(op) => &**op,
        Field::Absent => return Err(LineError::Malformed("missing op".into())),
        _ => return Err(LineError::Malformed("op must be a string".into())),
    };
    match op {
        "ping" => Ok(ClientOp::Ping),
        "hello" => {
            let field = |name: &str, f: &Field<'_>| match f {
                Field::Absent | Field::Null => Ok(None),
                Field::Str(s) => Ok(Some(s.to_string())),
                _ => Err(LineError::Malformed(format!(
                    "hello: {name} must be a string"
                ))),
            };
            let acks = match obj.acks {
                Field::Absent | Field::Null => false,
                Field::Bool(b) => b,
                _ => {
                    return Err(LineError::Malformed("hello: acks must be a boolean".into()));
                }
            };
            Ok(ClientOp::Hello {
                platform: field("platform", &obj.platform)?,
                token: field("token", &obj.token)?,
                acks,
            })
        }
        "delivered" => match obj.ids.take() {
            Some(ids) => Ok(ClientOp::Delivered {
                ids: ids.into_iter().map(Cow::into_owned).collect(),
            }),
            None => Err(LineError::Malformed(
                "delivered: ids must be an array of strings".into(),
            )),
        },
        "message" => parse_message(&mut obj),
        other => Err(LineError::Malformed(format!(
            "unknown op: {}",
            truncate(other, 64)
        ))),
    }
}

/// The fields of a `message`, checked in the order the protocol always checked them (the
/// first bad one is the one answered).
fn parse_message(obj: &mut Fields<'_>) -> Result<ClientOp, LineError> {
    let id = match std::mem::take(&mut obj.id) {
        Field::Str(id) if !id.is_empty() => id.into_owned(),
        _ => {
            return Err(LineError::Malformed(
                "message: id must be a non-empty string".into(),
            ));
        }
    };
    let invalid = |detail: String| LineError::Invalid {
        id: id.clone(),
        detail,
    };
    let required = |name: &str, f: Field<'_>| match f {
        Field::Str(s) => Ok(s.into_owned()),
        Field::Absent => Err(invalid(format!("{name} is required"))),
        _ => Err(invalid(format!("{name} must be a string"))),
    };
    let optional = |name: &str, f: Field<'_>| match f {
        Field::Absent | Field::Null => Ok(None),
        Field::Str(s) => Ok(Some(s.into_owned())),
        _ => Err(invalid(format!("{name} must be a string or null"))),
    };
    let chat_type = match &obj.chat_type {
        Field::Absent | Field::Null => ChatType::Dm,
        Field::Str(t) => ChatType::parse(t)
            .ok_or_else(|| invalid("chat_type must be one of dm, group, channel, thread".into()))?,
        _ => return Err(invalid("chat_type must be a string or null".into())),
    };
    let meta = match &obj.meta {
        None | Some(Value::Null) => None,
        // Re-serialized compactly: the agent gets a canonical object, bounded by the line.
        Some(v @ Value::Object(_)) => Some(v.to_string()),
        Some(_) => return Err(invalid("meta must be a JSON object or null".into())),
    };
    let chat_id = required("chat_id", std::mem::take(&mut obj.chat_id))?;
    let text = required("text", std::mem::take(&mut obj.text))?;
    let platform = optional("platform", std::mem::take(&mut obj.platform))?;
    let user_id = optional("user_id", std::mem::take(&mut obj.user_id))?;
    let user_name = optional("user_name", std::mem::take(&mut obj.user_name))?;
    let thread_id = optional("thread_id", std::mem::take(&mut obj.thread_id))?;
    Ok(ClientOp::Message(MessageFields {
        id,
        platform,
        chat_id,
        chat_type,
        user_id,
        user_name,
        meta,
        thread_id,
        text,
    }))
}

fn truncate(s: &str, max: usize) -> &str {
    match s.char_indices().nth(max) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// Longest platform name.
pub(super) const MAX_PLATFORM_BYTES: usize = 64;

/// Checks a platform name: 1 to 64 ASCII letters, digits, `.`, `_` or `-`.
pub(super) fn check_platform(name: &str) -> Result<(), String> {
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

/// A server line.
#[derive(Debug, Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub(super) enum ServerOp<'a> {
    /// Accepted (`running`/`queued` with a position) or a `duplicate`.
    Ack {
        /// Message id.
        id: &'a str,
        /// Session key.
        session: &'a str,
        /// `running`, `queued` or `duplicate`.
        state: &'a str,
        /// Messages of the session ahead of this one.
        #[serde(skip_serializing_if = "Option::is_none")]
        position: Option<usize>,
    },
    /// Refused.
    Reject {
        /// Message id.
        id: &'a str,
        /// Session key, when one could be built.
        #[serde(skip_serializing_if = "Option::is_none")]
        session: Option<&'a str>,
        /// `queue_full`, `overloaded`, `shutting_down`, `invalid`, `backpressure` or `storage`.
        reason: &'a str,
        /// Human-readable detail.
        detail: &'a str,
    },
    /// Typing indicator on or off.
    Typing {
        /// Session key.
        session: &'a str,
        /// Platform.
        platform: &'a str,
        /// Chat id.
        chat_id: &'a str,
        /// On or off.
        on: bool,
    },
    /// Terminal: the reply.
    // Written by `frame.rs`, which streams long texts; kept as the schema its tests check.
    #[allow(dead_code)]
    Reply {
        /// Message id.
        id: &'a str,
        /// Session key.
        session: &'a str,
        /// Reply text.
        text: &'a str,
        /// The agent's reply was longer than `--max-reply-bytes` and was cut.
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        truncated: bool,
    },
    /// The reply so far of a running turn (best effort; the terminal `reply` has it all).
    // Written by `frame.rs`, which streams long texts; kept as the schema its tests check.
    #[allow(dead_code)]
    Partial {
        /// Message id.
        id: &'a str,
        /// Session key.
        session: &'a str,
        /// The text so far.
        text: &'a str,
    },
    /// Terminal: cancelled.
    Cancelled {
        /// Message id.
        id: &'a str,
        /// Session key.
        session: &'a str,
        /// stopped, reset, interrupted, shutdown.
        reason: &'a str,
    },
    /// Terminal: failed.
    // Written by `frame.rs`, which streams long texts; kept as the schema its tests check.
    #[allow(dead_code)]
    Failed {
        /// Message id.
        id: &'a str,
        /// Session key.
        session: &'a str,
        /// What failed.
        error: &'a str,
    },
    /// Terminal: merged into another message's turn.
    Merged {
        /// Message id.
        id: &'a str,
        /// Session key.
        session: &'a str,
        /// The carrier message's id.
        into: &'a str,
    },
    /// A line that could not be acted on.
    Error {
        /// What was wrong.
        detail: &'a str,
    },
    /// Answer to ping.
    Pong,
}

/// Encodes a server op as one line, newline included.
pub(super) fn encode(op: &ServerOp<'_>) -> Vec<u8> {
    // Serializing these plain structs cannot fail; fall back to an error line regardless.
    let mut line = serde_json::to_vec(op)
        .unwrap_or_else(|_| br#"{"op":"error","detail":"encoding failed"}"#.to_vec());
    line.push(b'\n');
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_full_message() {
        let line = br#"{"op":"message","id":"m-1","platform":"telegram","chat_id":"42","chat_type":"group","user_id":"7","thread_id":null,"text":"hi"}"#;
        let Ok(ClientOp::Message(m)) = parse_line(line) else {
            panic!("not a message")
        };
        assert_eq!(m.id, "m-1");
        assert_eq!(m.chat_type, ChatType::Group);
        assert_eq!(m.user_id.as_deref(), Some("7"));
        assert_eq!(m.thread_id, None);
        assert_eq!((m.user_name, m.meta), (None, None));
        let line = br#"{"op":"message","id":"m","chat_id":"1","text":"x","user_id":"7","user_name":"Ann","meta":{"reply_to": "m0"}}"#;
        let Ok(ClientOp::Message(m)) = parse_line(line) else {
            panic!("not a message")
        };
        assert_eq!(m.user_name.as_deref(), Some("Ann"));
        assert_eq!(m.meta.as_deref(), Some(r#"{"reply_to":"m0"}"#));
        let e = parse_line(br#"{"op":"message","id":"m","chat_id":"1","text":"x","meta":[1]}"#);
        assert!(matches!(e, Err(LineError::Invalid { detail, .. }) if detail.starts_with("meta")));
    }

    #[test]
    fn platform_names_are_short_and_plain() {
        assert!(check_platform("telegram").is_ok());
        assert!(check_platform("my-bridge_2.0").is_ok());
        assert!(check_platform(&"a".repeat(64)).is_ok());
        assert!(check_platform(&"a".repeat(65)).is_err());
        assert!(check_platform("").is_err());
        assert!(check_platform("tele gram").is_err());
        assert!(check_platform("tg:1").is_err());
    }

    #[test]
    fn malformed_lines_are_errors_and_bad_fields_are_invalid_naming_the_field() {
        assert!(
            matches!(parse_line(b"{nope"), Err(LineError::Malformed(d)) if d.starts_with("invalid JSON"))
        );
        assert!(matches!(parse_line(b"[1]"), Err(LineError::Malformed(d)) if d.contains("object")));
        assert!(
            matches!(parse_line(br#"{"op":"dance"}"#), Err(LineError::Malformed(d)) if d.contains("unknown op"))
        );
        assert!(
            matches!(parse_line(br#"{"x":1}"#), Err(LineError::Malformed(d)) if d.contains("missing op"))
        );
        let e = parse_line(br#"{"op":"message","id":"m","text":"hi"}"#);
        assert_eq!(
            e,
            Err(LineError::Invalid {
                id: "m".into(),
                detail: "chat_id is required".into()
            })
        );
        let e = parse_line(br#"{"op":"message","id":"m","chat_id":42,"text":"hi"}"#);
        assert_eq!(
            e,
            Err(LineError::Invalid {
                id: "m".into(),
                detail: "chat_id must be a string".into()
            })
        );
        let e = parse_line(
            br#"{"op":"message","id":"m","chat_id":"1","text":"hi","chat_type":"room"}"#,
        );
        assert!(
            matches!(e, Err(LineError::Invalid { detail, .. }) if detail.starts_with("chat_type"))
        );
    }

    #[test]
    fn encodes_one_line_per_op() {
        let line = encode(&ServerOp::Ack {
            id: "m",
            session: "t:dm:1",
            state: "queued",
            position: Some(2),
        });
        assert_eq!(line, b"{\"op\":\"ack\",\"id\":\"m\",\"session\":\"t:dm:1\",\"state\":\"queued\",\"position\":2}\n");
        assert_eq!(encode(&ServerOp::Pong), b"{\"op\":\"pong\"}\n");
    }
}
