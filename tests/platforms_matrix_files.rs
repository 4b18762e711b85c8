//! Matrix files reach the agent (issue 36), against a **real Synapse** (the pinned release
//! `.ci/synapse.sh` installs, whose media is authenticated: only a token may fetch it): a
//! human uploads an image and a text file, the bridge downloads them with the bot's token
//! into the gateway's spool, and the exec agent sees both with matching sha256; a file over
//! `--max-attachment-bytes` is not fetched, the human is told, and the agent sees it named.
//!
//! Without Synapse installed the test says so and passes, except under `.ci/run`
//! (`TURNSTILE_REQUIRE_REAL_SERVERS=1`), where a missing Synapse fails it.

mod common;
mod matrix_files_support;
mod matrix_support;

mod child_support;
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{Value, json};

use matrix_files_support::{FilesRig, agent_answer, upload};
use matrix_support::{User, enc, synapse};

/// The exec agent: each entry's name, and whether the sha256 of the file at its path is the
/// entry's (or why it was skipped).
const AGENT: &str = r#"python3 -c '
import hashlib, json, os
out = []
for a in json.loads(os.environ["TURNSTILE_ATTACHMENTS"]):
    if "path" in a:
        data = open(a["path"], "rb").read()
        out.append([a["name"], a["mime"], len(data), hashlib.sha256(data).hexdigest() == a["sha256"]])
    else:
        out.append([a["name"], a["skipped"]])
print(json.dumps(out))
'"#;

/// Sends a file message (`m.image`, `m.file`) naming `uri`; its event id.
fn send_file(
    user: &User,
    room: &str,
    msgtype: &str,
    name: &str,
    mime: &str,
    uri: &str,
    size: usize,
) -> String {
    static TXN: AtomicU64 = AtomicU64::new(0);
    let txn = format!(
        "f{}-{}",
        std::process::id(),
        TXN.fetch_add(1, Ordering::SeqCst)
    );
    let content = json!({"msgtype": msgtype, "body": name, "url": uri,
                         "info": {"mimetype": mime, "size": size}});
    let v = user
        .call(
            "PUT",
            &format!("/rooms/{}/send/m.room.message/{txn}", enc(room)),
            Some(&content),
        )
        .expect("send");
    v["event_id"].as_str().expect("event_id").to_owned()
}

fn bytes(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
        .collect()
}

#[test]
fn a_humans_image_and_text_file_reach_the_exec_agent_with_matching_sha256() {
    let Some(hs) = synapse() else { return };
    let bot = hs.register("bot", "Turnstile Bot");
    let human = hs.register("ann", "Ann");
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
        &["--max-attachment-bytes", "65536"],
    );
    let log = rig.bridge_log.clone();
    let me = bot.mxid.clone();

    let image = bytes(30_000, 1);
    let text = b"the notes\nline two\n".to_vec();
    let big = bytes(70_000, 2);
    let cases = [
        (
            "m.image",
            "cat.png",
            "image/png",
            image,
            json!([["cat.png", "image/png", 30_000, true]]),
        ),
        (
            "m.file",
            "notes.txt",
            "text/plain",
            text,
            json!([["notes.txt", "text/plain", 19, true]]),
        ),
        (
            "m.file",
            "big.bin",
            "application/octet-stream",
            big,
            json!([["big.bin", "larger than --max-attachment-bytes 65536"]]),
        ),
    ];
    for (msgtype, name, mime, data, expected) in cases {
        let uri = upload(&human, Some(name), mime, &data);
        let after = seen.log.len().saturating_sub(1);
        let event = send_file(&human, &room, msgtype, name, mime, &uri, data.len());
        let answer = agent_answer(&mut seen, after, &me, &event);
        assert_eq!(answer, expected, "{name}");
    }
    // The human was told, once, that the big file was not passed on.
    let told: Vec<&Value> = seen
        .events()
        .map(|(_, ev)| ev)
        .filter(|ev| ev["content"]["msgtype"] == "m.notice")
        .collect();
    assert_eq!(told.len(), 1, "{}", seen.transcript());
    assert_eq!(
        told[0]["content"]["body"],
        "[file not passed on: big.bin: larger than --max-attachment-bytes 65536]"
    );
    let log = std::fs::read_to_string(&log).expect("log");
    assert!(!log.contains(&bot.token), "the access token was logged");
}
