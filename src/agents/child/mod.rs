//! Containment of agent processes, shared by the exec and the process agent.
//!
//! Every agent command runs under a **leader**: a `/bin/sh` wrapper that the gateway forks
//! itself (not through `std::process`) with
//! - a clean environment: only an allow-list ([`AgentEnv`]), never the gateway's secrets;
//! - its own process group, and the **child-subreaper** attribute (`PR_SET_CHILD_SUBREAPER`,
//!   which survives `exec`): whatever the command starts, even after `setsid` or a double
//!   fork, is re-parented to the leader rather than to init, so it stays in the leader's tree;
//! - stdin, stdout and stderr on pipes, fd 3 on a private status pipe, and fd 4 on the
//!   gateway's **lifeline**, a pipe whose write end only the gateway holds.
//!
//! The wrapper runs the command (`/bin/sh -c CMD`) in a subshell that writes its exit status
//! on fd 3, holds none of the command's pipes itself, and waits on the lifeline. The gateway
//! decides what happens to the tree: [`ContainedChild::kill`] walks it and kills every
//! process in it, then the leader, then reaps. If the gateway dies, however (SIGKILL, OOM,
//! a panic), the lifeline reads end of file and the leader kills its own tree and exits:
//! nothing an agent started outlives the gateway, and no leader idles for ever.
//!
//! Two rules keep a recycled pid from ever being hit:
//! - the gateway never signals a process group, and never reaps with `waitpid(-1)`;
//! - the leader is the gateway's own child and stays unreaped until its tree is dead, so its
//!   pid cannot be reused while the tree is walked; every other process is signalled through
//!   a pidfd, opened first and then checked to still be the child of a process of the tree.
//!
//! The gateway binary also makes itself a child subreaper ([`become_subreaper`]): if an agent
//! kills its own leader, what the leader held is re-parented to the gateway instead of init,
//! and [`sweep_strays`] kills and reaps it. [`kill_all`] is for forced-exit paths.
//!
//! Linux only (pidfds: Linux 5.4 or later; `/proc/<pid>/task/<tid>/children`).

mod bounded;
mod registry;
mod sys;
#[cfg(test)]
mod tests;
mod tree;

use std::fmt;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) use bounded::{LineBuf, OutputBuf, READ_BUDGET, ReadState, log_stderr};
// The binary's (feature `cli`).
#[cfg_attr(not(feature = "cli"), allow(unused_imports))]
pub(crate) use registry::{become_subreaper, kill_all, kill_all_at_exit};

/// Waits up to `timeout` for `pid` — a child of this process not yet reaped, so its pid
/// cannot have been reused — to exit, without reaping it (through a pidfd, no polling
/// loop). For children outside the agent registry, such as the supervised bridges.
pub(crate) fn wait_child_exit(pid: u32, timeout: Duration) -> io::Result<bool> {
    let pid = i32::try_from(pid).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let fd = sys::pidfd_open(pid)?;
    Ok(wait_exited(&[fd.as_fd()], timeout))
}
pub(crate) use sys::{Wake, poll, pollin, readable, set_nonblocking, write_some};
// The cluster's leash replaces the lifeline (`cluster/leash.rs`); unused in a build without it.
#[allow(unused_imports)]
pub(crate) use sys::install_lifeline;

use registry::{Leader, sweep_strays};
use sys::{ChildFds, ExecArgs, pipe, reap, wait_exited};
use tree::live_descendants;

/// The leader. It keeps the command's pipes on fds 5–7 and runs the command in a subshell
/// that holds nothing but the status pipe (so the command closing its stdout is seen at once)
/// and reports on fd 3 its own pid (a line), then the exit status. The leader itself holds nothing of the command's and
/// blocks reading fd 4, the gateway's lifeline ([`sys::lifeline`]): its write end is only in
/// the gateway, so however the gateway dies (SIGKILL, OOM, a panic) the read ends, and the
/// leader kills every process of its tree (its children, round after round: being a
/// subreaper, it inherits what each killed process had started) and exits. It only ever
/// signals its own unreaped children (builtins only, no fork, so nothing is reaped meanwhile):
/// no recycled pid is hit. It stops after two rounds in a row find no live child: a child
/// that turned zombie during a round may have handed its children over after the list was
/// read. `$1` is the command.
const WRAPPER: &str = r#"exec 5<&0 6>&1 7>&2 0</dev/null 1>/dev/null 2>&1
(read -r me _ </proc/self/stat; echo "$me" >&3
/bin/sh -c "$1" 0<&5 1>&6 2>&7 3>&- 4<&- 5<&- 6>&- 7>&- & exec 4<&- 5<&- 6>&- 7>&-; wait $!; echo $? >&3) &
exec 3>&- 5<&- 6>&- 7>&-
read -r _ <&4
exec 4<&-
n=0; q=0
while [ $n -lt 100000 ]; do
n=$((n+1)); k=; read -r k </proc/$$/task/$$/children; live=
for p in $k; do s=; read -r s </proc/$p/stat && case ${s##*) } in Z*) ;; *) live=1; kill -9 $p;; esac; done
if [ -z "$live" ]; then q=$((q+1)); [ $q -ge 2 ] && exit 0; else q=0; fi
done"#;

/// `PATH` given to agents when the gateway has none.
const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// The longest [`ContainedChild::kill`] (and [`kill_all`]) waits.
pub(crate) const KILL_MAX: Duration = Duration::from_secs(5);

// ---- environment ------------------------------------------------------------------------

/// The environment of agent processes: `PATH` (a default if the gateway has none), `HOME`
/// and `LANG` if set, the names listed with `--agent-env`, and the `TURNSTILE_*` turn
/// variables the agent adds. Nothing else of the gateway's environment is passed on: not
/// `TURNSTILE_AUTH_TOKEN`, not a provider key the operator forgot about.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AgentEnv {
    pass: Vec<String>,
}

impl AgentEnv {
    /// An allow-list passing `names` through from the gateway's environment as well. Names
    /// starting with `TURNSTILE_` are refused: that prefix is the gateway's own (its auth token,
    /// and the turn variables it sets itself).
    pub fn new<I, S>(names: I) -> Result<AgentEnv, String>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut pass = Vec::new();
        for name in names {
            let name = name.into();
            if name.is_empty() || name.contains('=') || name.contains('\0') {
                return Err(format!("--agent-env {name:?}: not a variable name"));
            }
            if name.starts_with("TURNSTILE_") {
                return Err(format!(
                    "--agent-env {name}: TURNSTILE_* variables are the gateway's own and never passed to agents"
                ));
            }
            if !pass.contains(&name) {
                pass.push(name);
            }
        }
        Ok(AgentEnv { pass })
    }

    /// The full environment of one agent process: the allow-list read now, then `vars`.
    pub fn build(&self, vars: &[(&str, &str)]) -> Vec<(String, String)> {
        self.build_from(vars, |name| std::env::var(name).ok())
    }

    /// As [`AgentEnv::build`], reading the gateway's variables through `read` (tests give
    /// an environment of their own instead of setting the process's, which races the other
    /// threads' reads).
    pub(crate) fn build_from(
        &self,
        vars: &[(&str, &str)],
        read: impl Fn(&str) -> Option<String>,
    ) -> Vec<(String, String)> {
        let mut env = Vec::new();
        let path = read("PATH").unwrap_or_else(|| DEFAULT_PATH.to_owned());
        env.push(("PATH".to_owned(), path));
        for name in ["HOME", "LANG"]
            .into_iter()
            .chain(self.pass.iter().map(String::as_str))
        {
            if let Some(v) = read(name)
                && !env.iter().any(|(k, _)| k == name)
            {
                env.push((name.to_owned(), v));
            }
        }
        for (k, v) in vars {
            env.retain(|(name, _)| name != k);
            env.push(((*k).to_owned(), (*v).to_owned()));
        }
        env
    }
}

// ---- the contained child ----------------------------------------------------------------

/// How an agent command ended, as its leader reported it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Exit {
    /// It exited with this status.
    Code(i32),
    /// A signal killed it (the shell reports 128 + the signal number).
    Signal(i32),
    /// Its leader died before reporting: the agent killed it.
    Lost,
}

impl Exit {
    /// Exit status 0.
    pub(crate) fn success(self) -> bool {
        self == Exit::Code(0)
    }
}

impl fmt::Display for Exit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Exit::Code(c) => write!(f, "exit status {c}"),
            Exit::Signal(s) => write!(f, "killed by signal {s}"),
            Exit::Lost => f.write_str("exit status unknown (its supervising shell was killed)"),
        }
    }
}

/// One agent command under its leader. Dropping it kills the whole tree.
#[derive(Debug)]
pub(crate) struct ContainedChild {
    leader: Arc<Leader>,
    /// The command's stdin (blocking; make it non-blocking to write from a poll loop).
    pub stdin: Option<File>,
    /// The command's stdout.
    pub stdout: Option<File>,
    /// The command's stderr.
    pub stderr: Option<File>,
    status: Option<File>,
    status_line: Vec<u8>,
    /// The pid of the status subshell, once it told it (0: it could not): it is not one of
    /// the command's processes. Only compared, never signalled.
    helper: Option<i32>,
    exit: Option<Exit>,
}

impl ContainedChild {
    /// Starts `command` under a new leader with exactly the environment `env`.
    pub(crate) fn spawn(command: &str, env: &[(String, String)]) -> io::Result<ContainedChild> {
        // Everything that allocates is done before fork: the child may only make system calls.
        let args = ExecArgs::new(&["/bin/sh", "-c", WRAPPER, "turnstile-agent", command], env)?;
        let (stdin_r, stdin_w) = pipe()?;
        let (stdout_r, stdout_w) = pipe()?;
        let (stderr_r, stderr_w) = pipe()?;
        let (status_r, status_w) = pipe()?;
        let (error_r, error_w) = pipe()?;
        let fds = ChildFds {
            stdin: stdin_r.as_raw_fd(),
            stdout: stdout_w.as_raw_fd(),
            stderr: stderr_w.as_raw_fd(),
            status: status_w.as_raw_fd(),
            error: error_w.as_raw_fd(),
            lifeline: sys::lifeline()?,
        };

        sweep_strays();
        let spawning = registry::spawning();
        let pid = sys::fork_leader(&fds, &args)?;
        drop((stdin_r, stdout_w, stderr_w, status_w, error_w));
        let fd = sys::confirm_exec(pid, error_r)?;
        let leader = registry::register(pid, fd);
        drop(spawning);
        let status = File::from(status_r);
        set_nonblocking(status.as_fd())?;
        Ok(ContainedChild {
            leader,
            stdin: Some(File::from(stdin_w)),
            stdout: Some(File::from(stdout_r)),
            stderr: Some(File::from(stderr_r)),
            status: Some(status),
            status_line: Vec::new(),
            helper: None,
            exit: None,
        })
    }

    /// The leader's pid (the command runs as its child).
    pub(crate) fn leader_pid(&self) -> i32 {
        self.leader.pid
    }

    /// The fd to poll for the command's exit (readable once the leader reports, or dies);
    /// `None` once the exit is known.
    pub(crate) fn exit_fd(&self) -> Option<RawFd> {
        self.status.as_ref().map(|f| f.as_raw_fd())
    }

    /// The command's exit, if the leader has reported it (never blocks).
    pub(crate) fn try_exit(&mut self) -> Option<Exit> {
        if self.exit.is_some() {
            return self.exit;
        }
        let status = self.status.as_mut()?;
        let mut buf = [0u8; 16];
        let eof = loop {
            match status.read(&mut buf) {
                Ok(0) => break true,
                Ok(n) => {
                    if self.status_line.len() < 64 {
                        self.status_line.extend_from_slice(&buf[..n]);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break false,
            }
        };
        if self.helper.is_none()
            && let Some(end) = self.status_line.iter().position(|&b| b == b'\n')
        {
            let pid = std::str::from_utf8(&self.status_line[..end])
                .ok()
                .and_then(|s| s.trim().parse::<i32>().ok());
            self.helper = Some(pid.unwrap_or(0));
            self.status_line.drain(..=end);
        }
        if self.helper.is_some()
            && let Some(end) = self.status_line.iter().position(|&b| b == b'\n')
        {
            let code = std::str::from_utf8(&self.status_line[..end])
                .ok()
                .and_then(|s| s.trim().parse::<i32>().ok());
            self.exit = Some(match code {
                Some(c @ 129..=192) => Exit::Signal(c - 128),
                Some(c) => Exit::Code(c),
                None => Exit::Lost,
            });
        } else if eof {
            self.exit = Some(Exit::Lost);
        }
        if self.exit.is_some() {
            self.status = None;
        }
        self.exit
    }

    /// Waits up to `timeout` for the command's exit.
    pub(crate) fn wait_exit(&mut self, timeout: Duration) -> Option<Exit> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(exit) = self.try_exit() {
                return Some(exit);
            }
            let fd = self.exit_fd()?;
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            let mut p = [pollin(fd)];
            if poll(&mut p, Some(deadline - now)).is_err() {
                return None;
            }
        }
    }

    /// Whether anything of the tree is still running besides the leader.
    /// The status subshell waiting for the command does not count.
    pub(crate) fn has_descendants(&self) -> bool {
        let reaped = self.leader.lock();
        !*reaped
            && live_descendants(self.leader.pid)
                .iter()
                .any(|p| Some(p.pid) != self.helper)
    }

    /// Sends `sig` to every process of the tree but the leader (SIGCONT follows a SIGTERM);
    /// returns how many were signalled.
    pub(crate) fn signal_descendants(&self, sig: libc::c_int) -> usize {
        self.leader.signal_tree(sig).len()
    }

    /// Waits up to `timeout` for every process of the tree but the leader to be gone.
    ///
    /// One empty walk is not proof: a process that exits while the walk is between its
    /// parent's list and its own is skipped, and its children, re-parented to the leader
    /// after the leader's list was read, are missed. Two walks in a row must find none.
    pub(crate) fn wait_descendants_gone(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut empty_walks = 0;
        loop {
            let procs = {
                let reaped = self.leader.lock();
                if *reaped {
                    return true;
                }
                live_descendants(self.leader.pid)
            };
            if procs.is_empty() {
                empty_walks += 1;
                if empty_walks >= 2 {
                    return true;
                }
                continue;
            }
            empty_walks = 0;
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            let fds: Vec<BorrowedFd<'_>> = procs.iter().map(|p| p.fd.as_fd()).collect();
            wait_exited(&fds, deadline - now);
        }
    }

    /// Kills the whole tree: every process below the leader (round after round, until none is
    /// left), then the leader, which is then reaped, and the processes killed, which come
    /// back to the gateway when the leader dies (if it is a subreaper). Idempotent. Returns
    /// whether everything was seen to die.
    pub(crate) fn kill(&mut self) -> bool {
        self.stdin = None;
        let (killed, clean) = tree::kill_descendants(&self.leader);
        let leader_gone = self.leader.kill_and_reap();
        // The killed processes were the leader's; now they are ours (or init's) to reap.
        let mut unreaped = 0;
        for p in &killed {
            if matches!(reap(p.fd.as_fd()), Ok(false)) {
                unreaped += 1;
            }
        }
        if unreaped > 0 || !leader_gone {
            registry::leave_to_sweeps(killed);
        }
        if self.exit == Some(Exit::Lost) || !leader_gone {
            sweep_strays();
        }
        self.try_exit();
        clean && leader_gone
    }
}

impl Drop for ContainedChild {
    fn drop(&mut self) {
        if !*self.leader.lock() {
            self.kill();
        }
    }
}
