//! `[[bridge]]` tables of the `--config` file: platform bridges (`turnstile bridge …`) run by
//! `serve` as supervised child processes, so one service (one systemd unit) runs a gateway
//! and its chat bots.
//!
//! ```toml
//! [[bridge]]
//! platform = "matrix"
//! args = ["--homeserver", "https://matrix.example.org", "--state-dir", "/var/lib/turnstile/matrix"]
//! ```
//!
//! Each bridge is this binary's `bridge <platform> --gateway <the bound address> <args…>`,
//! with the gateway's auth token in its environment (`TURNSTILE_AUTH_TOKEN`, never on its
//! command line) and the platform's own secrets taken from serve's environment as the bridge
//! documents (e.g. `MATRIX_ACCESS_TOKEN`). Its environment holds nothing else of serve's but
//! the ordinary process variables ([`PROCESS_VARS`], and every `LC_*`): no other platform's
//! secret. Its stderr (its log) is copied into serve's through a budget
//! ([`STDERR_BURST`] lines at once, then [`STDERR_PER_SEC`] a second, "(N more suppressed)").
//! A bridge that exits is restarted after a backoff
//! (1 s doubling to 60 s, back to 1 s once it ran a minute); it dies with the gateway
//! (`PR_SET_PDEATHSIG`) and is stopped with SIGTERM (then SIGKILL after 5 s) at shutdown.

use std::ffi::OsString;
use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStderr, Command, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use clap::{Args, FromArgMatches};
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, bounded};
use serde::Deserialize;

pub(super) use super::board::Board;
use super::board::is_error_line;
use crate::cli::bridge::{BridgeArgs, BridgeNeeds};
use crate::logfmt::{LogBudget, relay_lines, suppressed_note};

/// Most `[[bridge]]` tables one gateway runs.
pub(super) const MAX_BRIDGES: usize = 16;
/// First wait before a restart; doubled after each quick exit.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// A bridge that ran this long restarts after the first backoff again.
const STABLE_RUN: Duration = Duration::from_secs(60);
/// Between SIGTERM and SIGKILL at shutdown.
const STOP_GRACE: Duration = Duration::from_secs(5);
/// How often a supervisor looks at its child (it also wakes at once to stop).
const CHECK_EVERY: Duration = Duration::from_millis(100);
/// Lines of a bridge's stderr copied into serve's log at once, before the rate applies.
const STDERR_BURST: f64 = 100.0;
/// Lines of a bridge's stderr copied a second once its burst is used.
const STDERR_PER_SEC: f64 = 10.0;
/// Longest line of a bridge's stderr copied; the rest of it is cut (marked " …").
const STDERR_LINE_MAX: usize = 8192;

/// The variables of serve's environment every bridge child keeps, besides every `LC_*`, its
/// platform's own secrets (those its flags name) and the gateway's token: the locale, time
/// zone, user, temporary directory, log filter, the TLS roots' overrides and the HTTP proxy
/// settings the bridges' HTTP client reads.
const PROCESS_VARS: &[&str] = &[
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "LANG",
    "LANGUAGE",
    "TZ",
    "TMPDIR",
    "RUST_LOG",
    "RUST_LOG_STYLE",
    "RUST_BACKTRACE",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "ALL_PROXY",
    "all_proxy",
    "HTTPS_PROXY",
    "https_proxy",
    "HTTP_PROXY",
    "http_proxy",
    "NO_PROXY",
    "no_proxy",
];

/// A chat platform a `[[bridge]]` table may name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum BridgePlatform {
    /// `turnstile bridge matrix`.
    Matrix,
    /// `turnstile bridge irc`.
    Irc,
    /// `turnstile bridge telegram`.
    Telegram,
    /// `turnstile bridge discord`.
    Discord,
    /// `turnstile bridge slack`.
    Slack,
}

impl BridgePlatform {
    pub(super) fn name(self) -> &'static str {
        match self {
            BridgePlatform::Matrix => "matrix",
            BridgePlatform::Irc => "irc",
            BridgePlatform::Telegram => "telegram",
            BridgePlatform::Discord => "discord",
            BridgePlatform::Slack => "slack",
        }
    }
}

/// One `[[bridge]]` table.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct BridgeSpec {
    /// Which bridge.
    pub(super) platform: BridgePlatform,
    /// Its flags, as `turnstile bridge <platform> --help` lists them (without `--gateway`,
    /// which serve fills in).
    #[serde(default)]
    args: Vec<String>,
}

/// Checks every table the way the bridge itself will parse it, and that what it will need
/// is there (its secret variables, its state directory), so a bad table stops start-up (and
/// `--check-config`) with its index, platform and the error.
pub(super) fn check(specs: &[BridgeSpec]) -> Result<(), String> {
    if specs.len() > MAX_BRIDGES {
        return Err(format!(
            "[[bridge]]: {} tables, at most {MAX_BRIDGES}",
            specs.len()
        ));
    }
    for (i, spec) in specs.iter().enumerate() {
        if spec
            .args
            .iter()
            .any(|a| a == "--gateway" || a.starts_with("--gateway="))
        {
            return Err(format!(
                "[[bridge]] #{} ({}): --gateway is set by serve (the address it listens on)",
                i + 1,
                spec.platform.name()
            ));
        }
        let table =
            |text: String| format!("[[bridge]] #{} ({}): {text}", i + 1, spec.platform.name());
        let needs = parse(spec).map_err(table)?.needs();
        check_needs(&needs).map_err(table)?;
    }
    Ok(())
}

/// What the bridge will need at its start, there now: every secret variable its platform
/// reads set and not empty (named, never shown), its state directory writable.
fn check_needs(needs: &BridgeNeeds) -> Result<(), String> {
    for (var, flag) in &needs.required {
        match std::env::var(var) {
            Ok(v) if !v.is_empty() => {}
            Ok(_) | Err(std::env::VarError::NotPresent) => {
                return Err(format!(
                    "the variable {var} ({flag}) is unset or empty in serve's environment"
                ));
            }
            Err(std::env::VarError::NotUnicode(_)) => {
                return Err(format!("the variable {var} ({flag}) is not valid UTF-8"));
            }
        }
    }
    if let Some(dir) = &needs.state_dir {
        check_state_dir(dir).map_err(|e| format!("--state-dir {}: {e}", dir.display()))?;
    }
    Ok(())
}

/// The bridge creates its state directory if it is missing: the directory, or else its
/// nearest existing parent, must take a new file (one is made and removed to see).
fn check_state_dir(dir: &std::path::Path) -> Result<(), String> {
    let mut at = dir;
    loop {
        match std::fs::metadata(at) {
            Ok(m) if m.is_dir() => break,
            Ok(_) => return Err(format!("{} is not a directory", at.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                at = match at.parent() {
                    Some(p) if !p.as_os_str().is_empty() => p,
                    _ => std::path::Path::new("."),
                };
            }
            Err(e) => return Err(format!("{}: {e}", at.display())),
        }
    }
    let probe = at.join(format!(".turnstile-check-{}", std::process::id()));
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
        .and_then(|_| std::fs::remove_file(&probe))
        .map_err(|e| format!("not writable ({}): {e}", at.display()))
}

/// The table's flags parsed by the definitions of `turnstile bridge <platform>`, as the
/// child will parse them; the error is clap's message up to its usage block, on one line.
fn parse(spec: &BridgeSpec) -> Result<BridgeArgs, String> {
    let argv = ["bridge", spec.platform.name(), "--gateway", "127.0.0.1:1"]
        .into_iter()
        .map(String::from)
        .chain(spec.args.iter().cloned());
    let command = BridgeArgs::augment_args(clap::Command::new("bridge"));
    command
        .try_get_matches_from(argv)
        .and_then(|m| BridgeArgs::from_arg_matches(&m))
        .map_err(|e| {
            let text = e.to_string();
            let text = text.split("\nUsage:").next().unwrap_or("");
            let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
            text.trim_start_matches("error: ").to_owned()
        })
}

/// The variables of serve's environment a bridge with these needs keeps (see
/// [`PROCESS_VARS`]); the gateway's token is set apart, from serve's own.
fn kept_env(needs: &BridgeNeeds) -> Vec<(OsString, OsString)> {
    std::env::vars_os()
        .filter(|(k, _)| {
            let Some(k) = k.to_str() else {
                return false;
            };
            PROCESS_VARS.contains(&k)
                || k.starts_with("LC_")
                || needs.required.iter().any(|(var, _)| var == k)
                || needs.optional.iter().any(|var| var == k)
                || (k == needs.gateway_token_env && k != "TURNSTILE_AUTH_TOKEN")
        })
        .collect()
}

/// The supervisors of the running bridges; [`Bridges::stop`] ends them.
pub(super) struct Bridges {
    stop: Option<Sender<()>>,
    threads: Vec<JoinHandle<()>>,
}

impl Bridges {
    /// Starts one supervisor thread per table, each telling `board` of its process.
    pub(super) fn start(
        specs: &[BridgeSpec],
        gateway: SocketAddr,
        (token, spool): (Option<&str>, &[String]),
        log_json: bool,
        board: &Board,
    ) -> Bridges {
        let (stop, stopped) = bounded::<()>(0);
        let gateway = reachable(gateway);
        let threads = specs
            .iter()
            .enumerate()
            .filter_map(|(i, spec)| {
                // Checked at start-up: it parses.
                let needs = parse(spec).map(|a| a.needs()).ok()?;
                // Its secrets are redacted from its lines the status keeps.
                for (var, _) in &needs.required {
                    crate::platforms::secrets::register(&std::env::var(var).unwrap_or_default());
                }
                crate::platforms::secrets::register(token.unwrap_or_default());
                let launch = Launch {
                    index: i + 1,
                    spec: spec.clone(),
                    needs,
                    gateway,
                    token: token.map(str::to_owned),
                    spool: spool.to_vec(),
                    log_json,
                    board: board.clone(),
                };
                let stopped = stopped.clone();
                std::thread::Builder::new()
                    .name(format!("turnstile-bridge-{}", i + 1))
                    .spawn(move || supervise(&launch, &stopped))
                    .map_err(|e| {
                        log::error!(
                            "bridge #{} ({}): cannot start its supervisor: {e}",
                            i + 1,
                            spec.platform.name()
                        );
                    })
                    .ok()
            })
            .collect();
        Bridges {
            stop: Some(stop),
            threads,
        }
    }

    /// Stops every bridge (SIGTERM, then SIGKILL after a grace) and waits for it.
    pub(super) fn stop(mut self) {
        drop(self.stop.take());
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// A wildcard listen address is reached on loopback by a child on the same host.
fn reachable(addr: SocketAddr) -> SocketAddr {
    match addr {
        SocketAddr::V4(a) if a.ip().is_unspecified() => {
            SocketAddr::from(([127, 0, 0, 1], a.port()))
        }
        SocketAddr::V6(a) if a.ip().is_unspecified() => {
            SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, a.port()))
        }
        a => a,
    }
}

/// What a supervisor starts, again and again.
struct Launch {
    index: usize,
    spec: BridgeSpec,
    /// What its flags make it read from its environment.
    needs: BridgeNeeds,
    gateway: SocketAddr,
    token: Option<String>,
    /// The gateway's spool and bounds as bridge flags ([`spool_args`]).
    spool: Vec<String>,
    log_json: bool,
    board: Board,
}

/// The spool and its bounds as the flags a bridge takes (issue 36): each supervised bridge
/// downloads its platform's files where the gateway admits them.
pub(super) fn spool_args(limits: &crate::AttachmentLimits) -> Vec<String> {
    let Some(dir) = &limits.dir else {
        return Vec::new();
    };
    [
        ("--attachments-dir", dir.display().to_string()),
        ("--max-attachment-bytes", limits.max_file_bytes.to_string()),
        ("--max-attachments", limits.max_files.to_string()),
        ("--attachments-bytes", limits.spool_bytes.to_string()),
    ]
    .into_iter()
    .flat_map(|(flag, value)| [flag.to_owned(), value])
    .collect()
}

impl Launch {
    fn name(&self) -> String {
        format!("#{} ({})", self.index, self.spec.platform.name())
    }

    fn spawn(&self) -> std::io::Result<Child> {
        let mut command = Command::new(program()?);
        command
            .args(["--log-format", if self.log_json { "json" } else { "text" }])
            .args(["bridge", self.spec.platform.name()])
            .arg("--gateway")
            .arg(self.gateway.to_string())
            .args(&self.spec.args)
            // The gateway's own spool, unless the table names one.
            .args(
                if self
                    .spec
                    .args
                    .iter()
                    .any(|a| a.starts_with("--attachments-dir"))
                {
                    &[][..]
                } else {
                    &self.spool[..]
                },
            )
            .stdin(Stdio::null())
            // Its `ready:` line is not serve's stdout; its log is copied into serve's.
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .env_clear()
            .envs(kept_env(&self.needs));
        if let Some(t) = &self.token {
            command.env("TURNSTILE_AUTH_TOKEN", t);
        }
        // SAFETY: prctl(2) only, which is async-signal-safe, between fork and exec.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        command.spawn()
    }
}

/// Runs one bridge until `stopped` closes: start, wait, restart after a backoff.
fn supervise(launch: &Launch, stopped: &Receiver<()>) {
    let mut backoff = FIRST_BACKOFF;
    let mut again = false;
    loop {
        let started = Instant::now();
        match launch.spawn() {
            Ok(mut child) => {
                log::info!("bridge {}: started (pid {})", launch.name(), child.id());
                launch.board.started(launch.index, again);
                if let Some(stderr) = child.stderr.take() {
                    relay_stderr(launch.name(), stderr, launch.board.clone(), launch.index);
                }
                match wait_or_stop(&mut child, stopped) {
                    Waited::Stopped => {
                        terminate(launch, &mut child);
                        return;
                    }
                    Waited::Exited(status) => {
                        launch.board.exited(launch.index, status.to_string());
                        if started.elapsed() >= STABLE_RUN {
                            backoff = FIRST_BACKOFF;
                        }
                        log::warn!(
                            "bridge {}: exited ({status}); restarting in {backoff:?}",
                            launch.name()
                        );
                    }
                }
            }
            Err(e) => {
                launch
                    .board
                    .exited(launch.index, format!("cannot start: {e}"));
                log::error!(
                    "bridge {}: cannot start: {e}; retrying in {backoff:?}",
                    launch.name()
                );
            }
        }
        again = true;
        match stopped.recv_timeout(backoff) {
            Err(RecvTimeoutError::Timeout) => {}
            _ => return,
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// The program a bridge child runs: this binary (with the `test-hooks` feature,
/// `TURNSTILE_TEST_BRIDGE_EXE` if set, so a test can see what a child is given).
fn program() -> std::io::Result<std::path::PathBuf> {
    #[cfg(feature = "test-hooks")]
    if let Some(exe) = std::env::var_os("TURNSTILE_TEST_BRIDGE_EXE") {
        return Ok(exe.into());
    }
    std::env::current_exe()
}

/// Copies a child's stderr into serve's, line by line through a budget, on a thread of its
/// own (until the child's end closes the pipe).
fn relay_stderr(name: String, stderr: ChildStderr, board: Board, index: usize) {
    let thread = format!(
        "turnstile-bridge-{}-stderr",
        name.split(' ').next().unwrap_or("")
    );
    let spawned = std::thread::Builder::new()
        .name(thread)
        .spawn(move || copy_stderr(&name, stderr, &board, index));
    if let Err(e) = spawned {
        log::error!("cannot start a bridge stderr reader thread: {e}; its stderr is discarded");
    }
}

/// One child's stderr on its way into serve's: whole lines (its own log lines, already
/// formatted), cut at [`STDERR_LINE_MAX`], at most what the budget allows; an ERROR line
/// copied is also its last error on the board.
fn copy_stderr(name: &str, stderr: ChildStderr, board: &Board, index: usize) {
    let tell = |dropped: u64| {
        if dropped > 0 {
            log::warn!(
                "bridge {name}: its stderr is rate-limited{}",
                suppressed_note(dropped)
            );
        }
    };
    let budget = LogBudget::new(STDERR_BURST, STDERR_PER_SEC);
    let dropped = relay_lines(stderr, STDERR_LINE_MAX, budget, |line, cut, dropped| {
        tell(dropped);
        if is_error_line(line) {
            board.error_line(index, &String::from_utf8_lossy(line));
        }
        let mut out = line.to_vec();
        if cut {
            out.extend_from_slice(" …".as_bytes());
        }
        out.push(b'\n');
        let _ = std::io::stderr().lock().write_all(&out);
    });
    tell(dropped);
}

enum Waited {
    Stopped,
    Exited(std::process::ExitStatus),
}

fn wait_or_stop(child: &mut Child, stopped: &Receiver<()>) -> Waited {
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Waited::Exited(status),
            Ok(None) => {}
            Err(e) => {
                log::error!("bridge pid {}: cannot wait for it: {e}", child.id());
                return Waited::Stopped;
            }
        }
        match stopped.recv_timeout(CHECK_EVERY) {
            Err(RecvTimeoutError::Timeout) => {}
            _ => return Waited::Stopped,
        }
    }
}

/// SIGTERM, a grace, then SIGKILL; always reaped. The child is unreaped until then, so its
/// pid cannot have been reused.
fn terminate(launch: &Launch, child: &mut Child) {
    // SAFETY: kill(2) on our own unreaped child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    if crate::agents::child::wait_child_exit(child.id(), STOP_GRACE).unwrap_or(false)
        && let Ok(Some(status)) = child.try_wait()
    {
        log::info!("bridge {}: stopped ({status})", launch.name());
        return;
    }
    log::warn!(
        "bridge {}: still running {STOP_GRACE:?} after SIGTERM; killing it",
        launch.name()
    );
    let _ = child.kill();
    let _ = child.wait();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(platform: BridgePlatform, args: &[&str]) -> BridgeSpec {
        BridgeSpec {
            platform,
            args: args.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn tables_are_checked_as_the_bridge_parses_them() {
        let ok = spec(
            BridgePlatform::Irc,
            &[
                "--server",
                "127.0.0.1:6667",
                "--nick",
                "bot",
                "--channel",
                "#c",
            ],
        );
        assert_eq!(check(std::slice::from_ref(&ok)), Ok(()));
        let missing = spec(BridgePlatform::Matrix, &[]);
        let e = check(&[ok.clone(), missing]).expect_err("matrix needs --homeserver");
        assert!(e.starts_with("[[bridge]] #2 (matrix):"), "{e}");
        assert!(e.contains("--homeserver"), "{e}");
        let gateway = spec(BridgePlatform::Telegram, &["--gateway", "1.2.3.4:5"]);
        let e = check(&[gateway]).expect_err("--gateway is serve's");
        assert!(e.contains("--gateway is set by serve"), "{e}");
        let many = vec![ok; MAX_BRIDGES + 1];
        assert!(check(&many).expect_err("too many").contains("at most"));
    }

    #[test]
    fn a_wildcard_address_is_reached_on_loopback() {
        let any: SocketAddr = "0.0.0.0:7878".parse().expect("addr");
        assert_eq!(reachable(any), "127.0.0.1:7878".parse().expect("addr"));
        let v6: SocketAddr = "[::]:7878".parse().expect("addr");
        assert_eq!(reachable(v6), "[::1]:7878".parse().expect("addr"));
        let one: SocketAddr = "10.0.0.2:7878".parse().expect("addr");
        assert_eq!(reachable(one), one);
    }

    #[test]
    fn unknown_keys_and_platforms_are_refused() {
        assert!(toml::from_str::<BridgeSpec>("platform = \"whatsapp\"").is_err());
        assert!(toml::from_str::<BridgeSpec>("platform = \"irc\"\nargz = []").is_err());
        let s: BridgeSpec = toml::from_str("platform = \"irc\"").expect("no args is fine");
        assert!(s.args.is_empty());
    }
}
