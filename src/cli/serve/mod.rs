//! `turnstile serve`: flags, the optional TOML config file, and the server's lifetime —
//! `args` (the flags), `settings` (resolved and checked), `reload` (SIGHUP), and here the
//! run in its steps: build the runtime, bind the bridge (journal recovered), host the
//! operations endpoint, serve until stopped.

mod args;
mod board;
mod bridges;
mod exit;
mod lock;
mod reload;
mod settings;
mod tables;

#[cfg(test)]
pub(crate) use args::defaults;
pub(crate) use args::{ServeArgs, document_defaults};

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::agents::child::{self};
use crate::agents::routes::Picks;
use crate::journal::JournalConfig;
use crate::ops::http::HttpServer;
use crate::ops::systemd::SdNotify;
use crate::ops::{Ops, ReloadApplier, SwappableFactory, journal_ready};
use crate::server::{BridgeServer, ServerConfig};
use crate::{Builder, Handle, Runtime};

use crate::AgentFactory;
use crate::journal::{SqliteStore, Store};
use args::AgentKind;
use exit::{RETRYABLE, StartError};
use lock::DirLock;
use reload::{make_factory, reload_loader};
use settings::{Settings, resolve};

/// The heartbeat period of the served runtime.
const TICK_INTERVAL: Duration = Duration::from_millis(100);
/// Runs the server; returns the process exit code (see `exit` for what each means).
pub(crate) fn run(args: ServeArgs, log_json: bool) -> i32 {
    let check_only = args.check_config;
    let flags = args.clone();
    let ready = resolve(args)
        .map_err(StartError::from)
        .and_then(|s| preflight(s, check_only));
    let Preflight {
        settings: mut s,
        factory,
        picks,
        data,
    } = match ready {
        Ok(p) => p,
        Err(e) => {
            fatal(log_json, &e);
            return e.code();
        }
    };
    if check_only {
        println!("configuration ok");
        return 0;
    }
    log::info!(
        "turnstile {} (revision {}) starting, pid {}",
        crate::liveness::VERSION,
        crate::liveness::REVISION,
        std::process::id()
    );
    warn_secrets_on_command_line(&s);
    raise_fd_limit();
    if let Err(e) = private_spool(&mut s) {
        fatal(log_json, &e);
        return e.code();
    }
    // Held until the process ends: the data directory is this gateway's alone.
    let (_lock, store) = match data {
        Some((lock, store)) => (Some(lock), Some(store)),
        None => (None, None),
    };
    let board = bridges::Board::new(s.bridges.iter().map(|b| b.platform.name()));
    let started = build_runtime(&s, factory).and_then(|(runtime, handle, swap)| {
        let server = bind_bridge(&s, store)?;
        let forced = server.forced_stops();
        let unfinished = server.journal_unfinished();
        let addr = server
            .local_addr()
            .map_err(|e| exit::io_error(&e, format!("--listen: {e}")))?;
        let (mut ops, http_addr) = host_ops(server, &s, flags, handle, (swap, picks))?;
        if !s.bridges.is_empty() {
            let board = board.clone();
            ops = ops.with_status_addon(Box::new(move |f| board.fill(f)));
        }
        Ok((runtime, ops, (forced, unfinished), addr, http_addr))
    });
    let (runtime, ops, (forced, unfinished), addr, http_addr) = match started {
        Ok(parts) => parts,
        Err(e) => {
            fatal(log_json, &e);
            return e.code();
        }
    };
    announce(&s, addr, http_addr);
    let bridges = (!s.bridges.is_empty()).then(|| {
        let token = s.bridge.auth_token.as_deref();
        let spool = bridges::spool_args(&s.bridge.attachments);
        bridges::Bridges::start(&s.bridges, addr, (token, &spool), log_json, &board)
    });
    let mut code = serve_until_stopped(runtime, ops, &forced);
    if code == 0 && unfinished.load(std::sync::atomic::Ordering::SeqCst) {
        // Logged at ERROR by the server: what it did not write is recovered as after a crash.
        code = RETRYABLE;
    }
    if let Some(b) = bridges {
        b.stop();
    }
    if s.agents.iter().any(|a| a.kind != AgentKind::Echo) {
        // Closing each agent killed its processes; this catches anything a close left.
        child::kill_all();
    }
    code
}

/// Says where the gateway listens (the first stdout lines, which tests and supervisors wait
/// for) and what it serves.
fn announce(s: &Settings, addr: std::net::SocketAddr, http_addr: Option<std::net::SocketAddr>) {
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "listening on {addr}");
    if let Some(h) = http_addr {
        let _ = writeln!(stdout, "http on {h}");
    }
    let _ = stdout.flush();
    drop(stdout);
    log::info!(
        "serving: agent {:?} ({} named agents, {} routes), {} turn workers, busy mode {:?}",
        s.agents[0].kind,
        s.agents.len() - 1,
        s.routes.len(),
        s.core.config.turn_workers,
        s.core.config.busy_mode
    );
    if let Some(tls) = &s.tls {
        log::info!(
            "TLS on both listeners: certificate {}",
            tls.cert_path().display()
        );
    }
}

/// Raises the open-file limit to the hard limit, saying what it is.
fn raise_fd_limit() {
    match crate::server::raise_fd_limit() {
        Ok((old, new)) if new > old => {
            log::info!("raised the open-file limit from {old} to {new} (the hard limit)")
        }
        Ok((_, now)) => log::info!("open-file limit: {now}"),
        Err(e) => log::warn!("cannot raise the open-file limit: {e}"),
    }
}

/// What `serve` checks before it binds anything — everything `--check-config` checks too:
/// the settings, the status file, the agent factory (URLs, model), and with `--data-dir` the
/// directory locked, writable and its journal opened (and, for `--check-config`, read
/// through: a journal that cannot be trusted fails here too).
struct Preflight {
    settings: Settings,
    factory: Arc<dyn AgentFactory>,
    /// The live agents per name, shared by every route table (a reload makes new ones).
    picks: Arc<Picks>,
    data: Option<(DirLock, SqliteStore)>,
}

fn preflight(mut s: Settings, check_only: bool) -> Result<Preflight, StartError> {
    if let Some(path) = &s.status_file
        && let Err(e) = check_writable(path)
    {
        return Err(exit::io_error(
            &e,
            format!("--status-file {}: {e}", path.display()),
        ));
    }
    if let Some(c) = s.cluster.clone() {
        // Reachable, syncing every write before its ack, of the same partition count.
        let what = format_args!("--cluster {}", c.shown_url());
        crate::cluster::RedisStore::connect(c.clone()).map_err(|e| exit::store_error(&e, what))?;
        // The openai agent's conversations are read from Redis when a session's agent is made.
        s.memory =
            Some(crate::cluster::history_loader(&c).map_err(|e| exit::store_error(&e, what))?);
    }
    let data = match &s.data_dir {
        None => None,
        Some(dir) => {
            let what = format!("--data-dir {}", dir.display());
            let lock = lock::lock(dir).map_err(|e| match e.io_error() {
                Some(io) => exit::io_error(io, format!("{what}: {e}")),
                None => StartError::Config(format!("{what}: {e}")),
            })?;
            check_writable(&dir.join("turnstile.probe"))
                .map_err(|e| exit::io_error(&e, format!("{what}: not writable: {e}")))?;
            let mut store = SqliteStore::open(dir).map_err(|e| exit::store_error(&e, &what))?;
            if check_only {
                store
                    .load(crate::journal::now_ms())
                    .map_err(|e| exit::store_error(&e, &what))?;
            } else {
                // The bounds apply at once (a lowered --history-bytes, a shorter ttl).
                store
                    .set_history_limits(s.history)
                    .map_err(|e| exit::store_error(&e, &what))?;
                s.memory = Some(store.memory_loader());
            }
            Some((lock, store))
        }
    };
    // After the journal: the openai agent reads its stored conversations through it.
    let picks = Arc::new(Picks::default());
    let (factory, table) = make_factory(&s, &picks)?;
    if let Some(table) = &table {
        picks.install(table);
    }
    Ok(Preflight {
        settings: s,
        factory,
        picks,
        data,
    })
}

/// The runtime with its agent factory (swappable, so a reload can give new agents a new
/// command); for process-based agents the gateway becomes their subreaper first.
fn build_runtime(
    s: &Settings,
    factory: Arc<dyn AgentFactory>,
) -> Result<(Runtime, Handle, Arc<SwappableFactory>), StartError> {
    let swap = SwappableFactory::new(factory);
    if s.agents.iter().any(|a| a.runs_processes()) {
        if let Err(e) = child::become_subreaper() {
            log::warn!(
                "cannot become a child subreaper ({e}): agent processes that kill their own leader escape containment"
            );
        }
        // Whatever path ends the process, agent processes go with it.
        child::kill_all_at_exit();
        // With --cluster, also once it stops renewing its leases, stopped or not.
        if s.cluster.is_some()
            && let Err(e) = crate::cluster::leash::start()
        {
            return Err(StartError::Transient(format!(
                "cannot start the agents' leash: {e}"
            )));
        }
    }
    let mut builder = Builder::new(Arc::clone(&swap))
        .max_reply_bytes(s.max_reply_bytes)
        .core_config(s.core.config.clone())
        .cleanup_workers(s.core.cleanup_workers)
        .partial_interval(s.core.partial_interval)
        .tick_interval(TICK_INTERVAL);
    if let Some(path) = &s.status_file {
        builder = builder.status_file(path);
    }
    let (runtime, handle, _events) = builder.build().map_err(|e| match &e {
        // Threads the system would not give (EAGAIN, ENOMEM) may come later.
        crate::BuildError::Threads { source, .. } | crate::BuildError::Poll { source, .. } => {
            exit::io_error(source, e.to_string())
        }
        _ => StartError::Config(e.to_string()),
    })?;
    Ok((runtime, handle, swap))
}

/// The bridge server on `--listen`, with its journal (opened by `preflight`) recovered when
/// `--data-dir` is set.
/// The spool is made here, once (not on every reload), and named by its canonical path:
/// the directory configured, else a private temporary one; the supervised bridges are
/// given it too.
fn private_spool(s: &mut Settings) -> Result<(), StartError> {
    if let Some(dir) = &s.bridge.attachments.dir {
        let made = crate::attachments::open_spool(dir)
            .map_err(|e| exit::io_error(&e, format!("--attachments-dir {}: {e}", dir.display())))?;
        s.bridge.attachments.dir = Some(made);
        return Ok(());
    }
    let dir = settings::private_temp_dir()
        .and_then(|d| d.canonicalize())
        .map_err(|e| {
            exit::io_error(
                &e,
                format!("--attachments-dir: cannot create a private temporary directory: {e}"),
            )
        })?;
    log::info!("attachments spool: {}", dir.display());
    s.bridge.attachments.dir = Some(dir);
    Ok(())
}

fn bind_bridge(s: &Settings, store: Option<SqliteStore>) -> Result<BridgeServer, StartError> {
    // Well past every shutdown deadline: drain, grace, cleanup, the flush budget, then the
    // wait for delivery confirmations.
    let flush_budget = Duration::from_secs(5);
    // The confirmations of what the drain sent are awaited as long as the drain itself.
    let delivery_wait = s.core.config.drain_timeout;
    let watchdog = s.core.config.drain_timeout
        + s.core.config.stop_grace
        + s.core.config.cleanup_timeout
        + flush_budget
        + delivery_wait
        + Duration::from_secs(30);
    let cfg = ServerConfig {
        bridge: s.bridge.clone(),
        flush_budget,
        delivery_wait,
        watchdog,
        allow_insecure_bind: s.allow_insecure_bind,
        ..ServerConfig::default()
    };
    // An address in use or not ours is the configuration's to fix (under systemd the old
    // process has exited before the new one starts).
    let mut server = BridgeServer::bind(s.listen, cfg)
        .map_err(|e| StartError::Config(format!("--listen {}: {e}", s.listen)))?;
    server.set_tls(s.tls.clone());
    if let Some(c) = &s.cluster {
        return join_cluster(server, s, c);
    }
    let (Some(dir), Some(store)) = (&s.data_dir, store) else {
        // Nothing is journaled: every file a previous run left is an orphan.
        server.sweep_spool(&Default::default());
        return Ok(server);
    };
    server.persist_access(dir).map_err(|e| {
        exit::io_error(
            &e,
            format!("--data-dir {}: access.json: {e}", dir.display()),
        )
    })?;
    server
        .with_journal(store, JournalConfig::default())
        .map(|(server, _counts)| server)
        .map_err(|e| exit::store_error(&e, format_args!("--data-dir {}", dir.display())))
}

/// `--cluster`: the server journals to Redis (one connection for the journal thread, one
/// for the stream reader); a session's messages in flight across the cluster are bounded
/// by its queue cap and its running turn.
fn join_cluster(
    mut server: BridgeServer,
    s: &Settings,
    c: &crate::cluster::ClusterConfig,
) -> Result<BridgeServer, StartError> {
    let what = format_args!("--cluster {}", c.shown_url());
    let connect =
        || crate::cluster::RedisStore::connect(c.clone()).map_err(|e| exit::store_error(&e, what));
    let (mut journal, reader) = (connect()?, connect()?);
    journal.set_history_limits(s.history.ttl, s.history.max_bytes);
    // One process per id: a twin would skip the other's messages as its own.
    journal
        .claim_instance()
        .map_err(|e| exit::store_error(&e, what))?;
    // The access policy's approvals, codes and counters, merged across the instances.
    let shared = crate::cluster::access_store(c).map_err(StartError::Config)?;
    server
        .share_access(shared)
        .map_err(|e| exit::io_error(&e, format!("access: {e}")))?;
    log::info!(
        "cluster member {} on {}: {} partitions, lease {:?}",
        c.instance,
        c.shown_url(),
        c.partitions,
        c.lease
    );
    server
        .with_cluster(
            journal,
            reader,
            s.core.config.queue_cap.saturating_add(1),
            JournalConfig::default(),
        )
        .map_err(|e| exit::store_error(&e, what))
}

/// The operations frontend around the bridge server: the HTTP endpoint, readiness checks,
/// reload on SIGHUP (with `--config`) and systemd notifications.
fn host_ops(
    server: BridgeServer,
    s: &Settings,
    flags: ServeArgs,
    handle: Handle,
    (swap, picks): (Arc<SwappableFactory>, Arc<Picks>),
) -> Result<(Ops<BridgeServer>, Option<SocketAddr>), StartError> {
    let mut ops = Ops::new(server, TICK_INTERVAL);
    let mut http_addr = None;
    if let Some((addr, cfg)) = s.http.clone() {
        let mut server = HttpServer::bind(addr, cfg)
            .map_err(|e| StartError::Config(format!("--http-listen {addr}: {e}")))?;
        server.set_tls(s.tls.clone());
        http_addr = server.local_addr().ok();
        ops = ops.with_http(server);
    }
    if s.data_dir.is_some() || s.cluster.is_some() {
        // Not ready while the journal's writes fail: new messages would be rejected `storage`.
        ops = ops.with_readiness_check("store", Box::new(journal_ready));
    }
    // With TLS a SIGHUP re-reads the certificate even without a config file.
    if flags.config.is_some() || s.tls.is_some() {
        let loader = reload_loader(flags, s, picks);
        let apply: ReloadApplier<BridgeServer> = Box::new(move |server, r| {
            let mut restart = Vec::new();
            if !server.set_auth_token(r.auth_token.as_deref()) {
                restart.push("auth-token".to_owned());
            }
            handle.set_partial_interval(r.partial_interval);
            if let Some(f) = &r.factory {
                swap.swap(Arc::clone(f));
            }
            if let Some(tls) = &r.tls {
                log::info!(
                    "reload: TLS certificate read again from {}; new connections get it",
                    tls.cert_path().display()
                );
                server.set_tls(Some(tls.clone()));
            }
            restart
        });
        ops = ops.with_reload(loader, apply);
    }
    ops = ops.with_access(Box::new(|server, platform, command| {
        server.access_command(platform, command)
    }));
    if let Some(load) = &s.memory {
        ops = ops.with_history(Arc::clone(load));
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
            log::warn!("shutdown was not clean {report}");
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

/// A start-up error, in the chosen log format: with `--log-format json` an ERROR record (one
/// JSON object, like every other line), otherwise a plain line naming the command.
fn fatal(log_json: bool, e: &dyn std::fmt::Display) {
    if log_json {
        log::error!("turnstile serve: {e}");
    } else {
        eprintln!("turnstile serve: {e}");
    }
}

/// A WARN for each secret given on the command line, which any local user can read in
/// `/proc/PID/cmdline` (the environment or the `--config` file keep it out).
fn warn_secrets_on_command_line(s: &Settings) {
    if on_command_line(std::env::args_os(), "--auth-token") {
        log::warn!(
            "the auth token was given with --auth-token: any local user can read it in /proc/{}/cmdline; use TURNSTILE_AUTH_TOKEN or the --config file",
            std::process::id()
        );
    }
    if let Some(c) = &s.cluster
        && c.shown_url() != c.url
        && on_command_line(std::env::args_os(), "--cluster")
    {
        log::warn!(
            "the Redis password was given in the --cluster URL ({}): any local user can read it in /proc/{}/cmdline; put the URL in the --config file (`cluster = \"redis://…\"`)",
            c.shown_url(),
            std::process::id()
        );
    }
}

/// Whether `flag` (one taking a value: `--auth-token`, `--cluster`) appears among the
/// arguments: a secret in it is readable in `/proc/PID/cmdline` (the environment and the
/// config file keep it out).
fn on_command_line(args: impl Iterator<Item = std::ffi::OsString>, flag: &str) -> bool {
    let with_value = format!("{flag}=");
    args.take_while(|a| a != "--")
        .any(|a| a == flag || a.to_string_lossy().starts_with(&with_value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_flag_on_the_command_line_is_noticed() {
        let args = |v: &[&str]| v.iter().map(std::ffi::OsString::from).collect::<Vec<_>>();
        let on = |v: &[&str], flag| on_command_line(args(v).into_iter(), flag);
        assert!(on(
            &["turnstile", "serve", "--auth-token", "k"],
            "--auth-token"
        ));
        assert!(on(
            &["turnstile", "serve", "--auth-token=k"],
            "--auth-token"
        ));
        assert!(!on(
            &["turnstile", "serve", "--listen", "x"],
            "--auth-token"
        ));
        assert!(!on(
            &["turnstile", "send", "--", "--auth-token"],
            "--auth-token"
        ));
        assert!(on(
            &["turnstile", "serve", "--cluster=redis://:p@h"],
            "--cluster"
        ));
        assert!(!on(
            &["turnstile", "serve", "--cluster-rebalance", "false"],
            "--cluster"
        ));
    }
}
