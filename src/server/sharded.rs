//! A map keyed by `u64`, split into shards so that it grows a shard at a time.
//!
//! A `HashMap` grows by rehashing every entry at once: at a million entries that is tens of
//! milliseconds on the reactor. Split 64 ways by the key's low bits, each growth moves a
//! sixty-fourth of the entries, well under a millisecond. Keys must spread over their low
//! bits (sequential tags and hash fingerprints both do).

use std::collections::HashMap;

use crate::message::KeyHashBuilder;

const SHARDS: usize = 64;

/// A `u64`-keyed map in 64 shards.
pub(super) struct Sharded<V> {
    shards: Vec<HashMap<u64, V, KeyHashBuilder>>,
    len: usize,
}

/// The shard of a key.
pub(super) fn shard_of(key: u64) -> usize {
    (key % SHARDS as u64) as usize
}

impl<V> Default for Sharded<V> {
    fn default() -> Self {
        Sharded {
            shards: (0..SHARDS).map(|_| HashMap::default()).collect(),
            len: 0,
        }
    }
}

impl<V> Sharded<V> {
    /// The value of `key`.
    pub(super) fn get(&self, key: &u64) -> Option<&V> {
        self.shards[shard_of(*key)].get(key)
    }

    /// The value of `key`, to change.
    pub(super) fn get_mut(&mut self, key: &u64) -> Option<&mut V> {
        self.shards[shard_of(*key)].get_mut(key)
    }

    /// Sets `key`; returns its previous value.
    pub(super) fn insert(&mut self, key: u64, value: V) -> Option<V> {
        let old = self.shards[shard_of(key)].insert(key, value);
        if old.is_none() {
            self.len += 1;
        }
        old
    }

    /// Takes `key` out.
    pub(super) fn remove(&mut self, key: &u64) -> Option<V> {
        let old = self.shards[shard_of(*key)].remove(key);
        if old.is_some() {
            self.len -= 1;
        }
        old
    }

    /// Whether `key` is present.
    pub(super) fn contains_key(&self, key: &u64) -> bool {
        self.get(key).is_some()
    }

    /// Entries.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every value, in no order.
    pub(super) fn values(&self) -> impl Iterator<Item = &V> {
        self.shards.iter().flat_map(HashMap::values)
    }

    /// Every entry, in no order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (u64, &V)> {
        self.shards.iter().flatten().map(|(k, v)| (*k, v))
    }

    /// Takes every entry out.
    pub(super) fn drain(&mut self) -> Vec<(u64, V)> {
        self.len = 0;
        self.shards.iter_mut().flat_map(|s| s.drain()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn behaves_as_one_map() {
        let mut m: Sharded<u64> = Sharded::default();
        for k in 0..1000 {
            assert_eq!(m.insert(k, k * 2), None);
        }
        assert_eq!(m.insert(5, 0), Some(10));
        assert_eq!(m.len(), 1000);
        assert_eq!(m.get(&7), Some(&14));
        *m.get_mut(&7).unwrap() = 1;
        assert_eq!(m.remove(&7), Some(1));
        assert_eq!(m.remove(&7), None);
        assert!(!m.contains_key(&7) && m.contains_key(&8));
        assert_eq!(m.values().count(), 999);
        assert_eq!(m.drain().len(), 999);
        assert!(m.is_empty());
    }
}
