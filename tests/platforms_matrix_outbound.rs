//! Agents send files back (issue 36 row 3), against a **real Synapse** (`.ci/synapse.sh`'s
//! pinned release): a process agent attaches a file from its turn's outbox, the bridge
//! uploads it (`/_matrix/media/v3/upload`) and posts an `m.image` before it confirms the
//! reply, and the human downloads it byte for byte; files past `--max-attachment-bytes` or
//! the spool's room are left out with the human told in the reply; a path outside the outbox
//! is refused, said; each reply's files leave the spool once it is delivered.
//!
//! Without Synapse installed the test says so and passes, except under `.ci/run`
//! (`TURNSTILE_REQUIRE_REAL_SERVERS=1`), where a missing Synapse fails it.

mod common;
mod matrix_files_support;
mod matrix_support;

mod child_support;

use serde_json::Value;
use sha2::{Digest, Sha256};

use common::gateway::spool_empties;
use matrix_files_support::FilesRig;
use matrix_support::{Seen, User, WAIT, enc, replies_to, synapse};

/// The process agent: on `chart` it attaches a 200 000-byte PNG-named file; on `bounds` four
/// files, one over the per-file bound and one past the spool's room; on `escape` a file
/// outside its outbox, by an absolute path and by `..`.
const AGENT: &str = r#"
import json, os, sys

def data(n, seed):
    return bytes((i * 13 + seed) % 256 for i in range(n))

for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("op") != "turn":
        continue
    out = msg["outbox"]
    text, files = "?", []
    if msg["text"] == "chart":
        open(os.path.join(out, "chart.png"), "wb").write(data(200000, 7))
        text, files = "here is the chart", [{"path": "chart.png"}]
    elif msg["text"] == "bounds":
        for name, n in [("huge.bin", 400000), ("a.bin", 250000), ("b.bin", 250000), ("c.bin", 250000)]:
            open(os.path.join(out, name), "wb").write(data(n, len(name)))
        text = "four files"
        files = [{"path": p} for p in ["huge.bin", "a.bin", os.path.join(out, "b.bin"), "c.bin"]]
    elif msg["text"] == "escape":
        # The test's secret, next to the spool the outbox is in: absolute, then by "..".
        secret = os.path.join(os.path.dirname(os.path.dirname(out)), "secret.txt")
        text, files = "two secrets", [{"path": secret}, {"path": "../../secret.txt", "name": "x"}]
    print(json.dumps({"op": "reply", "id": msg["id"], "text": text, "attachments": files}), flush=True)
"#;

/// Downloads `mxc://server/id` as `user`, through the authenticated media API.
fn download(user: &User, mxc: &str) -> Vec<u8> {
    let (server, id) = mxc
        .strip_prefix("mxc://")
        .and_then(|s| s.split_once('/'))
        .expect("an mxc URI");
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let url = format!(
        "{}/_matrix/client/v1/media/download/{}/{}",
        user.base,
        enc(server),
        enc(id)
    );
    let mut response = agent
        .get(&url)
        .header("Authorization", &format!("Bearer {}", user.token))
        .call()
        .expect("download");
    assert_eq!(response.status().as_u16(), 200);
    response
        .body_mut()
        .with_config()
        .limit(10 << 20)
        .read_to_vec()
        .expect("body")
}

fn sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn data(n: usize, seed: usize) -> Vec<u8> {
    (0..n).map(|i| ((i * 13 + seed) % 256) as u8).collect()
}

/// What the human saw of the bot's messages, one line each (files with their type, name
/// and size).
fn transcript(seen: &matrix_support::Watcher, bot: &str) -> String {
    let mut out = String::new();
    for (_, ev) in seen.events() {
        if ev["type"] != "m.room.message" {
            continue;
        }
        let c = &ev["content"];
        let who = if ev["sender"] == bot { "bot" } else { "human" };
        let line = match c["msgtype"].as_str() {
            Some(t @ ("m.image" | "m.file")) => format!(
                "{who}: [{t}] {} ({} bytes, {})",
                c["body"].as_str().unwrap_or(""),
                c["info"]["size"],
                c["info"]["mimetype"].as_str().unwrap_or("")
            ),
            _ => format!("{who}: {}", c["body"].as_str().unwrap_or("")),
        };
        out.push_str(&line);
        out.push('\n');
    }
    out
}

#[test]
fn a_process_agent_answers_with_a_file_the_human_downloads_byte_for_byte() {
    let Some(hs) = synapse() else { return };
    let bot = hs.register("bot", "Turnstile Bot");
    let human = hs.register("ann", "Ann");
    hs.unlimit(&bot);
    let room = human.create_room(&[&bot.mxid]);
    let mut seen = human.watch(&room);
    let tmp = tempfile::tempdir().expect("tempdir");
    let script = tmp.path().join("agent.py");
    let secret = tmp.path().join("secret.txt");
    std::fs::write(&secret, "not for the chat").expect("secret");
    std::fs::write(&script, AGENT).expect("script");
    let agent_cmd = format!("python3 {}", script.display());
    let rig = FilesRig::start(
        hs,
        &bot,
        &mut seen,
        tmp.path(),
        &[
            "--agent",
            "process",
            "--agent-cmd",
            &agent_cmd,
            "--max-attachment-bytes",
            "300000",
            "--attachments-bytes",
            "600000",
        ],
        &["--format", "plain"],
    );
    let (spool, log) = (rig.spool.clone(), rig.bridge_log.clone());
    let me = bot.mxid.clone();
    let from_bot = |ev: &Value| ev["type"] == "m.room.message" && ev["sender"] == me.as_str();

    // A file: the text answers the human's message, then the image, which the human
    // downloads byte for byte.
    let after = seen.log.len().saturating_sub(1);
    let asked = human.say(&room, "chart");
    let text = seen.until_after(after, "the reply's text", |ev| replies_to(ev, &me, &asked));
    let image = seen.until_after(text, "the image", |ev| {
        from_bot(ev) && ev["content"]["msgtype"] == "m.image"
    });
    let Seen::Event(ev, _) = &seen.log[image] else {
        unreachable!()
    };
    let c = ev["content"].clone();
    assert_eq!(
        (&c["body"], &c["info"]["mimetype"], &c["info"]["size"]),
        (&"chart.png".into(), &"image/png".into(), &200_000.into())
    );
    let got = download(&human, c["url"].as_str().expect("url"));
    assert_eq!(sha256(&got), sha256(&data(200_000, 7)), "byte for byte");
    // Delivered: the file left the gateway's spool.
    spool_empties(&spool, "the chart's file deleted once delivered", WAIT);

    // Past the per-file bound and the spool's room: left out, and the reply says so.
    let after = seen.log.len().saturating_sub(1);
    let asked = human.say(&room, "bounds");
    let text = seen.until_after(after, "the reply's text", |ev| replies_to(ev, &me, &asked));
    let Seen::Event(ev, _) = &seen.log[text] else {
        unreachable!()
    };
    assert_eq!(
        ev["content"]["body"],
        "four files\n\
         (file left out: huge.bin, 390.6 KiB: larger than --max-attachment-bytes 300000)\n\
         (file left out: c.bin, 244.1 KiB: the attachments spool is full (--attachments-bytes 600000))"
    );
    let mut names = Vec::new();
    let mut at = text;
    for _ in 0..2 {
        at = seen.until_after(at, "a file", |ev| {
            from_bot(ev) && ev["content"]["msgtype"] == "m.file"
        });
        let Seen::Event(ev, _) = &seen.log[at] else {
            unreachable!()
        };
        let c = &ev["content"];
        let name = c["body"].as_str().expect("name").to_owned();
        let got = download(&human, c["url"].as_str().expect("url"));
        assert_eq!(sha256(&got), sha256(&data(250_000, name.len())), "{name}");
        names.push(name);
    }
    assert_eq!(names, ["a.bin", "b.bin"]);
    spool_empties(&spool, "the files deleted once delivered", WAIT);

    // Paths outside the outbox: refused, said; nothing uploaded.
    let after = seen.log.len().saturating_sub(1);
    let asked = human.say(&room, "escape");
    let text = seen.until_after(after, "the reply's text", |ev| replies_to(ev, &me, &asked));
    let Seen::Event(ev, _) = &seen.log[text] else {
        unreachable!()
    };
    let outside = "refused: the path is not inside this turn's outbox ($TURNSTILE_OUTBOX)";
    assert_eq!(
        ev["content"]["body"],
        format!(
            "two secrets\n(file left out: secret.txt: {outside})\n(file left out: x: {outside})"
        )
    );
    assert_eq!(
        std::fs::read_to_string(&secret).expect("left where it was"),
        "not for the chat"
    );
    let files = seen
        .events()
        .filter(|(_, ev)| from_bot(ev))
        .filter(|(_, ev)| ev["content"]["msgtype"] != "m.text")
        .count();
    assert_eq!(files, 3, "{}", transcript(&seen, &me));
    eprintln!("what the human saw:\n{}", transcript(&seen, &me));
    let log = std::fs::read_to_string(&log).expect("log");
    assert!(!log.contains(&bot.token), "the access token was logged");
}
