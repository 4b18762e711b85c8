//! The core's turn mechanics: cancelling queues and turns, abandoning a turn, the ready
//! queue, and starting a turn on a free worker.

use super::*;

impl<R: Clone, A> Core<R, A> {
    /// Ends every queued message of a session with `cancelled: reason`; returns how many.
    pub(super) fn cancel_queue(
        &mut self,
        slot: Key,
        reason: CancelReason,
        fx: &mut Vec<Effect<R, A>>,
    ) -> usize {
        let session = &mut self.slots[slot];
        let n = session.queue.len();
        for q in session.queue.drain(..) {
            self.queued_bytes -= q.text.len();
            emit(
                fx,
                q.route,
                &q.id,
                &session.key,
                EventKind::Finished(Outcome::Cancelled(reason)),
            );
        }
        session.free_empty_queue();
        self.queued_total -= n;
        self.stats.messages.queued_cancelled += n as u64;
        n
    }

    /// [`Input::HandOver`]: the sessions' queues end, their turns are cancelled for good
    /// (a turn already cancelling takes the new reason, so that its result is discarded
    /// too), their agents are closed.
    pub(super) fn hand_over(
        &mut self,
        now: Duration,
        keys: Vec<SessionKey>,
        fx: &mut Vec<Effect<R, A>>,
    ) {
        for key in keys {
            let Some(&slot) = self.index.get(&key) else {
                continue;
            };
            self.cancel_queue(slot, CancelReason::HandedOver, fx);
            match self.slots[slot].turn.as_mut() {
                Some(t) if t.cancel.is_some() => t.cancel = Some(CancelReason::HandedOver),
                _ => {
                    self.cancel_turn(now, slot, CancelReason::HandedOver, fx);
                }
            }
            self.unready(slot);
            self.retire_agent(slot, CleanupContext::Reset, fx);
            self.release_if_empty(slot);
        }
    }

    /// Signals a running turn's cancellation and starts its grace period. Returns whether a
    /// turn was running; a turn already cancelling keeps its first reason and deadline.
    pub(super) fn cancel_turn(
        &mut self,
        now: Duration,
        slot: Key,
        reason: CancelReason,
        fx: &mut Vec<Effect<R, A>>,
    ) -> bool {
        let Some(t) = self.slots[slot].turn.as_mut() else {
            return false;
        };
        if t.cancel.is_some() {
            return true;
        }
        t.cancel = Some(reason);
        let turn = t.turn;
        // A held turn never reached a worker: it ends now, with this reason.
        if !self.unhold(turn) {
            fx.push(Effect::CancelTurn(turn));
            self.timers
                .insert(now + self.cfg.stop_grace, Timer::StopGrace { turn, slot });
        }
        true
    }

    /// Gives up on a running turn: its message gets its outcome now; its agent stays with
    /// the stuck worker, and the session waits for it (to be closed when it comes back, or
    /// given up on after `cleanup_timeout`) before any other agent of the session exists.
    pub(super) fn abandon(
        &mut self,
        now: Duration,
        slot: Key,
        reason: AbandonReason,
        fx: &mut Vec<Effect<R, A>>,
    ) {
        let Some(running) = self.slots[slot].turn.take() else {
            return;
        };
        let key = self.slots[slot].key.clone();
        self.claimed_turns.remove(&running.turn);
        self.note_stale_timer();
        self.stats.turns.abandoned += 1;
        // A held turn is on no worker: its job comes back at once, as if its worker returned.
        let on_pool = !self.unhold(running.turn);
        let job = self.cleanups.await_agent(key.clone(), running.turn);
        self.slots[slot].agent = AgentState::Closing(job);
        let of = DeadlineOf::AwaitingAgent;
        self.timers.insert(
            now + self.cfg.cleanup_timeout,
            Timer::CleanupDeadline { job, of },
        );
        if on_pool {
            if reason == AbandonReason::Timeout {
                fx.push(Effect::CancelTurn(running.turn));
            }
            fx.push(Effect::TurnAbandoned {
                turn: running.turn,
                session: key.clone(),
                reason,
            });
        }
        let outcome = match reason {
            _ if running.cancel == Some(CancelReason::HandedOver) => {
                Outcome::Cancelled(CancelReason::HandedOver)
            }
            AbandonReason::Timeout => Outcome::Failed(FailReason::Timeout),
            AbandonReason::IgnoredCancel(r) => Outcome::Cancelled(r),
        };
        end_turn(fx, *running, &key, outcome);
        self.after_turn(slot);
    }

    /// After a turn ends: hand over to the queued work, or give the slot back.
    pub(super) fn after_turn(&mut self, slot: Key) {
        let session = &self.slots[slot];
        if session.queue.is_empty() {
            self.release_if_empty(slot);
        } else if session.agent_free() {
            self.make_ready(slot);
        }
        // Otherwise its agent is closing: the session becomes ready when the close ends.
    }

    pub(super) fn make_ready(&mut self, slot: Key) {
        let session = &mut self.slots[slot];
        debug_assert!(session.agent_free() && session.turn.is_none());
        if !session.waiting_for_worker {
            session.waiting_for_worker = true;
            self.waiting_total += 1;
            self.ready.push_back(slot);
        }
    }

    /// Takes a session out of the ready queue (its entry there goes stale).
    pub(super) fn unready(&mut self, slot: Key) {
        let session = &mut self.slots[slot];
        if session.waiting_for_worker {
            session.waiting_for_worker = false;
            self.waiting_total -= 1;
        }
    }

    /// Starts turns while there is room, in order: released held turns first (they were
    /// claimed earlier and only wait for a worker), then sessions in ready-queue order. The
    /// ready queue's head waits for the room its own kind of turn needs (a worker, or a
    /// place among the held turns), and the sessions behind it wait with it, so that a
    /// session keeps its place whatever kind of message it holds.
    pub(super) fn dispatch(&mut self, now: Duration, fx: &mut Vec<Effect<R, A>>) {
        while self.on_workers() < self.cfg.turn_workers {
            let Some(turn) = self.released.pop_front() else {
                break;
            };
            let held = self.held.remove(&turn);
            debug_assert!(held.as_ref().is_some_and(|h| h.released));
            if let Some(h) = held {
                fx.push(Effect::StartTurn(h.job));
            }
        }
        while let Some(&slot) = self.ready.front() {
            let head_held = match self.slots.get(slot) {
                Some(s) if s.waiting_for_worker => s.queue.front().is_some_and(|q| q.held),
                _ => {
                    // A stale entry: the session was stopped or left the slot.
                    self.ready.pop_front();
                    continue;
                }
            };
            if !self.can_claim(head_held) {
                break;
            }
            self.ready.pop_front();
            let session = &mut self.slots[slot];
            session.waiting_for_worker = false;
            self.waiting_total -= 1;
            debug_assert!(session.turn.is_none() && !session.queue.is_empty());
            self.start_turn(now, slot, fx);
        }
    }

    /// Claimed turns on a worker (or handed to one in this step).
    pub(super) fn on_workers(&self) -> usize {
        debug_assert!(self.held.len() <= self.claimed_turns.len());
        self.claimed_turns.len() - self.held.len()
    }

    /// Whether a turn may be claimed now: a held one needs a place among the held turns, any
    /// other a free worker that no released turn waits for.
    pub(super) fn can_claim(&self, held: bool) -> bool {
        if held {
            self.held.len() < self.cfg.max_held_turns
        } else {
            self.released.is_empty() && self.on_workers() < self.cfg.turn_workers
        }
    }

    pub(super) fn start_turn(&mut self, now: Duration, slot: Key, fx: &mut Vec<Effect<R, A>>) {
        let session = &mut self.slots[slot];
        let Some(head) = session.queue.pop_front() else {
            return;
        };
        self.queued_total -= 1;
        self.queued_bytes -= head.text.len();
        let mut input = head.text;
        if self.cfg.busy_mode == BusyMode::Merge {
            let merged = session.queue.len();
            for q in session.queue.drain(..) {
                self.queued_bytes -= q.text.len();
                input.push('\n');
                input.push_str(&q.text);
                let outcome = Outcome::Merged {
                    into: head.id.clone(),
                };
                emit(
                    fx,
                    q.route,
                    &q.id,
                    &session.key,
                    EventKind::Finished(outcome),
                );
            }
            self.queued_total -= merged;
        }
        session.free_empty_queue();
        let agent = self.take_held_agent(slot);
        let session = &mut self.slots[slot];
        debug_assert!(matches!(session.agent, AgentState::Absent));
        session.agent = AgentState::InTurn;
        self.next_turn += 1;
        let turn = TurnId(self.next_turn);
        emit(
            fx,
            head.route.clone(),
            &head.id,
            &session.key,
            EventKind::TurnStarted(turn),
        );
        let job = TurnJob {
            turn,
            slot,
            session: session.key.clone(),
            message_id: head.id.clone(),
            input,
            context: head.context,
            agent,
        };
        if head.held {
            let held = Held {
                job,
                released: false,
            };
            self.held.insert(turn, held);
        } else {
            fx.push(Effect::StartTurn(job));
        }
        session.turn = Some(Box::new(Running {
            turn,
            id: head.id,
            route: head.route,
            started: now,
            cancel: None,
            discard_agent: false,
        }));
        self.claimed_turns.insert(turn);
        self.timers.insert(
            now + self.cfg.turn_timeout,
            Timer::TurnDeadline { turn, slot },
        );
    }

    // ---- held turns (their start is made durable first) -------------------------------

    /// A held turn may run now: it goes to a worker in this step if one is free, else it
    /// waits (in release order) for the next one, without holding up the other held turns.
    pub(super) fn release(&mut self, turn: TurnId) {
        if let Some(h) = self.held.get_mut(&turn)
            && !h.released
        {
            debug_assert!(self.claimed_turns.contains(&turn));
            h.released = true;
            self.released.push_back(turn);
        }
    }

    /// Held turns that ended before their release come back as a worker's would (cancelled,
    /// never run), after the input that ended them.
    pub(super) fn take_back_unreleased(&mut self, now: Duration, fx: &mut Vec<Effect<R, A>>) {
        while let Some(done) = self.returned.pop_front() {
            self.turn_done(now, done, fx);
        }
    }

    /// A held turn ends before its release: it never reaches a worker; true if it was held.
    pub(super) fn unhold(&mut self, turn: TurnId) -> bool {
        let Some(Held { mut job, released }) = self.held.remove(&turn) else {
            return false;
        };
        if released {
            // Rare (a released turn timed out or was cancelled before a worker was free):
            // the queue is at most `max_held_turns` long.
            self.released.retain(|&t| t != turn);
        }
        let agent = job.agent.take();
        self.returned
            .push_back(job.done(agent, TurnResult::Cancelled));
        true
    }
}
