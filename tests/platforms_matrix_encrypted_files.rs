//! Files in encrypted Matrix rooms (issue 36 item 4's stretch), against a **real Synapse**: a
//! message's `content.file` (the Client-Server spec's encrypted attachment: `url`, a JWK
//! `key`, `iv`, `hashes.sha256`) is downloaded with the bot's token, decrypted (AES-256-CTR)
//! as it streams into the spool and checked against its hash. The exec agent sees the
//! plaintext (its SHA-256 is the one the test computed); a file whose hash does not match
//! reaches the agent named, the human told, and the spool keeps nothing of it.
//!
//! The room itself is not encrypted: what the bridge reads is the event's content, the same
//! once a Megolm event is decrypted (tests/platforms_matrix_e2ee.rs covers that part). The
//! ciphertext is a vector made with Python's `cryptography` (src/platforms/matrix/
//! encrypted_file.rs has it too).
//!
//! Without Synapse installed the test says so and passes, except under `.ci/run`
//! (`TURNSTILE_REQUIRE_REAL_SERVERS=1`), where a missing Synapse fails it.

mod common;
mod matrix_files_support;
mod matrix_support;

mod child_support;

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use matrix_files_support::{FilesRig, agent_answer, upload};
use matrix_support::{enc, synapse};

/// The exec agent: each entry's name and the SHA-256 of the file at its path (or why it was
/// skipped).
const AGENT: &str = r#"python3 -c '
import hashlib, json, os
out = []
for a in json.loads(os.environ["TURNSTILE_ATTACHMENTS"]):
    if "path" in a:
        out.append([a["name"], hashlib.sha256(open(a["path"], "rb").read()).hexdigest()])
    else:
        out.append([a["name"], a["skipped"]])
print(json.dumps(out))
'"#;

/// AES-256-CTR of [`plaintext`] with key 0..31 and IV a0..a7 then eight zeros.
const CIPHERTEXT: &str = "de7b755081d76c4eb6e760e393e26f2959bc003fca7262702a1dc73e7c6210c51ebe005dad317834cf60fcb4b84d77e3f6c23099d7fc271f450bdaf56ce666e92c2fb94da39095e6e9f96e26e8486aaf4e5a8a83016e8c5dbaef2c8d922f025b69aaa0ab";
/// SHA-256 of [`CIPHERTEXT`], unpadded base64.
const CIPHERTEXT_SHA256: &str = "fiYpYfPey6xxew/u1CrrC4Q2jnvsjipVNBhxGT+bViM";

fn plaintext() -> Vec<u8> {
    (0..100u32).map(|i| (i * 7 % 256) as u8).collect()
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

/// An `m.file` whose file is encrypted (`content.file`, no top-level `url`).
fn encrypted_file(name: &str, uri: &str, sha256: &str) -> Value {
    json!({
        "msgtype": "m.file",
        "body": name,
        "info": {"mimetype": "application/octet-stream", "size": 100},
        "file": {
            "url": uri,
            "key": {"kty": "oct", "key_ops": ["encrypt", "decrypt"], "alg": "A256CTR",
                    "k": "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8", "ext": true},
            "iv": "oKGio6SlpqcAAAAAAAAAAA",
            "hashes": {"sha256": sha256},
            "v": "v2"
        }
    })
}

#[test]
fn an_encrypted_file_is_decrypted_into_the_spool_and_a_wrong_hash_refused() {
    let Some(hs) = synapse() else { return };
    let bot = hs.register("bot", "Turnstile Bot");
    let human = hs.register("eve", "Eve");
    hs.unlimit(&bot);
    let room = human.create_room(&[&bot.mxid]);
    let mut seen = human.watch(&room);
    let tmp = tempfile::tempdir().expect("tempdir");
    let rig = FilesRig::start(
        hs,
        &bot,
        &mut seen,
        tmp.path(),
        &["--agent", "exec", "--agent-cmd", AGENT],
        &[],
    );
    let (spool, log) = (rig.spool.clone(), rig.bridge_log.clone());
    let me = bot.mxid.clone();

    let uri = upload(&human, None, "application/octet-stream", &hex(CIPHERTEXT));
    let plain_sha = format!("{:x}", Sha256::digest(plaintext()));
    let wrong = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8";
    let cases = [
        (
            encrypted_file("secret.bin", &uri, CIPHERTEXT_SHA256),
            json!([["secret.bin", plain_sha]]),
        ),
        (
            encrypted_file("tampered.bin", &uri, wrong),
            json!([[
                "tampered.bin",
                "download failed: the encrypted file's SHA-256 is not the one its event gives"
            ]]),
        ),
    ];
    for (i, (content, expected)) in cases.into_iter().enumerate() {
        let after = seen.log.len().saturating_sub(1);
        let v = human
            .call(
                "PUT",
                &format!("/rooms/{}/send/m.room.message/enc{i}", enc(&room)),
                Some(&content),
            )
            .expect("send");
        let event = v["event_id"].as_str().expect("event_id").to_owned();
        let answer = agent_answer(&mut seen, after, &me, &event);
        assert_eq!(answer, expected, "case {i}");
    }
    let told: Vec<&Value> = seen
        .events()
        .map(|(_, ev)| ev)
        .filter(|ev| ev["content"]["msgtype"] == "m.notice")
        .collect();
    assert_eq!(told.len(), 1, "{}", seen.transcript());
    assert!(
        told[0]["content"]["body"]
            .as_str()
            .is_some_and(|b| b.starts_with("[file not passed on: tampered.bin: ")),
        "{}",
        told[0]
    );
    let left: Vec<_> = std::fs::read_dir(&spool)
        .expect("spool")
        .filter_map(|e| e.ok().map(|e| e.file_name()))
        .collect();
    assert!(
        left.iter().all(|n| !n.to_string_lossy().ends_with(".part")),
        "a partial file left: {left:?}"
    );
    let log = std::fs::read_to_string(&log).expect("log");
    assert!(!log.contains(&bot.token), "the access token was logged");
    assert!(
        !log.contains("AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8"),
        "the file's key was logged"
    );
}
