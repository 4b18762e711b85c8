//! What a bridge sends to a rate-limited chat platform, and in which order.
//!
//! A streamed reply produces far more edits than a platform lets a bot send (Synapse's
//! default: 0.2 messages a second after a burst of 10), and a naive FIFO makes a `/stop`'s
//! answer wait behind stale edits. [`EditQueue`] keeps two classes:
//!
//! - **urgent** items — terminal results and command answers — never dropped, always sent
//!   before any edit, one queue per chat served in turn ([`FairQueue`]): one chat's burst of
//!   results does not hold another chat's first one;
//! - **edits** — at most **one pending edit per message** (a newer one replaces the older
//!   text in place), at most `max_edits` messages with a pending edit in all (past that the
//!   oldest pending edit is dropped: edits are best effort, the final carries the whole text);
//!   the chats take turns too, so one chat's many streaming replies do not hold another
//!   chat's first line (on Matrix a reply's first line is its first edit).
//!
//! Rate-limit strikes ([`EditQueue::rate_limited`]) are counted over a window; after
//! `strike_limit` of them the queue goes **final-only**: pending edits are dropped, new ones
//! are refused, and only urgent items go out until a whole window passes without a strike.
//!
//! The queue is pure bookkeeping (no I/O, the clock passed in), so its rules are unit-tested
//! without a server; the platform module decides what an item means on the wire.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::fair::FairQueue;

/// Tunables of an [`EditQueue`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct EditLimits {
    /// Messages that may have a pending edit at once.
    pub max_edits: usize,
    /// Rate-limit answers within `strike_window` that switch to final-only.
    pub strike_limit: usize,
    /// How long a strike counts; also how long final-only lasts after the last strike.
    pub strike_window: Duration,
    /// The longest wait a platform's `retry_after` is allowed to impose at once.
    pub max_retry_after: Duration,
}

impl Default for EditLimits {
    fn default() -> EditLimits {
        EditLimits {
            max_edits: 256,
            strike_limit: 3,
            strike_window: Duration::from_secs(60),
            max_retry_after: Duration::from_secs(60),
        }
    }
}

/// What [`EditQueue::push_edit`] did with an edit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EditPushed {
    /// Queued behind the other messages' edits.
    Queued,
    /// Replaced this message's older pending edit (which is not sent).
    Replaced,
    /// Queued, and the oldest other message's pending edit was dropped to stay in bounds.
    QueuedDroppedOldest,
    /// Refused: the queue is final-only after repeated rate-limit strikes.
    FinalOnly,
}

/// The next item to send.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Next<K, U, E> {
    /// A result or command answer.
    Urgent(U),
    /// The newest pending edit of message `K`.
    Edit(K, E),
}

/// A message's newest edit not sent yet, and the chat it is in.
#[derive(Debug)]
struct PendingEdit<K, E> {
    key: K,
    chat: String,
    edit: E,
}

/// Urgent items first, then at most one pending edit per message; see the module docs.
#[derive(Debug)]
pub(crate) struct EditQueue<K, U, E> {
    limits: EditLimits,
    urgent: FairQueue<U>,
    /// Pending edits, oldest first.
    edits: VecDeque<PendingEdit<K, E>>,
    /// Chats with a pending edit, in the order their turn comes.
    edit_round: VecDeque<String>,
    strikes: VecDeque<Instant>,
    blocked_until: Option<Instant>,
    dropped_edits: u64,
}

impl<K: PartialEq, U, E> EditQueue<K, U, E> {
    /// An empty queue.
    pub(crate) fn new(limits: EditLimits) -> EditQueue<K, U, E> {
        EditQueue {
            limits: EditLimits {
                max_edits: limits.max_edits.max(1),
                strike_limit: limits.strike_limit.max(1),
                ..limits
            },
            urgent: FairQueue::default(),
            edits: VecDeque::new(),
            edit_round: VecDeque::new(),
            strikes: VecDeque::new(),
            blocked_until: None,
            dropped_edits: 0,
        }
    }

    /// Queues a result or command answer behind chat `chat`'s other urgent items.
    pub(crate) fn push_urgent(&mut self, chat: &str, item: U) {
        self.urgent.push(chat, item);
    }

    /// Puts an urgent item that could not be sent back at the head, so order is kept.
    pub(crate) fn requeue_urgent(&mut self, chat: &str, item: U) {
        self.urgent.push_front(chat, item);
    }

    /// Puts the rest of an urgent item sent in parts first among its chat's items; the
    /// other chats' turns come in between.
    pub(crate) fn continue_urgent(&mut self, chat: &str, item: U) {
        self.urgent.push_next(chat, item);
    }

    /// Queues `edit` as message `key`'s (in chat `chat`) newest pending edit; see
    /// [`EditPushed`].
    pub(crate) fn push_edit(&mut self, chat: &str, key: K, edit: E, now: Instant) -> EditPushed {
        if self.final_only(now) {
            self.dropped_edits += 1;
            return EditPushed::FinalOnly;
        }
        if let Some(slot) = self.edits.iter_mut().find(|p| p.key == key) {
            slot.edit = edit;
            self.dropped_edits += 1;
            return EditPushed::Replaced;
        }
        let mut pushed = EditPushed::Queued;
        if self.edits.len() >= self.limits.max_edits
            && let Some(oldest) = self.edits.pop_front()
        {
            self.leave_round_if_done(&oldest.chat);
            self.dropped_edits += 1;
            pushed = EditPushed::QueuedDroppedOldest;
        }
        if !self.edit_round.iter().any(|c| c == chat) {
            self.edit_round.push_back(chat.to_owned());
        }
        self.edits.push_back(PendingEdit {
            key,
            chat: chat.to_owned(),
            edit,
        });
        self.debug_check_round();
        pushed
    }

    /// Puts back an edit that could not be sent, unless a newer one for `key` is waiting; its
    /// chat's turn comes first again.
    pub(crate) fn requeue_edit(&mut self, chat: &str, key: K, edit: E, now: Instant) {
        if self.final_only(now) || self.edits.iter().any(|p| p.key == key) {
            self.dropped_edits += 1;
            return;
        }
        if self.edits.len() >= self.limits.max_edits {
            self.dropped_edits += 1;
            return;
        }
        self.edit_round.retain(|c| c != chat);
        self.edit_round.push_front(chat.to_owned());
        self.edits.push_front(PendingEdit {
            key,
            chat: chat.to_owned(),
            edit,
        });
        self.debug_check_round();
    }

    /// Drops message `key`'s pending edit (its final has come, or it was stopped).
    pub(crate) fn cancel_edit(&mut self, key: &K) -> Option<E> {
        let at = self.edits.iter().position(|p| p.key == *key)?;
        let pending = self.edits.remove(at)?;
        self.leave_round_if_done(&pending.chat);
        Some(pending.edit)
    }

    /// The oldest pending edit of the chat whose turn it is; the chat's turn goes to the end
    /// of the round if it has more.
    fn pop_edit_in_turn(&mut self) -> Option<(K, E)> {
        let chat = self.edit_round.pop_front()?;
        let at = self.edits.iter().position(|p| p.chat == chat)?;
        let pending = self.edits.remove(at)?;
        if self.edits.iter().any(|p| p.chat == chat) {
            self.edit_round.push_back(chat);
        }
        self.debug_check_round();
        Some((pending.key, pending.edit))
    }

    /// Takes `chat` out of the round when none of its edits waits any more.
    fn leave_round_if_done(&mut self, chat: &str) {
        if !self.edits.iter().any(|p| p.chat == chat) {
            self.edit_round.retain(|c| c != chat);
        }
    }

    /// The round names each chat with a pending edit once, and no other.
    fn debug_check_round(&self) {
        debug_assert!(
            self.edits
                .iter()
                .all(|p| self.edit_round.iter().filter(|c| **c == p.chat).count() == 1)
                && self
                    .edit_round
                    .iter()
                    .all(|c| self.edits.iter().any(|p| p.chat == *c))
        );
    }

    /// The next item to send: urgent ones first. `None` when empty or while a rate limit's
    /// wait lasts ([`EditQueue::ready_at`] says until when).
    pub(crate) fn next(&mut self, now: Instant) -> Option<Next<K, U, E>> {
        if self.blocked_until.is_some_and(|t| now < t) {
            return None;
        }
        self.blocked_until = None;
        if let Some(u) = self.urgent.pop() {
            return Some(Next::Urgent(u));
        }
        if self.final_only(now) {
            self.drop_edits();
            return None;
        }
        self.pop_edit_in_turn().map(|(k, e)| Next::Edit(k, e))
    }

    /// Holds everything back for `wait` (a back-off after a failed send), without a strike.
    pub(crate) fn pause(&mut self, wait: Duration, now: Instant) {
        let until = now + wait.min(self.limits.max_retry_after);
        self.blocked_until = Some(self.blocked_until.map_or(until, |t| t.max(until)));
    }

    /// When the current rate-limit wait ends, if one lasts.
    pub(crate) fn ready_at(&self, now: Instant) -> Option<Instant> {
        self.blocked_until.filter(|t| now < *t)
    }

    /// Records a rate-limit answer asking to wait `retry_after` (capped): nothing is handed
    /// out before it passes, and enough strikes make the queue final-only (pending edits
    /// dropped). Returns whether the queue is final-only now.
    pub(crate) fn rate_limited(&mut self, retry_after: Duration, now: Instant) -> bool {
        let wait = retry_after.min(self.limits.max_retry_after);
        self.blocked_until = Some(now + wait);
        self.expire_strikes(now);
        self.strikes.push_back(now);
        // The strikes themselves are bounded: only the last `strike_limit` matter.
        while self.strikes.len() > self.limits.strike_limit {
            self.strikes.pop_front();
        }
        let final_only = self.final_only(now);
        if final_only {
            self.drop_edits();
        }
        final_only
    }

    /// Whether only urgent items go out: `strike_limit` strikes, the last one less than a
    /// window ago.
    pub(crate) fn final_only(&self, now: Instant) -> bool {
        self.strikes.len() >= self.limits.strike_limit
            && self
                .strikes
                .back()
                .is_some_and(|last| now.duration_since(*last) < self.limits.strike_window)
    }

    /// Urgent items waiting.
    pub(crate) fn urgent_len(&self) -> usize {
        self.urgent.len()
    }

    /// Messages with a pending edit.
    #[cfg(test)]
    pub(crate) fn edits_len(&self) -> usize {
        self.edits.len()
    }

    /// Edits never sent (replaced, dropped at the bound or while final-only), since the start.
    #[cfg(test)]
    pub(crate) fn dropped_edits(&self) -> u64 {
        self.dropped_edits
    }

    /// Whether nothing at all waits.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.urgent.is_empty() && self.edits.is_empty()
    }

    fn drop_edits(&mut self) {
        self.dropped_edits += self.edits.len() as u64;
        self.edits.clear();
        self.edit_round.clear();
    }

    fn expire_strikes(&mut self, now: Instant) {
        let window = self.limits.strike_window;
        while self
            .strikes
            .front()
            .is_some_and(|t| now.duration_since(*t) >= window)
        {
            self.strikes.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Q = EditQueue<&'static str, &'static str, &'static str>;

    fn queue() -> Q {
        EditQueue::new(EditLimits {
            max_edits: 3,
            strike_limit: 3,
            strike_window: Duration::from_secs(60),
            max_retry_after: Duration::from_secs(30),
        })
    }

    fn drain(q: &mut Q, now: Instant) -> Vec<Next<&'static str, &'static str, &'static str>> {
        std::iter::from_fn(|| q.next(now)).collect()
    }

    #[test]
    fn only_the_newest_edit_of_a_message_is_kept_in_its_place() {
        let now = Instant::now();
        let mut q = queue();
        assert_eq!(q.push_edit("a", "a", "a1", now), EditPushed::Queued);
        assert_eq!(q.push_edit("b", "b", "b1", now), EditPushed::Queued);
        assert_eq!(q.push_edit("a", "a", "a2", now), EditPushed::Replaced);
        assert_eq!(q.push_edit("a", "a", "a3", now), EditPushed::Replaced);
        assert_eq!(
            drain(&mut q, now),
            vec![Next::Edit("a", "a3"), Next::Edit("b", "b1")]
        );
        assert_eq!(q.dropped_edits(), 2);
    }

    #[test]
    fn results_and_command_answers_go_before_stale_edits() {
        let now = Instant::now();
        let mut q = queue();
        q.push_edit("a", "a", "a1", now);
        q.push_edit("b", "b", "b1", now);
        q.push_urgent("c", "stop answer");
        q.push_urgent("c", "final of c");
        assert_eq!(
            drain(&mut q, now),
            vec![
                Next::Urgent("stop answer"),
                Next::Urgent("final of c"),
                Next::Edit("a", "a1"),
                Next::Edit("b", "b1"),
            ]
        );
    }

    #[test]
    fn a_429_holds_everything_back_until_retry_after_and_keeps_order() {
        let t0 = Instant::now();
        let mut q = queue();
        q.push_urgent("c", "r1");
        q.push_urgent("c", "r2");
        let Some(Next::Urgent(first)) = q.next(t0) else {
            panic!("urgent first")
        };
        // The send was refused: back at the head, and a wait of 2 s.
        q.requeue_urgent("c", first);
        assert!(!q.rate_limited(Duration::from_secs(2), t0));
        assert_eq!(q.next(t0 + Duration::from_millis(1999)), None);
        assert_eq!(q.ready_at(t0), Some(t0 + Duration::from_secs(2)));
        let later = t0 + Duration::from_secs(2);
        assert_eq!(q.ready_at(later), None);
        assert_eq!(
            drain(&mut q, later),
            vec![Next::Urgent("r1"), Next::Urgent("r2")]
        );
    }

    #[test]
    fn retry_after_is_capped() {
        let t0 = Instant::now();
        let mut q = queue();
        q.rate_limited(Duration::from_secs(3600), t0);
        assert_eq!(q.ready_at(t0), Some(t0 + Duration::from_secs(30)));
    }

    #[test]
    fn a_refused_edit_comes_back_only_if_nothing_newer_waits() {
        let now = Instant::now();
        let mut q = queue();
        q.push_edit("a", "a", "a1", now);
        let Some(Next::Edit(k, e)) = q.next(now) else {
            panic!("edit")
        };
        q.push_edit("a", "a", "a2", now); // arrived while a1 was on the wire
        q.requeue_edit(k, k, e, now);
        assert_eq!(drain(&mut q, now), vec![Next::Edit("a", "a2")]);
        q.requeue_edit("b", "b", "b1", now);
        assert_eq!(drain(&mut q, now), vec![Next::Edit("b", "b1")]);
    }

    #[test]
    fn repeated_strikes_stop_editing_and_send_only_finals() {
        let t0 = Instant::now();
        let mut q = queue();
        q.push_edit("a", "a", "a1", t0);
        q.push_urgent("b", "final b");
        let s = Duration::from_secs(1);
        assert!(!q.rate_limited(s, t0));
        assert!(!q.rate_limited(s, t0 + s));
        assert!(q.rate_limited(s, t0 + 2 * s), "third strike: final-only");
        assert_eq!(q.edits_len(), 0, "pending edits dropped");
        let t = t0 + 3 * s;
        assert_eq!(q.push_edit("a", "a", "a2", t), EditPushed::FinalOnly);
        q.requeue_edit("a", "a", "a3", t);
        q.push_urgent("a", "final a");
        assert_eq!(
            drain(&mut q, t),
            vec![Next::Urgent("final b"), Next::Urgent("final a")]
        );
        // A whole window without a strike: edits again.
        let calm = t0 + 2 * s + Duration::from_secs(60);
        assert!(!q.final_only(calm));
        assert_eq!(q.push_edit("c", "c", "c1", calm), EditPushed::Queued);
        assert_eq!(drain(&mut q, calm), vec![Next::Edit("c", "c1")]);
    }

    #[test]
    fn strikes_a_window_apart_do_not_add_up() {
        let t0 = Instant::now();
        let mut q = queue();
        let w = Duration::from_secs(61);
        assert!(!q.rate_limited(Duration::ZERO, t0));
        assert!(!q.rate_limited(Duration::ZERO, t0 + w));
        assert!(!q.rate_limited(Duration::ZERO, t0 + 2 * w));
        assert!(!q.final_only(t0 + 2 * w));
    }

    #[test]
    fn pending_edits_are_bounded_dropping_the_oldest() {
        let now = Instant::now();
        let mut q = queue();
        q.push_edit("a", "a", "a1", now);
        q.push_edit("b", "b", "b1", now);
        q.push_edit("c", "c", "c1", now);
        assert_eq!(
            q.push_edit("d", "d", "d1", now),
            EditPushed::QueuedDroppedOldest
        );
        assert_eq!(q.edits_len(), 3);
        assert_eq!(
            drain(&mut q, now),
            vec![
                Next::Edit("b", "b1"),
                Next::Edit("c", "c1"),
                Next::Edit("d", "d1")
            ]
        );
    }

    #[test]
    fn a_final_cancels_its_pending_edit() {
        let now = Instant::now();
        let mut q = queue();
        q.push_edit("a", "a", "a1", now);
        q.push_edit("b", "b", "b1", now);
        assert_eq!(q.cancel_edit(&"a"), Some("a1"));
        assert_eq!(q.cancel_edit(&"a"), None);
        assert_eq!(drain(&mut q, now), vec![Next::Edit("b", "b1")]);
        assert!(q.is_empty());
    }

    /// Issue 30 row 4: edits (on Matrix, a reply's first line too) are served one chat at a
    /// time: a chat streaming many replies does not hold another chat's first line.
    #[test]
    fn chats_take_turns_with_their_edits() {
        let now = Instant::now();
        let mut q = EditQueue::new(EditLimits::default());
        for key in ["a1", "a2", "a3", "a4"] {
            q.push_edit("room-a", key, key, now);
        }
        q.push_edit("room-b", "b1", "b1", now);
        q.push_edit("room-c", "c1", "c1", now);
        q.push_edit("room-b", "b2", "b2", now);
        let order: Vec<&str> = std::iter::from_fn(|| q.next(now))
            .map(|n| match n {
                Next::Edit(k, _) => k,
                Next::Urgent(u) => u,
            })
            .collect();
        assert_eq!(order, ["a1", "b1", "c1", "a2", "b2", "a3", "a4"]);
        assert!(q.is_empty());
    }
}
