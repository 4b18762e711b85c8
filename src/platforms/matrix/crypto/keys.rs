//! Signed JSON and the bot's published keys: Matrix's canonical JSON, the device keys and
//! one-time keys `/keys/upload` takes, and checking another device's self-signature.

use serde_json::{Map, Value, json};
use vodozemac::olm::Account;
use vodozemac::{Curve25519PublicKey, Ed25519PublicKey, Ed25519Signature};

/// The Olm algorithm name (to-device encryption).
pub(crate) const OLM: &str = "m.olm.v1.curve25519-aes-sha2";
/// The Megolm algorithm name (room encryption).
pub(crate) const MEGOLM: &str = "m.megolm.v1.aes-sha2";

/// Matrix's canonical JSON: keys sorted at every level, no spaces (serde_json writes UTF-8
/// unescaped and the shortest number forms).
pub(crate) fn canonical(v: &Value) -> String {
    fn sorted(v: &Value) -> Value {
        match v {
            Value::Object(m) => {
                let mut keys: Vec<&String> = m.keys().collect();
                keys.sort();
                let mut out = Map::new();
                for k in keys {
                    out.insert(k.clone(), sorted(&m[k]));
                }
                Value::Object(out)
            }
            Value::Array(a) => Value::Array(a.iter().map(sorted).collect()),
            other => other.clone(),
        }
    }
    sorted(v).to_string()
}

/// `object` with `signatures.{user}.ed25519:{device}` added: the account's signature over
/// its canonical form without `signatures` and `unsigned`.
pub(crate) fn signed(account: &Account, user: &str, device: &str, mut object: Value) -> Value {
    let mut bare = object.clone();
    if let Some(m) = bare.as_object_mut() {
        m.remove("signatures");
        m.remove("unsigned");
    }
    let signature = account.sign(canonical(&bare)).to_base64();
    object["signatures"][user][format!("ed25519:{device}")] = json!(signature);
    object
}

/// Whether `object` carries a valid signature of `user`'s `device` made with `key`.
pub(crate) fn signature_valid(
    object: &Value,
    user: &str,
    device: &str,
    key: &Ed25519PublicKey,
) -> bool {
    let Some(sig) = object["signatures"][user][format!("ed25519:{device}")].as_str() else {
        return false;
    };
    let Ok(sig) = Ed25519Signature::from_base64(sig) else {
        return false;
    };
    let mut bare = object.clone();
    if let Some(m) = bare.as_object_mut() {
        m.remove("signatures");
        m.remove("unsigned");
    }
    key.verify(canonical(&bare).as_bytes(), &sig).is_ok()
}

/// The bot's signed device keys for `/keys/upload`.
pub(crate) fn device_keys(account: &Account, user: &str, device: &str) -> Value {
    let ids = account.identity_keys();
    signed(
        account,
        user,
        device,
        json!({
            "user_id": user,
            "device_id": device,
            "algorithms": [OLM, MEGOLM],
            "keys": {
                format!("curve25519:{device}"): ids.curve25519.to_base64(),
                format!("ed25519:{device}"): ids.ed25519.to_base64(),
            },
        }),
    )
}

/// The account's unpublished one-time keys, signed, for `/keys/upload`.
pub(crate) fn one_time_keys(account: &Account, user: &str, device: &str) -> Value {
    let mut out = Map::new();
    for (id, key) in account.one_time_keys() {
        let body = signed(account, user, device, json!({"key": key.to_base64()}));
        out.insert(format!("signed_curve25519:{}", id.to_base64()), body);
    }
    Value::Object(out)
}

/// The account's unpublished fallback key, signed, for `/keys/upload`.
pub(crate) fn fallback_keys(account: &Account, user: &str, device: &str) -> Value {
    let mut out = Map::new();
    for (id, key) in account.fallback_key() {
        let body = signed(
            account,
            user,
            device,
            json!({"key": key.to_base64(), "fallback": true}),
        );
        out.insert(format!("signed_curve25519:{}", id.to_base64()), body);
    }
    Value::Object(out)
}

/// Another user's device, as `/keys/query` answered it, its self-signature checked.
#[derive(Clone, Debug)]
pub(crate) struct Device {
    /// The device id.
    pub id: String,
    /// Its Olm identity key.
    pub curve25519: Curve25519PublicKey,
    /// Its signing key.
    pub ed25519: Ed25519PublicKey,
}

/// One device entry of a `/keys/query` answer; `None` (the caller logs it) when it is not
/// `user`'s `device`, lacks a key or its self-signature does not verify.
pub(crate) fn parse_device(user: &str, device: &str, v: &Value) -> Option<Device> {
    if v["user_id"] != user || v["device_id"] != device {
        return None;
    }
    let curve = v["keys"][format!("curve25519:{device}")].as_str()?;
    let ed = v["keys"][format!("ed25519:{device}")].as_str()?;
    let curve25519 = Curve25519PublicKey::from_base64(curve).ok()?;
    let ed25519 = Ed25519PublicKey::from_base64(ed).ok()?;
    signature_valid(v, user, device, &ed25519).then(|| Device {
        id: device.to_owned(),
        curve25519,
        ed25519,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_json_sorts_keys_at_every_level() {
        let v = json!({"b": 1, "a": {"d": [{"z": 1, "y": 2}], "c": "é"}});
        assert_eq!(
            canonical(&v),
            r#"{"a":{"c":"é","d":[{"y":2,"z":1}]},"b":1}"#
        );
    }

    #[test]
    fn device_keys_verify_and_a_changed_key_does_not() {
        let account = Account::new();
        let keys = device_keys(&account, "@bot:hs", "DEV");
        let parsed = parse_device("@bot:hs", "DEV", &keys).expect("self-signed keys verify");
        assert_eq!(parsed.curve25519, account.curve25519_key());
        let mut forged = keys.clone();
        forged["keys"]["curve25519:DEV"] = json!(Account::new().curve25519_key().to_base64());
        assert!(
            parse_device("@bot:hs", "DEV", &forged).is_none(),
            "a swapped key is refused"
        );
        assert!(
            parse_device("@eve:hs", "DEV", &keys).is_none(),
            "another user's claim is refused"
        );
    }
}
