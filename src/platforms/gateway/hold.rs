//! Retryable means retried: a message the gateway refused for a reason that passes
//! (`shutting_down`, `overloaded`, `storage`, `backpressure`; see the protocol's reject
//! reasons) is held and sent again with the same id — after a backoff on the same
//! connection, and at once after a reconnect — and its bridge hears of it only if the client
//! finally gives up: [`GatewayConfig::max_hold`] after the message was first handed over
//! (also for a message the gateway never answered because it was away), or at once when
//! [`GatewayConfig::max_held`] messages are held already.

use std::time::{Duration, Instant};

use super::{Admission, GatewayConfig, Pending, State};

/// Refusals worth sending again: they pass by themselves.
const RETRYABLE: [&str; 4] = ["shutting_down", "overloaded", "storage", "backpressure"];
/// The first wait before a held message is sent again; it doubles up to [`LAST_RETRY`].
const FIRST_RETRY: Duration = Duration::from_millis(500);
/// The longest wait between two sends of a held message.
const LAST_RETRY: Duration = Duration::from_secs(30);

/// What became of a refusal.
pub(super) enum Refusal {
    /// Held: it is sent again later; the bridge is told nothing.
    Held,
    /// Final: the bridge is told this.
    Final(Admission),
}

/// The gateway refused `id` with `reason`: held (if the reason passes, the message still
/// has time and there is room), or final.
pub(super) fn on_refusal(
    state: &mut State,
    config: &GatewayConfig,
    id: &str,
    refusal: Admission,
    now: Instant,
) -> Refusal {
    let Admission::Rejected { reason, detail, .. } = &refusal else {
        return Refusal::Final(refusal);
    };
    if !RETRYABLE.contains(&reason.as_str()) {
        return Refusal::Final(refusal);
    }
    let held = state.pending.iter().filter(|p| p.refused.is_some()).count();
    let Some(p) = state.pending.iter_mut().find(|p| p.id == id) else {
        return Refusal::Final(refusal);
    };
    let waited = now.saturating_duration_since(p.since);
    let give_up = if waited >= config.max_hold {
        Some(format!(
            "{detail} (tried for {}s; given up)",
            waited.as_secs()
        ))
    } else if p.refused.is_none() && held >= config.max_held {
        Some(format!(
            "{detail} ({} messages already wait for a retry; not held)",
            config.max_held
        ))
    } else {
        None
    };
    if let Some(detail) = give_up {
        return Refusal::Final(Admission::Rejected {
            session: None,
            reason: reason.clone(),
            detail,
        });
    }
    let wait = FIRST_RETRY
        .saturating_mul(1u32 << p.retries.min(16))
        .min(LAST_RETRY);
    p.retries = p.retries.saturating_add(1);
    p.in_flight = None;
    p.retry_at = Some(now + wait);
    p.refused = Some((reason.clone(), detail.clone()));
    debug_redacted!(
        "gateway: message {id} refused ({reason}: {detail}); sending it again in {wait:?}"
    );
    Refusal::Held
}

/// Sends again every held message whose wait is over (on a confirmed connection).
pub(super) fn resend_due(state: &mut State, now: Instant) {
    for i in 0..state.pending.len() {
        if state.pending[i].retry_at.is_some_and(|at| at <= now) && !state.write_pending(i) {
            return;
        }
    }
}

/// Takes out the messages the client gives up on: handed over `max_hold` ago and not on
/// their way to an answer now. Each comes with the final refusal its bridge is told.
pub(super) fn expire(
    state: &mut State,
    config: &GatewayConfig,
    now: Instant,
) -> Vec<(Pending, Admission)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < state.pending.len() {
        let p = &state.pending[i];
        if p.in_flight.is_some() || now.saturating_duration_since(p.since) < config.max_hold {
            i += 1;
            continue;
        }
        let Some(p) = state.pending.remove(i) else {
            break;
        };
        let (reason, detail) = p.refused.clone().unwrap_or_else(|| {
            (
                "unanswered".to_owned(),
                "the gateway could not be reached".to_owned(),
            )
        });
        let waited = now.saturating_duration_since(p.since).as_secs();
        warn_limited!(
            "gateway: message {} given up after {waited}s: {reason}: {detail}",
            p.id
        );
        let refusal = Admission::Rejected {
            session: None,
            reason,
            detail: format!("{detail} (tried for {waited}s; given up)"),
        };
        out.push((p, refusal));
    }
    out
}
