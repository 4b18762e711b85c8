//! What a refused request means: the answer read (bounded), the wait before a retry (the
//! server's `Retry-After`, or a backoff with jitter), or the text of giving up.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

use super::{OpenAiConfig, Stop, sse};
use crate::agent::CancelToken;

/// The longest error body read for its message.
const MAX_ERROR_BODY: u64 = 16 * 1024;

/// A non-2xx answer: its `Retry-After`, the message of its error body, and the reason shown
/// (that message, or the status's canonical reason).
pub(super) struct Refused {
    pub(super) retry_after: Option<Duration>,
    pub(super) message: Option<String>,
    pub(super) reason: String,
}

impl Refused {
    /// Reads the answer's headers and (bounded) body.
    pub(super) fn read(
        response: ureq::http::Response<ureq::Body>,
        status: u16,
        cancel: &CancelToken,
    ) -> Result<Refused, Stop> {
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(parse_retry_after);
        let mut body = response.into_body();
        let text = body
            .with_config()
            .limit(MAX_ERROR_BODY)
            .lossy_utf8(true)
            .read_to_string();
        if cancel.is_cancelled() {
            return Err(Stop::Cancelled);
        }
        let message = text.ok().and_then(|t| sse::error_message(&t));
        let reason = message.clone().unwrap_or_else(|| {
            ureq::http::StatusCode::from_u16(status)
                .ok()
                .and_then(|s| s.canonical_reason())
                .unwrap_or("error")
                .to_owned()
        });
        Ok(Refused {
            retry_after,
            message,
            reason,
        })
    }
}

/// What the chat sees of a refused request: the status, never the server's text.
pub(super) fn unavailable(status: u16) -> String {
    if status == 429 || (500..600).contains(&status) {
        format!("the model server is unavailable (HTTP {status})")
    } else {
        format!("the model server refused the request (HTTP {status})")
    }
}

/// The failure text (for the log) of a refused request not (or no longer) retried.
pub(super) fn give_up_text(
    status: u16,
    reason: &str,
    has_message: bool,
    url: &str,
    cfg: &OpenAiConfig,
    attempt: u32,
) -> String {
    let mut text = format!("{status} {reason} (from {url}");
    if status == 404 && !has_message {
        text.push_str(&format!(
            "; check the base URL and the model {:?}",
            cfg.model
        ));
    }
    if attempt > 0 {
        text.push_str(&format!("; gave up after {attempt} retries"));
    }
    text.push(')');
    text
}

/// `Retry-After` in seconds (decimal allowed); HTTP dates are not honoured (`None`).
fn parse_retry_after(v: &str) -> Option<Duration> {
    let secs: f64 = v.trim().parse().ok()?;
    (secs.is_finite() && (0.0..1e9).contains(&secs)).then(|| Duration::from_secs_f64(secs))
}

/// A random fraction in [0, 1).
fn jitter() -> f64 {
    let mut h = RandomState::new().build_hasher();
    h.write_u64(0);
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// How long to wait before retry `attempt + 1`: the server's `Retry-After` plus up to
/// 250 ms of jitter, or `retry_base * 2^attempt` plus up to 50 % jitter. `None` when the
/// server asks for more than `max_retry_wait`.
pub(super) fn retry_wait(
    attempt: u32,
    retry_after: Option<Duration>,
    cfg: &OpenAiConfig,
) -> Option<Duration> {
    match retry_after {
        Some(d) if d > cfg.max_retry_wait => None,
        Some(d) => Some(d + Duration::from_millis(250).mul_f64(jitter())),
        None => {
            let b = cfg.retry_base.saturating_mul(1u32 << attempt.min(16));
            Some((b + b.mul_f64(0.5 * jitter())).min(cfg.max_retry_wait))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_waits_honour_retry_after_and_back_off() {
        let cfg = OpenAiConfig::new("http://x/v1", "m");
        for _ in 0..50 {
            let w = retry_wait(0, Some(Duration::from_secs(2)), &cfg).expect("a wait");
            assert!(w >= Duration::from_secs(2) && w <= Duration::from_millis(2250));
            let b0 = retry_wait(0, None, &cfg).expect("a wait");
            assert!(b0 >= Duration::from_secs(1) && b0 <= Duration::from_millis(1500));
            let b2 = retry_wait(2, None, &cfg).expect("a wait");
            assert!(b2 >= Duration::from_secs(4) && b2 <= Duration::from_secs(6));
        }
        assert_eq!(retry_wait(0, Some(Duration::from_secs(61)), &cfg), None);
        assert!(retry_wait(0, Some(Duration::from_secs(60)), &cfg).is_some());
        // The jitter varies.
        let waits: std::collections::HashSet<Duration> =
            (0..20).filter_map(|_| retry_wait(1, None, &cfg)).collect();
        assert!(waits.len() > 1, "no jitter: {waits:?}");
        assert_eq!(
            retry_wait(30, None, &cfg),
            Some(cfg.max_retry_wait),
            "a long backoff is capped"
        );
        assert_eq!(parse_retry_after(" 1 "), Some(Duration::from_secs(1)));
        assert_eq!(parse_retry_after("0.5"), Some(Duration::from_millis(500)));
        assert_eq!(parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"), None);
        assert_eq!(parse_retry_after("-1"), None);
    }
}
