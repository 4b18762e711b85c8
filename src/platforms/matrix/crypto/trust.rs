//! `--matrix-require-verified FILE`: the devices the operator verified out of band, each
//! listed with its Ed25519 key (the "session key" Element shows under Settings → Sessions).
//! With the list, only those devices get the bot's room keys and only their room keys are
//! taken; without it, trust is on first use.
//!
//! A listed key is checked against what `/keys/query` answers: a device counts as listed only
//! when its self-signed device keys carry that Ed25519 key, which binds the Curve25519 key
//! its Olm messages come from. A forwarded room key (`m.forwarded_room_key`) is refused under
//! the list (its session was made by a device the forwarder vouches for, not one the
//! operator listed), so no key requests are sent either.

use std::collections::HashSet;
use std::path::Path;

use serde_json::Value;
use vodozemac::Ed25519PublicKey;

use super::Crypto;
use super::keys::Device;
use super::olm::Decrypted;
use crate::platforms::matrix::api::Api;

/// The listed devices: (user, device id, Ed25519 key in unpadded base64).
#[derive(Debug, Default)]
pub(crate) struct Verified {
    devices: HashSet<(String, String, String)>,
}

impl Verified {
    /// Reads the list from `path` (see [`Verified::parse`]).
    pub(crate) fn load(path: &Path) -> Result<Verified, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        Verified::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// One device a line: `@user:server DEVICEID KEY`, the key in base64 and possibly in
    /// groups separated by spaces (as Element shows it); `#` starts a comment.
    pub(crate) fn parse(text: &str) -> Result<Verified, String> {
        let mut devices = HashSet::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or_default().trim();
            if line.is_empty() {
                continue;
            }
            let mut words = line.split_whitespace();
            let (Some(user), Some(device)) = (words.next(), words.next()) else {
                return Err(format!(
                    "line {}: `@user:server DEVICEID KEY` expected",
                    n + 1
                ));
            };
            let key: String = words.collect();
            if !user.starts_with('@') || !user.contains(':') {
                return Err(format!("line {}: {user:?} is not a Matrix user id", n + 1));
            }
            let key = Ed25519PublicKey::from_base64(&key)
                .map_err(|e| format!("line {}: the Ed25519 key of {device}: {e}", n + 1))?;
            devices.insert((user.to_owned(), device.to_owned(), key.to_base64()));
        }
        Ok(Verified { devices })
    }

    /// How many devices are listed.
    pub(crate) fn len(&self) -> usize {
        self.devices.len()
    }

    /// Whether `user`'s `device` (its keys as `/keys/query` answered, self-signature checked)
    /// is listed with the key it has.
    pub(crate) fn lists(&self, user: &str, device: &Device) -> bool {
        self.devices.contains(&(
            user.to_owned(),
            device.id.clone(),
            device.ed25519.to_base64(),
        ))
    }
}

/// Users whose devices are asked for, per sync, to check room keys' senders at most (one
/// `/keys/query`); the keys of senders past it are refused (logged) and come again when the
/// sender's client re-shares.
const SENDERS_ASKED_PER_SYNC: usize = 100;

impl Crypto {
    /// Under `--matrix-require-verified`, the room keys of `decrypted` whose sending device is
    /// listed (asking `/keys/query` for senders whose devices are not known, once this sync);
    /// without it, all of them.
    pub(super) fn trusted_keys(
        &mut self,
        api: &Api,
        decrypted: Vec<(String, Decrypted)>,
    ) -> Vec<(String, Decrypted)> {
        let Some(list) = self.config.verified.clone() else {
            return decrypted;
        };
        let mut unknown: Vec<String> = decrypted
            .iter()
            .map(|(sender, _)| sender.clone())
            .filter(|s| !self.devices.contains_key(s) || self.stale.contains(s))
            .collect::<HashSet<String>>()
            .into_iter()
            .collect();
        unknown.truncate(SENDERS_ASKED_PER_SYNC);
        if !unknown.is_empty()
            && let Err(e) = self.refresh_devices(api, &unknown)
        {
            warn_limited!("matrix: asking the devices of room keys' senders failed: {e}");
        }
        decrypted
            .into_iter()
            .filter(|(sender, d)| {
                let listed = self.sent_by_listed(&list, sender, d);
                if !listed {
                    warn_limited!(
                        "matrix: a room key from {sender} (device key {}) refused: its device is not in --matrix-require-verified's list (or the key was forwarded)",
                        d.sender_key
                    );
                }
                listed
            })
            .collect()
    }

    /// Whether `d` (an `m.room_key`, not forwarded) came from a listed device of `sender`:
    /// the Olm sender's Curve25519 key is that device's, and so is the Ed25519 key the
    /// payload claims.
    fn sent_by_listed(&self, list: &Verified, sender: &str, d: &Decrypted) -> bool {
        if d.payload["type"] != "m.room_key" {
            return false;
        }
        let claimed: &Value = &d.payload["keys"]["ed25519"];
        self.devices.get(sender).into_iter().flatten().any(|dev| {
            dev.curve25519.to_base64() == d.sender_key
                && *claimed == dev.ed25519.to_base64().as_str()
                && list.lists(sender, dev)
        })
    }

    /// Whether `user`'s `device` may be given the room keys.
    pub(super) fn may_receive_keys(&self, user: &str, device: &Device) -> bool {
        self.config
            .verified
            .as_ref()
            .is_none_or(|list| list.lists(user, device))
    }
}

#[cfg(test)]
mod tests {
    use super::super::E2eeConfig;
    use super::*;
    use serde_json::json;
    use std::sync::Arc;
    use vodozemac::olm::Account;

    fn device(id: &str, account: &Account) -> Device {
        Device {
            id: id.into(),
            curve25519: account.curve25519_key(),
            ed25519: account.ed25519_key(),
        }
    }

    fn key_from(kind: &str, olm_sender: &Account, claimed: &Account) -> Decrypted {
        Decrypted {
            payload: json!({"type": kind, "keys": {"ed25519": claimed.ed25519_key().to_base64()}}),
            sender_key: olm_sender.curve25519_key().to_base64(),
        }
    }

    #[test]
    fn only_room_keys_straight_from_a_listed_device_are_taken_and_only_it_is_given_keys() {
        let (laptop, phone) = (Account::new(), Account::new());
        let list = Verified::parse(&format!(
            "@ann:hs LAPTOP {}",
            laptop.ed25519_key().to_base64()
        ))
        .expect("list");
        let config = E2eeConfig {
            verified: Some(Arc::new(list)),
            ..E2eeConfig::default()
        };
        let mut c = Crypto::new("@bot:hs", "DEV", None, &config);
        let (l, p) = (device("LAPTOP", &laptop), device("PHONE", &phone));
        c.devices
            .insert("@ann:hs".into(), vec![l.clone(), p.clone()]);
        c.devices.insert("@eve:hs".into(), Vec::new());
        // Every sender's devices are known: no `/keys/query` is made.
        let api =
            Api::new("http://127.0.0.1:9", "t", std::time::Duration::from_secs(1)).expect("api");
        let keys = vec![
            (
                "@ann:hs".to_owned(),
                key_from("m.room_key", &laptop, &laptop),
            ),
            ("@ann:hs".to_owned(), key_from("m.room_key", &phone, &phone)),
            (
                "@ann:hs".to_owned(),
                key_from("m.room_key", &phone, &laptop),
            ),
            (
                "@ann:hs".to_owned(),
                key_from("m.forwarded_room_key", &laptop, &laptop),
            ),
            (
                "@eve:hs".to_owned(),
                key_from("m.room_key", &laptop, &laptop),
            ),
        ];
        let kept = c.trusted_keys(&api, keys);
        assert_eq!(kept.len(), 1, "only the laptop's own room key");
        assert_eq!(kept[0].1.sender_key, laptop.curve25519_key().to_base64());
        assert!(c.may_receive_keys("@ann:hs", &l));
        assert!(!c.may_receive_keys("@ann:hs", &p));
        assert!(!c.may_receive_keys("@eve:hs", &l));

        let mut tofu = Crypto::new("@bot:hs", "DEV", None, &E2eeConfig::default());
        assert!(tofu.may_receive_keys("@ann:hs", &p), "on first use: all");
        let all = vec![("@ann:hs".to_owned(), key_from("m.room_key", &phone, &phone))];
        assert_eq!(tofu.trusted_keys(&api, all).len(), 1);
    }

    #[test]
    fn a_list_takes_element_style_keys_and_refuses_what_is_not_a_device_line() {
        let account = Account::new();
        let key = account.ed25519_key().to_base64();
        let grouped: Vec<String> = key
            .as_bytes()
            .chunks(4)
            .map(|c| String::from_utf8_lossy(c).into_owned())
            .collect();
        let text = format!(
            "# verified\n\n@ann:hs  PHONE  {}  # Ann's phone\n",
            grouped.join(" ")
        );
        let list = Verified::parse(&text).expect("parses");
        assert_eq!(list.len(), 1);
        let device = Device {
            id: "PHONE".into(),
            curve25519: account.curve25519_key(),
            ed25519: account.ed25519_key(),
        };
        assert!(list.lists("@ann:hs", &device));
        assert!(!list.lists("@bob:hs", &device), "another user's device");
        let other = Device {
            ed25519: Account::new().ed25519_key(),
            ..device.clone()
        };
        assert!(
            !list.lists("@ann:hs", &other),
            "the same id with another key"
        );
        assert!(Verified::parse("@ann:hs PHONE").is_err(), "no key");
        assert!(Verified::parse("ann PHONE AAAA").is_err(), "not a user id");
        let e = Verified::parse(&format!("@ann:hs PHONE {key}\n@ann:hs X nope")).unwrap_err();
        assert!(e.starts_with("line 2"), "{e}");
    }
}
