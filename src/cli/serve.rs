//! `turnstile serve`: flags, the optional TOML config file, and the server's lifetime.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::AgentFactory;
use crate::agents::child::{self, AgentEnv};
use crate::agents::exec::{ExecAgent, ExecOptions};
use crate::agents::openai::{
    ApiKey, DEFAULT_CONNECT_TIMEOUT, DEFAULT_HISTORY_CHARS, DEFAULT_HISTORY_TURNS,
    DEFAULT_READ_TIMEOUT, OpenAiConfig, OpenAiFactory, TlsRoots,
};
use crate::agents::process::{self, ProcessAgent, ProcessOptions};
use crate::core::{CoreConfig, Tunables};
use crate::journal::JournalConfig;
use crate::ops::http::{self, DEFAULT_HTTP_LISTEN, HttpConfig, HttpServer};
use crate::ops::notify::SdNotify;
use crate::ops::{Ops, Reload, ReloadApplier, ReloadLoader, SwappableFactory};
use crate::reactor::DEFAULT_PARTIAL_INTERVAL;
use crate::server::{BridgeConfig, BridgeServer, ServerConfig};
use crate::{Builder, BusyMode, EchoAgent, Handle, Runtime};
use clap::{Args, ValueEnum};
use serde::Deserialize;

use super::USAGE_ERROR;

/// Where `serve` listens unless told otherwise.
pub(crate) const DEFAULT_LISTEN: ([u8; 4], u16) = ([127, 0, 0, 1], 7878);

/// Which agent serves the sessions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum AgentKind {
    /// Replies with its input.
    Echo,
    /// Runs --agent-cmd through `sh -c` per turn.
    Exec,
    /// Runs --agent-cmd once per session, speaking JSON lines (docs/agent-protocol.md).
    Process,
    /// An OpenAI-compatible chat-completions server (--openai-base-url, --model).
    Openai,
}

/// `--openai-tls-roots` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum TlsRootsArg {
    /// The operating system's certificate store.
    Platform,
    /// Mozilla's roots built into the binary.
    Webpki,
}

/// Flags of `serve`; the same keys (kebab-case) may appear in the `--config` TOML file, and
/// flags override the file.
#[derive(Args, Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct ServeArgs {
    /// TOML file with any of these settings.
    #[arg(long)]
    #[serde(skip)]
    config: Option<PathBuf>,
    /// Address to listen on
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Agent
    #[arg(long, value_enum)]
    agent: Option<AgentKind>,
    /// Shell command of the exec or process agent.
    #[arg(long)]
    agent_cmd: Option<String>,
    /// Seconds a process agent gets to exit after `close` before SIGTERM
    #[arg(long)]
    agent_close_grace: Option<f64>,
    /// Pass this variable of the gateway's environment to agent processes (repeatable).
    #[arg(long, value_name = "NAME")]
    agent_env: Option<Vec<String>>,
    /// Longest line a process agent may write on stdout
    #[arg(long)]
    agent_max_line_bytes: Option<usize>,
    /// Replies and partials are cut to this many bytes and flagged truncated
    #[arg(long)]
    max_reply_bytes: Option<usize>,
    /// Simulated work per echo turn, in milliseconds (cancellable)
    #[arg(long)]
    echo_delay_ms: Option<u64>,
    /// What a message does while its session's turn runs
    #[arg(long, value_enum)]
    busy_mode: Option<BusyMode>,
    /// Messages a session may hold waiting
    #[arg(long)]
    queue_cap: Option<usize>,
    /// Threads running agent turns
    #[arg(long)]
    turn_workers: Option<usize>,
    /// Threads closing agents that always run
    #[arg(long)]
    cleanup_workers: Option<usize>,
    /// Agent close()s that may run at once; the cleanup pool grows on demand up to this
    #[arg(long)]
    max_cleanup_workers: Option<usize>,
    /// Idle agents kept for reuse; sessions with waiting work keep theirs beyond it
    #[arg(long)]
    max_cached_agents: Option<usize>,
    /// Seconds an idle agent is kept before it is closed
    #[arg(long)]
    agent_idle_ttl: Option<f64>,
    /// Messages waiting across all sessions before new ones are rejected `overloaded`
    #[arg(long)]
    max_queued_messages: Option<usize>,
    /// Bytes of text waiting across all sessions before new messages are rejected
    /// `overloaded`
    #[arg(long)]
    max_queued_bytes: Option<usize>,
    /// Least seconds between two partial replies forwarded for one turn
    #[arg(long)]
    partial_interval: Option<f64>,
    /// Seconds a turn may run
    #[arg(long)]
    turn_timeout: Option<f64>,
    /// Seconds a cancelled turn gets to return
    #[arg(long)]
    stop_grace: Option<f64>,
    /// Seconds an agent's close() may take
    #[arg(long)]
    cleanup_timeout: Option<f64>,
    /// Seconds shutdown lets running turns finish
    #[arg(long)]
    drain_timeout: Option<f64>,
    /// Write the status snapshot to this JSON file.
    #[arg(long)]
    status_file: Option<PathBuf>,
    /// Token every bridge must present in its hello.
    #[arg(long, env = "TURNSTILE_AUTH_TOKEN", hide_env_values = true)]
    auth_token: Option<String>,
    /// Connections beyond this are refused
    #[arg(long)]
    max_connections: Option<usize>,
    /// Longest accepted protocol line
    #[arg(long)]
    max_line_bytes: Option<usize>,
    /// Unwritten output per connection past which its reads pause and typing/partial lines
    /// are dropped; also the outbox backlog it is fed at a time
    #[arg(long)]
    max_write_buffer: Option<usize>,
    /// Undelivered results a platform may have (reserved at admission; `backpressure`
    /// beyond)
    #[arg(long)]
    outbox_cap: Option<usize>,
    /// Model name for --agent openai.
    #[arg(long)]
    model: Option<String>,
    /// Base URL of the OpenAI-compatible API, e.g. http://127.0.0.1:11434/v1 (required with
    /// --agent openai; https://api.openai.com/v1 for OpenAI).
    #[arg(long)]
    openai_base_url: Option<String>,
    /// Environment variable holding the API key
    #[arg(long)]
    openai_api_key_env: Option<String>,
    /// System prompt of the openai agent.
    #[arg(long)]
    system_prompt: Option<String>,
    /// File whose text is the system prompt.
    #[arg(long)]
    system_prompt_file: Option<PathBuf>,
    /// Past user/assistant exchanges sent with each message
    #[arg(long)]
    history_turns: Option<usize>,
    /// Character budget of a request's conversation
    #[arg(long)]
    history_chars: Option<usize>,
    /// Prefix "[from: NAME (id ID); meta: {...}]" to the user's text
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    openai_sender_prefix: Option<bool>,
    /// Seconds to open a connection to the API
    #[arg(long)]
    openai_connect_timeout: Option<f64>,
    /// Seconds the API may stay silent before the turn fails
    #[arg(long)]
    openai_read_timeout: Option<f64>,
    /// Certificate authorities for https
    #[arg(long, value_enum)]
    openai_tls_roots: Option<TlsRootsArg>,
    /// Bytes a platform may have reserved for undelivered results; each accepted message
    /// reserves --max-reply-bytes + 8 KiB (`backpressure` beyond)
    #[arg(long)]
    outbox_bytes: Option<usize>,
    /// Platforms known at once; a hello or message for another gets `error`/`overloaded`
    #[arg(long)]
    max_platforms: Option<usize>,
    /// Message ids a platform's duplicate window holds (`backpressure` beyond)
    #[arg(long)]
    dedup_max: Option<usize>,
    /// Seconds an accepted (platform, id) is remembered
    #[arg(long)]
    dedup_window: Option<f64>,
    /// Connections waiting for their hello (with a token), in all
    #[arg(long)]
    max_unauthenticated: Option<usize>,
    /// Connections waiting for their hello (with a token), per peer address
    #[arg(long)]
    max_unauthenticated_per_peer: Option<usize>,
    /// Seconds a connection has to send its hello (with a token)
    #[arg(long)]
    hello_timeout: Option<f64>,
    /// Bytes written to one connection per loop wake
    #[arg(long)]
    write_budget: Option<usize>,
    /// Seconds a connection with output may take none of it before it is closed (its
    /// results go back to the outbox)
    #[arg(long)]
    write_stall_timeout: Option<f64>,
    /// Address of the operations HTTP endpoint (/healthz, /readyz, /status, /metrics), or
    /// `off`.
    #[arg(long, value_name = "ADDR|off")]
    http_listen: Option<String>,
    /// Open connections to the HTTP endpoint; one more gets 503.
    #[arg(long)]
    http_max_connections: Option<usize>,
    /// Bytes of an HTTP request head; more gets 431.
    #[arg(long)]
    http_max_header_bytes: Option<usize>,
    /// HTTP requests served per connection before it is closed.
    #[arg(long)]
    http_max_requests: Option<usize>,
    /// Seconds an HTTP connection has to complete a request.
    #[arg(long)]
    http_idle_timeout: Option<f64>,
    /// Listen on a non-loopback address without an auth token.
    #[arg(long)]
    #[serde(default)]
    allow_insecure_bind: bool,
    /// Directory of the journal: turns durability on (acks after the message is on disk,
    /// recovery after a crash).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// At recovery, run again the turns a crash interrupted instead of failing them
    /// `interrupted by restart` (a message interrupted twice fails `poison`).
    #[arg(long)]
    #[serde(default)]
    resume_interrupted: bool,
    /// Accepted messages waiting for the journal at once before `reject overloaded`.
    #[arg(long)]
    max_pending_durable: Option<usize>,
    /// Check the flags and the configuration file, then exit: 0 if valid, 2 if not.
    #[arg(long)]
    #[serde(skip)]
    check_config: bool,
}

/// `/readyz`'s store check: the bridge's journal status says whether its last write failed.
fn store_ready(status: &crate::Status) -> Result<(), String> {
    let failing = status
        .frontend
        .as_ref()
        .and_then(|f| f.pointer("/journal/failing"))
        .and_then(serde_json::Value::as_bool);
    match failing {
        Some(true) => Err("journal writes are failing".into()),
        _ => Ok(()),
    }
}

/// Each flag's default as `serve --help` shows it, read from where the default is defined
/// (the core's, the bridge's and the agents' own defaults), never typed twice.
fn defaults() -> Vec<(&'static str, String)> {
    let core = CoreConfig::default();
    let bridge = BridgeConfig::default();
    let secs = |d: Duration| format!("{}s", d.as_secs_f64());
    let bytes = |n: usize| match n {
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{} KiB", n >> 10),
        n => n.to_string(),
    };
    let lower = |v: &dyn std::fmt::Debug| format!("{v:?}").to_lowercase();
    vec![
        ("listen", SocketAddr::from(DEFAULT_LISTEN).to_string()),
        ("http-listen", DEFAULT_HTTP_LISTEN.to_owned()),
        (
            "http-max-connections",
            http::DEFAULT_MAX_CONNECTIONS.to_string(),
        ),
        (
            "http-max-header-bytes",
            bytes(http::DEFAULT_MAX_HEADER_BYTES),
        ),
        ("http-max-requests", http::DEFAULT_MAX_REQUESTS.to_string()),
        ("http-idle-timeout", secs(http::DEFAULT_IDLE_TIMEOUT)),
        ("agent", lower(&AgentKind::Echo)),
        ("agent-close-grace", secs(process::DEFAULT_CLOSE_GRACE)),
        (
            "agent-max-line-bytes",
            bytes(process::DEFAULT_MAX_LINE_BYTES),
        ),
        ("max-reply-bytes", bytes(bridge.max_reply_bytes)),
        ("echo-delay-ms", "0".into()),
        ("busy-mode", lower(&core.busy_mode)),
        ("queue-cap", core.queue_cap.to_string()),
        ("turn-workers", core.turn_workers.to_string()),
        (
            "cleanup-workers",
            crate::reactor::DEFAULT_CLEANUP_WORKERS.to_string(),
        ),
        ("max-cleanup-workers", core.cleanup_concurrency.to_string()),
        ("max-cached-agents", core.max_cached_agents.to_string()),
        ("agent-idle-ttl", secs(core.agent_idle_ttl)),
        ("max-queued-messages", core.max_queued_messages.to_string()),
        ("max-queued-bytes", bytes(core.max_queued_bytes)),
        ("partial-interval", secs(DEFAULT_PARTIAL_INTERVAL)),
        ("turn-timeout", secs(core.turn_timeout)),
        ("stop-grace", secs(core.stop_grace)),
        ("cleanup-timeout", secs(core.cleanup_timeout)),
        ("drain-timeout", secs(core.drain_timeout)),
        ("max-connections", bridge.max_connections.to_string()),
        ("max-line-bytes", bytes(bridge.max_line_bytes)),
        ("max-write-buffer", bytes(bridge.max_write_buffer)),
        ("outbox-cap", bridge.outbox_cap.to_string()),
        ("outbox-bytes", bytes(bridge.outbox_bytes)),
        ("max-platforms", bridge.max_platforms.to_string()),
        ("dedup-max", bridge.dedup_max.to_string()),
        ("dedup-window", secs(bridge.dedup_window)),
        (
            "max-unauthenticated",
            bridge.max_unauthenticated.to_string(),
        ),
        (
            "max-unauthenticated-per-peer",
            bridge.max_unauthenticated_per_peer.to_string(),
        ),
        ("hello-timeout", secs(bridge.hello_timeout)),
        ("write-budget", bytes(bridge.write_budget)),
        ("write-stall-timeout", secs(bridge.write_stall_timeout)),
        (
            "max-pending-durable",
            bridge.max_pending_durable.to_string(),
        ),
        ("openai-api-key-env", "OPENAI_API_KEY".into()),
        ("history-turns", DEFAULT_HISTORY_TURNS.to_string()),
        ("history-chars", DEFAULT_HISTORY_CHARS.to_string()),
        ("openai-sender-prefix", "false".into()),
        ("openai-connect-timeout", secs(DEFAULT_CONNECT_TIMEOUT)),
        ("openai-read-timeout", secs(DEFAULT_READ_TIMEOUT)),
        ("openai-tls-roots", lower(&TlsRootsArg::Platform)),
    ]
}

/// Adds each flag's default to its help. The flags are `Option`s (so a config file can fill
/// what the command line left out), which is why clap cannot show the defaults itself.
pub(crate) fn document_defaults(serve: clap::Command) -> clap::Command {
    defaults().into_iter().fold(serve, |serve, (flag, value)| {
        serve.mut_arg(flag.replace('-', "_"), |arg| {
            let help = arg.get_help().map(ToString::to_string).unwrap_or_default();
            let long = arg.get_long_help().map(ToString::to_string);
            let arg = arg.help(format!("{help} [default: {value}]"));
            match long {
                Some(long) => arg.long_help(format!("{long} [default: {value}]")),
                None => arg,
            }
        })
    })
}

macro_rules! merge {
    ($flags:ident, $file:ident, $($field:ident),*) => {
        ServeArgs {
            config: None,
            check_config: $flags.check_config,
            allow_insecure_bind: $flags.allow_insecure_bind || $file.allow_insecure_bind,
            resume_interrupted: $flags.resume_interrupted || $file.resume_interrupted,
            $($field: $flags.$field.or($file.$field)),*
        }
    };
}

/// Every value resolved and checked.
struct Settings {
    listen: SocketAddr,
    agent: AgentKind,
    agent_cmd: Option<String>,
    agent_close_grace: Duration,
    agent_env: AgentEnv,
    agent_max_line_bytes: usize,
    max_reply_bytes: usize,
    echo_delay: Duration,
    busy_mode: BusyMode,
    queue_cap: usize,
    turn_workers: usize,
    cleanup_workers: usize,
    max_cleanup_workers: usize,
    max_cached_agents: usize,
    agent_idle_ttl: Duration,
    max_queued_messages: usize,
    max_queued_bytes: usize,
    partial_interval: Duration,
    turn_timeout: Duration,
    stop_grace: Duration,
    cleanup_timeout: Duration,
    drain_timeout: Duration,
    status_file: Option<PathBuf>,
    openai: Option<OpenAiConfig>,
    bridge: BridgeConfig,
    allow_insecure_bind: bool,
    data_dir: Option<PathBuf>,
    /// The HTTP endpoint's address and settings; `None` when `off`.
    http: Option<(SocketAddr, HttpConfig)>,
}

fn seconds(
    name: &str,
    value: Option<f64>,
    default: f64,
    allow_zero: bool,
) -> Result<Duration, String> {
    let v = value.unwrap_or(default);
    if !v.is_finite() || v < 0.0 || (!allow_zero && v == 0.0) || v > 1e9 {
        let range = if allow_zero {
            "0 or more"
        } else {
            "greater than 0"
        };
        return Err(format!(
            "--{name}: {v} is not a valid number of seconds ({range})"
        ));
    }
    Ok(Duration::from_secs_f64(v))
}

fn at_least_one(name: &str, value: Option<usize>, default: usize) -> Result<usize, String> {
    match value.unwrap_or(default) {
        0 => Err(format!("--{name}: must be at least 1")),
        v => Ok(v),
    }
}

/// The command line over the `--config` file: a flag wins over the file's key.
fn merged_args(flags: ServeArgs) -> Result<ServeArgs, String> {
    let file = match &flags.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("--config {}: {e}", path.display()))?;
            toml::from_str::<ServeArgs>(&text)
                .map_err(|e| format!("--config {}: {e}", path.display()))?
        }
        None => ServeArgs::default(),
    };
    let a = merge!(
        flags,
        file,
        listen,
        agent,
        agent_cmd,
        agent_close_grace,
        agent_env,
        agent_max_line_bytes,
        max_reply_bytes,
        echo_delay_ms,
        busy_mode,
        queue_cap,
        turn_workers,
        cleanup_workers,
        max_cleanup_workers,
        max_cached_agents,
        agent_idle_ttl,
        max_queued_messages,
        max_queued_bytes,
        partial_interval,
        turn_timeout,
        stop_grace,
        cleanup_timeout,
        drain_timeout,
        status_file,
        auth_token,
        max_connections,
        max_line_bytes,
        max_write_buffer,
        outbox_cap,
        model,
        openai_base_url,
        openai_api_key_env,
        system_prompt,
        system_prompt_file,
        history_turns,
        history_chars,
        openai_sender_prefix,
        openai_connect_timeout,
        openai_read_timeout,
        openai_tls_roots,
        outbox_bytes,
        max_platforms,
        dedup_max,
        dedup_window,
        max_unauthenticated,
        max_unauthenticated_per_peer,
        hello_timeout,
        write_budget,
        write_stall_timeout,
        data_dir,
        max_pending_durable,
        http_listen,
        http_max_connections,
        http_max_header_bytes,
        http_max_requests,
        http_idle_timeout
    );
    Ok(a)
}

/// The bridge's bounds and durability settings, each checked and named when wrong.
fn bridge_config(a: &ServeArgs, max_reply_bytes: usize) -> Result<BridgeConfig, String> {
    let bridge_default = BridgeConfig::default();
    let bridge = BridgeConfig {
        auth_token: a.auth_token.clone(),
        max_connections: at_least_one(
            "max-connections",
            a.max_connections,
            bridge_default.max_connections,
        )?,
        max_unauthenticated: at_least_one(
            "max-unauthenticated",
            a.max_unauthenticated,
            bridge_default.max_unauthenticated,
        )?,
        max_unauthenticated_per_peer: at_least_one(
            "max-unauthenticated-per-peer",
            a.max_unauthenticated_per_peer,
            bridge_default.max_unauthenticated_per_peer,
        )?,
        hello_timeout: seconds(
            "hello-timeout",
            a.hello_timeout,
            bridge_default.hello_timeout.as_secs_f64(),
            false,
        )?,
        max_line_bytes: at_least_one(
            "max-line-bytes",
            a.max_line_bytes,
            bridge_default.max_line_bytes,
        )?,
        max_write_buffer: at_least_one(
            "max-write-buffer",
            a.max_write_buffer,
            bridge_default.max_write_buffer,
        )?,
        write_budget: at_least_one("write-budget", a.write_budget, bridge_default.write_budget)?,
        write_stall_timeout: seconds(
            "write-stall-timeout",
            a.write_stall_timeout,
            bridge_default.write_stall_timeout.as_secs_f64(),
            false,
        )?,
        max_platforms: at_least_one(
            "max-platforms",
            a.max_platforms,
            bridge_default.max_platforms,
        )?,
        outbox_cap: at_least_one("outbox-cap", a.outbox_cap, bridge_default.outbox_cap)?,
        outbox_bytes: at_least_one("outbox-bytes", a.outbox_bytes, bridge_default.outbox_bytes)?,
        max_reply_bytes,
        journal: a.data_dir.is_some(),
        max_pending_durable: at_least_one(
            "max-pending-durable",
            a.max_pending_durable,
            bridge_default.max_pending_durable,
        )?,
        resume_interrupted: a.resume_interrupted,
        dedup_window: seconds(
            "dedup-window",
            a.dedup_window,
            bridge_default.dedup_window.as_secs_f64(),
            false,
        )?,
        dedup_max: at_least_one("dedup-max", a.dedup_max, bridge_default.dedup_max)?,
        ..BridgeConfig::default()
    };
    let reserve = max_reply_bytes.saturating_add(crate::server::bridge::TERMINAL_ENVELOPE);
    if bridge.outbox_bytes < reserve {
        return Err(format!(
            "--outbox-bytes: {} is less than one result's reservation ({reserve} bytes: --max-reply-bytes + 8 KiB)",
            bridge.outbox_bytes
        ));
    }
    Ok(bridge)
}

/// The HTTP endpoint's address and bounds, or `None` for `--http-listen off`.
fn http_settings(a: &ServeArgs) -> Result<Option<(SocketAddr, HttpConfig)>, String> {
    let http = match a.http_listen.as_deref().map(str::trim) {
        Some("off") => None,
        spec => {
            let addr: SocketAddr = spec.unwrap_or(DEFAULT_HTTP_LISTEN).parse().map_err(|e| {
                format!(
                    "--http-listen {}: {e} (an address like 127.0.0.1:7879, or off)",
                    spec.unwrap_or_default()
                )
            })?;
            if !addr.ip().is_loopback() && a.auth_token.is_none() && !a.allow_insecure_bind {
                return Err(format!(
                    "--http-listen {addr}: a non-loopback address needs --auth-token (or --allow-insecure-bind)"
                ));
            }
            let max_connections = at_least_one(
                "http-max-connections",
                a.http_max_connections,
                http::DEFAULT_MAX_CONNECTIONS,
            )?;
            if max_connections > http::MAX_CONNECTIONS_LIMIT {
                return Err(format!(
                    "--http-max-connections: must be at most {} (got {max_connections})",
                    http::MAX_CONNECTIONS_LIMIT
                ));
            }
            let max_header_bytes = at_least_one(
                "http-max-header-bytes",
                a.http_max_header_bytes,
                http::DEFAULT_MAX_HEADER_BYTES,
            )?;
            if max_header_bytes < 64 {
                return Err(format!(
                    "--http-max-header-bytes: must be at least 64 (got {max_header_bytes})"
                ));
            }
            let cfg = HttpConfig {
                auth_token: a.auth_token.clone(),
                max_connections,
                max_header_bytes,
                max_requests: at_least_one(
                    "http-max-requests",
                    a.http_max_requests,
                    http::DEFAULT_MAX_REQUESTS,
                )?,
                idle_timeout: seconds(
                    "http-idle-timeout",
                    a.http_idle_timeout,
                    http::DEFAULT_IDLE_TIMEOUT.as_secs_f64(),
                    false,
                )?,
            };
            Some((addr, cfg))
        }
    };
    Ok(http)
}

fn resolve(flags: ServeArgs) -> Result<Settings, String> {
    let a = merged_args(flags)?;
    let agent = a.agent.unwrap_or(AgentKind::Echo);
    let needs_cmd = matches!(agent, AgentKind::Exec | AgentKind::Process);
    if needs_cmd && a.agent_cmd.as_deref().is_none_or(|c| c.trim().is_empty()) {
        let name = if agent == AgentKind::Exec {
            "exec"
        } else {
            "process"
        };
        return Err(format!("--agent {name} needs --agent-cmd"));
    }
    let agent_close_grace = seconds(
        "agent-close-grace",
        a.agent_close_grace,
        process::DEFAULT_CLOSE_GRACE.as_secs_f64(),
        true,
    )?;
    let core_default = CoreConfig::default();
    let bridge_default = BridgeConfig::default();
    let cleanup_timeout = seconds(
        "cleanup-timeout",
        a.cleanup_timeout,
        core_default.cleanup_timeout.as_secs_f64(),
        false,
    )?;
    if agent == AgentKind::Process && agent_close_grace + process::CLOSE_OVERHEAD > cleanup_timeout
    {
        return Err(format!(
            "--agent-close-grace: {:?} plus {:?} to terminate and kill must fit in --cleanup-timeout ({cleanup_timeout:?})",
            agent_close_grace,
            process::CLOSE_OVERHEAD
        ));
    }
    if a.auth_token.as_deref() == Some("") {
        return Err("--auth-token: must not be empty".into());
    }
    let openai = match agent {
        AgentKind::Openai => Some(openai_config(&a)?),
        _ => None,
    };
    let listen = a.listen.unwrap_or_else(|| SocketAddr::from(DEFAULT_LISTEN));
    if !listen.ip().is_loopback() && a.auth_token.is_none() && !a.allow_insecure_bind {
        return Err(format!(
            "--listen {listen}: a non-loopback address needs --auth-token (or --allow-insecure-bind)"
        ));
    }
    let max_reply_bytes = at_least_one(
        "max-reply-bytes",
        a.max_reply_bytes,
        bridge_default.max_reply_bytes,
    )?;
    let bridge = bridge_config(&a, max_reply_bytes)?;
    let http = http_settings(&a)?;
    Ok(Settings {
        http,
        listen,
        bridge,
        max_reply_bytes,
        allow_insecure_bind: a.allow_insecure_bind,
        data_dir: a.data_dir,
        agent,
        agent_cmd: a.agent_cmd,
        agent_close_grace,
        agent_env: AgentEnv::new(a.agent_env.unwrap_or_default())?,
        agent_max_line_bytes: at_least_one(
            "agent-max-line-bytes",
            a.agent_max_line_bytes,
            process::DEFAULT_MAX_LINE_BYTES,
        )?,
        echo_delay: Duration::from_millis(a.echo_delay_ms.unwrap_or(0)),
        busy_mode: a.busy_mode.unwrap_or(core_default.busy_mode),
        queue_cap: at_least_one("queue-cap", a.queue_cap, core_default.queue_cap)?,
        turn_workers: at_least_one("turn-workers", a.turn_workers, core_default.turn_workers)?,
        cleanup_workers: at_least_one(
            "cleanup-workers",
            a.cleanup_workers,
            crate::reactor::DEFAULT_CLEANUP_WORKERS,
        )?,
        max_cleanup_workers: at_least_one(
            "max-cleanup-workers",
            a.max_cleanup_workers,
            core_default.cleanup_concurrency,
        )?,
        max_cached_agents: a
            .max_cached_agents
            .unwrap_or(core_default.max_cached_agents),
        agent_idle_ttl: seconds(
            "agent-idle-ttl",
            a.agent_idle_ttl,
            core_default.agent_idle_ttl.as_secs_f64(),
            false,
        )?,
        max_queued_messages: at_least_one(
            "max-queued-messages",
            a.max_queued_messages,
            core_default.max_queued_messages,
        )?,
        max_queued_bytes: at_least_one(
            "max-queued-bytes",
            a.max_queued_bytes,
            core_default.max_queued_bytes,
        )?,
        partial_interval: seconds(
            "partial-interval",
            a.partial_interval,
            DEFAULT_PARTIAL_INTERVAL.as_secs_f64(),
            true,
        )?,
        turn_timeout: seconds(
            "turn-timeout",
            a.turn_timeout,
            core_default.turn_timeout.as_secs_f64(),
            false,
        )?,
        stop_grace: seconds(
            "stop-grace",
            a.stop_grace,
            core_default.stop_grace.as_secs_f64(),
            true,
        )?,
        cleanup_timeout,
        drain_timeout: seconds(
            "drain-timeout",
            a.drain_timeout,
            core_default.drain_timeout.as_secs_f64(),
            true,
        )?,
        status_file: a.status_file,
        openai,
    })
}

/// The openai agent's settings; the API key is read from the environment here.
fn openai_config(a: &ServeArgs) -> Result<OpenAiConfig, String> {
    let base_url = a
        .openai_base_url
        .clone()
        .ok_or("--agent openai needs --openai-base-url (e.g. http://127.0.0.1:11434/v1)")?;
    let model = a.model.clone().ok_or("--agent openai needs --model")?;
    let mut cfg = OpenAiConfig::new(base_url, model);
    cfg.api_key = match &a.openai_api_key_env {
        Some(name) => Some(
            ApiKey::from_env(name)
                .map_err(|e| format!("--openai-api-key-env: {e}"))?
                .ok_or_else(|| format!("--openai-api-key-env: ${name} is not set or empty"))?,
        ),
        None => ApiKey::from_env("OPENAI_API_KEY")?,
    };
    cfg.system_prompt = match (&a.system_prompt, &a.system_prompt_file) {
        (Some(_), Some(_)) => {
            return Err("--system-prompt and --system-prompt-file: give one, not both".into());
        }
        (Some(p), None) => Some(p.clone()),
        (None, Some(path)) => Some(
            std::fs::read_to_string(path)
                .map_err(|e| format!("--system-prompt-file {}: {e}", path.display()))?,
        ),
        (None, None) => None,
    };
    cfg.history_turns = a.history_turns.unwrap_or(DEFAULT_HISTORY_TURNS);
    cfg.history_chars = a.history_chars.unwrap_or(DEFAULT_HISTORY_CHARS);
    cfg.sender_prefix = a.openai_sender_prefix.unwrap_or(false);
    cfg.connect_timeout = seconds(
        "openai-connect-timeout",
        a.openai_connect_timeout,
        DEFAULT_CONNECT_TIMEOUT.as_secs_f64(),
        false,
    )?;
    cfg.read_timeout = seconds(
        "openai-read-timeout",
        a.openai_read_timeout,
        DEFAULT_READ_TIMEOUT.as_secs_f64(),
        false,
    )?;
    cfg.tls_roots = match a.openai_tls_roots.unwrap_or(TlsRootsArg::Platform) {
        TlsRootsArg::Platform => TlsRoots::Platform,
        TlsRootsArg::Webpki => TlsRoots::WebPki,
    };
    if let Some(max) = a.max_reply_bytes {
        cfg.max_reply_bytes = max;
    }
    Ok(cfg)
}

/// The heartbeat period of the served runtime.
const TICK_INTERVAL: Duration = Duration::from_millis(100);

/// The agent factory the settings ask for.
fn make_factory(s: &Settings) -> Result<Arc<dyn AgentFactory>, String> {
    Ok(match (s.agent, &s.agent_cmd, s.openai.clone()) {
        (AgentKind::Exec, Some(cmd), _) => Arc::new(ExecAgent::factory_with(
            cmd,
            ExecOptions {
                env: s.agent_env.clone(),
                max_output_bytes: s.max_reply_bytes,
            },
        )),
        (AgentKind::Process, Some(cmd), _) => Arc::new(ProcessAgent::factory(ProcessOptions {
            command: cmd.clone(),
            env: s.agent_env.clone(),
            max_reply_bytes: s.max_reply_bytes,
            max_line_bytes: s.agent_max_line_bytes,
            stop_grace: s.stop_grace,
            close_grace: s.agent_close_grace,
        })),
        (AgentKind::Openai, _, Some(cfg)) => {
            Arc::new(OpenAiFactory::new(cfg).map_err(|e| format!("--agent openai: {e}"))?)
        }
        _ => Arc::new(EchoAgent::factory(s.echo_delay)),
    })
}

/// What a new agent factory depends on that a reload may change.
fn factory_key(s: &Settings) -> String {
    format!("{:?} {:?} {:?}", s.agent_cmd, s.echo_delay, s.stop_grace)
}

/// The settings a reload cannot change, by name, with their values (compared, never logged:
/// they may hold secrets).
fn restart_only(s: &Settings) -> Vec<(&'static str, String)> {
    let mut bridge = s.bridge.clone();
    bridge.auth_token = None;
    let http = s.http.clone().map(|(addr, mut cfg)| {
        cfg.auth_token = None;
        (addr, cfg)
    });
    vec![
        ("listen", format!("{:?}", s.listen)),
        ("http-listen and the http bounds", format!("{http:?}")),
        ("agent", format!("{:?}", s.agent)),
        ("agent-env", format!("{:?}", s.agent_env)),
        ("agent-close-grace", format!("{:?}", s.agent_close_grace)),
        (
            "agent-max-line-bytes",
            format!("{:?}", s.agent_max_line_bytes),
        ),
        ("max-reply-bytes", format!("{:?}", s.max_reply_bytes)),
        ("turn-workers", format!("{:?}", s.turn_workers)),
        ("cleanup-workers", format!("{:?}", s.cleanup_workers)),
        (
            "max-cleanup-workers",
            format!("{:?}", s.max_cleanup_workers),
        ),
        ("max-cached-agents", format!("{:?}", s.max_cached_agents)),
        ("agent-idle-ttl", format!("{:?}", s.agent_idle_ttl)),
        (
            "max-queued-messages",
            format!("{:?}", s.max_queued_messages),
        ),
        ("max-queued-bytes", format!("{:?}", s.max_queued_bytes)),
        ("status-file", format!("{:?}", s.status_file)),
        ("openai settings", format!("{:?}", s.openai)),
        ("the bridge's bounds", format!("{bridge:?}")),
        (
            "allow-insecure-bind",
            format!("{:?}", s.allow_insecure_bind),
        ),
    ]
}

/// SIGHUP: re-reads the flags and `--config` file (on a helper thread) into a [`Reload`].
fn reload_loader(flags: ServeArgs, initial: &Settings) -> ReloadLoader {
    let fixed = restart_only(initial);
    let last_key = Mutex::new(factory_key(initial));
    Arc::new(move || {
        let new = resolve(flags.clone())?;
        let restart_needed = restart_only(&new)
            .into_iter()
            .zip(&fixed)
            .filter(|((_, now), (_, was))| now != was)
            .map(|((name, _), _)| name.to_owned())
            .collect();
        let key = factory_key(&new);
        let mut last = last_key.lock().unwrap_or_else(|e| e.into_inner());
        let factory = if *last != key {
            let f = make_factory(&new)?;
            *last = key;
            Some(f)
        } else {
            None
        };
        Ok(Reload {
            tunables: Tunables {
                busy_mode: new.busy_mode,
                queue_cap: new.queue_cap,
                turn_timeout: new.turn_timeout,
                stop_grace: new.stop_grace,
                cleanup_timeout: new.cleanup_timeout,
                drain_timeout: new.drain_timeout,
            },
            partial_interval: new.partial_interval,
            auth_token: new.bridge.auth_token.clone(),
            factory,
            restart_needed,
        })
    })
}

/// Runs the server; returns the process exit code.
pub(crate) fn run(args: ServeArgs) -> i32 {
    let check_only = args.check_config;
    let flags = args.clone();
    let s = match resolve(args) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("turnstile serve: {e}");
            return USAGE_ERROR;
        }
    };
    if let Some(path) = &s.status_file
        && let Err(e) = check_writable(path)
    {
        eprintln!("turnstile serve: --status-file {}: {e}", path.display());
        return USAGE_ERROR;
    }
    if check_only {
        println!("configuration ok");
        return 0;
    }
    match crate::server::raise_fd_limit() {
        Ok((old, new)) if new > old => {
            log::info!("raised the open-file limit from {old} to {new} (the hard limit)")
        }
        Ok((_, now)) => log::info!("open-file limit: {now}"),
        Err(e) => log::warn!("cannot raise the open-file limit: {e}"),
    }
    let started = build_runtime(&s).and_then(|(runtime, handle, swap)| {
        let server = bind_bridge(&s)?;
        let forced = server.forced_stops();
        let addr = server.local_addr().map_err(|e| e.to_string())?;
        let (ops, http_addr) = host_ops(server, &s, flags, handle, swap)?;
        Ok((runtime, ops, forced, addr, http_addr))
    });
    let (runtime, ops, forced, addr, http_addr) = match started {
        Ok(parts) => parts,
        Err(e) => {
            eprintln!("turnstile serve: {e}");
            return USAGE_ERROR;
        }
    };
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "listening on {addr}");
    if let Some(h) = http_addr {
        let _ = writeln!(stdout, "http on {h}");
    }
    let _ = stdout.flush();
    drop(stdout);
    log::info!(
        "serving: agent {:?}, {} turn workers, busy mode {:?}",
        s.agent,
        s.turn_workers,
        s.busy_mode
    );
    let code = serve_until_stopped(runtime, ops, &forced);
    if s.agent != AgentKind::Echo {
        // Closing each agent killed its processes; this catches anything a close left.
        child::kill_all();
    }
    code
}

/// The runtime with its agent factory (swappable, so a reload can give new agents a new
/// command); for process-based agents the gateway becomes their subreaper first.
fn build_runtime(s: &Settings) -> Result<(Runtime, Handle, Arc<SwappableFactory>), String> {
    let swap = SwappableFactory::new(make_factory(s)?);
    if matches!(s.agent, AgentKind::Exec | AgentKind::Process) {
        if let Err(e) = child::become_subreaper() {
            log::warn!(
                "cannot become a child subreaper ({e}): agent processes that kill their own leader escape containment"
            );
        }
        // Whatever path ends the process, agent processes go with it.
        child::kill_all_at_exit();
    }
    let mut builder = Builder::new(Arc::clone(&swap))
        .max_reply_bytes(s.max_reply_bytes)
        .busy_mode(s.busy_mode)
        .queue_cap(s.queue_cap)
        .turn_workers(s.turn_workers)
        .cleanup_workers(s.cleanup_workers)
        .max_cleanup_workers(s.max_cleanup_workers)
        .max_cached_agents(s.max_cached_agents)
        .agent_idle_ttl(s.agent_idle_ttl)
        .max_queued_messages(s.max_queued_messages)
        .max_queued_bytes(s.max_queued_bytes)
        .partial_interval(s.partial_interval)
        .turn_timeout(s.turn_timeout)
        .stop_grace(s.stop_grace)
        .cleanup_timeout(s.cleanup_timeout)
        .drain_timeout(s.drain_timeout)
        .tick_interval(TICK_INTERVAL);
    if let Some(path) = &s.status_file {
        builder = builder.status_file(path);
    }
    let (runtime, handle, _events) = builder.build().map_err(|e| e.to_string())?;
    Ok((runtime, handle, swap))
}

/// The bridge server on `--listen`, with its journal recovered when `--data-dir` is set.
fn bind_bridge(s: &Settings) -> Result<BridgeServer, String> {
    // Well past every shutdown deadline: drain, grace, cleanup, then the flush budget.
    let flush_budget = Duration::from_secs(5);
    let watchdog =
        s.drain_timeout + s.stop_grace + s.cleanup_timeout + flush_budget + Duration::from_secs(30);
    let cfg = ServerConfig {
        bridge: s.bridge.clone(),
        flush_budget,
        watchdog,
        allow_insecure_bind: s.allow_insecure_bind,
        ..ServerConfig::default()
    };
    let server =
        BridgeServer::bind(s.listen, cfg).map_err(|e| format!("--listen {}: {e}", s.listen))?;
    let Some(dir) = &s.data_dir else {
        return Ok(server);
    };
    crate::journal::SqliteStore::open(dir)
        .and_then(|store| server.with_journal(store, JournalConfig::default()))
        .map(|(server, _counts)| server)
        .map_err(|e| format!("--data-dir {}: {e}", dir.display()))
}

/// The operations frontend around the bridge server: the HTTP endpoint, readiness checks,
/// reload on SIGHUP (with `--config`) and systemd notifications.
fn host_ops(
    server: BridgeServer,
    s: &Settings,
    flags: ServeArgs,
    handle: Handle,
    swap: Arc<SwappableFactory>,
) -> Result<(Ops<BridgeServer>, Option<SocketAddr>), String> {
    let mut ops = Ops::new(server, TICK_INTERVAL);
    let mut http_addr = None;
    if let Some((addr, cfg)) = s.http.clone() {
        let server =
            HttpServer::bind(addr, cfg).map_err(|e| format!("--http-listen {addr}: {e}"))?;
        http_addr = server.local_addr().ok();
        ops = ops.with_http(server);
    }
    if s.data_dir.is_some() {
        // Not ready while the journal's writes fail: new messages would be rejected `storage`.
        ops = ops.with_readiness_check("store", Box::new(store_ready));
    }
    if flags.config.is_some() {
        let loader = reload_loader(flags, s);
        let apply: ReloadApplier<BridgeServer> = Box::new(move |server, r| {
            let mut restart = Vec::new();
            if !server.set_auth_token(r.auth_token.as_deref()) {
                restart.push("auth-token".to_owned());
            }
            handle.set_partial_interval(r.partial_interval);
            if let Some(f) = &r.factory {
                swap.swap(Arc::clone(f));
            }
            restart
        });
        ops = ops.with_reload(loader, apply);
    }
    match SdNotify::from_env() {
        Ok(Some(n)) => {
            log::info!("systemd notifications on: {n:?}");
            ops = ops.with_notify(n);
        }
        Ok(None) => {}
        Err(e) => log::warn!("NOTIFY_SOCKET: {e}; no systemd notifications"),
    }
    Ok((ops, http_addr))
}

/// Runs the reactor on its own thread until it stops (0 when the shutdown was clean, 1
/// otherwise) or a stop is forced (1 at once: the loop may be wedged, so this thread acts on
/// it and the process ends without waiting for the loop).
fn serve_until_stopped(
    runtime: Runtime,
    ops: Ops<BridgeServer>,
    forced: &crossbeam_channel::Receiver<crate::ForcedStop>,
) -> i32 {
    let (finished_tx, finished) = crossbeam_channel::bounded(1);
    let reactor = std::thread::Builder::new()
        .name("turnstile-reactor".into())
        .spawn(move || {
            let _ = finished_tx.send(runtime.run_with(ops));
        });
    if let Err(e) = reactor {
        log::error!("cannot start the reactor thread: {e}");
        return 1;
    }
    let finished = crossbeam_channel::select! {
        recv(finished) -> r => r,
        recv(forced) -> why => match why {
            Ok(why) => {
                log::error!("forced stop: {why}; exiting with code 1");
                child::kill_all();
                return 1;
            }
            // The server was dropped: the loop has ended and its result is on its way.
            Err(_) => finished.recv(),
        },
    };
    match finished.unwrap_or_else(|_| Err(std::io::Error::other("the reactor thread panicked"))) {
        Ok(report) if report.clean => 0,
        Ok(report) => {
            log::warn!("shutdown was not clean: {report:?}");
            1
        }
        Err(e) => {
            log::error!("reactor failed: {e}");
            1
        }
    }
}

/// Whether the status file can be written: its temporary sibling is created and removed, as
/// the status writer will do every 100 ms.
fn check_writable(path: &std::path::Path) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    std::fs::File::create(&tmp)?;
    std::fs::remove_file(&tmp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_is_not_ready_while_journal_writes_fail() {
        let mut status = crate::Status::default();
        assert_eq!(store_ready(&status), Ok(()));
        status.frontend = Some(serde_json::json!({"journal": {"failing": false}}));
        assert_eq!(store_ready(&status), Ok(()));
        status.frontend = Some(serde_json::json!({"journal": {"failing": true}}));
        assert_eq!(
            store_ready(&status),
            Err("journal writes are failing".to_owned())
        );
    }
}
