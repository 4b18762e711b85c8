//! Agents send files back through Telegram (issue 36 row 3), against a **fake** of the Bot
//! API's upload calls that enforces what the Bot API publishes for bots
//! (core.telegram.org/bots/api#sending-files): `sendPhoto` and `sendDocument` only as
//! `multipart/form-data` with a `chat_id` field and the file in a `photo` / `document` part
//! with a file name; a photo of at most 10 MB, any other file of at most 50 MB (past them:
//! 400 "photo is too big", 413 "Request Entity Too Large"). A document named `refuse*` is
//! refused (400), as Telegram refuses a file it cannot take. `getUpdates`, `sendMessage` and
//! `sendChatAction` as in `platforms_telegram.rs`. It is not Telegram and checks nothing else.
//!
//! The real `turnstile serve` (a process agent writing files into its turn's outbox) and the
//! real bridge run against it: a document arrives byte for byte (`sendDocument`, sha256
//! equal), a small image as a photo, a 10 MB+ image as a document; a file past Telegram's
//! 50 MB and one refused for good are told in the chat, once, never retried; files past the
//! gateway's bounds are left out with the reply saying so; each reply's files leave the
//! spool once it is delivered.

mod child_support;
mod common;
mod telegram_fake;
use child_support::{Proc, die_with_parent, first_line};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::gateway::spool_empties;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use telegram_fake::{
    BotState, FakeServer, Shared, TOKEN, dm_update, error, get_me, get_updates, ok, read_request,
    respond_json, sent_message,
};

const WAIT: Duration = Duration::from_secs(60);
/// The Bot API's upload limits for bots.
const PHOTO_LIMIT: usize = 10 * 1000 * 1000;
const DOCUMENT_LIMIT: usize = 50 * 1000 * 1000;

/// A file the fake took: the call, its field, the file name, its type, size and sha256.
#[derive(Clone, Debug, PartialEq)]
struct Took {
    method: String,
    name: String,
    mime: String,
    size: usize,
    sha256: String,
}

#[derive(Default)]
struct FakeState {
    pending: Vec<Value>,
    /// What the bot showed, in order: texts, and `[method name size]` for files taken.
    shown: Vec<String>,
    took: Vec<Took>,
    /// Upload calls, taken or refused.
    uploads: Vec<String>,
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
        FakeServer::spawn(FakeState::default(), serve_http)
    }

    /// Waits (bounded) for the `n`th thing the bot showed (from 0).
    fn shown(&self, n: usize) -> String {
        self.wait_for(&format!("thing {n} from the bot"), |s| {
            s.shown.get(n).cloned().ok_or_else(|| s.shown.clone())
        })
    }
}

fn serve_http(mut stream: TcpStream, shared: &Shared<FakeState>) {
    let Some(request) = read_request(&stream) else {
        return;
    };
    let (status, answer) = match request.method() {
        None => error(401, "Unauthorized"),
        Some(method @ ("sendPhoto" | "sendDocument")) => {
            upload(method, &request.content_type, &request.body, shared)
        }
        Some(method) => handle(method, &request.params(), shared),
    };
    respond_json(&mut stream, status, &answer);
}

/// One part of a multipart body: its field name, file name and type, and its bytes.
struct Part {
    name: String,
    filename: Option<String>,
    mime: Option<String>,
    data: Vec<u8>,
}

/// The parts of a `multipart/form-data` body, or why it is not one.
fn parts(content_type: &str, body: &[u8]) -> Result<Vec<Part>, String> {
    let boundary = content_type
        .strip_prefix("multipart/form-data; boundary=")
        .ok_or_else(|| format!("not multipart/form-data: {content_type:?}"))?;
    let delimiter = format!("--{boundary}").into_bytes();
    let find = |hay: &[u8], from: usize| {
        hay[from..]
            .windows(delimiter.len())
            .position(|w| w == delimiter.as_slice())
            .map(|p| p + from)
    };
    let mut at = find(body, 0).ok_or("no boundary")? + delimiter.len();
    let mut out = Vec::new();
    loop {
        if body[at..].starts_with(b"--") {
            return Ok(out);
        }
        let start = at + 2; // CRLF after the delimiter
        let end = find(body, start).ok_or("an unterminated part")?;
        let part = &body[start..end - 2]; // CRLF before the next delimiter
        let split = part
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .ok_or("a part without headers")?;
        let headers = String::from_utf8_lossy(&part[..split]).into_owned();
        let field = |key: &str| {
            headers
                .split(&format!("{key}=\""))
                .nth(1)
                .and_then(|s| s.split('"').next())
                .map(str::to_owned)
        };
        let mime = headers
            .lines()
            .find_map(|l| l.strip_prefix("Content-Type: "))
            .map(str::to_owned);
        out.push(Part {
            name: field(" name").ok_or("a part without a name")?,
            filename: field("filename"),
            mime,
            data: part[split + 4..].to_vec(),
        });
        at = end + delimiter.len();
    }
}

fn upload(
    method: &str,
    content_type: &str,
    body: &[u8],
    shared: &Shared<FakeState>,
) -> (u16, Value) {
    let (lock, cvar) = shared;
    let mut state = lock.lock().unwrap_or_else(|e| e.into_inner());
    state.uploads.push(method.to_owned());
    let field = if method == "sendPhoto" {
        "photo"
    } else {
        "document"
    };
    let parts = match parts(content_type, body) {
        Ok(p) => p,
        Err(e) => return error(400, &format!("Bad Request: {e}")),
    };
    if !parts
        .iter()
        .any(|p| p.name == "chat_id" && p.filename.is_none() && p.data == b"42")
    {
        return error(400, "Bad Request: chat_id is empty");
    }
    let Some(file) = parts
        .iter()
        .find(|p| p.name == field && p.filename.is_some())
    else {
        return error(
            400,
            &format!("Bad Request: there is no {field} in the request"),
        );
    };
    let limit = if method == "sendPhoto" {
        PHOTO_LIMIT
    } else {
        DOCUMENT_LIMIT
    };
    if file.data.len() > limit {
        return if method == "sendPhoto" {
            error(400, "Bad Request: photo is too big")
        } else {
            error(413, "Request Entity Too Large")
        };
    }
    let name = file.filename.clone().unwrap_or_default();
    if name.starts_with("refuse") {
        return error(400, "Bad Request: DOCUMENT_INVALID");
    }
    let took = Took {
        method: method.to_owned(),
        name: name.clone(),
        mime: file.mime.clone().unwrap_or_default(),
        size: file.data.len(),
        sha256: sha256(&file.data),
    };
    state
        .shown
        .push(format!("[{method} {name} {}]", file.data.len()));
    state.took.push(took);
    cvar.notify_all();
    let id = 1000 + state.shown.len();
    (
        200,
        json!({"ok": true, "result": {"message_id": id, "chat": {"id": 42}}}),
    )
}

fn handle(method: &str, params: &Value, shared: &Shared<FakeState>) -> (u16, Value) {
    let (lock, cvar) = shared;
    let mut state = lock.lock().unwrap_or_else(|e| e.into_inner());
    let answer = match method {
        "getMe" => get_me(),
        "getUpdates" => return get_updates(state, cvar, params, Instant::now()),
        "sendMessage" => {
            state
                .shown
                .push(params["text"].as_str().unwrap_or("").to_owned());
            sent_message(state.shown.len(), params)
        }
        "sendChatAction" | "setMessageReaction" => ok(json!(true)),
        _ => error(404, "Not Found"),
    };
    cvar.notify_all();
    answer
}

fn sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn data(n: usize, seed: usize) -> Vec<u8> {
    (0..n).map(|i| ((i * 31 + seed) % 251) as u8).collect()
}

/// The process agent: the text names the files to write into the outbox and attach, as
/// `name:size` words (`-` for no file); the reply's text is `files`.
const AGENT: &str = r#"
import json, os, sys
for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("op") != "turn":
        continue
    out, files = msg["outbox"], []
    for word in msg["text"].split():
        name, size = word.split(":")
        n, seed = int(size), len(name)
        # The test's data(): byte i is (i*31+seed)%251, a pattern of period 251.
        period = bytes((i * 31 + seed) % 251 for i in range(251))
        with open(os.path.join(out, name), "wb") as f:
            f.write((period * (n // 251 + 1))[:n])
        files.append({"path": name})
    print(json.dumps({"op": "reply", "id": msg["id"], "text": "files", "attachments": files}), flush=True)
"#;

/// Ann's private message `text`.
fn update(update_id: i64, text: &str) -> Value {
    dm_update(update_id, json!({ "text": text }))
}

#[test]
fn a_process_agents_files_are_uploaded_within_the_published_limits_and_the_rest_told() {
    let api = FakeBotApi::start();
    let tmp = tempfile::tempdir().expect("tempdir");
    let spool = tmp.path().join("spool");
    let script = tmp.path().join("agent.py");
    std::fs::write(&script, AGENT).expect("script");
    let mut serve = die_with_parent(
        Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args(["serve", "--listen", "127.0.0.1:0", "--http-listen", "off"])
            .args(["--access-default", "open"])
            .args(["--agent", "process", "--agent-cmd"])
            .arg(format!("python3 {}", script.display()))
            .arg("--attachments-dir")
            .arg(&spool)
            .args(["--max-attachment-bytes", "60000000"])
            .args(["--attachments-bytes", "70000000"])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit()),
    )
    .spawn()
    .expect("serve");
    let gateway = first_line(&mut serve, WAIT)
        .strip_prefix("listening on ")
        .expect("listening line")
        .to_owned();
    let _serve = Proc(serve);
    let log = tmp.path().join("bridge.log");
    let mut bridge = die_with_parent(
        Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args(["bridge", "telegram", "--gateway", &gateway])
            .args(["--api-base", &api.url, "--format", "plain"])
            .arg("--attachments-dir")
            .arg(&spool)
            .env("TELEGRAM_BOT_TOKEN", TOKEN)
            .env("RUST_LOG", "debug")
            .stdout(Stdio::piped())
            .stderr(Stdio::from(std::fs::File::create(&log).expect("log"))),
    )
    .spawn()
    .expect("bridge");
    assert_eq!(
        first_line(&mut bridge, WAIT),
        "ready: telegram as @fake_bot"
    );
    let _bridge = Proc(bridge);

    // A document, byte for byte, after the reply's text; a small image as a photo; an
    // image over the photo limit as a document.
    api.push_update(update(
        1,
        "report.txt:100000 pic.png:3000 poster.png:10000001",
    ));
    assert_eq!(api.shown(0), "files");
    assert_eq!(api.shown(1), "[sendDocument report.txt 100000]");
    assert_eq!(api.shown(2), "[sendPhoto pic.png 3000]");
    assert_eq!(api.shown(3), "[sendDocument poster.png 10000001]");
    let took = api.lock().took.clone();
    assert_eq!(took[0].sha256, sha256(&data(100_000, "report.txt".len())));
    assert_eq!(took[0].mime, "text/plain");
    assert_eq!(took[1].sha256, sha256(&data(3000, "pic.png".len())));
    assert_eq!(
        took[2].sha256,
        sha256(&data(10_000_001, "poster.png".len()))
    );
    spool_empties(&spool, "the files deleted once delivered", WAIT);

    // Past Telegram's 50 MB: not sent; refused by Telegram: not retried; both told, once.
    api.push_update(update(2, "huge.bin:50000001 refuse.txt:10 ok.txt:5"));
    assert_eq!(api.shown(4), "files");
    assert_eq!(api.shown(5), "[sendDocument ok.txt 5]");
    assert_eq!(
        api.shown(6),
        "(file not sent: huge.bin, 47.7 MiB: larger than Telegram's 50 MB limit for bots)\n\
         (file not sent: refuse.txt, 10 B: sendDocument: 400 Bad Request: DOCUMENT_INVALID)"
    );
    spool_empties(&spool, "the files deleted once delivered", WAIT);

    // Past the gateway's bounds: left out, the reply says so.
    api.push_update(update(3, "over.bin:60000001"));
    assert_eq!(
        api.shown(7),
        "files\n(file left out: over.bin, 57.2 MiB: larger than --max-attachment-bytes 60000000)"
    );
    // One more reply shows the last one ended: nothing else was shown or tried in between.
    api.push_update(update(4, "last.txt:1"));
    assert_eq!(api.shown(8), "files");
    assert_eq!(api.shown(9), "[sendDocument last.txt 1]");
    let state = api.lock();
    assert_eq!(state.shown.len(), 10, "{:#?}", state.shown);
    assert_eq!(
        state.uploads,
        [
            "sendDocument",
            "sendPhoto",
            "sendDocument",
            "sendDocument",
            "sendDocument",
            "sendDocument"
        ],
        "refuse.txt tried once, huge.bin never"
    );
    eprintln!("what the chat showed:\n{}", state.shown.join("\n"));
    drop(state);
    spool_empties(&spool, "the files deleted once delivered", WAIT);
    let log = std::fs::read_to_string(&log).expect("log");
    assert!(
        !log.contains(TOKEN) && !log.contains("FAKE-SECRET"),
        "the token leaked"
    );
}
