//! Sending into encrypted rooms: one outbound Megolm session per room, shared over Olm with
//! every joined member's devices before it encrypts, rotated by the room's settings.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};
use vodozemac::Curve25519PublicKey;
use vodozemac::megolm::{GroupSession, SessionConfig};
use vodozemac::olm::SessionConfig as OlmConfig;

use super::Crypto;
use super::keys::{self, Device, MEGOLM};
use crate::platforms::matrix::api::{Api, ApiError, enc};

/// Users asked about per `/keys/query` request at most.
const USERS_PER_QUERY: usize = 100;
/// Users whose devices are remembered at most (all forgotten past it, asked again).
const MAX_USERS: usize = 10_000;

/// When a room's outbound session is replaced (`m.room.encryption`'s settings).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Rotation {
    messages: u64,
    age: Duration,
}

impl Default for Rotation {
    fn default() -> Rotation {
        Rotation {
            messages: 100,
            age: Duration::from_secs(7 * 24 * 3600),
        }
    }
}

impl Rotation {
    /// From an `m.room.encryption` content (the spec's defaults for what it lacks).
    pub(crate) fn from_content(c: &Value) -> Rotation {
        let d = Rotation::default();
        Rotation {
            messages: c["rotation_period_msgs"]
                .as_u64()
                .filter(|&n| n > 0)
                .unwrap_or(d.messages),
            age: c["rotation_period_ms"]
                .as_u64()
                .filter(|&n| n > 0)
                .map_or(d.age, Duration::from_millis),
        }
    }
}

/// A room's outbound session and the devices it was shared with.
pub(crate) struct Outbound {
    session: GroupSession,
    shared: HashSet<(String, String)>,
    sent: u64,
    created: Instant,
}

impl Outbound {
    /// A new session, shared with nobody yet.
    pub(crate) fn new() -> Outbound {
        Outbound {
            session: GroupSession::new(SessionConfig::version_1()),
            shared: HashSet::new(),
            sent: 0,
            created: Instant::now(),
        }
    }
}

impl Crypto {
    /// The encrypted content to send instead of `content` in `room` (`m.room.encrypted`), or
    /// `None` when the room is not encrypted. Never falls back to plaintext in an encrypted
    /// room: a failure is an error.
    pub(crate) fn encrypt(
        &mut self,
        api: &Api,
        room: &str,
        content: &Value,
    ) -> Result<Option<Value>, ApiError> {
        let Some(rotation) = self.room_encryption(api, room)? else {
            return Ok(None);
        };
        let due = self
            .outbound
            .get(room)
            .is_none_or(|o| o.sent >= rotation.messages || o.created.elapsed() >= rotation.age);
        if due {
            self.outbound.insert(room.to_owned(), Outbound::new());
        }
        let members = joined_members(api, room)?;
        self.refresh_devices(api, &members)?;
        self.share(api, room, &members)?;
        let our_key = self.account.curve25519_key().to_base64();
        let Some(out) = self.outbound.get_mut(room) else {
            return Err(ApiError::BadResponse("no outbound session".into()));
        };
        let plain = json!({"type": "m.room.message", "content": content, "room_id": room});
        let ciphertext = out.session.encrypt(plain.to_string()).to_base64();
        out.sent += 1;
        let mut sealed = json!({
            "algorithm": MEGOLM,
            "sender_key": our_key,
            "ciphertext": ciphertext,
            "session_id": out.session.session_id(),
            "device_id": self.device,
        });
        if let Some(rel) = content.get("m.relates_to") {
            sealed["m.relates_to"] = rel.clone();
        }
        Ok(Some(sealed))
    }

    /// Whether `room` is encrypted (what a reply's file is not uploaded in the clear into).
    pub(crate) fn is_encrypted(&mut self, api: &Api, room: &str) -> Result<bool, ApiError> {
        self.room_encryption(api, room).map(|r| r.is_some())
    }

    /// Whether `room` is encrypted (asked of the server once, then followed in the sync).
    fn room_encryption(&mut self, api: &Api, room: &str) -> Result<Option<Rotation>, ApiError> {
        if let Some(known) = self.rooms.get(room) {
            return Ok(*known);
        }
        let path = format!("/rooms/{}/state/m.room.encryption/", enc(room));
        let rotation = match api.call("GET", &path, None) {
            Ok(c) if c["algorithm"] == MEGOLM => Some(Rotation::from_content(&c)),
            Ok(_) => None,
            Err(ApiError::Status { status: 404, .. }) => None,
            Err(e) => return Err(e),
        };
        if self.rooms.len() >= MAX_USERS {
            self.rooms.clear();
        }
        self.rooms.insert(room.to_owned(), rotation);
        Ok(rotation)
    }

    /// Asks `/keys/query` for the members whose devices are unknown or changed.
    pub(super) fn refresh_devices(
        &mut self,
        api: &Api,
        members: &[String],
    ) -> Result<(), ApiError> {
        let wanted: Vec<&String> = members
            .iter()
            .filter(|u| !self.devices.contains_key(*u) || self.stale.contains(*u))
            .collect();
        for batch in wanted.chunks(USERS_PER_QUERY) {
            let mut ask = Map::new();
            for u in batch {
                ask.insert((*u).clone(), json!([]));
            }
            let answer = api.call("POST", "/keys/query", Some(&json!({"device_keys": ask})))?;
            if self.devices.len() + batch.len() > MAX_USERS {
                self.devices.clear();
            }
            for u in batch {
                let mut list = Vec::new();
                for (id, v) in answer["device_keys"][u.as_str()]
                    .as_object()
                    .into_iter()
                    .flatten()
                {
                    match keys::parse_device(u, id, v) {
                        Some(d) => list.push(d),
                        None => warn_limited!(
                            "matrix: device {id} of {u}: keys missing or not self-signed; it gets no room keys"
                        ),
                    }
                }
                self.stale.remove(u.as_str());
                self.devices.insert((*u).clone(), list);
            }
        }
        Ok(())
    }

    /// Shares the room's outbound session with every member device that lacks it.
    fn share(&mut self, api: &Api, room: &str, members: &[String]) -> Result<(), ApiError> {
        let Some(out) = self.outbound.get(room) else {
            return Ok(());
        };
        let mut targets: Vec<(String, Device)> = Vec::new();
        for u in members {
            for d in self.devices.get(u).into_iter().flatten() {
                let own = *u == self.me && d.id == self.device;
                if own || out.shared.contains(&(u.clone(), d.id.clone())) {
                    continue;
                }
                if self.may_receive_keys(u, d) {
                    targets.push((u.clone(), d.clone()));
                } else {
                    debug_redacted!(
                        "matrix: room {room}: device {} of {u} is not in --matrix-require-verified's list; it gets no room key",
                        d.id
                    );
                }
            }
        }
        if targets.is_empty() {
            return Ok(());
        }
        let session_key = out.session.session_key().to_base64();
        let session_id = out.session.session_id();
        self.claim_sessions(api, &targets)?;
        let our_curve = self.account.curve25519_key().to_base64();
        let our_ed = self.account.ed25519_key().to_base64();
        let mut messages: HashMap<String, Map<String, Value>> = HashMap::new();
        let mut reached = Vec::new();
        for (user, d) in &targets {
            let payload = json!({
                "type": "m.room_key",
                "content": {"algorithm": MEGOLM, "room_id": room, "session_id": session_id, "session_key": session_key},
                "sender": self.me, "sender_device": self.device,
                "keys": {"ed25519": our_ed},
                "recipient": user, "recipient_keys": {"ed25519": d.ed25519.to_base64()},
            });
            if let Some(c) = self
                .olm
                .encrypt(&our_curve, &d.curve25519.to_base64(), &payload)
            {
                messages
                    .entry(user.clone())
                    .or_default()
                    .insert(d.id.clone(), c);
                reached.push((user.clone(), d.id.clone()));
            }
        }
        self.txn += 1;
        let txn = format!("e2ee-{}-{}-{}", std::process::id(), now_ms(), self.txn);
        let path = format!("/sendToDevice/m.room.encrypted/{}", enc(&txn));
        api.call("PUT", &path, Some(&json!({"messages": messages})))?;
        debug_redacted!(
            "matrix: room {room}: session {session_id} shared with {} device(s)",
            reached.len()
        );
        if let Some(out) = self.outbound.get_mut(room) {
            out.shared.extend(reached);
        }
        self.save();
        Ok(())
    }

    /// Starts Olm sessions (`/keys/claim`) with the devices that have none; a device without
    /// a one-time key, or whose key is not signed by it, is skipped (logged).
    fn claim_sessions(&mut self, api: &Api, targets: &[(String, Device)]) -> Result<(), ApiError> {
        let mut ask: HashMap<&str, Map<String, Value>> = HashMap::new();
        for (u, d) in targets {
            if !self.olm.has(&d.curve25519.to_base64()) {
                ask.entry(u.as_str())
                    .or_default()
                    .insert(d.id.clone(), json!("signed_curve25519"));
            }
        }
        if ask.is_empty() {
            return Ok(());
        }
        debug_redacted!(
            "matrix: claiming one-time keys of {} device(s) to start Olm sessions",
            ask.values().map(Map::len).sum::<usize>()
        );
        let answer = api.call("POST", "/keys/claim", Some(&json!({"one_time_keys": ask})))?;
        for (u, d) in targets {
            if self.olm.has(&d.curve25519.to_base64()) {
                continue;
            }
            let otk = answer["one_time_keys"][u.as_str()][d.id.as_str()]
                .as_object()
                .and_then(|m| m.values().next())
                .filter(|k| keys::signature_valid(k, u, &d.id, &d.ed25519))
                .and_then(|k| k["key"].as_str())
                .and_then(|k| Curve25519PublicKey::from_base64(k).ok());
            let Some(otk) = otk else {
                warn_limited!(
                    "matrix: device {} of {u}: no signed one-time key; it gets no room keys",
                    d.id
                );
                continue;
            };
            match self
                .account
                .create_outbound_session(OlmConfig::version_1(), d.curve25519, otk)
            {
                Ok(s) => self.olm.add(&d.curve25519.to_base64(), s),
                Err(e) => warn_limited!("matrix: device {} of {u}: no Olm session: {e}", d.id),
            }
        }
        Ok(())
    }
}

/// The joined members of `room`.
fn joined_members(api: &Api, room: &str) -> Result<Vec<String>, ApiError> {
    let v = api.call("GET", &format!("/rooms/{}/joined_members", enc(room)), None)?;
    v["joined"]
        .as_object()
        .map(|m| m.keys().cloned().collect())
        .ok_or_else(|| ApiError::BadResponse("joined_members: no `joined` object".into()))
}

fn now_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}
