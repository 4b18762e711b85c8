//! The crypto state kept in `--state-dir` (`matrix-e2ee.json`): the Olm account and every
//! Olm and inbound Megolm session, each pickled (encrypted) with the key from the variable
//! named by `--pickle-key-env`. Outbound room sessions are not kept: a restarted bridge
//! starts new ones and shares them, which costs the humans' clients nothing.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use vodozemac::megolm::{InboundGroupSession, InboundGroupSessionPickle};
use vodozemac::olm::{Account, AccountPickle, Session, SessionPickle};

use super::megolm::{Inbound, SessionRef};
use super::olm::OlmSessions;

/// The file in the state directory.
const FILE: &str = "matrix-e2ee.json";

/// Where the crypto state is written, and the key it is pickled with. Never logged.
pub(crate) struct Store {
    path: PathBuf,
    key: [u8; 32],
}

/// What a state file held.
pub(crate) struct Loaded {
    pub account: Account,
    pub olm: Vec<(String, Session)>,
    pub megolm: Vec<(SessionRef, InboundGroupSession)>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl Store {
    /// The store in `dir`, pickled with the SHA-256 of `secret`.
    pub(crate) fn new(dir: &Path, secret: &str) -> Store {
        use sha2::Digest;
        Store {
            path: dir.join(FILE),
            key: sha2::Sha256::digest(secret.as_bytes()).into(),
        }
    }

    /// The state kept for `user`'s `device`, if any. A file of another device (a new access
    /// token) is set aside as `.old` (logged); one that does not unpickle is an error (a wrong
    /// pickle key must not silently make a new device).
    pub(crate) fn load(&self, user: &str, device: &str) -> Result<Option<Loaded>, String> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("cannot read {}: {e}", self.path.display())),
        };
        let bad = |what: &str| {
            format!(
                "{}: {what} (a different --pickle-key-env value?)",
                self.path.display()
            )
        };
        let v: Value = serde_json::from_str(&text).map_err(|_| bad("not JSON"))?;
        if v["user"] != user || v["device"] != device {
            let old = self.path.with_extension("old");
            warn_limited!(
                "matrix: {} belongs to device {} of {}, not this access token's device {device}: set aside as {}, a new device starts",
                self.path.display(),
                v["device"],
                v["user"],
                old.display()
            );
            std::fs::rename(&self.path, &old)
                .map_err(|e| format!("cannot move {}: {e}", self.path.display()))?;
            return Ok(None);
        }
        let account = v["account"]
            .as_str()
            .and_then(|p| AccountPickle::from_encrypted(p, &self.key).ok())
            .map(Account::from_pickle)
            .ok_or_else(|| bad("the account does not unpickle"))?;
        let mut olm = Vec::new();
        for s in v["olm"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
            let (Some(peer), Some(p)) = (s["peer"].as_str(), s["pickle"].as_str()) else {
                continue;
            };
            let session = SessionPickle::from_encrypted(p, &self.key)
                .map_err(|_| bad("an Olm session does not unpickle"))?;
            olm.push((peer.to_owned(), Session::from_pickle(session)));
        }
        let mut megolm = Vec::new();
        for s in v["megolm"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
            let (Some(room), Some(sender_key), Some(session_id), Some(p)) = (
                s["room"].as_str(),
                s["sender_key"].as_str(),
                s["session_id"].as_str(),
                s["pickle"].as_str(),
            ) else {
                continue;
            };
            let session = InboundGroupSessionPickle::from_encrypted(p, &self.key)
                .map_err(|_| bad("a room session does not unpickle"))?;
            let r = SessionRef {
                room: room.into(),
                sender_key: sender_key.into(),
                session_id: session_id.into(),
            };
            megolm.push((r, InboundGroupSession::from_pickle(session)));
        }
        Ok(Some(Loaded {
            account,
            olm,
            megolm,
        }))
    }

    /// Writes everything (atomically: a crash leaves the old file or the new one).
    pub(crate) fn save(
        &self,
        user: &str,
        device: &str,
        account: &Account,
        olm: &OlmSessions,
        inbound: &Inbound,
    ) -> Result<(), String> {
        let olm: Vec<Value> = olm
            .all()
            .map(|(peer, s)| json!({"peer": peer, "pickle": s.pickle().encrypt(&self.key)}))
            .collect();
        let megolm: Vec<Value> = inbound
            .all()
            .map(|(r, s)| {
                json!({"room": r.room, "sender_key": r.sender_key, "session_id": r.session_id,
                       "pickle": s.pickle().encrypt(&self.key)})
            })
            .collect();
        let v = json!({
            "version": 1,
            "user": user,
            "device": device,
            "account": account.pickle().encrypt(&self.key),
            "olm": olm,
            "megolm": megolm,
        });
        crate::platforms::matrix::state::write_atomically(&self.path, &v.to_string())
            .map_err(|e| format!("cannot write {}: {e}", self.path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_account_comes_back_only_with_the_same_key_and_device() {
        let dir = tempfile::tempdir().expect("dir");
        let account = Account::new();
        let ed = account.ed25519_key();
        let store = Store::new(dir.path(), "secret one");
        store
            .save(
                "@b:hs",
                "DEV",
                &account,
                &OlmSessions::new(4),
                &Inbound::new(4),
            )
            .expect("save");
        let text = std::fs::read_to_string(dir.path().join(FILE)).expect("read");
        assert!(
            !text.contains("secret one"),
            "the pickle key is not in the file"
        );
        let back = store.load("@b:hs", "DEV").expect("load").expect("kept");
        assert_eq!(back.account.ed25519_key(), ed);
        let e = Store::new(dir.path(), "another")
            .load("@b:hs", "DEV")
            .err()
            .expect("wrong key");
        assert!(
            e.contains("pickle-key-env") && !e.contains("another"),
            "{e}"
        );
        assert!(
            store.load("@b:hs", "NEWDEV").expect("load").is_none(),
            "another device starts anew"
        );
        assert!(dir.path().join("matrix-e2ee.old").exists());
    }
}
