//! The duplicate window: (platform, message id) pairs accepted recently, so a bridge that
//! re-sends a message (a retry after a reconnect, a platform redelivery) does not run it twice.
//!
//! Entries are 64-bit SipHash fingerprints under a per-process random key: fixed-size entries
//! keep the map cheap to grow on the reactor (no string re-hashing), and a false match needs a
//! 64-bit collision (about 3e-8 with 10^6 ids remembered). Memory is bounded: past `max`
//! entries the oldest are forgotten early.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;
use std::time::Duration;

use crate::message::KeyHashBuilder;

/// A remembered (platform, id).
pub type Fingerprint = u64;

/// Recently accepted message ids, each remembered for `window`.
pub struct DedupWindow {
    window: Duration,
    max: usize,
    hasher: RandomState,
    until: HashMap<Fingerprint, Duration, KeyHashBuilder>,
    order: VecDeque<(Duration, Fingerprint)>,
}

impl DedupWindow {
    /// Remembers ids for `window`, at most `max` at a time.
    pub fn new(window: Duration, max: usize) -> DedupWindow {
        DedupWindow {
            window,
            max,
            hasher: RandomState::new(),
            until: HashMap::default(),
            order: VecDeque::new(),
        }
    }

    /// The fingerprint of a message id on a platform.
    pub fn fingerprint(&self, platform: &str, id: &str) -> Fingerprint {
        self.hasher.hash_one((platform, id))
    }

    /// Whether the id was accepted within the window before `now`.
    pub fn seen(&self, fp: Fingerprint, now: Duration) -> bool {
        self.until.get(&fp).is_some_and(|&until| until > now)
    }

    /// Remembers an accepted id from `now` on.
    pub fn remember(&mut self, fp: Fingerprint, now: Duration) {
        let until = now + self.window;
        self.until.insert(fp, until);
        self.order.push_back((until, fp));
        while self.order.len() > self.max {
            self.pop_oldest();
        }
    }

    /// Forgets an id that ended up refused, so that a retry is not mistaken for a duplicate.
    pub fn forget(&mut self, fp: Fingerprint) {
        self.until.remove(&fp);
    }

    /// Drops the ids whose window has passed.
    pub fn expire(&mut self, now: Duration) {
        while self.order.front().is_some_and(|(until, _)| *until <= now) {
            self.pop_oldest();
        }
    }

    fn pop_oldest(&mut self) {
        if let Some((until, fp)) = self.order.pop_front()
            && self.until.get(&fp) == Some(&until)
        {
            self.until.remove(&fp);
        }
    }

    /// Ids remembered now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.until.len()
    }

    /// True when nothing is remembered.
    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.until.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn an_id_is_a_duplicate_within_the_window_only() {
        let mut w = DedupWindow::new(600 * S, 100);
        let fp = w.fingerprint("telegram", "m-1");
        assert!(!w.seen(fp, S));
        w.remember(fp, S);
        assert!(w.seen(fp, 2 * S));
        assert!(w.seen(fp, 600 * S));
        assert!(!w.seen(fp, 601 * S), "still a duplicate after the window");
        w.expire(601 * S);
        assert!(w.is_empty());
    }

    #[test]
    fn ids_are_per_platform_and_a_refused_id_can_be_retried() {
        let mut w = DedupWindow::new(600 * S, 100);
        let tg = w.fingerprint("telegram", "7");
        let dc = w.fingerprint("discord", "7");
        w.remember(tg, S);
        assert!(!w.seen(dc, S));
        w.forget(tg);
        assert!(!w.seen(tg, S));
    }

    #[test]
    fn memory_is_bounded_by_forgetting_the_oldest() {
        let mut w = DedupWindow::new(600 * S, 3);
        let fps: Vec<_> = (0..5).map(|i| w.fingerprint("p", &i.to_string())).collect();
        for &fp in &fps {
            w.remember(fp, S);
        }
        assert_eq!(w.len(), 3);
        assert!(!w.seen(fps[0], S) && !w.seen(fps[1], S));
        assert!(fps[2..].iter().all(|&fp| w.seen(fp, S)));
    }
}
