//! `turnstile bridge <platform>`: a native platform bridge, a bridge-protocol client of a
//! running gateway (the code is in `crate::platforms`).

use std::io::Write;
use std::time::Duration;

use crate::platforms::gateway::{GatewayConfig, token_from_env};
use clap::{Args, Subcommand};
use crossbeam_channel::{Receiver, bounded};

use super::USAGE_ERROR;

/// Flags of `bridge`.
#[derive(Args, Debug)]
pub(crate) struct BridgeArgs {
    #[command(subcommand)]
    platform: Platform,
}

#[derive(Subcommand, Debug)]
enum Platform {
    /// An IRC bot: channel lines addressed to it (`NICK: text`) and private messages.
    Irc(IrcArgs),
    /// A Telegram bot (Bot API long polling).
    Telegram(TelegramArgs),
    /// A Matrix bot (Client-Server API, /sync long polling; plain and end-to-end encrypted rooms).
    Matrix(MatrixArgs),
    /// A Discord bot (Gateway v10 WebSocket and REST API).
    Discord(DiscordArgs),
    /// A Slack app (Socket Mode and the Web API).
    Slack(SlackArgs),
}

/// Flags every bridge has.
#[derive(Args, Debug)]
struct GatewayArgs {
    /// Address of the gateway (`turnstile serve`).
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:7878")]
    gateway: String,
    /// Environment variable holding the gateway's auth token (unset or empty: no token).
    #[arg(long, value_name = "NAME", default_value = "TURNSTILE_AUTH_TOKEN")]
    gateway_token_env: String,
    /// Connect to the gateway over TLS (its `--tls-cert`), trusting the CA certificates of
    /// this PEM file.
    #[arg(long, value_name = "PEM")]
    gateway_tls_ca: Option<std::path::PathBuf>,
    /// The name the gateway's certificate must be for (default: the host of --gateway).
    #[arg(long, value_name = "NAME", requires = "gateway_tls_ca")]
    gateway_tls_name: Option<String>,
    /// Longest line sent to the gateway, in bytes, when the gateway does not announce its
    /// own `--max-line-bytes` (it does in its `pong`, and that wins). A longer message is
    /// not sent; its sender is told once. Default 65,536, the gateway's default.
    #[arg(long, value_name = "BYTES", default_value_t = crate::platforms::gateway::DEFAULT_MAX_LINE_BYTES,
          value_parser = clap::value_parser!(usize))]
    max_line_bytes: usize,
    /// Messages held at once for a retry after a retryable refusal of the gateway
    /// (`shutting_down`, `overloaded`, `storage`, `backpressure`); past it such a refusal is
    /// told to the sender at once. Default 1,000.
    #[arg(long, value_name = "N", default_value_t = crate::platforms::gateway::DEFAULT_MAX_HELD)]
    max_held_messages: usize,
    /// The gateway's attachments spool (its `--attachments-dir`, on this host): the files
    /// of the platform's messages are downloaded there, bounded. Without it they reach the
    /// agent named, not fetched (Telegram and Matrix).
    #[arg(long, value_name = "DIR")]
    attachments_dir: Option<std::path::PathBuf>,
    /// Largest file downloaded; a larger one reaches the agent named, with the reason, and
    /// its sender is told. Default 20 MiB.
    #[arg(long, value_name = "BYTES")]
    max_attachment_bytes: Option<crate::cli::units::Bytes>,
    /// Files of one message downloaded; the others are named, not fetched. Default 10.
    #[arg(long, value_name = "N")]
    max_attachments: Option<usize>,
    /// Bytes the spool may hold; a file that does not fit is named, not fetched. Default
    /// 1 GiB.
    #[arg(long, value_name = "BYTES")]
    attachments_bytes: Option<crate::cli::units::Bytes>,
    /// How long a message is sent again (after retryable refusals, or while the gateway is
    /// away) before the bridge gives up and tells its sender, once. Default 10 min.
    #[arg(long, value_name = "DURATION", default_value = "10m")]
    max_hold: crate::cli::units::Seconds,
}

impl GatewayArgs {
    /// The spool (which must exist: the gateway made it) and its bounds.
    fn attachment_limits(&self) -> Result<crate::AttachmentLimits, String> {
        let d = crate::AttachmentLimits::default();
        let dir = match &self.attachments_dir {
            None => None,
            Some(dir) => Some(
                dir.canonicalize()
                    .map_err(|e| format!("--attachments-dir {}: {e}", dir.display()))?,
            ),
        };
        Ok(crate::AttachmentLimits {
            dir,
            max_files: self.max_attachments.unwrap_or(d.max_files),
            max_file_bytes: self
                .max_attachment_bytes
                .map_or(d.max_file_bytes, |b| b.0 as u64),
            spool_bytes: self.attachments_bytes.map_or(d.spool_bytes, |b| b.0 as u64),
        })
    }

    fn config(&self, platform: &str) -> Result<GatewayConfig, String> {
        let token = token_from_env(&self.gateway_token_env)?;
        let mut config = GatewayConfig::new(&self.gateway, platform, token);
        config.max_line_bytes = self.max_line_bytes;
        config.max_held = self.max_held_messages;
        config.max_hold = Duration::from_secs_f64(self.max_hold.0);
        config.attachments = self.attachment_limits()?;
        if let Some(ca) = &self.gateway_tls_ca {
            config.tls = Some(crate::platforms::tls::client_config(
                Some(ca),
                "--gateway-tls-ca",
            )?);
            config.tls_name = self.gateway_tls_name.clone();
        }
        Ok(config)
    }
}

/// How a bridge shows the agent's Markdown.
#[derive(Args, Debug)]
struct FormatArgs {
    /// `markdown`: the reply's Markdown (emphasis, code, lists, links, quotes, headings)
    /// shown as the platform formats it (Matrix HTML, Telegram HTML, IRC plain text without
    /// the markup); `plain`: the text exactly as the agent wrote it.
    #[arg(long, value_enum, default_value_t = crate::platforms::markdown::Format::Markdown)]
    format: crate::platforms::markdown::Format,
}

#[derive(Args, Debug)]
struct IrcArgs {
    #[command(flatten)]
    gateway: GatewayArgs,
    #[command(flatten)]
    format: FormatArgs,
    /// The IRC server.
    #[arg(long, value_name = "HOST:PORT")]
    server: String,
    /// Speak TLS to the server (its certificate checked against the system's roots).
    #[arg(long)]
    tls: bool,
    /// With --tls: trust only the CA certificates in this PEM file (a private server).
    #[arg(long, value_name = "PEM", requires = "tls")]
    tls_ca_file: Option<std::path::PathBuf>,
    /// With --tls: offer this client certificate (PEM, the chain) to the server, for
    /// --sasl-external or a network that knows the bot by its certificate.
    #[arg(long, value_name = "PEM", requires_all = ["tls", "tls_client_key"])]
    tls_client_cert: Option<std::path::PathBuf>,
    /// The private key of --tls-client-cert (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, value_name = "PEM", requires = "tls_client_cert")]
    tls_client_key: Option<std::path::PathBuf>,
    /// The bot's nick (an alternate is taken if it is in use).
    #[arg(long)]
    nick: String,
    /// A channel to join (repeatable), e.g. '#help'.
    #[arg(long = "channel", value_name = "CHANNEL")]
    channels: Vec<String>,
    /// Lines sent at once before pacing starts.
    #[arg(long, default_value_t = 5)]
    flood_burst: u32,
    /// Seconds between lines once the burst is used.
    #[arg(long, default_value_t = 1.0)]
    flood_interval: f64,
    /// Lines of one reply at most (the last one says what was left out).
    #[arg(long, default_value_t = 40)]
    max_reply_lines: usize,
    /// Environment variable holding the server's password (sent as `PASS`).
    #[arg(long, value_name = "NAME")]
    server_password_env: Option<String>,
    /// Log in with SASL PLAIN as this account (the password from --sasl-password-env).
    #[arg(long, value_name = "ACCOUNT", requires = "sasl_password_env")]
    sasl_account: Option<String>,
    /// Environment variable holding the SASL account's password.
    #[arg(long, value_name = "NAME", requires = "sasl_account")]
    sasl_password_env: Option<String>,
    /// Log in with SASL EXTERNAL: the server knows the bot by its client certificate
    /// (--tls-client-cert).
    #[arg(long, requires = "tls_client_cert", conflicts_with = "sasl_account")]
    sasl_external: bool,
    /// Environment variable holding the password sent to NickServ (`IDENTIFY`) after
    /// connecting.
    #[arg(long, value_name = "NAME")]
    nickserv_password_env: Option<String>,
}

/// The secret in the environment variable `var` (named by `flag`), which must be set and not
/// empty. The error names the variable, never a value.
fn secret_from_env(
    var: Option<&str>,
    flag: &str,
) -> Result<Option<crate::platforms::secrets::Secret>, String> {
    let Some(var) = var else {
        return Ok(None);
    };
    match token_from_env(var)? {
        Some(v) => Ok(Some(crate::platforms::secrets::Secret::new(v))),
        None => Err(format!("{flag} {var}: the variable is unset or empty")),
    }
}

#[derive(Args, Debug)]
struct TelegramArgs {
    #[command(flatten)]
    gateway: GatewayArgs,
    #[command(flatten)]
    format: FormatArgs,
    /// Base URL of the Bot API.
    #[arg(long, value_name = "URL", default_value = "https://api.telegram.org")]
    api_base: String,
    /// Environment variable holding the bot token.
    #[arg(long, value_name = "NAME", default_value = "TELEGRAM_BOT_TOKEN")]
    bot_token_env: String,
    /// Directory keeping the update offset, so a restart processes no update twice, and the
    /// ids of the results shown (the newest 4,096), so a restart shows none twice.
    #[arg(long, value_name = "DIR")]
    state_dir: Option<std::path::PathBuf>,
    /// Seconds one getUpdates long poll waits for updates.
    #[arg(long, default_value_t = 30)]
    poll_timeout: u64,
}

#[derive(Args, Debug)]
struct DiscordArgs {
    #[command(flatten)]
    gateway: GatewayArgs,
    /// Base URL of the REST API (the Gateway's URL comes from its `GET /gateway/bot`).
    #[arg(
        long,
        value_name = "URL",
        default_value = "https://discord.com/api/v10"
    )]
    api_base: String,
    /// Environment variable holding the bot token.
    #[arg(long, value_name = "NAME", default_value = "DISCORD_BOT_TOKEN")]
    token_env: String,
    /// Directory keeping the Gateway session, so a restart resumes it and answers what came
    /// while the bridge was down (while Discord still keeps the session).
    #[arg(long, value_name = "DIR")]
    state_dir: Option<std::path::PathBuf>,
}

#[derive(Args, Debug)]
struct SlackArgs {
    #[command(flatten)]
    gateway: GatewayArgs,
    /// Base URL of the Web API.
    #[arg(long, value_name = "URL", default_value = "https://slack.com/api")]
    api_base: String,
    /// Environment variable holding the app-level token (`xapp-…`, Socket Mode).
    #[arg(long, value_name = "NAME", default_value = "SLACK_APP_TOKEN")]
    app_token_env: String,
    /// Environment variable holding the bot token (`xoxb-…`).
    #[arg(long, value_name = "NAME", default_value = "SLACK_BOT_TOKEN")]
    bot_token_env: String,
    /// Directory keeping the ids of the results shown (the newest 4,096), so a result
    /// redelivered after a restart is not shown twice. What came while the bridge was down
    /// needs no state: Slack redelivers every event it had no ack for.
    #[arg(long, value_name = "DIR")]
    state_dir: Option<std::path::PathBuf>,
}

#[derive(Args, Debug)]
struct MatrixArgs {
    #[command(flatten)]
    gateway: GatewayArgs,
    #[command(flatten)]
    format: FormatArgs,
    /// Base URL of the homeserver, e.g. `https://matrix.example.org`.
    #[arg(long, value_name = "URL")]
    homeserver: String,
    /// Environment variable holding the bot's access token.
    #[arg(long, value_name = "NAME", default_value = "MATRIX_ACCESS_TOKEN")]
    access_token_env: String,
    /// Rooms the bot stays joined to at most (later invites are ignored, logged).
    #[arg(long, default_value_t = 1000)]
    max_rooms: usize,
    /// Directory keeping the sync position, so a restarted bridge answers what was written
    /// while it was down (without it, each start answers only what comes after it), and the
    /// ids of the results shown (the newest 4,096), so a restart shows none twice, and the
    /// encryption keys (pickled with the key in `--pickle-key-env`).
    #[arg(long, value_name = "DIR")]
    state_dir: Option<std::path::PathBuf>,
    /// Environment variable holding the key the encryption state in `--state-dir` is pickled
    /// with (without it the bot is a new device at every start).
    #[arg(long, value_name = "NAME", default_value = "MATRIX_PICKLE_KEY")]
    pickle_key_env: String,
    /// Seconds an encrypted message whose key has not come waits before the room is told
    /// (once per room).
    #[arg(long, value_name = "SECS", default_value_t = 60)]
    undecryptable_notice_after: u64,
    /// Encrypted messages waiting for their key at most (past it the oldest is dropped).
    #[arg(long, value_name = "N", default_value_t = 256)]
    max_undecryptable: usize,
    /// Trust only the devices listed in FILE (`@user:server DEVICEID ED25519KEY` a line, the
    /// key as clients show it): only they get room keys, only their room keys are taken.
    /// Without it, every device is trusted on first use.
    #[arg(long, value_name = "FILE")]
    matrix_require_verified: Option<std::path::PathBuf>,
}

/// What one `turnstile bridge <platform>` command line takes from its environment and its
/// disk: `serve` gives each `[[bridge]]` child these variables and no other secret, and
/// checks them and the state directory before it starts (`--check-config` too).
pub(crate) struct BridgeNeeds {
    /// Variables that must be set and not empty, each with the flag that names it.
    pub(crate) required: Vec<(String, &'static str)>,
    /// The variable of the gateway's token (`--gateway-token-env`), read only if set.
    pub(crate) gateway_token_env: String,
    /// Other secrets' variables read only if set (Matrix's `--pickle-key-env`).
    pub(crate) optional: Vec<String>,
    /// The `--state-dir`, if any: the bridge creates it and writes in it.
    pub(crate) state_dir: Option<std::path::PathBuf>,
}

impl BridgeArgs {
    /// What these flags make the bridge read from its environment and disk.
    pub(crate) fn needs(&self) -> BridgeNeeds {
        match &self.platform {
            Platform::Irc(a) => BridgeNeeds {
                required: [
                    (&a.server_password_env, "--server-password-env"),
                    (&a.sasl_password_env, "--sasl-password-env"),
                    (&a.nickserv_password_env, "--nickserv-password-env"),
                ]
                .into_iter()
                .filter_map(|(var, flag)| var.clone().map(|v| (v, flag)))
                .collect(),
                gateway_token_env: a.gateway.gateway_token_env.clone(),
                optional: Vec::new(),
                state_dir: None,
            },
            Platform::Telegram(a) => BridgeNeeds {
                required: vec![(a.bot_token_env.clone(), "--bot-token-env")],
                gateway_token_env: a.gateway.gateway_token_env.clone(),
                optional: Vec::new(),
                state_dir: a.state_dir.clone(),
            },
            Platform::Matrix(a) => BridgeNeeds {
                required: vec![(a.access_token_env.clone(), "--access-token-env")],
                gateway_token_env: a.gateway.gateway_token_env.clone(),
                optional: vec![a.pickle_key_env.clone()],
                state_dir: a.state_dir.clone(),
            },
            Platform::Slack(a) => BridgeNeeds {
                required: vec![
                    (a.app_token_env.clone(), "--app-token-env"),
                    (a.bot_token_env.clone(), "--bot-token-env"),
                ],
                gateway_token_env: a.gateway.gateway_token_env.clone(),
                optional: Vec::new(),
                state_dir: a.state_dir.clone(),
            },
            Platform::Discord(a) => BridgeNeeds {
                required: vec![(a.token_env.clone(), "--token-env")],
                gateway_token_env: a.gateway.gateway_token_env.clone(),
                optional: Vec::new(),
                state_dir: a.state_dir.clone(),
            },
        }
    }
}

/// Stops the bridge on SIGTERM or SIGINT (the receiver fires once).
fn stop_on_signals() -> Result<Receiver<()>, String> {
    let mut signals = signal_hook::iterator::Signals::new([libc::SIGTERM, libc::SIGINT])
        .map_err(|e| format!("cannot install the signal handlers: {e}"))?;
    let (tx, rx) = bounded(1);
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                log::info!("signal {sig}: stopping the bridge");
                let _ = tx.send(());
            }
        })
        .map_err(|e| format!("cannot start the signal thread: {e}"))?;
    Ok(rx)
}

/// Prints the `ready:` line scripts and tests wait for.
fn print_ready(platform: &str, identity: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "ready: {platform} as {identity}");
    let _ = out.flush();
}

fn seconds(name: &str, value: f64) -> Result<Duration, String> {
    if value.is_finite() && value >= 0.0 {
        Ok(Duration::from_secs_f64(value))
    } else {
        Err(format!("{name} must be a non-negative number of seconds"))
    }
}

/// Runs the bridge; returns the exit code (0 after SIGTERM, 2 on bad flags, 1 on failure).
pub(super) fn run(args: BridgeArgs) -> i32 {
    let (name, result) = match args.platform {
        Platform::Irc(a) => ("irc", run_irc(a)),
        Platform::Telegram(a) => ("telegram", run_telegram(a)),
        Platform::Matrix(a) => ("matrix", run_matrix(a)),
        Platform::Discord(a) => ("discord", run_discord(a)),
        Platform::Slack(a) => ("slack", run_slack(a)),
    };
    match result {
        Ok(()) => 0,
        Err(Failure::Usage(e)) => {
            eprintln!("turnstile bridge {name}: {e}");
            USAGE_ERROR
        }
        Err(Failure::Run(e)) => {
            log::error!("bridge {name}: {e}");
            eprintln!("turnstile bridge {name}: {e}");
            1
        }
    }
}

enum Failure {
    Usage(String),
    Run(String),
}

fn run_irc(a: IrcArgs) -> Result<(), Failure> {
    use crate::platforms::irc::{self, IrcConfig};
    let gateway = a.gateway.config("irc").map_err(Failure::Usage)?;
    let mut config = IrcConfig::new(gateway, &a.server, &a.nick, a.channels);
    config.tls = a.tls;
    config.tls_ca_file = a.tls_ca_file;
    config.tls_client_cert = a.tls_client_cert.zip(a.tls_client_key);
    config.login.sasl_external = a.sasl_external;
    config.flood_burst = a.flood_burst;
    config.flood_interval =
        seconds("--flood-interval", a.flood_interval).map_err(Failure::Usage)?;
    config.max_reply_lines = a.max_reply_lines;
    config.format = a.format.format;
    let env = |var: &Option<String>, flag| secret_from_env(var.as_deref(), flag);
    config.login.server_password =
        env(&a.server_password_env, "--server-password-env").map_err(Failure::Usage)?;
    config.login.nickserv_password =
        env(&a.nickserv_password_env, "--nickserv-password-env").map_err(Failure::Usage)?;
    if let (Some(account), Some(password)) = (
        a.sasl_account,
        env(&a.sasl_password_env, "--sasl-password-env").map_err(Failure::Usage)?,
    ) {
        config.login.sasl_plain = Some((account, password));
    }
    config.validate().map_err(Failure::Usage)?;
    let stop = stop_on_signals().map_err(Failure::Run)?;
    irc::run(config, &stop, &mut |nick| print_ready("irc", nick)).map_err(Failure::Run)
}

fn run_telegram(a: TelegramArgs) -> Result<(), Failure> {
    use crate::platforms::telegram::{self, TelegramConfig};
    let mut gateway = a.gateway.config("telegram").map_err(Failure::Usage)?;
    gateway.shown_file = a.state_dir.as_ref().map(|d| d.join("telegram-shown"));
    let token = token_from_env(&a.bot_token_env)
        .map_err(Failure::Usage)?
        .ok_or_else(|| {
            Failure::Usage(format!(
                "the bot token is missing: set {} (or name another variable with --bot-token-env)",
                a.bot_token_env
            ))
        })?;
    if !a.api_base.starts_with("https://") && !a.api_base.starts_with("http://") {
        return Err(Failure::Usage(format!(
            "--api-base {:?} is not an http(s) URL",
            a.api_base
        )));
    }
    if a.poll_timeout > 600 {
        return Err(Failure::Usage(
            "--poll-timeout is at most 600 seconds".into(),
        ));
    }
    let mut config = TelegramConfig::new(gateway, &a.api_base, &token);
    config.state_dir = a.state_dir;
    config.poll_timeout = Duration::from_secs(a.poll_timeout);
    config.format = a.format.format;
    let stop = stop_on_signals().map_err(Failure::Run)?;
    telegram::run(config, &stop, &mut |me| print_ready("telegram", me)).map_err(Failure::Run)
}

fn run_matrix(a: MatrixArgs) -> Result<(), Failure> {
    use crate::platforms::matrix::{self, MatrixConfig};
    let mut gateway = a.gateway.config("matrix").map_err(Failure::Usage)?;
    gateway.shown_file = a.state_dir.as_ref().map(|d| d.join("matrix-shown"));
    let token = match std::env::var(&a.access_token_env) {
        Ok(t) if !t.is_empty() => t,
        _ => {
            return Err(Failure::Usage(format!(
                "the bot's access token must be in the variable {} (--access-token-env)",
                a.access_token_env
            )));
        }
    };
    if a.max_rooms == 0 {
        return Err(Failure::Usage("--max-rooms must be at least 1".into()));
    }
    // A bad URL or token is a usage error, said before anything connects.
    matrix::api::Api::new(&a.homeserver, &token, Duration::from_secs(1)).map_err(Failure::Usage)?;
    let mut config = MatrixConfig::new(&a.homeserver, token, gateway);
    config.max_rooms = a.max_rooms;
    config.format = a.format.format;
    config.state_dir = a.state_dir;
    config.e2ee.pickle_secret = std::env::var(&a.pickle_key_env)
        .ok()
        .filter(|k| !k.is_empty());
    config.e2ee.notice_after = Duration::from_secs(a.undecryptable_notice_after);
    config.e2ee.max_pending = a.max_undecryptable.max(1);
    if let Some(path) = &a.matrix_require_verified {
        let list = matrix::crypto::Verified::load(path).map_err(Failure::Usage)?;
        config.e2ee.verified = Some(std::sync::Arc::new(list));
    }
    let stop = stop_on_signals().map_err(Failure::Run)?;
    matrix::run(config, &stop, &mut |me| print_ready("matrix", me)).map_err(Failure::Run)
}

fn run_discord(a: DiscordArgs) -> Result<(), Failure> {
    use crate::platforms::discord::{self, DiscordConfig, DiscordError};
    let mut gateway = a.gateway.config("discord").map_err(Failure::Usage)?;
    gateway.shown_file = a.state_dir.as_ref().map(|d| d.join("discord-shown"));
    let token = token_from_env(&a.token_env)
        .map_err(Failure::Usage)?
        .ok_or_else(|| {
            Failure::Usage(format!(
                "the bot token is missing: set {} (or name another variable with --token-env)",
                a.token_env
            ))
        })?;
    if !a.api_base.starts_with("https://") && !a.api_base.starts_with("http://") {
        return Err(Failure::Usage(format!(
            "--api-base {:?} is not an http(s) URL",
            a.api_base
        )));
    }
    let mut config = DiscordConfig::new(gateway, &a.api_base, &token);
    config.state_dir = a.state_dir;
    let stop = stop_on_signals().map_err(Failure::Run)?;
    discord::run(config, &stop, &mut |me| print_ready("discord", me)).map_err(|e| match e {
        // A setting must change (the token, the intents): like a usage error, exit 2.
        DiscordError::Fatal(e) => {
            log::error!("bridge discord: {e}");
            Failure::Usage(e)
        }
        DiscordError::Failed(e) => Failure::Run(e),
    })
}

fn run_slack(a: SlackArgs) -> Result<(), Failure> {
    use crate::platforms::slack::{self, SlackConfig, SlackError};
    let mut gateway = a.gateway.config("slack").map_err(Failure::Usage)?;
    gateway.shown_file = a.state_dir.as_ref().map(|d| d.join("slack-shown"));
    let token = |var: &str, flag: &str| {
        token_from_env(var).map_err(Failure::Usage)?.ok_or_else(|| {
            Failure::Usage(format!(
                "a Slack token is missing: set {var} (or name another variable with {flag})"
            ))
        })
    };
    let app = token(&a.app_token_env, "--app-token-env")?;
    let bot = token(&a.bot_token_env, "--bot-token-env")?;
    if !a.api_base.starts_with("https://") && !a.api_base.starts_with("http://") {
        return Err(Failure::Usage(format!(
            "--api-base {:?} is not an http(s) URL",
            a.api_base
        )));
    }
    let config = SlackConfig::new(gateway, &a.api_base, &app, &bot);
    let stop = stop_on_signals().map_err(Failure::Run)?;
    slack::run(config, &stop, &mut |me| print_ready("slack", me)).map_err(|e| match e {
        // A token must change: like a usage error, exit 2.
        SlackError::Fatal(e) => {
            log::error!("bridge slack: {e}");
            Failure::Usage(e)
        }
        SlackError::Failed(e) => Failure::Run(e),
    })
}
