//! `turnstile history export`: a session's stored conversation (the openai agent's durable
//! history, `serve --data-dir`) printed as JSON lines, one exchange a line, oldest first:
//! `{"session":"…","user":"…","assistant":"…"}`. It opens the journal read-only; the
//! running gateway holds its database locked, so it reads a stopped gateway's directory (or
//! a copy). With `--cluster URL` it reads the cluster's Redis instead, while the cluster
//! runs. Exit codes: 0 printed (nothing for a session with no stored conversation);
//! 1 the journal or Redis cannot be read; 2 usage.

use std::io::Write;
use std::path::PathBuf;

use clap::{Args, Subcommand};
use serde::Serialize;

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
    Export {
        /// The session key, as the status and the logs show it (`matrix:group:!room:hs`).
        #[arg(long)]
        session: String,
        /// The gateway's `--data-dir`.
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
    },
}

/// One printed line.
#[derive(Serialize)]
struct Line<'a> {
    session: &'a str,
    user: &'a str,
    assistant: &'a str,
}

/// Runs `history`; returns the exit code.
pub(crate) fn run(args: HistoryArgs) -> i32 {
    let Action::Export {
        session,
        data_dir,
        cluster,
    } = args.action;
    let exchanges = match cluster {
        Some(url) => crate::cluster::export_history(&url, &session),
        None => crate::journal::export_history(&data_dir, &session),
    };
    let exchanges = match exchanges {
        Ok(e) => e,
        Err(e) => {
            eprintln!("turnstile history export: {e}");
            return 1;
        }
    };
    let mut out = std::io::stdout().lock();
    for (user, assistant) in &exchanges {
        let line = Line {
            session: &session,
            user,
            assistant,
        };
        let written = serde_json::to_string(&line)
            .map_err(std::io::Error::other)
            .and_then(|l| writeln!(out, "{l}"));
        if let Err(e) = written {
            eprintln!("turnstile history export: cannot write: {e}");
            return 1;
        }
    }
    0
}
