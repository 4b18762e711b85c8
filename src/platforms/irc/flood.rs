//! The flood bucket pacing lines to the server.

use std::time::{Duration, Instant};

/// A token bucket: `burst` lines at once, one more per `interval`.
pub(super) struct FloodBucket {
    tokens: f64,
    burst: f64,
    interval: Duration,
    last: Instant,
}

impl FloodBucket {
    /// A full bucket.
    pub(super) fn new(burst: u32, interval: Duration) -> FloodBucket {
        FloodBucket {
            tokens: f64::from(burst),
            burst: f64::from(burst),
            interval,
            last: Instant::now(),
        }
    }

    /// Adds the tokens earned since the last refill.
    fn refill(&mut self, now: Instant) {
        let per = self.interval.as_secs_f64();
        let gained = if per <= 0.0 {
            self.burst
        } else {
            now.saturating_duration_since(self.last).as_secs_f64() / per
        };
        self.tokens = (self.tokens + gained).min(self.burst);
        self.last = now;
    }

    /// Takes a token if one is there.
    pub(super) fn take(&mut self, now: Instant) -> bool {
        self.refill(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// When the tokens were last counted.
    #[cfg(test)]
    pub(super) fn refilled_at(&self) -> Instant {
        self.last
    }

    /// When the next token is there.
    pub(super) fn next_at(&self) -> Instant {
        let missing = (1.0 - self.tokens).max(0.0);
        self.last + self.interval.mul_f64(missing)
    }
}
