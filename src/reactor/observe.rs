//! What is logged and counted about the core's effects: DEBUG lines for every message,
//! WARN lines (rate-limited per session) for failed and abandoned turns and troubled
//! cleanups, and the counters the heartbeat publishes.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::core::{
    AbandonReason, CleanupContext, CleanupId, EventKind, FailReason, IdMap, MessageEvent, Outcome,
    TurnId,
};
use crate::histogram::{PromHistogram, TURN_BUCKETS};
use crate::logfmt::{Field, cut};
use crate::message::SessionKey;

/// WARN lines about failed turns per session per [`WARN_WINDOW`]; the rest are counted and
/// the count is given with the next line allowed.
const WARNS_PER_WINDOW: u32 = 5;
const WARN_WINDOW: Duration = Duration::from_secs(60);
/// Sessions remembered by the WARN limiter before the expired ones are forgotten.
const WARN_SESSIONS: usize = 4096;
/// Characters of an agent's error text in a WARN line.
const WARN_ERROR_CHARS: usize = 200;

/// Rate-limits the WARN lines about failed turns, per session.
#[derive(Default)]
pub(super) struct WarnLimiter {
    /// Per session: the window's start, lines logged in it, lines suppressed since the last.
    sessions: HashMap<SessionKey, (Duration, u32, u64)>,
}

impl WarnLimiter {
    /// Whether a line about `session` may be logged at `now`, and how many were suppressed
    /// since the last one.
    pub(super) fn allow(&mut self, session: &SessionKey, now: Duration) -> Option<u64> {
        if self.sessions.len() >= WARN_SESSIONS && !self.sessions.contains_key(session) {
            self.sessions
                .retain(|_, (start, _, _)| now.saturating_sub(*start) < WARN_WINDOW);
        }
        let entry = self.sessions.entry(session.clone()).or_insert((now, 0, 0));
        if now.saturating_sub(entry.0) >= WARN_WINDOW {
            entry.0 = now;
            entry.1 = 0;
        }
        if entry.1 >= WARNS_PER_WINDOW {
            entry.2 += 1;
            return None;
        }
        entry.1 += 1;
        Some(std::mem::take(&mut entry.2))
    }
}

/// ` (N more suppressed)` after a rate-limited line, when some were.
fn suppressed_note(suppressed: u64) -> String {
    if suppressed > 0 {
        format!(" ({suppressed} more suppressed)")
    } else {
        String::new()
    }
}

/// The driver's log lines and counters.
pub(super) struct Observer {
    /// Running turns: when each started and the message it answers.
    started: IdMap<TurnId, (Duration, Arc<str>)>,
    /// The turn that just ended (its `Finished` follows): message, turn, duration.
    just_ended: Option<(Arc<str>, TurnId, Duration)>,
    /// Turn durations, claim to end.
    turn_durations: PromHistogram,
    /// The runtime's rejections by reason.
    rejected_by_reason: BTreeMap<&'static str, u64>,
    /// Partials delivered.
    partials_forwarded: u64,
    /// Events whose sink was full or gone.
    undelivered: u64,
    /// Partials not sent to the runtime's `Events` stream, which was behind.
    partials_skipped: u64,
    /// When the last WARN about skipped partials was logged, and the skips since.
    skip_warned: Option<Duration>,
    skipped_since_warn: u64,
    warn_limiter: WarnLimiter,
}

impl Observer {
    pub(super) fn new() -> Observer {
        Observer {
            started: IdMap::default(),
            just_ended: None,
            turn_durations: PromHistogram::new(TURN_BUCKETS),
            rejected_by_reason: BTreeMap::new(),
            partials_forwarded: 0,
            undelivered: 0,
            partials_skipped: 0,
            skip_warned: None,
            skipped_since_warn: 0,
            warn_limiter: WarnLimiter::default(),
        }
    }

    /// Turn durations, claim to end.
    pub(super) fn turn_durations(&self) -> &PromHistogram {
        &self.turn_durations
    }

    /// The runtime's rejections by reason.
    pub(super) fn rejected_by_reason(&self) -> &BTreeMap<&'static str, u64> {
        &self.rejected_by_reason
    }

    /// Partials delivered.
    pub(super) fn partials_forwarded(&self) -> u64 {
        self.partials_forwarded
    }

    /// Events whose sink was full or gone.
    pub(super) fn undelivered(&self) -> u64 {
        self.undelivered
    }

    /// Partials not sent to the runtime's `Events` stream, which was behind.
    pub(super) fn partials_skipped(&self) -> u64 {
        self.partials_skipped
    }

    /// Counts a partial not sent to the runtime's `Events` stream, `unread` events behind:
    /// DEBUG per partial, and one WARN per [`WARN_WINDOW`] at most (the stream's reader, not
    /// a session, is behind), with the skips since the last.
    pub(super) fn partial_skipped(&mut self, ev: &MessageEvent, unread: usize, now: Duration) {
        self.partials_skipped += 1;
        self.skipped_since_warn += 1;
        let (session, id) = (Field(ev.session.as_str()), Field(&ev.id));
        log::debug!("partial skipped session={session} id={id} unread_events={unread}");
        if self
            .skip_warned
            .is_some_and(|at| now.saturating_sub(at) < WARN_WINDOW)
        {
            return;
        }
        let skipped = std::mem::take(&mut self.skipped_since_warn);
        self.skip_warned = Some(now);
        log::warn!(
            "the runtime's Events stream has {unread} unread events (its events_backlog): partial replies are skipped until it is read, outcomes still sent; session={session} id={id} skipped={skipped}"
        );
    }

    /// Turns started and not yet ended.
    pub(super) fn running_turns(&self) -> usize {
        self.started.len()
    }

    /// A turn went to the pool at `now`.
    pub(super) fn turn_started(&mut self, turn: TurnId, message: &Arc<str>, now: Duration) {
        self.started.insert(turn, (now, Arc::clone(message)));
    }

    /// Counts and logs a message's event before it is delivered: DEBUG for every accepted,
    /// rejected and finished message; WARN (rate-limited per session) for a failed turn.
    pub(super) fn event(&mut self, ev: &MessageEvent, now: Duration) {
        let session = Field(ev.session.as_str());
        let id = Field(&ev.id);
        match &ev.kind {
            EventKind::Accepted { state, position } => log::debug!(
                "accepted session={session} id={id} state={state:?} position={position}"
            ),
            EventKind::Rejected(reason) => {
                *self.rejected_by_reason.entry(reason.as_str()).or_insert(0) += 1;
                log::debug!(
                    "rejected session={session} id={id} outcome=rejected reason={}",
                    reason.as_str()
                );
            }
            EventKind::TurnStarted(_) => {}
            EventKind::Partial(_) => self.partials_forwarded += 1,
            EventKind::TurnEnded(turn) => {
                if let Some((start, message)) = self.started.remove(turn) {
                    let took = now.saturating_sub(start);
                    self.turn_durations.record(took);
                    self.just_ended = Some((message, *turn, took));
                }
            }
            EventKind::Finished(outcome) => self.finished(ev, outcome, now),
        }
    }

    /// The DEBUG line of a finished message, and the WARN line of a failed turn.
    fn finished(&mut self, ev: &MessageEvent, outcome: &Outcome, now: Duration) {
        let session = Field(ev.session.as_str());
        let id = Field(&ev.id);
        let ended = self
            .just_ended
            .take()
            .filter(|(message, _, _)| *message == ev.id);
        // Formatted only if a line is written: no allocation per message for a log level
        // that is off (issue 21 §5).
        let (turn, ms) = match &ended {
            Some((_, turn, took)) => (Dash(Some(turn.0)), Dash(Some(took.as_millis()))),
            None => (Dash(None), Dash(None)),
        };
        let name = OutcomeName(outcome);
        log::debug!("finished session={session} id={id} turn={turn} outcome={name} ms={ms}");
        // A timed-out turn was WARNed as abandoned (the `TurnAbandoned` effect).
        if let Outcome::Failed(FailReason::Agent(error) | FailReason::Panic(error)) = outcome
            && let Some(suppressed) = self.warn_limiter.allow(&ev.session, now)
        {
            let error = cut(error, WARN_ERROR_CHARS);
            let more = suppressed_note(suppressed);
            log::warn!(
                "turn failed session={session} id={id} turn={turn} outcome={name} ms={ms} error={}{more}",
                Field(&error)
            );
        }
    }

    /// The WARN line (rate-limited per session) of a turn given up on.
    pub(super) fn turn_abandoned(
        &mut self,
        turn: TurnId,
        session: &SessionKey,
        reason: AbandonReason,
        now: Duration,
    ) {
        let why = match reason {
            AbandonReason::Timeout => "ran past its turn timeout".to_owned(),
            AbandonReason::IgnoredCancel(r) => {
                format!("ignored cancellation ({}) past the stop grace", r.as_str())
            }
        };
        let (ms, id) = match self.started.get(&turn) {
            Some((start, id)) => (
                now.saturating_sub(*start).as_millis().to_string(),
                id.to_string(),
            ),
            None => ("-".to_owned(), "-".to_owned()),
        };
        if let Some(suppressed) = self.warn_limiter.allow(session, now) {
            let more = suppressed_note(suppressed);
            log::warn!(
                "turn abandoned session={} id={} turn={} outcome=abandoned ms={ms}: it {why}; its late result will be discarded{more}",
                Field(session.as_str()),
                Field(&id),
                turn.0
            );
        }
    }

    /// A sink was full: the event is lost (WARN) and counted.
    pub(super) fn sink_full(&mut self, ev: &MessageEvent) {
        self.undelivered += 1;
        log::warn!(
            "session {}: event sink full, event for message {} lost: {:?}",
            ev.session,
            ev.id,
            ev.kind
        );
    }

    /// A sink's receiver is gone (DEBUG: its owner stopped listening), counted.
    pub(super) fn sink_closed(&mut self, ev: &MessageEvent) {
        self.undelivered += 1;
        log::debug!("session {}: event sink closed ({})", ev.session, ev.id);
    }

    /// An event stream was dropped (DEBUG), counted.
    #[cfg(feature = "async")]
    pub(super) fn stream_dropped(&mut self, ev: &MessageEvent) {
        self.undelivered += 1;
        log::debug!("session {}: event stream dropped ({})", ev.session, ev.id);
    }

    /// The WARN line of an agent `close()` past its deadline.
    pub(super) fn cleanup_exceeded(
        &self,
        session: &SessionKey,
        context: CleanupContext,
        timeout: Duration,
    ) {
        log::warn!(
            "session {session}: agent cleanup ({}) exceeded {timeout:?}; proceeding without waiting (the thread is left to finish on its own)",
            context.as_str(),
        );
    }

    /// The WARN line of an agent `close()` that failed.
    pub(super) fn cleanup_failed(
        &self,
        session: &SessionKey,
        context: CleanupContext,
        error: &str,
    ) {
        log::warn!(
            "session {session}: agent cleanup ({}) failed: {error}",
            context.as_str()
        );
    }

    /// The ERROR line of a stuck turn thread the pool would not replace.
    pub(super) fn turn_replace_refused(&self, session: &SessionKey, turn: TurnId) {
        log::error!(
            "session {session}: cannot replace the turn thread stuck on turn {}: extra-thread cap reached",
            turn.0
        );
    }

    /// The ERROR line of a stuck cleanup thread the pool would not replace.
    pub(super) fn cleanup_replace_refused(&self, session: &SessionKey, job: CleanupId) {
        log::error!(
            "session {session}: cannot replace the cleanup thread stuck on job {}: extra-thread cap reached",
            job.0
        );
    }
}

/// A figure in a log line, or `-` when there is none.
struct Dash<T>(Option<T>);

impl<T: fmt::Display> fmt::Display for Dash<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Some(v) => v.fmt(f),
            None => f.write_str("-"),
        }
    }
}

/// The outcome's name in log lines: `reply`, `cancelled:<reason>`, `failed:<kind>`, `merged`.
struct OutcomeName<'a>(&'a Outcome);

impl fmt::Display for OutcomeName<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Outcome::Reply(_) => f.write_str("reply"),
            Outcome::Cancelled(r) => write!(f, "cancelled:{}", r.as_str()),
            Outcome::Failed(FailReason::Agent(_)) => f.write_str("failed:agent"),
            Outcome::Failed(FailReason::Panic(_)) => f.write_str("failed:panic"),
            Outcome::Failed(FailReason::Timeout) => f.write_str("failed:timeout"),
            Outcome::Merged { .. } => f.write_str("merged"),
        }
    }
}

#[cfg(test)]
fn outcome_name(outcome: &Outcome) -> String {
    OutcomeName(outcome).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warn_limiter_allows_a_burst_per_session_then_reports_what_it_suppressed() {
        let mut l = WarnLimiter::default();
        let a = SessionKey::dm("t", "a").unwrap();
        let b = SessionKey::dm("t", "b").unwrap();
        let s = Duration::from_secs;
        for _ in 0..WARNS_PER_WINDOW {
            assert_eq!(l.allow(&a, s(1)), Some(0));
        }
        assert_eq!(l.allow(&a, s(2)), None);
        assert_eq!(l.allow(&a, s(3)), None);
        assert_eq!(l.allow(&b, s(3)), Some(0), "another session is not limited");
        assert_eq!(
            l.allow(&a, s(60)),
            None,
            "the window runs from its first line"
        );
        assert_eq!(l.allow(&a, s(61)), Some(3));
        assert_eq!(l.allow(&a, s(62)), Some(0));
    }

    #[test]
    fn warn_limiter_forgets_expired_sessions_at_its_bound() {
        let mut l = WarnLimiter::default();
        for i in 0..WARN_SESSIONS {
            let k = SessionKey::dm("t", &i.to_string()).unwrap();
            assert_eq!(l.allow(&k, Duration::ZERO), Some(0));
        }
        assert_eq!(l.sessions.len(), WARN_SESSIONS);
        let k = SessionKey::dm("t", "new").unwrap();
        assert_eq!(l.allow(&k, WARN_WINDOW), Some(0));
        assert_eq!(l.sessions.len(), 1, "expired sessions forgotten");
    }

    #[test]
    fn outcome_names() {
        use crate::core::{CancelReason, Reply};
        assert_eq!(outcome_name(&Outcome::Reply(Reply::default())), "reply");
        assert_eq!(
            outcome_name(&Outcome::Cancelled(CancelReason::Stopped)),
            "cancelled:stopped"
        );
        assert_eq!(
            outcome_name(&Outcome::Failed(FailReason::Agent("x".into()))),
            "failed:agent"
        );
        assert_eq!(
            outcome_name(&Outcome::Failed(FailReason::Panic("x".into()))),
            "failed:panic"
        );
        assert_eq!(
            outcome_name(&Outcome::Failed(FailReason::Timeout)),
            "failed:timeout"
        );
        assert_eq!(
            outcome_name(&Outcome::Merged { into: "m".into() }),
            "merged"
        );
    }
}
