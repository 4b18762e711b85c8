//! [`RecentIds`]: the bounded memory of result ids already handled.

use std::collections::{HashSet, VecDeque};

/// A bounded set of ids, oldest forgotten first.
#[derive(Debug)]
pub(crate) struct RecentIds {
    order: VecDeque<String>,
    set: HashSet<String>,
    capacity: usize,
}

impl RecentIds {
    /// Remembers at most `capacity` ids (at least one).
    pub(crate) fn new(capacity: usize) -> RecentIds {
        RecentIds {
            order: VecDeque::new(),
            set: HashSet::new(),
            capacity: capacity.max(1),
        }
    }

    /// Remembers `id`; returns false if it was already there.
    pub(crate) fn insert(&mut self, id: &str) -> bool {
        if self.set.contains(id) {
            return false;
        }
        if self.order.len() == self.capacity
            && let Some(old) = self.order.pop_front()
        {
            self.set.remove(&old);
        }
        self.order.push_back(id.to_owned());
        self.set.insert(id.to_owned());
        true
    }

    /// Whether `id` is remembered.
    pub(crate) fn contains(&self, id: &str) -> bool {
        self.set.contains(id)
    }

    /// Ids remembered.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.order.len()
    }
}
