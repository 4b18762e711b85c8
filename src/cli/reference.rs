//! `turnstile config-reference` (hidden): docs/configuration.md, every subcommand's flags
//! with their defaults and the first sentence of their help, rendered from the same clap
//! `Command` the parser uses (`tests/docs.rs` fails when the file is stale).

use std::fmt::Write as _;
use std::io::Write as _;

/// Prints the flags reference as markdown; returns the exit code.
pub(crate) fn print(command: clap::Command) -> i32 {
    let mut out = std::io::stdout().lock();
    match out
        .write_all(markdown(command).as_bytes())
        .and_then(|()| out.flush())
    {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("turnstile config-reference: {e}");
            1
        }
    }
}

/// The whole page: a header, then a section per visible (sub)command with flags.
pub(crate) fn markdown(mut command: clap::Command) -> String {
    command.build();
    let mut page = String::from(
        "# Configuration reference\n\n\
         <!-- Generated from the clap definitions by `turnstile config-reference`; do not edit.\n     \
         Regenerate: TURNSTILE_BLESS=1 cargo test --test docs -->\n\n\
         Every flag of every subcommand: its default and the first sentence of its help\n\
         (`turnstile <subcommand> --help` has the rest). `serve`'s flags are also the keys of its\n\
         `--config` TOML file (`queue-cap = 8`); flags override the file.\n",
    );
    section(&mut page, &command, "turnstile", true);
    page
}

/// One command's table (if it has flags of its own), then its subcommands'.
fn section(page: &mut String, command: &clap::Command, path: &str, top: bool) {
    let args: Vec<&clap::Arg> = command
        .get_arguments()
        .filter(|a| !a.is_hide_set() && (top || !a.is_global_set()))
        .filter(|a| !matches!(a.get_id().as_str(), "help" | "version"))
        .collect();
    if !args.is_empty() {
        let about = command.get_about().map(one_line).unwrap_or_default();
        let _ = write!(
            page,
            "\n## `{path}`\n\n{about}\n\n| flag | default | |\n|---|---|---|\n"
        );
        for arg in args {
            let (help, default) = help_and_default(arg);
            let _ = writeln!(page, "| {} | {} | {} |", flag(arg), default, help);
        }
    }
    // In declaration order (`mut_subcommand` moves the subcommand it edits to the end).
    let mut subs: Vec<&clap::Command> = command.get_subcommands().collect();
    subs.sort_by_key(|s| s.get_display_order());
    for sub in subs.into_iter().filter(|s| !s.is_hide_set()) {
        if sub.get_name() != "help" {
            section(page, sub, &format!("{path} {}", sub.get_name()), false);
        }
    }
}

/// `--name VALUE` (with `-s` when there is one), or `VALUE…` for a positional.
fn flag(arg: &clap::Arg) -> String {
    let value = arg
        .get_value_names()
        .map(|v| {
            v.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_else(|| arg.get_id().as_str().to_ascii_uppercase());
    let takes = arg.get_num_args().is_some_and(|n| n.takes_values());
    let cell = match (arg.get_long(), arg.get_short()) {
        (Some(long), Some(short)) if takes => format!("`-{short}`, `--{long} {value}`"),
        (Some(long), Some(short)) => format!("`-{short}`, `--{long}`"),
        (Some(long), None) if takes => format!("`--{long} {value}`"),
        (Some(long), None) => format!("`--{long}`"),
        (None, _) => format!("`{value}`"),
    };
    cell.replace('|', "\\|")
}

/// The help's first sentence (and the possible values), and the default: clap's own, or
/// the `[default: X]` that `serve::document_defaults` appends to the help.
fn help_and_default(arg: &clap::Arg) -> (String, String) {
    let full = arg.get_help().map(ToString::to_string).unwrap_or_default();
    let (text, documented) = match full.rsplit_once(" [default: ") {
        Some((text, tail)) => (text.to_owned(), tail.trim_end_matches(']').to_owned()),
        None => (full, String::new()),
    };
    let defaults: Vec<String> = arg
        .get_default_values()
        .iter()
        .map(|v| v.to_string_lossy().into_owned())
        .collect();
    let default = match (documented.is_empty(), defaults.is_empty()) {
        (false, _) => format!("`{documented}`"),
        (true, false) if matches!(arg.get_action(), clap::ArgAction::SetTrue) => "off".to_owned(),
        (true, false) => format!("`{}`", defaults.join(", ")),
        (true, true) => String::new(),
    };
    let mut help = first_sentence(&text);
    let values: Vec<String> = arg
        .get_possible_values()
        .iter()
        .filter(|v| !v.is_hide_set())
        .map(|v| format!("`{}`", v.get_name()))
        .collect();
    let boolean = matches!(values.as_slice(), [a, b] if a == "`true`" && b == "`false`");
    let named = values.iter().all(|v| help.contains(v.as_str()));
    if !values.is_empty() && !boolean && !named {
        let _ = write!(help, " ({})", values.join(", "));
    }
    if matches!(arg.get_action(), clap::ArgAction::Append) && !help.contains("repeatable") {
        help.push_str(" (repeatable)");
    }
    (help.replace('|', "\\|"), default.replace('|', "\\|"))
}

/// The text up to the end of its first sentence, on one line.
fn first_sentence(text: &str) -> String {
    let flat = one_line(text);
    let mut end = flat.len();
    for (i, _) in flat.match_indices(". ") {
        // Not an abbreviation such as "e.g. " or "i.e. ".
        if !flat[..i].ends_with("e.g") && !flat[..i].ends_with("i.e") {
            end = i + 1;
            break;
        }
    }
    flat[..end].to_owned()
}

/// Whitespace (newlines included) collapsed to single spaces.
fn one_line(text: impl ToString) -> String {
    text.to_string()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}
