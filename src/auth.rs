//! The auth token check. A guess is compared through keyed digests of fixed size, with
//! `subtle`'s constant-time equality: the time taken depends on neither the secret's bytes nor
//! its length (only on the guess's own length, which the client knows).

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;

use subtle::ConstantTimeEq;

/// The configured token, kept only as its keyed digest.
pub(crate) struct Token {
    keys: [RandomState; 2],
    digest: [u8; 16],
}

impl Token {
    /// Remembers `secret` under fresh random keys.
    pub(crate) fn new(secret: &str) -> Token {
        let keys = [RandomState::new(), RandomState::new()];
        let digest = digest(&keys, secret.as_bytes());
        Token { keys, digest }
    }

    /// Whether `guess` is the token. A false match needs a 128-bit collision of SipHash under
    /// keys the client never sees.
    pub(crate) fn matches(&self, guess: &str) -> bool {
        digest(&self.keys, guess.as_bytes())
            .ct_eq(&self.digest)
            .into()
    }
}

fn digest(keys: &[RandomState; 2], bytes: &[u8]) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&keys[0].hash_one(bytes).to_le_bytes());
    out[8..].copy_from_slice(&keys[1].hash_one(bytes).to_le_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_token_matches() {
        let t = Token::new("s3cret");
        assert!(t.matches("s3cret"));
        for wrong in ["", "s3cre", "s3cret ", "S3cret", "s3creT", "s3crets3cret"] {
            assert!(!t.matches(wrong), "{wrong}");
        }
    }
}
