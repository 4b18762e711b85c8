//! The `turnstile` binary: `serve` runs the gateway, `send` talks to one.

mod cli;

use clap::{Parser, Subcommand};

#[derive(Parser)]
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
}

fn main() {
    let cli = Cli::parse();
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
    };
    std::process::exit(code);
}
