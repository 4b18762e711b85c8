//! Megolm: the room sessions. Inbound ones (the humans' keys, bounded per room) decrypt
//! `m.room.encrypted` events; events whose key has not come yet wait in a bounded queue.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use serde_json::Value;
use vodozemac::megolm::{InboundGroupSession, MegolmMessage};

use super::keys::MEGOLM;

/// A room session's identity: the room, the sending device's key and the session id.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct SessionRef {
    pub room: String,
    pub sender_key: String,
    pub session_id: String,
}

/// The inbound room sessions, at most `per_room` per room (the oldest forgotten first).
pub(crate) struct Inbound {
    sessions: HashMap<SessionRef, InboundGroupSession>,
    order: HashMap<String, VecDeque<SessionRef>>,
    per_room: usize,
}

/// Why a room event did not decrypt.
#[derive(Debug)]
pub(crate) enum Undecryptable {
    /// Its session's key has not arrived (yet): worth keeping and retrying.
    MissingKey(SessionRef),
    /// Damaged, another algorithm, or a key that does not fit: never retried.
    Bad(String),
}

impl Inbound {
    /// No sessions; at most `per_room` kept per room.
    pub(crate) fn new(per_room: usize) -> Inbound {
        Inbound {
            sessions: HashMap::new(),
            order: HashMap::new(),
            per_room: per_room.max(1),
        }
    }

    /// Every session (to pickle).
    pub(crate) fn all(&self) -> impl Iterator<Item = (&SessionRef, &InboundGroupSession)> {
        self.sessions.iter()
    }

    /// How many sessions are kept.
    pub(crate) fn len(&self) -> usize {
        self.sessions.len()
    }

    /// Keeps `session` (a known one is kept if it reaches further back).
    pub(crate) fn add(&mut self, key: SessionRef, mut session: InboundGroupSession) {
        if let Some(old) = self.sessions.get_mut(&key) {
            if let Some(better) = old.merge(&mut session) {
                *old = better;
            }
            return;
        }
        let order = self.order.entry(key.room.clone()).or_default();
        while order.len() >= self.per_room {
            let Some(gone) = order.pop_front() else { break };
            self.sessions.remove(&gone);
        }
        order.push_back(key.clone());
        self.sessions.insert(key, session);
        debug_assert!(self.order.values().all(|o| o.len() <= self.per_room));
    }

    /// Decrypts an `m.room.encrypted` event of `room`: its plaintext (`type`, `content`).
    pub(crate) fn decrypt(&mut self, room: &str, event: &Value) -> Result<Value, Undecryptable> {
        let content = &event["content"];
        if content["algorithm"] != MEGOLM {
            return Err(Undecryptable::Bad(format!(
                "algorithm {} is not Megolm",
                content["algorithm"]
            )));
        }
        let (Some(sender_key), Some(session_id), Some(ciphertext)) = (
            content["sender_key"].as_str(),
            content["session_id"].as_str(),
            content["ciphertext"].as_str(),
        ) else {
            return Err(Undecryptable::Bad(
                "missing sender_key, session_id or ciphertext".into(),
            ));
        };
        let key = SessionRef {
            room: room.to_owned(),
            sender_key: sender_key.to_owned(),
            session_id: session_id.to_owned(),
        };
        let Some(session) = self.sessions.get_mut(&key) else {
            return Err(Undecryptable::MissingKey(key));
        };
        let message = MegolmMessage::from_base64(ciphertext)
            .map_err(|e| Undecryptable::Bad(format!("bad Megolm message: {e}")))?;
        let plain = session
            .decrypt(&message)
            .map_err(|e| Undecryptable::Bad(format!("session {session_id}: {e}")))?;
        let payload: Value = serde_json::from_slice(&plain.plaintext)
            .map_err(|e| Undecryptable::Bad(format!("the plaintext is not JSON: {e}")))?;
        // A payload claiming another room is a replay from elsewhere.
        if payload["room_id"] != room {
            return Err(Undecryptable::Bad(
                "the plaintext names another room".into(),
            ));
        }
        Ok(payload)
    }
}

/// An encrypted event waiting for its key.
pub(crate) struct Waiting {
    pub room: String,
    pub event: Value,
    pub session: SessionRef,
    pub since: Instant,
}

/// Undecryptable events kept for a retry, at most `cap` (the oldest dropped, logged).
pub(crate) struct Pending {
    queue: VecDeque<Waiting>,
    cap: usize,
    /// Events dropped because the queue was full, since the start.
    pub dropped: u64,
}

impl Pending {
    /// Empty; holds at most `cap` events.
    pub(crate) fn new(cap: usize) -> Pending {
        Pending {
            queue: VecDeque::new(),
            cap: cap.max(1),
            dropped: 0,
        }
    }

    /// How many wait.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.queue.len()
    }

    /// Keeps `w`; when full, the oldest is dropped first (logged: it will not be answered).
    pub(crate) fn push(&mut self, w: Waiting) {
        if self.queue.len() >= self.cap
            && let Some(old) = self.queue.pop_front()
        {
            self.dropped += 1;
            warn_limited!(
                "matrix: room {}: an undecryptable event (session {}) dropped unanswered: {} wait already (the bound)",
                old.room,
                old.session.session_id,
                self.cap
            );
        }
        self.queue.push_back(w);
        debug_assert!(self.queue.len() <= self.cap);
    }

    /// Takes out every waiting event `ready` says can be tried now, in arrival order.
    pub(crate) fn take(&mut self, mut ready: impl FnMut(&Waiting) -> bool) -> Vec<Waiting> {
        let (now, keep): (Vec<Waiting>, Vec<Waiting>) =
            self.queue.drain(..).partition(|w| ready(w));
        self.queue = keep.into();
        now
    }

    /// The waiting events.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Waiting> {
        self.queue.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use vodozemac::megolm::{GroupSession, SessionConfig};

    fn encrypted(out: &mut GroupSession, room: &str, body: &str) -> Value {
        let plain = json!({"type": "m.room.message", "room_id": room, "content": {"msgtype": "m.text", "body": body}});
        json!({"type": "m.room.encrypted", "event_id": format!("${body}"), "content": {
            "algorithm": MEGOLM, "sender_key": "SK", "session_id": out.session_id(),
            "ciphertext": out.encrypt(plain.to_string()).to_base64()}})
    }

    #[test]
    fn a_missing_key_is_named_and_decrypts_once_it_arrives() {
        let mut out = GroupSession::new(SessionConfig::version_1());
        let key = out.session_key();
        let ev = encrypted(&mut out, "!r", "hi");
        let mut inbound = Inbound::new(4);
        let Err(Undecryptable::MissingKey(r)) = inbound.decrypt("!r", &ev) else {
            panic!("a missing key is retryable")
        };
        assert_eq!(r.session_id, out.session_id());
        inbound.add(
            r,
            InboundGroupSession::new(&key, SessionConfig::version_1()),
        );
        let plain = inbound.decrypt("!r", &ev).expect("decrypts");
        assert_eq!(plain["content"]["body"], "hi");
        assert!(
            matches!(
                inbound.decrypt("!other", &ev),
                Err(Undecryptable::MissingKey(_))
            ),
            "a session is the room's own"
        );
    }

    #[test]
    fn sessions_per_room_are_bounded() {
        let mut inbound = Inbound::new(2);
        for i in 0..5 {
            let out = GroupSession::new(SessionConfig::version_1());
            let r = SessionRef {
                room: "!r".into(),
                sender_key: "SK".into(),
                session_id: format!("s{i}"),
            };
            inbound.add(
                r,
                InboundGroupSession::new(&out.session_key(), SessionConfig::version_1()),
            );
        }
        assert_eq!(inbound.len(), 2);
    }

    #[test]
    fn pending_events_past_the_bound_drop_the_oldest() {
        let mut pending = Pending::new(3);
        for i in 0..5 {
            pending.push(Waiting {
                room: "!r".into(),
                event: json!({"event_id": format!("$e{i}")}),
                session: SessionRef {
                    room: "!r".into(),
                    sender_key: "SK".into(),
                    session_id: "s".into(),
                },
                since: Instant::now(),
            });
        }
        assert_eq!(pending.len(), 3);
        assert_eq!(pending.dropped, 2);
        let ids: Vec<_> = pending
            .take(|_| true)
            .into_iter()
            .map(|w| w.event["event_id"].clone())
            .collect();
        assert_eq!(ids, vec![json!("$e2"), json!("$e3"), json!("$e4")]);
        assert_eq!(pending.len(), 0);
    }
}
