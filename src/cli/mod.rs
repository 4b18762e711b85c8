//! The `turnstile` binary, as a library module behind the `cli` feature so the binary's code
//! reaches the crate's internals without making them public: `serve` runs the gateway,
//! `send` talks to one, `loadgen` measures one, `status` reads one's snapshot.

mod access;
mod bridge;
mod docs;
mod history;
pub(crate) mod loadgen;
mod reference;
pub(crate) mod send;
pub(crate) mod serve;
pub(crate) mod status;
mod units;
mod workload;

#[cfg(test)]
use clap::Parser;
use clap::{CommandFactory, FromArgMatches, Subcommand};

/// Exit code for bad flags or configuration (as clap uses).
pub(crate) const USAGE_ERROR: i32 = 2;

#[derive(clap::Parser)]
#[command(
    name = "turnstile",
    version = concat!(env!("CARGO_PKG_VERSION"), " (revision ", env!("TURNSTILE_REVISION"), ")"),
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
    /// Manage a running gateway's access policy: pending codes, approvals, denials, usage.
    Access(access::AccessArgs),
    /// Print a session's stored conversation (`serve --data-dir`) as JSON lines.
    History(history::HistoryArgs),
    /// Connect a chat platform (Matrix, IRC, Telegram, Discord, Slack) to a running gateway.
    Bridge(bridge::BridgeArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions(docs::CompletionsArgs),
    /// Print the man page (or write every page into a directory with --out).
    Man(docs::ManArgs),
    /// Print docs/configuration.md: every subcommand's flags, from these definitions.
    #[command(hide = true)]
    ConfigReference,
    /// The leash of a `serve --cluster` gateway's agent processes (started by it, never by
    /// hand): ends them once the gateway stops renewing its leases (docs/cluster.md).
    #[command(hide = true)]
    Leash,
}

/// The command line's definition, with each serve flag's default in its help.
fn command() -> clap::Command {
    Cli::command().mut_subcommand("serve", serve::document_defaults)
}

/// The binary's entry point: parses the command line, sets up logging, runs the
/// subcommand and returns the process's exit code.
pub fn main() -> i32 {
    let cli = Cli::from_arg_matches(&command().get_matches()).unwrap_or_else(|e| e.exit());
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
        Cmd::Serve(args) => serve::run(*args, cli.log_format == LogFormat::Json),
        Cmd::Send(args) => send::run(args),
        Cmd::Loadgen(args) => loadgen::run(args),
        Cmd::Status(args) => status::run(args),
        Cmd::Access(args) => access::run(args),
        Cmd::History(args) => history::run(args),
        Cmd::Bridge(args) => bridge::run(args),
        Cmd::Completions(args) => docs::completions(args, command()),
        Cmd::Man(args) => docs::man(args, command()),
        Cmd::ConfigReference => reference::print(command()),
        Cmd::Leash => crate::cluster::leash::run(),
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

    /// What the help prints as a flag's default is accepted by that flag (once the help said
    /// `600s` and `1 MiB` while the parser wanted `600` and `1048576`).
    #[test]
    fn every_default_the_help_prints_is_accepted_by_its_flag() {
        for (flag, value) in serve::defaults() {
            let arg = format!("--{flag}");
            let parsed = Cli::try_parse_from(["turnstile", "serve", &arg, &value]);
            assert!(parsed.is_ok(), "{arg} {value}: {:?}", parsed.err());
        }
    }

    /// Completions and man pages come from the parser's own definitions: every subcommand
    /// and a serve flag with its default appear.
    #[test]
    fn completions_and_man_pages_cover_every_subcommand() {
        let mut bash = Vec::new();
        clap_complete::generate(
            clap_complete::Shell::Bash,
            &mut command(),
            "turnstile",
            &mut bash,
        );
        let bash = String::from_utf8(bash).expect("utf-8");
        for sub in [
            "serve",
            "send",
            "loadgen",
            "status",
            "bridge",
            "completions",
            "man",
        ] {
            assert!(
                bash.contains(sub),
                "{sub} missing from the bash completions"
            );
        }
        assert!(bash.contains("--turn-timeout"));
        let mut page = Vec::new();
        let serve = command().find_subcommand("serve").cloned().expect("serve");
        clap_mangen::Man::new(serve)
            .render(&mut page)
            .expect("render");
        let page = String::from_utf8(page).expect("utf-8");
        assert!(page.contains(".TH"), "not a man page");
        assert!(page.contains("turn\\-timeout"), "{page}");
        assert!(page.contains("[default: 600s]"), "the default is not shown");
    }
}
