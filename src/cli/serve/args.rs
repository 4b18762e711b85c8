//! The flags of `serve`, their defaults as the help shows them, and the `--config` file
//! under them.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::bridges::BridgeSpec;
use crate::BusyMode;
use crate::agents::openai::{
    DEFAULT_CONNECT_TIMEOUT, DEFAULT_HISTORY_CHARS, DEFAULT_HISTORY_TURNS,
    DEFAULT_INLINE_TEXT_BYTES, DEFAULT_READ_TIMEOUT, DEFAULT_STREAM_TIMEOUT,
};
use crate::agents::process::{self};
use crate::cli::units::{Bytes, ListenAddr, Seconds};
use crate::core::CoreConfig;
use crate::journal::memory::{DEFAULT_HISTORY_BYTES, DEFAULT_HISTORY_TTL};
use crate::ops::http::{self, DEFAULT_HTTP_LISTEN};
use crate::reactor::DEFAULT_PARTIAL_INTERVAL;
use crate::server::BridgeConfig;
use clap::{Args, ValueEnum};
use serde::Deserialize;

/// Where `serve` listens unless told otherwise.
pub(crate) const DEFAULT_LISTEN: ([u8; 4], u16) = ([127, 0, 0, 1], 7878);

/// `--access-default`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum AccessDefault {
    /// Strangers on the native platforms are paired.
    Pairing,
    /// Every platform without a table is open.
    Open,
}

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

impl AgentKind {
    /// Its name as `--agent` and an agent table's `kind` spell it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            AgentKind::Echo => "echo",
            AgentKind::Exec => "exec",
            AgentKind::Process => "process",
            AgentKind::Openai => "openai",
        }
    }
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
/// Declares [`ServeArgs`] from its one list of settings, and [`ServeArgs::over`] (flags over
/// the file) from the same list: a setting is one field, its flag (clap) and its key in the
/// file (serde, kebab-case) both derived from it.
macro_rules! settings {
    (
        $(#[$meta:meta])*
        pub(crate) struct ServeArgs {
            $($(#[$field_meta:meta])* $vis:vis $field:ident: $ty:ty,)*
        }
    ) => {
        $(#[$meta])*
        pub(crate) struct ServeArgs {
            $($(#[$field_meta])* $vis $field: $ty,)*
        }

        impl ServeArgs {
            /// These settings (the flags) over `file`'s: each one given here wins.
            fn over(self, file: ServeArgs) -> ServeArgs {
                ServeArgs {
                    $($field: Overlay::over(self.$field, file.$field),)*
                }
            }
        }
    };
}

/// A setting given twice (a flag, a key of the file): which one counts.
trait Overlay {
    /// `self` if it was given, else `under`.
    fn over(self, under: Self) -> Self;
}

impl<T> Overlay for Option<T> {
    fn over(self, under: Self) -> Self {
        self.or(under)
    }
}

/// A switch is on if either turned it on.
impl Overlay for bool {
    fn over(self, under: Self) -> Self {
        self || under
    }
}

settings! {
/// Flags of `serve`; the same keys (kebab-case) may appear in the `--config` TOML file, and
/// flags override the file.
#[derive(Args, Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct ServeArgs {
    /// TOML file with any of these settings.
    #[arg(long)]
    #[serde(skip)]
    pub(super) config: Option<PathBuf>,
    /// Address to listen on
    #[arg(long)]
    pub(super) listen: Option<ListenAddr>,
    /// Agent
    #[arg(long, value_enum)]
    pub(super) agent: Option<AgentKind>,
    /// Shell command of the exec or process agent.
    #[arg(long)]
    pub(super) agent_cmd: Option<String>,
    /// Seconds a process agent gets to exit after `close` before SIGTERM
    #[arg(long)]
    pub(super) agent_close_grace: Option<Seconds>,
    /// Pass this variable of the gateway's environment to agent processes (repeatable).
    #[arg(long, value_name = "NAME")]
    pub(super) agent_env: Option<Vec<String>>,
    /// Longest line a process agent may write on stdout
    #[arg(long)]
    pub(super) agent_max_line_bytes: Option<Bytes>,
    /// Replies and partials are cut to this many bytes and flagged truncated
    #[arg(long)]
    pub(super) max_reply_bytes: Option<Bytes>,
    /// Simulated work per echo turn, in milliseconds (cancellable)
    #[arg(long)]
    pub(super) echo_delay_ms: Option<u64>,
    /// What a message does while its session's turn runs
    #[arg(long, value_enum)]
    pub(super) busy_mode: Option<BusyMode>,
    /// Messages a session may hold waiting
    #[arg(long)]
    pub(super) queue_cap: Option<usize>,
    /// Threads running agent turns
    #[arg(long)]
    pub(super) turn_workers: Option<usize>,
    /// With --data-dir or --cluster: turns claimed beside the running ones while their start
    /// record is written (they take no worker). A kill -9 ends each whose start was durable
    /// `failed: interrupted by restart`, run or not: lower this to shrink that, at the cost
    /// of durable throughput (fewer start records per commit)
    #[arg(long)]
    pub(super) max_held_turns: Option<usize>,
    /// Threads closing agents that always run
    #[arg(long)]
    pub(super) cleanup_workers: Option<usize>,
    /// Agent close()s that may run at once; the cleanup pool grows on demand up to this
    #[arg(long)]
    pub(super) max_cleanup_workers: Option<usize>,
    /// Idle agents kept for reuse; sessions with waiting work keep theirs beyond it
    #[arg(long)]
    pub(super) max_cached_agents: Option<usize>,
    /// Seconds an idle agent is kept before it is closed
    #[arg(long)]
    pub(super) agent_idle_ttl: Option<Seconds>,
    /// Messages waiting across all sessions before new ones are rejected `overloaded`
    #[arg(long)]
    pub(super) max_queued_messages: Option<usize>,
    /// Bytes of text waiting across all sessions before new messages are rejected
    /// `overloaded`
    #[arg(long)]
    pub(super) max_queued_bytes: Option<Bytes>,
    /// Least seconds between two partial replies forwarded for one turn
    #[arg(long)]
    pub(super) partial_interval: Option<Seconds>,
    /// Seconds a turn may run
    #[arg(long)]
    pub(super) turn_timeout: Option<Seconds>,
    /// Seconds a cancelled turn gets to return
    #[arg(long)]
    pub(super) stop_grace: Option<Seconds>,
    /// Seconds an agent's close() may take
    #[arg(long)]
    pub(super) cleanup_timeout: Option<Seconds>,
    /// Seconds shutdown lets running turns finish
    #[arg(long)]
    pub(super) drain_timeout: Option<Seconds>,
    /// Write the status snapshot to this JSON file.
    #[arg(long)]
    pub(super) status_file: Option<PathBuf>,
    /// Token every bridge must present in its hello.
    #[arg(long, env = "TURNSTILE_AUTH_TOKEN", hide_env_values = true)]
    pub(super) auth_token: Option<String>,
    /// Connections beyond this are refused
    #[arg(long)]
    pub(super) max_connections: Option<usize>,
    /// Longest accepted protocol line
    #[arg(long)]
    pub(super) max_line_bytes: Option<Bytes>,
    /// Unwritten output per connection past which its reads pause and typing/partial lines
    /// are dropped; also the outbox backlog it is fed at a time
    #[arg(long)]
    pub(super) max_write_buffer: Option<Bytes>,
    /// Undelivered results a platform may have (reserved at admission; `backpressure`
    /// beyond)
    #[arg(long)]
    pub(super) outbox_cap: Option<usize>,
    /// Model name for --agent openai.
    #[arg(long)]
    pub(super) model: Option<String>,
    /// Base URL of the OpenAI-compatible API, e.g. http://127.0.0.1:11434/v1 (required with
    /// --agent openai; `https://api.openai.com/v1` for OpenAI).
    #[arg(long)]
    pub(super) openai_base_url: Option<String>,
    /// Environment variable holding the API key
    #[arg(long)]
    pub(super) openai_api_key_env: Option<String>,
    /// System prompt of the openai agent.
    #[arg(long)]
    pub(super) system_prompt: Option<String>,
    /// File whose text is the system prompt.
    #[arg(long)]
    pub(super) system_prompt_file: Option<PathBuf>,
    /// Past user/assistant exchanges sent with each message
    #[arg(long)]
    pub(super) history_turns: Option<usize>,
    /// Character budget of a request's conversation
    #[arg(long)]
    pub(super) history_chars: Option<usize>,
    /// Seconds without a turn after which a session's stored conversation is deleted (with
    /// --data-dir or --cluster: the openai agent's history is kept in the journal or Redis)
    #[arg(long)]
    pub(super) history_ttl: Option<Seconds>,
    /// Bytes of stored conversations in all (with --data-dir; with --cluster, split evenly
    /// among the partitions); past it, the least recently continued ones are deleted
    #[arg(long)]
    pub(super) history_bytes: Option<Bytes>,
    /// Prefix "[from: NAME (id ID); meta: {...}]" to the user's text
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub(super) openai_sender_prefix: Option<bool>,
    /// Send a message's images (PNG, JPEG, GIF, WebP) to the model as image_url parts
    /// (base64 data URLs), for vision models, within --max-attachment-bytes for the message's
    /// images together; off, they are named in the text
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub(super) openai_vision: Option<bool>,
    /// Bytes of a message's text files (text/*, JSON, XML, YAML…) inlined in its text, all
    /// together: a file past it is cut (and says so), the next ones named
    #[arg(long)]
    pub(super) openai_inline_text_bytes: Option<Bytes>,
    /// Seconds to open a connection to the API
    #[arg(long)]
    pub(super) openai_connect_timeout: Option<Seconds>,
    /// Seconds the API may go without sending content before the turn fails (SSE comments,
    /// keep-alives and empty deltas do not count)
    #[arg(long)]
    pub(super) openai_read_timeout: Option<Seconds>,
    /// Seconds a request may take in all (connect, retries, the whole stream); must be
    /// below --turn-timeout (the default is lowered to 90 % of a shorter --turn-timeout)
    #[arg(long)]
    pub(super) openai_stream_timeout: Option<Seconds>,
    /// Certificate authorities for https
    #[arg(long, value_enum)]
    pub(super) openai_tls_roots: Option<TlsRootsArg>,
    /// Bytes a platform may hold for owed results: 8 KiB per accepted message (its
    /// envelope) plus each result's text once it exists (`backpressure` beyond)
    #[arg(long)]
    pub(super) outbox_bytes: Option<Bytes>,
    /// Seconds after which a platform no bridge has said hello for is stale: its waiting
    /// results beyond --outbox-stale-keep are dropped (WARN each, counted in the status)
    #[arg(long)]
    pub(super) outbox_stale_after: Option<Seconds>,
    /// Waiting results a stale platform keeps (the newest)
    #[arg(long)]
    pub(super) outbox_stale_keep: Option<usize>,
    /// Platforms known at once; a hello or message for another gets `error`/`overloaded`
    #[arg(long)]
    pub(super) max_platforms: Option<usize>,
    /// Message ids a platform's duplicate window holds (`backpressure` beyond)
    #[arg(long)]
    pub(super) dedup_max: Option<usize>,
    /// Seconds an accepted (platform, id) is remembered
    #[arg(long)]
    pub(super) dedup_window: Option<Seconds>,
    /// Connections waiting for their hello (with a token), in all; at the cap the oldest waiting one is closed for the newcomer
    #[arg(long)]
    pub(super) max_unauthenticated: Option<usize>,
    /// Connections waiting for their hello (with a token), per address prefix (IPv4 /24, IPv6 /64)
    #[arg(long)]
    pub(super) max_unauthenticated_per_peer: Option<usize>,
    /// Seconds a connection has to send its hello (with a token)
    #[arg(long)]
    pub(super) hello_timeout: Option<Seconds>,
    /// Bytes written to one connection per loop wake
    #[arg(long)]
    pub(super) write_budget: Option<Bytes>,
    /// Seconds a connection with output may take none of it before it is closed (its
    /// results go back to the outbox)
    #[arg(long)]
    pub(super) write_stall_timeout: Option<Seconds>,
    /// Address of the operations HTTP endpoint (/healthz, /readyz, /status, /metrics), or
    /// `off`.
    #[arg(long, value_name = "ADDR|off")]
    pub(super) http_listen: Option<String>,
    /// Open connections to the HTTP endpoint; one more evicts the oldest idle one (503 when
    /// none is idle).
    #[arg(long)]
    pub(super) http_max_connections: Option<usize>,
    /// Open HTTP connections of one peer address; one more evicts that peer's oldest idle
    /// one.
    #[arg(long)]
    pub(super) http_max_per_peer: Option<usize>,
    /// Seconds a new HTTP connection has to send its first request's head.
    #[arg(long)]
    pub(super) http_head_timeout: Option<Seconds>,
    /// Bytes of an HTTP request head; more gets 431.
    #[arg(long)]
    pub(super) http_max_header_bytes: Option<Bytes>,
    /// HTTP requests served per connection before it is closed.
    #[arg(long)]
    pub(super) http_max_requests: Option<usize>,
    /// Seconds an HTTP connection has to complete a request.
    #[arg(long)]
    pub(super) http_idle_timeout: Option<Seconds>,
    /// TLS on both listeners (the bridge protocol's and the HTTP endpoint's): this PEM
    /// certificate chain, the server's certificate first (needs --tls-key; re-read on
    /// SIGHUP).
    #[arg(long, value_name = "PEM", requires = "tls_key")]
    pub(super) tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert (re-read on SIGHUP; never logged).
    #[arg(long, value_name = "PEM", requires = "tls_cert")]
    pub(super) tls_key: Option<PathBuf>,
    /// Listen on a non-loopback address without an auth token.
    #[arg(long)]
    #[serde(default)]
    pub(super) allow_insecure_bind: bool,
    /// Directory of the journal: turns durability on (acks after the message is on disk,
    /// recovery after a crash).
    #[arg(long)]
    pub(super) data_dir: Option<PathBuf>,
    /// At recovery, run again the turns a crash interrupted instead of failing them
    /// `interrupted by restart` (a message interrupted twice fails `poison`).
    #[arg(long)]
    #[serde(default)]
    pub(super) resume_interrupted: bool,
    /// Accepted messages waiting for the journal at once before `reject overloaded`.
    #[arg(long)]
    pub(super) max_pending_durable: Option<usize>,
    /// The spool: the only directory whose files a message's `attachments` may name (a path
    /// outside it is refused `invalid`); default `<data-dir>/attachments`, else a private
    /// temporary directory. Files no journaled message names are removed at start-up.
    #[arg(long, value_name = "DIR")]
    pub(super) attachments_dir: Option<PathBuf>,
    /// Largest attachment: a bridge skips a larger file (the entry kept, `skipped` saying
    /// why), the gateway refuses a message naming one and leaves out (said in the reply) a
    /// larger file an agent attaches.
    #[arg(long)]
    pub(super) max_attachment_bytes: Option<Bytes>,
    /// Attachments one message may carry (more: `reject invalid`), and one reply (more are
    /// left out, said in the reply).
    #[arg(long)]
    pub(super) max_attachments: Option<usize>,
    /// Bytes the spool may hold in all: a bridge skips a file that does not fit, an agent's
    /// reply leaves it out (said).
    #[arg(long)]
    pub(super) attachments_bytes: Option<Bytes>,
    /// Run as one of several instances sharing this Redis (`redis://HOST:PORT`): sessions
    /// are partitioned across them by fenced leases (docs/cluster.md). Exclusive with
    /// --data-dir.
    #[arg(long, value_name = "URL")]
    pub(super) cluster: Option<String>,
    /// This instance's name in the cluster's leases; unique among live instances.
    #[arg(long, value_name = "NAME")]
    pub(super) instance_id: Option<String>,
    /// Partitions of the session space (fixed for the life of the Redis database).
    #[arg(long, value_name = "N")]
    pub(super) partitions: Option<u32>,
    /// A partition lease's time to live, in milliseconds: a dead instance's partitions are
    /// taken over after about this long.
    #[arg(long, value_name = "MS")]
    pub(super) lease_ms: Option<u64>,
    /// The fence margin, in milliseconds: how far an instance's clock may run behind
    /// Redis's over one lease, plus the time a turn takes to stop. An owner that cannot
    /// renew stops a partition's turns this long before its lease can expire, and a new
    /// owner starts none until this long after it acquired the lease. Below a third of
    /// --lease-ms (refused otherwise); by default a tenth of it
    #[arg(long, value_name = "MS")]
    pub(super) max_clock_skew_ms: Option<u64>,
    /// Accept a Redis whose `appendfsync` is not `always` (an ack may precede the fsync: a
    /// Redis crash can then lose acknowledged messages).
    #[arg(long)]
    #[serde(default)]
    pub(super) cluster_allow_lazy_fsync: bool,
    /// When an instance joins, the others drain and release what they hold beyond their
    /// fair share (the default; `--cluster-rebalance false`: a joining instance takes only
    /// partitions that come free)
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub(super) cluster_rebalance: Option<bool>,
    /// With rebalancing: how long, in milliseconds, a partition being released may
    /// wait for its running turns to end; past it, it is released as if lost (those turns
    /// then end `interrupted by restart` on the next owner).
    #[arg(long, value_name = "MS")]
    pub(super) cluster_drain_ms: Option<u64>,
    /// Replicas that must have each batch of writes before its messages are acked (Redis
    /// `WAIT`): with 1, a failover to that replica loses no acked message; a batch they do
    /// not confirm in time is rejected `storage`. 0 (the default): acks wait for the
    /// primary's fsync only.
    #[arg(long, value_name = "N")]
    pub(super) cluster_min_replicas: Option<u32>,
    /// Check the flags and the configuration file, then exit: 0 if valid, 2 if not.
    #[arg(long)]
    #[serde(skip)]
    pub(super) check_config: bool,
    /// `[[bridge]]` tables (config file only): platform bridges run as supervised children.
    #[arg(skip)]
    pub(super) bridge: Option<Vec<BridgeSpec>>,
    /// Access mode of every platform without an `[access.<platform>]` table: `pairing`
    /// (matrix, irc and telegram pair strangers with a code an admin approves and answer
    /// group messages only when addressed; other platforms are open) or `open` (every
    /// platform open, every group message answered)
    #[arg(long, value_enum, value_name = "MODE")]
    pub(super) access_default: Option<AccessDefault>,
    /// `[access.<platform>]` tables (config file only): who may talk to the bot, and how
    /// much (docs/access.md).
    #[arg(skip)]
    pub(super) access: Option<std::collections::BTreeMap<String, crate::access::AccessTable>>,
    /// `[[agent]]` tables (config file only): named agents for the `[[route]]`s
    /// (docs/agents.md). Taken out of the file before the rest is read: the file's `agent`
    /// key is either the top-level agent's kind or these tables.
    #[arg(skip)]
    #[serde(skip)]
    pub(super) agent_tables: Option<Vec<super::tables::AgentTable>>,
    /// `[[route]]` tables (config file only): which agent a new session gets, first match
    /// wins (docs/agents.md).
    #[arg(skip)]
    pub(super) route: Option<Vec<super::tables::RouteSpec>>,
}
}
/// Each flag's default as `serve --help` shows it, read from where the default is defined
/// (the core's, the bridge's and the agents' own defaults), never typed twice.
/// `--partitions`' default.
pub(super) const DEFAULT_PARTITIONS: u32 = 64;
/// `--lease-ms`' default.
pub(super) const DEFAULT_LEASE_MS: u64 = 3000;

pub(crate) fn defaults() -> Vec<(&'static str, String)> {
    let core = CoreConfig::default();
    let bridge = BridgeConfig::default();
    let files = &bridge.attachments;
    let secs = |d: Duration| Seconds(d.as_secs_f64()).to_string();
    let bytes = |n: usize| Bytes(n).to_string();
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
        ("http-max-per-peer", http::DEFAULT_MAX_PER_PEER.to_string()),
        ("http-head-timeout", secs(http::DEFAULT_HEAD_TIMEOUT)),
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
        ("max-held-turns", core.max_held_turns.to_string()),
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
        ("outbox-stale-after", secs(bridge.outbox_stale_after)),
        ("outbox-stale-keep", bridge.outbox_stale_keep.to_string()),
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
        ("attachments-dir", "<data-dir>/attachments".into()),
        ("max-attachment-bytes", bytes(files.max_file_bytes as usize)),
        ("max-attachments", files.max_files.to_string()),
        ("attachments-bytes", bytes(files.spool_bytes as usize)),
        ("access-default", "pairing".into()),
        ("instance-id", "hostname:pid:random".into()),
        ("partitions", DEFAULT_PARTITIONS.to_string()),
        ("cluster-min-replicas", "0".into()),
        ("lease-ms", DEFAULT_LEASE_MS.to_string()),
        (
            "cluster-drain-ms",
            crate::cluster::DEFAULT_DRAIN.as_millis().to_string(),
        ),
    ]
    .into_iter()
    .chain(openai_defaults())
    .collect()
}

/// The openai agent's part of [`defaults`].
fn openai_defaults() -> [(&'static str, String); 12] {
    let secs = |d: Duration| Seconds(d.as_secs_f64()).to_string();
    let bytes = |n: usize| Bytes(n).to_string();
    [
        ("openai-api-key-env", "OPENAI_API_KEY".into()),
        ("history-turns", DEFAULT_HISTORY_TURNS.to_string()),
        ("history-chars", DEFAULT_HISTORY_CHARS.to_string()),
        ("history-ttl", secs(DEFAULT_HISTORY_TTL)),
        ("history-bytes", bytes(DEFAULT_HISTORY_BYTES as usize)),
        ("openai-sender-prefix", "false".into()),
        ("openai-vision", "false".into()),
        ("openai-inline-text-bytes", bytes(DEFAULT_INLINE_TEXT_BYTES)),
        ("openai-connect-timeout", secs(DEFAULT_CONNECT_TIMEOUT)),
        ("openai-read-timeout", secs(DEFAULT_READ_TIMEOUT)),
        ("openai-stream-timeout", secs(DEFAULT_STREAM_TIMEOUT)),
        (
            "openai-tls-roots",
            format!("{:?}", TlsRootsArg::Platform).to_lowercase(),
        ),
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
/// Largest `--config` file read (a reload reads it on a helper thread; a huge or endless
/// file must not grow the gateway's memory).
pub(super) const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// The config file's text: a regular file (a FIFO or a device would block every reload) of
/// at most [`MAX_CONFIG_BYTES`].
fn read_config(path: &std::path::Path) -> Result<String, String> {
    use std::io::Read;
    let file = open_regular(path)?;
    let mut text = String::new();
    file.take(MAX_CONFIG_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| e.to_string())?;
    if text.len() as u64 > MAX_CONFIG_BYTES {
        return Err(format!(
            "larger than {} (the most a config file may be)",
            crate::cli::units::Bytes(MAX_CONFIG_BYTES as usize)
        ));
    }
    Ok(text)
}

/// Opens `path` for reading if it is a regular file. The type is checked on the open file,
/// and the open never waits (`O_NONBLOCK`): a FIFO swapped in after a check by path would
/// block the reload thread for good (every later SIGHUP "already in progress").
fn open_regular(path: &std::path::Path) -> Result<std::fs::File, String> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| e.to_string())?;
    let meta = file.metadata().map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    Ok(file)
}

/// The file's settings; its `[[agent]]` tables, when it has some, read on their own.
fn file_args(text: &str) -> Result<ServeArgs, String> {
    let mut table = text.parse::<toml::Table>().map_err(|e| {
        let hint = if text.contains("[[agent]]") {
            " (with [[agent]] tables the file's `agent` key is their array: give the top-level agent with --agent, or end the routes with a catch-all [[route]])"
        } else {
            ""
        };
        format!("{e}{hint}")
    })?;
    let Some(agents) = super::tables::take_agent_tables(&mut table)? else {
        // Parsed from the text: an error keeps its line and column.
        return toml::from_str::<ServeArgs>(text).map_err(|e| e.to_string());
    };
    let args = toml::Value::Table(table)
        .try_into::<ServeArgs>()
        .map_err(|e| e.to_string())?;
    Ok(ServeArgs {
        agent_tables: Some(agents),
        ..args
    })
}

/// The command line over the `--config` file: a flag wins over the file's key.
pub(super) fn merged_args(flags: ServeArgs) -> Result<ServeArgs, String> {
    let file = match &flags.config {
        Some(path) => {
            let text =
                read_config(path).map_err(|e| format!("--config {}: {e}", path.display()))?;
            file_args(&text).map_err(|e| format!("--config {}: {e}", path.display()))?
        }
        None => ServeArgs::default(),
    };
    // The file's path is not a setting of the merged whole (a reload reads it again).
    Ok(ServeArgs {
        config: None,
        ..flags.over(file)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A flag wins over the file's key, the file fills what the flags left out, a switch is
    /// on if either turned it on, and the merged whole names no config file.
    #[test]
    fn flags_over_the_file() {
        let file: ServeArgs = toml::from_str(
            "queue-cap = 5\nturn-workers = 3\nresume-interrupted = true\n[[bridge]]\nplatform = \"irc\"\n",
        )
        .expect("file");
        let flags = ServeArgs {
            config: Some("cfg.toml".into()),
            queue_cap: Some(7),
            allow_insecure_bind: true,
            ..ServeArgs::default()
        };
        let a = ServeArgs {
            config: None,
            ..flags.over(file)
        };
        assert_eq!(a.queue_cap, Some(7));
        assert_eq!(a.turn_workers, Some(3));
        assert!(a.allow_insecure_bind && a.resume_interrupted && !a.check_config);
        assert_eq!(a.bridge.map(|b| b.len()), Some(1));
        assert!(a.config.is_none() && a.listen.is_none());
    }

    /// Issue 18 row 10: a FIFO as the config file is refused at once, by the open file's type;
    /// with a check by path before a blocking open, a FIFO swapped in between wedged every
    /// later reload.
    #[test]
    fn a_fifo_is_refused_without_waiting_for_a_writer() {
        let dir = std::env::temp_dir().join(format!("turnstile-cfg-fifo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let fifo = dir.join("cfg.toml");
        let c = std::ffi::CString::new(fifo.to_str().expect("path")).expect("cstr");
        // SAFETY: mkfifo with a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let (tx, rx) = crossbeam_channel::bounded(1);
        let path = fifo.clone();
        std::thread::spawn(move || {
            let _ = tx.send(open_regular(&path).map(|_| ()));
        });
        let got = rx.recv_timeout(std::time::Duration::from_secs(20));
        if got.is_err() {
            // Release the blocked open before failing.
            let _ = std::fs::OpenOptions::new().write(true).open(&fifo);
        }
        assert_eq!(
            got.expect("the open waited for a writer"),
            Err("not a regular file".to_owned())
        );
        let file = dir.join("ok.toml");
        std::fs::write(&file, "queue-cap = 5\n").expect("write");
        assert_eq!(read_config(&file), Ok("queue-cap = 5\n".to_owned()));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
