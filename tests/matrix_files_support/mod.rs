//! What the Matrix files tests share (against the real Synapse of `matrix_support`): the
//! gateway and the bridge on one attachments spool, the bot joined to the human's room, and
//! a file uploaded as the human.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;

use crate::child_support::{Proc, die_with_parent, first_line};
use crate::matrix_support::{Seen, Synapse, User, WAIT, Watcher, enc, replies_to};

/// `turnstile serve` and `turnstile bridge matrix` on one spool, both killed when dropped
/// (the bridge first).
pub struct FilesRig {
    /// The attachments spool both were given (`<dir>/spool`).
    pub spool: PathBuf,
    /// The bridge's stderr, at debug level.
    pub bridge_log: PathBuf,
    _bridge: Proc,
    _serve: Proc,
}

impl FilesRig {
    /// Starts `serve` (open access, `serve_args` naming the agent and any bounds) and the
    /// bridge for `bot` (`bridge_args` added), then waits until `seen` shows the bot joined.
    pub fn start(
        hs: &Synapse,
        bot: &User,
        seen: &mut Watcher,
        dir: &Path,
        serve_args: &[&str],
        bridge_args: &[&str],
    ) -> FilesRig {
        let spool = dir.join("spool");
        let port = TcpListener::bind("127.0.0.1:0")
            .expect("bind")
            .local_addr()
            .expect("addr")
            .port();
        let mut serve = die_with_parent(
            Command::new(env!("CARGO_BIN_EXE_turnstile"))
                .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
                .args(["--http-listen", "off", "--access-default", "open"])
                .args(serve_args)
                .arg("--attachments-dir")
                .arg(&spool)
                .env("RUST_LOG", "warn")
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit()),
        )
        .spawn()
        .expect("serve");
        assert!(first_line(&mut serve, WAIT).starts_with("listening on "));
        let serve = Proc(serve);
        let bridge_log = dir.join("bridge.log");
        let mut bridge = die_with_parent(
            Command::new(env!("CARGO_BIN_EXE_turnstile"))
                .args([
                    "bridge",
                    "matrix",
                    "--gateway",
                    &format!("127.0.0.1:{port}"),
                ])
                .args(["--homeserver", &hs.base])
                .args(bridge_args)
                .arg("--attachments-dir")
                .arg(&spool)
                .env("MATRIX_ACCESS_TOKEN", &bot.token)
                .env("RUST_LOG", "debug")
                .stdout(Stdio::piped())
                .stderr(std::fs::File::create(&bridge_log).expect("log")),
        )
        .spawn()
        .expect("bridge");
        assert!(first_line(&mut bridge, WAIT).starts_with("ready: matrix as "));
        let bridge = Proc(bridge);
        let me = bot.mxid.as_str();
        seen.until("the bot joining", |s| {
            matches!(s, Seen::Event(ev, _) if ev["type"] == "m.room.member"
                && ev["state_key"] == me && ev["content"]["membership"] == "join")
        });
        FilesRig {
            spool,
            bridge_log,
            _bridge: bridge,
            _serve: serve,
        }
    }
}

/// Uploads `bytes` as `user` (named `filename`, if given): the `mxc://` URI.
pub fn upload(user: &User, filename: Option<&str>, mime: &str, bytes: &[u8]) -> String {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let mut url = format!("{}/_matrix/media/v3/upload", user.base);
    if let Some(name) = filename {
        url = format!("{url}?filename={}", enc(name));
    }
    let mut response = agent
        .post(&url)
        .header("Authorization", &format!("Bearer {}", user.token))
        .header("Content-Type", mime)
        .send(bytes)
        .expect("upload");
    let text = response.body_mut().read_to_string().expect("answer");
    assert_eq!(response.status().as_u16(), 200, "{text}");
    let v: Value = serde_json::from_str(&text).expect("json");
    v["content_uri"].as_str().expect("content_uri").to_owned()
}

/// Waits (after `seen`'s entry `after`) for the agent's answer to `event`, a plain text
/// reply of `bot` (not an edit), and parses it: the exec agents answer in JSON.
pub fn agent_answer(seen: &mut Watcher, after: usize, bot: &str, event: &str) -> Value {
    let i = seen.until_after(after, "the agent's answer", |ev| {
        replies_to(ev, bot, event)
            && ev["content"]["msgtype"] == "m.text"
            && ev["content"]["m.relates_to"]["rel_type"].is_null()
    });
    let Seen::Event(ev, _) = &seen.log[i] else {
        unreachable!()
    };
    serde_json::from_str(ev["content"]["body"].as_str().expect("body")).expect("json")
}
