//! [`FairQueue`]: outgoing work in one queue per chat (per target on IRC), served
//! round-robin, so one chat's long reply cannot hold another chat's first line behind it.

use std::collections::{HashMap, VecDeque};

/// Items queued per key; [`pop`](FairQueue::pop) takes one item of each key in turn (a key
/// new to the queue joins the end of the round).
#[derive(Debug)]
pub(crate) struct FairQueue<T> {
    queues: HashMap<String, VecDeque<T>>,
    /// Keys with items, in the order they are served next.
    round: VecDeque<String>,
    len: usize,
}

impl<T> Default for FairQueue<T> {
    fn default() -> Self {
        FairQueue {
            queues: HashMap::new(),
            round: VecDeque::new(),
            len: 0,
        }
    }
}

impl<T> FairQueue<T> {
    /// Queues `item` behind `key`'s others.
    pub(crate) fn push(&mut self, key: &str, item: T) {
        match self.queues.get_mut(key) {
            Some(q) => q.push_back(item),
            None => {
                self.queues.insert(key.to_owned(), VecDeque::from([item]));
                self.round.push_back(key.to_owned());
            }
        }
        self.len += 1;
    }

    /// Puts `item` back first of all (an item taken and not sent).
    pub(crate) fn push_front(&mut self, key: &str, item: T) {
        match self.queues.get_mut(key) {
            Some(q) => {
                q.push_front(item);
                if let Some(at) = self.round.iter().position(|k| k == key)
                    && let Some(k) = self.round.remove(at)
                {
                    self.round.push_front(k);
                }
            }
            None => {
                self.queues.insert(key.to_owned(), VecDeque::from([item]));
                self.round.push_front(key.to_owned());
            }
        }
        self.len += 1;
    }

    /// Puts `item` first among `key`'s items without changing whose turn it is (the rest of
    /// a long item sent in parts: the other keys go in between).
    pub(crate) fn push_next(&mut self, key: &str, item: T) {
        match self.queues.get_mut(key) {
            Some(q) => q.push_front(item),
            None => {
                self.queues.insert(key.to_owned(), VecDeque::from([item]));
                self.round.push_back(key.to_owned());
            }
        }
        self.len += 1;
    }

    /// The next item: the first of the key whose turn it is; that key goes to the end of
    /// the round.
    pub(crate) fn pop(&mut self) -> Option<T> {
        let key = self.round.pop_front()?;
        let q = self.queues.get_mut(&key)?;
        let item = q.pop_front();
        if q.is_empty() {
            self.queues.remove(&key);
        } else {
            self.round.push_back(key);
        }
        if item.is_some() {
            self.len -= 1;
        }
        item
    }

    /// Items queued in all.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is queued.
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_served_in_turn_and_a_new_key_waits_one_round_at_most() {
        let mut q = FairQueue::default();
        for i in 0..60 {
            q.push("alice", format!("a{i}"));
        }
        assert_eq!(q.pop().as_deref(), Some("a0"));
        q.push("bob", "b0".to_owned());
        q.push("bob", "b1".to_owned());
        let next: Vec<String> = (0..4).filter_map(|_| q.pop()).collect();
        assert_eq!(next, ["a1", "b0", "a2", "b1"]);
        assert_eq!(q.len(), 57);
        q.push_front("alice", "again".to_owned());
        assert_eq!(q.pop().as_deref(), Some("again"));
        let rest: Vec<String> = std::iter::from_fn(|| q.pop()).collect();
        assert_eq!(rest.len(), 57);
        assert!(q.is_empty());
    }
}
