//! Admission: a message becomes a command's answer, a refusal, or a queued entry of its
//! session (created here, so a refused message never creates a session).

use super::*;
use crate::journal::MemoryUpdate;

impl<R: Clone, A> Core<R, A> {
    /// Admits one message: commands are answered at once; text is refused at a bound or
    /// queued (a held message's turn waits for its release once claimed).
    pub(super) fn submit(
        &mut self,
        now: Duration,
        msg: Message,
        route: R,
        held: bool,
        fx: &mut Vec<Effect<R, A>>,
    ) {
        let Message {
            id,
            session: key,
            body,
            context,
        } = msg;
        if self.shutdown.is_some() {
            self.reject(route, id, key, RejectReason::ShuttingDown, fx);
            return;
        }
        let text = match body {
            Body::Command(cmd) => return self.answer_command(now, route, id, key, cmd, fx),
            Body::Text(text) => text,
        };
        if let Some(reason) = self.refusal(&key, text.len()) {
            self.reject(route, id, key, reason, fx);
            return;
        }
        let slot = self.slot_for(key.clone());
        let entry = Queued {
            id,
            held,
            text,
            context,
            route,
        };
        self.enqueue(now, slot, &key, entry, fx);
    }

    /// A command runs now, between or during turns: accepted as running, then its reply.
    fn answer_command(
        &mut self,
        now: Duration,
        route: R,
        id: Arc<str>,
        key: SessionKey,
        cmd: Command,
        fx: &mut Vec<Effect<R, A>>,
    ) {
        self.stats.messages.accepted += 1;
        let accepted = EventKind::Accepted {
            state: AcceptState::Running,
            position: 0,
        };
        emit(fx, route.clone(), &id, &key, accepted);
        let reply = self.command(now, &key, cmd, fx);
        // `/new` clears the durable conversation in its own outcome's commit.
        let memory = (cmd == Command::Reset).then(|| MemoryUpdate::clear(key.as_str()));
        let reply = Reply::from(reply).remembering(memory);
        let finished = EventKind::Finished(Outcome::Reply(reply));
        emit(fx, route, &id, &key, finished);
    }

    /// The bound a text of `len` bytes for `key` would pass, if any. Checked before a slot
    /// is claimed, so a refused message never creates a session.
    fn refusal(&self, key: &SessionKey, len: usize) -> Option<RejectReason> {
        let waiting = self
            .index
            .get(key)
            .map_or(0, |&slot| self.slots[slot].queue.len());
        if waiting >= self.cfg.queue_cap {
            return Some(RejectReason::QueueFull);
        }
        if self.queued_total >= self.cfg.max_queued_messages
            || self.queued_bytes + len > self.cfg.max_queued_bytes
        {
            return Some(RejectReason::Overloaded);
        }
        None
    }

    /// The session's slot, claimed for it if it holds none.
    fn slot_for(&mut self, key: SessionKey) -> Key {
        if let Some(&slot) = self.index.get(&key) {
            return slot;
        }
        let slot = self.slots.insert(Session {
            key: key.clone(),
            queue: VecDeque::new(),
            turn: None,
            agent: AgentState::Absent,
            waiting_for_worker: false,
        });
        self.index.insert(key, slot);
        slot
    }

    /// Accepts an admitted text into its session's queue, starting the session if it was
    /// idle.
    fn enqueue(
        &mut self,
        now: Duration,
        slot: Key,
        key: &SessionKey,
        entry: Queued<R>,
        fx: &mut Vec<Effect<R, A>>,
    ) {
        let session = &self.slots[slot];
        self.stats.messages.accepted += 1;
        let position = session.queue.len() + usize::from(session.turn.is_some());
        // Not running, not waiting, agent not closing: the session is idle (nothing queued).
        let startable =
            session.turn.is_none() && !session.waiting_for_worker && session.agent_free();
        debug_assert!(!startable || session.queue.is_empty());
        // Dispatch runs after every input and stops only at a head that cannot be claimed:
        // an idle session starts in this very step exactly when nothing waits before it and
        // its kind of turn has room.
        let state = if startable && self.ready.is_empty() && self.can_claim(entry.held) {
            AcceptState::Running
        } else {
            AcceptState::Queued
        };
        let accepted = EventKind::Accepted { state, position };
        emit(fx, entry.route.clone(), &entry.id, key, accepted);
        if self.cfg.busy_mode == BusyMode::Interrupt {
            self.cancel_turn(now, slot, CancelReason::Interrupted, fx);
        }
        // The session is busy from now on: its idle agent is no longer evictable.
        self.park_agent(slot);
        self.queued_total += 1;
        self.queued_bytes += entry.text.len();
        let queue = &mut self.slots[slot].queue;
        if queue.capacity() == 0 {
            // The common case is one message at a time: room for one, not the default four.
            queue.reserve_exact(1);
        }
        queue.push_back(entry);
        if startable {
            self.make_ready(slot);
        }
    }

    pub(super) fn reject(
        &mut self,
        route: R,
        id: Arc<str>,
        key: SessionKey,
        reason: RejectReason,
        fx: &mut Vec<Effect<R, A>>,
    ) {
        self.stats.messages.rejected += 1;
        emit(fx, route, &id, &key, EventKind::Rejected(reason));
    }
}
