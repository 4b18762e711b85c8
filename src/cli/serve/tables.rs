//! `[[agent]]` and `[[route]]` tables of the `--config` file: several agents in one gateway,
//! routed (docs/agents.md). An agent table's options are the top-level agent options, read
//! by the same [`ServeArgs`] parsing; only the keys of its kind are allowed.

use serde::Deserialize;

use super::args::{AgentKind, ServeArgs};
use crate::agents::routes::{DEFAULT_AGENT, Glob, MAX_AGENTS, MAX_ROUTES, Route};
use crate::message::ChatType;

/// One `[[agent]]` table: its name, its kind, and its options (only its kind's keys set).
#[derive(Clone, Debug, Default)]
pub(crate) struct AgentTable {
    pub(super) name: String,
    pub(super) kind: Option<AgentKind>,
    pub(super) options: Box<ServeArgs>,
}

/// One `[[route]]` table as written.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct RouteSpec {
    platform: Option<String>,
    chat_type: Option<String>,
    chat: Option<String>,
    user: Option<String>,
    agent: String,
}

/// The options each kind of agent takes, by their top-level key.
fn keys_of(kind: AgentKind) -> &'static [&'static str] {
    match kind {
        AgentKind::Echo => &["echo-delay-ms"],
        AgentKind::Exec => &["agent-cmd", "agent-env"],
        AgentKind::Process => &[
            "agent-cmd",
            "agent-env",
            "agent-close-grace",
            "agent-max-line-bytes",
        ],
        AgentKind::Openai => &[
            "model",
            "openai-base-url",
            "openai-api-key-env",
            "system-prompt",
            "system-prompt-file",
            "history-turns",
            "history-chars",
            "openai-sender-prefix",
            "openai-vision",
            "openai-inline-text-bytes",
            "openai-connect-timeout",
            "openai-read-timeout",
            "openai-stream-timeout",
            "openai-tls-roots",
        ],
    }
}

/// Takes the `[[agent]]` array out of the file's table (the top-level `agent` key, when a
/// string, is the top-level agent's kind and stays), parsing each one.
pub(super) fn take_agent_tables(file: &mut toml::Table) -> Result<Option<Vec<AgentTable>>, String> {
    if !matches!(file.get("agent"), Some(toml::Value::Array(_))) {
        return Ok(None);
    }
    let Some(toml::Value::Array(tables)) = file.remove("agent") else {
        return Ok(None);
    };
    if tables.len() > MAX_AGENTS {
        return Err(format!(
            "[[agent]]: {} tables, at most {MAX_AGENTS}",
            tables.len()
        ));
    }
    let parsed = tables
        .into_iter()
        .enumerate()
        .map(|(i, t)| match t {
            toml::Value::Table(t) => agent_table(i + 1, t),
            _ => Err(format!("[[agent]] #{}: not a table", i + 1)),
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Some(parsed))
}

fn agent_table(number: usize, mut t: toml::Table) -> Result<AgentTable, String> {
    let name = match t.remove("name") {
        Some(toml::Value::String(n)) => n,
        Some(_) => return Err(format!("[[agent]] #{number}: name: must be a string")),
        None => return Err(format!("[[agent]] #{number}: needs a name")),
    };
    let what = format!("[[agent]] {name:?}");
    if name.is_empty()
        || name.len() > 64
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return Err(format!(
            "{what}: name: 1 to 64 letters, digits, '-', '_' or '.'"
        ));
    }
    if name == DEFAULT_AGENT {
        return Err(format!(
            "{what}: the name {DEFAULT_AGENT:?} is the top-level agent's"
        ));
    }
    let kind = match t.remove("kind") {
        Some(v) => v
            .try_into::<AgentKind>()
            .map_err(|e| format!("{what}: kind: {e} (echo, exec, process or openai)"))?,
        None => {
            return Err(format!(
                "{what}: needs a kind (echo, exec, process or openai)"
            ));
        }
    };
    let allowed = keys_of(kind);
    if let Some(key) = t.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(format!(
            "{what}: key {key:?} is not an option of a {} agent (its keys: {})",
            format!("{kind:?}").to_lowercase(),
            allowed.join(", ")
        ));
    }
    let options = toml::Value::Table(t)
        .try_into::<ServeArgs>()
        .map_err(|e| format!("{what}: {e}"))?;
    Ok(AgentTable {
        name,
        kind: Some(kind),
        options: Box::new(options),
    })
}

/// The routes with each agent resolved to its index among `names` (index 0 is the top-level
/// agent), checked: every agent known, no route after a catch-all.
pub(super) fn routes(specs: &[RouteSpec], names: &[&str]) -> Result<Vec<Route>, String> {
    if specs.len() > MAX_ROUTES {
        return Err(format!(
            "[[route]]: {} tables, at most {MAX_ROUTES}",
            specs.len()
        ));
    }
    let mut routes: Vec<Route> = Vec::with_capacity(specs.len());
    for (i, spec) in specs.iter().enumerate() {
        let what = format!("[[route]] #{} (agent {:?})", i + 1, spec.agent);
        if let Some(before) = routes.iter().position(Route::is_catch_all) {
            return Err(format!(
                "{what}: can never match: [[route]] #{} before it matches everything",
                before + 1
            ));
        }
        let agent = names.iter().position(|n| *n == spec.agent).ok_or_else(|| {
            format!(
                "{what}: agent: no [[agent]] table is named {:?}",
                spec.agent
            )
        })?;
        let chat_type = match &spec.chat_type {
            Some(c) => Some(ChatType::parse(c).ok_or_else(|| {
                format!("{what}: chat-type: {c:?} is not dm, group, channel or thread")
            })?),
            None => None,
        };
        routes.push(Route {
            platform: spec.platform.clone(),
            chat_type,
            chat: spec.chat.as_deref().map(Glob::new),
            user: spec.user.as_deref().map(Glob::new),
            agent,
        });
    }
    Ok(routes)
}

/// Each table's name once, and not more tables than the bound.
pub(super) fn check_names(tables: &[AgentTable]) -> Result<(), String> {
    for (i, t) in tables.iter().enumerate() {
        if tables[..i].iter().any(|o| o.name == t.name) {
            return Err(format!(
                "[[agent]] {:?}: a second table of that name (#{})",
                t.name,
                i + 1
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The issue's example resolves: its openai agent with its own model and URL, its
    /// process agent, its two routes; a top-level `agent` key beside the tables is named.
    #[test]
    fn the_issue_s_example_resolves() {
        let dir = std::env::temp_dir().join(format!("turnstile-tables-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("t.toml");
        let example = "[[agent]]\nname = \"support\"\nkind = \"openai\"\nmodel = \"small\"\n\
            openai-base-url = \"http://127.0.0.1:8000/v1\"\n\
            system-prompt = \"You answer questions about our product.\"\n\
            [[agent]]\nname = \"coder\"\nkind = \"process\"\nagent-cmd = \"python3 /opt/bots/coder.py\"\n\
            [[route]]\nplatform = \"matrix\"\nchat = \"!support:example.org\"\nagent = \"support\"\n\
            [[route]]\nchat = \"dev-*\"\nagent = \"coder\"\n";
        std::fs::write(&path, example).expect("write");
        let flags = ServeArgs {
            config: Some(path.clone()),
            ..ServeArgs::default()
        };
        let s = super::super::settings::resolve(flags.clone()).expect("valid");
        let names: Vec<_> = s.agents.iter().map(|a| (a.name.as_str(), a.kind)).collect();
        assert_eq!(
            names,
            [
                (DEFAULT_AGENT, AgentKind::Echo),
                ("support", AgentKind::Openai),
                ("coder", AgentKind::Process)
            ]
        );
        let openai = s.agents[1].openai.as_ref().expect("openai config");
        assert_eq!(openai.model, "small");
        assert_eq!(s.routes.len(), 2);
        assert_eq!((s.routes[0].agent, s.routes[1].agent), (1, 2));
        std::fs::write(&path, format!("agent = \"echo\"\n{example}")).expect("write");
        let e = super::super::settings::resolve(flags)
            .err()
            .expect("refused");
        assert!(e.contains("give the top-level agent with --agent"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// An openai table takes the attachment keys (issue 36), and its images are bounded by
    /// the gateway-wide `--max-attachment-bytes`.
    #[test]
    fn an_openai_table_takes_vision_and_the_gateway_s_attachment_bound() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("t.toml");
        let table = "[[agent]]\nname = \"eyes\"\nkind = \"openai\"\nmodel = \"m\"\n\
            openai-base-url = \"http://127.0.0.1:8000/v1\"\n\
            openai-vision = true\nopenai-inline-text-bytes = 100\n";
        std::fs::write(&path, table).expect("write");
        let flags = ServeArgs {
            config: Some(path),
            max_attachment_bytes: Some(crate::cli::units::Bytes(1000)),
            ..ServeArgs::default()
        };
        let s = super::super::settings::resolve(flags).expect("valid");
        let openai = s.agents[1].openai.as_ref().expect("openai config");
        assert!(openai.vision);
        assert_eq!(openai.inline_text_bytes, 100);
        assert_eq!(openai.max_image_bytes, 1000);
    }

    /// Every key a kind allows is a key of the top-level settings (one spelling of each).
    #[test]
    fn each_kind_s_keys_are_top_level_keys() {
        let serve = <ServeArgs as clap::Args>::augment_args(clap::Command::new("serve"));
        let longs: Vec<&str> = serve.get_arguments().filter_map(|a| a.get_long()).collect();
        for kind in [
            AgentKind::Echo,
            AgentKind::Exec,
            AgentKind::Process,
            AgentKind::Openai,
        ] {
            for key in keys_of(kind) {
                assert!(longs.contains(key), "{key} is not a flag of serve");
            }
        }
    }
}
