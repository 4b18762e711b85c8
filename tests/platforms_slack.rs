//! `turnstile bridge slack` end to end against a **fake** of Slack (`slack_fake`: Socket
//! Mode and the Web API, written from the published documentation; it says at its top what
//! it checks and that it is not Slack).
//!
//! The real `turnstile serve` (with a streaming process agent) and the real bridge binary
//! run against it (`chat_bridge_support`: the gateway, the streaming agent and its FIFO).

mod chat_bridge_support;
mod child_support;
mod common;
mod slack_fake;
use chat_bridge_support::{
    AGENT, GATEWAY_TOKEN, Setup, WAIT, lines, stream_text, wait_all_delivered,
};
use child_support::{Proc, die_with_parent};
use serde_json::json;
use slack_fake::{APP_TOKEN, BOT_ID, BOT_TOKEN, FakeSlack};
use std::path::Path;
use std::process::{Command, Stdio};

use crossbeam_channel::Receiver;

/// The "stream" result: over 4,000 UTF-16 units, so it continues in new messages.
const STREAM_EMOJI: usize = 2000;

fn final_text() -> String {
    stream_text(STREAM_EMOJI)
}

/// Starts the bridge (stderr to `log`) and waits for its ready line.
fn start_bridge(setup: &Setup, fake: &FakeSlack, log: &Path) -> Proc {
    let state = setup.dir.path().join("state");
    let (child, ready) = spawn_bridge(&setup.gateway, &fake.api_base, APP_TOKEN, &state, log);
    assert_eq!(
        ready.recv_timeout(WAIT).expect("the ready line"),
        "ready: slack as fakebot"
    );
    child
}

fn spawn_bridge(
    gateway: &str,
    api_base: &str,
    app_token: &str,
    state_dir: &Path,
    log: &Path,
) -> (Proc, Receiver<String>) {
    let log = std::fs::File::create(log).expect("log file");
    let mut child = die_with_parent(
        Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args(["bridge", "slack", "--gateway", gateway])
            .args(["--api-base", api_base])
            .arg("--state-dir")
            .arg(state_dir)
            .env("SLACK_APP_TOKEN", app_token)
            .env("SLACK_BOT_TOKEN", BOT_TOKEN)
            .env("TURNSTILE_AUTH_TOKEN", GATEWAY_TOKEN)
            .env("RUST_LOG", "debug")
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log)),
    )
    .spawn()
    .expect("start the bridge");
    let ready = lines(child.stdout.take().expect("stdout"));
    (Proc(child), ready)
}

fn assert_no_secret(log: &Path) {
    let text = std::fs::read_to_string(log).expect("log");
    assert!(
        !text.contains(APP_TOKEN) && !text.contains(BOT_TOKEN),
        "a Slack token leaked"
    );
    assert!(!text.contains("SECRET"), "part of a Slack token leaked");
    assert!(
        !text.contains(GATEWAY_TOKEN),
        "the gateway token leaked into the log"
    );
}

fn posted(s: &slack_fake::FakeState, text: &str) -> usize {
    FakeSlack::posts(s, text)
}

#[test]
fn a_dm_and_a_mention_get_streamed_replies_in_their_threads_every_envelope_acked_in_time() {
    let fake = FakeSlack::start();
    let setup = Setup::start(STREAM_EMOJI);
    let log = setup.dir.path().join("bridge.log");
    let mut bridge = start_bridge(&setup, &fake, &log);
    fake.dm("100.000001", "stream");
    fake.wait_for("the first message", |s| {
        (posted(s, "Hello") == 1).then_some(())
    });
    {
        let s = fake.lock();
        let (_, body, _) = s
            .calls
            .iter()
            .find(|(m, b, ok)| m == "chat.postMessage" && *ok && b["text"] == "Hello")
            .expect("post");
        assert_eq!(body["channel"], "D1");
        assert_eq!(body["thread_ts"], "100.000001");
    }
    setup.go();
    fake.wait_for("the edit", |s| {
        (FakeSlack::texts(s, "D1") == ["Hello world"]).then_some(())
    });
    setup.go();
    let expected = final_text();
    let pieces = fake.wait_for("the whole result", |s| {
        let texts = FakeSlack::texts(s, "D1");
        (texts.concat() == expected).then_some(texts)
    });
    assert!(pieces.len() >= 2, "{} messages", pieces.len());
    for p in &pieces {
        assert!(p.encode_utf16().count() <= 4000);
    }
    // A mention in a channel is answered in its thread; channel chatter is not.
    fake.event(
        json!({"type": "message", "channel_type": "channel", "channel": "C1",
        "user": "U7", "ts": "200.000001", "text": "not for the bot"}),
    );
    fake.event(json!({"type": "app_mention", "channel": "C1", "user": "U7",
        "ts": "200.000002", "thread_ts": "150.000000", "text": format!("<@{BOT_ID}> hi")}));
    fake.wait_for("the mention's reply", |s| {
        (posted(s, "echo: hi (group)") == 1).then_some(())
    });
    fake.wait_for("every envelope acked", |s| (s.acks == 3).then_some(()));
    let s = fake.lock();
    let (_, body, _) = s
        .calls
        .iter()
        .find(|(_, b, _)| b["text"] == "echo: hi (group)")
        .expect("reply");
    assert_eq!(body["thread_ts"], "150.000000");
    assert_eq!(posted(&s, "echo: not for the bot (group)"), 0);
    assert_eq!(
        s.late_redeliveries, 0,
        "an envelope was acked later than 3 s"
    );
    assert_eq!(s.violations, 0);
    assert_eq!(s.too_long, 0);
    drop(s);
    assert!(bridge.terminate().success(), "SIGTERM exits 0");
    assert_no_secret(&log);
}

#[test]
fn a_disconnect_refresh_in_the_middle_of_a_stream_opens_first_and_loses_nothing() {
    let fake = FakeSlack::start();
    let setup = Setup::start(STREAM_EMOJI);
    let log = setup.dir.path().join("bridge.log");
    let mut bridge = start_bridge(&setup, &fake, &log);
    fake.dm("300.000001", "stream");
    fake.wait_for("the first message", |s| {
        (posted(s, "Hello") == 1).then_some(())
    });
    fake.disconnect();
    fake.wait_for("the old connection closed", |s| {
        (s.connections.len() == 2 && s.connections[0].1.is_some()).then_some(())
    });
    {
        let s = fake.lock();
        assert!(
            s.connections[0].1.expect("closed") >= s.connections[1].0,
            "the new connection opened before the old one closed"
        );
    }
    fake.dm("300.000002", "during");
    setup.go();
    // Each go() once the agent read the one before (two writers at once would be read as
    // one).
    fake.wait_for("the edit", |s| {
        FakeSlack::texts(s, "D1")
            .iter()
            .any(|t| t == "Hello world")
            .then_some(())
    });
    setup.go();
    let expected = final_text();
    fake.wait_for(
        "the result and the reply to what came after the refresh",
        |s| {
            let texts = FakeSlack::texts(s, "D1");
            texts
                .iter()
                .any(|t| t == "echo: during (dm)")
                .then_some(())?;
            let stream: Vec<String> = texts
                .into_iter()
                .filter(|t| t != "echo: during (dm)")
                .collect();
            (stream.concat() == expected).then_some(())
        },
    );
    // Every result was confirmed: the gateway holds none for Slack.
    setup.wait_all_delivered("slack");
    let s = fake.lock();
    assert_eq!(posted(&s, "echo: during (dm)"), 1);
    assert_eq!(posted(&s, "Hello"), 1);
    assert_eq!(
        s.acks, s.envelopes,
        "every envelope acked, none redelivered"
    );
    drop(s);
    assert!(bridge.terminate().success());
    assert_no_secret(&log);
}

#[test]
fn a_redelivered_envelope_is_acked_and_not_answered_twice() {
    let fake = FakeSlack::start();
    let setup = Setup::start(STREAM_EMOJI);
    let log = setup.dir.path().join("bridge.log");
    let mut bridge = start_bridge(&setup, &fake, &log);
    fake.dm("400.000001", "one");
    fake.wait_for("the reply", |s| {
        (posted(s, "echo: one (dm)") == 1 && s.acks == 1).then_some(())
    });
    // As if Slack had not seen the ack: the same event again, retry_attempt 1.
    {
        let mut s = fake.lock();
        s.force_429 = 0;
    }
    fake.event(
        json!({"type": "message", "channel_type": "im", "channel": "D1",
        "user": "U7", "ts": "400.000001", "text": "one"}),
    );
    fake.wait_for("the redelivery acked", |s| (s.acks == 2).then_some(()));
    fake.dm("400.000002", "two");
    fake.wait_for("the next reply", |s| {
        (posted(s, "echo: two (dm)") == 1).then_some(())
    });
    assert_eq!(posted(&fake.lock(), "echo: one (dm)"), 1, "answered once");
    assert!(bridge.terminate().success());
    assert_no_secret(&log);
}

#[test]
fn a_429_storm_ends_without_a_call_before_its_retry_after() {
    let fake = FakeSlack::start();
    fake.lock().force_429 = 3;
    let setup = Setup::start(STREAM_EMOJI);
    let log = setup.dir.path().join("bridge.log");
    let mut bridge = start_bridge(&setup, &fake, &log);
    for i in 0..5 {
        fake.dm(&format!("500.00000{i}"), &format!("m{i}"));
    }
    fake.wait_for("every reply", |s| {
        (0..5)
            .all(|i| posted(s, &format!("echo: m{i} (dm)")) == 1)
            .then_some(())
    });
    let s = fake.lock();
    assert_eq!(
        s.rate_limited, 3,
        "only the forced 429s: the bridge paced itself"
    );
    assert_eq!(s.violations, 0, "a call came before its Retry-After passed");
    drop(s);
    assert!(bridge.terminate().success());
    assert_no_secret(&log);
}

#[test]
fn a_refused_app_token_ends_the_bridge_with_exit_2() {
    let fake = FakeSlack::start();
    let setup = Setup::start(STREAM_EMOJI);
    let log = setup.dir.path().join("bridge.log");
    let (mut bridge, _) = spawn_bridge(
        &setup.gateway,
        &fake.api_base,
        "xapp-wrong",
        &setup.dir.path().join("state"),
        &log,
    );
    assert_eq!(bridge.wait_exit().code(), Some(2));
    let text = std::fs::read_to_string(&log).expect("log");
    assert!(text.contains("connections:write"), "{text}");
}

#[test]
fn an_envelope_is_acked_only_once_the_gateway_has_its_message() {
    let fake = FakeSlack::start();
    // The gateway is not there yet: the bridge gets the event but cannot hand it over.
    let listen = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        probe.local_addr().expect("addr").to_string()
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("bridge.log");
    let (mut bridge, ready) = spawn_bridge(
        &listen,
        &fake.api_base,
        APP_TOKEN,
        &dir.path().join("state"),
        &log,
    );
    fake.wait_for("the Socket Mode connection", |s| {
        (!s.connections.is_empty()).then_some(())
    });
    fake.dm("600.000001", "early");
    // Ordered by the fake: not acked within 3 s, so Slack delivers it again.
    fake.wait_for("a redelivery", |s| (s.late_redeliveries >= 1).then_some(()));
    assert_eq!(
        fake.lock().acks,
        0,
        "acked before the gateway had the message"
    );
    let setup = Setup::start_on(&listen, STREAM_EMOJI);
    assert_eq!(
        ready
            .recv_timeout(WAIT)
            .expect("ready once the gateway is up"),
        "ready: slack as fakebot"
    );
    fake.wait_for("the reply and every envelope acked", |s| {
        (posted(s, "echo: early (dm)") == 1 && s.acks == s.envelopes).then_some(())
    });
    assert_eq!(posted(&fake.lock(), "echo: early (dm)"), 1, "answered once");
    assert!(bridge.terminate().success());
    assert_no_secret(&log);
    drop(setup);
}

/// The gateway's answer to a `!stop` that cancelled a running turn.
const STOPPED: &str = "stop: cancelled the running turn, 0 queued message(s) cancelled";

#[test]
fn stop_from_the_chat_ends_a_streamed_turn_answered_once_and_nothing_shown_twice() {
    let fake = FakeSlack::start();
    let setup = Setup::start(STREAM_EMOJI);
    let log = setup.dir.path().join("bridge.log");
    let mut bridge = start_bridge(&setup, &fake, &log);
    fake.dm("700.000001", "stream");
    fake.wait_for("the first message", |s| {
        (posted(s, "Hello") == 1).then_some(())
    });
    // The agent is stuck mid-stream (it waits on the FIFO): only the stop ends the turn.
    fake.dm("700.000002", "!stop");
    fake.wait_for("the stop answered in its thread", |s| {
        s.messages
            .values()
            .any(|(c, t, text)| c == "D1" && t.as_deref() == Some("700.000002") && text == STOPPED)
            .then_some(())
    });
    fake.wait_for("the stream's message shows the cancellation", |s| {
        s.messages
            .values()
            .any(|(_, t, text)| {
                t.as_deref() == Some("700.000001") && text.starts_with("[cancelled")
            })
            .then_some(())
    });
    setup.wait_all_delivered("slack");
    // The session is free again.
    fake.dm("700.000003", "after");
    fake.wait_for("the next reply", |s| {
        (posted(s, "echo: after (dm)") == 1).then_some(())
    });
    let s = fake.lock();
    let created: Vec<&str> = s.created.iter().map(|(_, t)| t.as_str()).collect();
    assert_eq!(
        created,
        ["Hello", STOPPED, "echo: after (dm)"],
        "each shown once; the cancellation edits the stream's message"
    );
    assert!(
        !FakeSlack::texts(&s, "D1")
            .iter()
            .any(|t| t.contains("Hello world")),
        "nothing of the stopped turn came after the stop"
    );
    assert_eq!(s.violations, 0);
    drop(s);
    assert!(bridge.terminate().success());
    assert_no_secret(&log);
}

#[test]
fn a_restarted_bridge_answers_what_came_while_it_was_down_once() {
    let fake = FakeSlack::start();
    let setup = Setup::start(STREAM_EMOJI);
    let mut first = start_bridge(&setup, &fake, &setup.dir.path().join("bridge-1.log"));
    fake.dm("800.000001", "one");
    fake.wait_for("the first reply, acked", |s| {
        (posted(s, "echo: one (dm)") == 1 && s.acks == 1).then_some(())
    });
    setup.wait_all_delivered("slack");
    assert!(first.terminate().success());
    fake.wait_for("the connection closed", |s| {
        s.connections
            .iter()
            .all(|(_, closed)| closed.is_some())
            .then_some(())
    });
    // Nobody is connected: Slack keeps the event and delivers it again later.
    fake.dm("800.000002", "two");
    let log = setup.dir.path().join("bridge-2.log");
    let mut second = start_bridge(&setup, &fake, &log);
    fake.wait_for("the reply to what came while down, acked", |s| {
        (posted(s, "echo: two (dm)") == 1 && s.acks == 2).then_some(())
    });
    setup.wait_all_delivered("slack");
    let s = fake.lock();
    assert!(s.late_redeliveries >= 1, "it came as a redelivery");
    assert_eq!(posted(&s, "echo: one (dm)"), 1, "nothing answered twice");
    assert_eq!(posted(&s, "echo: two (dm)"), 1);
    drop(s);
    assert!(second.terminate().success());
    assert_no_secret(&log);
}

/// `serve --config` with a `[[bridge]]` table for slack runs the bridge as a supervised
/// child with its two token variables passed through: it answers, and is restarted when
/// killed.
#[test]
fn a_bridge_table_runs_the_slack_bridge_supervised_by_serve() {
    let fake = FakeSlack::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let script = dir.path().join("agent.py");
    std::fs::write(&script, AGENT).expect("agent");
    let config = dir.path().join("turnstile.toml");
    std::fs::write(
        &config,
        format!(
            "agent = \"process\"\nagent-cmd = \"exec python3 {} unused 1\"\n\n[[bridge]]\nplatform = \"slack\"\nargs = [\"--api-base\", \"{}\", \"--state-dir\", \"{}\"]\n",
            script.display(),
            fake.api_base,
            dir.path().join("state").display()
        ),
    )
    .expect("config");
    let mut serve = die_with_parent(
        Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args(["serve", "--listen", "127.0.0.1:0", "--http-listen", "off"])
            .args(["--access-default", "open"])
            .arg("--config")
            .arg(&config)
            .arg("--status-file")
            .arg(dir.path().join("status.json"))
            .env("RUST_LOG", "info")
            .env("SLACK_APP_TOKEN", APP_TOKEN)
            .env("SLACK_BOT_TOKEN", BOT_TOKEN)
            .env("TURNSTILE_AUTH_TOKEN", GATEWAY_TOKEN)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    )
    .spawn()
    .expect("start serve");
    let log = lines(serve.stderr.take().expect("stderr"));
    let _stdout = lines(serve.stdout.take().expect("stdout"));
    let mut serve = Proc(serve);
    let started_pid = || -> i32 {
        loop {
            let line = log.recv_timeout(WAIT).expect("a log line in time");
            assert!(
                !line.contains(GATEWAY_TOKEN)
                    && !line.contains(APP_TOKEN)
                    && !line.contains(BOT_TOKEN),
                "{line}"
            );
            if let Some(rest) = line.split("bridge #1 (slack): started (pid ").nth(1) {
                return rest.trim_end_matches(')').parse().expect("pid");
            }
        }
    };
    let first = started_pid();
    fake.wait_for("the first connection", |s| {
        (s.connections.len() == 1).then_some(())
    });
    fake.dm("950.000001", "one");
    fake.wait_for("the first reply", |s| {
        (posted(s, "echo: one (dm)") == 1).then_some(())
    });
    // Killed once the reply is confirmed: Slack has no idempotent post, so a reply whose
    // confirmation a kill cuts off is shown again (docs/platforms.md).
    wait_all_delivered(&dir.path().join("status.json"), "slack");
    // SAFETY: kill(2) of the bridge the gateway started (alive: it just answered).
    assert_eq!(unsafe { libc::kill(first, libc::SIGKILL) }, 0);
    let second = started_pid();
    assert_ne!(first, second, "a new bridge process");
    fake.wait_for("the restarted bridge's connection", |s| {
        (s.connections.len() == 2).then_some(())
    });
    fake.dm("950.000002", "two");
    fake.wait_for("the restarted bridge's reply", |s| {
        (posted(s, "echo: two (dm)") == 1).then_some(())
    });
    assert_eq!(posted(&fake.lock(), "echo: one (dm)"), 1);
    assert!(serve.terminate().success());
}
