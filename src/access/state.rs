//! What the policy remembers per platform — approved and denied users, pending pairing
//! codes, rate buckets, when each user last got a notice — each bounded, and its durable
//! form (`access.json` beside the journal).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::{Deserialize, Serialize};

/// Users one platform remembers as approved or denied; past it `!allow`/`!approve` answer
/// that the list is full.
pub(crate) const MAX_USERS: usize = 10_000;
/// Pairing codes pending on one platform; past it a stranger gets a notice without a code
/// (try later) until codes expire or are approved.
pub(crate) const MAX_PENDING: usize = 100;
/// How long a pairing code stays valid.
pub(crate) const CODE_TTL_MS: u64 = 3600 * 1000;
/// Users whose rate bucket and last notice one platform tracks; past it the least recently
/// seen is forgotten (a forgotten bucket starts full again).
pub(crate) const MAX_TRACKED: usize = 10_000;
/// A user gets at most one notice (and one new code) per this long; messages in between are
/// ignored without a word.
pub(crate) const NOTICE_EVERY_MS: u64 = 60 * 1000;

/// A pairing code waiting for an admin.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Pending {
    pub(crate) code: String,
    pub(crate) user: String,
    pub(crate) expires_ms: u64,
}

/// One UTC day's length.
pub(crate) const DAY_MS: u64 = 86_400_000;

/// The tokens a user's turns used on one UTC day (days since the epoch).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct DayTokens {
    pub(crate) day: u64,
    pub(crate) used: u64,
    /// Of `used`, what this instance counted and has not handed to the shared store yet
    /// (`--cluster`; `shared.rs`).
    #[serde(skip)]
    pub(crate) unpushed: u64,
}

/// A user's token bucket: `tokens` at `at_ms` (refilled continuously).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct Bucket {
    pub(crate) tokens: f64,
    pub(crate) at_ms: u64,
    /// Tokens this instance took and has not handed to the shared store yet (`--cluster`;
    /// `shared.rs`).
    #[serde(skip)]
    pub(crate) taken: u32,
}

/// One platform's state. Serialized as is into `access.json`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct PlatformState {
    pub(crate) approved: BTreeSet<String>,
    pub(crate) denied: BTreeSet<String>,
    pub(crate) pending: Vec<Pending>,
    pub(crate) buckets: HashMap<String, Bucket>,
    /// When each user last got a notice (ms).
    pub(crate) noticed: HashMap<String, u64>,
    /// Notices answered, by kind (for the status).
    #[serde(default)]
    pub(crate) refused: BTreeMap<String, u64>,
    /// Tokens each user spent on their latest day (`tokens-per-day`).
    #[serde(default)]
    pub(crate) tokens: HashMap<String, DayTokens>,
}

impl PlatformState {
    /// Drops expired codes.
    pub(crate) fn expire(&mut self, now_ms: u64) {
        self.pending.retain(|p| p.expires_ms > now_ms);
    }

    /// The pending code of `user`, minting one if there is room (`None`: full).
    pub(crate) fn code_for(&mut self, user: &str, now_ms: u64) -> Option<String> {
        self.expire(now_ms);
        if let Some(p) = self.pending.iter().find(|p| p.user == user) {
            return Some(p.code.clone());
        }
        if self.pending.len() >= MAX_PENDING {
            return None;
        }
        let code = loop {
            let c = new_code();
            if !self.pending.iter().any(|p| p.code == c) {
                break c;
            }
        };
        self.pending.push(Pending {
            code: code.clone(),
            user: user.to_owned(),
            expires_ms: now_ms + CODE_TTL_MS,
        });
        debug_assert!(self.pending.len() <= MAX_PENDING);
        Some(code)
    }

    /// Approves the user of `code` (case and dashes ignored); their user id.
    pub(crate) fn approve_code(&mut self, code: &str, now_ms: u64) -> Result<String, String> {
        self.expire(now_ms);
        let code: String = code
            .chars()
            .filter(|c| c.is_ascii_alphanumeric())
            .map(|c| c.to_ascii_uppercase())
            .collect();
        let i = self
            .pending
            .iter()
            .position(|p| p.code == code)
            .ok_or_else(|| format!("no pending code {code} (expired, or never given)"))?;
        let user = self.pending[i].user.clone();
        self.allow(&user)?;
        Ok(user)
    }

    pub(crate) fn allow(&mut self, user: &str) -> Result<(), String> {
        if !self.knows(user) && self.approved.len() + self.denied.len() >= MAX_USERS {
            return Err(format!(
                "{MAX_USERS} users remembered already: !deny or remove some first"
            ));
        }
        self.denied.remove(user);
        self.approved.insert(user.to_owned());
        self.pending.retain(|p| p.user != user);
        self.noticed.remove(user);
        Ok(())
    }

    /// Whether `user` is approved or denied (moving between the two needs no room).
    fn knows(&self, user: &str) -> bool {
        self.approved.contains(user) || self.denied.contains(user)
    }

    pub(crate) fn deny(&mut self, user: &str) -> Result<(), String> {
        if !self.knows(user) && self.approved.len() + self.denied.len() >= MAX_USERS {
            return Err(format!("{MAX_USERS} users remembered already"));
        }
        self.approved.remove(user);
        self.pending.retain(|p| p.user != user);
        self.denied.insert(user.to_owned());
        Ok(())
    }

    /// Whether `user` may get a notice now (at most one per [`NOTICE_EVERY_MS`]); records it.
    pub(crate) fn may_notice(&mut self, user: &str, now_ms: u64) -> bool {
        if let Some(&at) = self.noticed.get(user)
            && now_ms < at.saturating_add(NOTICE_EVERY_MS)
        {
            return false;
        }
        if !self.noticed.contains_key(user) && self.noticed.len() >= MAX_TRACKED {
            evict_oldest(&mut self.noticed, |&at| at);
        }
        self.noticed.insert(user.to_owned(), now_ms);
        debug_assert!(self.noticed.len() <= MAX_TRACKED);
        true
    }

    /// Takes one token of `user`'s bucket (`count` per `per_ms`): `Err(ms until one is
    /// there)` when empty.
    pub(crate) fn take_token(
        &mut self,
        user: &str,
        count: u32,
        per_ms: u64,
        now_ms: u64,
    ) -> Result<(), u64> {
        let full = f64::from(count);
        let per_token = per_ms as f64 / full;
        if !self.buckets.contains_key(user) && self.buckets.len() >= MAX_TRACKED {
            // A bucket refilled to full says nothing: those go first, else the stalest.
            evict_oldest(&mut self.buckets, |b| b.at_ms);
        }
        let b = self.buckets.entry(user.to_owned()).or_insert(Bucket {
            tokens: full,
            at_ms: now_ms,
            taken: 0,
        });
        let elapsed = now_ms.saturating_sub(b.at_ms) as f64;
        b.tokens = (b.tokens + elapsed / per_token).min(full);
        b.at_ms = now_ms.max(b.at_ms);
        debug_assert!(b.tokens <= full);
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            b.taken = b.taken.saturating_add(1);
            Ok(())
        } else {
            Err(((1.0 - b.tokens) * per_token).ceil() as u64)
        }
    }

    /// The tokens `user` spent on `day`.
    pub(crate) fn tokens_on(&self, user: &str, day: u64) -> u64 {
        self.tokens
            .get(user)
            .filter(|t| t.day == day)
            .map_or(0, |t| t.used)
    }

    /// Counts `n` tokens to `user` on `day` (a new day starts from zero).
    pub(crate) fn charge(&mut self, user: &str, n: u64, day: u64) {
        if !self.tokens.contains_key(user) && self.tokens.len() >= MAX_TRACKED {
            // The user whose count is oldest goes (a past day's count says nothing).
            evict_oldest(&mut self.tokens, |t| t.day);
        }
        let t = self.tokens.entry(user.to_owned()).or_insert(DayTokens {
            day,
            used: 0,
            unpushed: 0,
        });
        if t.day != day {
            *t = DayTokens {
                day,
                used: 0,
                unpushed: 0,
            };
        }
        t.used = t.used.saturating_add(n);
        t.unpushed = t.unpushed.saturating_add(n);
        debug_assert!(self.tokens.len() <= MAX_TRACKED);
    }

    pub(crate) fn count_refused(&mut self, kind: &str) {
        *self.refused.entry(kind.to_owned()).or_default() += 1;
    }

    /// Forgets what is past the bounds (a state merged from the cluster's may be): the
    /// newest codes, the stalest buckets and day counts, users denied before approved.
    pub(crate) fn trim(&mut self) {
        self.pending
            .sort_by_key(|p| std::cmp::Reverse(p.expires_ms));
        self.pending.truncate(MAX_PENDING);
        while self.buckets.len() > MAX_TRACKED {
            evict_oldest(&mut self.buckets, |b| b.at_ms);
        }
        while self.tokens.len() > MAX_TRACKED {
            evict_oldest(&mut self.tokens, |t| t.day);
        }
        while self.approved.len() + self.denied.len() > MAX_USERS {
            if self.denied.pop_last().is_none() {
                self.approved.pop_last();
            }
        }
        self.approved.retain(|u| !self.denied.contains(u));
    }

    /// Checks the bounds (debug builds).
    pub(crate) fn check(&self) {
        debug_assert!(self.pending.len() <= MAX_PENDING);
        debug_assert!(self.approved.len() + self.denied.len() <= MAX_USERS);
        debug_assert!(self.buckets.len() <= MAX_TRACKED && self.noticed.len() <= MAX_TRACKED);
        debug_assert!(self.tokens.len() <= MAX_TRACKED);
        debug_assert!(self.approved.is_disjoint(&self.denied));
    }
}

fn evict_oldest<V>(map: &mut HashMap<String, V>, at: impl Fn(&V) -> u64) {
    if let Some(k) = map
        .iter()
        .min_by_key(|(_, v)| at(v))
        .map(|(k, _)| k.clone())
    {
        map.remove(&k);
    }
}

/// Code alphabet: no 0/O, 1/I/L, so a code read aloud or retyped survives.
const ALPHABET: &[u8] = b"ABCDEFGHJKMNPQRSTUVWXYZ23456789";
/// Characters in a code (31^8 ≈ 8.5e11: not guessable within the notice rate).
const CODE_LEN: usize = 8;

/// A fresh random code from the kernel's generator.
fn new_code() -> String {
    let mut bytes = [0u8; CODE_LEN];
    // SAFETY: getrandom(2) writes at most `len` bytes into our buffer.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if n != CODE_LEN as isize {
        // Never short for 8 bytes once the pool is initialised; fall back to the clock's
        // nanoseconds, mixed, rather than fail a message.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        bytes = t.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes();
    }
    bytes
        .iter()
        .map(|b| char::from(ALPHABET[usize::from(*b) % ALPHABET.len()]))
        .collect()
}

/// Everything the policy keeps, as written to `access.json`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Snapshot {
    pub(crate) platforms: BTreeMap<String, PlatformState>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_bounded_one_per_user_and_expire() {
        let mut s = PlatformState::default();
        let first = s.code_for("u0", 0).expect("room");
        assert_eq!(
            s.code_for("u0", 10).as_deref(),
            Some(first.as_str()),
            "no second code"
        );
        for i in 1..MAX_PENDING {
            assert!(s.code_for(&format!("u{i}"), 0).is_some());
        }
        assert_eq!(
            s.code_for("one-too-many", 0),
            None,
            "past the bound: no code"
        );
        s.check();
        assert!(
            s.code_for("one-too-many", CODE_TTL_MS).is_some(),
            "expired ones freed room"
        );
        assert!(
            s.approve_code(&first, CODE_TTL_MS).is_err(),
            "an expired code approves no one"
        );
    }

    #[test]
    fn an_approved_code_is_used_once_and_case_does_not_matter() {
        let mut s = PlatformState::default();
        let code = s.code_for("@bob:x", 0).expect("room");
        assert_eq!(
            s.approve_code(&code.to_lowercase(), 5),
            Ok("@bob:x".to_owned())
        );
        assert!(s.approved.contains("@bob:x") && s.pending.is_empty());
        assert!(s.approve_code(&code, 6).is_err());
        s.deny("@bob:x").expect("room");
        assert!(!s.approved.contains("@bob:x") && s.denied.contains("@bob:x"));
        s.check();
    }

    #[test]
    fn users_remembered_are_bounded() {
        let mut s = PlatformState::default();
        for i in 0..MAX_USERS {
            s.allow(&format!("u{i}")).expect("room");
        }
        assert!(s.allow("one-more").is_err());
        assert!(s.deny("one-more").is_err());
        assert!(s.deny("u1").is_ok(), "moving a known user needs no room");
        s.check();
    }

    #[test]
    fn a_bucket_refuses_past_its_count_and_refills() {
        let mut s = PlatformState::default();
        for _ in 0..3 {
            assert_eq!(s.take_token("u", 3, 60_000, 0), Ok(()));
        }
        assert_eq!(s.take_token("u", 3, 60_000, 0), Err(20_000));
        assert_eq!(s.take_token("u", 3, 60_000, 20_000), Ok(()));
        assert!(s.take_token("u", 3, 60_000, 20_001).is_err());
    }

    #[test]
    fn tracked_users_are_bounded() {
        let mut s = PlatformState::default();
        for i in 0..=MAX_TRACKED as u64 {
            let u = format!("u{i}");
            let _ = s.take_token(&u, 1, 1000, i);
            assert!(s.may_notice(&u, i));
        }
        s.check();
        assert!(!s.buckets.contains_key("u0"), "the stalest went");
        assert!(!s.may_notice(&format!("u{MAX_TRACKED}"), MAX_TRACKED as u64 + 1));
    }

    #[test]
    fn token_counts_are_per_day_and_bounded() {
        let mut s = PlatformState::default();
        s.charge("u", 700, 10);
        s.charge("u", 400, 10);
        assert_eq!(s.tokens_on("u", 10), 1100);
        assert_eq!(s.tokens_on("u", 11), 0, "a new day starts from zero");
        s.charge("u", 5, 11);
        assert_eq!((s.tokens_on("u", 11), s.tokens_on("u", 10)), (5, 0));
        for i in 0..MAX_TRACKED as u64 {
            s.charge(&format!("v{i}"), 1, 12);
        }
        s.check();
        assert!(!s.tokens.contains_key("u"), "the oldest day's count went");
    }

    proptest::proptest! {
        /// Whatever the order of messages, a user never gets more than `count` tokens in
        /// any window of `per` (the bucket's whole promise).
        #[test]
        fn no_window_admits_more_than_the_rate(gaps in proptest::collection::vec(0u64..30_000, 1..80)) {
            let mut s = PlatformState::default();
            let (mut now, mut admitted) = (0u64, Vec::new());
            for g in gaps {
                now += g;
                if s.take_token("u", 4, 60_000, now).is_ok() {
                    admitted.push(now);
                }
            }
            for (i, &t) in admitted.iter().enumerate() {
                let in_window = admitted[i..].iter().take_while(|&&u| u < t + 60_000).count();
                // A full bucket plus what refills during the window.
                proptest::prop_assert!(in_window <= 4 + 4, "{in_window} in a minute");
            }
        }
    }
}
