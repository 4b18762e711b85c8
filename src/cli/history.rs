//! `turnstile history export`: a session's stored conversation (the openai agent's durable
//! history, `serve --data-dir`) printed as JSON lines, one exchange a line, oldest first:
//! `{"session":"…","user":"…","assistant":"…"}`.
//!
//! Three ways to read it:
//! - `--http ADDR`: from a running gateway, through its HTTP endpoint (`GET /history`, behind
//!   its token: `--token` or `TURNSTILE_AUTH_TOKEN`), which reads it on the endpoint's thread
//!   through the journal's own connection (or Redis, with `--cluster`);
//! - `--data-dir DIR` (the default, `.`): the journal opened read-only; a running gateway
//!   holds its database locked, so this reads a stopped gateway's directory (or a copy);
//! - `--cluster URL`: the cluster's Redis, while the cluster runs.
//!
//! Exit codes: 0 printed (nothing for a session with no stored conversation); 1 the journal,
//! Redis or the gateway cannot be read (no answer, a refused token, nothing stored there);
//! 2 usage, a session key that is not one among them.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Subcommand};

use super::USAGE_ERROR;
use super::status::request;
use super::units::Seconds;
use crate::journal::memory::{Exchange, export_lines, read_export_lines};
use crate::message::SessionKey;
use crate::ops::access::percent_encode;

/// Flags of `history`.
#[derive(Args, Debug)]
pub(crate) struct HistoryArgs {
    #[command(subcommand)]
    action: Action,
}

/// What to do.
#[derive(Subcommand, Debug)]
enum Action {
    /// Print SESSION's stored conversation as JSON lines.
    Export(ExportArgs),
}

/// Flags of `history export`.
#[derive(Args, Debug)]
struct ExportArgs {
    /// The session key, as the status and the logs show it (`matrix:group:!room:hs`).
    #[arg(long)]
    session: String,
    /// The gateway's `--data-dir` (a stopped gateway's: a running one holds it locked).
    #[arg(long, default_value = ".")]
    data_dir: PathBuf,
    /// Read the cluster's Redis instead (`serve --cluster URL`), while it runs; from the
    /// environment, a password stays out of the process list.
    #[arg(
        long,
        value_name = "URL",
        env = "TURNSTILE_CLUSTER",
        conflicts_with = "data_dir"
    )]
    cluster: Option<String>,
    /// Ask a running gateway's HTTP endpoint at this address instead (`serve --http-listen`;
    /// it needs the gateway's token).
    #[arg(long, value_name = "ADDR", conflicts_with_all = ["data_dir", "cluster"])]
    http: Option<String>,
    /// Bearer token for the HTTP endpoint (with `--http`).
    #[arg(long, env = "TURNSTILE_AUTH_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// How long to wait for the HTTP endpoint's answer (with `--http`).
    #[arg(long, default_value = "10s")]
    timeout: Seconds,
    #[command(flatten)]
    tls: crate::platforms::tls::ClientTlsArgs,
}

/// Runs `history`; returns the exit code.
pub(crate) fn run(args: HistoryArgs) -> i32 {
    let Action::Export(args) = args.action;
    // The key as stored (its rendered form); a typo is named here, not printed as nothing.
    let session = match args.session.parse::<SessionKey>() {
        Ok(key) => key,
        Err(e) => {
            eprintln!(
                "turnstile history export: --session {:?}: {e}",
                args.session
            );
            return USAGE_ERROR;
        }
    };
    let session = session.as_str();
    let exchanges = match (&args.http, &args.cluster) {
        (Some(addr), _) => {
            if args.timeout.0 <= 0.0 {
                eprintln!(
                    "turnstile history export: --timeout must be a positive number of seconds"
                );
                return USAGE_ERROR;
            }
            from_gateway(addr, session, &args)
        }
        (None, Some(url)) => crate::cluster::export_history(url, session),
        (None, None) => crate::journal::export_history(&args.data_dir, session),
    };
    let exchanges = match exchanges {
        Ok(e) => e,
        Err(e) => {
            eprintln!("turnstile history export: {e}");
            return 1;
        }
    };
    let mut out = std::io::stdout().lock();
    if let Err(e) = out
        .write_all(export_lines(session, &exchanges).as_bytes())
        .and_then(|()| out.flush())
    {
        eprintln!("turnstile history export: cannot write: {e}");
        return 1;
    }
    0
}

/// `session`'s conversation as a running gateway's endpoint answers it (`GET /history`).
fn from_gateway(addr: &str, session: &str, args: &ExportArgs) -> Result<Vec<Exchange>, String> {
    let path = format!("/history?session={}", percent_encode(session));
    let timeout = Duration::from_secs_f64(args.timeout.0);
    let token = args.token.as_deref();
    match request("GET", addr, &path, token, timeout, &args.tls) {
        Ok((200, body)) => read_export_lines(session, &body)
            .map_err(|e| format!("{addr}: not a conversation: {e}")),
        Ok((401, _)) => Err(format!(
            "{addr}: unauthorized (give the gateway's token with --token or TURNSTILE_AUTH_TOKEN)"
        )),
        Ok((code, body)) => Err(format!("{addr} answered {code}: {}", body.trim())),
        Err(e) => Err(format!("{addr}: {e}")),
    }
}
