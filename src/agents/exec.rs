//! The exec agent: each turn runs a shell command, contained ([`crate::agents::child`]), with the
//! turn's text on stdin and the reply read from stdout. This is how a one-shot LLM agent (any
//! CLI or script) plugs into the gateway.
//!
//! The turn waits in `poll(2)` on the command's pipes, its exit and the cancellation, never in
//! a polling loop. The reply is what the command wrote on stdout before it exited (kept up to
//! the reply cap, the rest read and discarded), even if a process it left running still holds
//! the pipe. Its stderr goes to the log with the session key, never to the chat. Processes a
//! turn leaves running live in their contained tree until the agent is closed.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::Arc;

use crate::agent::{Agent, AgentFactory, CancelToken, TurnError, TurnInput};
use crate::agents::child::{
    self, AgentEnv, ContainedChild, Exit, OutputBuf, READ_BUDGET, ReadState, Wake, pollin,
    readable, write_some,
};
use crate::attachments::Outbox;
use crate::message::SessionKey;
use crate::reactor::DEFAULT_MAX_REPLY_BYTES;

/// Bytes of a failed command's stdout quoted in the failure.
const ERROR_TEXT_MAX: usize = 2048;
/// Trees of turns that left processes running, kept per agent until `close()`; past this the
/// oldest is killed, so a session leaving a process behind every turn stays bounded.
const MAX_LEFTOVER_TREES: usize = 16;

/// Settings of exec agents.
#[derive(Clone, Debug)]
pub struct ExecOptions {
    /// The environment allow-list.
    pub env: AgentEnv,
    /// stdout kept per turn (the worker cuts the reply to this and flags it truncated; a few
    /// bytes more are kept so the cut is detected).
    pub max_output_bytes: usize,
    /// The spool and bounds of the turn's outbox (`$TURNSTILE_OUTBOX`: the files left there
    /// are attached to the reply). Without a `dir` a turn gets no outbox.
    pub outbox: crate::AttachmentLimits,
}

impl Default for ExecOptions {
    fn default() -> Self {
        ExecOptions {
            env: AgentEnv::default(),
            max_output_bytes: DEFAULT_MAX_REPLY_BYTES,
            outbox: crate::AttachmentLimits::default(),
        }
    }
}

/// Runs `/bin/sh -c <command>` per turn, contained.
pub struct ExecAgent {
    command: Arc<str>,
    options: Arc<ExecOptions>,
    /// Trees of turns whose command left processes running; `close()` kills them.
    leftovers: Vec<ContainedChild>,
    /// The files the last turn left in its outbox, until the worker takes them.
    attached: Vec<crate::Attachment>,
}

impl ExecAgent {
    /// A factory of exec agents for `command`, with the default options.
    pub fn factory(command: &str) -> impl AgentFactory {
        ExecAgent::factory_with(command, ExecOptions::default())
    }

    /// A factory of exec agents for `command`.
    pub fn factory_with(command: &str, options: ExecOptions) -> impl AgentFactory {
        let command: Arc<str> = command.into();
        let options = Arc::new(options);
        move |_: &SessionKey| -> Result<Box<dyn Agent>, String> {
            Ok(Box::new(ExecAgent::new(&command, &options)))
        }
    }

    fn new(command: &Arc<str>, options: &Arc<ExecOptions>) -> ExecAgent {
        ExecAgent {
            command: Arc::clone(command),
            options: Arc::clone(options),
            leftovers: Vec::new(),
            attached: Vec::new(),
        }
    }

    /// Runs the command for one turn: its exit, its (bounded) stdout and its outbox.
    fn run(
        &mut self,
        input: &TurnInput<'_>,
        cancel: &CancelToken,
    ) -> Result<(Exit, OutputBuf, Option<Outbox>), TurnError> {
        // Trees whose leftovers have all exited need nothing more than their leader reaped.
        self.leftovers
            .retain_mut(|c| c.has_descendants() || !c.kill());
        let files = crate::attachments::to_json(input.context.attachments());
        let outbox = Outbox::create(&self.options.outbox)
            .map_err(|e| failed("cannot make the turn's outbox", e))?;
        let outbox_dir = outbox
            .as_ref()
            .map(|o| o.path().to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut vars = turn_vars(input).to_vec();
        vars.push(("TURNSTILE_ATTACHMENTS", &files));
        vars.push(("TURNSTILE_OUTBOX", &outbox_dir));
        let env = self.options.env.build(&vars);
        let mut child = ContainedChild::spawn(&self.command, &env)
            .map_err(|e| failed("cannot run agent command", e))?;
        if let Some(stderr) = child.stderr.take() {
            child::log_stderr(stderr, input.session.clone());
        }
        let wake = Arc::new(Wake::new().map_err(|e| failed("eventfd", e))?);
        {
            let wake = Arc::clone(&wake);
            cancel.on_cancel(move || wake.signal());
        }
        let mut pipes = Pipes::take(&mut child, input.text)?;
        // A few bytes past the cap, so the worker sees (and flags) the cut.
        let mut out = OutputBuf::new(self.options.max_output_bytes.saturating_add(4));
        let exit = pipes.until_exit(&mut child, &wake, &mut out)?;
        pipes.finish(&mut out);
        self.keep_if_running(child, input.session);
        Ok((exit, out, outbox))
    }

    /// Keeps a finished turn's tree while something of it still runs (killing the oldest
    /// kept past [`MAX_LEFTOVER_TREES`]); otherwise reaps its leader now.
    fn keep_if_running(&mut self, mut child: ContainedChild, s: &SessionKey) {
        if child.has_descendants() {
            if self.leftovers.len() >= MAX_LEFTOVER_TREES {
                let mut oldest = self.leftovers.remove(0);
                log::warn!(
                    "session {s}: more than {MAX_LEFTOVER_TREES} turns left processes running; killing those of the oldest (leader pid {})",
                    oldest.leader_pid()
                );
                oldest.kill();
            }
            self.leftovers.push(child);
        } else {
            child.kill();
        }
    }
}

/// A turn's failure to run the command.
fn failed(what: &str, e: io::Error) -> TurnError {
    TurnError::Failed(format!("{what}: {e}").into())
}

/// The `TURNSTILE_*` variables of a turn.
fn turn_vars<'a>(input: &TurnInput<'a>) -> [(&'static str, &'a str); 9] {
    let s = input.session;
    let user_id = input
        .context
        .user_id
        .as_deref()
        .or(s.user_id())
        .unwrap_or("");
    [
        ("TURNSTILE_SESSION", s.as_str()),
        ("TURNSTILE_MESSAGE_ID", input.message_id),
        ("TURNSTILE_PLATFORM", s.platform()),
        ("TURNSTILE_CHAT_ID", s.chat_id()),
        ("TURNSTILE_USER_ID", user_id),
        (
            "TURNSTILE_USER_NAME",
            input.context.user_name.as_deref().unwrap_or(""),
        ),
        ("TURNSTILE_CHAT_TYPE", s.chat_type().as_str()),
        ("TURNSTILE_THREAD_ID", s.thread_id().unwrap_or("")),
        (
            "TURNSTILE_META",
            input.context.meta.as_deref().unwrap_or(""),
        ),
    ]
}

/// The gateway's ends of a turn's stdin and stdout, both non-blocking.
struct Pipes {
    /// `None` once everything is written (or the command closed it).
    stdin: Option<File>,
    pending: Vec<u8>,
    written: usize,
    /// `None` at end of file.
    stdout: Option<File>,
}

impl Pipes {
    /// Takes the child's stdin (to write `text` to) and stdout.
    fn take(child: &mut ContainedChild, text: &str) -> Result<Pipes, TurnError> {
        let mut stdin = child.stdin.take();
        let pending = text.as_bytes().to_vec();
        if pending.is_empty() {
            stdin = None;
        }
        let stdout = child.stdout.take();
        for fd in stdin
            .iter()
            .map(|f| f.as_fd())
            .chain(stdout.iter().map(|f| f.as_fd()))
        {
            child::set_nonblocking(fd).map_err(|e| failed("agent pipes", e))?;
        }
        Ok(Pipes {
            stdin,
            pending,
            written: 0,
            stdout,
        })
    }

    /// Writes stdin and reads stdout into `out` until the command exits; a cancel (through
    /// `wake`) kills the tree and ends the turn.
    fn until_exit(
        &mut self,
        child: &mut ContainedChild,
        wake: &Wake,
        out: &mut OutputBuf,
    ) -> Result<Exit, TurnError> {
        loop {
            if let Some(exit) = child.try_exit() {
                return Ok(exit);
            }
            let Some(exit_fd) = child.exit_fd() else {
                continue;
            };
            let mut fds = vec![pollin(wake.fd()), pollin(exit_fd)];
            if let Some(f) = &self.stdout {
                fds.push(pollin(f.as_raw_fd()));
            }
            if let Some(f) = &self.stdin {
                fds.push(libc::pollfd {
                    fd: f.as_raw_fd(),
                    events: libc::POLLOUT,
                    revents: 0,
                });
            }
            child::poll(&mut fds, None).map_err(|e| failed("poll", e))?;
            if readable(&fds[0]) {
                // The cancel path kills the whole tree, detached processes included.
                child.kill();
                return Err(TurnError::Cancelled);
            }
            self.transfer(&fds[2..], out);
        }
    }

    /// Reads and writes what `fds` (stdout's, then stdin's, if open) say is ready.
    fn transfer(&mut self, fds: &[libc::pollfd], out: &mut OutputBuf) {
        let mut i = 0;
        if let Some(f) = &mut self.stdout {
            if readable(&fds[i])
                && out
                    .read_from(f, READ_BUDGET)
                    .map_or(true, |st| st == ReadState::Eof)
            {
                self.stdout = None;
            }
            i += 1;
        }
        if let Some(f) = &mut self.stdin
            && fds[i].revents != 0
        {
            // Done, or the command closed its stdin: either way nothing more to write.
            if !matches!(
                write_some(f, &mut self.pending, &mut self.written),
                Ok(false)
            ) {
                self.stdin = None;
            }
        }
    }

    /// After the exit: closes stdin, then takes what stdout holds and closes it.
    fn finish(mut self, out: &mut OutputBuf) {
        drop(self.stdin.take());
        // Everything the command wrote before it exited is in the pipe now: take it without
        // waiting for an end of file that a detached process holding the pipe would withhold.
        if let Some(f) = &mut self.stdout {
            // SAFETY: F_GETPIPE_SZ on a pipe fd we own.
            let size = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GETPIPE_SZ) };
            let budget = usize::try_from(size)
                .unwrap_or(READ_BUDGET)
                .max(READ_BUDGET);
            let _ = out.read_from(f, budget);
        }
    }
}

impl Agent for ExecAgent {
    fn turn(&mut self, input: &TurnInput<'_>, cancel: &CancelToken) -> Result<String, TurnError> {
        self.attached.clear();
        let (exit, out, outbox) = self.run(input, cancel)?;
        let truncated = out.truncated();
        let mut text = String::from_utf8_lossy(&out.into_vec()).into_owned();
        if exit.success() {
            if !truncated && text.ends_with('\n') {
                text.pop();
            }
            if let Some(outbox) = outbox {
                let taken = outbox.take_all();
                text = taken.annotate(text);
                self.attached = taken.files;
            }
            return Ok(text);
        }
        // The chat sees the exit status and what the command printed for it on stdout, never
        // its stderr (that is in the log).
        let text = text.trim();
        if text.is_empty() {
            return Err(TurnError::Failed(exit.to_string().into()));
        }
        let shown = crate::text::prefix(text, ERROR_TEXT_MAX);
        let more = if shown.len() < text.len() { "…" } else { "" };
        Err(TurnError::Failed(format!("{exit}: {shown}{more}").into()))
    }

    fn turn_attachments(&mut self) -> Vec<crate::Attachment> {
        std::mem::take(&mut self.attached)
    }

    fn close(&mut self) -> Result<(), crate::agent::AgentError> {
        for mut c in self.leftovers.drain(..) {
            c.kill();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::Partials;
    use crate::message::MessageContext;
    use std::path::Path;

    fn agent(cmd: &str, max_output_bytes: usize) -> ExecAgent {
        let options = ExecOptions {
            max_output_bytes,
            ..ExecOptions::default()
        };
        ExecAgent::new(&cmd.into(), &Arc::new(options))
    }

    fn with_input<T>(text: &str, f: impl FnOnce(&TurnInput<'_>) -> T) -> T {
        let key = SessionKey::dm("tg", "42").unwrap();
        let context = MessageContext {
            user_id: Some("7".into()),
            user_name: Some("Ann".into()),
            meta: Some(r#"{"reply_to":"m-8"}"#.into()),
            ..MessageContext::default()
        };
        let input = TurnInput {
            session: &key,
            message_id: "m-9",
            text,
            context: &context,
            partials: &Partials::discard(),
        };
        f(&input)
    }

    fn run(cmd: &str, text: &str) -> Result<String, TurnError> {
        with_input(text, |input| {
            agent(cmd, DEFAULT_MAX_REPLY_BYTES).turn(input, &CancelToken::new())
        })
    }

    /// Issue 36 row 3: what the command leaves in `$TURNSTILE_OUTBOX` is attached to the
    /// reply (moved into the spool with its sha256); a failed turn attaches nothing and
    /// leaves nothing behind.
    #[test]
    fn the_files_left_in_the_outbox_are_attached_and_a_failed_turn_leaves_none() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let spool = crate::attachments::open_spool(&tmp.path().join("spool")).expect("spool");
        let options = ExecOptions {
            outbox: crate::AttachmentLimits {
                dir: Some(spool.clone()),
                ..crate::AttachmentLimits::default()
            },
            ..ExecOptions::default()
        };
        let cmd =
            r#"printf hello > "$TURNSTILE_OUTBOX/a.txt"; echo "$TURNSTILE_OUTBOX"; exit $(cat)"#;
        let mut a = ExecAgent::new(&cmd.into(), &Arc::new(options));
        let out = with_input("0", |input| a.turn(input, &CancelToken::new())).expect("reply");
        assert!(
            out.starts_with(&spool.to_string_lossy().into_owned()),
            "{out}"
        );
        assert!(
            !Path::new(&out).exists(),
            "the outbox is removed after the turn"
        );
        let files = a.turn_attachments();
        assert_eq!(files.len(), 1);
        assert_eq!((files[0].name.as_str(), files[0].size), ("a.txt", 5));
        assert_eq!(
            files[0].sha256.as_deref(),
            Some("2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824")
        );
        let path = files[0].path.clone().expect("path");
        assert_eq!(std::fs::read(&path).expect("in the spool"), b"hello");
        assert!(a.turn_attachments().is_empty(), "taken once");
        std::fs::remove_file(path).expect("rm");
        let failed = with_input("3", |input| a.turn(input, &CancelToken::new()));
        assert!(failed.is_err());
        assert!(a.turn_attachments().is_empty());
        let left = std::fs::read_dir(&spool).expect("spool").count();
        assert_eq!(left, 0, "a failed turn's outbox is gone");
    }

    #[test]
    fn stdin_in_stdout_out_with_one_trailing_newline_trimmed() {
        assert_eq!(run("cat; echo", "hi"), Ok("hi".to_owned()));
        assert_eq!(run("printf 'a\\n\\n'", ""), Ok("a\n".to_owned()));
        assert_eq!(run("printf abc", ""), Ok("abc".to_owned()));
    }

    #[test]
    fn a_long_failure_text_is_cut_on_a_character_boundary() {
        // 2047 ASCII bytes, then 'é' (2 bytes) straddling the 2048-byte cut.
        let out = run("printf '%2047s' '' | tr ' ' x; printf 'éyy'; exit 1", "");
        let Err(TurnError::Failed(e)) = out else {
            panic!("{out:?}")
        };
        let text = e
            .message()
            .strip_prefix("exit status 1: ")
            .expect("status first");
        assert_eq!(text, format!("{}…", "x".repeat(2047)));
        let out = run("printf '%2048s' '' | tr ' ' x; exit 1", "");
        assert_eq!(
            out,
            Err(TurnError::Failed(
                format!("exit status 1: {}", "x".repeat(2048)).into()
            ))
        );
    }

    #[test]
    fn a_leftover_that_ends_on_its_own_is_dropped_at_the_next_turn() {
        let dir = std::env::temp_dir().join(format!("turnstile-exec-left-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let fifo = dir.join("release");
        let _ = std::fs::remove_file(&fifo);
        let c = std::ffi::CString::new(fifo.to_string_lossy().as_bytes()).expect("path");
        // SAFETY: mkfifo with a valid C string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let mut a = agent(
            &format!("read x < {} >/dev/null 2>&1 & echo $!", fifo.display()),
            DEFAULT_MAX_REPLY_BYTES,
        );
        let pid: i32 = with_input("", |input| a.turn(input, &CancelToken::new()))
            .expect("reply")
            .parse()
            .expect("pid");
        assert_eq!(a.leftovers.len(), 1);
        // SAFETY: pidfd_open(2) on a process that is blocked on the FIFO, so still alive.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        assert!(fd >= 0);
        std::fs::write(&fifo, "go\n").expect("release the leftover");
        let mut p = libc::pollfd {
            fd: fd as i32,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll on one pollfd; then close the pidfd we opened.
        unsafe {
            assert_eq!(libc::poll(&mut p, 1, 20_000), 1, "the leftover never ended");
            libc::close(fd as i32);
        }
        a.command = "true".into();
        assert_eq!(
            with_input("", |input| a.turn(input, &CancelToken::new())),
            Ok(String::new())
        );
        assert!(a.leftovers.is_empty(), "a finished leftover tree was kept");
        let _ = std::fs::remove_dir_all(&dir);
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
    fn a_nonzero_exit_fails_with_the_status_and_stdout_never_stderr() {
        let out = run("echo one >&2; echo 'api key sk-SECRET123' >&2; exit 3", "");
        assert_eq!(
            out,
            Err(TurnError::Failed("exit status 3".to_owned().into()))
        );
        let out = run("echo 'quota exhausted'; echo sk-SECRET123 >&2; exit 4", "");
        assert_eq!(
            out,
            Err(TurnError::Failed(
                "exit status 4: quota exhausted".to_owned().into()
            ))
        );
        assert_eq!(
            run("kill -TERM $$", ""),
            Err(TurnError::Failed("killed by signal 15".to_owned().into()))
        );
    }

    #[test]
    fn a_command_that_never_reads_stdin_does_not_block_the_turn() {
        let big = "x".repeat(4 << 20);
        assert_eq!(run("echo ignored", &big), Ok("ignored".to_owned()));
    }

    /// §5: a command printing 1 GB drove the gateway's RSS to 1.86 GB. Now at most the cap
    /// (plus 4 bytes) is ever buffered, while all of it is read so the command finishes.
    #[test]
    fn one_gigabyte_of_output_is_read_through_a_bounded_buffer() {
        let cap = 64 * 1024;
        let (exit, out, _) = with_input("", |input| {
            agent("head -c 1000000000 /dev/zero; echo done >&2", cap)
                .run(input, &CancelToken::new())
                .expect("ran")
        });
        assert_eq!(exit, Exit::Code(0));
        assert_eq!(out.total(), 1_000_000_000, "the output was not all drained");
        assert!(out.truncated());
        assert_eq!(out.kept().len(), cap + 4);
        assert!(
            out.buffered() <= cap + 4,
            "{} bytes buffered for a {cap}-byte cap",
            out.buffered()
        );
    }

    /// §5: `echo the-real-answer; setsid sh -c 'sleep 120' &` replied "" because the detached
    /// child held the pipe. What was read before the command exited is the reply.
    #[test]
    fn the_reply_is_what_was_written_before_exit_even_if_a_detached_child_holds_the_pipe() {
        // The detached child writes nothing: a write after the turn ended would meet a closed
        // pipe and die of SIGPIPE, leaving nothing to keep (a race this test once lost).
        let mut a = agent(
            "echo the-real-answer; setsid sh -c 'exec sleep 120' &",
            DEFAULT_MAX_REPLY_BYTES,
        );
        let reply = with_input("", |input| a.turn(input, &CancelToken::new()));
        assert_eq!(reply.expect("a reply"), "the-real-answer");
        assert_eq!(
            a.leftovers.len(),
            1,
            "the detached child is kept for close()"
        );
        let pid = a.leftovers[0].leader_pid();
        a.close().expect("close");
        assert!(a.leftovers.is_empty());
        assert!(
            std::fs::metadata(format!("/proc/{pid}")).is_err()
                || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .is_ok_and(|s| s.contains(") Z ")),
            "the leader outlived close()"
        );
    }

    #[test]
    fn leftovers_are_bounded_per_agent_the_oldest_killed_first() {
        let mut a = agent(
            "sleep 300 >/dev/null 2>&1 & echo $!",
            DEFAULT_MAX_REPLY_BYTES,
        );
        let mut first = None;
        for _ in 0..=MAX_LEFTOVER_TREES {
            let pid: i32 = with_input("", |input| a.turn(input, &CancelToken::new()))
                .expect("reply")
                .parse()
                .expect("pid");
            first.get_or_insert(pid);
        }
        assert_eq!(a.leftovers.len(), MAX_LEFTOVER_TREES);
        let first = first.expect("a first pid");
        let state = std::fs::read_to_string(format!("/proc/{first}/stat")).unwrap_or_default();
        assert!(
            state.is_empty() || state.contains(") Z "),
            "the oldest leftover is still running: {state}"
        );
        a.close().expect("close");
    }

    #[test]
    fn cancellation_kills_the_tree_and_ends_the_turn() {
        let token = CancelToken::new();
        let canceller = {
            let token = token.clone();
            std::thread::spawn(move || token.cancel())
        };
        let out = with_input("", |input| {
            agent("trap '' TERM; sleep 300", DEFAULT_MAX_REPLY_BYTES).turn(input, &token)
        });
        canceller.join().expect("join");
        assert_eq!(out, Err(TurnError::Cancelled));
    }
}
