//! The policy's state shared across a cluster (`--cluster`): what this instance changed is
//! handed, at most once a [`SYNC_EVERY_MS`], to a thread of its own ([`Sharer`]) that
//! merges it into the shared store (Redis: `cluster/access.rs`) per user — approvals and
//! denials by user, codes by code, rate tokens and day tokens as deltas — and pulls the
//! merged state back; the reactor takes that state at its next tick and re-applies on it
//! what it changed since. The reactor never waits on the store: a store that is down leaves
//! the local state in force (and the thread retries every period).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use super::state::{MAX_PENDING, MAX_TRACKED, Pending, PlatformState, Snapshot};

/// How often changes are pushed and the merged state pulled: a limit is exceeded across the
/// cluster by at most what the instances admit within this long (docs/access.md).
pub(crate) const SYNC_EVERY_MS: u64 = 1000;

/// One platform's changes since the state last came from the store.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct PlatformChanges {
    /// Users approved (`true`) or denied (`false`) here.
    pub(crate) verdicts: BTreeMap<String, bool>,
    /// Codes given here.
    pub(crate) codes_added: Vec<Pending>,
    /// Codes gone here (approved, or their user allowed or denied).
    pub(crate) codes_removed: BTreeSet<String>,
    /// Rate tokens taken here per user, with the user's rate (count, per ms) to refill by.
    pub(crate) taken: BTreeMap<String, (u32, u32, u64)>,
    /// Tokens spent here per user on `(day, n)`.
    pub(crate) spent: BTreeMap<String, (u64, u64)>,
}

impl PlatformChanges {
    fn is_empty(&self) -> bool {
        *self == PlatformChanges::default()
    }
}

/// Changes per platform.
pub(crate) type Changes = BTreeMap<String, PlatformChanges>;

/// Where the shared state lives: one call pushes `changes` and answers the merged state
/// (approved, denied, pending, buckets and today's tokens; the rest is left default). Runs
/// on the [`Sharer`]'s thread only.
pub(crate) trait SharedStore: Send {
    fn sync(&mut self, changes: &Changes, now_ms: u64) -> Result<Snapshot, String>;
}

type Slot<T> = Arc<(Mutex<Option<T>>, Condvar)>;

/// The reactor's end: changes handed out, merged states taken in; each slot holds one.
pub(crate) struct Sharer {
    out: Slot<Changes>,
    back: Arc<Mutex<Option<Snapshot>>>,
}

impl Sharer {
    pub(crate) fn start(mut store: Box<dyn SharedStore>) -> std::io::Result<Sharer> {
        let out: Slot<Changes> = Arc::default();
        let back: Arc<Mutex<Option<Snapshot>>> = Arc::default();
        let (out2, back2) = (Arc::clone(&out), Arc::clone(&back));
        std::thread::Builder::new()
            .name("access-share".into())
            .spawn(move || share_loop(store.as_mut(), &out2, &back2))?;
        Ok(Sharer { out, back })
    }

    /// Hands `changes` out, merged into any the thread has not taken yet.
    pub(crate) fn offer(&self, changes: Changes) {
        let (lock, cv) = &*self.out;
        if let Ok(mut slot) = lock.lock() {
            merge_changes(slot.get_or_insert_with(Changes::default), changes);
            cv.notify_one();
        }
    }

    /// The newest merged state, if one came since the last call.
    pub(crate) fn take_merged(&self) -> Option<Snapshot> {
        self.back.lock().ok().and_then(|mut s| s.take())
    }
}

/// Adds `newer` to `into` (a newer verdict wins; counts add up). Bounded as the state is,
/// however long the store is down: codes by [`MAX_PENDING`] (the newest kept), users whose
/// counts wait by [`MAX_TRACKED`] (past it a new user's count stays local only).
fn merge_changes(into: &mut Changes, newer: Changes) {
    for (platform, c) in newer {
        let p = into.entry(platform).or_default();
        p.verdicts.extend(c.verdicts);
        for code in c.codes_added {
            if !p.codes_added.iter().any(|q| q.code == code.code) {
                p.codes_added.push(code);
            }
        }
        p.codes_added
            .sort_by_key(|q| std::cmp::Reverse(q.expires_ms));
        p.codes_added.truncate(MAX_PENDING);
        p.codes_removed.extend(c.codes_removed);
        // A code given and gone while the store was away is not given again.
        p.codes_added.retain(|q| !p.codes_removed.contains(&q.code));
        for (user, (n, count, per)) in c.taken {
            if p.taken.len() < MAX_TRACKED || p.taken.contains_key(&user) {
                let t = p.taken.entry(user).or_insert((0, count, per));
                t.0 = t.0.saturating_add(n);
            }
        }
        for (user, (day, n)) in c.spent {
            if p.spent.len() < MAX_TRACKED || p.spent.contains_key(&user) {
                let s = p.spent.entry(user).or_insert((day, 0));
                *s = if s.0 == day {
                    (day, s.1.saturating_add(n))
                } else {
                    (day, n)
                };
            }
        }
        debug_assert!(p.codes_added.len() <= MAX_PENDING && p.taken.len() <= MAX_TRACKED);
    }
}

fn share_loop(store: &mut dyn SharedStore, out: &Slot<Changes>, back: &Mutex<Option<Snapshot>>) {
    let mut failing = false;
    // Until the policy (the reactor's end) is gone.
    while Arc::strong_count(out) > 1 {
        let changes = {
            let Ok(slot) = out.0.lock() else { return };
            let Ok((mut slot, _)) = out
                .1
                .wait_timeout(slot, Duration::from_millis(SYNC_EVERY_MS))
            else {
                return;
            };
            slot.take().unwrap_or_default()
        };
        match store.sync(&changes, crate::journal::now_ms()) {
            Ok(merged) => {
                if failing {
                    log::info!("access: the shared state is reachable again");
                }
                failing = false;
                if let Ok(mut b) = back.lock() {
                    *b = Some(merged);
                }
            }
            Err(e) => {
                if !failing {
                    // Once per outage: the thread retries every period.
                    log::warn!(
                        "access: cannot sync the shared state: {e}; the local state stays in force"
                    );
                }
                failing = true;
                // Not lost: pushed again with the next ones.
                if let Ok(mut slot) = out.0.lock() {
                    let mut again = changes;
                    if let Some(newer) = slot.take() {
                        merge_changes(&mut again, newer);
                    }
                    *slot = Some(again);
                }
            }
        }
    }
}

/// What `now` changed against `base` (the state as the store last gave it), with the rate
/// tokens and day tokens not handed out yet (which it resets); `rate` gives a platform's
/// user rate (count, per ms).
pub(crate) fn changes_since(
    base: &Snapshot,
    now: &mut Snapshot,
    rate: impl Fn(&str) -> Option<(u32, u64)>,
) -> Changes {
    let mut all = Changes::new();
    let empty = PlatformState::default();
    for (platform, st) in &mut now.platforms {
        let was = base.platforms.get(platform).unwrap_or(&empty);
        let mut c = PlatformChanges::default();
        for u in st.approved.difference(&was.approved) {
            c.verdicts.insert(u.clone(), true);
        }
        for u in st.denied.difference(&was.denied) {
            c.verdicts.insert(u.clone(), false);
        }
        c.codes_added = (st.pending.iter())
            .filter(|p| !was.pending.iter().any(|q| q.code == p.code))
            .cloned()
            .collect();
        c.codes_removed = (was.pending.iter())
            .filter(|q| !st.pending.iter().any(|p| p.code == q.code))
            .map(|q| q.code.clone())
            .collect();
        if let Some((count, per_ms)) = rate(platform) {
            for (user, b) in &mut st.buckets {
                if b.taken > 0 {
                    c.taken.insert(user.clone(), (b.taken, count, per_ms));
                    b.taken = 0;
                }
            }
        }
        for (user, t) in &mut st.tokens {
            if t.unpushed > 0 {
                c.spent.insert(user.clone(), (t.day, t.unpushed));
                t.unpushed = 0;
            }
        }
        if !c.is_empty() {
            all.insert(platform.clone(), c);
        }
    }
    all
}

/// The state after `merged` came from the store: `merged`'s approvals, denials, codes,
/// buckets and tokens, with what `now` changed against `base` since (not yet in `merged`)
/// applied again on it; notices and refusal counts stay this instance's.
pub(crate) fn rebase(base: &Snapshot, now: &Snapshot, merged: &Snapshot) -> Snapshot {
    let mut out = now.clone();
    let empty = PlatformState::default();
    let platforms: BTreeSet<&String> = now
        .platforms
        .keys()
        .chain(merged.platforms.keys())
        .collect();
    for platform in platforms {
        let was = base.platforms.get(platform).unwrap_or(&empty);
        let st = now.platforms.get(platform).unwrap_or(&empty);
        let m = merged.platforms.get(platform).unwrap_or(&empty);
        let o = out.platforms.entry(platform.clone()).or_default();
        o.approved = m.approved.clone();
        o.denied = m.denied.clone();
        for u in st.approved.difference(&was.approved) {
            o.denied.remove(u);
            o.approved.insert(u.clone());
        }
        for u in st.denied.difference(&was.denied) {
            o.approved.remove(u);
            o.denied.insert(u.clone());
        }
        o.pending = m.pending.clone();
        // Codes gone here since the store's last word stay gone.
        o.pending.retain(|p| {
            !was.pending.iter().any(|q| q.code == p.code)
                || st.pending.iter().any(|q| q.code == p.code)
        });
        for p in &st.pending {
            if !was.pending.iter().any(|q| q.code == p.code) && !o.pending.contains(p) {
                o.pending.push(p.clone());
            }
        }
        for (user, b) in &m.buckets {
            let mine = st.buckets.get(user).map_or(0, |b| b.taken);
            let mut b = *b;
            b.tokens -= f64::from(mine);
            b.taken = mine;
            o.buckets.insert(user.clone(), b);
        }
        for (user, t) in &m.tokens {
            let mine = st
                .tokens
                .get(user)
                .filter(|u| u.day == t.day)
                .map_or(0, |u| u.unpushed);
            let mut t = *t;
            t.used = t.used.saturating_add(mine);
            t.unpushed = mine;
            o.tokens.insert(user.clone(), t);
        }
        o.trim();
        o.check();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(platform: &str, st: PlatformState) -> Snapshot {
        let mut s = Snapshot::default();
        s.platforms.insert(platform.to_owned(), st);
        s
    }

    #[test]
    fn a_merge_takes_the_stores_word_and_keeps_what_changed_here_since() {
        // The store's last word: a code of bob's, pending.
        let mut was = PlatformState::default();
        let code = was.code_for("bob", 0).expect("room");
        let base = one("m", was.clone());
        // Here since: carol allowed (not yet in the store).
        let mut now = was.clone();
        now.allow("carol").expect("room");
        // The store now: bob approved elsewhere (his code gone), dave denied elsewhere.
        let mut merged = PlatformState::default();
        merged.approved.insert("bob".into());
        merged.denied.insert("dave".into());
        let out = rebase(&base, &one("m", now.clone()), &one("m", merged.clone()));
        let st = &out.platforms["m"];
        assert!(st.approved.contains("bob") && st.approved.contains("carol"));
        assert!(st.denied.contains("dave"));
        assert!(
            st.pending.iter().all(|p| p.code != code),
            "bob's code is gone"
        );
        // What is handed out next is carol only: bob and dave came from the store.
        let mut after = out.clone();
        let c = changes_since(&one("m", merged), &mut after, |_| None);
        assert_eq!(
            c["m"].verdicts,
            BTreeMap::from([("carol".to_owned(), true)])
        );
    }

    #[test]
    fn rate_tokens_taken_here_are_handed_out_once_and_count_against_the_stores_bucket() {
        let mut now = one("m", PlatformState::default());
        let st = now.platforms.get_mut("m").expect("platform");
        for _ in 0..2 {
            st.take_token("u", 5, 60_000, 0).expect("a token");
        }
        let c = changes_since(&Snapshot::default(), &mut now, |_| Some((5, 60_000)));
        assert_eq!(c["m"].taken["u"], (2, 5, 60_000));
        let again = changes_since(&Snapshot::default(), &mut now, |_| Some((5, 60_000)));
        assert!(!again.contains_key("m"), "handed out once: {again:?}");
        // One more taken here, not handed out; the store says another instance left 1.0.
        let st = now.platforms.get_mut("m").expect("platform");
        st.take_token("u", 5, 60_000, 0).expect("a token");
        let mut store = PlatformState::default();
        store.buckets.insert(
            "u".into(),
            super::super::state::Bucket {
                tokens: 1.0,
                at_ms: 0,
                taken: 0,
            },
        );
        let out = rebase(&Snapshot::default(), &now, &one("m", store));
        let b = out.platforms["m"].buckets["u"];
        assert_eq!(
            (b.tokens, b.taken),
            (0.0, 1),
            "the store's 1.0 less the take made here"
        );
    }

    #[test]
    fn day_tokens_spent_here_are_handed_out_once_and_added_to_the_stores_count() {
        let mut now = one("m", PlatformState::default());
        let st = now.platforms.get_mut("m").expect("platform");
        st.charge("u", 300, 7);
        let c = changes_since(&Snapshot::default(), &mut now, |_| None);
        assert_eq!(c["m"].spent["u"], (7, 300));
        assert!(!changes_since(&Snapshot::default(), &mut now, |_| None).contains_key("m"));
        // 50 more here, not handed out; the store counts 1000 (this 300 and others' 700).
        let st = now.platforms.get_mut("m").expect("platform");
        st.charge("u", 50, 7);
        let mut store = PlatformState::default();
        store.charge("u", 1000, 7);
        store.tokens.get_mut("u").expect("count").unpushed = 0;
        let out = rebase(&Snapshot::default(), &now, &one("m", store));
        assert_eq!(out.platforms["m"].tokens_on("u", 7), 1050);
        assert_eq!(out.platforms["m"].tokens["u"].unpushed, 50);
    }

    #[test]
    fn changes_kept_through_an_outage_are_bounded() {
        let mut into = Changes::new();
        for i in 0..3 * MAX_PENDING as u64 {
            let mut c = PlatformChanges::default();
            c.codes_added.push(Pending {
                code: format!("C{}", i % (2 * MAX_PENDING as u64)),
                user: format!("u{i}"),
                expires_ms: i,
            });
            merge_changes(&mut into, Changes::from([("m".to_owned(), c)]));
        }
        assert_eq!(into["m"].codes_added.len(), MAX_PENDING);
    }
}
