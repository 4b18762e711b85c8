//! The core's invariants, recomputed from scratch after every input in debug builds of
//! small tables (the module docs of `core` list them).

use super::*;

impl<R: Clone, A> Core<R, A> {
    /// Recomputes every incrementally kept count and checks the invariants in the module
    /// docs. Debug builds only, and only for small tables (tests), since it walks them all.
    pub(super) fn check_invariants(&self) {
        #[cfg(debug_assertions)]
        if self.slots.len() <= 64 {
            self.check_invariants_now();
        }
    }

    #[cfg(debug_assertions)]
    fn check_invariants_now(&self) {
        let (mut queued, mut bytes, mut waiting, mut parked, mut idle) = (0, 0, 0, 0, 0);
        for (slot, s) in self.slots.iter() {
            assert_eq!(self.index.get(&s.key), Some(&slot), "index out of step");
            assert!(!s.holds_nothing() || s.waiting_for_worker, "leaked slot");
            queued += s.queue.len();
            bytes += s.queue.iter().map(|q| q.text.len()).sum::<usize>();
            waiting += usize::from(s.waiting_for_worker);
            assert_eq!(s.turn.is_some(), matches!(s.agent, AgentState::InTurn));
            if s.waiting_for_worker {
                assert!(s.turn.is_none() && !s.queue.is_empty() && s.agent_free());
            }
            if s.turn.is_none() && !s.queue.is_empty() {
                assert!(s.waiting_for_worker || !s.agent_free(), "work unclaimed");
            }
            match &s.agent {
                AgentState::Held { .. } if self.in_cache(slot) => {
                    assert!(s.is_idle(), "a busy session's agent is evictable");
                    idle += 1;
                }
                AgentState::Held { .. } => {
                    assert!(!s.is_idle(), "an idle session's agent is not evictable");
                    parked += 1;
                }
                AgentState::Closing(job) => assert!(self.cleanups.contains(*job)),
                AgentState::Absent | AgentState::InTurn => {
                    assert!(!self.in_cache(slot), "a cache entry without an agent");
                }
            }
        }
        assert_eq!(self.index.len(), self.slots.len());
        let running: IdSet<TurnId> = self
            .slots
            .iter()
            .filter_map(|(_, s)| s.turn.as_ref().map(|t| t.turn))
            .collect();
        assert_eq!(running, self.claimed_turns, "claimed turns out of step");
        let cached = self.agent_seq.iter().filter(|&&seq| seq != 0).count();
        assert_eq!(cached, idle, "a cache stamp without an idle agent");
        assert_eq!(queued, self.queued_total, "queued messages miscounted");
        assert_eq!(bytes, self.queued_bytes, "queued bytes miscounted");
        assert_eq!(waiting, self.waiting_total, "waiting sessions miscounted");
        assert_eq!(parked, self.parked_agents, "parked agents miscounted");
        assert_eq!(idle, self.cache.live, "idle agents miscounted");
        assert!(
            self.held.keys().all(|t| self.claimed_turns.contains(t)),
            "a held turn that is not claimed"
        );
        assert!(self.on_workers() <= self.cfg.turn_workers);
        assert!(self.held.len() <= self.cfg.max_held_turns);
        let released = self.held.values().filter(|h| h.released).count();
        assert_eq!(released, self.released.len(), "released turns miscounted");
        assert!(
            self.released
                .iter()
                .all(|t| self.held.get(t).is_some_and(|h| h.released)),
            "a released turn missing from the held ones"
        );
        // Dispatch ran: a released turn waits only for a worker, and the ready queue's
        // live head only for room of its kind.
        assert!(self.released.is_empty() || self.on_workers() == self.cfg.turn_workers);
        if let Some(&slot) = self.ready.front()
            && let Some(s) = self.slots.get(slot)
            && s.waiting_for_worker
        {
            let held = s.queue.front().is_some_and(|q| q.held);
            assert!(
                !self.can_claim(held),
                "a ready session that could start waits"
            );
        }
        assert!(
            self.returned.is_empty(),
            "an unreleased turn not taken back"
        );
        self.cleanups.check();
        assert!(self.cleanups.in_pool() <= self.cfg.cleanup_concurrency);
    }
}
