//! The `turnstile` binary: `serve` runs the gateway, `send` talks to one.

mod cli;
mod workload;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "turnstile",
    version,
    about = "A runtime for chat-agent gateways"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
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
}

fn main() {
    let mut logger =
        env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"));
    // ureq may log whole requests, Authorization header included, at TRACE: whatever
    // RUST_LOG asks, its crates log at DEBUG at most, so the API key is never printed.
    if std::env::var("RUST_LOG").is_ok_and(|v| v.to_ascii_lowercase().contains("trace")) {
        logger
            .filter_module("ureq", log::LevelFilter::Debug)
            .filter_module("ureq_proto", log::LevelFilter::Debug);
    }
    logger.init();
    let code = match Cli::parse().command {
        Cmd::Serve(args) => cli::serve::run(*args),
        Cmd::Send(args) => cli::send::run(args),
        Cmd::Loadgen(args) => cli::loadgen::run(args),
    };
    std::process::exit(code);
}
