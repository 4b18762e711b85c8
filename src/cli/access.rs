//! `turnstile access`: a running gateway's access policy managed from the command line, over
//! its authenticated HTTP endpoint (`POST /access`); the gateway applies each command on its
//! loop, as an admin's `!` command in the chat would be. Exit codes: 0 done; 1 the gateway
//! refused or failed the command; 2 usage; 3 no answer (no server, wrong token, timeout).

use std::time::Duration;

use clap::{Args, Subcommand};

use super::status::request;
use super::units::Seconds;
use crate::ops::access::percent_encode;

/// Exit code when the gateway did not answer (or refused the token).
const NO_ANSWER: i32 = 3;

/// Flags of `access`.
#[derive(Args, Debug)]
pub(crate) struct AccessArgs {
    /// The platform whose policy to act on, as its bridge names it (`matrix`, `irc`, `telegram`, …).
    #[arg(long)]
    platform: String,
    /// The gateway's HTTP endpoint (`serve --http-listen`).
    #[arg(long, default_value = "127.0.0.1:7879")]
    http: String,
    /// Bearer token for the HTTP endpoint.
    #[arg(long, env = "TURNSTILE_AUTH_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// How long to wait for the gateway's answer.
    #[arg(long, default_value = "10s")]
    timeout: Seconds,
    #[command(flatten)]
    tls: crate::platforms::tls::ClientTlsArgs,
    #[command(subcommand)]
    action: Action,
}

/// What to do.
#[derive(Subcommand, Debug)]
enum Action {
    /// The pending pairing codes and the users allowed or denied by command.
    List,
    /// Let in the user who was given CODE.
    Approve {
        /// The code the user was given (case and dashes ignored).
        code: String,
    },
    /// Let USER in (and lift a denial).
    Allow {
        /// The user id, as the platform's bridge sends it (`@bob:example.org`).
        user: String,
    },
    /// Shut USER out, overriding `allow` patterns.
    Deny {
        /// The user id, as the platform's bridge sends it.
        user: String,
    },
    /// Each user's messages left in their rate bucket and tokens spent today (all users, or USER's).
    Usage {
        /// Only this user's figures.
        user: Option<String>,
    },
}

impl Action {
    /// The admin commands (words without the `!`) this action runs, in order.
    fn commands(&self) -> Vec<String> {
        match self {
            Action::List => vec!["pending".into(), "users".into()],
            Action::Approve { code } => vec![format!("approve {code}")],
            Action::Allow { user } => vec![format!("allow {user}")],
            Action::Deny { user } => vec![format!("deny {user}")],
            Action::Usage { user } => vec![format!("usage {}", user.as_deref().unwrap_or(""))],
        }
    }
}

/// Runs the action; returns the exit code.
pub(crate) fn run(args: AccessArgs) -> i32 {
    if args.timeout.0 <= 0.0 {
        eprintln!("turnstile access: --timeout must be a positive number of seconds");
        return super::USAGE_ERROR;
    }
    let timeout = Duration::from_secs_f64(args.timeout.0);
    let addr = &args.http;
    for command in args.action.commands() {
        let path = format!(
            "/access?platform={}&command={}",
            percent_encode(&args.platform),
            percent_encode(&command)
        );
        match request(
            "POST",
            addr,
            &path,
            args.token.as_deref(),
            timeout,
            &args.tls,
        ) {
            Ok((200, body)) => print!("{body}"),
            Ok((401, _)) => {
                eprintln!(
                    "turnstile access: {addr}: unauthorized (give the gateway's token with --token or TURNSTILE_AUTH_TOKEN)"
                );
                return NO_ANSWER;
            }
            Ok((code @ (404 | 503), body)) => {
                eprintln!("turnstile access: {addr} answered {code}: {}", body.trim());
                return NO_ANSWER;
            }
            Ok((code, body)) => {
                eprintln!("turnstile access: {addr} answered {code}: {}", body.trim());
                return 1;
            }
            Err(e) => {
                eprintln!("turnstile access: {addr}: {e}");
                return NO_ANSWER;
            }
        }
    }
    0
}
