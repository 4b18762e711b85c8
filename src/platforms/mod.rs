//! Native platform bridges: each is a bridge-protocol client ([`gateway`]) on one side and a
//! chat platform's own protocol on the other, run by `turnstile bridge <platform>`.
//!
//! Every rule the gateway keeps (dedup, outboxes, `acks`/`delivered`, the journal, the token,
//! partial pacing) applies unchanged: a bridge is just another client.

/// Logs at `$level` through a budget of this call site's own ([`WARN_BURST`] lines at once,
/// then [`WARN_PER_SEC`] a second): a platform server flooding one kind of line cannot flood
/// the log. The count of lines dropped is told with the next one logged, as
/// "(N more suppressed)". Every WARN and ERROR of the bridges fed by a platform server goes
/// through it (`warn_limited!`, `error_limited!`); the line is redacted ([`secrets::redact`]).
macro_rules! log_limited {
    ($level:expr, $($arg:tt)+) => {{
        static BUDGET: std::sync::Mutex<$crate::logfmt::LogBudget> = std::sync::Mutex::new(
            $crate::logfmt::LogBudget::new($crate::platforms::WARN_BURST, $crate::platforms::WARN_PER_SEC),
        );
        if log::log_enabled!($level) {
            $crate::platforms::emit_limited(&BUDGET, $level, module_path!(), format_args!($($arg)+));
        }
    }};
}

/// A WARN line through [`log_limited!`].
macro_rules! warn_limited {
    ($($arg:tt)+) => { log_limited!(log::Level::Warn, $($arg)+) };
}

/// A line at `$level` with every secret's forms redacted ([`secrets::redact`]), for lines
/// that carry a server's text below WARN.
macro_rules! log_redacted {
    ($level:expr, $($arg:tt)+) => {{
        if log::log_enabled!($level) {
            let line = format!($($arg)+);
            log::log!($level, "{}", $crate::platforms::secrets::redact(&line));
        }
    }};
}

/// An INFO line through [`log_redacted!`].
macro_rules! info_redacted {
    ($($arg:tt)+) => { log_redacted!(log::Level::Info, $($arg)+) };
}

/// A DEBUG line through [`log_redacted!`].
macro_rules! debug_redacted {
    ($($arg:tt)+) => { log_redacted!(log::Level::Debug, $($arg)+) };
}

/// An ERROR line through [`log_limited!`].
macro_rules! error_limited {
    ($($arg:tt)+) => { log_limited!(log::Level::Error, $($arg)+) };
}

pub(crate) use crate::logfmt::{WARN_BURST, WARN_PER_SEC};

/// The body of [`log_limited!`]: the line, if `budget` allows it, with the count dropped
/// before it.
pub(crate) fn emit_limited(
    budget: &std::sync::Mutex<crate::logfmt::LogBudget>,
    level: log::Level,
    target: &str,
    args: std::fmt::Arguments<'_>,
) {
    let allowed = budget
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .allow(std::time::Instant::now());
    if let Some(dropped) = allowed {
        let more = crate::logfmt::suppressed_note(dropped);
        let line = args.to_string();
        log::log!(target: target, level, "{}{more}", secrets::redact(&line));
    }
}

pub(crate) mod discord;
pub(crate) mod edits;
pub(crate) mod fair;
pub(crate) mod gateway;
pub(crate) mod grapheme;
pub(crate) mod irc;
pub(crate) mod lenient;
pub(crate) mod markdown;
pub(crate) mod matrix;
pub(crate) mod replies;
pub(crate) mod secrets;
pub(crate) mod slack;
pub(crate) mod split;
pub(crate) mod spool;
pub(crate) mod telegram;
pub(crate) mod tls;
pub(crate) mod websocket;

/// Chat commands typed with a `!` (IRC and Matrix clients take `/` for themselves) mapped to
/// the gateway's `/` commands: `!stop` → `/stop`, also `!new`, `!reset`, `!status`. Anything
/// else is returned as it is (a `/stop` typed directly stays a command).
pub(crate) fn map_command(text: &str) -> std::borrow::Cow<'_, str> {
    let trimmed = text.trim_start();
    for name in ["stop", "new", "reset", "status"] {
        if let Some(rest) = trimmed.strip_prefix('!').and_then(|t| t.strip_prefix(name))
            && (rest.is_empty() || rest.starts_with(char::is_whitespace))
        {
            return format!("/{name}{rest}").into();
        }
    }
    text.into()
}

/// Whether `c` may stay in a display name passed to the agent: no control character and no
/// bidi override or isolate (U+202A–U+202E, U+2066–U+2069), which would let a name reorder
/// the text around it.
pub(crate) fn name_char(c: char) -> bool {
    !c.is_control() && !matches!(c, '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}')
}

/// Why a bridge could not run (bad flags, a refused login): printed, exit code 1.
pub(crate) type BridgeError = String;

/// Opens a TCP connection to the first of `addr`'s addresses (`HOST:PORT`, names resolved)
/// that answers within `timeout`; the error names the address and why.
pub(crate) fn connect_tcp(
    addr: &str,
    timeout: std::time::Duration,
) -> Result<std::net::TcpStream, String> {
    use std::net::ToSocketAddrs;
    let addrs: Vec<_> = addr
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {addr}: {e}"))?
        .collect();
    let mut last = format!("{addr} resolves to no address");
    for a in addrs {
        match std::net::TcpStream::connect_timeout(&a, timeout) {
            Ok(s) => return Ok(s),
            Err(e) => last = format!("cannot connect to {a}: {e}"),
        }
    }
    Err(last)
}

/// Runs the blocking call `f` (a start-up request to a server that may never answer) on a
/// thread of its own and waits for its answer or for `stop`, whichever comes first: `None`
/// when `stop` fired (or was dropped) first; the call is then left to end on its own (its
/// timeout), the process does not wait for it.
pub(crate) fn interruptible<T: Send + 'static>(
    stop: &crossbeam_channel::Receiver<()>,
    name: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<Option<T>, BridgeError> {
    let (tx, rx) = crossbeam_channel::bounded(1);
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let _ = tx.send(f());
        })
        .map_err(|e| format!("cannot start a thread: {e}"))?;
    crossbeam_channel::select! {
        recv(rx) -> answer => answer
            .map(Some)
            .map_err(|_| format!("the {name} thread ended without an answer")),
        recv(stop) -> _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bang_commands_map_to_slash_commands_and_nothing_else_does() {
        assert_eq!(map_command("!stop"), "/stop");
        assert_eq!(map_command("  !new"), "/new");
        assert_eq!(map_command("!status please"), "/status please");
        assert_eq!(map_command("!reset"), "/reset");
        assert_eq!(map_command("/stop"), "/stop");
        assert_eq!(map_command("!stopwatch"), "!stopwatch");
        assert_eq!(map_command("say !stop"), "say !stop");
        assert_eq!(map_command("!unknown"), "!unknown");
    }

    #[test]
    fn names_lose_bidi_overrides_and_isolates() {
        let name: String = "Ann\u{202E}live\u{2066}x\u{2069}\u{202A}\u{7}é"
            .chars()
            .filter(|&c| name_char(c))
            .collect();
        assert_eq!(name, "Annlivexé");
    }
}
