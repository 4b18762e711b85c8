//! A **FAKE** of Discord (Gateway v10 over a WebSocket, and the REST API), written for the
//! tests of `turnstile bridge discord` from Discord's published documentation. It is not
//! Discord and checks only what the bridge depends on and what the real service punishes:
//!
//! - Gateway: Hello with a heartbeat interval; Identify (the token, and the intents: guilds,
//!   guild messages, direct messages, message content) answered with READY (session id,
//!   `resume_gateway_url`, the bot user) or a close code (4004 for a wrong token, or the one
//!   a test scripts); heartbeats answered with Heartbeat ACK unless a test drops them (a
//!   zombie link: then dispatches are not delivered either); Resume replaying every
//!   dispatch after the given sequence, then RESUMED; an unknown session answered op 9;
//!   THREAD_CREATE when a test opens a thread (a thread is a channel of its own).
//! - REST: `GET /gateway/bot`; `POST /channels/{id}/messages` (2,000 characters at most, a
//!   `message_reference` recorded; a repeated `nonce` with `enforce_nonce` returns the message
//!   it created), `PATCH` edits, `DELETE`, `POST …/typing`; buckets of 5
//!   requests per 5 s per channel, the message routes (post, edit, delete) sharing one
//!   bucket (one `X-RateLimit-Bucket` hash, as Discord lets routes share buckets), typing
//!   another, and 50 requests a second in all (the global limit), announced in the
//!   `X-RateLimit-*` headers and answered 429 with `retry_after` past them; a request on a
//!   bucket before its `retry_after` passed is counted as a violation (what gets a bot
//!   banned).
#![allow(dead_code)]

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crossbeam_channel::{Sender, unbounded};
use serde_json::{Value, json};
use tungstenite::Message;

/// Only a failing run waits this long.
pub const WAIT: Duration = Duration::from_secs(60);
pub const TOKEN: &str = "FAKE-discord-SECRET.token.xyz";
pub const BOT_ID: &str = "1000";
/// Per route and channel: this many requests per [`BUCKET_WINDOW`].
pub const BUCKET_LIMIT: usize = 5;
pub const BUCKET_WINDOW: Duration = Duration::from_secs(5);
pub const GLOBAL_PER_SEC: usize = 50;

/// One REST request the fake received.
#[derive(Clone, Debug)]
pub struct Call {
    pub method: String,
    pub path: String,
    pub body: Value,
    pub at: Instant,
    pub status: u16,
}

#[derive(Default)]
pub struct FakeState {
    pub calls: Vec<Call>,
    /// Every message the bot posted: id → (channel, content).
    pub messages: HashMap<String, (String, String)>,
    /// Every message created, in order: (id, content).
    pub created: Vec<(String, String)>,
    /// Nonces of `enforce_nonce` posts → the message they created.
    nonces: HashMap<String, String>,
    next_id: u64,
    /// The session's dispatches (READY first); the sequence number is the index plus one.
    events: Vec<Value>,
    session_id: Option<String>,
    pub identifies: u32,
    pub resumes: u32,
    /// Resume sequence numbers asked for.
    pub resumed_from: Vec<u64>,
    pub heartbeats: u32,
    /// The live connection's outbox.
    conn: Option<Sender<Value>>,
    /// Heartbeat ACKs are not sent, nor dispatches (a dead link), while set.
    pub zombie: bool,
    pub heartbeat_ms: u64,
    /// The next Identify is answered with this close code.
    pub close_on_identify: Option<u16>,
    pub intents: Option<u64>,
    /// Message POSTs are answered only once this is cleared (the message is created at
    /// once): a bridge killed meanwhile has posted a reply it never heard back about.
    pub hold_posts: bool,
    /// The Gateway URL `GET /gateway/bot` names instead of the fake's own.
    pub gateway_url: Option<String>,
    /// The next this many message POSTs get a 429 with `retry_after`.
    pub force_429: u32,
    pub retry_after: f64,
    buckets: HashMap<String, VecDeque<Instant>>,
    global: VecDeque<Instant>,
    limited_until: HashMap<String, Instant>,
    pub rate_limited: u32,
    /// 429s for the global limit (a subset of `rate_limited`).
    pub global_limited: u32,
    pub violations: u32,
    pub too_long: u32,
    pub not_modified: u32,
}

/// The fake, listening on two ports of 127.0.0.1.
pub struct FakeDiscord {
    pub api_base: String,
    pub ws_url: String,
    shared: Arc<(Mutex<FakeState>, Condvar)>,
}

impl FakeDiscord {
    pub fn start(heartbeat_ms: u64) -> FakeDiscord {
        let rest = TcpListener::bind("127.0.0.1:0").expect("bind");
        let ws = TcpListener::bind("127.0.0.1:0").expect("bind");
        let api_base = format!("http://{}/api/v10", rest.local_addr().expect("addr"));
        let ws_url = format!("ws://{}", ws.local_addr().expect("addr"));
        let shared = Arc::new((
            Mutex::new(FakeState {
                next_id: 5000,
                heartbeat_ms,
                ..FakeState::default()
            }),
            Condvar::new(),
        ));
        let for_rest = Arc::clone(&shared);
        let url = ws_url.clone();
        std::thread::spawn(move || {
            for stream in rest.incoming() {
                let Ok(stream) = stream else { return };
                let shared = Arc::clone(&for_rest);
                let url = url.clone();
                std::thread::spawn(move || serve_http(stream, &shared, &url));
            }
        });
        let for_ws = Arc::clone(&shared);
        let url = ws_url.clone();
        std::thread::spawn(move || {
            for stream in ws.incoming() {
                let Ok(stream) = stream else { return };
                let shared = Arc::clone(&for_ws);
                let url = url.clone();
                std::thread::spawn(move || serve_gateway(stream, &shared, &url));
            }
        });
        FakeDiscord {
            api_base,
            ws_url,
            shared,
        }
    }

    /// Answers the held POSTs.
    pub fn release_posts(&self) {
        self.lock().hold_posts = false;
        self.shared.1.notify_all();
    }

    pub fn lock(&self) -> MutexGuard<'_, FakeState> {
        self.shared.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits (bounded) until `pred` holds; returns what it extracted.
    pub fn wait_for<T>(&self, what: &str, pred: impl Fn(&FakeState) -> Option<T>) -> T {
        let deadline = Instant::now() + WAIT;
        let mut state = self.lock();
        loop {
            if let Some(t) = pred(&state) {
                return t;
            }
            let now = Instant::now();
            if now >= deadline {
                let calls: Vec<String> = state
                    .calls
                    .iter()
                    .map(|c| format!("{} {} {} {}", c.method, c.path, c.status, c.body))
                    .collect();
                panic!(
                    "timed out waiting for {what}; the fake's REST calls:\n{}",
                    calls.join("\n")
                );
            }
            state = self
                .shared
                .1
                .wait_timeout(state, (deadline - now).min(Duration::from_millis(200)))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// A user's message: a MESSAGE_CREATE dispatch in the session (delivered now if a
    /// connection is live and not a zombie, else replayed on Resume).
    pub fn user_message(&self, id: &str, channel: &str, guild: Option<&str>, content: &str) {
        let mentions: Vec<Value> = if content.contains(&format!("<@{BOT_ID}>")) {
            vec![json!({"id": BOT_ID, "username": "fakebot"})]
        } else {
            vec![]
        };
        let mut d = json!({"id": id, "channel_id": channel, "type": 0, "content": content,
            "author": {"id": "7", "username": "ann", "global_name": "Ann"}, "mentions": mentions});
        if let Some(g) = guild {
            d["guild_id"] = json!(g);
        }
        let mut state = self.lock();
        dispatch(&mut state, "MESSAGE_CREATE", d);
        self.shared.1.notify_all();
    }

    /// A thread `thread` created in channel `parent` of guild `guild` (THREAD_CREATE).
    pub fn thread_created(&self, thread: &str, parent: &str, guild: &str) {
        let mut state = self.lock();
        let d = json!({"id": thread, "parent_id": parent, "guild_id": guild, "type": 11,
            "name": "a thread"});
        dispatch(&mut state, "THREAD_CREATE", d);
        self.shared.1.notify_all();
    }

    /// Sends `payload` (an op 7, an op 9) on the live connection.
    pub fn send_op(&self, payload: Value) {
        let state = self.lock();
        let conn = state.conn.as_ref().expect("a live connection");
        conn.send(payload).expect("the connection thread is there");
    }

    /// Messages the bot posted or edited in `channel`, in id order.
    pub fn texts(state: &FakeState, channel: &str) -> Vec<String> {
        let mut ids: Vec<(&String, &(String, String))> = state
            .messages
            .iter()
            .filter(|(_, (c, _))| c == channel)
            .collect();
        ids.sort_by_key(|(id, _)| id.parse::<u64>().unwrap_or(0));
        ids.into_iter().map(|(_, (_, t))| t.clone()).collect()
    }

    /// Messages created with `content` (the number of times a text was posted).
    pub fn posts(state: &FakeState, content: &str) -> usize {
        state.created.iter().filter(|(_, c)| c == content).count()
    }
}

/// Appends a dispatch to the session's log and delivers it when the link is up.
fn dispatch(state: &mut FakeState, t: &str, d: Value) {
    let seq = state.events.len() as u64 + 1;
    let payload = json!({"op": 0, "s": seq, "t": t, "d": d});
    state.events.push(payload.clone());
    if !state.zombie
        && let Some(conn) = &state.conn
    {
        let _ = conn.send(payload);
    }
}

fn serve_gateway(stream: TcpStream, shared: &(Mutex<FakeState>, Condvar), url: &str) {
    let Ok(mut ws) = tungstenite::accept(stream) else {
        return;
    };
    let _ = ws
        .get_mut()
        .set_read_timeout(Some(Duration::from_millis(20)));
    let (tx, rx) = unbounded::<Value>();
    let interval = shared
        .0
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .heartbeat_ms;
    if ws
        .send(Message::text(
            json!({"op": 10, "d": {"heartbeat_interval": interval}}).to_string(),
        ))
        .is_err()
    {
        return;
    }
    let mut introduced = false;
    loop {
        while let Ok(payload) = rx.try_recv() {
            if ws.send(Message::text(payload.to_string())).is_err() {
                return;
            }
        }
        match ws.read() {
            Ok(Message::Text(text)) => {
                let v: Value = serde_json::from_str(text.as_str()).unwrap_or(Value::Null);
                let (lock, cvar) = shared;
                let mut state = lock.lock().unwrap_or_else(|e| e.into_inner());
                let reply = on_payload(&mut state, &v, &tx, &mut introduced, url);
                cvar.notify_all();
                drop(state);
                match reply {
                    Reply::None => {}
                    Reply::Close(code) => {
                        let _ = ws.close(Some(tungstenite::protocol::CloseFrame {
                            code: code.into(),
                            reason: "fake".into(),
                        }));
                        let _ = ws.flush();
                        // Read until the client answers the close (a socket dropped with
                        // unread data would reset, and could lose the close frame).
                        let deadline = Instant::now() + WAIT;
                        while Instant::now() < deadline {
                            match ws.read() {
                                Ok(_) => {}
                                Err(tungstenite::Error::Io(e))
                                    if matches!(
                                        e.kind(),
                                        std::io::ErrorKind::WouldBlock
                                            | std::io::ErrorKind::TimedOut
                                    ) => {}
                                Err(_) => return,
                            }
                        }
                        return;
                    }
                }
            }
            Ok(Message::Close(_)) => return,
            Ok(_) => {}
            Err(tungstenite::Error::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return,
        }
    }
}

enum Reply {
    None,
    Close(u16),
}

fn on_payload(
    state: &mut FakeState,
    v: &Value,
    tx: &Sender<Value>,
    introduced: &mut bool,
    url: &str,
) -> Reply {
    match v.get("op").and_then(Value::as_u64) {
        Some(1) => {
            state.heartbeats += 1;
            if !state.zombie {
                let _ = tx.send(json!({"op": 11}));
            }
        }
        Some(2) => {
            state.identifies += 1;
            if v.pointer("/d/token").and_then(Value::as_str) != Some(TOKEN) {
                return Reply::Close(4004);
            }
            if let Some(code) = state.close_on_identify.take() {
                return Reply::Close(code);
            }
            state.intents = v.pointer("/d/intents").and_then(Value::as_u64);
            let n = state.identifies;
            state.session_id = Some(format!("session-{n}"));
            state.events.clear();
            state.conn = Some(tx.clone());
            *introduced = true;
            dispatch(
                state,
                "READY",
                json!({"v": 10, "session_id": format!("session-{n}"), "resume_gateway_url": url,
                    "user": {"id": BOT_ID, "username": "fakebot", "bot": true}}),
            );
        }
        Some(6) => {
            state.resumes += 1;
            if v.pointer("/d/token").and_then(Value::as_str) != Some(TOKEN) {
                return Reply::Close(4004);
            }
            let asked = v.pointer("/d/session_id").and_then(Value::as_str);
            if asked.is_none() || asked != state.session_id.as_deref() {
                let _ = tx.send(json!({"op": 9, "d": false}));
                return Reply::None;
            }
            let from = v.pointer("/d/seq").and_then(Value::as_u64).unwrap_or(0);
            state.resumed_from.push(from);
            // A new connection: the link is healthy again.
            state.zombie = false;
            for e in state.events.iter().skip(from as usize) {
                let _ = tx.send(e.clone());
            }
            state.conn = Some(tx.clone());
            *introduced = true;
            let seq = state.events.len() as u64 + 1;
            let resumed = json!({"op": 0, "s": seq, "t": "RESUMED", "d": {}});
            state.events.push(resumed.clone());
            let _ = tx.send(resumed);
        }
        _ => {}
    }
    Reply::None
}

fn respond(stream: &mut TcpStream, status: u16, headers: &[(String, String)], body: &Value) {
    let body = if body.is_null() {
        String::new()
    } else {
        body.to_string()
    };
    let mut head = format!(
        "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    let _ = write!(stream, "{head}\r\n{body}");
}

/// One request per connection.
fn serve_http(mut stream: TcpStream, shared: &(Mutex<FakeState>, Condvar), ws_url: &str) {
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let mut request_line = String::new();
    if reader.read_line(&mut request_line).unwrap_or(0) == 0 {
        return;
    }
    let mut parts = request_line.split(' ');
    let method = parts.next().unwrap_or("").to_owned();
    let path = parts.next().unwrap_or("").to_owned();
    let mut length = 0usize;
    let mut authorized = false;
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header).unwrap_or(0) == 0 {
            return;
        }
        let header = header.trim_end();
        if header.is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            if name.eq_ignore_ascii_case("content-length") {
                length = value.trim().parse().unwrap_or(0);
            }
            if name.eq_ignore_ascii_case("authorization") && value.trim() == format!("Bot {TOKEN}")
            {
                authorized = true;
            }
        }
    }
    let mut body = vec![0u8; length];
    if reader.read_exact(&mut body).is_err() {
        return;
    }
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    if !authorized {
        return respond(
            &mut stream,
            401,
            &[],
            &json!({"message": "401: Unauthorized", "code": 0}),
        );
    }
    let path = path.strip_prefix("/api/v10").unwrap_or(&path).to_owned();
    let (lock, cvar) = shared;
    let mut state = lock.lock().unwrap_or_else(|e| e.into_inner());
    let (status, headers, answer) = handle(&mut state, &method, &path, &body, ws_url);
    let method_posts_message = method == "POST" && path.ends_with("/messages");
    state.calls.push(Call {
        method,
        path,
        body,
        at: Instant::now(),
        status,
    });
    cvar.notify_all();
    while state.hold_posts && method_posts_message {
        state = cvar.wait(state).unwrap_or_else(|e| e.into_inner());
    }
    drop(state);
    respond(&mut stream, status, &headers, &answer);
}

type Answer = (u16, Vec<(String, String)>, Value);

/// The rate limits of bucket `hash` for one channel (`key`): a violation is a request before
/// its bucket's `retry_after` passed.
fn limit(
    state: &mut FakeState,
    key: &str,
    hash: &str,
    now: Instant,
) -> Result<Vec<(String, String)>, Answer> {
    let route = key;
    if state.limited_until.get(route).is_some_and(|t| *t > now) {
        state.violations += 1;
    }
    let too_many = |after: Duration, global: bool| -> Answer {
        (
            429,
            vec![
                (
                    "Retry-After".into(),
                    format!("{}", after.as_secs_f64().ceil()),
                ),
                ("X-RateLimit-Global".into(), global.to_string()),
            ],
            json!({"message": "You are being rate limited.", "retry_after": after.as_secs_f64(), "global": global}),
        )
    };
    state
        .global
        .retain(|t| now.duration_since(*t) < Duration::from_secs(1));
    if state.global.len() >= GLOBAL_PER_SEC {
        state.rate_limited += 1;
        state.global_limited += 1;
        let after = Duration::from_secs(1) - now.duration_since(state.global[0]);
        return Err(too_many(after, true));
    }
    if state.force_429 > 0 && hash == "fake-messages" {
        state.force_429 -= 1;
        state.rate_limited += 1;
        let after = Duration::from_secs_f64(state.retry_after);
        state.limited_until.insert(route.to_owned(), now + after);
        return Err(too_many(after, false));
    }
    let bucket = state.buckets.entry(route.to_owned()).or_default();
    bucket.retain(|t| now.duration_since(*t) < BUCKET_WINDOW);
    if bucket.len() >= BUCKET_LIMIT {
        let after = BUCKET_WINDOW - now.duration_since(bucket[0]);
        state.limited_until.insert(route.to_owned(), now + after);
        state.rate_limited += 1;
        return Err(too_many(after, false));
    }
    bucket.push_back(now);
    let remaining = BUCKET_LIMIT - bucket.len();
    let reset_after = BUCKET_WINDOW - now.duration_since(bucket[0]);
    state.global.push_back(now);
    Ok(vec![
        ("X-RateLimit-Limit".into(), BUCKET_LIMIT.to_string()),
        ("X-RateLimit-Remaining".into(), remaining.to_string()),
        (
            "X-RateLimit-Reset-After".into(),
            format!("{:.3}", reset_after.as_secs_f64()),
        ),
        ("X-RateLimit-Bucket".into(), hash.to_owned()),
    ])
}

fn handle(state: &mut FakeState, method: &str, path: &str, body: &Value, ws_url: &str) -> Answer {
    let parts: Vec<&str> = path.split('/').collect();
    if method == "GET" && path == "/gateway/bot" {
        return (
            200,
            vec![],
            json!({"url": state.gateway_url.as_deref().unwrap_or(ws_url), "shards": 1,
                "session_start_limit": {"total": 1000, "remaining": 999, "reset_after": 14_400_000, "max_concurrency": 1}}),
        );
    }
    if method == "GET" && path == "/users/@me" {
        return (
            200,
            vec![],
            json!({"id": BOT_ID, "username": "fakebot", "bot": true}),
        );
    }
    if parts.len() < 4 || parts[1] != "channels" {
        return (404, vec![], json!({"message": "404: Not Found", "code": 0}));
    }
    let channel = parts[2].to_owned();
    let hash = if parts[3] == "messages" {
        "fake-messages".to_owned()
    } else {
        format!("fake-{}", parts[3])
    };
    let key = format!("{hash}:{channel}");
    let headers = match limit(state, &key, &hash, Instant::now()) {
        Ok(h) => h,
        Err(answer) => return answer,
    };
    let content = body.get("content").and_then(Value::as_str).unwrap_or("");
    match (method, parts[3], parts.get(4)) {
        ("POST", "typing", None) => (204, headers, Value::Null),
        ("POST", "messages", None) => {
            if content.chars().count() > 2000 {
                state.too_long += 1;
                return (
                    400,
                    headers,
                    json!({"message": "Invalid Form Body", "code": 50035}),
                );
            }
            let nonce = body
                .get("nonce")
                .and_then(Value::as_str)
                .filter(|_| body.get("enforce_nonce") == Some(&json!(true)))
                .map(str::to_owned);
            if let Some(id) = nonce.as_ref().and_then(|n| state.nonces.get(n)).cloned() {
                let (channel, content) = state.messages.get(&id).cloned().unwrap_or_default();
                return (
                    200,
                    headers,
                    json!({"id": id, "channel_id": channel, "content": content}),
                );
            }
            state.next_id += 1;
            let id = state.next_id.to_string();
            state
                .messages
                .insert(id.clone(), (channel.clone(), content.to_owned()));
            state.created.push((id.clone(), content.to_owned()));
            if let Some(n) = nonce {
                state.nonces.insert(n, id.clone());
            }
            (
                200,
                headers,
                json!({"id": id, "channel_id": channel, "content": content}),
            )
        }
        ("PATCH", "messages", Some(id)) => {
            let id = (*id).to_owned();
            if content.chars().count() > 2000 {
                state.too_long += 1;
                return (
                    400,
                    headers,
                    json!({"message": "Invalid Form Body", "code": 50035}),
                );
            }
            match state.messages.get_mut(&id) {
                None => (
                    404,
                    headers,
                    json!({"message": "Unknown Message", "code": 10008}),
                ),
                Some(m) => {
                    if m.1 == content {
                        state.not_modified += 1;
                    }
                    m.1 = content.to_owned();
                    (200, headers, json!({"id": id, "content": content}))
                }
            }
        }
        ("DELETE", "messages", Some(id)) => {
            state.messages.remove(*id);
            (204, headers, Value::Null)
        }
        _ => (
            404,
            headers,
            json!({"message": "404: Not Found", "code": 0}),
        ),
    }
}
