//! `/access` on the HTTP endpoint (issue 32): the access policy's admin commands
//! (`turnstile access approve CODE`, …) handed from the endpoint's thread to the reactor,
//! which owns the policy and applies them there (its saver thread writes `access.json`).
//!
//! The endpoint's thread waits for the answer, at most [`ANSWER_TIMEOUT`]: the reactor takes
//! calls every tick. While it waits the endpoint answers nothing else, so the wait is short
//! and only an authenticated caller (the endpoint's bearer token) can cause it.

use std::time::Duration;

use crossbeam_channel::{Receiver, Sender, TrySendError};

/// Calls queued for the reactor; the endpoint's single thread waits on each, so more than
/// one waits only after a timeout.
const CALLS_CAP: usize = 4;
/// How long the endpoint waits for the reactor's answer before a `503`.
pub(crate) const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);
/// Calls the reactor applies per pass.
const CALLS_PER_PASS: usize = CALLS_CAP;
/// Bytes of a platform name or a command taken from a request.
const MAX_FIELD_BYTES: usize = 1024;

/// One admin command for the reactor, with where to answer.
pub(crate) struct AccessCall {
    platform: String,
    command: String,
    reply: Sender<Result<String, String>>,
}

/// Runs one command on the wrapped frontend (the bridge server's policy).
pub(crate) type AccessApplier<F> =
    Box<dyn FnMut(&mut F, &str, &str) -> Result<String, String> + Send>;

/// The endpoint's side: asks the reactor.
pub(crate) struct AccessDesk {
    tx: Sender<AccessCall>,
}

/// The reactor's side: the calls waiting.
pub(crate) struct AccessCalls<F> {
    rx: Receiver<AccessCall>,
    apply: AccessApplier<F>,
}

/// A desk and its calls, connected.
pub(crate) fn channel<F>(apply: AccessApplier<F>) -> (AccessDesk, AccessCalls<F>) {
    let (tx, rx) = crossbeam_channel::bounded(CALLS_CAP);
    (AccessDesk { tx }, AccessCalls { rx, apply })
}

impl AccessDesk {
    /// The answer to `POST /access?platform=P&command=C`: status and plain text.
    pub(crate) fn ask(&self, query: &str) -> (u16, String) {
        let (platform, command) = match parse_query(query) {
            Ok(pc) => pc,
            Err(why) => return (400, format!("{why}\n")),
        };
        let (reply, answer) = crossbeam_channel::bounded(1);
        let call = AccessCall {
            platform,
            command,
            reply,
        };
        match self.tx.try_send(call) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                return (
                    503,
                    "the gateway's loop has access calls waiting; retry\n".into(),
                );
            }
            Err(TrySendError::Disconnected(_)) => {
                return (503, "the gateway is stopping\n".into());
            }
        }
        match answer.recv_timeout(ANSWER_TIMEOUT) {
            Ok(Ok(text)) => (200, format!("{text}\n")),
            Ok(Err(why)) => (409, format!("{why}\n")),
            Err(_) => (
                503,
                format!(
                    "the gateway's loop did not answer within {} s (the command may still apply)\n",
                    ANSWER_TIMEOUT.as_secs()
                ),
            ),
        }
    }
}

impl<F> AccessCalls<F> {
    /// Applies the calls waiting (a bounded number per pass) on the reactor.
    pub(crate) fn apply_waiting(&mut self, inner: &mut F) {
        for call in self.rx.try_iter().take(CALLS_PER_PASS) {
            let answer = (self.apply)(inner, &call.platform, &call.command);
            log::info!(
                "access: {} {:?} from the HTTP endpoint: {}",
                call.platform,
                call.command,
                match &answer {
                    Ok(_) => "done",
                    Err(e) => e.as_str(),
                }
            );
            // The endpoint may have stopped waiting (a timeout): nothing to tell.
            let _ = call.reply.send(answer);
        }
    }
}

/// `platform` and `command` of an `/access` query, percent-decoded.
fn parse_query(query: &str) -> Result<(String, String), String> {
    let (mut platform, mut command) = (None, None);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let value = percent_decode(value).ok_or_else(|| format!("{key}: bad percent-encoding"))?;
        if value.len() > MAX_FIELD_BYTES {
            return Err(format!("{key}: over {MAX_FIELD_BYTES} bytes"));
        }
        match key {
            "platform" => platform = Some(value),
            "command" => command = Some(value),
            _ => return Err(format!("unknown parameter {key:?}")),
        }
    }
    match (platform, command) {
        (Some(p), Some(c)) if !p.is_empty() && !c.trim().is_empty() => Ok((p, c)),
        _ => Err("give platform=NAME&command=WORDS".into()),
    }
}

/// `%XX` escapes and `+` (a space) decoded; `None` for a bad escape or invalid UTF-8.
pub(crate) fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// `s` percent-encoded for a query value (all but unreserved characters escaped).
// Only `turnstile access` (feature `cli`) writes queries.
#[cfg_attr(not(feature = "cli"), allow(dead_code))]
pub(crate) fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for &c in s.as_bytes() {
        if c.is_ascii_alphanumeric() || b"-._~".contains(&c) {
            out.push(c as char);
        } else {
            out.push_str(&format!("%{c:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_query_round_trips_through_the_encoding() {
        let user = "@bob:example.org #chan+x&y=z é";
        let q = format!(
            "platform=matrix&command={}",
            percent_encode(&format!("allow {user}"))
        );
        assert_eq!(
            parse_query(&q),
            Ok(("matrix".into(), format!("allow {user}")))
        );
        assert!(parse_query("platform=matrix").is_err());
        assert!(parse_query("platform=matrix&command=%zz").is_err());
        assert!(parse_query("platform=matrix&command=x&other=1").is_err());
    }

    /// The reactor's side answers each call through its own reply channel.
    #[test]
    fn calls_are_applied_on_the_reactor_side_and_answered() {
        let apply: AccessApplier<Vec<String>> = Box::new(|seen, p, c| {
            seen.push(format!("{p} {c}"));
            if c == "fail" {
                Err("no".into())
            } else {
                Ok("done".into())
            }
        });
        let (desk, mut calls) = channel(apply);
        let reactor = std::thread::spawn(move || {
            let mut seen = Vec::new();
            while seen.len() < 2 {
                calls.apply_waiting(&mut seen);
                std::thread::yield_now();
            }
            seen
        });
        assert_eq!(
            desk.ask("platform=irc&command=approve+K7"),
            (200, "done\n".into())
        );
        assert_eq!(desk.ask("platform=irc&command=fail"), (409, "no\n".into()));
        let seen = reactor.join().expect("the reactor side");
        assert_eq!(seen, ["irc approve K7", "irc fail"]);
        assert_eq!(desk.ask("nothing").0, 400);
    }
}
