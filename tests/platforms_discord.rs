//! `turnstile bridge discord` end to end against a **fake** of Discord
//! (`discord_fake`: the Gateway over a WebSocket and the REST API, written from the published
//! documentation; it says at its top what it checks and that it is not Discord).
//!
//! The real `turnstile serve` (with a streaming process agent) and the real bridge binary
//! run against it (`chat_bridge_support`: the gateway, the streaming agent and its FIFO).

mod chat_bridge_support;
mod child_support;
mod common;
mod discord_fake;
use chat_bridge_support::{AGENT, GATEWAY_TOKEN, Setup, WAIT, lines, stream_text};
use child_support::{Proc, die_with_parent};
use common::{eventually, holds};
use discord_fake::{BOT_ID, FakeDiscord, FakeState, TOKEN};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, bounded};

/// The "stream" result: over 2,000 characters, so it continues in new messages.
const STREAM_EMOJI: usize = 1500;

fn final_text() -> String {
    stream_text(STREAM_EMOJI)
}

/// Starts the bridge (stderr to `log`) and waits for its ready line.
fn start_bridge(setup: &Setup, fake: &FakeDiscord, state_dir: &Path, log: &Path) -> Proc {
    let (child, ready) = spawn_bridge(&setup.gateway, &fake.api_base, TOKEN, state_dir, log);
    assert_eq!(
        ready.recv_timeout(WAIT).expect("the ready line"),
        "ready: discord as fakebot"
    );
    child
}

fn spawn_bridge(
    gateway: &str,
    api_base: &str,
    token: &str,
    state_dir: &Path,
    log: &Path,
) -> (Proc, Receiver<String>) {
    let log = std::fs::File::create(log).expect("log file");
    let mut child = die_with_parent(
        Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args(["bridge", "discord", "--gateway", gateway])
            .args(["--api-base", api_base])
            .arg("--state-dir")
            .arg(state_dir)
            .env("DISCORD_BOT_TOKEN", token)
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
    assert!(!text.contains(TOKEN), "the bot token leaked into the log");
    assert!(!text.contains("SECRET"), "part of the bot token leaked");
    assert!(
        !text.contains(GATEWAY_TOKEN),
        "the gateway token leaked into the log"
    );
}

/// The replies posted in `channel` that say `text`.
fn posted(s: &FakeState, text: &str) -> usize {
    FakeDiscord::posts(s, text)
}

#[test]
fn a_dm_and_a_guild_mention_get_streamed_replies_split_at_2000_characters() {
    let fake = FakeDiscord::start(1000);
    let setup = Setup::start(STREAM_EMOJI);
    let log = setup.dir.path().join("bridge.log");
    let mut bridge = start_bridge(&setup, &fake, &setup.dir.path().join("state"), &log);
    assert_eq!(
        fake.lock().intents,
        Some(1 | (1 << 9) | (1 << 12) | (1 << 15)),
        "guilds (thread events), guild messages, direct messages, message content"
    );

    fake.user_message("500", "42", None, "stream");
    let first = fake.wait_for("the first message", |s| {
        s.calls
            .iter()
            .find(|c| c.method == "POST" && c.status == 200 && c.body["content"] == "Hello")
            .cloned()
    });
    assert_eq!(first.path, "/channels/42/messages");
    assert_eq!(first.body["message_reference"]["message_id"], "500");
    assert_eq!(
        first.body["allowed_mentions"]["parse"],
        serde_json::json!([])
    );
    setup.go();
    fake.wait_for("the edit", |s| {
        (FakeDiscord::texts(s, "42") == ["Hello world"]).then_some(())
    });
    setup.go();
    let expected = final_text();
    let pieces = fake.wait_for("the whole result", |s| {
        let texts = FakeDiscord::texts(s, "42");
        (texts.concat() == expected).then_some(texts)
    });
    assert!(pieces.len() >= 2, "{} messages", pieces.len());
    for p in &pieces {
        assert!(p.chars().count() <= 2000);
    }

    // A guild message is answered only when it mentions the bot.
    fake.user_message("501", "77", Some("9"), "not for the bot");
    fake.user_message("502", "77", Some("9"), &format!("<@{BOT_ID}> hi"));
    fake.wait_for("the guild reply", |s| {
        (posted(s, "echo: hi (group)") == 1).then_some(())
    });
    let s = fake.lock();
    let reply = s
        .calls
        .iter()
        .find(|c| c.body["content"] == "echo: hi (group)")
        .expect("reply");
    assert_eq!(reply.path, "/channels/77/messages");
    assert_eq!(reply.body["message_reference"]["message_id"], "502");
    assert_eq!(posted(&s, "echo: not for the bot (group)"), 0);
    assert_eq!(s.not_modified, 0, "an edit repeated the text already shown");
    assert_eq!(
        s.rate_limited, 0,
        "posts and edits share the channel's bucket: none past it"
    );
    assert_eq!(s.too_long, 0, "a text over 2,000 characters was sent");
    assert!(
        s.calls.iter().any(|c| c.path == "/channels/42/typing"),
        "typing was shown"
    );
    assert_eq!(s.violations, 0);
    drop(s);
    assert!(bridge.terminate().success(), "SIGTERM exits 0");
    assert_no_secret(&log);
}

#[test]
fn a_zombie_connection_is_resumed_in_the_middle_of_a_stream_losing_and_repeating_nothing() {
    let fake = FakeDiscord::start(300);
    let setup = Setup::start(STREAM_EMOJI);
    let log = setup.dir.path().join("bridge.log");
    let mut bridge = start_bridge(&setup, &fake, &setup.dir.path().join("state"), &log);
    fake.user_message("600", "42", None, "stream");
    fake.wait_for("the first message", |s| {
        (posted(s, "Hello") == 1).then_some(())
    });
    // The link dies silently: no ACK, no dispatch; a message comes meanwhile.
    let resumes_before = {
        let mut s = fake.lock();
        s.zombie = true;
        s.resumes
    };
    fake.user_message("601", "42", None, "during");
    // Ordered by the fake: the bridge must notice the missing ACK and resume.
    fake.wait_for("a resume", |s| (s.resumes > resumes_before).then_some(()));
    // The stream goes on over the gateway; the missed message waits behind it (one
    // session) and is answered after it. Each go() once the agent read the one before (two
    // writers at once would be read as one).
    setup.go();
    fake.wait_for("the edit", |s| {
        FakeDiscord::texts(s, "42")
            .iter()
            .any(|t| t == "Hello world")
            .then_some(())
    });
    setup.go();
    let expected = final_text();
    fake.wait_for("the whole result and the missed message's reply", |s| {
        let texts = FakeDiscord::texts(s, "42");
        texts
            .iter()
            .any(|t| t == "echo: during (dm)")
            .then_some(())?;
        let stream: Vec<String> = texts
            .into_iter()
            .filter(|t| t != "echo: during (dm)")
            .collect();
        (stream.concat() == expected).then_some(())
    });
    // Every result was confirmed: the gateway holds none for Discord.
    setup.wait_all_delivered("discord");
    let s = fake.lock();
    assert_eq!(s.identifies, 1, "the session was resumed, not started anew");
    assert_eq!(posted(&s, "echo: during (dm)"), 1, "answered once");
    assert_eq!(
        posted(&s, "Hello"),
        1,
        "the stream's first message posted once"
    );
    drop(s);
    assert!(bridge.terminate().success());
    assert_no_secret(&log);
}

#[test]
fn a_429_storm_ends_without_a_request_past_the_limits() {
    let fake = FakeDiscord::start(1000);
    {
        let mut s = fake.lock();
        s.force_429 = 3;
        s.retry_after = 1.0;
    }
    let setup = Setup::start(STREAM_EMOJI);
    let log = setup.dir.path().join("bridge.log");
    let mut bridge = start_bridge(&setup, &fake, &setup.dir.path().join("state"), &log);
    for i in 0..8 {
        fake.user_message(&format!("70{i}"), "42", None, &format!("m{i}"));
    }
    fake.wait_for("every reply", |s| {
        (0..8)
            .all(|i| posted(s, &format!("echo: m{i} (dm)")) == 1)
            .then_some(())
    });
    let s = fake.lock();
    assert_eq!(
        s.rate_limited, 3,
        "the forced 429s only: the X-RateLimit headers kept the bridge inside the buckets"
    );
    assert_eq!(
        s.violations, 0,
        "a request came on a route before its retry_after passed"
    );
    for i in 0..8 {
        assert_eq!(posted(&s, &format!("echo: m{i} (dm)")), 1);
    }
    drop(s);
    assert!(bridge.terminate().success());
    assert_no_secret(&log);
}

#[test]
fn close_codes_no_retry_fixes_and_a_refused_token_end_the_bridge_with_exit_2() {
    let setup = Setup::start(STREAM_EMOJI);
    for (code, hint) in [(4004, "Reset Token"), (4014, "Message Content Intent")] {
        let fake = FakeDiscord::start(1000);
        fake.lock().close_on_identify = Some(code);
        let log = setup.dir.path().join(format!("bridge-{code}.log"));
        let (mut bridge, _) = spawn_bridge(
            &setup.gateway,
            &fake.api_base,
            TOKEN,
            &setup.dir.path().join("state"),
            &log,
        );
        let status = bridge.wait_exit();
        assert_eq!(status.code(), Some(2), "close {code}");
        let text = std::fs::read_to_string(&log).expect("log");
        assert!(text.contains(hint), "close {code}: {text}");
        assert_eq!(fake.lock().identifies, 1, "close {code} is not retried");
        assert_no_secret(&log);
    }
    let fake = FakeDiscord::start(1000);
    let log = setup.dir.path().join("bridge-bad-token.log");
    let (mut bridge, _) = spawn_bridge(
        &setup.gateway,
        &fake.api_base,
        "wrong-token",
        &setup.dir.path().join("state-2"),
        &log,
    );
    assert_eq!(bridge.wait_exit().code(), Some(2), "a refused token");
}

#[test]
fn a_restarted_bridge_resumes_its_session_and_answers_what_came_while_it_was_down_once() {
    let fake = FakeDiscord::start(1000);
    let setup = Setup::start(STREAM_EMOJI);
    let state = setup.dir.path().join("state");
    let log = setup.dir.path().join("bridge-1.log");
    let mut first = start_bridge(&setup, &fake, &state, &log);
    fake.user_message("800", "42", None, "one");
    fake.wait_for("the first reply", |s| {
        (posted(s, "echo: one (dm)") == 1).then_some(())
    });
    // Ordered by the state file: it records the message as answered.
    eventually("the session saved", WAIT, || {
        let saved = std::fs::read_to_string(state.join("discord-session")).unwrap_or_default();
        holds(saved, |s| s.contains("\"seq\":2"))
    });
    assert!(first.terminate().success());
    fake.user_message("801", "42", None, "two");
    let log = setup.dir.path().join("bridge-2.log");
    let second = start_bridge(&setup, &fake, &state, &log);
    fake.wait_for("the reply to what came while down", |s| {
        (posted(s, "echo: two (dm)") == 1).then_some(())
    });
    let s = fake.lock();
    assert_eq!(s.identifies, 1, "the restart resumed the session");
    assert_eq!(s.resumed_from, vec![2]);
    assert_eq!(posted(&s, "echo: one (dm)"), 1, "nothing answered twice");
    drop(s);

    // Killed after its reply was created and before it heard back (so before it could
    // confirm it): the gateway redelivers the result, and the post repeated with the same
    // nonce returns the message already there.
    fake.lock().hold_posts = true;
    fake.user_message("802", "42", None, "three");
    fake.wait_for("the reply created", |s| {
        (posted(s, "echo: three (dm)") == 1).then_some(())
    });
    drop(second);
    fake.release_posts();
    let log = setup.dir.path().join("bridge-3.log");
    let mut third = start_bridge(&setup, &fake, &state, &log);
    fake.wait_for("the repeated post", |s| {
        let tries = s
            .calls
            .iter()
            .filter(|c| c.method == "POST" && c.body["content"] == "echo: three (dm)")
            .count();
        (tries == 2).then_some(())
    });
    assert_eq!(posted(&fake.lock(), "echo: three (dm)"), 1, "shown once");
    assert!(third.terminate().success());
    assert_no_secret(&log);
}

#[test]
fn reconnect_and_invalid_session_are_answered_as_the_gateway_documentation_says() {
    let fake = FakeDiscord::start(1000);
    let setup = Setup::start(STREAM_EMOJI);
    let log = setup.dir.path().join("bridge.log");
    let mut bridge = start_bridge(&setup, &fake, &setup.dir.path().join("state"), &log);
    // Op 7: reconnect and resume; a message sent meanwhile is replayed and answered once.
    fake.send_op(serde_json::json!({"op": 7, "d": null}));
    fake.user_message("900", "42", None, "after seven");
    fake.wait_for("the resume after op 7", |s| (s.resumes == 1).then_some(()));
    fake.wait_for("the reply", |s| {
        (posted(s, "echo: after seven (dm)") == 1).then_some(())
    });
    // Op 9, resumable: resume again.
    fake.send_op(serde_json::json!({"op": 9, "d": true}));
    fake.wait_for("the resume after op 9 true", |s| {
        (s.resumes == 2).then_some(())
    });
    // Op 9, not resumable: a new session (Identify), not a resume.
    fake.send_op(serde_json::json!({"op": 9, "d": false}));
    fake.wait_for("the identify after op 9 false", |s| {
        (s.identifies == 2).then_some(())
    });
    fake.user_message("901", "42", None, "new session");
    fake.wait_for("the reply in the new session", |s| {
        (posted(s, "echo: new session (dm)") == 1).then_some(())
    });
    let s = fake.lock();
    assert_eq!(s.resumes, 2, "op 9 false is not resumed");
    assert_eq!(posted(&s, "echo: after seven (dm)"), 1);
    drop(s);
    assert!(bridge.terminate().success());
    assert_no_secret(&log);
}

/// `serve --config` with a `[[bridge]]` table for discord runs the bridge as a supervised
/// child with its token variable passed through: it answers, and is restarted when killed.
#[test]
fn a_bridge_table_runs_the_discord_bridge_supervised_by_serve() {
    let fake = FakeDiscord::start(1000);
    let dir = tempfile::tempdir().expect("tempdir");
    let script = dir.path().join("agent.py");
    std::fs::write(&script, AGENT).expect("agent");
    let config = dir.path().join("turnstile.toml");
    std::fs::write(
        &config,
        format!(
            "agent = \"process\"\nagent-cmd = \"exec python3 {} unused 1\"\n\n[[bridge]]\nplatform = \"discord\"\nargs = [\"--api-base\", \"{}\", \"--state-dir\", \"{}\"]\n",
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
            .env("RUST_LOG", "info")
            .env("DISCORD_BOT_TOKEN", TOKEN)
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
                !line.contains(GATEWAY_TOKEN) && !line.contains(TOKEN),
                "{line}"
            );
            if let Some(rest) = line.split("bridge #1 (discord): started (pid ").nth(1) {
                return rest.trim_end_matches(')').parse().expect("pid");
            }
        }
    };
    let first = started_pid();
    fake.wait_for("the first session", |s| (s.identifies == 1).then_some(()));
    fake.user_message("950", "42", None, "one");
    fake.wait_for("the first reply", |s| {
        (posted(s, "echo: one (dm)") == 1).then_some(())
    });
    // SAFETY: kill(2) of the bridge the gateway started (alive: it just answered).
    assert_eq!(unsafe { libc::kill(first, libc::SIGKILL) }, 0);
    let second = started_pid();
    assert_ne!(first, second, "a new bridge process");
    fake.wait_for("the restarted bridge's resume", |s| {
        (s.resumes >= 1).then_some(())
    });
    fake.user_message("951", "42", None, "two");
    fake.wait_for("the restarted bridge's reply", |s| {
        (posted(s, "echo: two (dm)") == 1).then_some(())
    });
    assert_eq!(posted(&fake.lock(), "echo: one (dm)"), 1);
    assert!(serve.terminate().success());
}

/// A listener that accepts connections and never says anything: a server that hangs.
fn silent_listener() -> (String, Receiver<std::net::TcpStream>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let (tx, rx) = bounded(16);
    std::thread::spawn(move || {
        for s in listener.incoming().flatten() {
            if tx.send(s).is_err() {
                return;
            }
        }
    });
    (addr, rx)
}

#[test]
fn sigterm_exits_0_promptly_while_the_api_or_the_gateway_hangs() {
    let setup = Setup::start(STREAM_EMOJI);
    // The REST API accepts and never answers (the start-up calls hang).
    let (api, accepted) = silent_listener();
    let log = setup.dir.path().join("bridge-api.log");
    let (mut bridge, _) = spawn_bridge(
        &setup.gateway,
        &format!("http://{api}/api/v10"),
        TOKEN,
        &setup.dir.path().join("state-1"),
        &log,
    );
    let _held = accepted
        .recv_timeout(WAIT)
        .expect("the bridge called the API");
    let asked = Instant::now();
    assert!(
        bridge.terminate().success(),
        "exit 0 during the start-up calls"
    );
    assert!(
        asked.elapsed() < Duration::from_secs(25),
        "not promptly: {:?}",
        asked.elapsed()
    );
    assert_no_secret(&log);

    // The Gateway accepts TCP and never completes the WebSocket handshake.
    let fake = FakeDiscord::start(1000);
    let (ws, accepted) = silent_listener();
    fake.lock().gateway_url = Some(format!("ws://{ws}"));
    let log = setup.dir.path().join("bridge-ws.log");
    let (mut bridge, _) = spawn_bridge(
        &setup.gateway,
        &fake.api_base,
        TOKEN,
        &setup.dir.path().join("state-2"),
        &log,
    );
    let _held = accepted
        .recv_timeout(WAIT)
        .expect("the bridge opened the Gateway");
    let asked = Instant::now();
    assert!(bridge.terminate().success(), "exit 0 during the handshake");
    assert!(
        asked.elapsed() < Duration::from_secs(25),
        "not promptly: {:?}",
        asked.elapsed()
    );
    assert_no_secret(&log);
}

/// The gateway's answer to a `!stop` that cancelled a running turn.
const STOPPED: &str = "stop: cancelled the running turn, 0 queued message(s) cancelled";

#[test]
fn stop_from_the_chat_ends_a_streamed_turn_answered_once_and_nothing_shown_twice() {
    let fake = FakeDiscord::start(1000);
    let setup = Setup::start(STREAM_EMOJI);
    let log = setup.dir.path().join("bridge.log");
    let mut bridge = start_bridge(&setup, &fake, &setup.dir.path().join("state"), &log);
    fake.user_message("650", "42", None, "stream");
    fake.wait_for("the first message", |s| {
        (posted(s, "Hello") == 1).then_some(())
    });
    // The agent is stuck mid-stream (it waits on the FIFO): only the stop ends the turn.
    fake.user_message("651", "42", None, "!stop");
    fake.wait_for("the stop answered", |s| {
        s.calls
            .iter()
            .any(|c| {
                c.method == "POST"
                    && c.status == 200
                    && c.body["content"] == STOPPED
                    && c.body["message_reference"]["message_id"] == "651"
            })
            .then_some(())
    });
    fake.wait_for("the stream's message shows the cancellation", |s| {
        FakeDiscord::texts(s, "42")
            .iter()
            .any(|t| t.starts_with("[cancelled"))
            .then_some(())
    });
    setup.wait_all_delivered("discord");
    // The session is free again.
    fake.user_message("652", "42", None, "after");
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
        !FakeDiscord::texts(&s, "42")
            .iter()
            .any(|t| t.contains("Hello world")),
        "nothing of the stopped turn came after the stop"
    );
    assert_eq!(s.violations, 0);
    drop(s);
    assert!(bridge.terminate().success());
    assert_no_secret(&log);
}

/// Replies in 80 channels at once (each its own bucket) are over 50 requests a second
/// without a global limit of the bridge's own: it keeps under it, so Discord never answers
/// a global 429.
#[test]
fn replies_in_many_channels_at_once_stay_under_the_global_limit_without_a_429() {
    let fake = FakeDiscord::start(1000);
    let setup = Setup::echo();
    let log = setup.dir.path().join("bridge.log");
    let mut bridge = start_bridge(&setup, &fake, &setup.dir.path().join("state"), &log);
    let n = 80;
    for i in 0..n {
        fake.user_message(
            &format!("3{i:03}"),
            &format!("6{i:03}"),
            None,
            &format!("hi {i}"),
        );
    }
    fake.wait_for("every reply", |s| {
        (0..n)
            .all(|i| posted(s, &format!("hi {i}")) == 1)
            .then_some(())
    });
    setup.wait_all_delivered("discord");
    let s = fake.lock();
    assert_eq!(
        s.global_limited, 0,
        "a global 429: over 50 requests a second"
    );
    assert_eq!(s.rate_limited, 0);
    assert_eq!(s.violations, 0);
    drop(s);
    assert!(bridge.terminate().success());
    assert_no_secret(&log);
}

#[test]
fn a_mention_in_a_thread_is_in_the_threads_session_and_answered_in_the_thread() {
    let fake = FakeDiscord::start(1000);
    let setup = Setup::start(STREAM_EMOJI);
    let log = setup.dir.path().join("bridge.log");
    let mut bridge = start_bridge(&setup, &fake, &setup.dir.path().join("state"), &log);
    fake.thread_created("88", "77", "9");
    fake.user_message("560", "88", Some("9"), &format!("<@{BOT_ID}> where"));
    let reply = "session discord:group:77:thread:88:user:7";
    let call = fake.wait_for("the reply in the thread", |s| {
        s.calls
            .iter()
            .find(|c| c.method == "POST" && c.status == 200 && c.body["content"] == reply)
            .cloned()
    });
    assert_eq!(call.path, "/channels/88/messages", "answered in the thread");
    assert_eq!(call.body["message_reference"]["message_id"], "560");
    // The thread's parent channel itself is still a channel of its own.
    fake.user_message("561", "77", Some("9"), &format!("<@{BOT_ID}> where"));
    fake.wait_for("the reply in the channel", |s| {
        s.calls
            .iter()
            .any(|c| {
                c.path == "/channels/77/messages"
                    && c.body["content"] == "session discord:group:77:user:7"
            })
            .then_some(())
    });
    assert!(
        !fake
            .lock()
            .calls
            .iter()
            .any(|c| c.path == "/channels/77/messages" && c.body["content"] == reply),
        "the thread's reply went to the parent channel"
    );
    assert!(bridge.terminate().success());
    assert_no_secret(&log);
}
