//! The `turnstile` binary: `serve` runs the gateway, `send` talks to one.

mod cli;
mod workload;

use clap::{CommandFactory, FromArgMatches, Subcommand};

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
    Serve(Box<cli::serve::ServeArgs>),
    /// Send one message to a running gateway and print the reply.
    Send(cli::send::SendArgs),
    /// Run the closed-loop benchmark workload against a running gateway.
    Loadgen(cli::loadgen::LoadgenArgs),
    /// Summarise a gateway's status (file or HTTP); non-zero exit when stale or unhealthy.
    Status(cli::status::StatusArgs),
    /// Run a native platform bridge (IRC, Telegram) in front of a running gateway.
    Bridge(cli::bridge::BridgeArgs),
}

fn main() {
    let command = Cli::command().mut_subcommand("serve", cli::serve::document_defaults);
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
            let ts = turnstile::liveness::rfc3339_utc(std::time::SystemTime::now());
            let line = turnstile::ops::logfmt::json_line(
                &ts,
                record.level(),
                record.target(),
                &record.args().to_string(),
            );
            writeln!(buf, "{line}")
        });
    }
    logger.init();
    let code = match cli.command {
        Cmd::Serve(args) => cli::serve::run(*args),
        Cmd::Send(args) => cli::send::run(args),
        Cmd::Loadgen(args) => cli::loadgen::run(args),
        Cmd::Status(args) => cli::status::run(args),
        Cmd::Bridge(args) => cli::bridge::run(args),
    };
    std::process::exit(code);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every default named in `defaults()` belongs to a real flag (`mut_arg` would panic at
    /// start-up otherwise) and shows in the help with the value the code falls back to.
    #[test]
    fn serve_help_shows_the_defaults_the_code_uses() {
        let mut command = Cli::command().mut_subcommand("serve", cli::serve::document_defaults);
        command.build();
        let serve = command.find_subcommand_mut("serve").expect("serve");
        let help = serve.render_long_help().to_string();
        let core = turnstile::core::CoreConfig::default();
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
