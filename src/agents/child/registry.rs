//! The live leaders of this gateway, and what acts on all of them: the sweep of escaped
//! processes (when the gateway is a child subreaper) and [`kill_all`] for forced exits.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock, RwLockReadGuard};
use std::time::Instant;

use super::sys::{cvt, has_exited, pidfd_open, pidfd_signal, reap, wait_exited};
use super::tree::{
    KILL_BUDGET, KILL_ROUNDS, LEADER_WAIT, Proc, ROUND_WAIT, children_of, live_descendants, stat_of,
};

/// A leader: the gateway's own child, unreaped until its tree is dead.
#[derive(Debug)]
pub(super) struct Leader {
    /// Safe to use while `reaped` is held and false.
    pub(super) pid: i32,
    fd: OwnedFd,
    /// Held while the pid is used to walk the tree, and set once the leader is reaped: a walk
    /// never runs on a pid that could have been recycled.
    reaped: Mutex<bool>,
}

impl Leader {
    /// Holds the leader unreaped (or tells it is reaped: true).
    pub(super) fn lock(&self) -> MutexGuard<'_, bool> {
        self.reaped.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Signals every live process of the tree, the leader excepted; returns them.
    pub(super) fn signal_tree(&self, sig: libc::c_int) -> Vec<Proc> {
        let reaped = self.lock();
        if *reaped {
            return Vec::new();
        }
        let procs = live_descendants(self.pid);
        for p in &procs {
            let _ = pidfd_signal(p.fd.as_fd(), sig);
            if sig == libc::SIGTERM {
                // A stopped process would never act on the TERM.
                let _ = pidfd_signal(p.fd.as_fd(), libc::SIGCONT);
            }
        }
        procs
    }

    /// Reaps the leader if it has exited; true once reaped.
    pub(super) fn try_reap(&self) -> bool {
        let mut reaped = self.lock();
        if !*reaped && !matches!(reap(self.fd.as_fd()), Ok(false)) {
            *reaped = true;
            registry().remove(&self.pid);
        }
        *reaped
    }

    /// Kills the leader unless it is reaped already, and reaps it if it exits within
    /// [`LEADER_WAIT`]; true once reaped.
    pub(super) fn kill_and_reap(&self) -> bool {
        if !*self.lock() {
            // Our unreaped child: the signal cannot reach anyone else.
            let _ = pidfd_signal(self.fd.as_fd(), libc::SIGKILL);
        }
        wait_exited(&[self.fd.as_fd()], LEADER_WAIT) && { self.try_reap() }
    }
}

/// Registers the new leader `pid` (its pidfd `fd`): from now on [`kill_all`] reaches its tree
/// and a sweep does not take it for a stray.
pub(super) fn register(pid: i32, fd: OwnedFd) -> Arc<Leader> {
    let leader = Arc::new(Leader {
        pid,
        fd,
        reaped: Mutex::new(false),
    });
    registry().insert(pid, Arc::clone(&leader));
    leader
}

/// Held from before fork until the new leader is [`register`]ed.
pub(super) fn spawning() -> RwLockReadGuard<'static, ()> {
    SPAWNING.read().unwrap_or_else(|e| e.into_inner())
}

/// Leaves killed processes not reaped yet to later sweeps, which reap them once they exit.
pub(super) fn leave_to_sweeps(procs: Vec<Proc>) {
    let mut pending = strays();
    for p in procs {
        pending.entry(p.pid).or_insert(p.fd);
    }
}

fn registry() -> MutexGuard<'static, HashMap<i32, Arc<Leader>>> {
    static LEADERS: OnceLock<Mutex<HashMap<i32, Arc<Leader>>>> = OnceLock::new();
    LEADERS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Held (shared) from fork until the new leader is registered, and (exclusive) by a sweep,
/// so that a sweep never mistakes a leader being born for a stray.
static SPAWNING: RwLock<()> = RwLock::new(());

/// Set by [`become_subreaper`].
static SUBREAPER: AtomicBool = AtomicBool::new(false);

/// Strays killed and not reaped yet, by pid.
fn strays() -> MutexGuard<'static, HashMap<i32, OwnedFd>> {
    static STRAYS: OnceLock<Mutex<HashMap<i32, OwnedFd>>> = OnceLock::new();
    STRAYS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Makes this process a child subreaper: an agent process whose leader died (killed from
/// inside the agent) is re-parented here instead of to init, where [`sweep_strays`] kills it.
///
/// The `turnstile` binary calls this when it runs exec or process agents. An embedding
/// program may call it too, with this consequence: any orphaned descendant of the program is
/// re-parented to it, and the sweep treats every child that is not an agent leader and is in
/// another process group or session than the program as an escaped agent process.
pub(crate) fn become_subreaper() -> io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    cvt(unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) })?;
    SUBREAPER.store(true, Ordering::SeqCst);
    Ok(())
}

/// Kills and reaps escaped agent processes: children of this (subreaper) process that are not
/// agent leaders and are in another process group or session than this process. They arrive
/// here only when an agent killed its own leader. Also reaps leaders that outlived their
/// kill. Does nothing unless [`become_subreaper`] was called. Returns how many were killed.
pub(super) fn sweep_strays() -> usize {
    let mut killed = 0;
    let leaders: Vec<Arc<Leader>> = registry().values().cloned().collect();
    for l in &leaders {
        let _ = l.try_reap();
    }
    if SUBREAPER.load(Ordering::SeqCst) {
        let me = std::process::id() as i32;
        // SAFETY: getpgrp and getsid take no pointers.
        let (pgrp, sid) = unsafe { (libc::getpgrp(), libc::getsid(0)) };
        let found: Vec<Proc> = {
            let _sweep = SPAWNING.write().unwrap_or_else(|e| e.into_inner());
            let leaders = registry();
            children_of("self")
                .into_iter()
                .filter(|pid| !leaders.contains_key(pid))
                .filter_map(|pid| {
                    let fd = pidfd_open(pid).ok()?;
                    let st = stat_of(pid)?;
                    (st.ppid == me && (st.pgrp != pgrp || st.session != sid))
                        .then_some(Proc { pid, fd })
                })
                .collect()
        };
        let mut pending = strays();
        for p in found {
            if !has_exited(p.fd.as_fd()) {
                let _ = pidfd_signal(p.fd.as_fd(), libc::SIGKILL);
                killed += 1;
            }
            pending.entry(p.pid).or_insert(p.fd);
        }
        pending.retain(|_, fd| matches!(reap(fd.as_fd()), Ok(false)));
    }
    if killed > 0 {
        log::warn!(
            "killed {killed} escaped agent process(es) (session unknown: their leader had died)"
        );
    }
    killed
}

/// Kills every agent process this gateway started and everything they started, as far as it
/// can be found: each leader's tree (walked repeatedly until it stops changing, a second at
/// most per round), the leaders, then escaped processes ([`sweep_strays`]). Blocks for a few
/// seconds at most.
///
/// For forced-exit paths (a second signal, the shutdown watchdog): call it before
/// `std::process::exit`, or register it once with [`kill_all_at_exit`] (the `turnstile`
/// binary does). A graceful shutdown does not need it, since closing each agent kills its
/// processes; it is harmless there too.
pub(crate) fn kill_all() {
    let leaders: Vec<Arc<Leader>> = registry().values().cloned().collect();
    let deadline = Instant::now() + KILL_BUDGET;
    for _ in 0..KILL_ROUNDS {
        if Instant::now() >= deadline {
            break;
        }
        let signalled: Vec<Proc> = leaders
            .iter()
            .flat_map(|l| l.signal_tree(libc::SIGKILL))
            .collect();
        if signalled.is_empty() {
            break;
        }
        let fds: Vec<BorrowedFd<'_>> = signalled.iter().map(|p| p.fd.as_fd()).collect();
        wait_exited(
            &fds,
            ROUND_WAIT.min(deadline.saturating_duration_since(Instant::now())),
        );
    }
    for l in &leaders {
        if !*l.lock() {
            let _ = pidfd_signal(l.fd.as_fd(), libc::SIGKILL);
        }
    }
    let fds: Vec<BorrowedFd<'_>> = leaders.iter().map(|l| l.fd.as_fd()).collect();
    wait_exited(&fds, LEADER_WAIT);
    for _ in 0..4 {
        if sweep_strays() == 0 {
            break;
        }
    }
}

/// Runs [`kill_all`] when the process exits through `exit(3)`, which is what
/// `std::process::exit` calls: the forced-exit paths of an embedding program (a second
/// signal, a watchdog) then kill the agents without calling it themselves. Idempotent.
/// `_exit(2)`, a crash or SIGKILL bypass it.
pub(crate) fn kill_all_at_exit() {
    extern "C" fn at_exit() {
        // Unwinding out of an extern "C" function aborts; kill_all does not panic, but a
        // bug in it must not turn an orderly exit into an abort.
        let _ = std::panic::catch_unwind(kill_all);
    }
    static REGISTERED: std::sync::Once = std::sync::Once::new();
    REGISTERED.call_once(|| {
        // SAFETY: atexit with a function that lives as long as the program.
        if unsafe { libc::atexit(at_exit) } != 0 {
            log::warn!("cannot register kill_all at exit: forced exits may leave agent processes");
        }
    });
}
