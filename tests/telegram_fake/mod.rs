//! The plumbing of the FAKE Telegram Bot APIs the telegram tests script (each test target
//! keeps its own state and its own answers, the rules it checks): an HTTP/1.1 server on
//! 127.0.0.1:0, one thread and one request per connection (`Connection: close`),
//! `/bot<token>/<method>` with a JSON or multipart body, `getUpdates` long polling where an
//! `offset` confirms (forgets) every earlier update. It is not Telegram.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common::eventually::Settled;

/// The bot token the bridges are given: fake, and never to be logged.
pub const TOKEN: &str = "123456:FAKE-SECRET-token";
/// Only a failing run waits this long.
const WAIT: Duration = Duration::from_secs(60);
/// The most updates one `getUpdates` answers (the Bot API's default `limit`).
const UPDATES_LIMIT: usize = 100;

/// A fake's state: the updates not confirmed yet, and whatever else its test records.
pub trait BotState: Send + 'static {
    /// Updates not confirmed yet (Telegram forgets those below the latest offset).
    fn pending(&mut self) -> &mut Vec<Value>;
}

/// A fake's state and the condition variable signalled whenever it changes.
pub type Shared<S> = (Mutex<S>, Condvar);

/// A fake Bot API server; `serve` answers each connection on a thread of its own.
pub struct FakeServer<S> {
    pub url: String,
    pub shared: Arc<Shared<S>>,
}

impl<S: BotState> FakeServer<S> {
    /// Listens on 127.0.0.1:0; each connection goes to `serve` on a thread of its own.
    pub fn spawn(state: S, serve: fn(TcpStream, &Shared<S>)) -> FakeServer<S> {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let shared = Arc::new((Mutex::new(state), Condvar::new()));
        let for_thread = Arc::clone(&shared);
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                let shared = Arc::clone(&for_thread);
                std::thread::spawn(move || serve(stream, &shared));
            }
        });
        FakeServer { url, shared }
    }

    pub fn lock(&self) -> MutexGuard<'_, S> {
        self.shared.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes every call waiting on the state (a long poll, a held send).
    pub fn notify(&self) {
        self.shared.1.notify_all();
    }

    /// Hands the bridge an update (a waiting `getUpdates` answers it at once).
    pub fn push_update(&self, update: Value) {
        self.lock().pending().push(update);
        self.notify();
    }

    /// Waits (bounded) until `pred` settles on the fake's state (`true`, `Some`, `Ok`;
    /// `Err` says what it saw); returns what it gave.
    #[track_caller]
    pub fn wait_for<P: Settled>(&self, what: &str, mut pred: impl FnMut(&S) -> P) -> P::Value {
        let deadline = Instant::now() + WAIT;
        let mut state = self.lock();
        loop {
            let seen = match pred(&state).settled() {
                Ok(value) => return value,
                Err(seen) => seen,
            };
            let now = Instant::now();
            assert!(
                now < deadline,
                "timed out waiting for {what}{}",
                seen.map(|s| format!("; last seen: {s}"))
                    .unwrap_or_default()
            );
            state = self
                .shared
                .1
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// One request as the fake read it.
pub struct Request {
    /// The request target: `/bot<token>/<method>`, or `/file/bot<token>/<path>`.
    pub path: String,
    pub content_type: String,
    pub body: Vec<u8>,
}

impl Request {
    /// The Bot API method the path names with the right token (`None`: answer 401).
    pub fn method(&self) -> Option<&str> {
        self.path.strip_prefix(&format!("/bot{TOKEN}/"))
    }

    /// The JSON body's parameters (`{}` when there are none or they do not parse).
    pub fn params(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(json!({}))
    }
}

/// Reads one request (`None`: the peer closed or sent less than it announced).
pub fn read_request(stream: &TcpStream) -> Option<Request> {
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let mut request_line = String::new();
    if reader.read_line(&mut request_line).unwrap_or(0) == 0 {
        return None;
    }
    let path = request_line.split(' ').nth(1).unwrap_or("").to_owned();
    let (mut length, mut content_type) = (0usize, String::new());
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header).unwrap_or(0) == 0 {
            return None;
        }
        let header = header.trim_end();
        if header.is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            if name.eq_ignore_ascii_case("content-length") {
                length = value.trim().parse().unwrap_or(0);
            } else if name.eq_ignore_ascii_case("content-type") {
                content_type = value.trim().to_owned();
            }
        }
    }
    let mut body = vec![0u8; length];
    reader.read_exact(&mut body).ok()?;
    Some(Request {
        path,
        content_type,
        body,
    })
}

/// Writes one answer and closes the exchange (`Connection: close`).
pub fn respond(stream: &mut TcpStream, status: u16, content_type: &str, body: &[u8]) {
    let _ = write!(
        stream,
        "HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = stream.write_all(body);
}

pub fn respond_json(stream: &mut TcpStream, status: u16, body: &Value) {
    respond(
        stream,
        status,
        "application/json",
        body.to_string().as_bytes(),
    );
}

/// A Bot API answer carrying `result`.
pub fn ok(result: Value) -> (u16, Value) {
    (200, json!({"ok": true, "result": result}))
}

/// `getMe`'s answer: the fake bot, `@fake_bot`.
pub fn get_me() -> (u16, Value) {
    ok(json!({"id": 999, "is_bot": true, "first_name": "Fake", "username": "fake_bot"}))
}

/// `sendMessage`'s answer for the bot's `n`th message in `params`' chat.
pub fn sent_message(n: usize, params: &Value) -> (u16, Value) {
    ok(json!({"message_id": 1000 + n, "chat": {"id": params["chat_id"]}, "text": params["text"]}))
}

/// An update: a private message from Ann (user 7) in chat 42, with `fields` (its `text`,
/// its `document`…).
pub fn dm_update(update_id: i64, fields: Value) -> Value {
    let mut m = json!({"message_id": update_id * 10, "chat": {"id": 42, "type": "private"},
                       "from": {"id": 7, "is_bot": false, "first_name": "Ann"}});
    for (k, v) in fields.as_object().expect("object") {
        m[k] = v.clone();
    }
    json!({"update_id": update_id, "message": m})
}

/// A Bot API error answer.
pub fn error(code: u16, description: &str) -> (u16, Value) {
    (
        code,
        json!({"ok": false, "error_code": code, "description": description}),
    )
}

/// `getUpdates` (called at `at`): forgets the updates below `offset`, then waits (up to its
/// `timeout`, or until one is pushed) for one; the answer.
pub fn get_updates<S: BotState>(
    mut state: MutexGuard<'_, S>,
    cvar: &Condvar,
    params: &Value,
    at: Instant,
) -> (u16, Value) {
    if let Some(o) = params.get("offset").and_then(Value::as_i64) {
        state
            .pending()
            .retain(|u| u["update_id"].as_i64() >= Some(o));
    }
    let timeout = params.get("timeout").and_then(Value::as_u64).unwrap_or(0);
    let deadline = at + Duration::from_secs(timeout);
    while state.pending().is_empty() && Instant::now() < deadline {
        let left = deadline.saturating_duration_since(Instant::now());
        state = cvar
            .wait_timeout(state, left)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
    let updates: Vec<Value> = state
        .pending()
        .iter()
        .take(UPDATES_LIMIT)
        .cloned()
        .collect();
    (200, json!({"ok": true, "result": updates}))
}
