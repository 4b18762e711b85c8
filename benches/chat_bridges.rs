//! The Discord and Slack bridges' figures against their fakes (tests/discord_fake,
//! tests/slack_fake: not the services, but their published limits): the real `turnstile
//! serve` with a streaming process agent and the real bridge binary.
//!
//! - **First text**: from a user's message entering the fake to the bot's first message
//!   (the reply's first partial) reaching the fake: `cold` in a new conversation (the
//!   agent's process starts: a Python interpreter), `warm` in one whose agent runs already
//!   (its earlier reply over a second before, out of the limits' way).
//! - **Edits per reply**: an agent streaming 40 partials 50 ms apart (2 s) is shown with how
//!   many edits (the final text included) under the bridges' pace (one edit a second per
//!   reply) and the fakes' limits (Discord: 5 per 5 s per channel, 50/s in all; Slack: about
//!   one post and one update a second per channel).
//!
//! One JSON line per platform. `cargo bench --bench chat_bridges [-- --n N]` (N replies each,
//! in N channels; default 5).

#[path = "../tests/chat_bridge_support/mod.rs"]
mod chat_bridge_support;
#[path = "../tests/child_support/mod.rs"]
mod child_support;
#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/discord_fake/mod.rs"]
mod discord_fake;
#[path = "../tests/slack_fake/mod.rs"]
mod slack_fake;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use chat_bridge_support::{GATEWAY_TOKEN, Setup, WAIT, lines};
use child_support::{Proc, die_with_parent};
use discord_fake::FakeDiscord;
use serde_json::json;
use slack_fake::FakeSlack;

/// Partials each streamed reply has (50 ms apart).
const TICKS: usize = 40;

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// Starts `turnstile bridge <platform> <args>` against `setup` and waits for its ready line.
fn bridge(setup: &Setup, platform: &str, args: &[&str], env: &[(&str, &str)]) -> Proc {
    let mut command = Command::new(env!("CARGO_BIN_EXE_turnstile"));
    command
        .args(["bridge", platform, "--gateway", &setup.gateway])
        .args(args)
        .env("TURNSTILE_AUTH_TOKEN", GATEWAY_TOKEN)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for (k, v) in env {
        command.env(k, v);
    }
    let mut child = die_with_parent(&mut command).spawn().expect("bridge");
    let ready = lines(child.stdout.take().expect("stdout"));
    let line = ready.recv_timeout(WAIT).expect("the ready line");
    assert!(line.starts_with("ready: "), "{line}");
    Proc(child)
}

fn median_ms(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64() * 1e3
}

fn report(platform: &str, conversation: &str, first: Vec<Duration>, edits: &[usize]) {
    let max = first.iter().max().copied().unwrap_or_default();
    println!(
        "{{\"bench\": \"chat_bridges\", \"platform\": \"{platform}\", \"conversation\": \"{conversation}\", \"replies\": {}, \"partials_per_reply\": {TICKS}, \"first_text_ms_median\": {:.1}, \"first_text_ms_max\": {:.1}, \"edits_per_reply\": {:?}}}",
        first.len(),
        median_ms(first),
        max.as_secs_f64() * 1e3,
        edits
    );
}

fn discord(n: usize) {
    let fake = FakeDiscord::start(41_250);
    let setup = Setup::start(1);
    let state = setup.dir.path().join("state");
    let state = state.to_str().expect("utf-8 path");
    let _bridge = bridge(
        &setup,
        "discord",
        &["--api-base", &fake.api_base, "--state-dir", state],
        &[("DISCORD_BOT_TOKEN", discord_fake::TOKEN)],
    );
    for warm in [false, true] {
        let (mut first, mut edits) = (Vec::new(), Vec::new());
        for i in 0..n {
            let channel = format!("4{}{i:03}", u8::from(warm));
            if warm {
                fake.user_message(&format!("8{i:03}"), &channel, None, "warm");
                fake.wait_for("the warm-up reply", |s| {
                    (FakeDiscord::posts(s, "echo: warm (dm)") == i + 1).then_some(())
                });
                std::thread::sleep(Duration::from_millis(1100));
            }
            let (at, n_edits) =
                discord_reply(&fake, &channel, &format!("{}9{i:03}", u8::from(warm)));
            first.push(at);
            edits.push(n_edits);
        }
        report("discord", if warm { "warm" } else { "cold" }, first, &edits);
    }
}

/// One streamed reply in `channel`: its first text's latency and its edits.
fn discord_reply(fake: &FakeDiscord, channel: &str, id: &str) -> (Duration, usize) {
    {
        let path = format!("/channels/{channel}/messages");
        let sent = Instant::now();
        fake.user_message(id, channel, None, &format!("ticks {TICKS}"));
        let done = format!("ticks done {TICKS}");
        let (at, n_edits) = fake.wait_for("the whole reply", |s| {
            let mine = s.calls.iter().filter(|c| c.status == 200);
            let first = mine
                .clone()
                .find(|c| c.method == "POST" && c.path == path && c.at >= sent)?;
            FakeDiscord::texts(s, channel)
                .contains(&done)
                .then_some(())?;
            let edits = mine
                .filter(|c| c.method == "PATCH" && c.path.starts_with(&path))
                .count();
            Some((first.at, edits))
        });
        (at.duration_since(sent), n_edits)
    }
}

fn slack(n: usize) {
    let fake = FakeSlack::start();
    let setup = Setup::start(1);
    let state = setup.dir.path().join("state");
    let state = state.to_str().expect("utf-8 path");
    let _bridge = bridge(
        &setup,
        "slack",
        &["--api-base", &fake.api_base, "--state-dir", state],
        &[
            ("SLACK_APP_TOKEN", slack_fake::APP_TOKEN),
            ("SLACK_BOT_TOKEN", slack_fake::BOT_TOKEN),
        ],
    );
    for warm in [false, true] {
        let (mut first, mut edits) = (Vec::new(), Vec::new());
        for i in 0..n {
            let channel = format!("D{}{i}", u8::from(warm));
            if warm {
                fake.event(
                    json!({"type": "message", "channel_type": "im", "channel": channel,
                    "user": "U7", "ts": format!("800.{i:06}"), "text": "warm"}),
                );
                fake.wait_for("the warm-up reply", |s| {
                    (FakeSlack::posts(s, "echo: warm (dm)") == i + 1).then_some(())
                });
                std::thread::sleep(Duration::from_millis(1100));
            }
            let ts = format!("9{}0.{i:06}", u8::from(warm));
            let (at, n_edits) = slack_reply(&fake, &channel, &ts);
            first.push(at);
            edits.push(n_edits);
        }
        report("slack", if warm { "warm" } else { "cold" }, first, &edits);
    }
}

/// One streamed reply in `channel`: its first text's latency and its edits.
fn slack_reply(fake: &FakeSlack, channel: &str, ts: &str) -> (Duration, usize) {
    {
        let sent = Instant::now();
        fake.event(
            json!({"type": "message", "channel_type": "im", "channel": channel,
            "user": "U7", "ts": ts, "text": format!("ticks {TICKS}")}),
        );
        let done = format!("ticks done {TICKS}");
        let (at, n_edits) = fake.wait_for("the whole reply", |s| {
            let at = s
                .created_at
                .iter()
                .find(|(c, at)| c == channel && *at >= sent)?
                .1;
            FakeSlack::texts(s, channel).contains(&done).then_some(())?;
            let edits = s
                .calls
                .iter()
                .filter(|(m, b, ok)| m == "chat.update" && *ok && b["channel"] == channel)
                .count();
            Some((at, edits))
        });
        (at.duration_since(sent), n_edits)
    }
}

fn main() {
    let n: usize = arg("--n").and_then(|s| s.parse().ok()).unwrap_or(5).max(1);
    discord(n);
    slack(n);
}
