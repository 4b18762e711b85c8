//! Who may talk to the bot, and how much: the access policy (issue 32), sans-IO.
//!
//! The bridge server asks [`Policy::decide`] once per message, where it would submit it to the
//! runtime; the answer is to run it, or to answer it here with a notice (no agent runs):
//! - `pairing`: an unknown user on a `pairing` platform gets a one-time code an admin
//!   approves with `!approve CODE` (codes bounded per platform and expiring);
//! - `denied`: an unknown user on an `allowlist` platform, or one an admin denied;
//! - `rate_limited`: a user past their platform's `rate` (a token bucket per user);
//! - `budget`: a user whose turns today spent their platform's `tokens-per-day` (the agent's
//!   reported usage, counted when each turn's reply comes back: [`Policy::charge`]);
//! - `admin`: an admin's `!` command, answered here;
//! - `ignored`: a group message not addressed to the bot (`groups = "mention"`), or a
//!   refused user's message within a minute of their last notice — answered with an empty
//!   text the native bridges do not post.
//!
//! What it remembers is bounded (see `state.rs`) and, with `--data-dir`, kept in
//! `access.json` beside the journal, written by a thread of its own ([`Saver`]), never on
//! the reactor; with `--cluster`, merged with the other instances' through Redis by a
//! thread of its own instead (`shared.rs`, the store in `cluster/access.rs`).

// The tables are read from `serve`'s `--config` file (feature `cli`); a library-only build
// has no reader of them yet, so their parser is unused there.
#[cfg_attr(not(feature = "cli"), allow(dead_code))]
mod config;
#[cfg_attr(not(feature = "cli"), allow(dead_code))]
mod glob;
// Shared through Redis with `--cluster`, which only `serve` (feature `cli`) sets up.
#[cfg_attr(not(feature = "cli"), allow(dead_code))]
pub(crate) mod shared;
pub(crate) mod state;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};

pub use config::AccessConfig;
#[cfg(feature = "cli")]
pub(crate) use config::AccessTable;
use config::{Mode, Rules};
use state::{DAY_MS, PlatformState, Snapshot};

use crate::message::{Body, ChatType, Message};

/// The meta key a bridge sets (`"to_bot": true`) on a group message addressed to the bot.
pub(crate) const ADDRESSED_KEY: &str = "to_bot";
/// The meta key of the sender's full IRC mask (`nick!user@host`), which `admins` and
/// `allow` patterns match as well as the user id.
pub(crate) const MASK_KEY: &str = "mask";
/// Most platforms the policy keeps state for (the bridge's own platform cap is lower).
const MAX_PLATFORMS: usize = 64;
/// Counter changes (rate buckets, notices) are saved at most this often; approvals and
/// denials at once.
const SAVE_EVERY_MS: u64 = 1000;

/// The kind of a notice, as the `notice` field of the `reply` says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Notice {
    Pairing,
    Denied,
    RateLimited,
    Budget,
    Admin,
    Ignored,
}

impl Notice {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Notice::Pairing => "pairing",
            Notice::Denied => "denied",
            Notice::RateLimited => "rate_limited",
            Notice::Budget => "budget",
            Notice::Admin => "admin",
            Notice::Ignored => "ignored",
        }
    }
}

/// What to do with a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Submit it to the runtime.
    Admit,
    /// Answer it here with `text` (a `reply` carrying `"notice": kind`); no agent runs.
    Answer { notice: Notice, text: String },
}

impl Decision {
    fn answer(notice: Notice, text: impl Into<String>) -> Decision {
        Decision::Answer {
            notice,
            text: text.into(),
        }
    }
}

/// The policy: the configuration and what it remembers.
pub(crate) struct Policy {
    cfg: AccessConfig,
    state: Snapshot,
    saver: Option<Saver>,
    /// With `--cluster`: the thread sharing the state, and the state as it last came from
    /// the shared store (what changed here since is handed out: `shared.rs`).
    sharer: Option<(shared::Sharer, Snapshot)>,
    /// State changed since the last save; `urgent` for approvals and denials.
    dirty: bool,
    urgent: bool,
    last_save_ms: u64,
    /// The platform cap was reported (once).
    warned_full: bool,
}

/// Whose budget an admitted message's turn spends: kept by the caller with the message (the
/// bridge's route) until it ends, then given to [`Policy::charge`].
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Charge {
    platform: String,
    user: String,
}

impl Policy {
    pub(crate) fn new(cfg: AccessConfig) -> Policy {
        Policy {
            cfg,
            state: Snapshot::default(),
            saver: None,
            sharer: None,
            dirty: false,
            urgent: false,
            last_save_ms: 0,
            warned_full: false,
        }
    }

    /// Keeps the state in `dir/access.json`: loads it now (start-up, before the reactor
    /// runs) and saves changes from now on through a writer thread.
    pub(crate) fn persist_in(&mut self, dir: &Path) -> std::io::Result<()> {
        let path = dir.join("access.json");
        match std::fs::read(&path) {
            Ok(bytes) => {
                self.state = serde_json::from_slice(&bytes).map_err(|e| {
                    std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("{}: {e}", path.display()),
                    )
                })?;
                self.state.platforms.values_mut().for_each(|p| p.check());
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        self.saver = Some(Saver::start(path)?);
        Ok(())
    }

    /// Shares the state through `store` (`--cluster`): loads it now (start-up, before the
    /// reactor runs; a store that does not answer leaves the local state, with a WARN) and
    /// from then on merges changes both ways through a thread of its own.
    #[cfg_attr(not(feature = "cli"), allow(dead_code))]
    pub(crate) fn share(&mut self, mut store: Box<dyn shared::SharedStore>) -> std::io::Result<()> {
        match store.sync(&shared::Changes::new(), crate::journal::now_ms()) {
            Ok(merged) => {
                self.state = shared::rebase(&Snapshot::default(), &self.state, &merged);
                self.sharer = Some((shared::Sharer::start(store)?, merged));
            }
            Err(e) => {
                log::warn!("access: cannot load the shared state: {e}; starting from none");
                self.sharer = Some((shared::Sharer::start(store)?, Snapshot::default()));
            }
        }
        Ok(())
    }

    /// With `--cluster`: takes the newest merged state in, and hands what changed here out
    /// (approvals at once, counters at most once a [`shared::SYNC_EVERY_MS`]).
    fn sync_shared(&mut self, now_ms: u64) {
        let Some((sharer, base)) = &mut self.sharer else {
            return;
        };
        if let Some(merged) = sharer.take_merged() {
            self.state = shared::rebase(base, &self.state, &merged);
            *base = merged;
        }
        let due = self.urgent || now_ms >= self.last_save_ms.saturating_add(shared::SYNC_EVERY_MS);
        if !self.dirty || !due {
            return;
        }
        let cfg = &self.cfg;
        let rate = |platform: &str| {
            let rules = cfg
                .rules(platform)
                .cloned()
                .unwrap_or_else(|| cfg.default_rules(platform));
            rules.rate.map(|r| (r.count, r.per.as_millis() as u64))
        };
        let changes = shared::changes_since(base, &mut self.state, rate);
        if !changes.is_empty() {
            sharer.offer(changes);
        }
        (self.dirty, self.urgent, self.last_save_ms) = (false, false, now_ms);
    }

    /// Logs, once at start-up, the mode in force per platform.
    pub(crate) fn log_summary(&self) {
        for line in self.cfg.summary() {
            log::info!("{line}");
        }
    }

    fn rules(&self, platform: &str) -> Rules {
        self.cfg
            .rules(platform)
            .cloned()
            .unwrap_or_else(|| self.cfg.default_rules(platform))
    }

    /// The decision for `m` at wall-clock `now_ms`.
    pub(crate) fn decide(&mut self, m: &Message, now_ms: u64) -> Decision {
        let platform = m.session.platform();
        let rules = self.rules(platform);
        let limited = rules.rate.is_some() || rules.tokens_per_day.is_some();
        if rules.mode == Mode::Open && !limited && !rules.mention_only {
            return Decision::Admit;
        }
        if m.session.chat_type() != ChatType::Dm && rules.mention_only && !addressed(m) {
            return Decision::answer(Notice::Ignored, "");
        }
        let user = m.context.user_id.as_deref().unwrap_or("");
        let mask = meta_str(m, MASK_KEY);
        let ids = [Some(user).filter(|u| !u.is_empty()), mask.as_deref()];
        if rules
            .admins
            .iter()
            .any(|g| ids.iter().flatten().any(|id| g.matches(id)))
        {
            return match admin_command(m) {
                Some(cmd) => {
                    let text = self.run_admin(platform, cmd, now_ms);
                    Decision::answer(Notice::Admin, text)
                }
                None => Decision::Admit,
            };
        }
        if rules.mode == Mode::Open && !limited {
            return Decision::Admit;
        }
        if !self.state.platforms.contains_key(platform)
            && self.state.platforms.len() >= MAX_PLATFORMS
        {
            if !self.warned_full {
                log::warn!(
                    "access: state for {MAX_PLATFORMS} platforms already; messages on {platform} refused"
                );
                self.warned_full = true;
            }
            return Decision::answer(Notice::Denied, "This bot is not available here.");
        }
        let st = self.state.platforms.entry(platform.to_owned()).or_default();
        let decision = decide_known(&rules, st, m, &ids, now_ms);
        if let Decision::Answer { notice, .. } = &decision {
            st.count_refused(notice.as_str());
        }
        st.check();
        self.dirty = true;
        decision
    }

    /// Whether `user` may use the bot on `platform` — an admin, a user let in (an `allow`
    /// pattern, an approval, or a member of an `allow-chats` chat `chat`), or anyone on an
    /// open platform — without a message: a bridge asks before it acts for them (the Matrix
    /// bridge before it accepts an invite). Changes nothing (no code minted, no token
    /// taken), so a flood of questions grows nothing.
    pub(crate) fn may_use(&self, platform: &str, user: &str, chat: Option<&str>) -> bool {
        let rules = self.rules(platform);
        if user.is_empty() {
            return rules.mode == Mode::Open;
        }
        if rules.admins.iter().any(|g| g.matches(user)) {
            return true;
        }
        let st = self.state.platforms.get(platform);
        if st.is_some_and(|st| st.denied.contains(user)) {
            return false;
        }
        rules.mode == Mode::Open
            || rules.allow.iter().any(|g| g.matches(user))
            || st.is_some_and(|st| st.approved.contains(user))
            || chat.is_some_and(|c| rules.allow_chats.iter().any(|g| g.matches(c)))
    }

    /// Whose budget the admitted message `m` spends: its user's, when their platform has one
    /// and they are no admin (`None` otherwise). Its reply's tokens are counted by
    /// [`charge`](Self::charge).
    pub(crate) fn track(&self, m: &Message) -> Option<Charge> {
        let platform = m.session.platform();
        let rules = self.rules(platform);
        rules.tokens_per_day?;
        let user = m.context.user_id.as_deref().unwrap_or("");
        let mask = meta_str(m, MASK_KEY);
        let ids = [Some(user).filter(|u| !u.is_empty()), mask.as_deref()];
        if rules
            .admins
            .iter()
            .any(|g| ids.iter().flatten().any(|id| g.matches(id)))
        {
            return None;
        }
        Some(Charge {
            platform: platform.to_owned(),
            user: user.to_owned(),
        })
    }

    /// A message ended; `tokens` its turn reported (a reply's): counted to the user's day of
    /// its [`Charge`], if it had one ([tracked](Self::track)).
    pub(crate) fn charge(&mut self, charge: Option<Charge>, tokens: Option<u64>, now_ms: u64) {
        let Some(Charge { platform, user }) = charge else {
            return;
        };
        let (Some(n), Some(st)) = (tokens, self.state.platforms.get_mut(&platform)) else {
            return;
        };
        st.charge(&user, n, now_ms / DAY_MS);
        st.check();
        self.dirty = true;
    }

    /// Saves the state if it changed (approvals at once, counters at most once a second).
    pub(crate) fn maybe_save(&mut self, now_ms: u64) {
        if self.sharer.is_some() {
            return self.sync_shared(now_ms);
        }
        let due = self.urgent || now_ms >= self.last_save_ms.saturating_add(SAVE_EVERY_MS);
        if !self.dirty || !due {
            return;
        }
        if let Some(s) = &self.saver {
            // A copy only: the JSON is made on the saver's thread, not the reactor's.
            s.offer(self.state.clone());
        }
        (self.dirty, self.urgent, self.last_save_ms) = (false, false, now_ms);
    }

    /// Figures for the status: refused messages by platform and kind, pending codes.
    pub(crate) fn figures(&self) -> AccessFigures {
        let mut f = AccessFigures::default();
        for (p, st) in &self.state.platforms {
            for (kind, n) in &st.refused {
                f.refused.insert(format!("{p}:{kind}"), *n);
            }
            f.pending_codes += st.pending.len();
            f.users_remembered += st.approved.len() + st.denied.len();
        }
        f
    }

    /// Runs an admin command given outside the chat (`turnstile access`, over the HTTP
    /// endpoint): `command` is its words without the `!`. `Err` for a platform the policy
    /// has no room for (no state is made for it).
    #[cfg(feature = "cli")] // called by `turnstile access` through serve's HTTP endpoint
    pub(crate) fn operate(
        &mut self,
        platform: &str,
        command: &str,
        now_ms: u64,
    ) -> Result<String, String> {
        let cmd = parse_command(command).unwrap_or(AdminCommand::Unknown);
        if !self.state.platforms.contains_key(platform)
            && self.state.platforms.len() >= MAX_PLATFORMS
        {
            return Err(format!(
                "state for {MAX_PLATFORMS} platforms already; none for {platform}"
            ));
        }
        Ok(self.run_admin(platform, cmd, now_ms))
    }

    fn run_admin(&mut self, platform: &str, cmd: AdminCommand<'_>, now_ms: u64) -> String {
        let st = self.state.platforms.entry(platform.to_owned()).or_default();
        st.expire(now_ms);
        let changed = matches!(
            cmd,
            AdminCommand::Approve(_) | AdminCommand::Allow(_) | AdminCommand::Deny(_)
        );
        let text = match cmd {
            AdminCommand::Approve(code) => match st.approve_code(code, now_ms) {
                Ok(user) => format!("approved {user}"),
                Err(e) => e,
            },
            AdminCommand::Allow(user) => st
                .allow(user)
                .map_or_else(|e| e, |()| format!("allowed {user}")),
            AdminCommand::Deny(user) => st
                .deny(user)
                .map_or_else(|e| e, |()| format!("denied {user}")),
            AdminCommand::Pending => list(
                "pending codes",
                st.pending.iter().map(|p| {
                    format!(
                        "{} {} (expires in {} min)",
                        p.code,
                        p.user,
                        p.expires_ms.saturating_sub(now_ms) / 60_000
                    )
                }),
            ),
            AdminCommand::Users => list(
                "users",
                (st.approved.iter().map(|u| format!("allowed {u}")))
                    .chain(st.denied.iter().map(|u| format!("denied {u}"))),
            ),
            AdminCommand::Usage(user) => usage(st, user, now_ms),
            AdminCommand::Unknown => {
                "commands: !approve CODE, !allow USER, !deny USER, !pending, !users, !usage [USER]"
                    .into()
            }
        };
        st.check();
        if changed {
            log::info!("access: {platform}: {text}");
            (self.dirty, self.urgent) = (true, true);
        }
        text
    }
}

/// `!usage [USER]`: each user's messages left in their rate bucket and tokens spent today.
fn usage(st: &PlatformState, user: Option<&str>, now_ms: u64) -> String {
    let today = now_ms / DAY_MS;
    let mut users: Vec<&String> = st.buckets.keys().chain(st.tokens.keys()).collect();
    users.sort_unstable();
    users.dedup();
    list(
        "usage",
        users
            .into_iter()
            .filter(|u| user.is_none_or(|w| w == u.as_str()))
            .map(|u| {
                let mut line = format!("{u}:");
                if let Some(b) = st.buckets.get(u) {
                    let _ = write!(line, " {:.1} messages left", b.tokens);
                }
                let _ = write!(line, " {} tokens today", st.tokens_on(u, today));
                line
            }),
    )
}

/// The `budget` notice: the day's tokens are spent; they come back at 00:00 UTC.
fn budget_spent(limit: u64, now_ms: u64) -> Decision {
    let next_day_ms = (now_ms / DAY_MS + 1) * DAY_MS;
    let mins = (next_day_ms - now_ms).div_ceil(60_000);
    Decision::answer(
        Notice::Budget,
        format!(
            "Today's budget is spent: {limit} tokens per day here. It resets at 00:00 UTC, in {} h {} min.",
            mins / 60,
            mins % 60
        ),
    )
}

/// The decision for a non-admin user on a platform with a policy.
fn decide_known(
    rules: &Rules,
    st: &mut PlatformState,
    m: &Message,
    ids: &[Option<&str>; 2],
    now_ms: u64,
) -> Decision {
    let user = ids[0].unwrap_or("");
    let listed = !user.is_empty()
        && (rules
            .allow
            .iter()
            .any(|g| ids.iter().flatten().any(|id| g.matches(id)))
            || st.approved.contains(user));
    let chat_listed = rules
        .allow_chats
        .iter()
        .any(|g| g.matches(m.session.chat_id()));
    let denied = st.denied.contains(user);
    let allowed = !denied && (rules.mode == Mode::Open || listed || chat_listed);
    if !allowed {
        if !st.may_notice(user, now_ms) {
            return Decision::answer(Notice::Ignored, "");
        }
        if denied || rules.mode == Mode::Allowlist || user.is_empty() {
            return Decision::answer(
                Notice::Denied,
                "This bot is private: you are not on its list of users.",
            );
        }
        let platform = m.session.platform();
        return match st.code_for(user, now_ms) {
            Some(code) => Decision::answer(
                Notice::Pairing,
                format!(
                    "This bot is private. To ask for access, send its operator this code: {code} (valid for an hour). \
                 An admin approves it by writing `!approve {code}` to the bot; without an admin, the operator adds \
                 {user} to `allow` in the gateway's [access.{platform}] table."
                ),
            ),
            None => Decision::answer(
                Notice::Pairing,
                "This bot is private, and too many requests wait for approval: try again later.",
            ),
        };
    }
    if let Some(limit) = rules.tokens_per_day
        && st.tokens_on(user, now_ms / DAY_MS) >= limit
    {
        if !st.may_notice(user, now_ms) {
            return Decision::answer(Notice::Ignored, "");
        }
        return budget_spent(limit, now_ms);
    }
    if let Some(rate) = rules.rate {
        let per_ms = rate.per.as_millis() as u64;
        if let Err(wait_ms) = st.take_token(user, rate.count, per_ms, now_ms) {
            if !st.may_notice(user, now_ms) {
                return Decision::answer(Notice::Ignored, "");
            }
            let secs = wait_ms.div_ceil(1000);
            return Decision::answer(
                Notice::RateLimited,
                format!(
                    "Slow down: at most {} messages per {} s here. Try again in {secs} s.",
                    rate.count,
                    rate.per.as_secs()
                ),
            );
        }
    }
    Decision::Admit
}

/// Whether a group message is addressed to the bot, as its bridge marked it in `meta`.
fn addressed(m: &Message) -> bool {
    meta_value(m).is_some_and(|v| v.get(ADDRESSED_KEY) == Some(&serde_json::Value::Bool(true)))
}

/// The message's `meta` object, parsed (at most 16 KiB, checked at admission).
fn meta_value(m: &Message) -> Option<serde_json::Value> {
    serde_json::from_str(m.context.meta.as_deref()?).ok()
}

/// A string field of `meta`.
fn meta_str(m: &Message, key: &str) -> Option<String> {
    meta_value(m)?.get(key)?.as_str().map(str::to_owned)
}

/// An admin's `!` command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AdminCommand<'a> {
    Approve(&'a str),
    Allow(&'a str),
    Deny(&'a str),
    Pending,
    Users,
    Usage(Option<&'a str>),
    /// `!` and a word that is none of these: answered with the list.
    Unknown,
}

/// The admin command `m`'s text is, if any (`!word` first; a Matrix reply's quoted lines
/// are not part of the command).
fn admin_command(m: &Message) -> Option<AdminCommand<'_>> {
    let Body::Text(text) = &m.body else {
        return None;
    };
    parse_command(text.trim().strip_prefix('!')?)
}

/// An admin command's words without the `!` (`approve CODE`), as the chat and the
/// `turnstile access` CLI give them.
fn parse_command(text: &str) -> Option<AdminCommand<'_>> {
    let mut words = text.split_whitespace();
    let cmd = words.next()?;
    let arg = words.next();
    Some(match (cmd, arg) {
        ("approve", Some(code)) => AdminCommand::Approve(code),
        ("allow", Some(user)) => AdminCommand::Allow(user),
        ("deny", Some(user)) => AdminCommand::Deny(user),
        ("pending", _) => AdminCommand::Pending,
        ("users", _) => AdminCommand::Users,
        ("usage", user) => AdminCommand::Usage(user),
        _ => AdminCommand::Unknown,
    })
}

/// A titled list, cut at 50 lines (the rest counted).
fn list(title: &str, lines: impl Iterator<Item = String>) -> String {
    const MAX_LINES: usize = 50;
    let all: Vec<String> = lines.collect();
    let mut out = format!("{title}: {}", all.len());
    for l in all.iter().take(MAX_LINES) {
        let _ = write!(out, "\n{l}");
    }
    if all.len() > MAX_LINES {
        let _ = write!(out, "\n… and {} more", all.len() - MAX_LINES);
    }
    out
}

/// The policy's figures in the status.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AccessFigures {
    /// Messages answered with a notice, by `platform:kind`.
    pub refused: BTreeMap<String, u64>,
    /// Pairing codes waiting for an admin.
    pub pending_codes: usize,
    /// Users approved or denied.
    pub users_remembered: usize,
}

/// The writer of `access.json`: the reactor offers the newest state; a thread writes it
/// (to a temporary file, synced, then renamed over). Only the newest offer is kept: a slow
/// disk costs intermediate states, never the reactor's time, and memory stays one state.
pub(crate) struct Saver {
    slot: Arc<(Mutex<Option<Snapshot>>, Condvar)>,
}

impl Saver {
    fn start(path: PathBuf) -> std::io::Result<Saver> {
        let slot: Arc<(Mutex<Option<Snapshot>>, Condvar)> = Arc::default();
        let theirs = Arc::clone(&slot);
        std::thread::Builder::new()
            .name("access-saver".into())
            .spawn(move || save_loop(&path, &theirs))?;
        Ok(Saver { slot })
    }

    fn offer(&self, state: Snapshot) {
        let (lock, cv) = &*self.slot;
        if let Ok(mut s) = lock.lock() {
            *s = Some(state);
            cv.notify_one();
        }
    }
}

fn save_loop(path: &Path, slot: &(Mutex<Option<Snapshot>>, Condvar)) {
    let tmp = path.with_extension("json.tmp");
    loop {
        let state = {
            let Ok(mut s) = slot.0.lock() else { return };
            loop {
                if let Some(b) = s.take() {
                    break b;
                }
                s = match slot.1.wait(s) {
                    Ok(s) => s,
                    Err(_) => return,
                };
            }
        };
        let write = || -> std::io::Result<()> {
            let bytes = serde_json::to_vec(&state).map_err(std::io::Error::other)?;
            let mut f = std::fs::File::create(&tmp)?;
            std::io::Write::write_all(&mut f, &bytes)?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)
        };
        if let Err(e) = write() {
            // At most one write a second, or one per admin change: no flood.
            log::error!("access: cannot save {}: {e}", path.display());
        }
    }
}

#[cfg(test)]
mod tests;
