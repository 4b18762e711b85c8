//! Poll tokens: the one place that hands out every fixed token and band on the reactor's
//! `mio::Poll`, so two rooms can never take the same value (they once did: the journal's
//! wake-up and the HTTP listener were both `FIRST_RESERVED_TOKEN - 3`).
//!
//! From the top of the token space down:
//!
//! | tokens | owner |
//! |---|---|
//! | `FIRST_RESERVED_TOKEN ..= usize::MAX` | the reactor (its waker, its timer) |
//! | [`BRIDGE_LISTENER`], [`SIGNALS`], [`JOURNAL`] | the bridge server |
//! | [`HTTP_LISTENER`], then [`HTTP_CONNS`] | the operations endpoint |
//! | below [`CONN_TOKEN_LIMIT`] | a frontend's connections (a bridge connection's key bits) |

use mio::Token;

/// Tokens from this value up belong to the reactor; a frontend uses tokens below it.
pub const FIRST_RESERVED_TOKEN: usize = usize::MAX - 15;

/// The reactor's waker (ingress, completions).
pub(crate) const REACTOR_WAKE: Token = Token(usize::MAX - 1);
/// The reactor's deadline timer.
pub(crate) const REACTOR_TIMER: Token = Token(usize::MAX - 2);

/// The bridge server's listening socket.
pub(crate) const BRIDGE_LISTENER: Token = Token(FIRST_RESERVED_TOKEN - 1);
/// Signals (SIGTERM, SIGINT, SIGHUP) through `signal-hook-mio`.
pub(crate) const SIGNALS: Token = Token(FIRST_RESERVED_TOKEN - 2);
/// The journal thread's wake-up pipe.
pub(crate) const JOURNAL: Token = Token(FIRST_RESERVED_TOKEN - 3);
/// The HTTP endpoint's listening socket.
pub(crate) const HTTP_LISTENER: Token = Token(FIRST_RESERVED_TOKEN - 4);

/// A contiguous run of tokens counting down from `top`: slot `i` is `top - i`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Band {
    top: usize,
    len: usize,
}

impl Band {
    /// The token of slot `i` (`i < len`).
    pub(crate) fn token(self, i: usize) -> Token {
        debug_assert!(i < self.len, "slot {i} outside a band of {}", self.len);
        Token(self.top - i)
    }

    /// The slot of `token`, if it lies in the band.
    pub(crate) fn slot(self, token: Token) -> Option<usize> {
        (token.0 <= self.top && token.0 > self.top - self.len).then(|| self.top - token.0)
    }

    /// The lowest token of the band.
    const fn bottom(self) -> usize {
        self.top + 1 - self.len
    }
}

/// Most connections the HTTP endpoint may be configured with (their tokens are a band).
pub(crate) const HTTP_MAX_CONNECTIONS: usize = 4096;
/// The HTTP endpoint's connections, just below its listener.
pub(crate) const HTTP_CONNS: Band = Band {
    top: FIRST_RESERVED_TOKEN - 5,
    len: HTTP_MAX_CONNECTIONS,
};

/// Connection tokens made from key bits must stay below every fixed token and band.
pub(crate) const CONN_TOKEN_LIMIT: usize = HTTP_CONNS.bottom();

/// The token of a connection whose key packs to `bits`.
pub(crate) fn conn_token(bits: u64) -> Token {
    let bits = bits as usize;
    debug_assert!(
        bits < CONN_TOKEN_LIMIT,
        "connection token {bits} collides with a fixed token"
    );
    Token(bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every fixed token and band, as inclusive ranges.
    fn owners() -> Vec<(&'static str, usize, usize)> {
        let one = |name, t: Token| (name, t.0, t.0);
        vec![
            ("reactor", FIRST_RESERVED_TOKEN, usize::MAX),
            one("bridge listener", BRIDGE_LISTENER),
            one("signals", SIGNALS),
            one("journal", JOURNAL),
            one("http listener", HTTP_LISTENER),
            ("http connections", HTTP_CONNS.bottom(), HTTP_CONNS.top),
            ("frontend connections", 0, CONN_TOKEN_LIMIT - 1),
        ]
    }

    #[test]
    fn no_two_fixed_tokens_or_bands_overlap() {
        let owners = owners();
        for (i, a) in owners.iter().enumerate() {
            assert!(a.1 <= a.2, "{} is an empty range", a.0);
            for b in &owners[i + 1..] {
                assert!(a.2 < b.1 || b.2 < a.1, "{} overlaps {}", a.0, b.0);
            }
        }
        for t in [REACTOR_WAKE, REACTOR_TIMER] {
            assert!(t.0 >= FIRST_RESERVED_TOKEN);
        }
    }

    #[test]
    fn the_bands_cover_the_space_without_gaps() {
        let mut ranges: Vec<_> = owners().into_iter().map(|(_, lo, hi)| (lo, hi)).collect();
        ranges.sort();
        assert_eq!(ranges[0].0, 0);
        for w in ranges.windows(2) {
            assert_eq!(w[0].1 + 1, w[1].0, "a gap or overlap at {}", w[0].1);
        }
        assert_eq!(ranges.last().map(|r| r.1), Some(usize::MAX));
    }

    #[test]
    fn a_band_maps_slots_to_tokens_and_back() {
        assert_eq!(HTTP_CONNS.slot(HTTP_CONNS.token(0)), Some(0));
        let last = HTTP_MAX_CONNECTIONS - 1;
        assert_eq!(HTTP_CONNS.slot(HTTP_CONNS.token(last)), Some(last));
        assert_eq!(HTTP_CONNS.slot(HTTP_LISTENER), None);
        assert_eq!(HTTP_CONNS.slot(Token(CONN_TOKEN_LIMIT - 1)), None);
        assert_eq!(HTTP_CONNS.slot(JOURNAL), None);
    }
}
