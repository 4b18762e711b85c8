//! Telegram photos and documents reach the agent as files (issue 36), against a **fake** of
//! the Bot API's file calls: `getFile` answers a `file_path` (and refuses files over the Bot
//! API's published 20 MB download limit, "file is too big"), `GET /file/bot<token>/<path>`
//! serves the bytes; `getUpdates`, `sendMessage` and `sendChatAction` as in
//! `platforms_telegram.rs`. It is not Telegram and checks nothing else.
//!
//! The real `turnstile serve` (an exec agent that hashes what it is given) and the real
//! bridge run against it: a photo (the largest size within the bound) and a text document
//! reach the agent with matching sha256; a file announced over `--max-attachment-bytes` is
//! never requested; one that turns out larger while streaming is stopped, deleted and not
//! fetched again; a file that does not fit the spool is skipped; the sender is told each time.

mod child_support;
mod common;
mod telegram_fake;
use child_support::{Proc, die_with_parent, first_line};
use std::collections::HashMap;
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{eventually, holds};
use serde_json::{Value, json};
use telegram_fake::{
    BotState, FakeServer, Shared, TOKEN, dm_update, error, get_me, get_updates, ok, read_request,
    respond, respond_json, sent_message,
};

const WAIT: Duration = Duration::from_secs(60);
/// The Bot API's download limit for bots (core.telegram.org/bots/api#getfile).
const BOT_API_DOWNLOAD_LIMIT: usize = 20 * 1000 * 1000;

#[derive(Default)]
struct FakeState {
    pending: Vec<Value>,
    /// Files by id: (path, bytes).
    files: HashMap<String, (String, Vec<u8>)>,
    /// `getFile` calls and downloads, by file id.
    get_file: HashMap<String, usize>,
    downloads: HashMap<String, usize>,
    /// Texts the bot sent, in order.
    sent: Vec<String>,
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

    fn add_file(&self, id: &str, bytes: Vec<u8>) {
        let path = format!("documents/{id}.bin");
        self.lock().files.insert(id.into(), (path, bytes));
    }

    /// Waits (bounded) for the `n`th text the bot sent (from 0).
    fn sent(&self, n: usize) -> String {
        self.wait_for(&format!("message {n} from the bot"), |s| {
            s.sent.get(n).cloned()
        })
    }
}

fn serve_http(mut stream: TcpStream, shared: &Shared<FakeState>) {
    let Some(request) = read_request(&stream) else {
        return;
    };
    if let Some(file) = request.path.strip_prefix(&format!("/file/bot{TOKEN}/")) {
        let mut state = shared.0.lock().unwrap_or_else(|e| e.into_inner());
        let found = state
            .files
            .iter()
            .find(|(_, (p, _))| p == file)
            .map(|(id, (_, bytes))| (id.clone(), bytes.clone()));
        return match found {
            Some((id, bytes)) => {
                *state.downloads.entry(id).or_default() += 1;
                drop(state);
                respond(&mut stream, 200, "application/octet-stream", &bytes);
            }
            None => respond(&mut stream, 404, "text/plain", b"not found"),
        };
    }
    let (status, answer) = match request.method() {
        Some(method) => handle(method, &request.params(), shared),
        None => error(401, "Unauthorized"),
    };
    respond_json(&mut stream, status, &answer);
}

fn handle(method: &str, params: &Value, shared: &Shared<FakeState>) -> (u16, Value) {
    let (lock, cvar) = shared;
    let mut state = lock.lock().unwrap_or_else(|e| e.into_inner());
    let answer = match method {
        "getMe" => get_me(),
        "getUpdates" => return get_updates(state, cvar, params, Instant::now()),
        "getFile" => {
            let id = params["file_id"].as_str().unwrap_or("").to_owned();
            *state.get_file.entry(id.clone()).or_default() += 1;
            match state.files.get(&id) {
                Some((_, bytes)) if bytes.len() > BOT_API_DOWNLOAD_LIMIT => (
                    400,
                    json!({"ok": false, "error_code": 400, "description": "Bad Request: file is too big"}),
                ),
                // The Bot API's file_size is optional: a "sneaky" file comes without one.
                Some((path, _)) if id.starts_with("sneaky") => {
                    ok(json!({"file_id": id, "file_unique_id": id, "file_path": path}))
                }
                Some((path, bytes)) => ok(
                    json!({"file_id": id, "file_unique_id": id, "file_path": path, "file_size": bytes.len()}),
                ),
                None => (
                    400,
                    json!({"ok": false, "error_code": 400, "description": "Bad Request: invalid file_id"}),
                ),
            }
        }
        "sendMessage" => {
            state
                .sent
                .push(params["text"].as_str().unwrap_or("").to_owned());
            sent_message(state.sent.len(), params)
        }
        "sendChatAction" => ok(json!(true)),
        _ => error(404, "Not Found"),
    };
    cvar.notify_all();
    answer
}

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

fn document(id: &str, name: &str, mime: &str, size: Option<usize>) -> Value {
    let mut d = json!({"file_id": id, "file_unique_id": id, "file_name": name, "mime_type": mime});
    if let Some(s) = size {
        d["file_size"] = json!(s);
    }
    json!({"document": d})
}

fn bytes(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Every entry of the spool, sorted: files and directories alike.
fn spool_entries(spool: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(spool)
        .expect("spool")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn photos_and_documents_reach_the_agent_bounded_and_the_sender_is_told_what_did_not() {
    let api = FakeBotApi::start();
    let tmp = tempfile::tempdir().expect("tempdir");
    let spool = tmp.path().join("spool");
    let mut serve = die_with_parent(
        Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args(["serve", "--listen", "127.0.0.1:0", "--http-listen", "off"])
            .args(["--access-default", "open"])
            .args(["--agent", "exec", "--agent-cmd", AGENT])
            .arg("--attachments-dir")
            .arg(&spool)
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
            .args(["--api-base", &api.url])
            // The agent answers with JSON the test reads back as the bot sent it: as written,
            // not rendered from Markdown to Telegram HTML (this fake does not parse HTML).
            .args(["--format", "plain"])
            .arg("--attachments-dir")
            .arg(&spool)
            .args([
                "--max-attachment-bytes",
                "4096",
                "--attachments-bytes",
                "8192",
            ])
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

    // A photo in three sizes (the largest over the bound) with a caption, and a text file.
    let (small, large, huge) = (bytes(100, 1), bytes(2000, 2), bytes(10_000, 3));
    api.add_file("p-small", small);
    api.add_file("p-large", large);
    api.add_file("p-huge", huge);
    api.add_file("notes", b"hello from a text file\n".to_vec());
    let size = |w: u32, id: &str, n: usize| json!({"file_id": id, "file_unique_id": id, "width": w, "height": w, "file_size": n});
    api.push_update(dm_update(
        1,
        json!({"caption": "look", "photo": [size(90, "p-small", 100), size(800, "p-large", 2000),
                                            size(2560, "p-huge", 10_000)]}),
    ));
    let seen: Value = serde_json::from_str(&api.sent(0)).expect("the agent's answer");
    assert_eq!(seen, json!([["photo.jpg", "image/jpeg", 2000, true]]));
    api.push_update(dm_update(
        2,
        document("notes", "notes.txt", "text/plain", Some(23)),
    ));
    let seen: Value = serde_json::from_str(&api.sent(1)).expect("the agent's answer");
    assert_eq!(seen, json!([["notes.txt", "text/plain", 23, true]]));

    // Announced over the bound: never requested. Over it only once streaming: stopped,
    // deleted, not fetched again. Each time the sender is told, once.
    api.add_file("big", bytes(5000, 4));
    api.push_update(dm_update(3, document("big", "big.bin", "", Some(5000))));
    assert_eq!(
        api.sent(2),
        "[file(s) not passed on: big.bin: larger than --max-attachment-bytes 4096]"
    );
    let seen: Value = serde_json::from_str(&api.sent(3)).expect("the agent's answer");
    assert_eq!(
        seen,
        json!([["big.bin", "larger than --max-attachment-bytes 4096"]])
    );
    api.add_file("sneaky", bytes(6000, 5));
    api.push_update(dm_update(4, document("sneaky", "sneaky.bin", "", None)));
    assert!(
        api.sent(4)
            .contains("sneaky.bin: larger than --max-attachment-bytes 4096")
    );
    let _ = api.sent(5);

    // The spool is shared with the gateway: a file that does not fit it is skipped.
    std::fs::write(spool.join("filler"), bytes(7000, 6)).expect("filler");
    api.add_file("late", bytes(1500, 7));
    api.push_update(dm_update(5, document("late", "late.bin", "", Some(1500))));
    assert_eq!(
        api.sent(6),
        "[file(s) not passed on: late.bin: the attachments spool is full (--attachments-bytes 8192)]"
    );
    let _ = api.sent(7);

    let state = api.lock();
    for (id, calls) in [
        ("big", None),
        ("late", None),
        ("p-huge", None),
        ("sneaky", Some(&1)),
    ] {
        assert_eq!(state.get_file.get(id), calls, "getFile for {id}");
        assert_eq!(state.downloads.get(id), calls, "downloads of {id}");
    }
    drop(state);
    // The gateway's janitor deletes an answered message's files on a thread of its own.
    // The bridge process deletes the refused files on its own thread: polled (bounded) until
    // they are gone, nothing in this test waits on the order of events.
    eventually("the spool keeps only the filler", WAIT, || {
        holds(spool_entries(&spool), |left| left == &["filler"])
    });
    let log = std::fs::read_to_string(&log).expect("log");
    assert!(
        !log.contains(TOKEN) && !log.contains("FAKE-SECRET"),
        "the token leaked"
    );
}
