//! The process agent: one long-lived child process per session, speaking newline-delimited
//! JSON on its stdin and stdout ([`docs/agent-protocol.md`]). This is the agent the cache, the
//! idle TTL, eviction, `/new` and `close()` exist for: a Python SDK, a node tool, anything
//! with expensive start-up or memory plugs in without Rust.
//!
//! The process is contained like every agent command ([`crate::agents::child`]). The factory starts
//! it on a turn worker; `close()` asks it to leave (`close`, then end of stdin), then
//! terminates and kills its tree. A process that dies, or breaks the protocol, fails the
//! running turn; the agent remembers that and starts a fresh process on the session's next
//! turn (the core keeps a failed turn's agent, so one agent object spans the session's
//! processes one after another, never two at once).
//!
//! [`docs/agent-protocol.md`]: https://github.com/turnstile/turnstile/blob/main/docs/agent-protocol.md

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::agent::{Agent, AgentFactory, CancelToken, TurnError, TurnInput};
use crate::agents::child::{
    self, AgentEnv, ContainedChild, Exit, LineBuf, READ_BUDGET, ReadState, pollin, write_some,
};
use crate::message::SessionKey;
use crate::reactor::DEFAULT_MAX_REPLY_BYTES;
use turn::Ended;

mod turn;

/// Default longest line an agent process may write: 4 MiB.
pub(crate) const DEFAULT_MAX_LINE_BYTES: usize = 4 << 20;
/// Default time `close()` gives the process to exit on its own: 10 s.
pub(crate) const DEFAULT_CLOSE_GRACE: Duration = Duration::from_secs(10);
/// Default longest a turn's line may sit unread in the process's stdin: 5 s.
pub(crate) const DEFAULT_STDIN_DRAIN: Duration = Duration::from_secs(5);
/// Default time a cancelled turn waits for the process's answer to `cancel`: the core's
/// default stop grace.
pub(crate) const DEFAULT_STOP_GRACE: Duration = Duration::from_secs(5);
/// Time between SIGTERM and SIGKILL when `close()` has to terminate the process.
pub(crate) const TERM_GRACE: Duration = Duration::from_secs(2);
/// What `close()` adds to the close grace at most: the TERM grace and the kill.
#[cfg_attr(not(feature = "cli"), allow(dead_code))]
pub(crate) const CLOSE_OVERHEAD: Duration =
    Duration::from_secs(TERM_GRACE.as_secs() + child::KILL_MAX.as_secs());

/// Settings of process agents.
#[derive(Clone, Debug)]
pub struct ProcessOptions {
    /// The shell command (`/bin/sh -c`).
    pub command: String,
    /// The environment allow-list.
    pub env: AgentEnv,
    /// Partials are cut to this before they are published (the worker cuts replies).
    pub max_reply_bytes: usize,
    /// A longer stdout line fails the turn and replaces the process.
    pub max_line_bytes: usize,
    /// The core's stop grace: a cancelled turn's process is killed at three quarters of it,
    /// so the turn ends `cancelled` before the core abandons it.
    pub stop_grace: Duration,
    /// How long `close()` waits for the process to exit after `close` and end of stdin,
    /// before SIGTERM, then SIGKILL 2 s later.
    pub close_grace: Duration,
    /// How long a turn's line may sit unread in the process's stdin: past it the process is
    /// taken for stuck, the turn fails and the process is replaced.
    pub stdin_drain: Duration,
    /// The spool and bounds of each turn's outbox (the `turn` line's `outbox`; a `reply`'s
    /// `attachments` name files in it). Without a `dir` a turn gets no outbox.
    pub outbox: crate::AttachmentLimits,
}

impl ProcessOptions {
    /// Defaults for `command`.
    pub fn new(command: &str) -> ProcessOptions {
        ProcessOptions {
            command: command.to_owned(),
            env: AgentEnv::default(),
            max_reply_bytes: DEFAULT_MAX_REPLY_BYTES,
            max_line_bytes: DEFAULT_MAX_LINE_BYTES,
            stop_grace: DEFAULT_STOP_GRACE,
            close_grace: DEFAULT_CLOSE_GRACE,
            stdin_drain: DEFAULT_STDIN_DRAIN,
            outbox: crate::AttachmentLimits::default(),
        }
    }
}

/// The running process and the gateway's ends of its pipes.
struct Live {
    child: ContainedChild,
    /// Non-blocking; `None` once the process closed it.
    stdin: Option<File>,
    pending: Vec<u8>,
    written: usize,
    /// Non-blocking.
    stdout: File,
    lines: LineBuf,
    pid: i32,
    /// It has answered a turn, so its command was running (until then, nothing below the
    /// leader may only mean the leader has not started it yet).
    answered: bool,
}

impl Live {
    fn queue(&mut self, line: &Value) {
        self.pending.extend_from_slice(line.to_string().as_bytes());
        self.pending.push(b'\n');
    }

    /// Writes what the pipe takes now. A closed stdin drops what was pending.
    fn flush(&mut self) {
        if let Some(w) = &mut self.stdin
            && write_some(w, &mut self.pending, &mut self.written).is_err()
        {
            self.stdin = None;
            self.pending.clear();
            self.written = 0;
        }
    }

    fn pollout(&self) -> Option<libc::pollfd> {
        let w = self.stdin.as_ref()?;
        (!self.pending.is_empty()).then(|| libc::pollfd {
            fd: w.as_raw_fd(),
            events: libc::POLLOUT,
            revents: 0,
        })
    }
}

/// One long-lived process per session.
pub struct ProcessAgent {
    options: Arc<ProcessOptions>,
    session: SessionKey,
    live: Option<Live>,
    /// The files the last turn's reply attached, until the worker takes them.
    attached: Vec<crate::Attachment>,
}

impl ProcessAgent {
    /// A factory of process agents: each starts its session's process at once.
    pub fn factory(options: ProcessOptions) -> impl AgentFactory {
        let options = Arc::new(options);
        move |session: &SessionKey| -> Result<Box<dyn Agent>, String> {
            let mut agent = ProcessAgent {
                options: Arc::clone(&options),
                session: session.clone(),
                live: None,
                attached: Vec::new(),
            };
            agent
                .start()
                .map_err(|e| format!("cannot start agent process: {e}"))?;
            Ok(Box::new(agent))
        }
    }

    fn start(&mut self) -> io::Result<()> {
        let s = &self.session;
        let vars = [
            ("TURNSTILE_SESSION", s.as_str()),
            ("TURNSTILE_PLATFORM", s.platform()),
            ("TURNSTILE_CHAT_ID", s.chat_id()),
            ("TURNSTILE_CHAT_TYPE", s.chat_type().as_str()),
            ("TURNSTILE_THREAD_ID", s.thread_id().unwrap_or("")),
            ("TURNSTILE_USER_ID", s.user_id().unwrap_or("")),
        ];
        let env = self.options.env.build(&vars);
        let mut child = ContainedChild::spawn(&self.options.command, &env)?;
        if let Some(stderr) = child.stderr.take() {
            child::log_stderr(stderr, s.clone());
        }
        let stdin = child.stdin.take();
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| io::Error::other("no stdout pipe"))?;
        for fd in stdin.iter().map(|f| f.as_fd()).chain([stdout.as_fd()]) {
            child::set_nonblocking(fd)?;
        }
        let pid = child.leader_pid();
        log::info!("session {s}: started agent process (leader pid {pid})");
        self.live = Some(Live {
            child,
            stdin,
            pending: Vec::new(),
            written: 0,
            stdout,
            lines: LineBuf::new(self.options.max_line_bytes),
            pid,
            answered: false,
        });
        Ok(())
    }

    /// Kills the process tree and forgets it; the next turn starts a fresh one.
    fn discard(&mut self) {
        if let Some(mut live) = self.live.take()
            && !live.child.kill()
        {
            log::warn!(
                "session {}: agent process tree (leader pid {}) did not all exit when killed; left to the reaper",
                self.session,
                live.pid
            );
        }
    }

    /// The running process, started if there is none (or it died since the last turn).
    fn ensure_live(&mut self) -> Result<(), TurnError> {
        if let Some(live) = &mut self.live {
            // Gone if its leader reported, or if nothing runs below the leader any more once
            // it has answered (the leader may not have written the status yet).
            let exit = live.child.try_exit();
            if exit.is_some() || (live.answered && !live.child.has_descendants()) {
                let how = exit.map_or_else(|| "exited".to_owned(), |e| e.to_string());
                log::warn!(
                    "session {}: agent process gone between turns ({how}); starting a fresh one",
                    self.session
                );
                self.discard();
            }
        }
        if self.live.is_none() {
            self.start().map_err(|e| {
                TurnError::Failed(format!("cannot start agent process: {e}").into())
            })?;
        }
        Ok(())
    }

    /// Runs one turn on the live process. `Err`: the process is unusable, to be replaced.
    fn run_turn(
        &mut self,
        input: &TurnInput<'_>,
        cancel: &CancelToken,
    ) -> Result<Result<String, TurnError>, String> {
        let Some(live) = &mut self.live else {
            return Err("no agent process".into());
        };
        let outbox = crate::attachments::Outbox::create(&self.options.outbox)
            .map_err(|e| format!("cannot make the turn's outbox: {e}"))?;
        let dir = outbox.as_ref().map(|o| o.path());
        match turn::run(live, input, dir, cancel, &self.options)? {
            Ended::Answered(Ok(text), files) => {
                let taken = crate::attachments::take_requested(outbox, &files);
                let text = taken.annotate(text);
                self.attached = taken.files;
                Ok(Ok(text))
            }
            Ended::Answered(result, _) => Ok(result),
            Ended::CancelIgnored => {
                log::warn!(
                    "session {}: agent process did not answer cancel within {:?}; killing its process tree",
                    input.session,
                    self.options.stop_grace * 3 / 4
                );
                self.discard();
                Ok(Err(TurnError::Cancelled))
            }
        }
    }
}

impl Agent for ProcessAgent {
    fn turn(&mut self, input: &TurnInput<'_>, cancel: &CancelToken) -> Result<String, TurnError> {
        self.attached.clear();
        self.ensure_live()?;
        match self.run_turn(input, cancel) {
            Ok(result) => result,
            Err(why) => {
                log::warn!(
                    "session {}: turn {} failed: {why}; the agent process is replaced on the next turn",
                    self.session,
                    input.message_id
                );
                self.discard();
                if cancel.is_cancelled() {
                    return Err(TurnError::Cancelled);
                }
                Err(TurnError::Failed(why.into()))
            }
        }
    }

    fn turn_attachments(&mut self) -> Vec<crate::Attachment> {
        std::mem::take(&mut self.attached)
    }

    fn close(&mut self) -> Result<(), crate::agent::AgentError> {
        let Some(live) = &mut self.live else {
            return Ok(());
        };
        let s = &self.session;
        if let Some(exit) = live.child.try_exit() {
            log::warn!("session {s}: agent process had exited before close ({exit})");
            self.discard();
            return Ok(());
        }
        let grace = self.options.close_grace;
        let result = match live.ask_to_leave(grace) {
            Some(e) if e.success() => Ok(()),
            Some(e) => Err(format!("agent process {e} on close")),
            None => Err(live.terminate(s, grace)),
        };
        // Whatever is left of the tree (processes the agent started and left) goes too.
        self.discard();
        result.map_err(Into::into)
    }
}

impl Live {
    /// Sends `close`, then ends stdin, and waits up to `grace` for the process to exit.
    fn ask_to_leave(&mut self, grace: Duration) -> Option<Exit> {
        self.queue(&json!({"op": "close"}));
        let deadline = Instant::now() + grace;
        let mut stdout_open = true;
        while Instant::now() < deadline {
            self.flush();
            if self.pending.is_empty() {
                // End of input: the other way to say close.
                self.stdin = None;
            }
            // Keep reading (and discarding) so a process that writes on its way out never
            // blocks on a full pipe; one pass per iteration, so the deadline holds.
            if stdout_open {
                stdout_open = self.discard_output();
            }
            let exit = self.child.try_exit();
            if exit.is_some() {
                return exit;
            }
            let mut fds = Vec::with_capacity(3);
            if let Some(fd) = self.child.exit_fd() {
                fds.push(pollin(fd));
            }
            if stdout_open {
                fds.push(pollin(self.stdout.as_raw_fd()));
            }
            if let Some(p) = self.pollout() {
                fds.push(p);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let _ = child::poll(&mut fds, Some(left));
        }
        None
    }

    /// One read pass of stdout, its lines dropped; false once there is nothing more to read
    /// (end of file, an error, or an overlong line: the kill ends it if need be).
    fn discard_output(&mut self) -> bool {
        let mut open = match self.lines.read_from(&mut self.stdout, READ_BUDGET) {
            Ok(ReadState::More | ReadState::WouldBlock) => true,
            Ok(ReadState::Eof) | Err(_) => false,
        };
        while let Some(line) = self.lines.next_line() {
            if line.is_err() {
                open = false;
                break;
            }
        }
        open
    }

    /// After `close` went unheeded for `grace`: SIGTERM to the tree, [`TERM_GRACE`] to exit;
    /// the error saying how it ended (the kill follows).
    fn terminate(&mut self, s: &SessionKey, grace: Duration) -> String {
        let n = self.child.signal_descendants(libc::SIGTERM);
        log::warn!(
            "session {s}: agent process did not exit within {grace:?} of close; sent SIGTERM to {n} process(es)"
        );
        let term_deadline = Instant::now() + TERM_GRACE;
        let left = || term_deadline.saturating_duration_since(Instant::now());
        if self.child.wait_exit(left()).is_some() && self.child.wait_descendants_gone(left()) {
            format!("agent process ignored close for {grace:?}; terminated")
        } else {
            format!(
                "agent process ignored close for {grace:?} and SIGTERM for {TERM_GRACE:?}; killed"
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::sync::Mutex;

    use super::turn::{FromAgent, MAX_UNREAD_STDIN};
    use super::*;
    use crate::agent::Partials;
    use crate::message::MessageContext;

    const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/agents/scripted.py");
    const WAIT: Duration = Duration::from_secs(20);

    /// The drain deadline runs from the turn's start, which for a fresh process includes
    /// python3's start-up: on a loaded machine that once took past the default 5 s and
    /// failed a crash test's `pid` turn. Only the drain test waits for that deadline.
    fn options(prefix: &str) -> ProcessOptions {
        ProcessOptions {
            stop_grace: Duration::from_secs(2),
            close_grace: Duration::from_secs(5),
            stdin_drain: WAIT,
            ..ProcessOptions::new(&format!("{prefix} exec python3 {SCRIPT}"))
        }
    }

    fn key() -> SessionKey {
        SessionKey::dm("tg", "42").expect("key")
    }

    fn agent(options: ProcessOptions) -> Box<dyn Agent> {
        ProcessAgent::factory(options)
            .create(&key())
            .expect("the process starts")
    }

    fn turn_with(
        agent: &mut dyn Agent,
        text: &str,
        partials: &Partials,
        cancel: &CancelToken,
    ) -> Result<String, TurnError> {
        let key = key();
        let context = MessageContext {
            user_id: Some("7".into()),
            user_name: Some("Ann".into()),
            meta: Some(r#"{"reply_to":"m-8"}"#.into()),
            ..MessageContext::default()
        };
        let input = TurnInput {
            session: &key,
            message_id: "m-1",
            text,
            context: &context,
            partials,
        };
        agent.turn(&input, cancel)
    }

    fn turn(agent: &mut dyn Agent, text: &str) -> Result<String, TurnError> {
        turn_with(agent, text, &Partials::discard(), &CancelToken::new())
    }

    fn pid(agent: &mut dyn Agent) -> i32 {
        turn(agent, "pid")
            .expect("pid reply")
            .parse()
            .expect("a pid")
    }

    /// A pidfd on a running process, to wait for its exit.
    fn pidfd(pid: i32) -> std::os::fd::OwnedFd {
        use std::os::fd::FromRawFd;
        // SAFETY: pidfd_open(2) with a pid and no flags.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        assert!(fd >= 0, "{pid} is not running");
        // SAFETY: a fresh fd that is ours.
        unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) }
    }

    /// Running, not a zombie.
    fn running(pid: i32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|s| s.rsplit(')').next().is_some_and(|r| !r.starts_with(" Z")))
    }

    /// A FIFO the agent writes "started" to; returns its path and a receiver of that event.
    fn started_fifo(name: &str) -> (String, crossbeam_channel::Receiver<()>) {
        let dir = std::env::temp_dir().join(format!("turnstile-process-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join(name);
        let _ = std::fs::remove_file(&path);
        let c = CString::new(path.to_string_lossy().as_bytes()).expect("path");
        // SAFETY: mkfifo with a valid C string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let (tx, rx) = crossbeam_channel::bounded(1);
        let p = path.clone();
        std::thread::spawn(move || {
            let mut s = String::new();
            if std::fs::File::open(&p)
                .and_then(|mut f| f.read_to_string(&mut s))
                .is_ok()
            {
                let _ = tx.send(());
            }
        });
        (path.to_string_lossy().into_owned(), rx)
    }

    use std::ffi::CString;

    #[test]
    fn one_process_keeps_its_memory_across_turns() {
        let mut a = agent(options(""));
        let p = pid(&mut *a);
        assert_eq!(turn(&mut *a, "remember apples"), Ok("apples".into()));
        assert_eq!(turn(&mut *a, "remember pears"), Ok("apples | pears".into()));
        assert_eq!(pid(&mut *a), p, "the same process serves every turn");
        assert_eq!(a.close(), Ok(()));
        assert!(!running(p), "close() left the process running");
    }

    #[test]
    fn the_turn_line_carries_the_session_sender_and_meta() {
        let mut a = agent(options(""));
        let reply = turn(&mut *a, "context").expect("reply");
        let v: Value = serde_json::from_str(&reply).expect("json");
        assert_eq!(
            v,
            json!({"chat_id": "42", "chat_type": "dm", "meta": {"reply_to": "m-8"},
                   "platform": "tg", "session": "tg:dm:42", "user_id": "7", "user_name": "Ann"})
        );
    }

    #[test]
    fn a_crash_fails_the_turn_with_its_status_and_the_next_turn_gets_a_fresh_process() {
        let mut a = agent(options(""));
        let first = pid(&mut *a);
        assert_eq!(
            turn(&mut *a, "crash 3"),
            Err(TurnError::Failed("agent process exit status 3".into()))
        );
        assert!(!running(first));
        let second = pid(&mut *a);
        assert_ne!(first, second);
        // Exiting between turns is noticed at the next turn, which starts a fresh one.
        let exiting = pidfd(second);
        assert_eq!(turn(&mut *a, "reply-then-exit"), Ok("bye".into()));
        let mut p = libc::pollfd {
            fd: exiting.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll on one pollfd we own.
        assert_eq!(
            unsafe { libc::poll(&mut p, 1, 20_000) },
            1,
            "it never exited"
        );
        let third = pid(&mut *a);
        assert_ne!(third, second);
    }

    #[test]
    fn a_malformed_line_fails_the_turn_clearly_and_replaces_the_process() {
        let mut a = agent(options(""));
        let first = pid(&mut *a);
        match turn(&mut *a, "garbage") {
            Err(TurnError::Failed(e)) => assert!(
                e.message()
                    .starts_with("agent protocol error: not a valid message line"),
                "{e}"
            ),
            other => panic!("{other:?}"),
        }
        assert!(!running(first), "the broken process was not killed");
        assert_ne!(pid(&mut *a), first);
    }

    #[test]
    fn a_flood_without_newline_fails_at_the_line_limit_and_replaces_the_process() {
        let mut a = agent(ProcessOptions {
            max_line_bytes: 100_000,
            ..options("")
        });
        let first = pid(&mut *a);
        assert_eq!(
            turn(&mut *a, "flood 50000000"),
            Err(TurnError::Failed(
                "agent protocol error: the agent wrote a line longer than 100000 bytes".into()
            ))
        );
        assert!(!running(first));
        assert_ne!(pid(&mut *a), first);
    }

    #[test]
    fn an_error_line_is_the_failure_text_and_the_process_stays() {
        let mut a = agent(options(""));
        let first = pid(&mut *a);
        assert_eq!(
            turn(&mut *a, "fail quota exhausted"),
            Err(TurnError::Failed("quota exhausted".into()))
        );
        assert_eq!(pid(&mut *a), first);
    }

    /// Partials that `f` publishes, with `f`'s result.
    fn with_partials<T>(f: impl FnOnce(&Partials) -> T) -> (T, Vec<String>) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&seen);
        let partials = Partials::throttled(Duration::ZERO, move |t| {
            sink.lock().unwrap_or_else(|e| e.into_inner()).push(t)
        });
        let out = f(&partials);
        let seen = seen.lock().unwrap_or_else(|e| e.into_inner()).clone();
        (out, seen)
    }

    #[test]
    fn unknown_ops_and_lines_of_other_turns_are_ignored() {
        let mut a = agent(options(""));
        let (reply, partials) =
            with_partials(|p| turn_with(&mut *a, "unknown", p, &CancelToken::new()));
        assert_eq!(reply, Ok("ok".into()));
        assert!(partials.is_empty(), "{partials:?}");
    }

    #[test]
    fn a_turn_line_larger_than_the_pipe_is_written_as_the_agent_reads_it() {
        let mut a = agent(options(""));
        let text = format!("size {}", "z".repeat(3 << 20));
        assert_eq!(turn(&mut *a, &text), Ok(text.len().to_string()));
    }

    #[test]
    fn a_partial_longer_than_the_reply_cap_is_cut_on_a_character_boundary() {
        let mut a = agent(ProcessOptions {
            max_reply_bytes: 4,
            ..options("")
        });
        // "abcé": the cut at 4 bytes falls inside "é".
        let (reply, partials) =
            with_partials(|p| turn_with(&mut *a, "partial abcé", p, &CancelToken::new()));
        assert_eq!(partials, vec!["abc".to_owned()]);
        // The reply is cut by the worker, not here.
        assert_eq!(reply, Ok("abcé".into()));
    }

    #[test]
    fn partials_are_published_in_order_before_the_reply() {
        let mut a = agent(options(""));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&seen);
        let partials = Partials::throttled(Duration::ZERO, move |t| {
            sink.lock().unwrap_or_else(|e| e.into_inner()).push(t)
        });
        let reply = turn_with(&mut *a, "stream 20", &partials, &CancelToken::new());
        let seen = seen.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let expected: Vec<String> = (1..=20)
            .map(|n| (0..n).map(|i| i.to_string()).collect::<Vec<_>>().join(" "))
            .collect();
        assert_eq!(seen, expected);
        assert_eq!(reply, Ok(expected[19].clone()));
    }

    #[test]
    fn a_cancel_the_agent_answers_ends_the_turn_and_keeps_the_process() {
        let mut a = agent(options(""));
        let first = pid(&mut *a);
        let (fifo, started) = started_fifo("honour");
        let cancel = CancelToken::new();
        let canceller = {
            let cancel = cancel.clone();
            std::thread::spawn(move || {
                let _ = started.recv_timeout(WAIT);
                cancel.cancel();
            })
        };
        let out = turn_with(
            &mut *a,
            &format!("honour-cancel {fifo}"),
            &Partials::discard(),
            &cancel,
        );
        canceller.join().expect("join");
        assert_eq!(out, Err(TurnError::Cancelled));
        assert_eq!(pid(&mut *a), first, "a cooperative agent is kept");
    }

    #[test]
    fn a_cancel_the_agent_ignores_kills_its_tree_and_the_next_turn_gets_a_fresh_process() {
        let mut a = agent(ProcessOptions {
            stop_grace: Duration::from_millis(400),
            ..options("")
        });
        let first = pid(&mut *a);
        let (fifo, started) = started_fifo("ignore");
        let cancel = CancelToken::new();
        let canceller = {
            let cancel = cancel.clone();
            std::thread::spawn(move || {
                let _ = started.recv_timeout(WAIT);
                cancel.cancel();
            })
        };
        let out = turn_with(
            &mut *a,
            &format!("ignore-cancel {fifo}"),
            &Partials::discard(),
            &cancel,
        );
        canceller.join().expect("join");
        assert_eq!(out, Err(TurnError::Cancelled));
        assert!(
            !running(first),
            "the process ignoring cancel was not killed"
        );
        assert_ne!(pid(&mut *a), first);
    }

    #[test]
    fn close_kills_what_the_agent_started_even_in_a_session_of_its_own() {
        let mut a = agent(options(""));
        let reply = turn(&mut *a, "detach").expect("reply");
        let pids: Vec<i32> = reply.split(' ').map(|p| p.parse().expect("pid")).collect();
        assert!(pids.iter().all(|&p| running(p)));
        assert_eq!(a.close(), Ok(()));
        for p in pids {
            assert!(!running(p), "{p} survived close()");
        }
    }

    #[test]
    fn close_terminates_an_agent_that_ignores_close_and_kills_one_that_ignores_sigterm() {
        let mut a = agent(ProcessOptions {
            close_grace: Duration::from_millis(200),
            ..options("SCRIPTED_IGNORE_CLOSE=1")
        });
        let p = pid(&mut *a);
        let e = a.close().expect_err("ignored close");
        assert!(e.message().ends_with("terminated"), "{e}");
        assert!(!running(p));

        let mut a = agent(ProcessOptions {
            close_grace: Duration::from_millis(200),
            ..options("SCRIPTED_IGNORE_CLOSE=1 SCRIPTED_IGNORE_TERM=1")
        });
        let p = pid(&mut *a);
        let e = a.close().expect_err("ignored close and TERM");
        assert!(e.message().ends_with("killed"), "{e}");
        assert!(!running(p));
    }

    #[test]
    fn an_agent_that_never_reads_its_stdin_is_replaced_before_the_backlog_grows_unbounded() {
        // Five replies written up front (the tests' message id is always m-1), stdin never read.
        let mut a = agent(ProcessOptions {
            stdin_drain: WAIT, // the backlog's bound is the subject, not the drain deadline
            ..ProcessOptions::new(
                r#"for i in 1 2 3 4 5; do echo '{"op":"reply","id":"m-1","text":"x"}'; done; exec sleep 300"#,
            )
        });
        let big = "y".repeat(6 << 20);
        assert_eq!(turn(&mut *a, &big), Ok("x".into()));
        assert_eq!(turn(&mut *a, &big), Ok("x".into()));
        assert_eq!(
            turn(&mut *a, &big),
            Err(TurnError::Failed(
                format!(
                    "the agent process left more than {MAX_UNREAD_STDIN} bytes of its stdin unread"
                )
                .into()
            ))
        );
    }

    /// Runs `f` on a thread; its result, or a panic if it has not returned within [`WAIT`]
    /// (on main, the broken agents below held their turn for ever).
    fn within_wait<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = crossbeam_channel::bounded(1);
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(WAIT)
            .expect("the turn was held: the broken agent did not fail it")
    }

    /// Issue 18 row 9: a process that closes its stdout but lives on fails the turn at once,
    /// while it still runs (it would sleep 300 s), and is replaced.
    #[test]
    fn an_agent_that_closes_its_stdout_and_lives_on_fails_the_turn_at_once() {
        let (out, leader) = within_wait(|| {
            let mut a = ProcessAgent {
                options: Arc::new(ProcessOptions::new(
                    "read -r line; exec 1>&-; exec sleep 300",
                )),
                attached: Vec::new(),
                session: key(),
                live: None,
            };
            a.start().expect("started");
            let leader = pidfd(a.live.as_ref().expect("live").pid);
            (turn(&mut a, "hi"), leader)
        });
        assert_eq!(
            out,
            Err(TurnError::Failed(
                "the agent process closed its stdout while still running".into()
            ))
        );
        let mut p = libc::pollfd {
            fd: leader.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll on one pollfd we own.
        assert_eq!(unsafe { libc::poll(&mut p, 1, 20_000) }, 1, "not replaced");
    }

    /// Issue 18 row 9: a process that never reads its stdin fails the turn once the turn's
    /// line has sat unread for `stdin_drain`; one that closed its stdin fails it at once.
    #[test]
    fn an_agent_that_never_reads_its_stdin_fails_the_turn_at_the_drain_deadline() {
        let out = within_wait(|| {
            let mut a = agent(ProcessOptions {
                stdin_drain: Duration::from_millis(300),
                ..ProcessOptions::new("exec sleep 300")
            });
            turn(&mut *a, "hi")
        });
        assert_eq!(
            out,
            Err(TurnError::Failed(
                "the agent process did not read its stdin within 300ms".into()
            ))
        );
        let out = within_wait(|| {
            let mut a = agent(ProcessOptions::new("exec 0<&-; exec sleep 300"));
            turn(&mut *a, &"x".repeat(1 << 20))
        });
        assert_eq!(
            out,
            Err(TurnError::Failed(
                "the agent process closed its stdin".into()
            ))
        );
    }

    /// Issue 18 row 9: a process flooding its stdout and ignoring `cancel` is still killed at
    /// the kill deadline (on main the flood kept the loop from ever checking it).
    #[test]
    fn a_flooding_agent_that_ignores_cancel_is_killed_at_the_deadline() {
        let (fifo, started) = started_fifo("flood");
        let out = within_wait(move || {
            let mut a = agent(ProcessOptions {
                stop_grace: Duration::from_millis(400),
                ..ProcessOptions::new(&format!(
                    r#"read -r line; echo go > {fifo}; exec yes '{{"op":"noise"}}'"#
                ))
            });
            let cancel = CancelToken::new();
            let canceller = {
                let cancel = cancel.clone();
                std::thread::spawn(move || {
                    let _ = started.recv_timeout(WAIT);
                    cancel.cancel();
                })
            };
            let out = turn_with(&mut *a, "flood", &Partials::discard(), &cancel);
            canceller.join().expect("join");
            out
        });
        assert_eq!(out, Err(TurnError::Cancelled));
    }

    #[test]
    fn agent_lines_parse_by_op_and_unknown_ops_are_tolerated() {
        let parse = |s: &str| serde_json::from_str::<FromAgent>(s);
        assert_eq!(
            parse(r#"{"op":"reply","id":"1","text":"t","extra":1}"#).ok(),
            Some(FromAgent::Reply {
                id: "1".into(),
                text: "t".into(),
                attachments: Vec::new(),
            })
        );
        assert_eq!(
            parse(r#"{"op":"progress","pct":50}"#).ok(),
            Some(FromAgent::Unknown)
        );
        assert!(parse(r#"{"op":"reply","id":"1"}"#).is_err());
        assert!(parse(r#"{"id":"1"}"#).is_err());
        assert!(parse("[]").is_err());
    }
}
