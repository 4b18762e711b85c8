//! `turnstile bridge slack` end to end against a **fake** of Slack (`slack_fake`: Socket
//! Mode and the Web API, written from the published documentation; it says at its top what
//! it checks and that it is not Slack).
//!
//! The real `turnstile serve` (with a streaming process agent) and the real bridge binary
//! run against it. Nothing sleeps to order events: the agent waits on a FIFO the test writes
//! once it has seen what it waits for, and every wait has a deadline.

mod child_support;
mod discord_fake;
mod slack_fake;
use child_support::{Proc, die_with_parent};
use discord_fake::lines;
use serde_json::json;
use slack_fake::{APP_TOKEN, BOT_ID, BOT_TOKEN, FakeSlack, WAIT};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, bounded};

/// The gateway's auth token: the bridge must present it, and never log it.
const GATEWAY_TOKEN: &str = "gateway-secret-4711";

/// The streaming process agent: for "stream", a partial, (FIFO) a longer partial, (FIFO) a
/// result over 4,000 UTF-16 units; anything else is echoed with its chat type.
const AGENT: &str = r#"
import json, sys
fifo = sys.argv[1]
def out(o):
    sys.stdout.write(json.dumps(o) + "\n"); sys.stdout.flush()
for line in sys.stdin:
    m = json.loads(line)
    if m.get("op") != "turn":
        continue
    i, t = m["id"], m["text"]
    if t == "stream":
        out({"op": "partial", "id": i, "text": "Hello"})
        open(fifo).read()
        out({"op": "partial", "id": i, "text": "Hello world"})
        open(fifo).read()
        out({"op": "reply", "id": i, "text": "Hello world " + "\U0001F389 " * 2000})
    else:
        out({"op": "reply", "id": i, "text": "echo: %s (%s)" % (t, m["chat_type"])})
"#;

fn final_text() -> String {
    format!("Hello world {}", "🎉 ".repeat(2000))
}

impl Proc {
    fn terminate(&mut self) -> std::process::ExitStatus {
        // SAFETY: kill(2) on our own child.
        assert_eq!(unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) }, 0);
        self.wait_exit()
    }

    fn wait_exit(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(status) = self.0.try_wait().expect("try_wait") {
                return status;
            }
            assert!(Instant::now() < deadline, "no exit in time");
            std::thread::park_timeout(Duration::from_millis(20));
        }
    }
}

struct Setup {
    dir: tempfile::TempDir,
    fifo: PathBuf,
    _serve: Proc,
    gateway: String,
}

impl Setup {
    fn start() -> Setup {
        Setup::start_on("127.0.0.1:0")
    }

    fn start_on(listen: &str) -> Setup {
        let dir = tempfile::tempdir().expect("tempdir");
        let script = dir.path().join("agent.py");
        std::fs::write(&script, AGENT).expect("agent");
        let fifo = dir.path().join("go.fifo");
        let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
        assert!(made.success());
        let cmd = format!("exec python3 {} {}", script.display(), fifo.display());
        let mut serve = die_with_parent(
            Command::new(env!("CARGO_BIN_EXE_turnstile"))
                .args(["serve", "--listen", listen, "--http-listen", "off"])
                .args(["--access-default", "open"])
                .args(["--agent", "process", "--agent-cmd", &cmd])
                .args(["--partial-interval", "0"])
                .env("RUST_LOG", "warn")
                .env("TURNSTILE_AUTH_TOKEN", GATEWAY_TOKEN)
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit()),
        )
        .spawn()
        .expect("start serve");
        let line = lines(serve.stdout.take().expect("stdout"))
            .recv_timeout(WAIT)
            .expect("listening");
        let gateway = line
            .strip_prefix("listening on ")
            .expect("listening line")
            .to_owned();
        Setup {
            dir,
            fifo,
            _serve: Proc(serve),
            gateway,
        }
    }

    /// Starts the bridge (stderr to `log`) and waits for its ready line.
    fn bridge(&self, fake: &FakeSlack, log: &Path) -> Proc {
        let (child, ready) = spawn_bridge(&self.gateway, &fake.api_base, APP_TOKEN, log);
        assert_eq!(
            ready.recv_timeout(WAIT).expect("the ready line"),
            "ready: slack as fakebot"
        );
        child
    }

    /// Lets the agent go on (it waits on the FIFO), bounded.
    fn go(&self) {
        let fifo = self.fifo.clone();
        let (tx, rx) = bounded(1);
        std::thread::spawn(move || {
            let r = std::fs::OpenOptions::new()
                .write(true)
                .open(&fifo)
                .and_then(|mut f| f.write_all(b"go"));
            let _ = tx.send(r);
        });
        rx.recv_timeout(WAIT)
            .expect("the agent opened the FIFO")
            .expect("write");
    }
}

fn spawn_bridge(
    gateway: &str,
    api_base: &str,
    app_token: &str,
    log: &Path,
) -> (Proc, Receiver<String>) {
    let log = std::fs::File::create(log).expect("log file");
    let mut child = die_with_parent(
        Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args(["bridge", "slack", "--gateway", gateway])
            .args(["--api-base", api_base])
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
    let setup = Setup::start();
    let log = setup.dir.path().join("bridge.log");
    let mut bridge = setup.bridge(&fake, &log);
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
    let setup = Setup::start();
    let log = setup.dir.path().join("bridge.log");
    let mut bridge = setup.bridge(&fake, &log);
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
    let s = fake.lock();
    assert_eq!(posted(&s, "echo: during (dm)"), 1);
    assert_eq!(posted(&s, "Hello"), 1);
    drop(s);
    assert!(bridge.terminate().success());
    assert_no_secret(&log);
}

#[test]
fn a_redelivered_envelope_is_acked_and_not_answered_twice() {
    let fake = FakeSlack::start();
    let setup = Setup::start();
    let log = setup.dir.path().join("bridge.log");
    let mut bridge = setup.bridge(&fake, &log);
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
    let setup = Setup::start();
    let log = setup.dir.path().join("bridge.log");
    let mut bridge = setup.bridge(&fake, &log);
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
    let setup = Setup::start();
    let log = setup.dir.path().join("bridge.log");
    let (mut bridge, _) = spawn_bridge(&setup.gateway, &fake.api_base, "xapp-wrong", &log);
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
    let (mut bridge, ready) = spawn_bridge(&listen, &fake.api_base, APP_TOKEN, &log);
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
    let setup = Setup::start_on(&listen);
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
