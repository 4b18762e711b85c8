//! The exec agent: each turn runs a shell command in its own process group, with the turn's
//! text on stdin and the reply read from stdout. This is how a real LLM agent (any CLI or
//! script) plugs into the gateway.

use std::io::{Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use crossbeam_channel::{Receiver, bounded};

use crate::agent::{Agent, AgentFactory, CancelToken, TurnError, TurnInput};
use crate::message::SessionKey;

/// How often a running command is checked for exit while waiting on the cancel token.
const EXIT_POLL: Duration = Duration::from_millis(2);
/// How long to wait for stdout/stderr to close after the command exits.
const OUTPUT_GRACE: Duration = Duration::from_millis(500);
/// Lines of stderr quoted in a failure.
const STDERR_LINES: usize = 5;

/// Runs `sh -c <command>` per turn.
pub struct ExecAgent {
    command: Arc<str>,
    /// Process groups this agent started; `close()` kills what is left of them.
    groups: Vec<i32>,
}

impl ExecAgent {
    /// A factory of exec agents for `command`.
    pub fn factory(command: &str) -> impl AgentFactory {
        let command: Arc<str> = command.into();
        move |_: &SessionKey| -> Result<Box<dyn Agent>, String> {
            Ok(Box::new(ExecAgent {
                command: command.clone(),
                groups: Vec::new(),
            }))
        }
    }
}

fn kill_group(pgid: i32) -> bool {
    // SAFETY: kill(2) with a negative pid signals a process group; no memory is involved.
    unsafe { libc::kill(-pgid, libc::SIGKILL) == 0 }
}

fn group_alive(pgid: i32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    unsafe { libc::kill(-pgid, 0) == 0 }
}

fn read_all(mut r: impl Read + Send + 'static) -> Receiver<Vec<u8>> {
    let (tx, rx) = bounded(1);
    let spawned = thread::Builder::new()
        .name("turnstile-exec-io".into())
        .spawn(move || {
            let mut buf = Vec::new();
            let _ = r.read_to_end(&mut buf);
            let _ = tx.send(buf);
        });
    if spawned.is_err() {
        log::error!("cannot start an exec output reader thread");
    }
    rx
}

impl Agent for ExecAgent {
    fn turn(&mut self, input: &TurnInput<'_>, cancel: &CancelToken) -> Result<String, TurnError> {
        self.groups.retain(|&g| group_alive(g));
        let s = input.session;
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(&*self.command)
            .process_group(0)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env("TURNSTILE_SESSION", s.as_str())
            .env("TURNSTILE_MESSAGE_ID", input.message_id)
            .env("TURNSTILE_PLATFORM", s.platform())
            .env("TURNSTILE_CHAT_ID", s.chat_id())
            .env(
                "TURNSTILE_USER_ID",
                input
                    .context
                    .user_id
                    .as_deref()
                    .or(s.user_id())
                    .unwrap_or(""),
            )
            .env(
                "TURNSTILE_USER_NAME",
                input.context.user_name.as_deref().unwrap_or(""),
            )
            .env("TURNSTILE_CHAT_TYPE", s.chat_type().as_str())
            .env("TURNSTILE_THREAD_ID", s.thread_id().unwrap_or(""))
            .env(
                "TURNSTILE_META",
                input.context.meta.as_deref().unwrap_or(""),
            )
            .spawn()
            .map_err(|e| TurnError::Failed(format!("cannot run agent command: {e}")))?;
        let pgid = child.id() as i32;
        self.groups.push(pgid);
        let stdout = child.stdout.take().map(read_all);
        let stderr = child.stderr.take().map(read_all);
        if let Some(mut stdin) = child.stdin.take() {
            let text = input.text.as_bytes().to_vec();
            // A writer thread: a command that never reads stdin must not block the turn.
            let _ = thread::Builder::new()
                .name("turnstile-exec-io".into())
                .spawn(move || {
                    let _ = stdin.write_all(&text);
                });
        }
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) => {}
                Err(e) => return Err(TurnError::Failed(format!("waiting for agent command: {e}"))),
            }
            if cancel.wait_timeout(EXIT_POLL) {
                kill_group(pgid);
                let _ = child.wait();
                return Err(TurnError::Cancelled);
            }
        };
        let collect = |rx: Option<Receiver<Vec<u8>>>| -> Vec<u8> {
            let Some(rx) = rx else { return Vec::new() };
            match rx.recv_timeout(OUTPUT_GRACE) {
                Ok(b) => b,
                Err(_) => {
                    // A leftover process holds the pipe open; the turn is over, so end it.
                    kill_group(pgid);
                    rx.recv_timeout(OUTPUT_GRACE).unwrap_or_default()
                }
            }
        };
        let out = collect(stdout);
        let err = collect(stderr);
        if status.success() {
            let mut reply = String::from_utf8_lossy(&out).into_owned();
            if reply.ends_with('\n') {
                reply.pop();
            }
            return Ok(reply);
        }
        let how = match (status.code(), status.signal()) {
            (Some(code), _) => format!("exit status {code}"),
            (None, Some(sig)) => format!("killed by signal {sig}"),
            _ => "abnormal exit".to_owned(),
        };
        let err = String::from_utf8_lossy(&err);
        let tail: Vec<&str> = err.lines().rev().take(STDERR_LINES).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        Err(TurnError::Failed(if tail.is_empty() {
            how
        } else {
            format!("{how}: {}", tail.join("\n"))
        }))
    }

    fn close(&mut self) -> Result<(), String> {
        for pgid in self.groups.drain(..) {
            kill_group(pgid);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(cmd: &str, text: &str) -> Result<String, TurnError> {
        let key = SessionKey::dm("tg", "42").unwrap();
        let mut agent = ExecAgent {
            command: cmd.into(),
            groups: Vec::new(),
        };
        let context = crate::message::MessageContext {
            user_id: Some("7".into()),
            user_name: Some("Ann".into()),
            meta: Some(r#"{"reply_to":"m-8"}"#.into()),
        };
        let input = TurnInput {
            session: &key,
            message_id: "m-9",
            text,
            context: &context,
            partials: &crate::agent::Partials::discard(),
        };
        agent.turn(&input, &CancelToken::new())
    }

    #[test]
    fn stdin_in_stdout_out_with_one_trailing_newline_trimmed() {
        assert_eq!(run("cat; echo", "hi"), Ok("hi".to_owned()));
        assert_eq!(run("printf 'a\\n\\n'", ""), Ok("a\n".to_owned()));
    }

    #[test]
    fn the_turn_is_described_in_the_environment() {
        let out = run(
            "echo $TURNSTILE_SESSION $TURNSTILE_MESSAGE_ID $TURNSTILE_PLATFORM $TURNSTILE_CHAT_ID",
            "",
        );
        assert_eq!(out, Ok("tg:dm:42 m-9 tg 42".to_owned()));
        let out = run(
            "echo $TURNSTILE_USER_ID $TURNSTILE_USER_NAME $TURNSTILE_CHAT_TYPE \"$TURNSTILE_THREAD_ID\" $TURNSTILE_META",
            "",
        );
        assert_eq!(out, Ok(r#"7 Ann dm  {"reply_to":"m-8"}"#.to_owned()));
    }

    #[test]
    fn a_nonzero_exit_fails_with_the_status_and_stderr_tail() {
        let out = run("echo one >&2; echo two >&2; exit 3", "");
        assert_eq!(
            out,
            Err(TurnError::Failed("exit status 3: one\ntwo".to_owned()))
        );
    }
}
