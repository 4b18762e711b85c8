//! Durability (`--data-dir`): everything the bridge has only with a journal — messages
//! waiting to be durable before their submission, terminal events waiting for their outcome
//! record, the journal's figures, the wall clock — in one [`Durable`], held as an `Option`
//! by the bridge; and the bridge's two round trips with the journal: the thread's report
//! (applied by [`Durable::committed`], which returns what it releases and states the release
//! rule; carried out by `Bridge::journaled` in `mod.rs`) and start-up recovery (each
//! journaled message's fate decided by [`recovery`]; carried out by `Bridge::recover`).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use super::super::dedup::fingerprint;
use super::super::frame::Frame;
use super::admit::{Source, build};
use super::config::BridgeConfig;
use super::platforms::Platforms;
use super::refusal::Refusal;
use super::routes::{InFlight, Phase, Routes, Terminal, files_released, no_conn};
use super::status::{JournalStatus, RecoveryCounts};
use super::{Action, ConnId, INTERRUPTED, POISON};
use crate::core::TurnId;
use crate::journal::{
    Committed, MemoryUpdate, Record, RecoveredMessage, StoredMessage, StoredOutcome,
};
use crate::message::{Message, SessionKey};
use crate::wire::{EncodedLine, TextOp};

/// The bridge's journal side.
pub(super) struct Durable {
    /// The figures kept here; the rest of [`JournalStatus`] is filled in by `status`.
    figures: JournalStatus,
    /// Accepted messages waiting for the journal before their submission, by tag.
    waiting: HashMap<u64, Message>,
    /// Terminal events waiting for their outcome record (by sequence number), with the
    /// connection they go to.
    unjournaled: HashMap<u64, (ConnId, Frame)>,
    /// One entry per record sent to the journal and not yet taken by a batch, in order (the
    /// thread takes them in order): what the record's durability releases.
    sent: VecDeque<Sent>,
    /// Refusals of journaled messages, each waiting for its `forget` record: a bridge told
    /// `reject` retries the id as new, so the journal must not bring it back after a crash.
    forgetting: HashMap<u64, Refusal>,
    /// Of them, those whose record a failed batch took.
    taken_forgets: Vec<u64>,
    /// Held turns whose `started` record a failed batch took (it is retried): released with
    /// the next batch that succeeds, which always writes what failed before.
    taken_starts: Vec<(TurnId, u64)>,
    /// Outcome records taken by a batch and not yet known durable (their batch failed):
    /// their terminal events wait for the next batch that succeeds.
    taken_outcomes: HashSet<u64>,
    max_pending: usize,
    /// Wall-clock ms since the epoch at the bridge's time zero (duplicate windows are
    /// journaled in wall time, to survive a restart).
    wall_at_zero: u64,
    /// Messages a graceful shutdown left in the journal for the next start.
    kept_for_restart: usize,
}

impl Durable {
    pub(super) fn new(max_pending: usize) -> Durable {
        Durable {
            figures: JournalStatus::default(),
            waiting: HashMap::new(),
            unjournaled: HashMap::new(),
            sent: VecDeque::new(),
            forgetting: HashMap::new(),
            taken_forgets: Vec::new(),
            taken_starts: Vec::new(),
            taken_outcomes: HashSet::new(),
            max_pending,
            wall_at_zero: 0,
            kept_for_restart: 0,
        }
    }

    /// The action that writes `r`.
    pub(super) fn record(&mut self, r: Record) -> Action {
        self.figures.queued_records += 1;
        self.sent.push_back(Sent::Other);
        Action::Journal(r)
    }

    /// The action that writes the `forget` record of a journaled message the runtime refused;
    /// the refusal is answered once the record is durable.
    pub(super) fn record_forget(&mut self, seq: u64, refusal: Refusal) -> Action {
        self.figures.queued_records += 1;
        self.sent.push_back(Sent::Forget(seq));
        self.forgetting.insert(seq, refusal);
        Action::Journal(Record::Forget { seq })
    }

    /// The action that writes the `started` record of a held turn, which the turn waits for.
    pub(super) fn record_start(&mut self, seq: u64, attempt: u32, turn: TurnId) -> Action {
        self.figures.queued_records += 1;
        self.sent.push_back(Sent::Start(turn, seq));
        Action::Journal(Record::Started { seq, attempt })
    }

    /// Whether another accepted message may wait for the journal.
    pub(super) fn room(&self) -> Result<(), Refusal> {
        if self.waiting.len() >= self.max_pending {
            return Err(Refusal::journal_full(self.max_pending));
        }
        Ok(())
    }

    /// `message` waits for its record to be durable before it is submitted.
    pub(super) fn wait(&mut self, tag: u64, message: Message, stored: StoredMessage) -> Action {
        debug_assert!(self.waiting.len() < self.max_pending);
        self.waiting.insert(tag, message);
        self.record(Record::Accepted(stored))
    }

    /// Whether the message of `tag` still waits for the journal.
    pub(super) fn is_waiting(&self, tag: u64) -> bool {
        self.waiting.contains_key(&tag)
    }

    /// Whether the runtime refused the message of `tag` and its `forget` record is pending.
    pub(super) fn is_forgetting(&self, tag: u64) -> bool {
        self.forgetting.contains_key(&tag)
    }

    /// A terminal event waits for its outcome record before it is sent; `memory`, the
    /// change to its session's stored conversation, commits with that record.
    pub(super) fn hold_outcome(
        &mut self,
        seq: u64,
        conn: ConnId,
        frame: Frame,
        memory: Option<MemoryUpdate>,
    ) -> Action {
        let outcome = StoredOutcome {
            memory,
            ..frame.body.to_stored()
        };
        debug_assert!(!self.unjournaled.contains_key(&seq));
        self.unjournaled.insert(seq, (conn, frame));
        self.record(Record::Outcome { seq, outcome })
    }

    pub(super) fn set_wall_clock(&mut self, epoch_ms: u64) {
        self.wall_at_zero = epoch_ms;
    }

    /// The wall-clock time of the bridge's `now`.
    pub(super) fn wall_ms(&self, now: Duration) -> u64 {
        self.wall_at_zero + now.as_millis() as u64
    }

    /// Forced exit: no message waits any more (their routes are gone).
    pub(super) fn abandon(&mut self) {
        self.waiting.clear();
        self.taken_starts.clear();
        self.forgetting.clear();
        self.taken_forgets.clear();
    }

    pub(super) fn unjournaled(&self) -> usize {
        self.unjournaled.len()
    }

    /// Messages start-up recovery restored (their reservations may exceed a lowered cap).
    pub(super) fn recovered(&self) -> usize {
        self.figures.recovery.messages
    }

    pub(super) fn status(&self) -> JournalStatus {
        JournalStatus {
            pending_durable: self.waiting.len(),
            unjournaled_outcomes: self.unjournaled.len(),
            max_pending_durable: self.max_pending,
            ..self.figures.clone()
        }
    }

    /// The platforms owed a reservation by the terminal events held here.
    pub(super) fn terminals_by_platform(&self) -> impl Iterator<Item = &str> {
        self.unjournaled
            .values()
            .filter_map(|(_, f)| f.terminal_for.as_deref())
    }

    /// Checks, in debug builds, every index here keyed by a message's tag against the
    /// records: that every waiting message has its route, in its phase, within the bound,
    /// that a refusal waiting for its `forget` record is its route's phase (if the route is
    /// still there), that a terminal event waiting for its outcome record has no route any
    /// more (the bridge's `audit` checks the converse), and that what each record in
    /// flight releases is kept once per record.
    pub(super) fn check(&self, routes: &Routes) {
        debug_assert!(self.waiting.len() <= self.max_pending);
        debug_assert!((self.waiting.keys()).all(|&tag| {
            routes
                .get(tag)
                .is_some_and(|r| r.phase == Phase::Journaling)
        }));
        for &tag in self.forgetting.keys() {
            let phase = routes.get(tag).map(|r| r.phase);
            debug_assert!(
                phase.is_none_or(|p| p == Phase::Refusing),
                "message {tag} phase"
            );
        }
        for &seq in self.unjournaled.keys() {
            debug_assert!(
                !routes.contains(seq),
                "message {seq}: an outcome and a route"
            );
        }
        // The tags kept for a record in flight are one entry per record counted.
        debug_assert_eq!(
            self.sent.len(),
            self.figures.queued_records,
            "records in flight"
        );
    }

    /// A graceful shutdown ended the message of `route` (`cancelled: shutdown`, queued or
    /// cut off by the drain): with a journal it is not answered and gets no outcome record,
    /// so the next start finds it as a crash would have left it — queued again if its turn
    /// never started, interrupted (failed, or run again with `resume_interrupted`) if it did.
    /// A planned restart then keeps the queue instead of dropping it. Its duplicate-window
    /// entry stays (it is still in flight), and so does its outbox reservation: the message
    /// is still owed, and whatever is admitted meanwhile (and may stay in the journal, its
    /// refusal not yet durable) must fit beside it, so the next process never recovers more
    /// than the bounds admit. Returns its connection, which may now be finished.
    pub(super) fn keep_for_restart(
        &mut self,
        route: InFlight,
        platforms: &mut Platforms,
    ) -> ConnId {
        debug_assert!(route.copies.is_empty(), "a finished message was admitted");
        self.kept_for_restart += 1;
        log::debug!(
            "session {}: message {} kept in the journal for the next start",
            route.session,
            route.id
        );
        platforms.keep_for_restart(&route.platform);
        route.conn
    }
}

// The cluster side's few operations here (`--cluster`, `cluster/bridge/side.rs`): a message
// answered otherwise leaves its wait, a terminal event whose outcome record was not written
// is taken back.
#[cfg(feature = "cluster")]
impl Durable {
    /// The message of `tag` no longer waits for the journal (answered otherwise).
    pub(super) fn forget_waiting(&mut self, tag: u64) -> Option<Message> {
        self.waiting.remove(&tag)
    }

    /// The terminal event held for `seq`'s outcome record, taken out (the record was not
    /// written).
    pub(super) fn take_unjournaled(&mut self, seq: u64) -> Option<(ConnId, Frame)> {
        self.taken_outcomes.remove(&seq);
        self.unjournaled.remove(&seq)
    }

    /// Whether the terminal event of `seq` waits for its outcome record.
    pub(super) fn is_unjournaled(&self, seq: u64) -> bool {
        self.unjournaled.contains_key(&seq)
    }
}

/// What a record sent to the journal releases once durable.
enum Sent {
    Other,
    /// A held turn (of the message with this tag) may start.
    Start(TurnId, u64),
    /// A refusal may be answered.
    Forget(u64),
}

/// What a journal report releases ([`Durable::committed`]), in the order the bridge applies
/// it.
pub(super) struct Released {
    /// Held turns whose `started` record is written: they may start (message tag, turn).
    pub(super) starts: Vec<(TurnId, u64)>,
    /// Accepted messages now durable: submitted (tag, message).
    pub(super) submit: Vec<(u64, Message)>,
    /// Terminal events whose outcome record is written: sent (their connection, the frame).
    pub(super) outcomes: Vec<(ConnId, Frame)>,
    /// Refusals of journaled messages whose `forget` record is written: answered.
    pub(super) forgotten: Vec<(u64, Refusal)>,
    /// Accepted messages whose write failed: rejected `storage`, with the write's error.
    pub(super) failed: Vec<u64>,
    pub(super) error: Option<String>,
}

impl Durable {
    /// The journal thread's report `c`, applied to what waits for the journal; returns what
    /// it releases.
    ///
    /// **The durability release rule** (stated here only, where it is enforced): a message
    /// is submitted once its `accepted` record is durable, and rejected `storage` if that
    /// write failed (it was never acknowledged). A held turn starts, a terminal event is
    /// sent and a runtime refusal is answered only once a batch has written its record
    /// (`started`, the outcome, `forget`) *and nothing is failing or kept for another try*:
    /// a failed batch releases none of them, and neither does a report that wrote nothing
    /// while records are kept (a cluster's ownership pass). While the journal cannot write,
    /// no turn starts and no outcome reaches a bridge (both wait, in order, and go once writes
    /// succeed), so that nothing a bridge or an agent has seen can be lost or contradicted by
    /// a crash.
    pub(super) fn committed(&mut self, c: Committed) -> Released {
        let j = &mut self.figures;
        j.queued_records = j.queued_records.saturating_sub(c.taken);
        j.retrying = c.retrying;
        j.batches += 1;
        j.failing = c.error.is_some();
        j.failed_batches += u64::from(c.error.is_some());
        for _ in 0..c.taken {
            match self.sent.pop_front() {
                Some(Sent::Start(turn, seq)) => self.taken_starts.push((turn, seq)),
                Some(Sent::Forget(seq)) => self.taken_forgets.push(seq),
                Some(Sent::Other) => {}
                None => break,
            }
        }
        self.taken_outcomes.extend(c.outcomes.iter().copied());
        let mut r = Released {
            starts: Vec::new(),
            submit: Vec::new(),
            outcomes: Vec::new(),
            forgotten: Vec::new(),
            failed: Vec::new(),
            error: c.error,
        };
        // Everything taken so far is written only if nothing failed and nothing is still
        // kept for another try (a cluster's ownership-pass report writes nothing).
        if r.error.is_none() && c.retrying == 0 {
            let mut seqs: Vec<u64> = self.taken_outcomes.drain().collect();
            seqs.sort_unstable();
            let unjournaled = &mut self.unjournaled;
            r.outcomes = (seqs.into_iter())
                .filter_map(|seq| unjournaled.remove(&seq))
                .collect();
            r.starts = std::mem::take(&mut self.taken_starts);
            for seq in self.taken_forgets.drain(..) {
                if let Some(refusal) = self.forgetting.remove(&seq) {
                    r.forgotten.push((seq, refusal));
                }
            }
        }
        for seq in c.durable {
            if let Some(message) = self.waiting.remove(&seq) {
                r.submit.push((seq, message));
            }
        }
        r.failed = (c.failed.into_iter())
            .filter(|seq| self.waiting.remove(seq).is_some())
            .collect();
        r
    }
}

impl Durable {
    /// Messages a graceful shutdown left in the journal for the next start.
    pub(super) fn kept(&self) -> usize {
        self.kept_for_restart
    }

    /// Start-up recovery of `messages` begins: the wall clock is `wall_now_ms` at the
    /// bridge's `now`.
    pub(super) fn recovering(&mut self, wall_now_ms: u64, now: Duration, messages: usize) {
        self.wall_at_zero = wall_now_ms.saturating_sub(now.as_millis() as u64);
        self.figures.recovery.messages = messages;
    }

    /// Start-up recovery is done: its counts, for the status.
    pub(super) fn recovered_all(&mut self, n: RecoveryCounts) {
        self.figures.recovery = n;
    }
}

impl Platforms {
    /// Restores the journaled duplicate windows (`(platform, id, until)`, `until` on the
    /// wall clock, which is `wall_now_ms` at `now`); returns how many ids they hold.
    pub(super) fn restore_dedup(
        &mut self,
        mut dedup: Vec<(String, String, u64)>,
        wall_now_ms: u64,
        now: Duration,
    ) -> usize {
        let mut ids = 0;
        // Each shard's expiry queue must be in expiry order.
        dedup.sort_by_key(|(_, _, until)| *until);
        for (platform, id, until) in dedup {
            let Some(p) = self.force(&platform) else {
                continue;
            };
            let left = Duration::from_millis(until.saturating_sub(wall_now_ms));
            ids += usize::from(self.remember(&p, fingerprint(&id), now + left, now, false));
        }
        ids
    }
}

/// The one INFO line start-up recovery logs.
pub(super) fn log_recovered(n: &RecoveryCounts) {
    log::info!(
        "recovered from the journal: {} message(s): {} requeued ({} interrupted turn(s) resumed), {} interrupted (failed), {} poison, {} outcome(s) to deliver; {} id(s) in duplicate windows",
        n.messages,
        n.requeued,
        n.resumed,
        n.interrupted,
        n.poisoned,
        n.outcomes,
        n.dedup_ids
    );
}

/// What a journaled message becomes at recovery ([`recovery`]), for the bridge to carry out.
pub(super) enum Recovery {
    /// Its outcome was journaled: the terminal event goes to this connection, else the
    /// platform's outbox.
    Outcome(ConnId, Arc<str>, Frame),
    /// It is failed (interrupted, poison, or no longer admissible).
    Failed(Terminal),
    /// It is submitted again with this tag, on this route (its connection waits for it
    /// once more).
    Requeue(u64, InFlight, Message),
    /// Not even a session can be named for it: dropped.
    Dropped,
}

/// One journaled message `rm` at recovery, its result going to `to` (a connection waiting
/// for it, or [`no_conn`]) on `platform`: its outbox reservation and duplicate-window entry
/// are restored, and what it becomes is returned (counted in `n`): its outcome sent again
/// (marked `redelivery` unless a connection waited for it), submitted again, or failed
/// `interrupted by restart` — or, with `resume_interrupted`, run again unless it was
/// interrupted twice (`poison`).
pub(super) fn recovery(
    rm: RecoveredMessage,
    to: ConnId,
    platform: Arc<str>,
    cfg: &BridgeConfig,
    platforms: &mut Platforms,
    n: &mut RecoveryCounts,
    now: Duration,
) -> Recovery {
    let m = rm.message;
    platforms.reserve(&platform);
    let id: Arc<str> = m.id().into();
    let seq = m.seq;
    // A message still in flight stays a duplicate, even if its window ran out while
    // it waited (its entry is later than every restored one: the order holds).
    let (fp, until) = (fingerprint(m.id()), now + cfg.dedup_window);
    n.dedup_ids += usize::from(platforms.remember(&platform, fp, until, now, true));
    if let Some(o) = rm.outcome {
        let mut frame =
            Frame::new(EncodedLine::from_stored(o), Some(platform.clone())).of_message(seq, id);
        // Sent before, perhaps; never to a connection that waited for it.
        if to == no_conn() {
            frame.mark_redelivery();
        }
        n.outcomes += 1;
        return Recovery::Outcome(to, platform, frame);
    }
    let built = build(
        m.platform(),
        m.fields.clone(),
        Source::Journal,
        &cfg.attachments,
    );
    let session = match &built {
        Ok(a) => a.message.session.clone(),
        Err(_) => match SessionKey::dm(m.platform(), &m.fields.chat_id) {
            Ok(k) => k,
            Err(_) => return Recovery::Dropped,
        },
    };
    let failure = match (&built, rm.starts) {
        (Err(refusal), _) => Some(refusal.after_restart()),
        (Ok(_), 0) => None,
        (Ok(_), 1) if cfg.resume_interrupted => None,
        (Ok(_), _) if cfg.resume_interrupted => {
            n.poisoned += 1;
            log::warn!("session {session}: message {id}: {POISON}");
            Some(POISON.to_string())
        }
        (Ok(_), _) => {
            n.interrupted += 1;
            Some(INTERRUPTED.to_string())
        }
    };
    if let Some(why) = failure {
        let files = built.ok().and_then(|a| a.message.context.attachments);
        let body = EncodedLine::text_op(TextOp::Failed, &id, session.as_str(), why);
        return Recovery::Failed(Terminal {
            seq,
            conn: to,
            platform,
            id,
            body,
            memory: None,
            files: files_released(files.as_deref()),
        });
    }
    let Ok(admitted) = built else {
        return Recovery::Dropped;
    };
    let mut route = InFlight::new(to, id, session, platform, fp);
    (route.starts, route.recovered) = (rm.starts, true);
    route.files = admitted.message.context.attachments.clone();
    n.requeued += 1;
    n.resumed += usize::from(rm.starts > 0);
    Recovery::Requeue(seq, route, admitted.message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::Key;
    use crate::wire::MessageFields;

    fn message() -> Message {
        let key = SessionKey::dm("telegram", "1").expect("key");
        Message::new("m", key, "hi").expect("message")
    }

    fn stored(seq: u64) -> StoredMessage {
        StoredMessage::new(seq, "telegram", MessageFields::new("m", "1", "hi"), 0)
    }

    #[test]
    fn a_waiting_message_holds_room_until_it_is_durable() {
        let mut d = Durable::new(1);
        let mut routes = Routes::default();
        let tag = routes.new_tag();
        let conn = Key::from_bits(0);
        let mut route = InFlight::new(conn, "m".into(), message().session, "telegram".into(), 1);
        route.phase = Phase::Journaling;
        routes.insert(tag, route);
        assert!(d.room().is_ok());
        assert!(matches!(
            d.wait(tag, message(), stored(tag)),
            Action::Journal(Record::Accepted(_))
        ));
        assert!(d.is_waiting(tag));
        assert_eq!(d.room().unwrap_err().reason, "overloaded");
        assert_eq!(
            (d.status().pending_durable, d.status().queued_records),
            (1, 1)
        );
        d.check(&routes);
        d.abandon();
        assert!(d.room().is_ok());
    }

    fn route_of(tag: u64, routes: &mut Routes) {
        let conn = Key::from_bits(0);
        let route = InFlight::new(conn, "m".into(), message().session, "telegram".into(), 1);
        routes.insert(tag, route);
    }

    /// A runtime refusal waiting for its `forget` record is its route's phase: the check
    /// holds the index and the record together.
    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "phase")]
    fn check_catches_a_pending_refusal_whose_route_is_in_another_phase() {
        let mut d = Durable::new(4);
        let mut routes = Routes::default();
        let tag = routes.new_tag();
        route_of(tag, &mut routes);
        let refusal = Refusal::runtime(crate::core::RejectReason::QueueFull);
        let _ = d.record_forget(tag, refusal);
        assert!(d.is_forgetting(tag));
        routes.get_mut(tag).expect("route").phase = Phase::Refusing;
        d.check(&routes);
        routes.get_mut(tag).expect("route").phase = Phase::Submitted;
        d.check(&routes);
    }

    /// A terminal event waiting for its outcome record belongs to a message whose route
    /// ended.
    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "an outcome and a route")]
    fn check_catches_an_outcome_waiting_beside_its_route() {
        let mut d = Durable::new(4);
        let mut routes = Routes::default();
        let tag = routes.new_tag();
        let body = super::super::delivery::failed_line("m", "telegram:1", "why".into(), 100);
        let frame = Frame::new(body, Some("telegram".into())).of_message(tag, "m".into());
        let _ = d.hold_outcome(tag, Key::from_bits(0), frame, None);
        d.check(&routes);
        route_of(tag, &mut routes);
        d.check(&routes);
    }

    /// What each record in flight releases is kept once per record sent.
    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "records in flight")]
    fn check_catches_a_record_in_flight_without_its_entry() {
        let mut d = Durable::new(4);
        let _ = d.record(Record::Delivered { seq: 1 });
        d.check(&Routes::default());
        d.sent.clear();
        d.check(&Routes::default());
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic]
    fn check_catches_a_waiting_message_without_its_route() {
        let mut d = Durable::new(4);
        let _ = d.wait(1, message(), stored(1));
        d.check(&Routes::default());
    }
}
