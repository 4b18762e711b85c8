//! A file in an encrypted room (`content.file` of `m.image`, `m.file`, …): its ciphertext is
//! downloaded like any media and decrypted as it streams into the spool — AES-256-CTR with
//! the event's key and IV — while the SHA-256 of the ciphertext is checked against the
//! event's `hashes.sha256`. A file whose hash does not match is a failed download: the spool
//! keeps nothing of it (the Client-Server spec, "Sending encrypted attachments").

use std::io::{self, Read};

use aes::Aes256;
use aes::cipher::{BlockEncrypt, KeyInit, generic_array::GenericArray};
use base64::Engine;
use base64::engine::general_purpose::{STANDARD_NO_PAD_INDIFFERENT, URL_SAFE_NO_PAD_INDIFFERENT};
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::platforms::lenient::Lenient;

/// `content.file` as the event carries it.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct EncryptedFile {
    #[serde(default)]
    url: Lenient<String>,
    #[serde(default)]
    key: Lenient<JsonWebKey>,
    #[serde(default)]
    iv: Lenient<String>,
    #[serde(default)]
    hashes: Lenient<Hashes>,
}

#[derive(Debug, Default, Deserialize)]
struct JsonWebKey {
    #[serde(default)]
    alg: Lenient<String>,
    /// The key, unpadded URL-safe base64.
    #[serde(default)]
    k: Lenient<String>,
}

#[derive(Debug, Default, Deserialize)]
struct Hashes {
    #[serde(default)]
    sha256: Lenient<String>,
}

/// What decrypting a file needs, decoded.
#[derive(Clone, PartialEq, Eq)]
pub(super) struct FileKey {
    key: [u8; 32],
    iv: [u8; 16],
    sha256: [u8; 32],
}

impl std::fmt::Debug for FileKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FileKey(redacted)")
    }
}

/// An encrypted file as a message carries it: what decrypts it, or that its key is
/// malformed (then it is not fetched).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Sealed {
    Key(FileKey),
    Malformed,
}

impl EncryptedFile {
    /// Its `mxc://` URL.
    pub(super) fn url(&self) -> Option<&str> {
        self.url.text()
    }

    /// What decrypts it.
    pub(super) fn sealed(&self) -> Sealed {
        self.key().map_or(Sealed::Malformed, Sealed::Key)
    }

    /// The key, IV and hash, if each is there and of its size (`alg` `A256CTR`).
    fn key(&self) -> Option<FileKey> {
        fn decode<const N: usize>(engine: &impl Engine, text: Option<&str>) -> Option<[u8; N]> {
            engine.decode(text?).ok()?.try_into().ok()
        }
        let jwk = self.key.get()?;
        if jwk.alg.text() != Some("A256CTR") {
            return None;
        }
        Some(FileKey {
            key: decode(&URL_SAFE_NO_PAD_INDIFFERENT, jwk.k.text())?,
            iv: decode(&STANDARD_NO_PAD_INDIFFERENT, self.iv.text())?,
            sha256: decode(
                &STANDARD_NO_PAD_INDIFFERENT,
                self.hashes.get().and_then(|h| h.sha256.text()),
            )?,
        })
    }
}

/// Reads the plaintext of a ciphertext read from `inner`; at its end, an error if the
/// ciphertext's SHA-256 is not the event's.
pub(super) struct Decrypting<R> {
    inner: R,
    cipher: Aes256,
    counter: [u8; 16],
    keystream: [u8; 16],
    /// Bytes of `keystream` used (16: a new block is due).
    used: usize,
    hasher: Sha256,
    want: [u8; 32],
    /// The end was reached and the hash matched.
    verified: bool,
}

impl<R: Read> Decrypting<R> {
    pub(super) fn new(inner: R, key: &FileKey) -> Decrypting<R> {
        Decrypting {
            inner,
            cipher: Aes256::new(GenericArray::from_slice(&key.key)),
            counter: key.iv,
            keystream: [0; 16],
            used: 16,
            hasher: Sha256::new(),
            want: key.sha256,
            verified: false,
        }
    }

    /// The next block of keystream; the counter is the IV's low 64 bits, big-endian, as
    /// the spec's clients count it (WebCrypto's AES-CTR with a 64-bit counter).
    fn next_block(&mut self) {
        let mut block = GenericArray::from(self.counter);
        self.cipher.encrypt_block(&mut block);
        self.keystream.copy_from_slice(&block);
        self.used = 0;
        let mut low = [0u8; 8];
        low.copy_from_slice(&self.counter[8..]);
        let next = u64::from_be_bytes(low).wrapping_add(1);
        self.counter[8..].copy_from_slice(&next.to_be_bytes());
    }
}

impl<R: Read> Read for Decrypting<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.verified {
            return Ok(0);
        }
        let n = self.inner.read(buf)?;
        if n == 0 {
            let got: [u8; 32] = self.hasher.finalize_reset().into();
            if got != self.want {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "the encrypted file's SHA-256 is not the one its event gives",
                ));
            }
            self.verified = true;
            return Ok(0);
        }
        self.hasher.update(&buf[..n]);
        for b in &mut buf[..n] {
            if self.used == 16 {
                self.next_block();
            }
            *b ^= self.keystream[self.used];
            self.used += 1;
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vector made with Python's `cryptography` (AES-256-CTR): key 0..31, IV
    /// a0..a7 then eight zeros, plaintext `(i * 7) % 256` for i in 0..100.
    const CIPHERTEXT: &str = "de7b755081d76c4eb6e760e393e26f2959bc003fca7262702a1dc73e7c6210c51ebe005dad317834cf60fcb4b84d77e3f6c23099d7fc271f450bdaf56ce666e92c2fb94da39095e6e9f96e26e8486aaf4e5a8a83016e8c5dbaef2c8d922f025b69aaa0ab";

    /// Parsed from text, as the bridge reads an event (`Lenient` reads raw JSON).
    fn parse(v: serde_json::Value) -> EncryptedFile {
        serde_json::from_str(&v.to_string()).expect("a file object")
    }

    fn file(sha256: &str) -> EncryptedFile {
        parse(serde_json::json!({
            "url": "mxc://hs/abc",
            "key": {"kty": "oct", "key_ops": ["encrypt", "decrypt"], "alg": "A256CTR",
                    "k": "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8", "ext": true},
            "iv": "oKGio6SlpqcAAAAAAAAAAA",
            "hashes": {"sha256": sha256},
            "v": "v2"
        }))
    }

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
            .collect()
    }

    /// Reads `r` to its end in reads of at most 7 bytes (blocks straddle reads).
    fn read_all(mut r: impl Read) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        let mut buf = [0u8; 7];
        loop {
            match r.read(&mut buf)? {
                0 => return Ok(out),
                n => out.extend_from_slice(&buf[..n]),
            }
        }
    }

    #[test]
    fn a_file_decrypts_to_its_plaintext_when_its_hash_matches() {
        let key = file("fiYpYfPey6xxew/u1CrrC4Q2jnvsjipVNBhxGT+bViM")
            .key()
            .expect("a valid key");
        let plain = read_all(Decrypting::new(&hex(CIPHERTEXT)[..], &key)).expect("decrypted");
        let want: Vec<u8> = (0..100u32).map(|i| (i * 7 % 256) as u8).collect();
        assert_eq!(plain, want);
    }

    #[test]
    fn a_hash_that_does_not_match_fails_the_read() {
        let key = file("fiYpYfPey6xxew/u1CrrC4Q2jnvsjipVNBhxGT+bViM")
            .key()
            .expect("a valid key");
        let mut tampered = hex(CIPHERTEXT);
        tampered[40] ^= 1;
        let e = read_all(Decrypting::new(&tampered[..], &key)).expect_err("refused");
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn a_malformed_key_gives_none() {
        assert!(file("short").key().is_none());
        let mut f = file("fiYpYfPey6xxew/u1CrrC4Q2jnvsjipVNBhxGT+bViM");
        f.iv = serde_json::from_str("\"AAAA\"").expect("lenient");
        assert!(f.key().is_none(), "a 3-byte IV");
        assert!(EncryptedFile::default().key().is_none());
        let wrong_alg = parse(serde_json::json!({
            "key": {"alg": "A128CTR", "k": "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8"},
            "iv": "oKGio6SlpqcAAAAAAAAAAA",
            "hashes": {"sha256": "fiYpYfPey6xxew/u1CrrC4Q2jnvsjipVNBhxGT+bViM"}
        }));
        assert!(wrong_alg.key().is_none());
        assert_eq!(
            format!(
                "{:?}",
                file("fiYpYfPey6xxew/u1CrrC4Q2jnvsjipVNBhxGT+bViM").key()
            ),
            "Some(FileKey(redacted))"
        );
    }

    #[test]
    fn the_counter_carries_in_its_low_64_bits_only() {
        let key = FileKey {
            key: [0; 32],
            iv: [0xFF; 16],
            sha256: [0; 32],
        };
        let mut d = Decrypting::new(&[][..], &key);
        d.next_block();
        assert_eq!(d.counter[..8], [0xFF; 8], "the high half is never touched");
        assert_eq!(d.counter[8..], [0; 8], "the low half wrapped");
    }
}
