//! The `turnstile` binary, as a library module behind the `cli` feature so the binary's code
//! reaches the crate's internals without making them public: `serve` runs the gateway,
//! `send` talks to one, `loadgen` measures one, `status` reads one's snapshot.

pub(crate) mod loadgen;
pub(crate) mod send;
pub(crate) mod serve;
pub(crate) mod status;
mod workload;

use clap::{CommandFactory, FromArgMatches, Subcommand};

/// Exit code for bad flags or configuration (as clap uses).
pub(crate) const USAGE_ERROR: i32 = 2;

#[derive(clap::Parser)]
#[command(
    name = "turnstile",
    version,
    about = "A runtime for chat-agent gateways"
)]
struct Cli {
    /// Log line format on stderr: `text`, or `json` (one object per line, for log shippers).
    #[arg(long, global = true, value_enum, default_value = "text")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

// Parsed once at start-up: the size of the serve flags' variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Cmd {
    /// Run the gateway server (bridge protocol over TCP).
    Serve(Box<serve::ServeArgs>),
    /// Send one message to a running gateway and print the reply.
    Send(send::SendArgs),
    /// Run the closed-loop benchmark workload against a running gateway.
    Loadgen(loadgen::LoadgenArgs),
    /// Summarise a gateway's status (file or HTTP); non-zero exit when stale or unhealthy.
    Status(status::StatusArgs),
}

/// The binary's entry point: parses the command line, sets up logging, runs the
/// subcommand and returns the process's exit code.
pub fn main() -> i32 {
    let command = Cli::command().mut_subcommand("serve", serve::document_defaults);
    let cli = Cli::from_arg_matches(&command.get_matches()).unwrap_or_else(|e| e.exit());
    let mut logger =
        env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"));
    // ureq may log whole requests, Authorization header included, at TRACE: whatever
    // RUST_LOG asks, its crates log at DEBUG at most, so the API key is never printed.
    if std::env::var("RUST_LOG").is_ok_and(|v| v.to_ascii_lowercase().contains("trace")) {
        logger
            .filter_module("ureq", log::LevelFilter::Debug)
            .filter_module("ureq_proto", log::LevelFilter::Debug);
    }
    if cli.log_format == LogFormat::Json {
        logger.format(|buf, record| {
            use std::io::Write;
            let ts = crate::liveness::rfc3339_utc(std::time::SystemTime::now());
            let line = crate::logfmt::json_line(
                &ts,
                record.level(),
                record.target(),
                &record.args().to_string(),
            );
            writeln!(buf, "{line}")
        });
    }
    logger.init();
    match cli.command {
        Cmd::Serve(args) => serve::run(*args),
        Cmd::Send(args) => send::run(args),
        Cmd::Loadgen(args) => loadgen::run(args),
        Cmd::Status(args) => status::run(args),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every default named in `defaults()` belongs to a real flag (`mut_arg` would panic at
    /// start-up otherwise) and shows in the help with the value the code falls back to.
    #[test]
    fn serve_help_shows_the_defaults_the_code_uses() {
        let mut command = Cli::command().mut_subcommand("serve", serve::document_defaults);
        command.build();
        let serve = command.find_subcommand_mut("serve").expect("serve");
        let help = serve.render_long_help().to_string();
        let core = crate::core::CoreConfig::default();
        for expected in [
            "[default: 127.0.0.1:7878]".to_owned(),
            format!("[default: {}]", core.queue_cap),
            format!("[default: {}]", core.max_queued_messages),
            "[default: 256 MiB]".to_owned(),
            "[default: 0.8s]".to_owned(),
            "[default: queue]".to_owned(),
        ] {
            assert!(help.contains(&expected), "{expected} missing from:\n{help}");
        }
        let shown = help.matches("[default: ").count();
        // Each of the documented defaults appears once (clap's own, e.g. for --help, none).
        assert!(shown >= 40, "only {shown} defaults shown");
    }
}
