//! End-to-end encrypted rooms (Olm/Megolm with `vodozemac`), over the Client-Server API the
//! bridge already speaks.
//!
//! The sync thread hands every `/sync` answer to [`Crypto::on_sync`] before reading it: the
//! to-device room keys are decrypted (Olm) and kept, the one-time keys topped up, and each
//! `m.room.encrypted` event is rewritten in place into the event it carries (Megolm), so the
//! rest of the bridge reads it like any other. An event whose key has not come waits
//! (bounded) and is put into a later answer once its key arrives; past
//! [`E2eeConfig::notice_after`] the room is told once. The main loop's sends go through
//! [`Crypto::encrypt`] (in `outbound`): in an encrypted room the content is encrypted with
//! the room's outbound session, first shared over Olm with every joined member's devices.
//!
//! Trust: on first use (any device whose keys carry its own valid signature gets the room
//! key), or only the devices `--matrix-require-verified` lists ([`trust`]); there is no
//! interactive verification and no cross-signing (see docs/platforms.md).

mod keys;
mod megolm;
mod olm;
mod outbound;
mod store;
mod trust;

pub(crate) use trust::Verified;

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use vodozemac::megolm::{ExportedSessionKey, InboundGroupSession, SessionConfig, SessionKey};
use vodozemac::olm::Account;

use super::api::{Api, ApiError};
use megolm::{Inbound, Pending, SessionRef, Undecryptable, Waiting};
use olm::{Decrypted, OlmSessions};
use store::Store;

/// The encryption settings of `turnstile bridge matrix`.
#[derive(Clone, Debug)]
pub(crate) struct E2eeConfig {
    /// The secret the state is pickled with (from `--pickle-key-env`). Never logged.
    pub pickle_secret: Option<String>,
    /// How long an undecryptable event waits before its room is told.
    pub notice_after: Duration,
    /// Undecryptable events kept for a retry at most (`--max-undecryptable`).
    pub max_pending: usize,
    /// Inbound room sessions kept per room at most.
    pub sessions_per_room: usize,
    /// Other devices with Olm sessions at most.
    pub max_devices: usize,
    /// The only devices trusted (`--matrix-require-verified`); `None`: trust on first use.
    pub verified: Option<Arc<Verified>>,
}

impl Default for E2eeConfig {
    fn default() -> E2eeConfig {
        E2eeConfig {
            pickle_secret: None,
            notice_after: Duration::from_secs(60),
            max_pending: 256,
            sessions_per_room: 64,
            max_devices: 4096,
            verified: None,
        }
    }
}

/// Key requests sent per sync at most.
const KEY_REQUESTS_PER_SYNC: usize = 16;

/// The text a room sees once when a message's key does not come.
pub(crate) const UNREADABLE_NOTICE: &str = "I can't read this message yet — its encryption key has not reached me. Sending it again, or verifying that your client shares keys with new devices, may help.";

/// The crypto state, shared by the sync thread (receiving) and the main loop (sending).
pub(crate) type Shared = Arc<Mutex<Crypto>>;

/// Locks `c` (a panic elsewhere while it was held leaves the state usable).
pub(crate) fn lock(c: &Shared) -> MutexGuard<'_, Crypto> {
    c.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The bot's device and its sessions.
pub(crate) struct Crypto {
    me: String,
    device: String,
    account: Account,
    olm: OlmSessions,
    inbound: Inbound,
    pending: Pending,
    outbound: HashMap<String, outbound::Outbound>,
    /// Rooms known to be encrypted (with their rotation settings) or known not to be.
    rooms: HashMap<String, Option<outbound::Rotation>>,
    /// Other users' devices, as `/keys/query` answered.
    devices: HashMap<String, Vec<keys::Device>>,
    /// Users whose device list changed since it was asked for.
    stale: HashSet<String>,
    /// Rooms already told about an unreadable message.
    told: HashSet<String>,
    /// Key requests to send after this sync: the sender, its device and the session.
    requests: Vec<(String, String, SessionRef)>,
    /// Sessions whose key was already asked for.
    asked: HashSet<SessionRef>,
    store: Option<Store>,
    config: E2eeConfig,
    txn: u64,
}

impl std::fmt::Debug for Crypto {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Crypto")
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

/// A notice for a room whose message cannot be read: the event it answers.
#[derive(Debug)]
pub(crate) struct Unreadable {
    pub room: String,
    pub event_id: String,
}

impl Crypto {
    /// The bot's device: the account kept in `state_dir` (pickled with the configured
    /// secret) or a new one, its keys published.
    pub(crate) fn start(
        api: &Api,
        me: &str,
        state_dir: Option<&Path>,
        config: &E2eeConfig,
    ) -> Result<Crypto, String> {
        let whoami = api
            .call("GET", "/account/whoami", None)
            .map_err(|e| e.to_string())?;
        let device = whoami["device_id"]
            .as_str()
            .ok_or("the access token has no device (whoami names none)")?
            .to_owned();
        let store = match (state_dir, &config.pickle_secret) {
            (Some(dir), Some(secret)) => Some(Store::new(dir, secret)),
            (Some(_), None) => {
                warn_limited!(
                    "matrix: --state-dir is set but the pickle key variable (--pickle-key-env) is empty: the encryption keys are not kept, every restart is a new device to the humans' clients"
                );
                None
            }
            (None, _) => {
                warn_limited!(
                    "matrix: no --state-dir: the encryption keys are not kept, every restart is a new device to the humans' clients (messages sent to the old one cannot be read)"
                );
                None
            }
        };
        let loaded = match &store {
            Some(s) => s.load(me, &device)?,
            None => None,
        };
        let mut crypto = Crypto::new(me, &device, store, config);
        let fresh = loaded.is_none();
        if let Some(l) = loaded {
            crypto.account = l.account;
            for (peer, s) in l.olm {
                crypto.olm.add(&peer, s);
            }
            for (r, s) in l.megolm {
                crypto.inbound.add(r, s);
            }
        }
        if fresh {
            crypto.account.generate_fallback_key();
        }
        let count = crypto
            .upload(api, true)
            .map_err(|e| format!("publishing the device keys: {e}"))?;
        crypto.top_up(api, count);
        info_redacted!(
            "matrix: encryption on, device {} ({}), {} room session(s) kept; trust: {}; bounds: {} undecryptable events waiting, {} sessions per room, {} devices with Olm sessions, {KEY_REQUESTS_PER_SYNC} key requests a sync; unreadable messages told after {:?}",
            crypto.device,
            if fresh {
                "new"
            } else {
                "kept from --state-dir"
            },
            crypto.inbound.len(),
            match &config.verified {
                Some(list) => format!(
                    "only the {} device(s) --matrix-require-verified lists",
                    list.len()
                ),
                None => "on first use".to_owned(),
            },
            config.max_pending,
            config.sessions_per_room,
            config.max_devices,
            config.notice_after
        );
        Ok(crypto)
    }

    /// A new device's state (no keys published yet).
    fn new(me: &str, device: &str, store: Option<Store>, config: &E2eeConfig) -> Crypto {
        Crypto {
            me: me.to_owned(),
            device: device.to_owned(),
            account: Account::new(),
            olm: OlmSessions::new(config.max_devices),
            inbound: Inbound::new(config.sessions_per_room),
            pending: Pending::new(config.max_pending),
            outbound: HashMap::new(),
            rooms: HashMap::new(),
            devices: HashMap::new(),
            stale: HashSet::new(),
            told: HashSet::new(),
            requests: Vec::new(),
            asked: HashSet::new(),
            store,
            config: config.clone(),
            txn: 0,
        }
    }

    /// Publishes the device keys (with `device_keys`) and the unpublished one-time and
    /// fallback keys; the server's one-time key count.
    fn upload(&mut self, api: &Api, device_keys: bool) -> Result<u64, ApiError> {
        let mut body = json!({
            "one_time_keys": keys::one_time_keys(&self.account, &self.me, &self.device),
            "fallback_keys": keys::fallback_keys(&self.account, &self.me, &self.device),
        });
        if device_keys {
            body["device_keys"] = keys::device_keys(&self.account, &self.me, &self.device);
        }
        let answer = api.call("POST", "/keys/upload", Some(&body))?;
        self.account.mark_keys_as_published();
        self.save();
        Ok(answer["one_time_key_counts"]["signed_curve25519"]
            .as_u64()
            .unwrap_or(0))
    }

    /// Uploads new one-time keys when the server holds fewer than half the most it may.
    fn top_up(&mut self, api: &Api, on_server: u64) {
        let target = (self.account.max_number_of_one_time_keys() / 2) as u64;
        if on_server >= target {
            return;
        }
        self.account
            .generate_one_time_keys((target - on_server) as usize);
        match self.upload(api, false) {
            Ok(n) => debug_redacted!("matrix: one-time keys topped up to {n}"),
            Err(e) => warn_limited!("matrix: uploading one-time keys failed: {e}"),
        }
    }

    /// Writes the state, if kept (a failure is logged: the next change tries again).
    fn save(&self) {
        if let Some(s) = &self.store
            && let Err(e) = s.save(
                &self.me,
                &self.device,
                &self.account,
                &self.olm,
                &self.inbound,
            )
        {
            error_limited!("matrix: the encryption state was not saved: {e}");
        }
    }

    /// Reads one sync answer before the bridge does: keys in, encrypted events decrypted in
    /// place, waiting events whose key came appended to their room's timeline. `first`: the
    /// backlog sync (its room events are not answered, so not kept either). The rooms to tell
    /// that a message cannot be read.
    pub(crate) fn on_sync(
        &mut self,
        api: &Api,
        sync: &mut Value,
        first: bool,
        now: Instant,
    ) -> Vec<Unreadable> {
        let keys_came = self.take_to_device(api, &sync["to_device"]["events"]);
        for user in sync["device_lists"]["changed"]
            .as_array()
            .into_iter()
            .flatten()
        {
            if let Some(u) = user.as_str() {
                self.stale.insert(u.to_owned());
            }
        }
        for user in sync["device_lists"]["left"]
            .as_array()
            .into_iter()
            .flatten()
        {
            if let Some(u) = user.as_str() {
                self.devices.remove(u);
            }
        }
        if let Some(n) = sync["device_one_time_keys_count"]["signed_curve25519"].as_u64() {
            self.top_up(api, n);
        }
        if let Some(types) = sync["device_unused_fallback_key_types"].as_array()
            && !types.iter().any(|t| t == "signed_curve25519")
        {
            self.account.generate_fallback_key();
            if let Err(e) = self.upload(api, false) {
                warn_limited!("matrix: uploading a fallback key failed: {e}");
            }
        }
        if let Some(joined) = sync["rooms"]["join"].as_object_mut() {
            for (room, entry) in joined.iter_mut() {
                self.room_events(room, entry, first, now);
            }
        }
        if keys_came {
            self.retry(sync);
        }
        self.send_key_requests(api);
        self.unreadable(now)
    }

    /// Decrypts the to-device events and takes the room keys they carry (under
    /// `--matrix-require-verified`, only those of listed devices); true when one was kept.
    fn take_to_device(&mut self, api: &Api, events: &Value) -> bool {
        let our_key = self.account.curve25519_key().to_base64();
        let mut decrypted = Vec::new();
        for ev in events.as_array().into_iter().flatten() {
            if ev["type"] != "m.room.encrypted" {
                continue;
            }
            let sender = ev["sender"].as_str().unwrap_or_default();
            match self
                .olm
                .decrypt(&mut self.account, &our_key, &ev["content"])
            {
                Ok(d) => decrypted.push((sender.to_owned(), d)),
                Err(why) => {
                    warn_limited!("matrix: a to-device message from {sender} not decrypted: {why}")
                }
            }
        }
        let mut came = false;
        for (sender, d) in self.trusted_keys(api, decrypted) {
            came |= self.room_key(&sender, d);
        }
        if came || !events.as_array().is_none_or(Vec::is_empty) {
            self.save();
        }
        came
    }

    /// Takes a decrypted `m.room_key` or `m.forwarded_room_key`; true when kept.
    fn room_key(&mut self, sender: &str, d: Decrypted) -> bool {
        let p = &d.payload;
        let ours = self.account.ed25519_key().to_base64();
        if p["sender"] != sender
            || p["recipient"] != self.me.as_str()
            || p["recipient_keys"]["ed25519"] != ours.as_str()
        {
            warn_limited!(
                "matrix: a to-device message from {sender} names another sender or recipient; ignored"
            );
            return false;
        }
        let c = &p["content"];
        let (Some(room), Some(session_id)) = (c["room_id"].as_str(), c["session_id"].as_str())
        else {
            return false;
        };
        if c["algorithm"] != keys::MEGOLM {
            return false;
        }
        let (session, sender_key) = match p["type"].as_str() {
            Some("m.room_key") => match c["session_key"].as_str().map(SessionKey::from_base64) {
                Some(Ok(k)) => (
                    InboundGroupSession::new(&k, SessionConfig::version_1()),
                    d.sender_key,
                ),
                _ => return false,
            },
            Some("m.forwarded_room_key") => {
                match (
                    c["session_key"]
                        .as_str()
                        .map(ExportedSessionKey::from_base64),
                    c["sender_key"].as_str(),
                ) {
                    (Some(Ok(k)), Some(original)) => (
                        InboundGroupSession::import(&k, SessionConfig::version_1()),
                        original.to_owned(),
                    ),
                    _ => return false,
                }
            }
            _ => return false,
        };
        if session.session_id() != session_id {
            warn_limited!(
                "matrix: room {room}: a room key from {sender} does not match its session id; ignored"
            );
            return false;
        }
        debug_redacted!("matrix: room {room}: key of session {session_id} from {sender}");
        let r = SessionRef {
            room: room.to_owned(),
            sender_key,
            session_id: session_id.to_owned(),
        };
        self.inbound.add(r, session);
        true
    }

    /// One joined room's events: encryption turned on noticed, member changes rotate the
    /// outbound session, encrypted events decrypted in place (or kept to retry).
    fn room_events(&mut self, room: &str, entry: &mut Value, first: bool, now: Instant) {
        for ev in entry["state"]["events"].as_array().into_iter().flatten() {
            self.room_state(room, ev);
        }
        let Some(events) = entry["timeline"]["events"].as_array_mut() else {
            return;
        };
        for ev in events.iter_mut() {
            self.room_state(room, ev);
            if ev["type"] != "m.room.encrypted" || first || ev["sender"] == self.me.as_str() {
                continue;
            }
            self.rooms
                .entry(room.to_owned())
                .or_insert_with(|| Some(outbound::Rotation::default()));
            match self.inbound.decrypt(room, ev) {
                Ok(plain) => reveal(ev, plain),
                Err(Undecryptable::MissingKey(session)) => {
                    self.want_key(ev, &session);
                    debug_redacted!(
                        "matrix: room {room}: session {} unknown yet; the event waits",
                        session.session_id
                    );
                    self.pending.push(Waiting {
                        room: room.to_owned(),
                        event: ev.clone(),
                        session,
                        since: now,
                    });
                }
                Err(Undecryptable::Bad(why)) => {
                    warn_limited!(
                        "matrix: room {room}: event {} not decrypted: {why}",
                        ev["event_id"]
                    );
                }
            }
        }
    }

    /// A state event of `room`: `m.room.encryption` turns it encrypted; a member leaving
    /// retires the room's outbound session (the next message uses a new one).
    fn room_state(&mut self, room: &str, ev: &Value) {
        match ev["type"].as_str() {
            Some("m.room.encryption") if ev["content"]["algorithm"] == keys::MEGOLM => {
                self.rooms.insert(
                    room.to_owned(),
                    Some(outbound::Rotation::from_content(&ev["content"])),
                );
            }
            Some("m.room.member")
                if matches!(ev["content"]["membership"].as_str(), Some("leave" | "ban")) =>
            {
                self.outbound.remove(room);
            }
            _ => {}
        }
    }

    /// Queues a key request (`m.room_key_request`) for the session of `ev`, once per session
    /// (none under `--matrix-require-verified`: the answer, a forwarded key, would be refused).
    fn want_key(&mut self, ev: &Value, session: &SessionRef) {
        if self.asked.contains(session) || self.config.verified.is_some() {
            return;
        }
        if self.asked.len() >= self.config.max_pending.max(1024) {
            self.asked.clear();
        }
        self.asked.insert(session.clone());
        let sender = ev["sender"].as_str().unwrap_or_default().to_owned();
        let device = ev["content"]["device_id"]
            .as_str()
            .unwrap_or("*")
            .to_owned();
        self.requests.push((sender, device, session.clone()));
    }

    /// Sends this sync's key requests ([`Crypto::key_request_batch`]).
    fn send_key_requests(&mut self, api: &Api) {
        let messages = self.key_request_batch();
        if messages.is_empty() {
            return;
        }
        let path = format!(
            "/sendToDevice/m.room_key_request/{}",
            super::api::enc(&format!("{}-kr-{}", self.device, self.txn))
        );
        if let Err(e) = api.call("PUT", &path, Some(&json!({"messages": messages}))) {
            warn_limited!("matrix: sending key requests failed: {e}");
        }
    }

    /// This sync's key requests, by user and device: at most [`KEY_REQUESTS_PER_SYNC`], one
    /// per device (a `/sendToDevice` carries one message per device). The others wait for
    /// the next sync, at most [`E2eeConfig::max_pending`] of them (past it the oldest are
    /// dropped, logged: their events still wait, and the sender may share the key unasked).
    fn key_request_batch(&mut self) -> HashMap<String, serde_json::Map<String, Value>> {
        let mut messages: HashMap<String, serde_json::Map<String, Value>> = HashMap::new();
        let mut later = Vec::new();
        let mut taken = 0;
        for (sender, device, s) in std::mem::take(&mut self.requests) {
            let busy = messages
                .get(&sender)
                .is_some_and(|m| m.contains_key(&device));
            if taken >= KEY_REQUESTS_PER_SYNC || busy {
                later.push((sender, device, s));
                continue;
            }
            self.txn += 1;
            let body = json!({
                "action": "request",
                "requesting_device_id": self.device,
                "request_id": format!("{}-{}", self.device, self.txn),
                "body": {"algorithm": keys::MEGOLM, "room_id": s.room, "sender_key": s.sender_key, "session_id": s.session_id},
            });
            messages.entry(sender).or_default().insert(device, body);
            taken += 1;
        }
        let dropped = later.len().saturating_sub(self.config.max_pending);
        if dropped > 0 {
            later.drain(..dropped);
            warn_limited!(
                "matrix: {dropped} key request(s) dropped unsent: at most {KEY_REQUESTS_PER_SYNC} a sync and {} waiting",
                self.config.max_pending
            );
        }
        self.requests = later;
        debug_assert!(taken <= KEY_REQUESTS_PER_SYNC);
        debug_assert!(self.requests.len() <= self.config.max_pending);
        messages
    }

    /// Puts waiting events whose key has come into their room's timeline in `sync`.
    fn retry(&mut self, sync: &mut Value) {
        let inbound = &self.inbound;
        let ready = self
            .pending
            .take(|w| inbound.all().any(|(r, _)| *r == w.session));
        for mut w in ready {
            match self.inbound.decrypt(&w.room, &w.event) {
                Ok(plain) => {
                    reveal(&mut w.event, plain);
                    let timeline =
                        &mut sync["rooms"]["join"][w.room.as_str()]["timeline"]["events"];
                    if !timeline.is_array() {
                        *timeline = json!([]);
                    }
                    if let Some(list) = timeline.as_array_mut() {
                        list.push(w.event);
                    }
                }
                Err(e) => warn_limited!(
                    "matrix: room {}: a waiting event still not decrypted: {e:?}",
                    w.room
                ),
            }
        }
    }

    /// Rooms to tell (once each) that a message waited past `notice_after`.
    fn unreadable(&mut self, now: Instant) -> Vec<Unreadable> {
        let mut out = Vec::new();
        let due: Vec<(String, String, String)> = self
            .pending
            .iter()
            .filter(|w| {
                now.duration_since(w.since) >= self.config.notice_after
                    && !self.told.contains(&w.room)
            })
            .map(|w| {
                (
                    w.room.clone(),
                    w.event["event_id"].as_str().unwrap_or_default().to_owned(),
                    w.session.session_id.clone(),
                )
            })
            .collect();
        for (room, event_id, session_id) in due {
            if self.told.len() >= self.config.max_pending.max(1024) {
                self.told.clear();
            }
            if !self.told.insert(room.clone()) {
                continue;
            }
            warn_limited!(
                "matrix: room {room}: event {event_id} unreadable for {:?}: the key of session {session_id} has not come",
                self.config.notice_after
            );
            out.push(Unreadable { room, event_id });
        }
        out
    }
}

/// Rewrites an `m.room.encrypted` event in place into the event it carries; a relation in
/// the cleartext (where clients put it for the server) stays when the payload has none.
fn reveal(ev: &mut Value, plain: Value) {
    let relates = ev["content"]["m.relates_to"].clone();
    ev["type"] = plain["type"].clone();
    ev["content"] = plain["content"].clone();
    if !relates.is_null() && ev["content"].is_object() && ev["content"]["m.relates_to"].is_null() {
        ev["content"]["m.relates_to"] = relates;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vodozemac::megolm::GroupSession;

    const ROOM: &str = "!r:hs";

    fn encrypted(out: &mut GroupSession, id: &str, body: &str) -> Value {
        let plain = json!({"type": "m.room.message", "room_id": ROOM, "content": {"msgtype": "m.text", "body": body}});
        json!({"type": "m.room.encrypted", "event_id": id, "sender": "@ann:hs", "content": {
            "algorithm": keys::MEGOLM, "sender_key": "SK", "session_id": out.session_id(),
            "ciphertext": out.encrypt(plain.to_string()).to_base64()}})
    }

    fn sync_with(events: Vec<Value>) -> Value {
        json!({"next_batch": "b", "rooms": {"join": {ROOM: {"timeline": {"events": events}}}}})
    }

    #[test]
    fn a_waiting_event_is_decrypted_into_the_sync_its_key_comes_in_and_the_room_is_told_once() {
        let config = E2eeConfig {
            notice_after: Duration::from_secs(5),
            ..E2eeConfig::default()
        };
        let mut c = Crypto::new("@bot:hs", "DEV", None, &config);
        let mut out = GroupSession::new(SessionConfig::version_1());
        let key = out.session_key();
        let t0 = Instant::now();
        let mut first = sync_with(vec![
            encrypted(&mut out, "$a", "one"),
            encrypted(&mut out, "$b", "two"),
        ]);
        c.room_events(ROOM, &mut first["rooms"]["join"][ROOM], false, t0);
        assert_eq!(
            first["rooms"]["join"][ROOM]["timeline"]["events"][0]["type"],
            "m.room.encrypted"
        );
        assert!(
            c.unreadable(t0 + Duration::from_secs(4)).is_empty(),
            "not before the timeout"
        );
        let told = c.unreadable(t0 + Duration::from_secs(5));
        assert_eq!(told.len(), 1, "two waiting events, one notice for the room");
        assert_eq!(told[0].event_id, "$a");
        assert!(
            c.unreadable(t0 + Duration::from_secs(60)).is_empty(),
            "the room is told once"
        );

        let r = SessionRef {
            room: ROOM.into(),
            sender_key: "SK".into(),
            session_id: out.session_id(),
        };
        c.inbound.add(
            r,
            InboundGroupSession::new(&key, SessionConfig::version_1()),
        );
        let mut later = json!({"next_batch": "c"});
        c.retry(&mut later);
        let events = &later["rooms"]["join"][ROOM]["timeline"]["events"];
        assert_eq!(events[0]["type"], "m.room.message");
        assert_eq!(events[0]["content"]["body"], "one");
        assert_eq!(events[1]["content"]["body"], "two");
        assert_eq!(c.pending.len(), 0);
    }

    #[test]
    fn key_requests_are_bounded_per_sync_one_per_device_and_the_rest_wait_bounded() {
        let config = E2eeConfig {
            max_pending: 30,
            ..E2eeConfig::default()
        };
        let mut c = Crypto::new("@bot:hs", "DEV", None, &config);
        let ask = |c: &mut Crypto, device: &str, session: &str| {
            let ev = json!({"sender": "@ann:hs", "content": {"device_id": device}});
            let r = SessionRef {
                room: ROOM.into(),
                sender_key: "SK".into(),
                session_id: session.into(),
            };
            c.want_key(&ev, &r);
        };
        for i in 0..20 {
            ask(&mut c, &format!("D{i}"), &format!("s{i}"));
        }
        ask(&mut c, "D0", "again-on-D0");
        let count = |m: &HashMap<String, serde_json::Map<String, Value>>| {
            m.values().map(serde_json::Map::len).sum::<usize>()
        };
        let first = c.key_request_batch();
        assert_eq!(count(&first), KEY_REQUESTS_PER_SYNC, "at most 16 a sync");
        assert_eq!(first["@ann:hs"]["D0"]["body"]["session_id"], "s0");
        assert_eq!(c.requests.len(), 5, "the other five wait for the next sync");
        let second = c.key_request_batch();
        assert_eq!(count(&second), 5);
        assert_eq!(second["@ann:hs"]["D0"]["body"]["session_id"], "again-on-D0");
        assert!(c.key_request_batch().is_empty());

        for i in 0..40 {
            ask(&mut c, "D0", &format!("t{i}"));
        }
        assert_eq!(
            count(&c.key_request_batch()),
            1,
            "one a device a sync: a second would overwrite the first"
        );
        assert_eq!(
            c.requests.len(),
            30,
            "39 wait, bounded to max_pending (30): the oldest dropped"
        );
        assert_eq!(c.requests[0].2.session_id, "t10");
    }

    #[test]
    fn a_member_leaving_retires_the_outbound_session_and_an_invite_does_not() {
        let mut c = Crypto::new("@bot:hs", "DEV", None, &E2eeConfig::default());
        let fresh = || outbound::Outbound::new();
        c.outbound.insert(ROOM.into(), fresh());
        c.room_state(
            ROOM,
            &json!({"type": "m.room.member", "content": {"membership": "invite"}}),
        );
        assert!(c.outbound.contains_key(ROOM));
        c.room_state(
            ROOM,
            &json!({"type": "m.room.member", "content": {"membership": "leave"}}),
        );
        assert!(!c.outbound.contains_key(ROOM));
        c.room_state(ROOM, &json!({"type": "m.room.encryption", "content": {"algorithm": keys::MEGOLM, "rotation_period_msgs": 3}}));
        assert!(
            matches!(c.rooms.get(ROOM), Some(Some(_))),
            "encryption turned on mid-life is followed"
        );
    }
}
