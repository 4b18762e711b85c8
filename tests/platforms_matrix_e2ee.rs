//! `turnstile bridge matrix` in **end-to-end encrypted** rooms, against the real Synapse, with
//! an independent encrypting client as the human: matrix-nio with its E2E support (the
//! `vodozemac` Python bindings), driven by tests/matrix_support/e2ee_client.py. What is
//! asserted is what that client decrypts.
//!
//! Without Synapse or nio installed the tests say so and pass, except under `.ci/run`
//! (`TURNSTILE_REQUIRE_REAL_SERVERS=1`), where either missing fails them. Nothing sleeps to
//! order events: every wait is a channel receive with a deadline.

mod common;
mod matrix_support;

mod child_support;
use child_support::{Proc, die_with_parent};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Instant;

use crossbeam_channel::{Receiver, RecvTimeoutError, bounded};
use serde_json::{Value, json};

use matrix_support::{Synapse, User, WAIT, synapse, venv};

const GATEWAY_TOKEN: &str = "gateway-token-for-the-e2ee-test";
const PICKLE_KEY: &str = "pickle-key-never-to-be-logged-7f3a";

fn stdout_lines(child: &mut Child) -> Receiver<String> {
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = bounded(256);
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

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// Whether matrix-nio with E2E support is installed in the Synapse venv (`.ci/synapse.sh`
/// installs it); a missing one fails under `TURNSTILE_REQUIRE_REAL_SERVERS=1`.
fn nio_installed() -> bool {
    let ok = Command::new(venv().join("bin/python"))
        .args([
            "-c",
            "import nio.crypto, sys; sys.exit(0 if nio.crypto.ENCRYPTION_ENABLED else 1)",
        ])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        if std::env::var("TURNSTILE_REQUIRE_REAL_SERVERS").as_deref() == Ok("1") {
            panic!(
                "matrix-nio[e2e] is not installed in {} but TURNSTILE_REQUIRE_REAL_SERVERS=1 (.ci/synapse.sh installs it)",
                venv().display()
            );
        }
        eprintln!(
            "SKIPPED: matrix-nio[e2e] is not installed in {} (run .ci/synapse.sh)",
            venv().display()
        );
    }
    ok
}

/// `turnstile serve` on `port` with the streaming agent.
fn serve(port: u16) -> Proc {
    let agent = format!(
        "python3 {}/tests/agents/matrix_stream.py",
        env!("CARGO_MANIFEST_DIR")
    );
    let mut child = die_with_parent(
        Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--http-listen", "off", "--agent", "process"])
            .args(["--agent-cmd", &agent, "--partial-interval", "0.05"])
            .args(["--access-default", "open"])
            .env("RUST_LOG", "warn")
            .env("TURNSTILE_AUTH_TOKEN", GATEWAY_TOKEN)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit()),
    )
    .spawn()
    .expect("start serve");
    let first = stdout_lines(&mut child)
        .recv_timeout(WAIT)
        .expect("listening line");
    assert!(first.starts_with("listening on "), "{first}");
    Proc(child)
}

struct Bridge {
    proc: Proc,
    log: std::path::PathBuf,
}

/// `turnstile bridge matrix` for `bot` (the pickle key in its environment); waits for `ready:`.
fn bridge(hs: &Synapse, bot: &User, port: u16, dir: &Path, args: &[&str]) -> Bridge {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let log = dir.join(format!("bridge-{n}.log"));
    let mut child = die_with_parent(
        Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args([
                "bridge",
                "matrix",
                "--gateway",
                &format!("127.0.0.1:{port}"),
            ])
            .args(["--homeserver", &hs.base])
            .args(args)
            .env("MATRIX_ACCESS_TOKEN", &bot.token)
            .env("MATRIX_PICKLE_KEY", PICKLE_KEY)
            .env("TURNSTILE_AUTH_TOKEN", GATEWAY_TOKEN)
            .env("RUST_LOG", "debug")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).expect("log file")),
    )
    .spawn()
    .expect("start bridge");
    let ready = stdout_lines(&mut child)
        .recv_timeout(WAIT)
        .expect("ready line");
    assert!(ready.starts_with("ready:"), "{ready}");
    Bridge {
        proc: Proc(child),
        log,
    }
}

impl Bridge {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).expect("bridge log")
    }

    /// No secret in the log: neither token nor the pickle key.
    fn assert_no_secret_logged(&self, bot: &User) {
        let log = self.log();
        assert!(!log.is_empty());
        assert!(!log.contains(&bot.token), "the access token was logged");
        assert!(!log.contains(GATEWAY_TOKEN), "the gateway token was logged");
        assert!(!log.contains(PICKLE_KEY), "the pickle key was logged");
    }

    fn stop(mut self) {
        // SAFETY: kill(2) on our own child.
        assert_eq!(
            unsafe { libc::kill(self.proc.0.id() as i32, libc::SIGTERM) },
            0
        );
        let status = self.proc.0.wait().expect("wait");
        assert_eq!(status.code(), Some(0), "SIGTERM exits 0");
    }
}

/// The human's encrypting client (nio), one process, driven by JSON lines.
struct Nio {
    _proc: Proc,
    stdin: ChildStdin,
    lines: Receiver<String>,
    /// Everything it reported, in order.
    log: Vec<Value>,
    /// Its device id and Ed25519 key (as Element shows a session's id and key).
    device: (String, String),
}

enum Login<'a> {
    Token(&'a User),
    /// A second device of the user (a password login).
    Password(&'a User),
}

impl Nio {
    fn start(hs: &Synapse, login: Login<'_>, store: &Path) -> Nio {
        std::fs::create_dir_all(store).expect("store dir");
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/matrix_support/e2ee_client.py"
        );
        let (user, mode, secret) = match login {
            Login::Token(u) => (u, "--token", u.token.clone()),
            Login::Password(u) => (u, "--password", "pw-not-used".to_owned()),
        };
        let mut child = die_with_parent(
            Command::new(venv().join("bin/python"))
                .arg(script)
                .args([&hs.base, &user.mxid, mode, &secret])
                .arg(store)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(std::fs::File::create(store.join("nio.log")).expect("nio log")),
        )
        .spawn()
        .expect("start the nio client");
        let stdin = child.stdin.take().expect("stdin");
        let lines = stdout_lines(&mut child);
        let mut nio = Nio {
            _proc: Proc(child),
            stdin,
            lines,
            log: Vec::new(),
            device: (String::new(), String::new()),
        };
        let ready = nio.until("nio ready", |v| v["ev"] == "ready");
        let field = |k: &str| {
            ready[k]
                .as_str()
                .expect("ready names the device")
                .to_owned()
        };
        nio.device = (field("device"), field("ed25519"));
        nio
    }

    fn send(&mut self, cmd: Value) {
        writeln!(self.stdin, "{cmd}").expect("write to nio");
    }

    /// Reads the client's reports until `pred` holds for one; returns it.
    fn until(&mut self, what: &str, mut pred: impl FnMut(&Value) -> bool) -> Value {
        if let Some(v) = self.log.iter().find(|v| pred(v)) {
            return v.clone();
        }
        let deadline = Instant::now() + WAIT;
        loop {
            let line = match self.lines.recv_deadline(deadline) {
                Ok(l) => l,
                Err(RecvTimeoutError::Timeout) => panic!(
                    "timed out waiting for {what}; nio saw:\n{}",
                    self.transcript()
                ),
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("nio ended waiting for {what}:\n{}", self.transcript())
                }
            };
            let v: Value = serde_json::from_str(&line)
                .unwrap_or_else(|_| json!({"ev": "noise", "line": line}));
            self.log.push(v.clone());
            if pred(&v) {
                return v;
            }
        }
    }

    fn transcript(&self) -> String {
        self.log.iter().map(|v| format!("{v}\n")).collect()
    }

    fn create(&mut self, invite: &[&str]) -> String {
        self.send(json!({"op": "create", "invite": invite}));
        let v = self.until("the room created", |v| v["ev"] == "created");
        v["room"].as_str().expect("room").to_owned()
    }

    /// Says `text` (encrypted; `late`: its key held back until `release`); the event id.
    fn say(&mut self, room: &str, text: &str, late: bool) -> String {
        let n = self.log.len();
        self.send(json!({"op": if late { "say_late" } else { "say" }, "room": room, "text": text}));
        let mut i = 0;
        let v = self.until("the message sent", |v| {
            i += 1;
            i > n && v["ev"] == "sent"
        });
        v["event_id"]
            .as_str()
            .unwrap_or_else(|| panic!("not sent: {v}"))
            .to_owned()
    }

    /// The first decrypted event of `sender` in `room` whose text (body or edit) satisfies `pred`.
    fn decrypted_from(
        &mut self,
        sender: &str,
        room: &str,
        what: &str,
        pred: impl Fn(&Value, &str) -> bool,
    ) -> Value {
        self.until(what, |v| {
            v["ev"] == "event"
                && v["sender"] == sender
                && v["room"] == room
                && v["decrypted"] == true
                && pred(v, text_of(v))
        })
    }
}

fn text_of(v: &Value) -> &str {
    v["content"]["m.new_content"]["body"]
        .as_str()
        .or_else(|| v["content"]["body"].as_str())
        .unwrap_or("")
}

/// The plaintext the sender encrypted (as the client decrypted it again), `Null` for an event
/// that was not encrypted.
fn payload(v: &Value) -> &Value {
    &v["payload"]["content"]
}

/// The bot's streamed answer to `trigger` (the agent's `slow` words ending in `last`), checked
/// as the human's client saw it: every bot event was `m.room.encrypted` on the wire with no
/// text in clear; the first message replies to `trigger` inside the ciphertext; at least one
/// edit carries its `m.replace` and `m.new_content` inside the ciphertext (the relation also in
/// clear for the server); the last edit shows `last`.
fn assert_streamed_reply(nio: &mut Nio, bot: &str, room: &str, trigger: &str, last: &str) {
    let first = nio.decrypted_from(bot, room, "the first message of the stream", |v, _| {
        payload(v)["m.relates_to"]["m.in_reply_to"]["event_id"] == trigger
    });
    let first_id = first["event_id"].as_str().expect("id").to_owned();
    let final_edit = nio.decrypted_from(bot, room, "the final edit, decrypted", |v, _| {
        payload(v)["m.relates_to"]["rel_type"] == "m.replace"
            && payload(v)["m.relates_to"]["event_id"] == first_id.as_str()
            && payload(v)["m.new_content"]["body"] == last
    });
    assert_eq!(final_edit["type"], "m.room.message", "{final_edit}");
    let edits: Vec<&Value> = nio
        .log
        .iter()
        .filter(|v| v["content"]["m.relates_to"]["event_id"] == first_id.as_str())
        .collect();
    assert!(!edits.is_empty());
    for ev in edits.iter().copied().chain([&first]) {
        assert_eq!(ev["decrypted"], true, "an edit not decrypted: {ev}");
        assert_eq!(ev["wire"]["algorithm"], "m.megolm.v1.aes-sha2", "{ev}");
        assert!(
            ev["wire"]["body"].is_null() && ev["wire"]["m.new_content"].is_null(),
            "no text in clear: {ev}"
        );
    }
    assert_eq!(
        final_edit["wire"]["m.relates_to"]["rel_type"], "m.replace",
        "the relation is also in clear, for the server: {final_edit}"
    );
}

/// `!stop` during a long streamed turn in `room`: that turn's reply (not an earlier one)
/// ends with the stopped marker, in an encrypted edit the human's client decrypts.
fn assert_stop_works(nio: &mut Nio, bot: &str, room: &str) {
    let long = nio.say(room, "slow 400 50", false);
    let first = nio.decrypted_from(bot, room, "the long turn's first message", |v, _| {
        payload(v)["m.relates_to"]["m.in_reply_to"]["event_id"] == long.as_str()
    });
    let first_id = first["event_id"].as_str().expect("id").to_owned();
    let of_it = |v: &Value| {
        v["event_id"] == first_id.as_str()
            || payload(v)["m.relates_to"]["event_id"] == first_id.as_str()
    };
    nio.decrypted_from(bot, room, "a streamed partial of it", |v, t| {
        of_it(v) && t.starts_with("w0 w1")
    });
    nio.say(room, "!stop", false);
    let stopped = nio.decrypted_from(bot, room, "the stopped marker", |v, _| {
        of_it(v)
            && payload(v)["m.new_content"]["body"]
                .as_str()
                .is_some_and(|t| t.contains("[stopped]"))
    });
    assert_eq!(
        stopped["payload"]["content"]["m.relates_to"]["rel_type"],
        "m.replace"
    );
}

/// The human's decrypted timeline of `room`, one line an event (printed with `--nocapture`:
/// the transcript for the closing note).
fn transcript(nio: &Nio, room: &str, names: &[(&str, &str)]) -> String {
    let mut out = String::new();
    let messages = nio.log.iter().filter(|v| {
        v["ev"] == "event"
            && v["room"] == room
            && (v["type"] == "m.room.message" || v["type"] == "m.room.encrypted")
    });
    for v in messages {
        let sender = v["sender"].as_str().unwrap_or("?");
        let who = names
            .iter()
            .find(|(id, _)| *id == sender)
            .map_or(sender, |(_, n)| *n);
        let how = match (v["wire"]["algorithm"].as_str(), v["decrypted"] == true) {
            (Some(_), true) => "encrypted, decrypted",
            (None, true) => "decrypted",
            (_, false) => "NOT decrypted",
        };
        let kind = if v["content"]["m.relates_to"]["rel_type"] == "m.replace" {
            " (edit)"
        } else {
            ""
        };
        out.push_str(&format!("{who}{kind} [{how}]: {}\n", text_of(v)));
    }
    out
}

/// The bot's devices as another user sees them (`/keys/query`): id → ed25519 key.
fn bot_devices(asker: &User, bot: &User) -> Vec<(String, String)> {
    let v = asker
        .call(
            "POST",
            "/keys/query",
            Some(&json!({"device_keys": {bot.mxid.as_str(): []}})),
        )
        .expect("keys/query");
    v["device_keys"][bot.mxid.as_str()]
        .as_object()
        .expect("the bot's devices")
        .iter()
        .map(|(id, d)| {
            (
                id.clone(),
                d["keys"][format!("ed25519:{id}")]
                    .as_str()
                    .unwrap_or("")
                    .to_owned(),
            )
        })
        .collect()
}

/// A human in an encrypted DM writes; the bot answers encrypted: a streamed reply (first
/// message, `m.replace` edits inside the ciphertext, the final text) decrypts on the human's
/// side, and `!stop` stops a long turn with an encrypted last edit.
#[test]
fn an_encrypted_dm_is_answered_and_the_answer_decrypts() {
    let Some(hs) = synapse() else { return };
    if !nio_installed() {
        return;
    }
    let dir = tempfile::tempdir().expect("dir");
    let bot = hs.register("bot", "Turnstile Bot");
    hs.unlimit(&bot);
    let human = hs.register("ann", "Ann");
    let port = free_port();
    let _serve = serve(port);
    let bridge = bridge(hs, &bot, port, dir.path(), &[]);
    let mut nio = Nio::start(hs, Login::Token(&human), &dir.path().join("nio"));
    let room = nio.create(&[&bot.mxid]);
    nio.until("the bot joining", |v| {
        v["ev"] == "joined" && v["user"] == bot.mxid.as_str()
    });

    let hello = nio.say(&room, "hello there", false);
    let reply = nio.decrypted_from(&bot.mxid, &room, "the bot's encrypted reply", |v, _| {
        payload(v)["m.relates_to"]["m.in_reply_to"]["event_id"] == hello.as_str()
    });
    let reply_id = reply["event_id"].as_str().expect("id").to_owned();
    nio.decrypted_from(&bot.mxid, &room, "the final text, decrypted", |v, text| {
        (v["event_id"] == reply_id.as_str()
            || v["content"]["m.relates_to"]["event_id"] == reply_id.as_str())
            && text == "echo: hello there"
    });

    let stream = nio.say(&room, "slow 4 400", false);
    assert_streamed_reply(&mut nio, &bot.mxid, &room, &stream, "w0 w1 w2 w3");
    assert_stop_works(&mut nio, &bot.mxid, &room);

    let undecrypted: Vec<&Value> = nio
        .log
        .iter()
        .filter(|v| {
            v["ev"] == "event" && v["sender"] == bot.mxid.as_str() && v["decrypted"] != true
        })
        .collect();
    assert!(
        undecrypted.is_empty(),
        "every bot event in the room was encrypted and decrypted: {undecrypted:?}"
    );
    println!(
        "What the human saw in the encrypted DM:\n{}",
        transcript(&nio, &room, &[(&bot.mxid, "bot"), (&human.mxid, "ann")])
    );
    let log = bridge.log();
    assert!(
        log.contains("no --state-dir: the encryption keys are not kept"),
        "the start-up warning:\n{log}"
    );
    assert!(
        log.contains("bounds: 256 undecryptable events waiting, 64 sessions per room"),
        "the bounds in the start-up log:\n{log}"
    );
    assert!(!log.contains("not decrypted"), "{log}");
    bridge.assert_no_secret_logged(&bot);
    bridge.stop();
}

/// Restarted with its `--state-dir`, the bot is the same device (same id, same keys) and its
/// kept room session still decrypts what the human's client sends without re-keying: the
/// human's client goes on with the same room session (it saw no new device to share with),
/// and the bot reaches the human's device over its kept Olm session (it claims no new
/// one-time key).
#[test]
fn a_restart_with_the_state_dir_keeps_the_device_and_its_sessions() {
    let Some(hs) = synapse() else { return };
    if !nio_installed() {
        return;
    }
    let dir = tempfile::tempdir().expect("dir");
    let state = dir.path().join("state");
    let state_arg = state.to_str().expect("utf8 path");
    let bot = hs.register("bot", "Turnstile Bot");
    hs.unlimit(&bot);
    let human = hs.register("ann", "Ann");
    let port = free_port();
    let _serve = serve(port);
    let first = bridge(hs, &bot, port, dir.path(), &["--state-dir", state_arg]);
    let mut nio = Nio::start(hs, Login::Token(&human), &dir.path().join("nio"));
    let room = nio.create(&[&bot.mxid]);
    nio.until("the bot joining", |v| {
        v["ev"] == "joined" && v["user"] == bot.mxid.as_str()
    });
    let one = nio.say(&room, "one", false);
    nio.decrypted_from(&bot.mxid, &room, "the answer to one", |_, t| {
        t == "echo: one"
    });
    let session_of = |nio: &mut Nio, id: &str| {
        let own = nio.decrypted_from(&human.mxid, &room, "the human's own event", |v, _| {
            v["event_id"] == id
        });
        own["wire"]["session_id"]
            .as_str()
            .unwrap_or_else(|| panic!("no session id: {own}"))
            .to_owned()
    };
    let session_before = session_of(&mut nio, &one);
    let before = bot_devices(&human, &bot);
    assert_eq!(before.len(), 1, "{before:?}");
    assert!(first.log().contains("(new)"));
    first.assert_no_secret_logged(&bot);
    first.stop();

    let second = bridge(hs, &bot, port, dir.path(), &["--state-dir", state_arg]);
    assert!(
        second.log().contains("(kept from --state-dir)"),
        "{}",
        second.log()
    );
    assert_eq!(
        bot_devices(&human, &bot),
        before,
        "the same device, the same keys"
    );
    let two = nio.say(&room, "two", false);
    nio.decrypted_from(
        &bot.mxid,
        &room,
        "the answer to two after the restart",
        |_, t| t == "echo: two",
    );
    assert_eq!(
        session_of(&mut nio, &two),
        session_before,
        "the human's client did not re-key the room for the restarted bot"
    );
    assert!(
        !second.log().contains("claiming one-time keys"),
        "the restarted bot used its kept Olm session:\n{}",
        second.log()
    );
    let kept = std::fs::read_to_string(state.join("matrix-e2ee.json")).expect("state file");
    assert!(!kept.contains(PICKLE_KEY));
    second.assert_no_secret_logged(&bot);
    second.stop();
}

/// A message whose key comes late is answered once it comes; one whose key never comes
/// gets the notice (once); past `--max-undecryptable` the oldest waiting event is dropped.
#[test]
fn a_late_key_is_waited_for_a_missing_one_told_and_waiting_is_bounded() {
    let Some(hs) = synapse() else { return };
    if !nio_installed() {
        return;
    }
    let dir = tempfile::tempdir().expect("dir");
    let bot = hs.register("bot", "Turnstile Bot");
    hs.unlimit(&bot);
    let human = hs.register("ann", "Ann");
    let port = free_port();
    let _serve = serve(port);
    let args = [
        "--undecryptable-notice-after",
        "1",
        "--max-undecryptable",
        "2",
    ];
    let bridge = bridge(hs, &bot, port, dir.path(), &args);
    let mut nio = Nio::start(hs, Login::Token(&human), &dir.path().join("nio"));
    let room = nio.create(&[&bot.mxid]);
    nio.until("the bot joining", |v| {
        v["ev"] == "joined" && v["user"] == bot.mxid.as_str()
    });

    nio.say(&room, "late one", true);
    nio.send(json!({"op": "release"}));
    nio.decrypted_from(&bot.mxid, &room, "the answer once the key came", |_, t| {
        t == "echo: late one"
    });

    let never = nio.say(&room, "never readable", true);
    let notice = nio.decrypted_from(&bot.mxid, &room, "the unreadable notice", |v, t| {
        t.contains("can't read this message")
            && v["content"]["m.relates_to"]["m.in_reply_to"]["event_id"] == never.as_str()
    });
    assert_eq!(notice["content"]["msgtype"], "m.notice");
    let request = nio.until("the bot's key request", |v| {
        v["ev"] == "key_request"
            && v["sender"] == bot.mxid.as_str()
            && v["content"]["action"] == "request"
    });
    assert_eq!(request["content"]["body"]["room_id"], room.as_str());

    nio.say(&room, "never two", true);
    nio.say(&room, "never three", true);
    nio.say(&room, "after", false);
    nio.decrypted_from(
        &bot.mxid,
        &room,
        "the answer after the waiting ones",
        |_, t| t == "echo: after",
    );
    let log = bridge.log();
    assert!(
        log.contains("dropped unanswered"),
        "past the bound the oldest is dropped:\n{log}"
    );
    let notices = nio
        .log
        .iter()
        .filter(|v| text_of(v).contains("can't read this message"))
        .count();
    assert_eq!(notices, 1, "the room is told once");
    bridge.assert_no_secret_logged(&bot);
    bridge.stop();
}

/// In an encrypted group room the streamed reply decrypts and `!stop` works; a second device
/// of the human that joins later reads the bot's next reply.
#[test]
fn a_second_device_of_the_human_reads_the_next_reply_in_a_group_room() {
    let Some(hs) = synapse() else { return };
    if !nio_installed() {
        return;
    }
    let dir = tempfile::tempdir().expect("dir");
    let bot = hs.register("bot", "Turnstile Bot");
    hs.unlimit(&bot);
    let human = hs.register("ann", "Ann");
    let other = hs.register("cat", "Cat");
    let port = free_port();
    let _serve = serve(port);
    let bridge = bridge(hs, &bot, port, dir.path(), &[]);
    let mut nio = Nio::start(hs, Login::Token(&human), &dir.path().join("nio"));
    let room = nio.create(&[&bot.mxid, &other.mxid]);
    other
        .call(
            "POST",
            &format!("/rooms/{}/join", matrix_support::enc(&room)),
            Some(&json!({})),
        )
        .expect("cat joins");
    nio.until("the bot joining", |v| {
        v["ev"] == "joined" && v["user"] == bot.mxid.as_str()
    });
    nio.say(&room, "first", false);
    nio.decrypted_from(&bot.mxid, &room, "the answer to first", |_, t| {
        t == "echo: first"
    });
    let stream = nio.say(&room, "slow 4 400", false);
    assert_streamed_reply(&mut nio, &bot.mxid, &room, &stream, "w0 w1 w2 w3");
    assert_stop_works(&mut nio, &bot.mxid, &room);

    let mut second = Nio::start(hs, Login::Password(&human), &dir.path().join("nio2"));
    nio.say(&room, "second", false);
    nio.decrypted_from(&bot.mxid, &room, "the answer to second", |_, t| {
        t == "echo: second"
    });
    second.decrypted_from(
        &bot.mxid,
        &room,
        "the answer on the second device",
        |_, t| t == "echo: second",
    );
    bridge.assert_no_secret_logged(&bot);
    bridge.stop();
}

/// A room that starts in clear and turns encryption on mid-life: the bot answers in clear
/// before, and its next reply after the `m.room.encryption` event is encrypted.
#[test]
fn a_room_that_turns_encryption_on_is_answered_encrypted_from_then_on() {
    let Some(hs) = synapse() else { return };
    if !nio_installed() {
        return;
    }
    let dir = tempfile::tempdir().expect("dir");
    let bot = hs.register("bot", "Turnstile Bot");
    hs.unlimit(&bot);
    let human = hs.register("ann", "Ann");
    let port = free_port();
    let _serve = serve(port);
    let bridge = bridge(hs, &bot, port, dir.path(), &[]);
    let mut nio = Nio::start(hs, Login::Token(&human), &dir.path().join("nio"));
    nio.send(json!({"op": "create", "invite": [bot.mxid], "plain": true}));
    let room = nio.until("the room created", |v| v["ev"] == "created")["room"]
        .as_str()
        .expect("room")
        .to_owned();
    nio.until("the bot joining", |v| {
        v["ev"] == "joined" && v["user"] == bot.mxid.as_str()
    });
    nio.say(&room, "in clear", false);
    let clear = nio.until("the answer in clear", |v| {
        v["ev"] == "event" && v["sender"] == bot.mxid.as_str() && text_of(v) == "echo: in clear"
    });
    assert_eq!(clear["decrypted"], false, "{clear}");
    assert_eq!(clear["type"], "m.room.message", "{clear}");

    nio.send(json!({"op": "encrypt", "room": room}));
    nio.until("encryption on in the human's client", |v| {
        v["ev"] == "event" && v["type"] == "m.room.encryption"
    });
    let secret = nio.say(&room, "now encrypted", false);
    let answer = nio.decrypted_from(&bot.mxid, &room, "the encrypted answer", |v, _| {
        payload(v)["m.relates_to"]["m.in_reply_to"]["event_id"] == secret.as_str()
    });
    assert_eq!(
        answer["wire"]["algorithm"], "m.megolm.v1.aes-sha2",
        "{answer}"
    );
    nio.decrypted_from(&bot.mxid, &room, "the final text, encrypted", |v, t| {
        !payload(v).is_null() && t == "echo: now encrypted"
    });
    let after: Vec<&Value> = nio
        .log
        .iter()
        .skip_while(|v| v["type"] != "m.room.encryption")
        .filter(|v| v["ev"] == "event" && v["sender"] == bot.mxid.as_str())
        .filter(|v| v["decrypted"] != true)
        .collect();
    assert!(
        after.is_empty(),
        "nothing in clear after the switch: {after:?}"
    );
    bridge.assert_no_secret_logged(&bot);
    bridge.stop();
}

/// `--matrix-require-verified`: of the human's two devices only the listed one gets the bot's
/// room keys (the other sees the reply and cannot decrypt it), and only the listed one's room
/// keys are taken (the other's message stays unreadable: the room is told, no answer).
#[test]
fn only_listed_devices_get_room_keys_and_only_theirs_are_taken() {
    let Some(hs) = synapse() else { return };
    if !nio_installed() {
        return;
    }
    let dir = tempfile::tempdir().expect("dir");
    let bot = hs.register("bot", "Turnstile Bot");
    hs.unlimit(&bot);
    let human = hs.register("ann", "Ann");
    let port = free_port();
    let _serve = serve(port);
    let mut listed = Nio::start(hs, Login::Token(&human), &dir.path().join("nio"));
    // The key in groups of four, as Element shows a session key.
    let (device, key) = &listed.device;
    let grouped: Vec<String> = key
        .as_bytes()
        .chunks(4)
        .map(|c| String::from_utf8_lossy(c).into_owned())
        .collect();
    let list = dir.path().join("verified.txt");
    std::fs::write(
        &list,
        format!(
            "# Ann's laptop\n{} {device} {}\n",
            human.mxid,
            grouped.join(" ")
        ),
    )
    .expect("list");
    let args = [
        "--matrix-require-verified",
        list.to_str().expect("utf8"),
        "--undecryptable-notice-after",
        "1",
    ];
    let bridge = bridge(hs, &bot, port, dir.path(), &args);
    let room = listed.create(&[&bot.mxid]);
    listed.until("the bot joining", |v| {
        v["ev"] == "joined" && v["user"] == bot.mxid.as_str()
    });
    let mut unlisted = Nio::start(hs, Login::Password(&human), &dir.path().join("nio2"));

    listed.say(&room, "from the listed device", false);
    let answer = listed.decrypted_from(&bot.mxid, &room, "the answer", |_, t| {
        t == "echo: from the listed device"
    });
    let answer_id = answer["event_id"].as_str().expect("id");
    let seen = unlisted.until("the answer on the unlisted device", |v| {
        v["ev"] == "event" && v["event_id"] == answer_id
    });
    assert_eq!(
        seen["decrypted"], false,
        "the unlisted device got no room key: {seen}"
    );

    let refused = unlisted.say(&room, "from the unlisted device", false);
    let notice = listed.decrypted_from(&bot.mxid, &room, "the unreadable notice", |v, t| {
        t.contains("can't read this message")
            && v["content"]["m.relates_to"]["m.in_reply_to"]["event_id"] == refused.as_str()
    });
    assert_eq!(notice["content"]["msgtype"], "m.notice");
    assert!(
        !listed
            .log
            .iter()
            .any(|v| text_of(v) == "echo: from the unlisted device"),
        "the unlisted device's message was not answered"
    );
    let log = bridge.log();
    assert!(
        log.contains("trust: only the 1 device(s) --matrix-require-verified lists"),
        "{log}"
    );
    assert!(log.contains("refused: its device is not in"), "{log}");
    bridge.assert_no_secret_logged(&bot);
    bridge.stop();
}
