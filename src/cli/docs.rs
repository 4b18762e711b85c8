//! `turnstile completions SHELL` and `turnstile man`: shell completions and man pages,
//! generated from the same clap definitions the parser uses, so they cannot drift.

use std::io::Write;
use std::path::PathBuf;

use clap::Args;

/// Flags of `completions`.
#[derive(Args, Debug)]
pub(crate) struct CompletionsArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    shell: clap_complete::Shell,
}

/// Flags of `man`.
#[derive(Args, Debug)]
pub(crate) struct ManArgs {
    /// Write `turnstile.1` and a page per subcommand (`turnstile-serve.1`, …) into this
    /// directory instead of printing `turnstile.1`.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
}

/// Prints the completion script; returns the exit code.
pub(crate) fn completions(args: CompletionsArgs, mut command: clap::Command) -> i32 {
    // Into memory first: clap_complete panics on a failed write (a closed pipe), and a
    // panic is a bug; a write error here is reported.
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut command, "turnstile", &mut script);
    let mut out = std::io::stdout().lock();
    match out.write_all(&script).and_then(|()| out.flush()) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("turnstile completions: {e}");
            1
        }
    }
}

/// Prints (or writes) the man pages; returns the exit code.
pub(crate) fn man(args: ManArgs, command: clap::Command) -> i32 {
    let result = match &args.out {
        Some(dir) => clap_mangen::generate_to(command, dir),
        None => {
            let mut out = std::io::stdout().lock();
            clap_mangen::Man::new(command)
                .render(&mut out)
                .and_then(|()| out.flush())
        }
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            let place = args
                .out
                .map(|d| format!(" {}", d.display()))
                .unwrap_or_default();
            eprintln!("turnstile man:{place} {e}");
            1
        }
    }
}
