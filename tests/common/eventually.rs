//! Waiting for a state another thread or process changes on a clock of its own (a janitor
//! deleting files, a heartbeat rewriting the status file, a key expiring in Redis): polled
//! with a generous deadline. It never orders events: a test waits on those with channels,
//! barriers or FIFOs.

use std::fmt::Debug;
use std::time::{Duration, Instant};

/// How often the state is looked at again: often enough to add nothing noticeable to a
/// test, seldom enough to leave the other side the machine.
const POLL_EVERY: Duration = Duration::from_millis(20);

/// What one look at the state found: settled (with what the caller wants from it), or not
/// yet (with what it saw, for the panic message when the deadline passes).
pub trait Settled {
    /// What a settled state gives back.
    type Value;
    /// `Ok` once settled; `Err` with a description of what was seen, if any, until then.
    fn settled(self) -> Result<Self::Value, Option<String>>;
}

impl Settled for bool {
    type Value = ();
    fn settled(self) -> Result<(), Option<String>> {
        if self { Ok(()) } else { Err(None) }
    }
}

impl<T> Settled for Option<T> {
    type Value = T;
    fn settled(self) -> Result<T, Option<String>> {
        self.ok_or(None)
    }
}

/// `Err(seen)`: not yet, and `seen` is what the panic message shows if it stays so.
impl<T, E: Debug> Settled for Result<T, E> {
    type Value = T;
    fn settled(self) -> Result<T, Option<String>> {
        self.map_err(|seen| Some(format!("{seen:?}")))
    }
}

/// Polls `check` until it settles (`true`, `Some`, `Ok`) and returns what it gave; panics
/// naming `what` (and the last state `check` described) if it has not within `within`.
#[track_caller]
pub fn eventually<S: Settled>(
    what: &str,
    within: Duration,
    mut check: impl FnMut() -> S,
) -> S::Value {
    let deadline = Instant::now() + within;
    loop {
        match check().settled() {
            Ok(value) => return value,
            Err(seen) => assert!(
                Instant::now() < deadline,
                "not within {within:?}: {what}{}",
                seen.map(|s| format!("; last seen: {s}"))
                    .unwrap_or_default()
            ),
        }
        // The poll's interval, not an order of events: the predicate decides, the deadline
        // bounds the wait.
        std::thread::sleep(POLL_EVERY);
    }
}

/// `Ok` once `pred` holds for `state`, else `Err(state)`: what [`eventually`]'s panic
/// message shows when it never does.
pub fn holds<T>(state: T, pred: impl FnOnce(&T) -> bool) -> Result<(), T> {
    if pred(&state) { Ok(()) } else { Err(state) }
}
