//! Agent teardown bookkeeping: every agent leaving service gets a cleanup job that goes
//! through stages, and the core issues jobs to the cleanup pool at a bounded concurrency.
//!
//! ```text
//! AwaitingAgent(turn) ──agent returns──▶ Queued ──issued──▶ Issued ──close() starts──▶ Running
//!        │ (abandoned turn's agent,        (backlog,          (in the pool's      (deadline runs
//!        │  deadline from abandonment)      no deadline)       queue)               from here)
//!        └──────────── deadline ─────────▶ exceeded ◀──────────── deadline ──────────┘
//! ```
//!
//! A queued job never times out: its deadline starts when `close()` starts, so a burst of
//! evictions waits its turn instead of being counted as leaked.

use std::collections::VecDeque;

use super::types::{CleanupContext, CleanupId, CleanupJob, IdMap, TurnId};
use crate::message::SessionKey;

/// Which deadline a timer enforces, so a timer armed for an earlier stage is ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum DeadlineOf {
    /// The abandoned turn must hand its agent back by then.
    AwaitingAgent,
    /// `close()` must return by then.
    Close,
}

#[derive(Debug)]
enum Stage<A> {
    AwaitingAgent(TurnId),
    Queued(A),
    Issued,
    Running,
}

/// A job the core is waiting for.
#[derive(Debug)]
pub(super) struct Pending<A> {
    /// The session whose agent it closes.
    pub session: SessionKey,
    /// Why.
    pub context: CleanupContext,
    stage: Stage<A>,
}

/// Pending cleanup jobs, the backlog not yet issued, and the count of jobs in the pool.
#[derive(Debug)]
pub(super) struct Cleanups<A> {
    pending: IdMap<CleanupId, Pending<A>>,
    backlog: VecDeque<CleanupId>,
    awaiting: IdMap<TurnId, CleanupId>,
    /// Jobs handed to the pool (issued or running).
    in_pool: usize,
    /// Jobs whose `close()` is running.
    running: usize,
    next: u64,
}

impl<A> Default for Cleanups<A> {
    fn default() -> Self {
        Cleanups {
            pending: IdMap::default(),
            backlog: VecDeque::new(),
            awaiting: IdMap::default(),
            in_pool: 0,
            running: 0,
            next: 0,
        }
    }
}

impl<A> Cleanups<A> {
    fn new_id(&mut self) -> CleanupId {
        self.next += 1;
        CleanupId(self.next)
    }

    /// Queues `agent` for closing.
    pub(super) fn enqueue(
        &mut self,
        session: SessionKey,
        context: CleanupContext,
        agent: A,
    ) -> CleanupId {
        let job = self.new_id();
        let stage = Stage::Queued(agent);
        self.pending.insert(
            job,
            Pending {
                session,
                context,
                stage,
            },
        );
        self.backlog.push_back(job);
        job
    }

    /// A job for the agent still held by the abandoned `turn`; it is queued when the turn
    /// hands the agent back.
    pub(super) fn await_agent(&mut self, session: SessionKey, turn: TurnId) -> CleanupId {
        let job = self.new_id();
        let stage = Stage::AwaitingAgent(turn);
        let context = CleanupContext::Abandoned;
        self.pending.insert(
            job,
            Pending {
                session,
                context,
                stage,
            },
        );
        self.awaiting.insert(turn, job);
        job
    }

    /// The abandoned `turn` returned: its job takes `agent` into the backlog. Gives the agent
    /// back when no job waits for it any more (its deadline passed).
    pub(super) fn agent_returned(&mut self, turn: TurnId, agent: A) -> Result<CleanupId, A> {
        let Some(job) = self.awaiting.remove(&turn) else {
            return Err(agent);
        };
        match self.pending.get_mut(&job) {
            Some(p) => {
                debug_assert!(matches!(p.stage, Stage::AwaitingAgent(t) if t == turn));
                p.stage = Stage::Queued(agent);
                self.backlog.push_back(job);
                Ok(job)
            }
            None => Err(agent),
        }
    }

    /// The abandoned `turn` returned without an agent (its creation failed): there is
    /// nothing to close, so its job ends.
    pub(super) fn agent_never_existed(&mut self, turn: TurnId) -> Option<(CleanupId, Pending<A>)> {
        let job = self.awaiting.remove(&turn)?;
        self.pending.remove(&job).map(|p| (job, p))
    }

    /// The next job to hand to the pool, if fewer than `limit` are there already.
    pub(super) fn issue(&mut self, limit: usize) -> Option<CleanupJob<A>> {
        if self.in_pool >= limit {
            return None;
        }
        while let Some(job) = self.backlog.pop_front() {
            let Some(p) = self.pending.get_mut(&job) else {
                continue;
            };
            let Stage::Queued(agent) = std::mem::replace(&mut p.stage, Stage::Issued) else {
                debug_assert!(false, "a backlog entry that is not queued");
                continue;
            };
            self.in_pool += 1;
            return Some(CleanupJob {
                job,
                session: p.session.clone(),
                context: p.context,
                agent,
            });
        }
        None
    }

    /// `close()` started for `job`; true when the core still waits for it (arm its deadline).
    pub(super) fn started(&mut self, job: CleanupId) -> bool {
        match self.pending.get_mut(&job) {
            Some(p) if matches!(p.stage, Stage::Issued) => {
                p.stage = Stage::Running;
                self.running += 1;
                true
            }
            _ => false,
        }
    }

    /// `job` returned; its record, unless it had already been given up on.
    pub(super) fn finish(&mut self, job: CleanupId) -> Option<Pending<A>> {
        let p = self.pending.remove(&job)?;
        self.leave(&p);
        Some(p)
    }

    /// The deadline `of` passed for `job`: its record if it is still at that stage.
    pub(super) fn expire(&mut self, job: CleanupId, of: DeadlineOf) -> Option<Pending<A>> {
        let due = matches!(
            (&self.pending.get(&job)?.stage, of),
            (Stage::AwaitingAgent(_), DeadlineOf::AwaitingAgent)
                | (Stage::Running, DeadlineOf::Close)
        );
        if !due {
            return None;
        }
        let p = self.pending.remove(&job)?;
        self.leave(&p);
        Some(p)
    }

    fn leave(&mut self, p: &Pending<A>) {
        match p.stage {
            Stage::AwaitingAgent(turn) => {
                self.awaiting.remove(&turn);
            }
            Stage::Issued => self.in_pool -= 1,
            Stage::Running => {
                self.in_pool -= 1;
                self.running -= 1;
            }
            Stage::Queued(_) => debug_assert!(false, "a queued job cannot finish"),
        }
    }

    /// Whether the core still waits for `job`.
    pub(super) fn contains(&self, job: CleanupId) -> bool {
        self.pending.contains_key(&job)
    }

    /// Jobs the core waits for, at any stage.
    pub(super) fn len(&self) -> usize {
        self.pending.len()
    }

    /// True when no job is pending.
    pub(super) fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// Jobs waiting for `close()` to start: the backlog plus those in the pool's queue.
    pub(super) fn queued(&self) -> usize {
        self.backlog.len() + self.in_pool - self.running
    }

    /// Jobs not yet handed to the pool.
    pub(super) fn backlog_len(&self) -> usize {
        self.backlog.len()
    }

    /// Jobs in the pool (queued there or running); for the core's invariant checks.
    #[cfg(debug_assertions)]
    pub(super) fn in_pool(&self) -> usize {
        self.in_pool
    }

    /// Recounts what is kept incrementally; for the core's invariant checks.
    #[cfg(debug_assertions)]
    pub(super) fn check(&self) {
        let in_pool = self
            .pending
            .values()
            .filter(|p| matches!(p.stage, Stage::Issued | Stage::Running))
            .count();
        assert_eq!(in_pool, self.in_pool, "jobs in the pool miscounted");
        let running = self
            .pending
            .values()
            .filter(|p| matches!(p.stage, Stage::Running))
            .count();
        assert_eq!(running, self.running, "running jobs miscounted");
        let queued = self
            .pending
            .values()
            .filter(|p| matches!(p.stage, Stage::Queued(_)))
            .count();
        assert_eq!(queued, self.backlog.len(), "backlog out of step");
        for (turn, job) in &self.awaiting {
            assert!(
                matches!(self.pending.get(job), Some(Pending { stage: Stage::AwaitingAgent(t), .. }) if t == turn),
                "awaiting index out of step"
            );
        }
    }
}
