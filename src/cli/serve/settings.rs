//! Every value of `serve` resolved from the flags and the file, checked, and named when
//! wrong.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::agents::child::AgentEnv;
use crate::agents::openai::{
    ApiKey, DEFAULT_CONNECT_TIMEOUT, DEFAULT_HISTORY_CHARS, DEFAULT_HISTORY_TURNS,
    DEFAULT_READ_TIMEOUT, DEFAULT_STREAM_TIMEOUT, OpenAiConfig, TlsRoots,
};
use crate::agents::process::{self};
use crate::agents::routes::{DEFAULT_AGENT, Route};
use crate::core::CoreConfig;
use crate::ops::http::{self, DEFAULT_HTTP_LISTEN, HttpConfig};
use crate::reactor::DEFAULT_PARTIAL_INTERVAL;
use crate::server::BridgeConfig;

use super::args::{
    AgentKind, DEFAULT_LEASE_MS, DEFAULT_LISTEN, DEFAULT_PARTITIONS, ServeArgs, TlsRootsArg,
    merged_args,
};
use super::bridges::BridgeSpec;
use crate::cli::units::{ListenAddr, Seconds};
use crate::cluster::ClusterConfig;
use crate::journal::memory::{
    DEFAULT_HISTORY_BYTES, DEFAULT_HISTORY_TTL, HistoryLimits, MemoryLoader,
};

/// Every value resolved and checked.
pub(super) struct Settings {
    /// The runtime's settings (the core's bounds and timings, the pools).
    pub(super) core: CoreSettings,
    /// Platform bridges to run as supervised children (`[[bridge]]` tables).
    pub(super) bridges: Vec<BridgeSpec>,
    pub(super) listen: SocketAddr,
    /// The top-level agent (the first; named `default`), then each `[[agent]]` table's.
    pub(super) agents: Vec<AgentSpec>,
    /// The `[[route]]` tables, their agents as indexes into `agents`.
    pub(super) routes: Vec<Route>,
    pub(super) max_reply_bytes: usize,
    pub(super) status_file: Option<PathBuf>,
    pub(super) bridge: BridgeConfig,
    pub(super) allow_insecure_bind: bool,
    pub(super) data_dir: Option<PathBuf>,
    /// The stored conversations' bounds (`--history-ttl`, `--history-bytes`; with
    /// `--data-dir`).
    pub(super) history: HistoryLimits,
    /// Reads them back for the openai agent: set once the journal is open.
    pub(super) memory: Option<MemoryLoader>,
    /// `--cluster`: the Redis, this instance's name, the partitions and the lease.
    pub(super) cluster: Option<ClusterConfig>,
    /// The HTTP endpoint's address and settings; `None` when `off`.
    pub(super) http: Option<(SocketAddr, HttpConfig)>,
    /// The listeners' certificate and key (`--tls-cert`, `--tls-key`), loaded; `None`: plain.
    pub(super) tls: Option<crate::ServerTls>,
}

/// One agent's settings, checked: the top-level agent's or an `[[agent]]` table's.
#[derive(Clone, Debug)]
pub(super) struct AgentSpec {
    pub(super) name: String,
    pub(super) kind: AgentKind,
    pub(super) cmd: Option<String>,
    pub(super) close_grace: Duration,
    pub(super) env: AgentEnv,
    pub(super) max_line_bytes: usize,
    pub(super) echo_delay: Duration,
    pub(super) openai: Option<OpenAiConfig>,
}

impl AgentSpec {
    /// Whether its agents run processes (the gateway then contains them).
    pub(super) fn runs_processes(&self) -> bool {
        matches!(self.kind, AgentKind::Exec | AgentKind::Process)
    }
}

/// The runtime's settings: the core's bounds and timings (its own configuration, each value
/// defined once there), the cleanup pool's size, the partials' interval.
pub(super) struct CoreSettings {
    pub(super) config: CoreConfig,
    pub(super) cleanup_workers: usize,
    pub(super) partial_interval: Duration,
}
pub(super) fn seconds(
    name: &str,
    value: Option<Seconds>,
    default: f64,
    allow_zero: bool,
) -> Result<Duration, String> {
    let v = value.map_or(default, |s| s.0);
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

pub(super) fn at_least_one(
    name: &str,
    value: Option<usize>,
    default: usize,
) -> Result<usize, String> {
    match value.unwrap_or(default) {
        0 => Err(format!("--{name}: must be at least 1")),
        v => Ok(v),
    }
}
/// The bridge's bounds and durability settings, each checked and named when wrong.
pub(super) fn bridge_config(a: &ServeArgs, max_reply_bytes: usize) -> Result<BridgeConfig, String> {
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
            a.max_line_bytes.map(|b| b.0),
            bridge_default.max_line_bytes,
        )?,
        max_write_buffer: at_least_one(
            "max-write-buffer",
            a.max_write_buffer.map(|b| b.0),
            bridge_default.max_write_buffer,
        )?,
        write_budget: at_least_one(
            "write-budget",
            a.write_budget.map(|b| b.0),
            bridge_default.write_budget,
        )?,
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
        outbox_bytes: at_least_one(
            "outbox-bytes",
            a.outbox_bytes.map(|b| b.0),
            bridge_default.outbox_bytes,
        )?,
        outbox_stale_after: seconds(
            "outbox-stale-after",
            a.outbox_stale_after,
            bridge_default.outbox_stale_after.as_secs_f64(),
            false,
        )?,
        outbox_stale_keep: a
            .outbox_stale_keep
            .unwrap_or(bridge_default.outbox_stale_keep),
        max_reply_bytes,
        // A cluster member journals to Redis.
        journal: a.data_dir.is_some() || a.cluster.is_some(),
        max_pending_durable: at_least_one(
            "max-pending-durable",
            a.max_pending_durable,
            bridge_default.max_pending_durable,
        )?,
        resume_interrupted: a.resume_interrupted,
        access: crate::AccessConfig::from_tables(
            &a.access.clone().unwrap_or_default(),
            a.access_default != Some(super::args::AccessDefault::Open),
        )?,
        dedup_window: seconds(
            "dedup-window",
            a.dedup_window,
            bridge_default.dedup_window.as_secs_f64(),
            false,
        )?,
        dedup_max: at_least_one("dedup-max", a.dedup_max, bridge_default.dedup_max)?,
        attachments: attachment_limits(a)?,
        ..BridgeConfig::default()
    };
    // Admission keeps every owed envelope plus one largest result within --outbox-bytes.
    let env = crate::server::bridge::TERMINAL_ENVELOPE;
    let least = max_reply_bytes.saturating_add(2 * env);
    if bridge.outbox_bytes < least {
        return Err(format!(
            "--outbox-bytes: {} is less than one message's envelope plus one largest result ({least} bytes: --max-reply-bytes + 2 x 8 KiB)",
            bridge.outbox_bytes
        ));
    }
    Ok(bridge)
}

/// The spool and its bounds (`--attachments-dir` …); the directory is made at start
/// (`private_spool`), owner-only, and named by its canonical path.
fn attachment_limits(a: &ServeArgs) -> Result<crate::AttachmentLimits, String> {
    let d = crate::AttachmentLimits::default();
    // Without either, a private temporary directory made once at start (`spool_dir`), not on
    // every reload.
    let dir = match (&a.attachments_dir, &a.data_dir) {
        (Some(dir), _) => Some(dir.clone()),
        (None, Some(data)) => Some(data.join("attachments")),
        (None, None) => None,
    };
    // Created (and made canonical) at start, after the data directory's own checks.
    Ok(crate::AttachmentLimits {
        dir,
        max_files: at_least_one("max-attachments", a.max_attachments, d.max_files)?,
        max_file_bytes: at_least_one(
            "max-attachment-bytes",
            a.max_attachment_bytes.map(|b| b.0),
            d.max_file_bytes as usize,
        )? as u64,
        spool_bytes: at_least_one(
            "attachments-bytes",
            a.attachments_bytes.map(|b| b.0),
            d.spool_bytes as usize,
        )? as u64,
    })
}

/// A new directory only this user may enter, under the system's temporary directory
/// (`mkdtemp`: never one another user created in advance).
pub(super) fn private_temp_dir() -> std::io::Result<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    let template = std::env::temp_dir().join("turnstile-attachments-XXXXXX");
    let mut raw = template.as_os_str().as_bytes().to_vec();
    raw.push(0);
    // SAFETY: `raw` is a NUL-terminated, writable buffer that mkdtemp fills in place.
    let made = unsafe { libc::mkdtemp(raw.as_mut_ptr().cast()) };
    if made.is_null() {
        return Err(std::io::Error::last_os_error());
    }
    raw.pop();
    Ok(PathBuf::from(std::ffi::OsStr::from_bytes(&raw)))
}

/// The HTTP endpoint's address and bounds, or `None` for `--http-listen off`.
pub(super) fn http_settings(a: &ServeArgs) -> Result<Option<(SocketAddr, HttpConfig)>, String> {
    let http = match a.http_listen.as_deref().map(str::trim) {
        Some("off") => None,
        spec => {
            let spec = spec.unwrap_or(DEFAULT_HTTP_LISTEN);
            let addr = spec
                .parse::<ListenAddr>()
                .map_err(|e| format!("--http-listen {spec}: {e} (or off)"))?
                .0;
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
                a.http_max_header_bytes.map(|b| b.0),
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
                max_per_peer: at_least_one(
                    "http-max-per-peer",
                    a.http_max_per_peer,
                    http::DEFAULT_MAX_PER_PEER,
                )?,
                head_timeout: seconds(
                    "http-head-timeout",
                    a.http_head_timeout,
                    http::DEFAULT_HEAD_TIMEOUT.as_secs_f64(),
                    false,
                )?,
            };
            Some((addr, cfg))
        }
    };
    Ok(http)
}
pub(super) fn resolve(flags: ServeArgs) -> Result<Settings, String> {
    let a = merged_args(flags)?;
    let core = core_settings(&a)?;
    let (agents, routes) = agent_specs(&a, &core)?;
    if a.auth_token.as_deref() == Some("") {
        return Err("--auth-token: must not be empty".into());
    }
    let listen = a
        .listen
        .map_or_else(|| SocketAddr::from(DEFAULT_LISTEN), |l| l.0);
    if !listen.ip().is_loopback() && a.auth_token.is_none() && !a.allow_insecure_bind {
        return Err(format!(
            "--listen {listen}: a non-loopback address needs --auth-token (or --allow-insecure-bind)"
        ));
    }
    let bridges = a.bridge.clone().unwrap_or_default();
    super::bridges::check(&bridges)?;
    let max_reply_bytes = at_least_one(
        "max-reply-bytes",
        a.max_reply_bytes.map(|b| b.0),
        BridgeConfig::default().max_reply_bytes,
    )?;
    let tls = match (&a.tls_cert, &a.tls_key) {
        (Some(cert), Some(key)) => {
            Some(crate::ServerTls::from_pem_files(cert, key).map_err(|e| e.to_string())?)
        }
        (None, None) => None,
        (Some(_), None) => return Err("--tls-cert needs --tls-key".into()),
        (None, Some(_)) => return Err("--tls-key needs --tls-cert".into()),
    };
    let cluster = cluster_settings(&a)?;
    Ok(Settings {
        tls,
        bridge: bridge_config(&a, max_reply_bytes)?,
        http: http_settings(&a)?,
        listen,
        max_reply_bytes,
        allow_insecure_bind: a.allow_insecure_bind,
        agents,
        routes,
        status_file: a.status_file,
        cluster,
        history: HistoryLimits {
            ttl: seconds(
                "history-ttl",
                a.history_ttl,
                DEFAULT_HISTORY_TTL.as_secs_f64(),
                false,
            )?,
            max_bytes: a
                .history_bytes
                .map_or(DEFAULT_HISTORY_BYTES, |b| b.0 as u64),
        },
        memory: None,
        data_dir: a.data_dir,
        core,
        bridges,
    })
}

/// The top-level agent, each `[[agent]]` table's, and the `[[route]]`s among them.
fn agent_specs(a: &ServeArgs, core: &CoreSettings) -> Result<(Vec<AgentSpec>, Vec<Route>), String> {
    let mut agents = vec![agent_spec(DEFAULT_AGENT, a, core)?];
    let tables = a.agent_tables.as_deref().unwrap_or_default();
    super::tables::check_names(tables)?;
    for t in tables {
        // Its own options only, and the gateway-wide bounds its replies are cut to and its
        // images are sent within.
        let options = ServeArgs {
            agent: t.kind,
            max_reply_bytes: a.max_reply_bytes,
            max_attachment_bytes: a.max_attachment_bytes,
            ..(*t.options).clone()
        };
        let spec = agent_spec(&t.name, &options, core)
            .map_err(|e| format!("[[agent]] {:?}: {e}", t.name))?;
        agents.push(spec);
    }
    let names: Vec<&str> = agents.iter().map(|s| s.name.as_str()).collect();
    let routes = super::tables::routes(a.route.as_deref().unwrap_or_default(), &names)?;
    Ok((agents, routes))
}

/// One agent's settings from its options (the top level's, or an agent table's).
fn agent_spec(name: &str, a: &ServeArgs, core: &CoreSettings) -> Result<AgentSpec, String> {
    let kind = a.agent.unwrap_or(AgentKind::Echo);
    let needs_cmd = matches!(kind, AgentKind::Exec | AgentKind::Process);
    if needs_cmd && a.agent_cmd.as_deref().is_none_or(|c| c.trim().is_empty()) {
        let kind = if kind == AgentKind::Exec {
            "exec"
        } else {
            "process"
        };
        return Err(format!("--agent {kind} needs --agent-cmd"));
    }
    let close_grace = seconds(
        "agent-close-grace",
        a.agent_close_grace,
        process::DEFAULT_CLOSE_GRACE.as_secs_f64(),
        true,
    )?;
    if kind == AgentKind::Process
        && close_grace + process::CLOSE_OVERHEAD > core.config.cleanup_timeout
    {
        return Err(format!(
            "--agent-close-grace: {:?} plus {:?} to terminate and kill must fit in --cleanup-timeout ({:?})",
            close_grace,
            process::CLOSE_OVERHEAD,
            core.config.cleanup_timeout
        ));
    }
    let openai = match kind {
        AgentKind::Openai => Some(openai_config(a, core.config.turn_timeout)?),
        _ => None,
    };
    Ok(AgentSpec {
        name: name.to_owned(),
        kind,
        cmd: a.agent_cmd.clone(),
        close_grace,
        env: AgentEnv::new(a.agent_env.clone().unwrap_or_default())?,
        max_line_bytes: at_least_one(
            "agent-max-line-bytes",
            a.agent_max_line_bytes.map(|b| b.0),
            process::DEFAULT_MAX_LINE_BYTES,
        )?,
        echo_delay: Duration::from_millis(a.echo_delay_ms.unwrap_or(0)),
        openai,
    })
}

/// `--cluster` and its flags: the Redis URL, this instance's name (default `hostname:pid:random`),
/// the partition count and the lease, each checked and named when wrong.
fn cluster_settings(a: &ServeArgs) -> Result<Option<ClusterConfig>, String> {
    let Some(url) = &a.cluster else {
        for (set, flag) in [
            (a.instance_id.is_some(), "--instance-id"),
            (a.partitions.is_some(), "--partitions"),
            (a.lease_ms.is_some(), "--lease-ms"),
            (a.max_clock_skew_ms.is_some(), "--max-clock-skew-ms"),
            (a.cluster_allow_lazy_fsync, "--cluster-allow-lazy-fsync"),
            (a.cluster_rebalance.is_some(), "--cluster-rebalance"),
            (a.cluster_drain_ms.is_some(), "--cluster-drain-ms"),
            (a.cluster_min_replicas.is_some(), "--cluster-min-replicas"),
        ] {
            if set {
                return Err(format!("{flag} needs --cluster"));
            }
        }
        return Ok(None);
    };
    if a.data_dir.is_some() {
        return Err(
            "--cluster and --data-dir are exclusive: a cluster keeps its journal in Redis".into(),
        );
    }
    if !(url.starts_with("redis://") || url.starts_with("unix://")) {
        // Not shown: a mistyped URL may still hold a password.
        return Err("--cluster: not a Redis URL (redis://HOST:PORT)".into());
    }
    let instance = match &a.instance_id {
        Some(name) => name.trim().to_owned(),
        None => crate::cluster::default_instance_id(),
    };
    // The lease token is `<instance>:<epoch>`: the name must be printable and not empty.
    if instance.is_empty() || instance.len() > 200 || instance.chars().any(char::is_control) {
        return Err(format!(
            "--instance-id {instance:?}: must be 1 to 200 printable characters"
        ));
    }
    let partitions = a.partitions.unwrap_or(DEFAULT_PARTITIONS);
    // Redis Cluster's hash slots: more partitions could not be spread any further.
    if !(1..=16_384).contains(&partitions) {
        return Err(format!(
            "--partitions {partitions}: must be from 1 to 16384"
        ));
    }
    let lease_ms = a.lease_ms.unwrap_or(DEFAULT_LEASE_MS);
    if !(100..=3_600_000).contains(&lease_ms) {
        return Err(format!(
            "--lease-ms {lease_ms}: must be from 100 to 3600000"
        ));
    }
    let mut c = ClusterConfig::new(url.clone(), instance);
    c.partitions = partitions;
    c.lease = Duration::from_millis(lease_ms);
    if let Some(skew) = a.max_clock_skew_ms {
        // Renewals go every third of the lease: a fence at `lease − skew` must come after
        // the second one, or one failed renewal would stop every turn.
        if skew.saturating_mul(3) >= lease_ms {
            return Err(format!(
                "--max-clock-skew-ms {skew}: leaves no room in --lease-ms {lease_ms}: an owner stops its turns at the lease less the skew, which must come after its second renewal (at 2/3 of the lease); use a skew below {} ms or a longer lease",
                lease_ms.div_ceil(3)
            ));
        }
        c.max_clock_skew = Some(Duration::from_millis(skew));
    }
    c.allow_lazy_fsync = a.cluster_allow_lazy_fsync;
    c.rebalance = a.cluster_rebalance.unwrap_or(true);
    c.min_replicas = a.cluster_min_replicas.unwrap_or(0);
    if c.min_replicas > 16 {
        return Err(format!(
            "--cluster-min-replicas {}: must be from 0 to 16",
            c.min_replicas
        ));
    }
    if let Some(ms) = a.cluster_drain_ms {
        if !c.rebalance {
            return Err(
                "--cluster-drain-ms needs rebalancing (--cluster-rebalance false turns it off)"
                    .into(),
            );
        }
        if !(100..=3_600_000).contains(&ms) {
            return Err(format!(
                "--cluster-drain-ms {ms}: must be from 100 to 3600000"
            ));
        }
        c.drain = Duration::from_millis(ms);
    }
    Ok(Some(c))
}

/// The runtime's settings from the flags, each checked and named when wrong.
fn core_settings(a: &ServeArgs) -> Result<CoreSettings, String> {
    let d = CoreConfig::default();
    let secs = |name, value, default: Duration, allow_zero| {
        seconds(name, value, default.as_secs_f64(), allow_zero)
    };
    Ok(CoreSettings {
        config: CoreConfig {
            busy_mode: a.busy_mode.unwrap_or(d.busy_mode),
            queue_cap: at_least_one("queue-cap", a.queue_cap, d.queue_cap)?,
            turn_workers: at_least_one("turn-workers", a.turn_workers, d.turn_workers)?,
            max_held_turns: at_least_one("max-held-turns", a.max_held_turns, d.max_held_turns)?,
            cleanup_concurrency: at_least_one(
                "max-cleanup-workers",
                a.max_cleanup_workers,
                d.cleanup_concurrency,
            )?,
            max_cached_agents: a.max_cached_agents.unwrap_or(d.max_cached_agents),
            agent_idle_ttl: secs("agent-idle-ttl", a.agent_idle_ttl, d.agent_idle_ttl, false)?,
            max_queued_messages: at_least_one(
                "max-queued-messages",
                a.max_queued_messages,
                d.max_queued_messages,
            )?,
            max_queued_bytes: at_least_one(
                "max-queued-bytes",
                a.max_queued_bytes.map(|b| b.0),
                d.max_queued_bytes,
            )?,
            turn_timeout: secs("turn-timeout", a.turn_timeout, d.turn_timeout, false)?,
            stop_grace: secs("stop-grace", a.stop_grace, d.stop_grace, true)?,
            cleanup_timeout: secs(
                "cleanup-timeout",
                a.cleanup_timeout,
                d.cleanup_timeout,
                false,
            )?,
            drain_timeout: secs("drain-timeout", a.drain_timeout, d.drain_timeout, true)?,
            ..d
        },
        cleanup_workers: at_least_one(
            "cleanup-workers",
            a.cleanup_workers,
            crate::reactor::DEFAULT_CLEANUP_WORKERS,
        )?,
        partial_interval: secs(
            "partial-interval",
            a.partial_interval,
            DEFAULT_PARTIAL_INTERVAL,
            true,
        )?,
    })
}

/// The openai agent's settings; the API key is read from the environment here.
pub(super) fn openai_config(a: &ServeArgs, turn_timeout: Duration) -> Result<OpenAiConfig, String> {
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
    cfg.vision = a.openai_vision.unwrap_or(false);
    if let Some(bytes) = a.openai_inline_text_bytes {
        cfg.inline_text_bytes = bytes.0;
    }
    if let Some(bytes) = a.max_attachment_bytes {
        cfg.max_image_bytes = bytes.0 as u64;
    }
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
    cfg.stream_timeout = seconds(
        "openai-stream-timeout",
        a.openai_stream_timeout,
        DEFAULT_STREAM_TIMEOUT.as_secs_f64(),
        false,
    )?;
    if cfg.stream_timeout >= turn_timeout {
        if a.openai_stream_timeout.is_some() {
            return Err(format!(
                "--openai-stream-timeout: {:?} must be below --turn-timeout ({turn_timeout:?})",
                cfg.stream_timeout
            ));
        }
        cfg.stream_timeout = turn_timeout.mul_f64(0.9);
    }
    cfg.tls_roots = match a.openai_tls_roots.unwrap_or(TlsRootsArg::Platform) {
        TlsRootsArg::Platform => TlsRoots::Platform,
        TlsRootsArg::Webpki => TlsRoots::WebPki,
    };
    if let Some(max) = a.max_reply_bytes.map(|b| b.0) {
        cfg.max_reply_bytes = max;
    }
    Ok(cfg)
}
