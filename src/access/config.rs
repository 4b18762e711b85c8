//! The `[access.<platform>]` tables of the `--config` file, validated: each key's error names
//! it (`access.matrix.rate: …`), so `--check-config` exits 2 saying which.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use super::glob::Glob;

/// Platforms whose bridges this crate ships: strangers reach them, so they default to
/// `pairing`; any other platform (a local `cli`, a third-party bridge) defaults to `open`.
pub(crate) const NATIVE_PLATFORMS: [&str; 5] = ["matrix", "irc", "telegram", "discord", "slack"];
/// Most `[access.*]` tables.
const MAX_TABLES: usize = 64;
/// Most patterns in one list (`admins`, `allow`, `allow-chats`).
const MAX_PATTERNS: usize = 1024;

/// One `[access.<platform>]` table as written.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct AccessTable {
    mode: Option<String>,
    #[serde(default)]
    admins: Vec<String>,
    #[serde(default)]
    allow: Vec<String>,
    #[serde(default)]
    allow_chats: Vec<String>,
    groups: Option<String>,
    rate: Option<String>,
    tokens_per_day: Option<u64>,
}

/// Who may use the bot on a platform.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Unknown users get a one-time code an admin approves.
    Pairing,
    /// Only listed (or approved) users; others get `denied`.
    Allowlist,
    /// Everyone.
    Open,
}

impl Mode {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Mode::Pairing => "pairing",
            Mode::Allowlist => "allowlist",
            Mode::Open => "open",
        }
    }
}

/// A per-user message rate: a token bucket holding `count`, refilled over `per`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Rate {
    pub(crate) count: u32,
    pub(crate) per: Duration,
}

/// One platform's rules, validated.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Rules {
    pub(crate) mode: Mode,
    pub(crate) admins: Vec<Glob>,
    pub(crate) allow: Vec<Glob>,
    pub(crate) allow_chats: Vec<Glob>,
    /// Group messages only when addressed to the bot (`groups = "mention"`, the default).
    pub(crate) mention_only: bool,
    pub(crate) rate: Option<Rate>,
    /// Tokens (the agent's reported usage) a user may spend per UTC day.
    pub(crate) tokens_per_day: Option<u64>,
}

/// Most `tokens-per-day` (10^12: far past any day's spend, far from overflowing a count).
const MAX_TOKENS_PER_DAY: u64 = 1_000_000_000_000;

impl Rules {
    /// The rules of a platform without a table.
    fn default_for(platform: &str) -> Rules {
        let native = NATIVE_PLATFORMS.contains(&platform);
        Rules {
            mode: if native { Mode::Pairing } else { Mode::Open },
            admins: Vec::new(),
            allow: Vec::new(),
            allow_chats: Vec::new(),
            // A third-party bridge may not mark mentions (`meta.to_bot`): without a table its
            // platform stays as it was, every group message answered.
            mention_only: native,
            rate: None,
            tokens_per_day: None,
        }
    }
}

/// The access policy's configuration: the tables, and whether platforms without one get
/// the safe defaults (`serve`) or are open (an embedder that configured nothing).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AccessConfig {
    tables: BTreeMap<String, Rules>,
    /// `matrix`, `irc` and `telegram` default to `pairing` (and groups to mention-only).
    native_defaults: bool,
}

impl AccessConfig {
    /// `serve`'s policy: the tables over the safe defaults (`native_defaults`: pair strangers
    /// on `matrix`, `irc`, `telegram`, `discord`, `slack`), or over open platforms. Errors name the key.
    pub(crate) fn from_tables(
        tables: &BTreeMap<String, AccessTable>,
        native_defaults: bool,
    ) -> Result<Self, String> {
        if tables.len() > MAX_TABLES {
            return Err(format!(
                "access: {} tables, at most {MAX_TABLES}",
                tables.len()
            ));
        }
        let mut out = AccessConfig {
            tables: BTreeMap::new(),
            native_defaults,
        };
        for (platform, t) in tables {
            crate::wire::check_platform(platform).map_err(|e| format!("access.{platform}: {e}"))?;
            let rules = rules(platform, t).map_err(|e| format!("access.{platform}.{e}"))?;
            out.tables.insert(platform.clone(), rules);
        }
        Ok(out)
    }

    /// The rules in force on `platform`: its table's, else the defaults.
    pub(crate) fn rules(&self, platform: &str) -> Option<&Rules> {
        self.tables.get(platform)
    }

    /// The rules in force on `platform` when it has no table.
    pub(crate) fn default_rules(&self, platform: &str) -> Rules {
        if self.native_defaults {
            Rules::default_for(platform)
        } else {
            Rules {
                mode: Mode::Open,
                mention_only: false,
                ..Rules::default_for(platform)
            }
        }
    }

    /// One line per platform saying the mode in force (the native ones, and every table).
    pub(crate) fn summary(&self) -> Vec<String> {
        let mut names: Vec<&str> = self.tables.keys().map(String::as_str).collect();
        if self.native_defaults {
            names.extend(
                NATIVE_PLATFORMS
                    .iter()
                    .filter(|p| !self.tables.contains_key(**p)),
            );
        }
        names.sort_unstable();
        let other = if self.native_defaults {
            "open"
        } else {
            "open (no policy)"
        };
        let mut lines: Vec<String> = names
            .into_iter()
            .map(|p| {
                let r = self
                    .tables
                    .get(p)
                    .cloned()
                    .unwrap_or_else(|| self.default_rules(p));
                format!(
                    "access: platform {p}: mode {}, {} admin pattern(s), groups {}{}{}",
                    r.mode.as_str(),
                    r.admins.len(),
                    if r.mention_only { "mention" } else { "all" },
                    r.rate
                        .map_or(String::new(), |r| format!(", rate {}/{:?}", r.count, r.per)),
                    r.tokens_per_day
                        .map_or(String::new(), |n| format!(", {n} tokens per day")),
                )
            })
            .collect();
        lines.push(format!("access: any other platform: {other}"));
        lines
    }
}

/// One table's rules; the error starts with the key.
fn rules(platform: &str, t: &AccessTable) -> Result<Rules, String> {
    // A table opts its platform into the policy: groups by mention unless it says `all`.
    let mut r = Rules {
        mention_only: true,
        ..Rules::default_for(platform)
    };
    if let Some(m) = &t.mode {
        r.mode = match m.as_str() {
            "pairing" => Mode::Pairing,
            "allowlist" => Mode::Allowlist,
            "open" => Mode::Open,
            other => return Err(format!("mode: {other:?} is not pairing, allowlist or open")),
        };
    }
    r.admins = globs("admins", &t.admins)?;
    r.allow = globs("allow", &t.allow)?;
    r.allow_chats = globs("allow-chats", &t.allow_chats)?;
    if let Some(g) = &t.groups {
        r.mention_only = match g.as_str() {
            "mention" => true,
            "all" => false,
            other => return Err(format!("groups: {other:?} is not mention or all")),
        };
    }
    r.rate = t
        .rate
        .as_deref()
        .map(parse_rate)
        .transpose()
        .map_err(|e| format!("rate: {e}"))?;
    r.tokens_per_day = match t.tokens_per_day {
        Some(n) if !(1..=MAX_TOKENS_PER_DAY).contains(&n) => {
            return Err(format!(
                "tokens-per-day: {n}: write a number of tokens from 1 to {MAX_TOKENS_PER_DAY}"
            ));
        }
        n => n,
    };
    Ok(r)
}

fn globs(key: &str, patterns: &[String]) -> Result<Vec<Glob>, String> {
    if patterns.len() > MAX_PATTERNS {
        return Err(format!(
            "{key}: {} patterns, at most {MAX_PATTERNS}",
            patterns.len()
        ));
    }
    patterns
        .iter()
        .map(|p| Glob::new(p).map_err(|e| format!("{key}: {e}")))
        .collect()
}

/// `N/s`, `N/min`, `N/hour` or `N/day`, N from 1 to 1,000,000.
pub(crate) fn parse_rate(s: &str) -> Result<Rate, String> {
    let bad = || format!("{s:?}: write N/s, N/min, N/hour or N/day with N from 1 to 1000000");
    let (n, unit) = s.split_once('/').ok_or_else(bad)?;
    let count: u32 = n.trim().parse().map_err(|_| bad())?;
    if !(1..=1_000_000).contains(&count) {
        return Err(bad());
    }
    let per = match unit.trim() {
        "s" | "sec" => 1,
        "min" => 60,
        "h" | "hour" => 3600,
        "day" => 86_400,
        _ => return Err(bad()),
    };
    Ok(Rate {
        count,
        per: Duration::from_secs(per),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(toml_like: impl FnOnce(&mut AccessTable)) -> BTreeMap<String, AccessTable> {
        let mut t = AccessTable::default();
        toml_like(&mut t);
        BTreeMap::from([("matrix".to_owned(), t)])
    }

    #[test]
    fn each_bad_key_is_named() {
        let err =
            |f: fn(&mut AccessTable)| AccessConfig::from_tables(&table(f), true).expect_err("bad");
        assert!(err(|t| t.mode = Some("closed".into())).starts_with("access.matrix.mode:"));
        assert!(err(|t| t.rate = Some("0/min".into())).starts_with("access.matrix.rate:"));
        assert!(err(|t| t.rate = Some("5/fortnight".into())).starts_with("access.matrix.rate:"));
        assert!(err(|t| t.allow = vec!["*".into()]).starts_with("access.matrix.allow:"));
        assert!(err(|t| t.groups = Some("some".into())).starts_with("access.matrix.groups:"));
        assert!(err(|t| t.admins = vec![String::new()]).starts_with("access.matrix.admins:"));
        assert!(err(|t| t.tokens_per_day = Some(0)).starts_with("access.matrix.tokens-per-day:"));
        let bad_name = BTreeMap::from([("no spaces".to_owned(), AccessTable::default())]);
        assert!(AccessConfig::from_tables(&bad_name, true).is_err());
    }

    #[test]
    fn native_platforms_default_to_pairing_and_others_to_open() {
        let c = AccessConfig::from_tables(&BTreeMap::new(), true).expect("empty");
        for p in NATIVE_PLATFORMS {
            assert_eq!(c.default_rules(p).mode, Mode::Pairing);
        }
        assert_eq!(c.default_rules("cli").mode, Mode::Open);
        assert!(
            c.default_rules("matrix").mention_only && !c.default_rules("whatsapp").mention_only
        );
        assert_eq!(
            AccessConfig::default().default_rules("matrix").mode,
            Mode::Open
        );
        assert_eq!(
            parse_rate("6/min"),
            Ok(Rate {
                count: 6,
                per: Duration::from_secs(60)
            })
        );
    }
}
