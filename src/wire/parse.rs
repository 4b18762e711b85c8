//! The typed, borrowing parse of a client line.
//!
//! A line used to be built into a `serde_json::Value` (a `BTreeMap` per object, a `String`
//! per key and per value) and its fields cloned out of it: under a flood that was half of
//! the reactor's time. Here the same serde_json parser drives visitors that keep only the
//! fields the protocol reads, strings borrowed from the line when they have no escapes, and
//! build nothing for the rest.
//!
//! Every answer must stay what the `Value` parse gave (the error texts are the protocol's,
//! see `docs/protocol.md`), so the visitors walk the input exactly as `Value`'s own visitor
//! does — `deserialize_any` for every value, `deserialize_str` for every key — and never
//! fail: every syntax error (and its line and column), every number out of range, every bad
//! escape or nesting deeper than serde_json's limit is found by the same code at the same
//! byte. What is *not* used is `IgnoredAny`: serde_json skips those values with a laxer
//! scan (it accepts `1e400` and lone surrogates that `Value` refuses). The checks of the
//! fields run after the whole line parsed, in the old order. The test module holds the old
//! parser as an oracle (`tests/wire_oracle.rs`) and a proptest holding the two equal.

use std::borrow::Cow;
use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

use super::{ClientOp, LineError, MessageFields};
use crate::message::ChatType;

/// Parses one line (without its newline).
pub fn parse_line(line: &[u8]) -> Result<ClientOp, LineError> {
    let mut obj = Fields::default();
    let object =
        parse(line, &mut obj).map_err(|e| LineError::Malformed(format!("invalid JSON: {e}")))?;
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
        "may_use" => parse_may_use(&mut obj),
        "link" => {
            let up = match &obj.state {
                Field::Str(s) if s == "up" => true,
                Field::Str(s) if s == "down" => false,
                _ => {
                    return Err(LineError::Malformed(
                        "link: state must be \"up\" or \"down\"".into(),
                    ));
                }
            };
            let detail = match std::mem::take(&mut obj.detail) {
                Field::Absent | Field::Null => None,
                Field::Str(d) => Some(truncate(&d, super::LINK_DETAIL_MAX).to_owned()),
                _ => return Err(LineError::Malformed("link: detail must be a string".into())),
            };
            Ok(ClientOp::Link { up, detail })
        }
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
    let attachments = match obj.attachments.take() {
        None | Some(Value::Null) => Vec::new(),
        Some(v) => crate::attachments::parse_list(v).map_err(invalid)?,
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
        attachments,
    }))
}

/// The fields of a `may_use` query; a bad one is a malformed line (it has no message id).
fn parse_may_use(obj: &mut Fields<'_>) -> Result<ClientOp, LineError> {
    let bad = |what: &str| LineError::Malformed(format!("may_use: {what}"));
    let id = match std::mem::take(&mut obj.id) {
        Field::Str(id) if !id.is_empty() => id.into_owned(),
        _ => return Err(bad("id must be a non-empty string")),
    };
    let user_id = match std::mem::take(&mut obj.user_id) {
        Field::Str(u) => u.into_owned(),
        _ => return Err(bad("user_id must be a string")),
    };
    let optional = |f: Field<'_>, name: &str| match f {
        Field::Absent | Field::Null => Ok(None),
        Field::Str(s) => Ok(Some(s.into_owned())),
        _ => Err(bad(&format!("{name} must be a string or null"))),
    };
    let platform = optional(std::mem::take(&mut obj.platform), "platform")?;
    let chat_id = optional(std::mem::take(&mut obj.chat_id), "chat_id")?;
    Ok(ClientOp::MayUse {
        id,
        platform,
        user_id,
        chat_id,
    })
}

fn truncate(s: &str, max: usize) -> &str {
    match s.char_indices().nth(max) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// What a field of the line held, as far as the protocol looks. A key given twice keeps its
/// last value, as `Value`'s map did.
#[derive(Debug, Default)]
pub(super) enum Field<'a> {
    /// Not in the line.
    #[default]
    Absent,
    /// `null`.
    Null,
    /// A string: borrowed from the line unless it had escapes.
    Str(Cow<'a, str>),
    /// `true` or `false`.
    Bool(bool),
    /// Anything else: a number, an array, an object.
    Other,
}

/// The fields of a line the protocol reads; fields of other names are parsed and dropped.
/// Filled in place (it is a few hundred bytes: moving it per line showed in the profile).
#[derive(Debug, Default)]
pub(super) struct Fields<'a> {
    pub op: Field<'a>,
    pub id: Field<'a>,
    pub platform: Field<'a>,
    pub token: Field<'a>,
    pub acks: Field<'a>,
    pub chat_id: Field<'a>,
    pub chat_type: Field<'a>,
    pub user_id: Field<'a>,
    pub user_name: Field<'a>,
    pub thread_id: Field<'a>,
    pub text: Field<'a>,
    pub state: Field<'a>,
    pub detail: Field<'a>,
    /// `ids` if it is an array of strings; `None` if absent or anything else.
    pub ids: Option<Vec<Cow<'a, str>>>,
    /// `meta` as `Value` has it (rare; the agent gets it re-serialized, keys sorted).
    pub meta: Option<Value>,
    /// `attachments` as `Value` has it (rare; typed once the line parsed).
    pub attachments: Option<Value>,
}

/// Parses `line` as one JSON value into `fields`, the errors those of
/// `serde_json::from_slice::<Value>`; whether it was an object (else valid JSON of another
/// kind, and `fields` untouched).
pub(super) fn parse<'a>(
    line: &'a [u8],
    fields: &mut Fields<'a>,
) -> Result<bool, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(line);
    let object = (&mut de).deserialize_any(LineVisitor(fields))?;
    de.end()?;
    Ok(object)
}

struct LineVisitor<'f, 'de>(&'f mut Fields<'de>);

impl<'de> Visitor<'de> for LineVisitor<'_, 'de> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let fields = self.0;
        while let Some(key) = map.next_key_seed(Key)? {
            let slot = match &*key {
                "op" => &mut fields.op,
                "id" => &mut fields.id,
                "platform" => &mut fields.platform,
                "token" => &mut fields.token,
                "acks" => &mut fields.acks,
                "chat_id" => &mut fields.chat_id,
                "chat_type" => &mut fields.chat_type,
                "user_id" => &mut fields.user_id,
                "user_name" => &mut fields.user_name,
                "thread_id" => &mut fields.thread_id,
                "text" => &mut fields.text,
                "state" => &mut fields.state,
                "detail" => &mut fields.detail,
                "ids" => {
                    fields.ids = map.next_value_seed(Ids)?;
                    continue;
                }
                "meta" => {
                    fields.meta = Some(map.next_value::<Value>()?);
                    continue;
                }
                "attachments" => {
                    fields.attachments = Some(map.next_value::<Value>()?);
                    continue;
                }
                _ => {
                    map.next_value_seed(Skip)?;
                    continue;
                }
            };
            *slot = map.next_value_seed(Scalar)?;
        }
        Ok(true)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        Skip.visit_seq(seq)?;
        Ok(false)
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(false)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(false)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(false)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(false)
    }

    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(false)
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(false)
    }
}

/// A key, read as `Value`'s map reads its keys (`deserialize_str`).
struct Key;

impl<'de> DeserializeSeed<'de> for Key {
    type Value = Cow<'de, str>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(KeyVisitor)
    }
}

struct KeyVisitor;

impl<'de> Visitor<'de> for KeyVisitor {
    type Value = Cow<'de, str>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string key")
    }

    fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(s))
    }

    fn visit_str<E>(self, s: &str) -> Result<Self::Value, E> {
        // An escaped key: only a known name needs keeping, and none has escapes in its
        // canonical form, but `"\u006fp"` is `op` to `Value` too.
        Ok(Cow::Owned(s.to_owned()))
    }
}

/// A value whose content is dropped, walked as `Value` walks it.
struct Skip;

impl<'de> DeserializeSeed<'de> for Skip {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Skip {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while map.next_key_seed(SkipKey)?.is_some() {
            map.next_value_seed(Skip)?;
        }
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Skip)?.is_some() {}
        Ok(())
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }

    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }

    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }

    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }

    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
}

/// A key whose text is dropped (`deserialize_str`, as `Value` reads keys).
struct SkipKey;

impl<'de> DeserializeSeed<'de> for SkipKey {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_str(Skip)
    }
}

/// A field's value, classified.
struct Scalar;

impl<'de> DeserializeSeed<'de> for Scalar {
    type Value = Field<'de>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Scalar {
    type Value = Field<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Self::Value, E> {
        Ok(Field::Str(Cow::Borrowed(s)))
    }

    fn visit_str<E>(self, s: &str) -> Result<Self::Value, E> {
        Ok(Field::Str(Cow::Owned(s.to_owned())))
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Field::Null)
    }

    fn visit_bool<E>(self, b: bool) -> Result<Self::Value, E> {
        Ok(Field::Bool(b))
    }

    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(Field::Other)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(Field::Other)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(Field::Other)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        Skip.visit_map(map)?;
        Ok(Field::Other)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        Skip.visit_seq(seq)?;
        Ok(Field::Other)
    }
}

/// `ids`: its strings if it is an array of nothing else. Whatever it holds is walked in
/// full, as `Value` walks it.
struct Ids;

impl<'de> DeserializeSeed<'de> for Ids {
    type Value = Option<Vec<Cow<'de, str>>>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Ids {
    type Value = Option<Vec<Cow<'de, str>>>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        // Every element is walked even after a non-string: a syntax error further on
        // still wins over the field's error, as it did.
        let mut kept = Some(Vec::new());
        while let Some(e) = seq.next_element_seed(Scalar)? {
            match (e, &mut kept) {
                (Field::Str(s), Some(v)) => v.push(s),
                _ => kept = None,
            }
        }
        Ok(kept)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        Skip.visit_map(map)?;
        Ok(None)
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
}
