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
//! parser as an oracle and a proptest holding the two equal.

use std::borrow::Cow;
use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

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
    /// An array, kept only for `ids`: its strings, or `None` if one element was not one.
    Strings(Option<Vec<Cow<'a, str>>>),
    /// An object, kept only for `meta`: the value itself, re-serialized by the caller.
    Object(Value),
    /// Anything else (a number; an array or object where none is kept).
    Other,
}

/// The fields of a line the protocol reads. Fields of other names are parsed and dropped.
#[derive(Debug, Default)]
pub(super) struct Fields<'a> {
    pub op: Field<'a>,
    pub id: Field<'a>,
    pub platform: Field<'a>,
    pub token: Field<'a>,
    pub acks: Field<'a>,
    pub ids: Field<'a>,
    pub chat_id: Field<'a>,
    pub chat_type: Field<'a>,
    pub user_id: Field<'a>,
    pub user_name: Field<'a>,
    pub meta: Field<'a>,
    pub thread_id: Field<'a>,
    pub text: Field<'a>,
}

/// Parses `line` as one JSON value, the errors those of `serde_json::from_slice::<Value>`:
/// its fields if it is an object, `None` if it is valid JSON of another kind.
pub(super) fn parse(line: &[u8]) -> Result<Option<Fields<'_>>, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(line);
    let parsed = (&mut de).deserialize_any(LineVisitor)?;
    de.end()?;
    Ok(parsed)
}

struct LineVisitor;

impl<'de> Visitor<'de> for LineVisitor {
    type Value = Option<Fields<'de>>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut fields = Fields::default();
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
                "ids" => {
                    fields.ids = map.next_value_seed(Scalar { strings: true })?;
                    continue;
                }
                "meta" => {
                    // Rare, and kept as `Value` re-serializes it (sorted keys, compact).
                    fields.meta = match map.next_value::<Value>()? {
                        Value::Null => Field::Null,
                        v @ Value::Object(_) => Field::Object(v),
                        _ => Field::Other,
                    };
                    continue;
                }
                _ => {
                    map.next_value_seed(Skip)?;
                    continue;
                }
            };
            *slot = map.next_value_seed(Scalar { strings: false })?;
        }
        Ok(Some(fields))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        Skip.visit_seq(seq)?;
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

/// A field's value, classified; with `strings`, an array's strings are kept (for `ids`).
struct Scalar {
    strings: bool,
}

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

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        if !self.strings {
            Skip.visit_seq(seq)?;
            return Ok(Field::Other);
        }
        // Every element is walked even after a non-string: a syntax error further on
        // still wins over the field's error, as it did.
        let mut kept = Some(Vec::new());
        while let Some(e) = seq.next_element_seed(Scalar { strings: false })? {
            match (e, &mut kept) {
                (Field::Str(s), Some(v)) => v.push(s),
                _ => kept = None,
            }
        }
        Ok(Field::Strings(kept))
    }
}
