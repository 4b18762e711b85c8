//! One turn of a process agent: the `turn` line out, then the agent's lines in until its
//! `reply` or `error` for this turn, its exit, or a `cancel` it does not answer in time. Each
//! pass of the loop is one [`Turn::step`]: write, read, take lines, watch the exit, watch the
//! cancel, wait.

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::{Value, json};

use super::{Live, ProcessOptions};
use crate::agent::{CancelToken, TurnError, TurnInput};
use crate::agents::child::{self, READ_BUDGET, ReadState, Wake, pollin};

/// Longest `error` message passed on to the chat.
const ERROR_TEXT_MAX: usize = 2048;
/// Bytes queued for a process that does not read its stdin, past which it is replaced.
pub(super) const MAX_UNREAD_STDIN: usize = 16 << 20;
/// Read passes allowed after the process has exited, for what it wrote before: a detached
/// process flooding the pipe must not hold the turn.
const PASSES_AFTER_EXIT: usize = 64;

/// How long a process whose stdout closed is given to report its exit, so the turn's error
/// says the exit status; a process still running past it closed its stdout while alive.
const EXIT_AFTER_EOF: Duration = Duration::from_secs(1);

/// Bytes written to the pipe `w` that its reader has not read yet.
fn unread(w: &std::fs::File) -> usize {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD on a pipe fd we own writes one int.
    let rc = unsafe { libc::ioctl(w.as_raw_fd(), libc::FIONREAD, &mut n) };
    if rc < 0 { 0 } else { n.max(0) as usize }
}

/// A line from the agent process.
#[derive(Debug, Deserialize, PartialEq)]
#[serde(tag = "op", rename_all = "lowercase")]
pub(super) enum FromAgent {
    Partial {
        id: String,
        text: String,
    },
    Reply {
        id: String,
        text: String,
        /// Files of the turn's outbox to attach (docs/agent-protocol.md).
        #[serde(default)]
        attachments: Vec<crate::attachments::Requested>,
    },
    Error {
        id: String,
        message: String,
    },
    /// Any other op: ignored, so the protocol can grow.
    #[serde(other)]
    Unknown,
}

/// How a turn ended, when the process is still usable or the agent has to act.
pub(super) enum Ended {
    /// The process answered the turn (an `error` after `cancel` is a cancellation), with the
    /// files its reply named.
    Answered(
        Result<String, TurnError>,
        Vec<crate::attachments::Requested>,
    ),
    /// The turn was cancelled and the process did not answer `cancel` within three quarters
    /// of the stop grace: its tree is to be killed.
    CancelIgnored,
}

/// Runs one turn on `live`. `Err` means the process is unusable (it exited, broke the
/// protocol, or a pipe failed) and is to be replaced.
pub(super) fn run(
    live: &mut Live,
    input: &TurnInput<'_>,
    outbox: Option<&std::path::Path>,
    cancel: &CancelToken,
    options: &ProcessOptions,
) -> Result<Ended, String> {
    let mut line = turn_line(input);
    line["outbox"] = json!(outbox.map(|p| p.to_string_lossy()));
    live.queue(&line);
    if live.pending.len() > MAX_UNREAD_STDIN {
        return Err(format!(
            "the agent process left more than {MAX_UNREAD_STDIN} bytes of its stdin unread"
        ));
    }
    let mut turn = Turn::new(input, cancel, options)?;
    loop {
        if let Some(ended) = turn.step(live)? {
            return Ok(ended);
        }
    }
}

/// The `turn` line of the protocol.
fn turn_line(input: &TurnInput<'_>) -> Value {
    let context = input.context;
    let meta = context
        .meta
        .as_deref()
        .and_then(|m| serde_json::from_str::<Value>(m).ok())
        .unwrap_or_else(|| json!({}));
    let s = input.session;
    json!({
        "op": "turn",
        "id": input.message_id,
        "session": s.as_str(),
        "text": input.text,
        "user_id": context.user_id.as_deref().or(s.user_id()),
        "user_name": context.user_name.as_deref(),
        "meta": meta,
        "attachments": context.attachments(),
        "platform": s.platform(),
        "chat_id": s.chat_id(),
        "chat_type": s.chat_type().as_str(),
        "thread_id": s.thread_id(),
    })
}

/// A turn's answer: the reply's text or the error, and the files the reply names.
type Answer = (
    Result<String, TurnError>,
    Vec<crate::attachments::Requested>,
);

/// A turn in progress.
struct Turn<'a> {
    input: &'a TurnInput<'a>,
    cancel: &'a CancelToken,
    options: &'a ProcessOptions,
    /// Signalled by the cancel token, so a cancel wakes the poll.
    wake: Arc<Wake>,
    /// Set once `cancel` is sent: past it the process tree is killed.
    kill_at: Option<Instant>,
    /// The process closed its stdout.
    eof: bool,
    /// Until the turn's line has left the stdin pipe: past it the process is stuck.
    drain_by: Option<Instant>,
    passes_after_exit: usize,
}

impl<'a> Turn<'a> {
    fn new(
        input: &'a TurnInput<'a>,
        cancel: &'a CancelToken,
        options: &'a ProcessOptions,
    ) -> Result<Turn<'a>, String> {
        let wake = Arc::new(Wake::new().map_err(|e| format!("eventfd: {e}"))?);
        {
            let wake = Arc::clone(&wake);
            cancel.on_cancel(move || wake.signal());
        }
        Ok(Turn {
            input,
            cancel,
            options,
            wake,
            kill_at: None,
            eof: false,
            drain_by: Some(Instant::now() + options.stdin_drain),
            passes_after_exit: 0,
        })
    }

    /// One pass; `None`: go on. The cancel, the kill deadline and the stdin deadline are
    /// checked on every pass, even while stdout floods.
    fn step(&mut self, live: &mut Live) -> Result<Option<Ended>, String> {
        live.flush();
        let state = self.read(live)?;
        if let Some((answer, files)) = self.take_lines(live)? {
            return Ok(Some(Ended::Answered(answer, files)));
        }
        if state == ReadState::Eof {
            // Nothing more can come: a process that closed its stdout (or exited) without
            // answering fails the turn now, with its exit status if it is exiting.
            return Err(match live.child.wait_exit(EXIT_AFTER_EOF) {
                Some(exit) => format!("agent process {exit}"),
                None => "the agent process closed its stdout while still running".to_owned(),
            });
        }
        self.pass_on_cancel(live);
        if let Some(at) = self.kill_at
            && Instant::now() >= at
        {
            return Ok(Some(Ended::CancelIgnored));
        }
        self.check_drained(live)?;
        if let Some(exit) = live.child.try_exit() {
            // Everything the process wrote before it exited is in the pipe: one more pass
            // after the exit is seen (it may have come right after a read), more while a pass
            // still finds data, within a bound.
            self.passes_after_exit += 1;
            if self.passes_after_exit == 1
                || (state == ReadState::More && self.passes_after_exit < PASSES_AFTER_EXIT)
            {
                return Ok(None);
            }
            return Err(format!("agent process {exit}"));
        }
        if state == ReadState::More {
            return Ok(None);
        }
        self.wait(live)?;
        Ok(None)
    }

    /// Fails the turn if the process closed its stdin, or left the turn's line unread past
    /// [`ProcessOptions::stdin_drain`].
    fn check_drained(&mut self, live: &Live) -> Result<(), String> {
        let Some(by) = self.drain_by else {
            return Ok(());
        };
        let Some(stdin) = &live.stdin else {
            return Err("the agent process closed its stdin".to_owned());
        };
        if live.pending.is_empty() && unread(stdin) == 0 {
            self.drain_by = None;
        } else if Instant::now() >= by {
            return Err(format!(
                "the agent process did not read its stdin within {:?}",
                self.options.stdin_drain
            ));
        }
        Ok(())
    }

    /// Reads what stdout has now (nothing once it is closed).
    fn read(&mut self, live: &mut Live) -> Result<ReadState, String> {
        if self.eof {
            return Ok(ReadState::WouldBlock);
        }
        let state = live
            .lines
            .read_from(&mut live.stdout, READ_BUDGET)
            .map_err(|e| format!("reading the agent's stdout: {e}"))?;
        self.eof = state == ReadState::Eof;
        Ok(state)
    }

    /// Takes the complete lines read: partials are published, lines for other turns
    /// ignored; this turn's `reply` (with the files it names) or `error` is its answer.
    fn take_lines(&self, live: &mut Live) -> Result<Option<Answer>, String> {
        let id = self.input.message_id;
        while let Some(line) = live.lines.next_line() {
            let line = line.map_err(|e| {
                format!(
                    "agent protocol error: the agent wrote a line longer than {} bytes",
                    e.max
                )
            })?;
            let msg = serde_json::from_slice::<FromAgent>(&line).map_err(|e| {
                format!("agent protocol error: not a valid message line from the agent: {e}")
            })?;
            match msg {
                FromAgent::Partial { id: i, text } if i == id => {
                    if self.kill_at.is_none() {
                        let shown = crate::text::prefix(&text, self.options.max_reply_bytes);
                        self.input.partials.publish(shown);
                    }
                }
                FromAgent::Reply {
                    id: i,
                    text,
                    attachments,
                } if i == id => {
                    live.answered = true;
                    return Ok(Some((Ok(text), attachments)));
                }
                FromAgent::Error { id: i, message } if i == id => {
                    live.answered = true;
                    if self.kill_at.is_some() {
                        return Ok(Some((Err(TurnError::Cancelled), Vec::new())));
                    }
                    let failed = TurnError::Failed(bounded(message).into());
                    return Ok(Some((Err(failed), Vec::new())));
                }
                FromAgent::Unknown => {}
                other => log::debug!(
                    "session {}: agent line for another turn ignored: {other:?}",
                    self.input.session
                ),
            }
        }
        Ok(None)
    }

    /// Once the turn is cancelled: sends `cancel` and sets the time the tree is killed at.
    fn pass_on_cancel(&mut self, live: &mut Live) {
        if self.kill_at.is_none() && self.cancel.is_cancelled() {
            live.queue(&json!({"op": "cancel", "id": self.input.message_id}));
            live.flush();
            self.kill_at = Some(Instant::now() + self.options.stop_grace * 3 / 4);
        }
    }

    /// Waits for the exit, stdout, the cancel (until it is passed on), or room in stdin.
    fn wait(&self, live: &Live) -> Result<(), String> {
        let mut fds = Vec::with_capacity(4);
        if let Some(fd) = live.child.exit_fd() {
            fds.push(pollin(fd));
        }
        if !self.eof {
            fds.push(pollin(live.stdout.as_raw_fd()));
        }
        if self.kill_at.is_none() {
            fds.push(pollin(self.wake.fd()));
        }
        if let Some(p) = live.pollout() {
            fds.push(p);
        }
        let timeout = [self.kill_at, self.drain_by]
            .into_iter()
            .flatten()
            .min()
            .map(|at| at.saturating_duration_since(Instant::now()));
        child::poll(&mut fds, timeout).map_err(|e| format!("poll: {e}"))?;
        Ok(())
    }
}

/// An agent's error text, cut to [`ERROR_TEXT_MAX`] for the chat.
fn bounded(mut text: String) -> String {
    if crate::text::truncate(&mut text, ERROR_TEXT_MAX) {
        text.push('…');
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::Partials;
    use crate::message::{MessageContext, SessionKey};

    /// The turn line names the message's files as the bridge protocol does (issue 36), and
    /// an empty list when it has none.
    #[test]
    fn the_turn_line_carries_the_attachments() {
        let key = SessionKey::dm("tg", "42").expect("key");
        let entry = crate::Attachment {
            name: "cat.png".into(),
            mime: "image/png".into(),
            size: 3,
            sha256: Some("ab".repeat(32)),
            path: Some("/spool/cat.png".into()),
            skipped: None,
        };
        let with_files = MessageContext {
            attachments: Some(Arc::new(vec![entry])),
            ..MessageContext::default()
        };
        let line = |context: &MessageContext| {
            turn_line(&TurnInput {
                session: &key,
                message_id: "m-1",
                text: "look",
                context,
                partials: &Partials::discard(),
            })
        };
        assert_eq!(
            line(&with_files)["attachments"],
            json!([{"name": "cat.png", "mime": "image/png", "size": 3,
                    "sha256": "ab".repeat(32), "path": "/spool/cat.png"}])
        );
        assert_eq!(line(&MessageContext::default())["attachments"], json!([]));
    }
}
