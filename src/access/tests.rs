use super::*;
use crate::message::SessionKey;

fn cfg(toml: &[(&str, AccessTable)]) -> AccessConfig {
    let map = toml
        .iter()
        .map(|(p, t)| ((*p).to_owned(), t.clone()))
        .collect();
    AccessConfig::from_tables(&map, true).expect("valid")
}

fn table(f: impl FnOnce(&mut toml_like::T)) -> AccessTable {
    let mut t = toml_like::T::default();
    f(&mut t);
    t.build()
}

/// Builds a table the way the TOML would (the fields are private to `config`).
mod toml_like {
    #[derive(Default)]
    pub(super) struct T {
        pub(super) mode: Option<&'static str>,
        pub(super) admins: Vec<&'static str>,
        pub(super) allow: Vec<&'static str>,
        pub(super) groups: Option<&'static str>,
        pub(super) rate: Option<&'static str>,
    }
    impl T {
        pub(super) fn build(self) -> super::AccessTable {
            let mut s = String::new();
            let list = |v: &[&str]| {
                v.iter()
                    .map(|x| format!("{x:?}"))
                    .collect::<Vec<_>>()
                    .join(",")
            };
            if let Some(m) = self.mode {
                s += &format!("mode = {m:?}\n");
            }
            s += &format!(
                "admins = [{}]\nallow = [{}]\n",
                list(&self.admins),
                list(&self.allow)
            );
            if let Some(g) = self.groups {
                s += &format!("groups = {g:?}\n");
            }
            if let Some(r) = self.rate {
                s += &format!("rate = {r:?}\n");
            }
            serde_json::from_value(toml_to_json(&s)).expect("table")
        }
    }
    /// The few `key = value` lines above as JSON (no TOML parser in the library).
    fn toml_to_json(s: &str) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        for line in s.lines() {
            let (k, v) = line.split_once(" = ").expect("key = value");
            m.insert(k.to_owned(), serde_json::from_str(v).expect("json value"));
        }
        serde_json::Value::Object(m)
    }
}

fn dm(platform: &str, user: &str, text: &str) -> Message {
    let key = SessionKey::dm(platform, user).expect("key");
    Message::new("m", key, text)
        .expect("msg")
        .from_user(user, None)
        .expect("user")
}

fn group(platform: &str, user: &str, text: &str, to_bot: bool) -> Message {
    let key = SessionKey::new(platform, ChatType::Group, "!room", None, Some(user)).expect("key");
    let m = Message::new("m", key, text)
        .expect("msg")
        .from_user(user, None)
        .expect("user");
    if to_bot {
        m.with_meta(r#"{"to_bot":true}"#).expect("meta")
    } else {
        m
    }
}

fn notice(d: &Decision) -> Option<Notice> {
    match d {
        Decision::Admit => None,
        Decision::Answer { notice, .. } => Some(*notice),
    }
}

fn code_in(d: &Decision) -> String {
    let Decision::Answer { text, .. } = d else {
        panic!("no notice")
    };
    let at = text.find("code: ").expect("a code") + 6;
    text[at..at + 8].to_owned()
}

#[test]
fn a_stranger_is_paired_and_the_admins_approval_lets_the_next_message_through() {
    let admin = "@alice:x";
    let mut p = Policy::new(cfg(&[("matrix", table(|t| t.admins = vec![admin]))]));
    let first = p.decide(&dm("matrix", "@bob:x", "hi"), 0);
    assert_eq!(notice(&first), Some(Notice::Pairing));
    let code = code_in(&first);
    // Within the minute: no second notice, no second code.
    assert_eq!(
        notice(&p.decide(&dm("matrix", "@bob:x", "hi?"), 1000)),
        Some(Notice::Ignored)
    );
    // A non-admin's `!approve` is not a command: it is a stranger's message like any.
    assert_eq!(
        notice(&p.decide(&dm("matrix", "@eve:x", &format!("!approve {code}")), 1000)),
        Some(Notice::Pairing)
    );
    let ok = p.decide(&dm("matrix", admin, &format!("!approve {code}")), 2000);
    assert_eq!(ok, Decision::answer(Notice::Admin, "approved @bob:x"));
    assert_eq!(
        p.decide(&dm("matrix", "@bob:x", "hi"), 3000),
        Decision::Admit
    );
    // The admin's own messages run, exempt.
    assert_eq!(
        p.decide(&dm("matrix", admin, "hello"), 3000),
        Decision::Admit
    );
    // `!deny` shuts them out again.
    p.decide(&dm("matrix", admin, "!deny @bob:x"), 4000);
    assert_eq!(
        notice(&p.decide(&dm("matrix", "@bob:x", "hi"), 5000)),
        Some(Notice::Denied)
    );
}

#[test]
fn defaults_pair_on_native_platforms_and_leave_others_open() {
    let mut p = Policy::new(cfg(&[]));
    for platform in ["matrix", "irc", "telegram"] {
        assert_eq!(
            notice(&p.decide(&dm(platform, "u", "hi"), 0)),
            Some(Notice::Pairing),
            "{platform}"
        );
    }
    assert_eq!(p.decide(&dm("cli", "u", "hi"), 0), Decision::Admit);
    let mut embedder = Policy::new(AccessConfig::default());
    assert_eq!(
        embedder.decide(&dm("matrix", "u", "hi"), 0),
        Decision::Admit
    );
}

#[test]
fn allow_globs_admit_and_an_allowlist_denies_the_rest() {
    let mut p = Policy::new(cfg(&[(
        "matrix",
        table(|t| {
            t.mode = Some("allowlist");
            t.allow = vec!["@*:example.org"];
        }),
    )]));
    assert_eq!(
        p.decide(&dm("matrix", "@bob:example.org", "hi"), 0),
        Decision::Admit
    );
    assert_eq!(
        notice(&p.decide(&dm("matrix", "@bob:evil.org", "hi"), 0)),
        Some(Notice::Denied)
    );
}

#[test]
fn in_a_mention_only_group_only_messages_to_the_bot_count() {
    let mut p = Policy::new(cfg(&[("matrix", table(|t| t.mode = Some("open")))]));
    assert_eq!(
        notice(&p.decide(&group("matrix", "u", "chatter", false), 0)),
        Some(Notice::Ignored)
    );
    assert_eq!(
        p.decide(&group("matrix", "u", "bot: hi", true), 0),
        Decision::Admit
    );
    assert_eq!(
        p.decide(&dm("matrix", "u", "hi"), 0),
        Decision::Admit,
        "a DM is always addressed"
    );
    let mut all = Policy::new(cfg(&[(
        "matrix",
        table(|t| {
            t.mode = Some("open");
            t.groups = Some("all");
        }),
    )]));
    assert_eq!(
        all.decide(&group("matrix", "u", "chatter", false), 0),
        Decision::Admit
    );
}

#[test]
fn a_user_past_the_rate_is_told_when_to_come_back_and_admins_are_exempt() {
    let mut p = Policy::new(cfg(&[(
        "telegram",
        table(|t| {
            t.mode = Some("open");
            t.rate = Some("2/min");
            t.admins = vec!["boss"];
        }),
    )]));
    assert_eq!(p.decide(&dm("telegram", "u", "1"), 0), Decision::Admit);
    assert_eq!(p.decide(&dm("telegram", "u", "2"), 0), Decision::Admit);
    let third = p.decide(&dm("telegram", "u", "3"), 0);
    assert_eq!(notice(&third), Some(Notice::RateLimited));
    let Decision::Answer { text, .. } = third else {
        unreachable!()
    };
    assert!(text.contains("Try again in 30 s"), "{text}");
    assert_eq!(p.decide(&dm("telegram", "u", "4"), 30_000), Decision::Admit);
    for _ in 0..10 {
        assert_eq!(p.decide(&dm("telegram", "boss", "x"), 0), Decision::Admit);
    }
    assert_eq!(p.figures().refused.get("telegram:rate_limited"), Some(&1));
}

#[test]
fn the_state_survives_a_save_and_a_load() {
    let dir = tempfile::tempdir().expect("dir");
    let mut p = Policy::new(cfg(&[("matrix", table(|t| t.admins = vec!["a"]))]));
    p.persist_in(dir.path()).expect("persist");
    p.decide(&dm("matrix", "a", "!allow bob"), 0);
    p.maybe_save(0);
    let path = dir.path().join("access.json");
    // The writer thread writes it; wait for it (a bounded poll of a file, no ordering sleep).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !std::fs::read_to_string(&path).is_ok_and(|s| s.contains("bob")) {
        assert!(std::time::Instant::now() < deadline, "never saved");
        std::thread::park_timeout(std::time::Duration::from_millis(10));
    }
    let mut again = Policy::new(cfg(&[("matrix", table(|t| t.admins = vec!["a"]))]));
    again.persist_in(dir.path()).expect("load");
    assert_eq!(
        again.decide(&dm("matrix", "bob", "hi"), 10),
        Decision::Admit
    );
}

/// One step of a random conversation with the policy.
#[derive(Clone, Debug)]
enum Step {
    /// User `n` writes (in a DM).
    Write(u8),
    /// The admin approves the code user `n` was given (if any).
    Approve(u8),
    /// The admin denies user `n`.
    Deny(u8),
    /// The admin allows user `n`.
    Allow(u8),
    /// Time passes (ms).
    Wait(u32),
}

fn step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    prop_oneof![
        4 => (0u8..6).prop_map(Step::Write),
        1 => (0u8..6).prop_map(Step::Approve),
        1 => (0u8..6).prop_map(Step::Deny),
        1 => (0u8..6).prop_map(Step::Allow),
        1 => (0u32..7_200_000).prop_map(Step::Wait),
    ]
}

proptest::proptest! {
    /// Whatever the interleaving of messages, approvals, denials and time: a user's message
    /// reaches the agent exactly when an admin let them in (approved their live code, or
    /// allowed them) and did not deny them since; no user ever holds two codes; a code is
    /// never handed out past its hour; and a refused user gets at most one notice a minute.
    #[test]
    fn only_users_an_admin_let_in_reach_the_agent(steps in proptest::collection::vec(step(), 1..60)) {
        let admin = "admin";
        let mut p = Policy::new(cfg(&[("matrix", table(|t| t.admins = vec!["admin"]))]));
        let mut now = 0u64;
        let mut let_in = std::collections::HashSet::new();
        let mut codes: std::collections::HashMap<u8, (String, u64)> = Default::default();
        let mut last_notice: std::collections::HashMap<u8, u64> = Default::default();
        for s in steps {
            match s {
                Step::Write(u) => {
                    let d = p.decide(&dm("matrix", &format!("u{u}"), "hi"), now);
                    proptest::prop_assert_eq!(d == Decision::Admit, let_in.contains(&u), "{:?}", d);
                    if let Decision::Answer { notice, text } = &d {
                        if *notice != Notice::Ignored {
                            let prev = last_notice.insert(u, now);
                            proptest::prop_assert!(prev.is_none_or(|t| now >= t + state::NOTICE_EVERY_MS));
                        }
                        if *notice == Notice::Pairing && text.contains("code: ") {
                            let code = code_in(&d);
                            match codes.get(&u) {
                                Some((old, expires)) if now < *expires => {
                                    // The same code again, with its first expiry.
                                    proptest::prop_assert_eq!(old, &code, "a second live code");
                                }
                                _ => {
                                    codes.insert(u, (code, now + state::CODE_TTL_MS));
                                }
                            }
                        }
                    }
                }
                Step::Approve(u) => {
                    if let Some((code, expires)) = codes.get(&u).cloned() {
                        let d = p.decide(&dm("matrix", admin, &format!("!approve {code}")), now);
                        let live = now < expires && !let_in.contains(&u);
                        let approved = d == Decision::answer(Notice::Admin, format!("approved u{u}"));
                        // A code is good until it expires or its user is let in another way.
                        proptest::prop_assert_eq!(approved, live, "{:?}", d);
                        if approved {
                            // Let in: their next refusal, if any, is news worth a notice.
                            let_in.insert(u);
                            last_notice.remove(&u);
                        }
                        codes.remove(&u);
                    }
                }
                Step::Deny(u) => {
                    p.decide(&dm("matrix", admin, &format!("!deny u{u}")), now);
                    let_in.remove(&u);
                    codes.remove(&u);
                }
                Step::Allow(u) => {
                    p.decide(&dm("matrix", admin, &format!("!allow u{u}")), now);
                    let_in.insert(u);
                    codes.remove(&u);
                    last_notice.remove(&u);
                }
                Step::Wait(ms) => now += u64::from(ms),
            }
        }
    }
}

/// `may_use` (a bridge's question before it joins an invite): admins and users let in —
/// by pattern, by approval, or on an open platform — may; strangers and denied users may
/// not; asking changes nothing (no code minted, no notice spent).
#[test]
fn may_use_says_who_is_let_in_and_changes_nothing() {
    let admin = "@alice:x";
    let mut p = Policy::new(cfg(&[(
        "matrix",
        table(|t| {
            t.admins = vec![admin];
            t.allow = vec!["@*:friends.org"];
        }),
    )]));
    assert!(p.may_use("matrix", admin, None));
    assert!(p.may_use("matrix", "@carol:friends.org", Some("!r")));
    assert!(!p.may_use("matrix", "@bob:x", Some("!r")));
    assert!(!p.may_use("matrix", "", None));
    assert!(p.may_use("cli", "anyone", None), "an open platform");
    assert!(!p.may_use("telegram", "7", None), "a native platform pairs");
    for _ in 0..100 {
        assert!(!p.may_use("matrix", "@bob:x", None));
    }
    assert!(p.state.platforms.is_empty(), "asking minted nothing");
    let first = p.decide(&dm("matrix", "@bob:x", "hi"), 0);
    assert_eq!(
        notice(&first),
        Some(Notice::Pairing),
        "the notice is unspent"
    );
    let code = code_in(&first);
    p.decide(&dm("matrix", admin, &format!("!approve {code}")), 1);
    assert!(p.may_use("matrix", "@bob:x", None), "approved");
    p.decide(&dm("matrix", admin, "!deny @carol:friends.org"), 2);
    assert!(
        !p.may_use("matrix", "@carol:friends.org", None),
        "a denial beats a pattern"
    );
}

/// `tokens-per-day`: a tracked message's reply tokens count to its user's UTC day; at the
/// budget the next message gets one `budget` notice (then `ignored` within the minute); the
/// next day starts from zero; admins are neither tracked nor limited; an untracked message's
/// tokens count nothing.
#[test]
fn a_budget_counts_replies_per_user_per_day_and_spares_admins() {
    const DAY: u64 = 86_400_000;
    let admin = "@alice:x";
    let table: AccessTable = serde_json::from_value(serde_json::json!({
        "mode": "open", "admins": [admin], "tokens-per-day": 1000
    }))
    .expect("table");
    let mut p = Policy::new(cfg(&[("matrix", table)]));
    let noon = 10 * DAY + DAY / 2;
    assert_eq!(p.decide(&dm("matrix", "@u:x", "hi"), noon), Decision::Admit);
    let first = p.track(&dm("matrix", "@u:x", "hi"));
    assert!(first.is_some());
    p.charge(None, Some(5000), noon); // not tracked: counts nothing
    p.charge(first, Some(999), noon);
    assert_eq!(p.decide(&dm("matrix", "@u:x", "hi"), noon), Decision::Admit);
    let second = p.track(&dm("matrix", "@u:x", "hi"));
    p.charge(second, Some(1), noon);
    let spent = p.decide(&dm("matrix", "@u:x", "hi"), noon);
    assert_eq!(notice(&spent), Some(Notice::Budget));
    let Decision::Answer { text, .. } = &spent else {
        unreachable!()
    };
    assert!(text.contains("in 12 h 0 min"), "{text}");
    assert_eq!(
        notice(&p.decide(&dm("matrix", "@u:x", "hi"), noon + 1)),
        Some(Notice::Ignored)
    );
    assert_eq!(
        p.decide(&dm("matrix", "@v:x", "hi"), noon),
        Decision::Admit,
        "per user"
    );
    assert_eq!(
        p.decide(&dm("matrix", "@u:x", "hi"), 11 * DAY),
        Decision::Admit,
        "a new UTC day"
    );
    let by_admin = p.track(&dm("matrix", admin, "hi"));
    assert!(by_admin.is_none(), "an admin spends no budget");
    p.charge(by_admin, Some(1_000_000), noon);
    assert_eq!(p.decide(&dm("matrix", admin, "hi"), noon), Decision::Admit);
    assert_eq!(
        p.operate("matrix", &format!("usage {admin}"), noon)
            .as_deref(),
        Ok("usage: 0"),
        "an admin's tokens are not counted"
    );
    let usage = p.operate("matrix", "usage @u:x", 11 * DAY);
    assert_eq!(usage.as_deref(), Ok("usage: 1\n@u:x: 0 tokens today"));
}

/// A shared store the test drives: each call's changes go to the test, which answers it.
struct DrivenStore {
    calls: std::sync::mpsc::Sender<shared::Changes>,
    answers: std::sync::mpsc::Receiver<Result<Snapshot, String>>,
}

impl shared::SharedStore for DrivenStore {
    fn sync(&mut self, changes: &shared::Changes, _now_ms: u64) -> Result<Snapshot, String> {
        let _ = self.calls.send(changes.clone());
        self.answers
            .recv()
            .unwrap_or_else(|_| Err("test over".into()))
    }
}

#[test]
fn a_shared_store_that_fails_or_hangs_never_stops_decisions_and_loses_no_change() {
    let (calls_tx, calls) = std::sync::mpsc::channel();
    let (answer, answers) = std::sync::mpsc::channel();
    let admin = "@alice:x";
    let limited = table(|t| (t.mode, t.rate) = (Some("open"), Some("5/min")));
    let mut p = Policy::new(cfg(&[
        ("matrix", table(|t| t.admins = vec![admin])),
        ("cli", limited),
    ]));
    answer.send(Err("down".into())).expect("send");
    let store = DrivenStore {
        calls: calls_tx,
        answers,
    };
    p.share(Box::new(store)).expect("thread");
    assert!(calls.recv().expect("the load").is_empty());
    // Down at start-up: the local state decides.
    let code = code_in(&p.decide(&dm("matrix", "@bob:x", "hi"), 0));
    assert_eq!(p.decide(&dm("cli", "u", "hi"), 0), Decision::Admit);
    p.maybe_save(1000);
    let pushed = calls.recv().expect("a push");
    assert!(pushed["matrix"].codes_added.iter().any(|c| c.code == code));
    // The store hangs in that call (no answer yet): the loop's calls still return.
    assert_eq!(
        notice(&p.decide(&dm("matrix", "@carol:x", "hi"), 1500)),
        Some(Notice::Pairing)
    );
    assert_eq!(p.decide(&dm("cli", "u", "hi"), 1500), Decision::Admit);
    p.maybe_save(2000);
    answer.send(Err("still down".into())).expect("send");
    // Pushed again with what came since: nothing lost to the failure.
    let again = calls.recv().expect("a retry");
    let codes = &again["matrix"].codes_added;
    assert!(codes.iter().any(|c| c.code == code), "{again:?}");
    assert!(codes.iter().any(|c| c.user == "@carol:x"), "{again:?}");
    assert_eq!(again["cli"].taken["u"].0, 2, "both tokens taken: {again:?}");
    // Back: the store's word (an approval of @dave made elsewhere) reaches the policy.
    let mut merged = Snapshot::default();
    let mut st = PlatformState::default();
    st.approved.insert("@dave:x".into());
    merged.platforms.insert("matrix".into(), st);
    answer.send(Ok(merged)).expect("send");
    // The next call means the answer before it was taken in by the thread.
    let _ = calls.recv().expect("the next period");
    p.maybe_save(3000);
    assert_eq!(
        p.decide(&dm("matrix", "@dave:x", "hi"), 3000),
        Decision::Admit
    );
    // bob's code, not yet in the store's word, is still approvable here.
    let ok = p.decide(&dm("matrix", admin, &format!("!approve {code}")), 3000);
    assert_eq!(ok, Decision::answer(Notice::Admin, "approved @bob:x"));
}
