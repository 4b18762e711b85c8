//! `turnstile bridge telegram` end to end against a **fake** of Telegram's Bot API.
//!
//! No real Telegram server can run here, so [`FakeBotApi`] is a scripted stand-in written
//! for these tests: a small HTTP/1.1 server on 127.0.0.1:0 that keeps Telegram's rules the
//! bridge depends on — `getUpdates` long polling where an `offset` confirms (forgets) every
//! earlier update, `sendMessage` ids, `editMessageText` refusing identical text ("message is
//! not modified") and texts over 4,096 UTF-16 units, 429 with `retry_after` on demand, 401
//! for a wrong token, forum topics (`message_thread_id` on `sendMessage` and `sendChatAction`
//! must name a topic that exists: "message thread not found" otherwise; a message sent
//! without it lands in the chat's General topic), `setMessageReaction` refusing anything
//! but a list of emoji reactions, and `parse_mode: HTML` parsed as Telegram documents it (its
//! tags only, balanced, nested as allowed, entities escaped), a malformed text refused with
//! "can't parse entities" ([`parse_entities`]). It is not Telegram and does not pretend to check anything
//! else.
//!
//! The real `turnstile serve` (with a streaming process agent) and the real bridge binary
//! run against it. Nothing sleeps to order events: the agent waits on a FIFO the test writes
//! once it has seen what it waits for, and every wait has a deadline.

mod child_support;
mod common;
mod telegram_fake;
mod telegram_html;
use child_support::{Proc, die_with_parent};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{eventually, holds};
use crossbeam_channel::{Receiver, bounded};
use serde_json::{Value, json};
use telegram_fake::{
    BotState, FakeServer, Shared, TOKEN, error, get_me, get_updates, read_request, respond_json,
};
use telegram_html::parse_entities;

/// Only a failing run waits this long.
const WAIT: Duration = Duration::from_secs(60);
/// The gateway's auth token: the bridge must present it, and never log it.
const GATEWAY_TOKEN: &str = "gateway-secret-4711";

/// One API call the fake received.
#[derive(Clone, Debug)]
struct Call {
    method: String,
    params: Value,
    at: Instant,
    /// What the fake answered: true for `ok`.
    ok: bool,
}

#[derive(Default)]
struct FakeState {
    /// Updates not confirmed yet (Telegram forgets those below the latest offset).
    pending: Vec<Value>,
    calls: Vec<Call>,
    /// Text of every message the bot posted (as shown: HTML parsed), by message id, with its
    /// chat.
    messages: HashMap<i64, (i64, String)>,
    /// The `text` parameter each message was last sent or edited with (HTML unparsed).
    sent_text: HashMap<i64, String>,
    /// Texts refused because their HTML did not parse.
    unparsable: u32,
    next_message_id: i64,
    /// The next this many `sendMessage` calls get a 429.
    rate_limit_sends: u32,
    retry_after: u64,
    /// Edits refused because the text was identical, and texts refused as too long.
    not_modified: u32,
    too_long: u32,
    /// While set, `sendMessage` calls wait (bounded) before they are answered.
    hold_sends: bool,
    /// Forum topics that exist, as (chat, message_thread_id).
    topics: std::collections::HashSet<(i64, i64)>,
    /// The topic each posted message landed in (`None`: the General topic or no forum).
    message_topics: HashMap<i64, Option<i64>>,
}

/// The Bot API's check of `message_thread_id`: absent, or a topic of the chat that exists.
fn topic_check(state: &FakeState, params: &Value) -> Result<Option<i64>, (u16, Value)> {
    match params.get("message_thread_id") {
        None => Ok(None),
        Some(t) => {
            let chat = params["chat_id"].as_i64().unwrap_or(0);
            match t.as_i64() {
                Some(t) if state.topics.contains(&(chat, t)) => Ok(Some(t)),
                _ => Err(error(400, "Bad Request: message thread not found")),
            }
        }
    }
}

/// A FAKE Telegram Bot API (see the module comment): scripted, in-process, for tests only.
type FakeBotApi = FakeServer<FakeState>;

impl BotState for FakeState {
    fn pending(&mut self) -> &mut Vec<Value> {
        &mut self.pending
    }
}

impl FakeServer<FakeState> {
    fn start() -> FakeBotApi {
        let state = FakeState {
            next_message_id: 1000,
            ..FakeState::default()
        };
        FakeServer::spawn(state, serve_http)
    }
}

/// One request per connection (the fake answers `Connection: close`).
fn serve_http(mut stream: TcpStream, shared: &Shared<FakeState>) {
    let Some(request) = read_request(&stream) else {
        return;
    };
    let (status, answer) = match request.method() {
        Some(method) => handle(method, &request.params(), shared),
        None => error(401, "Unauthorized"),
    };
    respond_json(&mut stream, status, &answer);
}

fn handle(method: &str, params: &Value, shared: &Shared<FakeState>) -> (u16, Value) {
    let (lock, cvar) = shared;
    let mut state = lock.lock().unwrap_or_else(|e| e.into_inner());
    let at = Instant::now();
    let (status, body) = match method {
        "getMe" => get_me(),
        "getUpdates" => {
            // Record the call when it arrives (the test checks the offsets asked for).
            state.calls.push(Call {
                method: method.into(),
                params: params.clone(),
                at,
                ok: true,
            });
            cvar.notify_all();
            return get_updates(state, cvar, params, at);
        }
        "sendMessage" => {
            let deadline = at + WAIT;
            while state.hold_sends && Instant::now() < deadline {
                state = cvar
                    .wait_timeout(state, deadline.saturating_duration_since(Instant::now()))
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            let raw = params["text"].as_str().unwrap_or("").to_owned();
            let parsed = shown_text(params, &raw);
            let text = parsed.clone().unwrap_or_default();
            let topic = topic_check(&state, params);
            if let Err(refused) = topic {
                refused
            } else if let Err(e) = parsed {
                state.unparsable += 1;
                error(400, &format!("Bad Request: can't parse entities: {e}"))
            } else if state.rate_limit_sends > 0 {
                state.rate_limit_sends -= 1;
                let after = state.retry_after;
                (
                    429,
                    json!({"ok": false, "error_code": 429,
                        "description": format!("Too Many Requests: retry after {after}"),
                        "parameters": {"retry_after": after}}),
                )
            } else if text.encode_utf16().count() > 4096 {
                state.too_long += 1;
                error(400, "Bad Request: message is too long")
            } else {
                state.next_message_id += 1;
                let id = state.next_message_id;
                let chat = params["chat_id"].as_i64().unwrap_or(0);
                state.messages.insert(id, (chat, text.clone()));
                state.message_topics.insert(id, topic.ok().flatten());
                state.sent_text.insert(id, raw);
                (
                    200,
                    json!({"ok": true, "result": {"message_id": id, "chat": {"id": chat}, "text": text}}),
                )
            }
        }
        "editMessageText" => {
            let id = params["message_id"].as_i64().unwrap_or(0);
            let raw = params["text"].as_str().unwrap_or("").to_owned();
            let parsed = shown_text(params, &raw);
            let text = parsed.clone().unwrap_or_default();
            let current = state.sent_text.get(&id).cloned();
            match current {
                _ if parsed.is_err() => {
                    state.unparsable += 1;
                    let e = parsed.err().unwrap_or_default();
                    error(400, &format!("Bad Request: can't parse entities: {e}"))
                }
                None => error(400, "Bad Request: message to edit not found"),
                Some(t) if t == raw => {
                    state.not_modified += 1;
                    error(
                        400,
                        "Bad Request: message is not modified: specified new message content and reply markup are exactly the same",
                    )
                }
                Some(_) if text.encode_utf16().count() > 4096 => {
                    state.too_long += 1;
                    error(400, "Bad Request: MESSAGE_TOO_LONG")
                }
                Some(_) => {
                    if let Some(m) = state.messages.get_mut(&id) {
                        m.1 = text.clone();
                    }
                    state.sent_text.insert(id, raw);
                    (200, json!({"ok": true, "result": {"message_id": id}}))
                }
            }
        }
        "sendChatAction" => match topic_check(&state, params) {
            Ok(_) => (200, json!({"ok": true, "result": true})),
            Err(refused) => refused,
        },
        "setMessageReaction" => {
            let emoji_only = params["reaction"].as_array().is_some_and(|r| {
                r.iter()
                    .all(|x| x["type"] == "emoji" && x["emoji"].as_str().is_some())
            });
            if params["message_id"].as_i64().is_some() && emoji_only {
                (200, json!({"ok": true, "result": true}))
            } else {
                error(400, "Bad Request: REACTION_INVALID")
            }
        }
        _ => error(404, "Not Found: method not found"),
    };
    state.calls.push(Call {
        method: method.into(),
        params: params.clone(),
        at,
        ok: status == 200,
    });
    cvar.notify_all();
    (status, body)
}

/// What a message with these parameters shows: `raw` itself, or with `parse_mode: HTML` its
/// HTML parsed; the error when it does not parse.
fn shown_text(params: &Value, raw: &str) -> Result<String, String> {
    match params.get("parse_mode").and_then(Value::as_str) {
        None => Ok(raw.to_owned()),
        Some("HTML") => parse_entities(raw),
        Some(other) => Err(format!("unsupported parse mode {other}")),
    }
}

#[test]
fn the_fake_parses_telegram_html_as_documented_and_refuses_malformed_html() {
    assert_eq!(
        parse_entities(
            "<b>a &lt;b&gt; &amp; <i>c</i></b> <pre><code class=\"language-rust\">x</code></pre> <a href=\"https://e.org\">l</a>"
        ),
        Ok("a <b> & c x l".to_owned())
    );
    for bad in [
        "<b>open",
        "</b>",
        "<b><i>x</b></i>",
        "<script>x</script>",
        "a < b",
        "&nbsp;",
        "&amp",
        "<code><b>x</b></code>",
        "<a href=\"https://e.org\"><code>x</code></a>",
        "<blockquote><blockquote>x</blockquote></blockquote>",
        "<b onclick=\"x\">y</b>",
    ] {
        assert!(parse_entities(bad).is_err(), "{bad:?} parsed");
    }
}

/// The streaming process agent: for "stream", a partial, (FIFO) a longer partial, (FIFO) a
/// result over 4,096 UTF-16 units; anything else is echoed with its chat type (and after
/// "flood 9" and "victim" it writes "replied" to the FIFO).
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
    if "whoami" in t:
        out({"op": "reply", "id": i, "text": "session " + m["session"]})
    elif t == "hold":
        open(fifo).read()
        out({"op": "reply", "id": i, "text": "held"})
    elif t.endswith("stream"):
        out({"op": "partial", "id": i, "text": "Hello"})
        open(fifo).read()
        out({"op": "partial", "id": i, "text": "Hello world"})
        open(fifo).read()
        out({"op": "reply", "id": i, "text": "Hello world " + "\U0001F389 " * 3000})
    elif t == "fence":
        code = "".join("let x%d = %d;\n" % (n, n) for n in range(500))
        out({"op": "reply", "id": i, "text": "Intro **bold** & <b>raw</b> [site](https://e.org/?a=1&b=2) [bad](javascript:alert(1))\n\n```rust\n" + code + "```\n\n> quoted `code`\n\n- one\n- two"})
    else:
        out({"op": "reply", "id": i, "text": "echo: %s (%s)" % (t, m["chat_type"])})
        if t in ("flood 9", "victim"):
            # Tells the test this turn was answered (the fairness test waits for it).
            with open(fifo, "w") as f:
                f.write("replied")
"#;

fn final_text() -> String {
    format!("Hello world {}", "🎉 ".repeat(3000))
}

fn first_line(child: &mut Child) -> Receiver<String> {
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = bounded(16);
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
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
        Setup::start_with(listen, None)
    }

    /// With `access` as the `--config` file's text (the access policy's defaults and tables),
    /// else every platform open.
    fn start_with(listen: &str, access: Option<&str>) -> Setup {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = dir.path().join("turnstile.toml");
        std::fs::write(&config, access.unwrap_or("access-default = \"open\"\n")).expect("config");
        let script = dir.path().join("agent.py");
        std::fs::write(&script, AGENT).expect("agent");
        let fifo = dir.path().join("go.fifo");
        let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
        assert!(made.success());
        let cmd = format!("exec python3 {} {}", script.display(), fifo.display());
        let mut serve = die_with_parent(
            Command::new(env!("CARGO_BIN_EXE_turnstile"))
                .args(["serve", "--listen", listen, "--http-listen", "off"])
                .arg("--config")
                .arg(&config)
                .args(["--agent", "process", "--agent-cmd", &cmd])
                .args(["--partial-interval", "0.05"])
                .env("RUST_LOG", "warn")
                .env("TURNSTILE_AUTH_TOKEN", GATEWAY_TOKEN)
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit()),
        )
        .spawn()
        .expect("start serve");
        let line = first_line(&mut serve)
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
    fn bridge(&self, api: &FakeBotApi, state_dir: &Path, log: &Path) -> Proc {
        let (child, ready) = spawn_bridge(&self.gateway, api, state_dir, log);
        assert_eq!(
            ready.recv_timeout(WAIT).expect("the ready line"),
            "ready: telegram as @fake_bot"
        );
        child
    }

    /// Waits (bounded) until the agent says it answered (it writes to the FIFO).
    fn replied(&self) {
        let fifo = self.fifo.clone();
        let (tx, rx) = bounded(1);
        std::thread::spawn(move || {
            let _ = tx.send(std::fs::read_to_string(&fifo));
        });
        let said = rx
            .recv_timeout(WAIT)
            .expect("the agent answered")
            .expect("read");
        assert_eq!(said, "replied");
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

/// Starts `turnstile bridge telegram` against `gateway` and the fake; its stdout lines (the
/// first is the ready line) on the receiver.
fn spawn_bridge(
    gateway: &str,
    api: &FakeBotApi,
    state_dir: &Path,
    log: &Path,
) -> (Proc, Receiver<String>) {
    let log = std::fs::File::create(log).expect("log file");
    let mut child = die_with_parent(
        Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args(["bridge", "telegram", "--gateway", gateway])
            .args(["--api-base", &api.url])
            .arg("--state-dir")
            .arg(state_dir)
            .env("TELEGRAM_BOT_TOKEN", TOKEN)
            .env("TURNSTILE_AUTH_TOKEN", GATEWAY_TOKEN)
            .env("RUST_LOG", "debug")
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log)),
    )
    .spawn()
    .expect("start the bridge");
    let ready = first_line(&mut child);
    (Proc(child), ready)
}

fn private_update(update_id: i64, message_id: i64, text: &str) -> Value {
    json!({"update_id": update_id, "message": {"message_id": message_id, "text": text,
        "chat": {"id": 42, "type": "private"}, "from": {"id": 7, "is_bot": false, "first_name": "Ann"}}})
}

/// A message of user 7 in the forum supergroup -1001, in `topic` (`None`: General).
fn forum_update(update_id: i64, message_id: i64, topic: Option<i64>, text: &str) -> Value {
    let mut m = json!({"message_id": message_id, "text": text,
        "chat": {"id": -1001, "type": "supergroup", "is_forum": true},
        "from": {"id": 7, "is_bot": false, "first_name": "Ann"}});
    if let Some(t) = topic {
        m["message_thread_id"] = json!(t);
        m["is_topic_message"] = json!(true);
    }
    json!({"update_id": update_id, "message": m})
}

/// A private message from user `chat` in its own chat.
fn chat_update(update_id: i64, message_id: i64, chat: i64, text: &str) -> Value {
    json!({"update_id": update_id, "message": {"message_id": message_id, "text": text,
        "chat": {"id": chat, "type": "private"}, "from": {"id": chat, "is_bot": false, "first_name": "Bo"}}})
}

fn assert_no_token(log: &Path) {
    let text = std::fs::read_to_string(log).expect("log");
    assert!(!text.contains(TOKEN), "the bot token leaked into the log");
    assert!(
        !text.contains(GATEWAY_TOKEN),
        "the gateway token leaked into the log"
    );
    assert!(
        !text.contains("FAKE-SECRET"),
        "part of the bot token leaked"
    );
}

#[test]
fn a_streamed_reply_is_one_message_plus_edits_under_429_and_splits_past_4096_units() {
    let api = FakeBotApi::start();
    {
        let mut s = api.lock();
        s.rate_limit_sends = 1;
        s.retry_after = 1;
    }
    api.push_update(private_update(1, 500, "stream"));
    let setup = Setup::start();
    let log = setup.dir.path().join("bridge.log");
    let mut bridge = setup.bridge(&api, &setup.dir.path().join("state"), &log);

    // The first partial: a 429, then the same message after retry_after, replying to the
    // user's message.
    let (refused_at, sent_at, first_id) = api.wait_for("the first message", |s| {
        let sends: Vec<&Call> = s
            .calls
            .iter()
            .filter(|c| c.method == "sendMessage")
            .collect();
        let refused = sends.iter().find(|c| !c.ok)?;
        let sent = sends.iter().find(|c| c.ok)?;
        let id = s
            .messages
            .iter()
            .find(|(_, (_, t))| t == "Hello")
            .map(|(id, _)| *id)?;
        Some((refused.at, (*sent).clone(), id))
    });
    assert!(
        sent_at.at.duration_since(refused_at) >= Duration::from_secs(1),
        "retry_after not honoured: {:?}",
        sent_at.at.duration_since(refused_at)
    );
    assert_eq!(sent_at.params["text"], "Hello");
    assert_eq!(sent_at.params["reply_parameters"]["message_id"], 500);

    // The longer partial edits that message in place.
    setup.go();
    api.wait_for("the edit", |s| {
        (s.messages.get(&first_id)?.1 == "Hello world").then_some(())
    });

    // The result: the first message filled up, the rest in new messages, all of it shown.
    setup.go();
    let expected = final_text();
    let pieces = api.wait_for("the whole result", |s| {
        let mut ids: Vec<i64> = s
            .messages
            .iter()
            .filter(|(_, (chat, _))| *chat == 42)
            .map(|(id, _)| *id)
            .filter(|id| *id >= first_id)
            .collect();
        ids.sort();
        let texts: Vec<String> = ids.iter().map(|id| s.messages[id].1.clone()).collect();
        // Markdown drops the text's trailing space.
        (texts.concat() == expected.trim_end()).then_some(texts)
    });
    assert!(pieces.len() >= 2, "{} messages", pieces.len());
    for p in &pieces {
        assert!(p.encode_utf16().count() <= 4096);
    }
    let s = api.lock();
    assert_eq!(s.not_modified, 0, "an edit repeated the text already shown");
    assert_eq!(s.too_long, 0, "a text over 4,096 UTF-16 units was sent");
    let continued: Vec<&Call> = s
        .calls
        .iter()
        .filter(|c| c.method == "sendMessage" && c.ok && c.params["text"] != "Hello")
        .collect();
    assert!(!continued.is_empty());
    assert!(
        continued
            .iter()
            .all(|c| c.params.get("reply_parameters").is_none()),
        "only the first message replies to the user"
    );
    assert!(
        s.calls
            .iter()
            .any(|c| c.method == "sendChatAction" && c.params["action"] == "typing"),
        "typing was shown"
    );
    // The poll after the update confirmed it.
    assert!(
        s.calls
            .iter()
            .any(|c| c.method == "getUpdates" && c.params["offset"] == 2)
    );
    drop(s);
    assert!(bridge.terminate().success(), "SIGTERM exits 0");
    assert_no_token(&log);
}

/// Issue 32 rows 1 and 3 through the real bridge and the fake Bot API, with the default
/// policy (`pairing`, groups by mention) and one allowed user: in the group, chatter is not
/// answered and a message naming `@fake_bot` is; a stranger's DM gets the pairing notice.
#[test]
fn a_group_is_answered_only_when_it_names_the_bot_and_a_stranger_gets_a_pairing_notice() {
    let api = FakeBotApi::start();
    let group = |update_id: i64, message_id: i64, text: &str| {
        json!({"update_id": update_id, "message": {"message_id": message_id, "text": text,
            "chat": {"id": -100, "type": "supergroup"}, "from": {"id": 8, "first_name": "Bob"}}})
    };
    api.push_update(group(20, 700, "chatter among humans"));
    api.push_update(group(21, 701, "@fake_bot are you there?"));
    api.push_update(private_update(22, 702, "let me in"));
    let setup = Setup::start_with("127.0.0.1:0", Some("[access.telegram]\nallow = [\"8\"]\n"));
    let state = setup.dir.path().join("state");
    let log = setup.dir.path().join("bridge.log");
    let mut bridge = setup.bridge(&api, &state, &log);
    let sent = |s: &FakeState, pred: &dyn Fn(&str) -> bool| {
        s.calls
            .iter()
            .filter(|c| c.method == "sendMessage" && c.params["text"].as_str().is_some_and(pred))
            .count()
    };
    api.wait_for(
        "the mention's answer, the notice and the confirming poll",
        |s| {
            let polled = s
                .calls
                .iter()
                .any(|c| c.method == "getUpdates" && c.params["offset"] == 23);
            let answered = sent(s, &|t| t == "echo: @fake_bot are you there? (group)") == 1;
            let noticed = sent(s, &|t| t.starts_with("This bot is private")) == 1;
            (answered && noticed && polled).then_some(())
        },
    );
    let s = api.lock();
    assert_eq!(
        sent(&s, &|t| t.contains("chatter")),
        0,
        "the chatter was answered"
    );
    assert_eq!(
        sent(&s, &|t| t.contains("let me in")),
        0,
        "the stranger reached the agent"
    );
    drop(s);
    assert!(bridge.terminate().success());
}

#[test]
fn a_restarted_bridge_resumes_from_its_saved_offset_and_processes_no_update_twice() {
    let api = FakeBotApi::start();
    api.push_update(private_update(10, 600, "one"));
    api.push_update(
        json!({"update_id": 11, "message": {"message_id": 601, "text": "two",
        "chat": {"id": -100, "type": "supergroup"}, "from": {"id": 8, "first_name": "Bob"}}}),
    );
    let setup = Setup::start();
    let state = setup.dir.path().join("state");
    let log = setup.dir.path().join("bridge-1.log");
    let mut first = setup.bridge(&api, &state, &log);
    let replies = |s: &FakeState, text: &str| {
        s.calls
            .iter()
            .filter(|c| c.method == "sendMessage" && c.ok && c.params["text"] == text)
            .count()
    };
    api.wait_for("both replies and the confirming poll", |s| {
        let polled = s
            .calls
            .iter()
            .any(|c| c.method == "getUpdates" && c.params["offset"] == 12);
        (replies(s, "echo: one (dm)") == 1 && replies(s, "echo: two (group)") == 1 && polled)
            .then_some(())
    });
    {
        let s = api.lock();
        let group = s
            .calls
            .iter()
            .find(|c| c.params["text"] == "echo: two (group)")
            .expect("group reply");
        assert_eq!(group.params["chat_id"], -100);
        assert_eq!(group.params["reply_parameters"]["message_id"], 601);
    }
    assert!(first.terminate().success());
    assert_eq!(
        std::fs::read_to_string(state.join("telegram-offset"))
            .expect("state file")
            .trim(),
        "12"
    );
    assert_no_token(&log);

    // As if Telegram never got the confirmation, the old updates are offered again; a new
    // one arrived while the bridge was down.
    let calls_before = api.lock().calls.len();
    api.push_update(private_update(10, 600, "one"));
    api.push_update(private_update(12, 602, "three"));
    let log = setup.dir.path().join("bridge-2.log");
    let mut second = setup.bridge(&api, &state, &log);
    api.wait_for("the new update's reply", |s| {
        (replies(s, "echo: three (dm)") == 1).then_some(())
    });
    let s = api.lock();
    let first_poll = s.calls[calls_before..]
        .iter()
        .find(|c| c.method == "getUpdates")
        .expect("a poll");
    assert_eq!(
        first_poll.params["offset"], 12,
        "the restarted bridge starts from the saved offset"
    );
    assert_eq!(replies(&s, "echo: one (dm)"), 1, "update 10 processed once");
    assert_eq!(
        replies(&s, "echo: two (group)"),
        1,
        "update 11 processed once"
    );
    drop(s);
    assert!(second.terminate().success());
    assert_no_token(&log);
}

#[test]
fn the_offset_moves_only_once_the_gateway_has_the_message() {
    let api = FakeBotApi::start();
    api.push_update(private_update(20, 700, "early"));
    // The gateway is not there yet: the bridge gets the update but cannot hand it over.
    let listen = {
        let probe = TcpListener::bind("127.0.0.1:0").expect("bind");
        probe.local_addr().expect("addr").to_string()
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("state");
    let log = dir.path().join("bridge.log");
    let (mut bridge, ready) = spawn_bridge(&listen, &api, &state, &log);
    // Ordered by the bridge's own log (bounded polling of another process's output): it has
    // the update, then failed to reach the gateway twice more — time it would have used to
    // poll past the update if it did not wait for the gateway's answer.
    eventually(
        "the bridge got the update, then retried twice",
        WAIT,
        || {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            holds(text, |t| {
                t.find("telegram: update 20 from chat 42")
                    .is_some_and(|at| t[at..].matches("reconnecting in").count() >= 2)
            })
        },
    );
    assert!(
        !api.lock()
            .calls
            .iter()
            .any(|c| c.method == "getUpdates" && c.params["offset"] == 21),
        "the offset moved while the gateway was down"
    );
    // Taken before the gateway starts: nothing can have been acked earlier.
    let gateway_up = Instant::now();
    let setup = Setup::start_on(&listen);
    assert_eq!(
        ready
            .recv_timeout(WAIT)
            .expect("ready once the gateway is up"),
        "ready: telegram as @fake_bot"
    );
    api.wait_for("the reply", |s| {
        s.calls
            .iter()
            .any(|c| c.method == "sendMessage" && c.params["text"] == "echo: early (dm)")
            .then_some(())
    });
    let s = api.lock();
    let advanced: Vec<&Call> = s
        .calls
        .iter()
        .filter(|c| c.method == "getUpdates" && c.params["offset"] == 21)
        .collect();
    assert!(!advanced.is_empty(), "the offset moved past the update");
    assert!(
        advanced.iter().all(|c| c.at >= gateway_up),
        "the offset moved before the gateway had the message"
    );
    drop(s);
    assert!(bridge.terminate().success());
    assert_eq!(
        std::fs::read_to_string(state.join("telegram-offset"))
            .expect("state file")
            .trim(),
        "21"
    );
    drop(setup);
}

/// `serve --config` with a `[[bridge]]` table runs the bridge as a supervised child: it
/// answers through the gateway, is restarted after it is killed, and is stopped (gone) when
/// the gateway shuts down.
#[test]
fn a_bridge_table_runs_the_bridge_supervised_by_serve() {
    let api = FakeBotApi::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let script = dir.path().join("agent.py");
    std::fs::write(&script, AGENT).expect("agent");
    let config = dir.path().join("turnstile.toml");
    let state = dir.path().join("state");
    std::fs::write(
        &config,
        format!(
            "agent = \"process\"\nagent-cmd = \"exec python3 {} unused\"\n\n[[bridge]]\nplatform = \"telegram\"\nargs = [\"--api-base\", \"{}\", \"--state-dir\", \"{}\", \"--poll-timeout\", \"1\"]\n",
            script.display(),
            api.url,
            state.display()
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
            .env("TELEGRAM_BOT_TOKEN", TOKEN)
            .env("TURNSTILE_AUTH_TOKEN", GATEWAY_TOKEN)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    )
    .spawn()
    .expect("start serve");
    let stderr = serve.stderr.take().expect("stderr");
    let (log_tx, log) = crossbeam_channel::unbounded::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { return };
            if log_tx.send(line).is_err() {
                return;
            }
        }
    });
    let _stdout = first_line(&mut serve);
    let mut serve = Proc(serve);
    let started_pid = || -> i32 {
        loop {
            let line = log.recv_timeout(WAIT).expect("a log line in time");
            assert!(
                !line.contains(GATEWAY_TOKEN) && !line.contains(TOKEN),
                "{line}"
            );
            if let Some(rest) = line.split("bridge #1 (telegram): started (pid ").nth(1) {
                return rest.trim_end_matches(')').parse().expect("pid");
            }
        }
    };
    let replies = |s: &FakeState, text: &str| {
        s.calls
            .iter()
            .filter(|c| c.method == "sendMessage" && c.ok && c.params["text"] == text)
            .count()
    };
    let first = started_pid();
    api.push_update(private_update(20, 700, "one"));
    api.wait_for("the first reply", |s| {
        (replies(s, "echo: one (dm)") == 1).then_some(())
    });
    // SAFETY: kill(2) of the bridge the gateway started (alive: it just answered).
    assert_eq!(unsafe { libc::kill(first, libc::SIGKILL) }, 0);
    let second = started_pid();
    assert_ne!(first, second, "a new bridge process");
    api.push_update(private_update(21, 701, "two"));
    api.wait_for("the restarted bridge's reply", |s| {
        (replies(s, "echo: two (dm)") == 1).then_some(())
    });
    assert!(serve.terminate().success());
    // The bridge was the gateway's child and is reaped by it before it exits: gone.
    let gone = std::fs::read_to_string(format!("/proc/{second}/stat"))
        .map(|s| s.contains(") Z "))
        .unwrap_or(true);
    assert!(gone, "the bridge outlived the gateway");
}

/// The agent of the restart test: every turn is logged (one line, its text, in `log`), runs
/// in a thread of its own, and a "slow" one reads one `go\n` (3 bytes, written at once) from
/// the FIFO before it answers "echo: TEXT".
const RESTART_AGENT: &str = r#"
import json, os, sys, threading
fifo, log = sys.argv[1], sys.argv[2]
lock = threading.Lock()
def out(o):
    with lock:
        sys.stdout.write(json.dumps(o) + "\n"); sys.stdout.flush()
def turn(i, t):
    with lock:
        with open(log, "a") as f:
            f.write(t + "\n")
    if t.startswith("slow"):
        fd = os.open(fifo, os.O_RDONLY)
        os.read(fd, 3)
        os.close(fd)
    out({"op": "reply", "id": i, "text": "echo: " + t})
for line in sys.stdin:
    m = json.loads(line)
    if m.get("op") == "turn":
        threading.Thread(target=turn, args=(m["id"], m["text"])).start()
"#;

/// `turnstile serve --data-dir data` on `listen` with [`RESTART_AGENT`]; its stderr lines on
/// the receiver.
fn serve_durable(listen: &str, dir: &Path) -> (Proc, Receiver<String>) {
    let cmd = format!(
        "exec python3 {} {} {}",
        dir.join("agent.py").display(),
        dir.join("go.fifo").display(),
        dir.join("turns.log").display()
    );
    let mut serve = die_with_parent(
        Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args(["serve", "--listen", listen, "--http-listen", "off"])
            .args(["--agent", "process", "--agent-cmd", &cmd])
            .args(["--access-default", "open"])
            .arg("--data-dir")
            .arg(dir.join("data"))
            .env("RUST_LOG", "info")
            .env("TURNSTILE_AUTH_TOKEN", GATEWAY_TOKEN)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    )
    .spawn()
    .expect("start serve");
    let stderr = serve.stderr.take().expect("stderr");
    let (tx, log) = crossbeam_channel::unbounded::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let line = first_line(&mut serve)
        .recv_timeout(WAIT)
        .expect("listening");
    assert_eq!(line, format!("listening on {listen}"));
    (Proc(serve), log)
}

/// Row 14 of issue 30, the gateway's side: a gateway (`--data-dir`) is stopped with SIGTERM
/// while four turns of four chats run; they finish in the drain, their replies go to the
/// bridge, which shows them (the fake holds the posts until the drain is over) and confirms
/// them. The gateway waits for those confirmations
/// and journals them before it exits: after a restart (gateway and bridge, the bridge with a
/// fresh state directory so that only the gateway can prevent a repeat) nothing is
/// redelivered — each reply was shown once, each message answered once, every agent turn
/// run once. Before, the gateway exited without reading the confirmations and the restart
/// showed the four replies again.
#[test]
fn a_gateway_restart_mid_burst_shows_each_reply_once() {
    let api = FakeBotApi::start();
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("agent.py"), RESTART_AGENT).expect("agent");
    let fifo = dir.path().join("go.fifo");
    let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
    assert!(made.success());
    let listen = {
        let probe = TcpListener::bind("127.0.0.1:0").expect("bind");
        probe.local_addr().expect("addr").to_string()
    };
    let replies = |s: &FakeState, text: &str| {
        s.calls
            .iter()
            .filter(|c| c.method == "sendMessage" && c.ok && c.params["text"] == text)
            .count()
    };
    let (mut serve, log) = serve_durable(&listen, dir.path());
    let log_1 = dir.path().join("bridge-1.log");
    let (mut bridge, ready) = spawn_bridge(&listen, &api, &dir.path().join("state-1"), &log_1);
    assert_eq!(
        ready.recv_timeout(WAIT).expect("the ready line"),
        "ready: telegram as @fake_bot"
    );
    // The replies are shown only once the drain is over (the gateway in its last steps):
    // their confirmations come after it.
    api.lock().hold_sends = true;
    for n in 1..=4 {
        api.push_update(json!({"update_id": n, "message": {"message_id": 100 + n,
            "text": format!("slow {n}"), "chat": {"id": 40 + n, "type": "private"},
            "from": {"id": 7, "is_bot": false, "first_name": "Ann"}}}));
    }
    // The offset moves past all four once the gateway has accepted them: they are running.
    api.wait_for("the four messages accepted", |s| {
        s.calls
            .iter()
            .any(|c| c.method == "getUpdates" && c.params["offset"] == 5)
            .then_some(())
    });
    // SAFETY: kill(2) on our own child.
    assert_eq!(unsafe { libc::kill(serve.0.id() as i32, libc::SIGTERM) }, 0);
    loop {
        let line = log.recv_timeout(WAIT).expect("the drain begins");
        if line.contains("shutting down") {
            break;
        }
    }
    // The four turns go on in the drain: four `go` in the FIFO, held open (its data stays
    // for the agents that open it later) until the test ends.
    let (hold_tx, hold_rx) = bounded::<()>(0);
    let writer_fifo = fifo.clone();
    std::thread::spawn(move || {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(&writer_fifo)
            .expect("open the FIFO");
        // One write (atomic, under PIPE_BUF) while the first reader, waiting for it, holds
        // the FIFO open: a write with no reader would fail.
        f.write_all(b"go\ngo\ngo\ngo\n").expect("write");
        let _ = hold_rx.recv();
    });
    loop {
        let line = log.recv_timeout(WAIT).expect("the drain ends");
        if line.contains("shutdown complete") {
            break;
        }
    }
    api.lock().hold_sends = false;
    api.notify();
    let status = serve.wait_exit();
    assert!(status.success(), "gateway exit status {status:?}");
    api.wait_for("the four replies shown", |s| {
        (1..=4)
            .all(|n| replies(s, &format!("echo: slow {n}")) == 1)
            .then_some(())
    });
    assert!(bridge.terminate().success());
    drop(hold_tx);

    // Both restart (as under `[[bridge]]`); a new message's reply comes after anything the
    // gateway would redeliver (an outbox is redelivered first, at the bridge's hello).
    let (mut serve, _log) = serve_durable(&listen, dir.path());
    let log_2 = dir.path().join("bridge-2.log");
    let (mut bridge, ready) = spawn_bridge(&listen, &api, &dir.path().join("state-2"), &log_2);
    assert_eq!(
        ready.recv_timeout(WAIT).expect("the ready line"),
        "ready: telegram as @fake_bot"
    );
    api.push_update(private_update(5, 105, "after"));
    api.wait_for("the new message's reply", |s| {
        (replies(s, "echo: after") == 1).then_some(())
    });
    assert!(bridge.terminate().success());
    assert!(serve.terminate().success());
    let s = api.lock();
    for n in 1..=4 {
        let shown = replies(&s, &format!("echo: slow {n}"));
        assert_eq!(shown, 1, "the reply to slow {n} was shown {shown} times");
    }
    drop(s);
    let turns = std::fs::read_to_string(dir.path().join("turns.log")).expect("turns");
    let mut turns: Vec<&str> = turns.lines().collect();
    turns.sort_unstable();
    assert_eq!(turns, ["after", "slow 1", "slow 2", "slow 3", "slow 4"]);
    assert_no_token(&log_1);
    assert_no_token(&log_2);
}

/// Issue 30 row 4: the Bot API holds the bridge's first `sendMessage` (a paced API) while one
/// chat's ten answers and then another chat's first answer reach the bridge; once released,
/// the other chat's answer goes out within one round of the chats (among the first three
/// messages), not behind the flooding chat's nine others (before: eleventh).
///
/// Order without sleeps: the agent writes to the FIFO after answering "flood 9" and after
/// "victim"; a probe message from a third chat is acknowledged by the gateway on the bridge's
/// connection after the victim's answer, and the poll past it is seen by the fake.
#[test]
fn a_flooding_chat_cannot_hold_another_chats_first_reply_behind_its_own() {
    let api = FakeBotApi::start();
    api.lock().hold_sends = true;
    for i in 0..10 {
        api.push_update(chat_update(1 + i, 500 + i, 42, &format!("flood {i}")));
    }
    let setup = Setup::start();
    let log = setup.dir.path().join("bridge.log");
    let mut bridge = setup.bridge(&api, &setup.dir.path().join("state"), &log);
    setup.replied();
    api.push_update(chat_update(11, 600, 43, "victim"));
    setup.replied();
    api.push_update(chat_update(12, 700, 44, "probe"));
    api.wait_for("the probe acknowledged", |s| {
        s.calls
            .iter()
            .any(|c| c.method == "getUpdates" && c.params["offset"] == 13)
            .then_some(())
    });
    api.lock().hold_sends = false;
    api.notify();
    let chats = api.wait_for("every answer", |s| {
        let chats: Vec<i64> = s
            .calls
            .iter()
            .filter(|c| c.method == "sendMessage" && c.ok)
            .filter_map(|c| c.params["chat_id"].as_i64())
            .collect();
        (chats.len() >= 12).then_some(chats)
    });
    let victim_at = chats
        .iter()
        .position(|c| *c == 43)
        .expect("the victim answered");
    assert!(
        victim_at <= 2,
        "the other chat's answer went out at position {victim_at}: {chats:?}"
    );
    assert_eq!(chats.iter().filter(|c| **c == 42).count(), 10, "{chats:?}");
    assert!(bridge.terminate().success(), "SIGTERM exits 0");
    assert_no_token(&log);
}

/// Issue 35 row 3: a forum topic is a conversation of its own: its session key holds the
/// topic, and the reply and the typing go into the topic; the General topic's message is
/// answered in General, in its own session.
#[test]
fn issue35_a_forum_topic_is_its_own_session_and_is_answered_in_the_topic() {
    let api = FakeBotApi::start();
    api.lock().topics.insert((-1001, 77));
    api.lock().topics.insert((-1001, 66));
    api.push_update(forum_update(1, 502, Some(77), "@fake_bot stream"));
    api.push_update(forum_update(2, 501, None, "@fake_bot whoami"));
    api.push_update(forum_update(3, 500, Some(66), "@fake_bot whoami"));
    let setup = Setup::start();
    let log = setup.dir.path().join("bridge.log");
    let mut bridge = setup.bridge(&api, &setup.dir.path().join("state"), &log);
    let posted = |s: &FakeState, text: &str| {
        s.calls.iter().find_map(|c| {
            (c.method == "sendMessage" && c.ok && c.params["text"] == text)
                .then(|| c.params.clone())
        })
    };
    let (in_topic, in_general) = api.wait_for("both answers", |s| {
        Some((
            posted(s, "session telegram:group:-1001:thread:66:user:7")?,
            posted(s, "session telegram:group:-1001:user:7")?,
        ))
    });
    assert_eq!(in_topic["message_thread_id"], 66, "{in_topic}");
    assert_eq!(in_topic["reply_parameters"]["message_id"], 500);
    assert!(
        in_general.get("message_thread_id").is_none(),
        "{in_general}"
    );
    // A streaming reply in the topic: its typing and its first line are in the topic (its
    // edits name only the message, which stays where it was posted).
    let typing = api.wait_for("typing in the topic", |s| {
        s.calls
            .iter()
            .find(|c| c.method == "sendChatAction" && c.ok && c.params["message_thread_id"] == 77)
            .map(|c| c.params.clone())
    });
    assert_eq!(typing["chat_id"], -1001, "{typing}");
    let first = api.wait_for("the first line", |s| posted(s, "Hello"));
    assert_eq!(first["message_thread_id"], 77);
    let first_id = api.wait_for("its id", |s| {
        s.messages
            .iter()
            .find_map(|(id, (_, t))| (t == "Hello").then_some(*id))
    });
    let s = api.lock();
    let refused: Vec<_> = s
        .calls
        .iter()
        .filter(|c| !c.ok && c.method != "getUpdates")
        .collect();
    assert!(refused.is_empty(), "calls the Bot API refused: {refused:?}");
    assert_eq!(s.message_topics.get(&first_id), Some(&Some(77)));
    drop(s);
    assert!(bridge.terminate().success());
    assert_no_token(&log);
}

/// Issue 35 row 5: a message queued behind a running turn gets one 👀 reaction while it
/// waits; the running message gets none; its reply still comes.
#[test]
fn issue35_a_message_queued_behind_a_running_turn_is_marked_once() {
    let api = FakeBotApi::start();
    api.push_update(private_update(1, 500, "hold"));
    let setup = Setup::start();
    let log = setup.dir.path().join("bridge.log");
    let mut bridge = setup.bridge(&api, &setup.dir.path().join("state"), &log);
    api.wait_for("typing: the turn runs", |s| {
        s.calls
            .iter()
            .any(|c| c.method == "sendChatAction" && c.ok && c.params["chat_id"] == 42)
            .then_some(())
    });
    api.push_update(private_update(2, 501, "second"));
    api.push_update(private_update(3, 502, "third"));
    let mark = api.wait_for("a reaction", |s| {
        s.calls
            .iter()
            .find(|c| c.method == "setMessageReaction" && c.ok)
            .map(|c| c.params.clone())
    });
    assert_eq!(mark["chat_id"], 42);
    assert_eq!(mark["reaction"], json!([{"type": "emoji", "emoji": "👀"}]));
    setup.go();
    api.wait_for("the queued messages' replies", |s| {
        let replied = |t: &str| {
            s.calls
                .iter()
                .any(|c| c.method == "sendMessage" && c.ok && c.params["text"] == t)
        };
        (replied("echo: second (dm)") && replied("echo: third (dm)")).then_some(())
    });
    let s = api.lock();
    let marked: Vec<i64> = s
        .calls
        .iter()
        .filter(|c| c.method == "setMessageReaction")
        .filter_map(|c| c.params["message_id"].as_i64())
        .collect();
    assert!(
        !marked.contains(&500),
        "the running message was marked: {marked:?}"
    );
    let mut unique = marked.clone();
    unique.dedup();
    assert_eq!(unique, marked, "a message marked twice: {marked:?}");
    assert!(marked.iter().all(|m| [501, 502].contains(m)), "{marked:?}");
    drop(s);
    assert!(bridge.terminate().success());
}

/// Issue 36 row 4 (Telegram): a reply with a code fence longer than one message is sent as
/// `parse_mode: HTML` the fake parses (nothing refused as "can't parse entities"): the fence
/// is split between lines, closed at the end of each message and opened again with its
/// language in the next; the raw HTML and the `javascript:` link are escaped or dropped.
#[test]
fn a_code_fence_longer_than_a_message_is_sent_as_telegram_html_split_and_reopened() {
    let api = FakeBotApi::start();
    api.push_update(private_update(1, 500, "fence"));
    let setup = Setup::start();
    let log = setup.dir.path().join("bridge.log");
    let mut bridge = setup.bridge(&api, &setup.dir.path().join("state"), &log);
    let sent = api.wait_for("the whole reply", |s| {
        let sends: Vec<&Call> = s
            .calls
            .iter()
            .filter(|c| c.method == "sendMessage" && c.ok)
            .collect();
        let done = sends.last()?.params["text"].as_str()?.ends_with("two");
        done.then(|| {
            sends
                .iter()
                .map(|c| c.params.clone())
                .collect::<Vec<Value>>()
        })
    });
    let s = api.lock();
    assert_eq!(s.unparsable, 0, "a text the Bot API cannot parse was sent");
    assert!(sent.len() >= 2, "{} messages", sent.len());
    let html: Vec<&str> = sent.iter().filter_map(|p| p["text"].as_str()).collect();
    for p in &sent {
        assert_eq!(p["parse_mode"], "HTML");
    }
    assert!(
        html[0].starts_with("Intro <b>bold</b> &amp; &lt;b&gt;raw&lt;/b&gt; <a href=\"https://e.org/?a=1&amp;b=2\">site</a> bad\n\n<pre><code class=\"language-rust\">let x0 = 0;"),
        "{}",
        html[0]
    );
    for (i, h) in html.iter().enumerate() {
        assert!(!h.to_lowercase().contains("javascript"), "{h}");
        if i + 1 < html.len() {
            assert!(
                h.ends_with(";\n</code></pre>"),
                "piece {i} cut inside a line: {h}"
            );
        }
        if i > 0 {
            assert!(
                h.starts_with("<pre><code class=\"language-rust\">let x"),
                "piece {i}: {h}"
            );
        }
    }
    // What the human sees: every line of code once, no backticks, the quote and list after.
    let shown: String = s
        .messages
        .values()
        .filter(|(chat, _)| *chat == 42)
        .map(|(_, t)| t.as_str())
        .collect::<Vec<_>>()
        .join("");
    for n in 0..500 {
        assert_eq!(
            shown.matches(&format!("let x{n} = {n};")).count(),
            1,
            "line {n}"
        );
    }
    assert!(!shown.contains("```"));
    assert!(
        html.last()
            .is_some_and(|h| h.ends_with("<blockquote>quoted code</blockquote>\n\n• one\n• two"))
    );
    drop(s);
    assert!(bridge.terminate().success(), "SIGTERM exits 0");
    assert_no_token(&log);
}
