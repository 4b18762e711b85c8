//! Olm: the one-to-one sessions with other devices, which carry room keys both ways.

use std::collections::{HashMap, VecDeque};

use serde_json::{Value, json};
use vodozemac::Curve25519PublicKey;
use vodozemac::olm::{Account, OlmMessage, Session, SessionConfig};

use super::keys::OLM;

/// Sessions kept per other device (the newest first): a device that re-keys leaves old ones.
const SESSIONS_PER_DEVICE: usize = 4;

/// The Olm sessions, per other device's identity key, bounded in devices (oldest forgotten).
pub(crate) struct OlmSessions {
    by_peer: HashMap<String, Vec<Session>>,
    order: VecDeque<String>,
    max_peers: usize,
}

/// A decrypted to-device payload: its `type`, `content` and the sender's claimed keys.
pub(crate) struct Decrypted {
    pub payload: Value,
    pub sender_key: String,
}

impl OlmSessions {
    /// No sessions; at most `max_peers` devices remembered.
    pub(crate) fn new(max_peers: usize) -> OlmSessions {
        OlmSessions {
            by_peer: HashMap::new(),
            order: VecDeque::new(),
            max_peers: max_peers.max(1),
        }
    }

    /// How many devices have sessions.
    #[cfg(test)]
    pub(crate) fn peers(&self) -> usize {
        self.by_peer.len()
    }

    /// Every session with its peer's key (to pickle).
    pub(crate) fn all(&self) -> impl Iterator<Item = (&str, &Session)> {
        self.by_peer
            .iter()
            .flat_map(|(k, v)| v.iter().map(move |s| (k.as_str(), s)))
    }

    /// Keeps `session` with `peer`, newest first; forgets the oldest device past the bound.
    pub(crate) fn add(&mut self, peer: &str, session: Session) {
        if !self.by_peer.contains_key(peer) {
            while self.by_peer.len() >= self.max_peers {
                let Some(old) = self.order.pop_front() else {
                    break;
                };
                self.by_peer.remove(&old);
            }
            self.order.push_back(peer.to_owned());
        }
        let list = self.by_peer.entry(peer.to_owned()).or_default();
        list.insert(0, session);
        list.truncate(SESSIONS_PER_DEVICE);
        debug_assert!(self.by_peer.len() <= self.max_peers);
    }

    /// Whether a session with `peer` exists (to send to it without claiming a key).
    pub(crate) fn has(&self, peer: &str) -> bool {
        self.by_peer.get(peer).is_some_and(|l| !l.is_empty())
    }

    /// Decrypts one to-device `m.room.encrypted` content addressed to `our_key`: an existing
    /// session first, then (a pre-key message) a new inbound one. `Err` says why, for the log.
    pub(crate) fn decrypt(
        &mut self,
        account: &mut Account,
        our_key: &str,
        content: &Value,
    ) -> Result<Decrypted, String> {
        if content["algorithm"] != OLM {
            return Err(format!("algorithm {} is not Olm", content["algorithm"]));
        }
        let sender_key = content["sender_key"].as_str().ok_or("no sender_key")?;
        let peer =
            Curve25519PublicKey::from_base64(sender_key).map_err(|e| format!("sender_key: {e}"))?;
        let ours = &content["ciphertext"][our_key];
        if ours.is_null() {
            return Err("not encrypted for this device".into());
        }
        let message: OlmMessage =
            serde_json::from_value(ours.clone()).map_err(|e| format!("bad Olm message: {e}"))?;
        let sender_key = peer.to_base64();
        if let Some(list) = self.by_peer.get_mut(&sender_key) {
            for session in list.iter_mut() {
                if let Ok(plain) = session.decrypt(&message) {
                    return parse(&plain, sender_key);
                }
            }
        }
        let OlmMessage::PreKey(pre_key) = &message else {
            return Err("no session with the sender decrypts it".into());
        };
        let created = account
            .create_inbound_session(SessionConfig::version_1(), peer, pre_key)
            .map_err(|e| format!("cannot start a session: {e}"))?;
        self.add(&sender_key, created.session);
        parse(&created.plaintext, sender_key)
    }

    /// Encrypts `payload` for `peer` with its newest session (which must exist).
    pub(crate) fn encrypt(&mut self, our_key: &str, peer: &str, payload: &Value) -> Option<Value> {
        let session = self.by_peer.get_mut(peer)?.first_mut()?;
        let message = session.encrypt(payload.to_string()).ok()?;
        Some(json!({
            "algorithm": OLM,
            "sender_key": our_key,
            "ciphertext": {peer: message},
        }))
    }
}

fn parse(plain: &[u8], sender_key: String) -> Result<Decrypted, String> {
    let payload: Value =
        serde_json::from_slice(plain).map_err(|e| format!("the plaintext is not JSON: {e}"))?;
    Ok(Decrypted {
        payload,
        sender_key,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_past_the_bound_forget_the_oldest() {
        let mut sessions = OlmSessions::new(2);
        let alice = Account::new();
        let mut bob = Account::new();
        bob.generate_one_time_keys(3);
        let otks: Vec<_> = bob.one_time_keys().into_values().collect();
        for (i, otk) in otks.iter().enumerate() {
            let s = alice
                .create_outbound_session(SessionConfig::version_1(), bob.curve25519_key(), *otk)
                .expect("session");
            sessions.add(&format!("peer{i}"), s);
        }
        assert_eq!(sessions.peers(), 2);
        assert!(!sessions.has("peer0"), "the oldest device was forgotten");
        assert!(sessions.has("peer2"));
    }

    #[test]
    fn a_pre_key_message_starts_a_session_and_later_messages_use_it() {
        let mut bot = Account::new();
        bot.generate_one_time_keys(1);
        let otk = *bot.one_time_keys().values().next().expect("a key");
        bot.mark_keys_as_published();
        let human = Account::new();
        let mut out = human
            .create_outbound_session(SessionConfig::version_1(), bot.curve25519_key(), otk)
            .expect("session");
        let our_key = bot.curve25519_key().to_base64();
        let content = |m: OlmMessage| json!({"algorithm": OLM, "sender_key": human.curve25519_key().to_base64(), "ciphertext": {our_key.clone(): m}});
        let mut sessions = OlmSessions::new(8);
        let first = content(out.encrypt(r#"{"type":"a"}"#).expect("enc"));
        let d = sessions
            .decrypt(&mut bot, &our_key, &first)
            .expect("pre-key decrypts");
        assert_eq!(d.payload["type"], "a");
        let second = content(out.encrypt(r#"{"type":"b"}"#).expect("enc"));
        let d = sessions
            .decrypt(&mut bot, &our_key, &second)
            .expect("the session decrypts");
        assert_eq!(d.payload["type"], "b");
        assert!(sessions.decrypt(&mut bot, "other", &second).is_err());
    }
}
