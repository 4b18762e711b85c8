//! Typed, bounded, lenient reading of platform answers (`/sync`, `getUpdates`): serde
//! structs that skip what the bridge does not use, collections that keep at most a fixed
//! number of items, and a malformed item that is counted and skipped instead of failing
//! the whole answer. Nothing here builds a `serde_json::Value` of the answer: a 31 MiB body
//! costs the body and the few items kept, not a tree of it.
//!
//! Every type here borrows raw JSON from the text it is parsed from, so they are read with
//! `serde_json::from_str` only (not from a reader or a `Value`, where every item would count
//! as malformed).

use std::fmt;
use std::marker::PhantomData;

use serde::Deserialize;
use serde::de::{DeserializeOwned, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

/// A value of type `T`, or `None` when it is absent or has another shape (a number where a
/// string belongs, …): the rest of the answer is read all the same.
#[derive(Debug)]
pub(crate) struct Lenient<T>(pub Option<T>);

impl<T> Default for Lenient<T> {
    fn default() -> Self {
        Lenient(None)
    }
}

impl<T> Lenient<T> {
    /// The value, when it had the right shape.
    pub(crate) fn get(&self) -> Option<&T> {
        self.0.as_ref()
    }
}

impl Lenient<String> {
    /// The string, when it was one.
    pub(crate) fn text(&self) -> Option<&str> {
        self.0.as_deref()
    }
}

/// Parses `raw` as a `T`; `None` when it is not one.
fn parse_raw<T: DeserializeOwned>(raw: &RawValue) -> Option<T> {
    serde_json::from_str(raw.get()).ok()
}

impl<'de, T: DeserializeOwned> Deserialize<'de> for Lenient<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // The raw text is borrowed from the answer (no copy); only a well-formed `T` is kept.
        let raw = <&'de RawValue>::deserialize(d)?;
        Ok(Lenient(parse_raw(raw)))
    }
}

/// A JSON list of `T` keeping at most `N` of them (the first ones): items past `N` are
/// skipped unread and counted in `over`, malformed ones counted in `malformed`. Anything but
/// a list reads as an empty one with `not_a_list` set.
#[derive(Debug)]
pub(crate) struct Capped<T, const N: usize> {
    /// The well-formed items kept, in order.
    pub items: Vec<T>,
    /// Items that were not a `T`.
    pub malformed: usize,
    /// Items past the first `N`, skipped.
    pub over: usize,
    /// The value was not a list at all.
    pub not_a_list: bool,
}

impl<T, const N: usize> Default for Capped<T, N> {
    fn default() -> Self {
        Capped {
            items: Vec::new(),
            malformed: 0,
            over: 0,
            not_a_list: false,
        }
    }
}

impl<T, const N: usize> Capped<T, N> {
    /// Malformed and skipped items together: what a per-answer warning reports.
    pub(crate) fn dropped(&self) -> usize {
        self.malformed + self.over
    }
}

/// Skips what a map holds; the visitor of anything that is not the wanted shape.
fn drain_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<(), A::Error> {
    while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
    Ok(())
}

/// Skips what a list holds.
fn drain_seq<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<(), A::Error> {
    while seq.next_element::<IgnoredAny>()?.is_some() {}
    Ok(())
}

/// Implements the `visit_*` of every JSON shape but one as "not that shape": `$out`.
macro_rules! other_shapes {
    ($out:expr) => {
        fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
            Ok($out)
        }
        fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
            Ok($out)
        }
        fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
            Ok($out)
        }
        fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
            Ok($out)
        }
        fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
            Ok($out)
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok($out)
        }
        fn visit_none<E>(self) -> Result<Self::Value, E> {
            Ok($out)
        }
    };
}

struct CappedVisitor<T, const N: usize>(PhantomData<T>);

impl<'de, T: DeserializeOwned, const N: usize> Visitor<'de> for CappedVisitor<T, N> {
    type Value = Capped<T, N>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = Capped::default();
        while out.items.len() + out.malformed < N {
            let Some(raw) = seq.next_element::<&'de RawValue>()? else {
                return Ok(out);
            };
            match parse_raw(raw) {
                Some(item) => out.items.push(item),
                None => out.malformed += 1,
            }
        }
        while seq.next_element::<IgnoredAny>()?.is_some() {
            out.over += 1;
        }
        debug_assert!(out.items.len() <= N);
        Ok(out)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        drain_map(map)?;
        Ok(Capped {
            not_a_list: true,
            ..Capped::default()
        })
    }

    other_shapes!(Capped {
        not_a_list: true,
        ..Capped::default()
    });
}

impl<'de, T: DeserializeOwned, const N: usize> Deserialize<'de> for Capped<T, N> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(CappedVisitor(PhantomData))
    }
}

/// A JSON object of `T` by key keeping at most `N` entries (the first ones): entries past
/// `N` are skipped unread and counted in `over`, malformed values counted in `malformed`.
/// Anything but an object reads as an empty one.
#[derive(Debug)]
pub(crate) struct CappedMap<T, const N: usize> {
    /// The well-formed entries kept, in the answer's order.
    pub entries: Vec<(String, T)>,
    /// Entries whose value was not a `T`.
    pub malformed: usize,
    /// Entries past the first `N`, skipped.
    pub over: usize,
}

impl<T, const N: usize> Default for CappedMap<T, N> {
    fn default() -> Self {
        CappedMap {
            entries: Vec::new(),
            malformed: 0,
            over: 0,
        }
    }
}

impl<T, const N: usize> CappedMap<T, N> {
    /// Malformed and skipped entries together: what a per-answer warning reports.
    pub(crate) fn dropped(&self) -> usize {
        self.malformed + self.over
    }
}

struct CappedMapVisitor<T, const N: usize>(PhantomData<T>);

impl<'de, T: DeserializeOwned, const N: usize> Visitor<'de> for CappedMapVisitor<T, N> {
    type Value = CappedMap<T, N>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = CappedMap::default();
        while out.entries.len() + out.malformed < N {
            let Some(key) = map.next_key::<String>()? else {
                return Ok(out);
            };
            match parse_raw(map.next_value::<&'de RawValue>()?) {
                Some(value) => out.entries.push((key, value)),
                None => out.malformed += 1,
            }
        }
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {
            out.over += 1;
        }
        debug_assert!(out.entries.len() <= N);
        Ok(out)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        drain_seq(seq)?;
        Ok(CappedMap::default())
    }

    other_shapes!(CappedMap::default());
}

impl<'de, T: DeserializeOwned, const N: usize> Deserialize<'de> for CappedMap<T, N> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(CappedMapVisitor(PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize, PartialEq)]
    struct Item {
        id: u32,
    }

    #[test]
    fn a_list_keeps_its_first_n_well_formed_items_and_counts_the_rest() {
        let list: Capped<Item, 3> =
            serde_json::from_str(r#"[{"id":1},{},{"id":"x"},{"id":2},{"id":3},[1],4]"#)
                .expect("parses");
        assert_eq!(list.items, [Item { id: 1 }]);
        assert_eq!((list.malformed, list.over, list.not_a_list), (2, 4, false));
        assert_eq!(list.dropped(), 6);
        let all: Capped<Item, 9> = serde_json::from_str(r#"[{"id":1},5,{"id":2}]"#).expect("ok");
        assert_eq!(all.items, [Item { id: 1 }, Item { id: 2 }]);
        assert_eq!((all.malformed, all.over), (1, 0));
    }

    #[test]
    fn anything_but_a_list_is_an_empty_one() {
        for text in [r#"{"a":[1]}"#, "5", "\"x\"", "null", "true", "-1", "1.5"] {
            let list: Capped<Item, 3> = serde_json::from_str(text).expect(text);
            assert!(list.items.is_empty() && list.not_a_list, "{text}");
        }
    }

    #[test]
    fn a_map_keeps_its_first_n_well_formed_entries_and_counts_the_rest() {
        let map: CappedMap<Item, 2> =
            serde_json::from_str(r#"{"a":{"id":1},"b":7,"c":{"id":3},"d":{},"e":{"id":5}}"#)
                .expect("parses");
        assert_eq!(map.entries, [("a".to_owned(), Item { id: 1 })]);
        assert_eq!((map.malformed, map.over), (1, 3));
        for text in ["[1,{}]", "5", "null"] {
            let map: CappedMap<Item, 2> = serde_json::from_str(text).expect(text);
            assert!(map.entries.is_empty() && map.dropped() == 0, "{text}");
        }
    }

    #[test]
    fn a_lenient_field_of_another_shape_is_none_and_the_rest_is_read() {
        #[derive(Deserialize)]
        struct Outer {
            #[serde(default)]
            name: Lenient<String>,
            #[serde(default)]
            inner: Lenient<Item>,
            n: u32,
        }
        let o: Outer = serde_json::from_str(r#"{"name":5,"inner":{"id":"no"},"n":3}"#).expect("ok");
        assert_eq!((o.name.text(), o.inner.get(), o.n), (None, None, 3));
        let o: Outer = serde_json::from_str(r#"{"name":"a","inner":{"id":4},"n":1}"#).expect("ok");
        assert_eq!(
            (o.name.text(), o.inner.get()),
            (Some("a"), Some(&Item { id: 4 }))
        );
        let o: Outer = serde_json::from_str(r#"{"n":2}"#).expect("ok");
        assert_eq!(o.name.text(), None);
    }
}
