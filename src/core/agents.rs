//! The core's agent mechanics: the idle cache and its recency order, parking an agent
//! while its session waits, retiring and closing agents through the cleanup queue.

use super::*;

impl<R: Clone, A> Core<R, A> {
    pub(super) fn in_cache(&self, slot: Key) -> bool {
        self.agent_seq
            .get(slot.index())
            .is_some_and(|&seq| seq != 0)
    }

    /// Keeps an agent that returned from a turn: evictable if its session is idle, parked
    /// (not evictable) if work waits for it.
    pub(super) fn hold_agent(&mut self, now: Duration, slot: Key, agent: A) {
        let session = &mut self.slots[slot];
        debug_assert!(matches!(session.agent, AgentState::Absent));
        session.agent = AgentState::Held {
            agent,
            idle_since: now,
        };
        if session.is_idle() {
            self.enter_cache(slot);
        } else {
            self.parked_agents += 1;
            if self.cache.live + self.parked_agents > self.cfg.max_cached_agents {
                self.stats.sessions.cache_overflows += 1;
            }
        }
    }

    pub(super) fn enter_cache(&mut self, slot: Key) {
        let lru_seq = self.cache.push(slot);
        if self.agent_seq.len() <= slot.index() {
            self.agent_seq.resize(slot.index() + 1, 0);
        }
        self.agent_seq[slot.index()] = lru_seq;
    }

    pub(super) fn leave_cache(&mut self, slot: Key) {
        self.agent_seq[slot.index()] = 0;
        let live = &self.agent_seq;
        self.cache
            .remove(|seq, slot| live.get(slot.index()) == Some(&seq));
    }

    /// The session got work: its idle agent stops being evictable.
    pub(super) fn park_agent(&mut self, slot: Key) {
        if self.in_cache(slot) {
            self.leave_cache(slot);
            self.parked_agents += 1;
        }
    }

    /// The session became idle without a turn (its queue was cancelled): a parked agent
    /// becomes evictable again.
    pub(super) fn settle_agent(&mut self, slot: Key) {
        let session = &self.slots[slot];
        if matches!(session.agent, AgentState::Held { .. })
            && session.is_idle()
            && !self.in_cache(slot)
        {
            self.parked_agents -= 1;
            self.enter_cache(slot);
        }
    }

    /// Takes a session's held agent (idle or parked), leaving it with none.
    pub(super) fn take_held_agent(&mut self, slot: Key) -> Option<A> {
        let session = &mut self.slots[slot];
        if !matches!(session.agent, AgentState::Held { .. }) {
            return None;
        }
        let AgentState::Held { agent, .. } =
            std::mem::replace(&mut session.agent, AgentState::Absent)
        else {
            return None;
        };
        if self.in_cache(slot) {
            self.leave_cache(slot);
        } else {
            self.parked_agents -= 1;
        }
        Some(agent)
    }

    /// The session's agent is not to serve again: a held one goes to cleanup now, the one
    /// in a running turn when that turn returns.
    pub(super) fn retire_agent(
        &mut self,
        slot: Key,
        context: CleanupContext,
        fx: &mut Vec<Effect<R, A>>,
    ) {
        if let Some(t) = &mut self.slots[slot].turn {
            t.discard_agent = true;
        }
        if matches!(self.slots[slot].agent, AgentState::Held { .. })
            && let Some(agent) = self.take_held_agent(slot)
        {
            self.close_agent(slot, context, agent, fx);
        }
    }

    /// Sends an idle agent to cleanup (sweep, eviction).
    pub(super) fn close_idle_agent(
        &mut self,
        slot: Key,
        context: CleanupContext,
        fx: &mut Vec<Effect<R, A>>,
    ) {
        debug_assert!(
            self.slots[slot].is_idle(),
            "evicting a busy session's agent"
        );
        if let Some(agent) = self.take_held_agent(slot) {
            self.close_agent(slot, context, agent, fx);
        }
    }

    /// Sends a session's agent to cleanup; the session waits for it before its next turn.
    pub(super) fn close_agent(
        &mut self,
        slot: Key,
        context: CleanupContext,
        agent: A,
        fx: &mut Vec<Effect<R, A>>,
    ) {
        let key = self.slots[slot].key.clone();
        debug_assert!(matches!(self.slots[slot].agent, AgentState::Absent));
        let job = self.cleanups.enqueue(key, context, agent);
        self.slots[slot].agent = AgentState::Closing(job);
        self.pump_cleanups(fx);
    }

    /// A cleanup job ended (done, failed, or given up on): if its session waits on it, the
    /// session is free to create its next agent.
    pub(super) fn agent_gone(
        &mut self,
        session: &SessionKey,
        job: CleanupId,
        fx: &mut Vec<Effect<R, A>>,
    ) {
        if let Some(&slot) = self.index.get(session)
            && matches!(self.slots[slot].agent, AgentState::Closing(j) if j == job)
        {
            self.slots[slot].agent = AgentState::Absent;
            let s = &self.slots[slot];
            if s.turn.is_none() && !s.queue.is_empty() {
                self.make_ready(slot);
            } else {
                self.release_if_empty(slot);
            }
        }
        self.pump_cleanups(fx);
        // Evictions and sweeps pause while the backlog is full; room may have freed up.
        self.enforce_cache_cap(fx);
    }

    /// Hands queued cleanup jobs to the pool while it has room.
    pub(super) fn pump_cleanups(&mut self, fx: &mut Vec<Effect<R, A>>) {
        while let Some(job) = self.cleanups.issue(self.cfg.cleanup_concurrency) {
            fx.push(Effect::Cleanup(job));
        }
    }

    /// The slot of the least recently used idle agent.
    pub(super) fn oldest_cached(&mut self) -> Option<Key> {
        let live = &self.agent_seq;
        self.cache
            .oldest(|seq, slot| live.get(slot.index()) == Some(&seq))
    }

    /// Closes least recently used idle agents while the cache is over its cap, pausing while
    /// the cleanup backlog is full.
    pub(super) fn enforce_cache_cap(&mut self, fx: &mut Vec<Effect<R, A>>) {
        while self.cache.live > self.cfg.max_cached_agents
            && self.cleanups.backlog_len() < self.cfg.cleanup_queue_cap
        {
            let Some(slot) = self.oldest_cached() else {
                break;
            };
            self.close_idle_agent(slot, CleanupContext::Eviction, fx);
        }
    }

    pub(super) fn release_if_empty(&mut self, slot: Key) {
        let session = &self.slots[slot];
        if session.holds_nothing() && !session.waiting_for_worker {
            self.index.remove(&session.key);
            self.slots.remove(slot);
        }
    }
}
