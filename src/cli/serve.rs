//! `turnstile serve`: flags, the optional TOML config file, and the server's lifetime.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use serde::Deserialize;
use turnstile::exec::ExecAgent;
use turnstile::server::{BridgeConfig, BridgeServer, ServerConfig};
use turnstile::{Builder, BusyMode, EchoAgent};

use super::USAGE_ERROR;

/// Which agent serves the sessions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AgentKind {
    /// Replies with its input.
    Echo,
    /// Runs --agent-cmd through `sh -c` per turn.
    Exec,
}

/// Busy mode names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BusyArg {
    /// Follow-ups run one turn each, in order.
    Queue,
    /// A follow-up cancels the running turn.
    Interrupt,
    /// Queued follow-ups run as one turn.
    Merge,
}

/// Flags of `serve`; the same keys (kebab-case) may appear in the `--config` TOML file, and
/// flags override the file.
#[derive(Args, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ServeArgs {
    /// TOML file with any of these settings.
    #[arg(long)]
    #[serde(skip)]
    config: Option<PathBuf>,
    /// Address to listen on [default: 127.0.0.1:7878].
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Agent [default: echo].
    #[arg(long, value_enum)]
    agent: Option<AgentKind>,
    /// Shell command of the exec agent.
    #[arg(long)]
    agent_cmd: Option<String>,
    /// Simulated work per echo turn, in milliseconds (cancellable) [default: 0].
    #[arg(long)]
    echo_delay_ms: Option<u64>,
    /// What a message does while its session's turn runs [default: queue].
    #[arg(long, value_enum)]
    busy_mode: Option<BusyArg>,
    /// Messages a session may hold waiting [default: 32].
    #[arg(long)]
    queue_cap: Option<usize>,
    /// Threads running agent turns [default: 16].
    #[arg(long)]
    turn_workers: Option<usize>,
    /// Threads closing agents [default: 2].
    #[arg(long)]
    cleanup_workers: Option<usize>,
    /// Seconds a turn may run [default: 600].
    #[arg(long)]
    turn_timeout: Option<f64>,
    /// Seconds a cancelled turn gets to return [default: 5].
    #[arg(long)]
    stop_grace: Option<f64>,
    /// Seconds an agent's close() may take [default: 30].
    #[arg(long)]
    cleanup_timeout: Option<f64>,
    /// Seconds shutdown lets running turns finish [default: 30].
    #[arg(long)]
    drain_timeout: Option<f64>,
    /// Write the status snapshot to this JSON file.
    #[arg(long)]
    status_file: Option<PathBuf>,
    /// Token every bridge must present in its hello.
    #[arg(long, env = "TURNSTILE_AUTH_TOKEN", hide_env_values = true)]
    auth_token: Option<String>,
    /// Connections beyond this are refused [default: 1024].
    #[arg(long)]
    max_connections: Option<usize>,
    /// Longest accepted protocol line [default: 65536].
    #[arg(long)]
    max_line_bytes: Option<usize>,
    /// Unwritten output per connection past which its reads pause and typing/partial lines
    /// are dropped; also the outbox backlog it is fed at a time [default: 1 MiB].
    #[arg(long)]
    max_write_buffer: Option<usize>,
    /// Undelivered results a platform may have (reserved at admission; `backpressure`
    /// beyond) [default: 10000].
    #[arg(long)]
    outbox_cap: Option<usize>,
    /// Bytes a platform may have reserved for undelivered results; each accepted message
    /// reserves --max-reply-bytes + 8 KiB (`backpressure` beyond) [default: 256 MiB].
    #[arg(long)]
    outbox_bytes: Option<usize>,
    /// Platforms known at once; a hello or message for another gets `error`/`overloaded`
    /// [default: 16].
    #[arg(long)]
    max_platforms: Option<usize>,
    /// Message ids a platform's duplicate window holds (`backpressure` beyond) [default: 1000000].
    #[arg(long)]
    dedup_max: Option<usize>,
    /// Seconds an accepted (platform, id) is remembered [default: 600].
    #[arg(long)]
    dedup_window: Option<f64>,
    /// Connections waiting for their hello (with a token), in all [default: 256].
    #[arg(long)]
    max_unauthenticated: Option<usize>,
    /// Connections waiting for their hello (with a token), per peer address [default: 32].
    #[arg(long)]
    max_unauthenticated_per_peer: Option<usize>,
    /// Seconds a connection has to send its hello (with a token) [default: 5].
    #[arg(long)]
    hello_timeout: Option<f64>,
    /// Bytes written to one connection per loop wake [default: 262144].
    #[arg(long)]
    write_budget: Option<usize>,
    /// Seconds a connection with output may take none of it before it is closed (its
    /// results go back to the outbox) [default: 60].
    #[arg(long)]
    write_stall_timeout: Option<f64>,
    /// Longest reply; longer ones are cut on a UTF-8 boundary and marked truncated
    /// [default: 1048576].
    #[arg(long)]
    max_reply_bytes: Option<usize>,
    /// Listen on a non-loopback address without an auth token.
    #[arg(long)]
    #[serde(default)]
    allow_insecure_bind: bool,
}

macro_rules! merge {
    ($flags:ident, $file:ident, $($field:ident),*) => {
        ServeArgs {
            config: None,
            allow_insecure_bind: $flags.allow_insecure_bind || $file.allow_insecure_bind,
            $($field: $flags.$field.or($file.$field)),*
        }
    };
}

/// Every value resolved and checked.
struct Settings {
    listen: SocketAddr,
    agent: AgentKind,
    agent_cmd: Option<String>,
    echo_delay: Duration,
    busy_mode: BusyMode,
    queue_cap: usize,
    turn_workers: usize,
    cleanup_workers: usize,
    turn_timeout: Duration,
    stop_grace: Duration,
    cleanup_timeout: Duration,
    drain_timeout: Duration,
    status_file: Option<PathBuf>,
    bridge: BridgeConfig,
    max_reply_bytes: usize,
    allow_insecure_bind: bool,
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

fn resolve(flags: ServeArgs) -> Result<Settings, String> {
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
        echo_delay_ms,
        busy_mode,
        queue_cap,
        turn_workers,
        cleanup_workers,
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
        outbox_bytes,
        max_platforms,
        dedup_max,
        dedup_window,
        max_unauthenticated,
        max_unauthenticated_per_peer,
        hello_timeout,
        write_budget,
        write_stall_timeout,
        max_reply_bytes
    );
    let agent = a.agent.unwrap_or(AgentKind::Echo);
    if agent == AgentKind::Exec && a.agent_cmd.as_deref().is_none_or(|c| c.trim().is_empty()) {
        return Err("--agent exec needs --agent-cmd".into());
    }
    if a.auth_token.as_deref() == Some("") {
        return Err("--auth-token: must not be empty".into());
    }
    let listen = a
        .listen
        .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 7878)));
    if !listen.ip().is_loopback() && a.auth_token.is_none() && !a.allow_insecure_bind {
        return Err(format!(
            "--listen {listen}: a non-loopback address needs --auth-token (or --allow-insecure-bind)"
        ));
    }
    let max_reply_bytes = at_least_one("max-reply-bytes", a.max_reply_bytes, 1 << 20)?;
    let bridge = BridgeConfig {
        auth_token: a.auth_token.clone(),
        max_connections: at_least_one("max-connections", a.max_connections, 1024)?,
        max_unauthenticated: at_least_one("max-unauthenticated", a.max_unauthenticated, 256)?,
        max_unauthenticated_per_peer: at_least_one(
            "max-unauthenticated-per-peer",
            a.max_unauthenticated_per_peer,
            32,
        )?,
        hello_timeout: seconds("hello-timeout", a.hello_timeout, 5.0, false)?,
        max_line_bytes: at_least_one("max-line-bytes", a.max_line_bytes, 65_536)?,
        max_write_buffer: at_least_one("max-write-buffer", a.max_write_buffer, 1 << 20)?,
        write_budget: at_least_one("write-budget", a.write_budget, 256 * 1024)?,
        write_stall_timeout: seconds("write-stall-timeout", a.write_stall_timeout, 60.0, false)?,
        max_platforms: at_least_one("max-platforms", a.max_platforms, 16)?,
        outbox_cap: at_least_one("outbox-cap", a.outbox_cap, 10_000)?,
        outbox_bytes: at_least_one("outbox-bytes", a.outbox_bytes, 256 << 20)?,
        max_reply_bytes,
        dedup_window: seconds("dedup-window", a.dedup_window, 600.0, false)?,
        dedup_max: at_least_one("dedup-max", a.dedup_max, 1_000_000)?,
        ..BridgeConfig::default()
    };
    let reserve = max_reply_bytes.saturating_add(turnstile::server::bridge::TERMINAL_ENVELOPE);
    if bridge.outbox_bytes < reserve {
        return Err(format!(
            "--outbox-bytes: {} is less than one result's reservation ({reserve} bytes: --max-reply-bytes + 8 KiB)",
            bridge.outbox_bytes
        ));
    }
    Ok(Settings {
        listen,
        bridge,
        max_reply_bytes,
        allow_insecure_bind: a.allow_insecure_bind,
        agent,
        agent_cmd: a.agent_cmd,
        echo_delay: Duration::from_millis(a.echo_delay_ms.unwrap_or(0)),
        busy_mode: match a.busy_mode.unwrap_or(BusyArg::Queue) {
            BusyArg::Queue => BusyMode::Queue,
            BusyArg::Interrupt => BusyMode::Interrupt,
            BusyArg::Merge => BusyMode::Merge,
        },
        queue_cap: at_least_one("queue-cap", a.queue_cap, 32)?,
        turn_workers: at_least_one("turn-workers", a.turn_workers, 16)?,
        cleanup_workers: at_least_one("cleanup-workers", a.cleanup_workers, 2)?,
        turn_timeout: seconds("turn-timeout", a.turn_timeout, 600.0, false)?,
        stop_grace: seconds("stop-grace", a.stop_grace, 5.0, true)?,
        cleanup_timeout: seconds("cleanup-timeout", a.cleanup_timeout, 30.0, false)?,
        drain_timeout: seconds("drain-timeout", a.drain_timeout, 30.0, true)?,
        status_file: a.status_file,
    })
}

/// Runs the server; returns the process exit code.
pub fn run(args: ServeArgs) -> i32 {
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
    match turnstile::server::raise_fd_limit() {
        Ok((old, new)) if new > old => {
            log::info!("raised the open-file limit from {old} to {new} (the hard limit)")
        }
        Ok((_, now)) => log::info!("open-file limit: {now}"),
        Err(e) => log::warn!("cannot raise the open-file limit: {e}"),
    }
    let builder = match (s.agent, &s.agent_cmd) {
        (AgentKind::Exec, Some(cmd)) => Builder::new(ExecAgent::factory(cmd)),
        _ => Builder::new(EchoAgent::factory(s.echo_delay)),
    };
    let mut builder = builder
        .busy_mode(s.busy_mode)
        .queue_cap(s.queue_cap)
        .turn_workers(s.turn_workers)
        .cleanup_workers(s.cleanup_workers)
        .turn_timeout(s.turn_timeout)
        .stop_grace(s.stop_grace)
        .cleanup_timeout(s.cleanup_timeout)
        .drain_timeout(s.drain_timeout)
        .max_reply_bytes(s.max_reply_bytes);
    if let Some(path) = &s.status_file {
        builder = builder.status_file(path);
    }
    let (runtime, _handle, _events) = match builder.build() {
        Ok(parts) => parts,
        Err(e) => {
            eprintln!("turnstile serve: {e}");
            return USAGE_ERROR;
        }
    };
    // Well past every shutdown deadline: drain, grace, cleanup, then the flush budget.
    let flush_budget = Duration::from_secs(5);
    let watchdog =
        s.drain_timeout + s.stop_grace + s.cleanup_timeout + flush_budget + Duration::from_secs(30);
    let cfg = ServerConfig {
        bridge: s.bridge,
        flush_budget,
        watchdog,
        allow_insecure_bind: s.allow_insecure_bind,
        ..ServerConfig::default()
    };
    let server = match BridgeServer::bind(s.listen, cfg) {
        Ok(server) => server,
        Err(e) => {
            eprintln!("turnstile serve: --listen {}: {e}", s.listen);
            return USAGE_ERROR;
        }
    };
    let addr = match server.local_addr() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("turnstile serve: {e}");
            return 1;
        }
    };
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "listening on {addr}");
    let _ = stdout.flush();
    drop(stdout);
    log::info!(
        "serving: agent {:?}, {} turn workers, busy mode {:?}",
        s.agent,
        s.turn_workers,
        s.busy_mode
    );
    match runtime.run_with(server) {
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
