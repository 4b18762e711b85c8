//! Generational keys: one id type for every table whose slots are reused (sessions,
//! connections, routes), so a stale reference to a freed slot can never reach its next
//! occupant.
//!
//! A [`Key`] is a slot index plus the generation of the entry that was there when the key
//! was made; [`Slots`] bumps a slot's generation whenever its entry is removed, and every
//! lookup compares it.

use std::ops::{Index, IndexMut};

use slab::Slab;

/// A slot index and its generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    index: u32,
    generation: u32,
}

impl Key {
    /// The slot index (dense, reused).
    pub fn index(self) -> usize {
        self.index as usize
    }

    /// The key packed in 64 bits (generation high, index low), e.g. for a `mio::Token`.
    pub fn to_bits(self) -> u64 {
        (u64::from(self.generation) << 32) | u64::from(self.index)
    }

    /// The key packed by [`Key::to_bits`].
    pub fn from_bits(bits: u64) -> Key {
        Key {
            index: bits as u32,
            generation: (bits >> 32) as u32,
        }
    }
}

impl std::fmt::Display for Key {
    /// `index.generation`, e.g. in log lines (`connection 3.1`).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.index, self.generation)
    }
}

/// A slab whose entries are addressed by generational [`Key`]s.
#[derive(Debug)]
pub struct Slots<T> {
    entries: Slab<(u32, T)>,
    /// Per slot index, the generation its next entry gets.
    generations: Vec<u32>,
}

impl<T> Default for Slots<T> {
    fn default() -> Self {
        Slots {
            entries: Slab::new(),
            generations: Vec::new(),
        }
    }
}

impl<T> Slots<T> {
    /// An empty table.
    pub fn new() -> Slots<T> {
        Slots::default()
    }

    /// Stores `value`; its key is unlike any key this table handed out for that slot before.
    ///
    /// # Panics
    /// If more than `u32::MAX` slots are in use at once.
    pub fn insert(&mut self, value: T) -> Key {
        let entry = self.entries.vacant_entry();
        let index = entry.key();
        if self.generations.len() <= index {
            self.generations.resize(index + 1, 0);
        }
        let generation = self.generations[index];
        entry.insert((generation, value));
        let index = u32::try_from(index).expect("fewer than 2^32 slots");
        Key { index, generation }
    }

    /// The entry of `key`, unless it was removed since.
    pub fn get(&self, key: Key) -> Option<&T> {
        match self.entries.get(key.index()) {
            Some((generation, value)) if *generation == key.generation => Some(value),
            _ => None,
        }
    }

    /// The entry of `key`, mutably, unless it was removed since.
    pub fn get_mut(&mut self, key: Key) -> Option<&mut T> {
        match self.entries.get_mut(key.index()) {
            Some((generation, value)) if *generation == key.generation => Some(value),
            _ => None,
        }
    }

    /// Whether `key` still names an entry.
    pub fn contains(&self, key: Key) -> bool {
        self.get(key).is_some()
    }

    /// Removes and returns the entry of `key`; its slot's next entry gets a new generation.
    pub fn remove(&mut self, key: Key) -> Option<T> {
        if !self.contains(key) {
            return None;
        }
        let (_, value) = self.entries.remove(key.index());
        self.generations[key.index()] = key.generation.wrapping_add(1);
        Some(value)
    }

    /// Entries stored.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Every entry with its key.
    pub fn iter(&self) -> impl Iterator<Item = (Key, &T)> + '_ {
        self.entries.iter().map(|(index, (generation, value))| {
            let key = Key {
                index: index as u32,
                generation: *generation,
            };
            (key, value)
        })
    }

    /// Every key.
    pub fn keys(&self) -> impl Iterator<Item = Key> + '_ {
        self.iter().map(|(key, _)| key)
    }
}

impl<'a, T> IntoIterator for &'a Slots<T> {
    type Item = (Key, &'a T);
    type IntoIter = Box<dyn Iterator<Item = (Key, &'a T)> + 'a>;
    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

impl<T> Index<Key> for Slots<T> {
    type Output = T;

    /// # Panics
    /// If `key`'s entry was removed: callers index only with keys they know are live.
    fn index(&self, key: Key) -> &T {
        self.get(key).expect("a live key")
    }
}

impl<T> IndexMut<Key> for Slots<T> {
    fn index_mut(&mut self, key: Key) -> &mut T {
        self.get_mut(key).expect("a live key")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stale_key_never_reaches_the_slots_next_entry() {
        let mut t = Slots::new();
        let a = t.insert("a");
        assert_eq!(t.remove(a), Some("a"));
        let b = t.insert("b");
        assert_eq!(a.index(), b.index(), "the slot is reused");
        assert_ne!(a, b);
        assert_eq!(t.get(a), None);
        assert_eq!(t.remove(a), None);
        assert_eq!(t[b], "b");
        assert_eq!(t.len(), 1);
        assert_eq!(Key::from_bits(b.to_bits()), b);
        assert_eq!(t.iter().collect::<Vec<_>>(), vec![(b, &"b")]);
    }
}
