//! What a SIGHUP reload re-reads, and which of it can change without a restart.

use std::sync::{Arc, Mutex};

use crate::AgentFactory;
use crate::EchoAgent;
use crate::agents::exec::{ExecAgent, ExecOptions};
use crate::agents::openai::OpenAiFactory;
use crate::agents::process::{ProcessAgent, ProcessOptions};
use crate::ops::{Reload, ReloadLoader};

use super::args::{AgentKind, ServeArgs};
use super::settings::{AgentSpec, Settings, resolve};
use crate::agents::routes::{NamedAgent, Picks, RouteTable};

/// The agent factory the settings ask for: the top-level agent's, or with `[[agent]]`/
/// `[[route]]` tables a route table over all of them (its live picks counted in `picks`,
/// shared by every table of the process; the caller installs it once it is in force).
pub(super) fn make_factory(s: &Settings, picks: &Arc<Picks>) -> Result<Made, String> {
    if s.agents.len() == 1 && s.routes.is_empty() {
        return Ok((agent_factory(s, &s.agents[0])?, None));
    }
    let agents = s
        .agents
        .iter()
        .map(|spec| {
            Ok(NamedAgent {
                name: spec.name.as_str().into(),
                kind: spec.kind.name(),
                factory: agent_factory(s, spec)?,
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    let table = Arc::new(RouteTable::new(agents, s.routes.clone(), Arc::clone(picks)));
    Ok((Arc::clone(&table) as Arc<dyn AgentFactory>, Some(table)))
}

/// The factory for the runtime, and the route table behind it when there is one.
pub(super) type Made = (Arc<dyn AgentFactory>, Option<Arc<RouteTable>>);

/// One agent's factory.
fn agent_factory(s: &Settings, spec: &AgentSpec) -> Result<Arc<dyn AgentFactory>, String> {
    Ok(match (spec.kind, &spec.cmd, spec.openai.clone()) {
        (AgentKind::Exec, Some(cmd), _) => Arc::new(ExecAgent::factory_with(
            cmd,
            ExecOptions {
                env: spec.env.clone(),
                max_output_bytes: s.max_reply_bytes,
                outbox: s.bridge.attachments.clone(),
            },
        )),
        (AgentKind::Process, Some(cmd), _) => Arc::new(ProcessAgent::factory(ProcessOptions {
            command: cmd.clone(),
            env: spec.env.clone(),
            max_reply_bytes: s.max_reply_bytes,
            max_line_bytes: spec.max_line_bytes,
            stop_grace: s.core.config.stop_grace,
            close_grace: spec.close_grace,
            outbox: s.bridge.attachments.clone(),
            ..ProcessOptions::new(cmd)
        })),
        (AgentKind::Openai, _, Some(cfg)) => {
            let f = OpenAiFactory::new(cfg)
                .map_err(|e| format!("agent {} (openai): {e}", spec.name))?;
            match &s.memory {
                Some(load) => Arc::new(f.with_memory(Arc::clone(load))),
                None => Arc::new(f),
            }
        }
        _ => Arc::new(EchoAgent::factory(spec.echo_delay)),
    })
}

/// What a new agent factory depends on that a reload may change: the top-level agent's
/// command and echo delay, every agent table, every route.
pub(super) fn factory_key(s: &Settings) -> String {
    let top = &s.agents[0];
    format!(
        "{:?} {:?} {:?} {:?} {:?}",
        top.cmd,
        top.echo_delay,
        &s.agents[1..],
        s.routes,
        s.core.config.stop_grace
    )
}

/// The settings a reload cannot change, by name, with their values (compared, never logged:
/// they may hold secrets).
pub(super) fn restart_only(s: &Settings) -> Vec<(&'static str, String)> {
    let mut bridge = s.bridge.clone();
    bridge.auth_token = None;
    let http = s.http.clone().map(|(addr, mut cfg)| {
        cfg.auth_token = None;
        (addr, cfg)
    });
    let top = &s.agents[0];
    vec![
        ("listen", format!("{:?}", s.listen)),
        ("http-listen and the http bounds", format!("{http:?}")),
        ("agent", format!("{:?}", top.kind)),
        ("agent-env", format!("{:?}", top.env)),
        ("agent-close-grace", format!("{:?}", top.close_grace)),
        ("agent-max-line-bytes", format!("{:?}", top.max_line_bytes)),
        ("max-reply-bytes", format!("{:?}", s.max_reply_bytes)),
        ("turn-workers", format!("{:?}", s.core.config.turn_workers)),
        (
            "max-held-turns",
            format!("{:?}", s.core.config.max_held_turns),
        ),
        ("cleanup-workers", format!("{:?}", s.core.cleanup_workers)),
        (
            "max-cleanup-workers",
            format!("{:?}", s.core.config.cleanup_concurrency),
        ),
        (
            "max-cached-agents",
            format!("{:?}", s.core.config.max_cached_agents),
        ),
        (
            "agent-idle-ttl",
            format!("{:?}", s.core.config.agent_idle_ttl),
        ),
        (
            "max-queued-messages",
            format!("{:?}", s.core.config.max_queued_messages),
        ),
        (
            "max-queued-bytes",
            format!("{:?}", s.core.config.max_queued_bytes),
        ),
        ("status-file", format!("{:?}", s.status_file)),
        ("bridge tables", format!("{:?}", s.bridges)),
        ("openai settings", format!("{:?}", top.openai)),
        ("the bridge's bounds", format!("{bridge:?}")),
        (
            "allow-insecure-bind",
            format!("{:?}", s.allow_insecure_bind),
        ),
        // Turning TLS on or off changes what every client must speak; the pair itself is
        // read again on every reload.
        ("tls-cert (TLS on or off)", format!("{:?}", s.tls.is_some())),
    ]
}

/// SIGHUP: re-reads the flags and `--config` file (on a helper thread) into a [`Reload`].
pub(super) fn reload_loader(
    flags: ServeArgs,
    initial: &Settings,
    picks: Arc<Picks>,
) -> ReloadLoader {
    let fixed = restart_only(initial);
    let fixed_top = initial.agents[0].clone();
    let tls_on = initial.tls.is_some();
    let last_key = Mutex::new(factory_key(initial));
    let memory = initial.memory.clone();
    // The spool made at start (its canonical path, or the private temporary directory):
    // a new factory's outboxes go there, whatever the flags now say (a restart applies them).
    let spool = initial.bridge.attachments.clone();
    Arc::new(move || {
        let mut new = resolve(flags.clone())?;
        new.memory = memory.clone();
        let restart_needed = restart_only(&new)
            .into_iter()
            .zip(&fixed)
            .filter(|((_, now), (_, was))| now != was)
            .map(|((name, _), _)| name.to_owned())
            .collect();
        // The top-level agent's other settings need a restart (named above): the new
        // factory keeps the ones in force.
        new.agents[0] = AgentSpec {
            cmd: new.agents[0].cmd.clone(),
            echo_delay: new.agents[0].echo_delay,
            ..fixed_top.clone()
        };
        new.bridge.attachments = spool.clone();
        let key = factory_key(&new);
        let mut last = last_key.lock().unwrap_or_else(|e| e.into_inner());
        let factory = if *last != key {
            let (f, table) = make_factory(&new, &picks)?;
            if let Some(table) = &table {
                // The last fallible step is behind: this table is the one in force.
                picks.install(table);
            }
            *last = key;
            Some(f)
        } else {
            None
        };
        Ok(Reload {
            tunables: new.core.config.tunables(),
            partial_interval: new.core.partial_interval,
            auth_token: new.bridge.auth_token.clone(),
            factory,
            restart_needed,
            // A new pair only for listeners that serve TLS; a bad one failed `resolve` above,
            // which keeps the one in force (the reload is refused with an ERROR).
            tls: if tls_on { new.tls } else { None },
        })
    })
}
