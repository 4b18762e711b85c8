//! A **FAKE** of Slack (Socket Mode and the Web API), written for the tests of `turnstile
//! bridge slack` from Slack's published documentation. It is not Slack and checks only what
//! the bridge depends on and what the real service punishes:
//!
//! - Socket Mode: `apps.connections.open` (the app-level token) gives a WebSocket URL; a
//!   connection starts with `hello`; every envelope must be acknowledged within 3 s, else it
//!   is delivered again with `retry_attempt` raised (up to 3 times); `disconnect` asks for a
//!   refresh, and the fake records whether the new connection opened before the old closed.
//! - Web API (the bot token; `invalid_auth` otherwise): `auth.test`; `chat.postMessage`
//!   (40,000 characters at most, `thread_ts` recorded) and `chat.update`, each about one a
//!   second per channel, 429 with `Retry-After` past it; a call on a channel before its
//!   `Retry-After` passed is counted as a violation.
#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crossbeam_channel::{Sender, unbounded};
use serde_json::{Value, json};
use tungstenite::Message;

pub const WAIT: Duration = Duration::from_secs(60);
pub const APP_TOKEN: &str = "xapp-1-FAKE-SECRET-app";
pub const BOT_TOKEN: &str = "xoxb-FAKE-SECRET-bot";
pub const BOT_ID: &str = "UBOT";
/// How long an envelope may wait for its ack.
pub const ACK_DEADLINE: Duration = Duration::from_secs(3);

/// An envelope sent and not acknowledged yet.
struct Unacked {
    envelope_id: String,
    event: Value,
    retry_attempt: u64,
    sent: Instant,
}

#[derive(Default)]
pub struct FakeState {
    /// Web API calls: (method, body, ok).
    pub calls: Vec<(String, Value, bool)>,
    /// Messages posted: ts → (channel, thread_ts, text).
    pub messages: HashMap<String, (String, Option<String>, String)>,
    /// Every message created, in order: (ts, text).
    pub created: Vec<(String, String)>,
    /// When each message was created, in order: (channel, instant).
    pub created_at: Vec<(String, Instant)>,
    next: u64,
    /// Connections: (opened, closed).
    pub connections: Vec<(Instant, Option<Instant>)>,
    conn: Option<(usize, Sender<Value>)>,
    unacked: Vec<Unacked>,
    pub acks: u32,
    /// Envelopes sent (first deliveries and redeliveries).
    pub envelopes: u32,
    /// Envelopes delivered again because their ack came late.
    pub late_redeliveries: u32,
    pub force_429: u32,
    last_post: HashMap<String, Instant>,
    limited_until: HashMap<String, Instant>,
    pub rate_limited: u32,
    pub violations: u32,
    pub too_long: u32,
}

pub struct FakeSlack {
    pub api_base: String,
    shared: Arc<(Mutex<FakeState>, Condvar)>,
}

impl FakeSlack {
    pub fn start() -> FakeSlack {
        let rest = TcpListener::bind("127.0.0.1:0").expect("bind");
        let ws = TcpListener::bind("127.0.0.1:0").expect("bind");
        let api_base = format!("http://{}/api", rest.local_addr().expect("addr"));
        let ws_url = format!("ws://{}/link", ws.local_addr().expect("addr"));
        let shared = Arc::new((Mutex::new(FakeState::default()), Condvar::new()));
        let for_rest = Arc::clone(&shared);
        std::thread::spawn(move || {
            for stream in rest.incoming() {
                let Ok(stream) = stream else { return };
                let shared = Arc::clone(&for_rest);
                let url = ws_url.clone();
                std::thread::spawn(move || serve_http(stream, &shared, &url));
            }
        });
        let for_ws = Arc::clone(&shared);
        std::thread::spawn(move || {
            for stream in ws.incoming() {
                let Ok(stream) = stream else { return };
                let shared = Arc::clone(&for_ws);
                std::thread::spawn(move || serve_socket(stream, &shared));
            }
        });
        FakeSlack { api_base, shared }
    }

    pub fn lock(&self) -> MutexGuard<'_, FakeState> {
        self.shared.0.lock().unwrap_or_else(|e| e.into_inner())
    }

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
                    .map(|(m, b, ok)| format!("{m} {ok} {b}"))
                    .collect();
                panic!("timed out waiting for {what}; calls:\n{}", calls.join("\n"));
            }
            state = self
                .shared
                .1
                .wait_timeout(state, (deadline - now).min(Duration::from_millis(200)))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// An Events API event, in an envelope on the newest connection.
    pub fn event(&self, event: Value) {
        let mut state = self.lock();
        send_envelope(&mut state, event, 0);
    }

    /// A DM from user U7.
    pub fn dm(&self, ts: &str, text: &str) {
        self.event(
            json!({"type": "message", "channel_type": "im", "channel": "D1",
            "user": "U7", "ts": ts, "text": text}),
        );
    }

    /// Asks the current connection to refresh.
    pub fn disconnect(&self) {
        let state = self.lock();
        let (_, conn) = state.conn.as_ref().expect("a connection");
        let _ = conn.send(json!({"type": "disconnect", "reason": "refresh_requested"}));
    }

    /// Texts of messages created.
    pub fn posts(state: &FakeState, text: &str) -> usize {
        state.created.iter().filter(|(_, t)| t == text).count()
    }

    /// Texts in `channel` in ts order.
    pub fn texts(state: &FakeState, channel: &str) -> Vec<String> {
        let mut m: Vec<(&String, &String)> = state
            .messages
            .iter()
            .filter(|(_, (c, _, _))| c == channel)
            .map(|(ts, (_, _, text))| (ts, text))
            .collect();
        m.sort();
        m.into_iter().map(|(_, t)| t.clone()).collect()
    }
}

fn send_envelope(state: &mut FakeState, event: Value, retry_attempt: u64) {
    state.next += 1;
    state.envelopes += 1;
    let envelope_id = format!("env-{}", state.next);
    let envelope = json!({"envelope_id": envelope_id, "type": "events_api",
        "accepts_response_payload": false, "retry_attempt": retry_attempt,
        "retry_reason": if retry_attempt > 0 { "timeout" } else { "" },
        "payload": {"type": "event_callback", "event_id": format!("Ev{}", event["ts"]), "event": event}});
    if let Some((_, conn)) = &state.conn {
        let _ = conn.send(envelope);
    }
    state.unacked.push(Unacked {
        envelope_id,
        event,
        retry_attempt,
        sent: Instant::now(),
    });
}

fn serve_socket(stream: TcpStream, shared: &(Mutex<FakeState>, Condvar)) {
    let Ok(mut ws) = tungstenite::accept(stream) else {
        return;
    };
    let _ = ws
        .get_mut()
        .set_read_timeout(Some(Duration::from_millis(20)));
    let (tx, rx) = unbounded::<Value>();
    let index = {
        let mut state = shared.0.lock().unwrap_or_else(|e| e.into_inner());
        state.connections.push((Instant::now(), None));
        let i = state.connections.len() - 1;
        state.conn = Some((i, tx));
        shared.1.notify_all();
        i
    };
    let hello = json!({"type": "hello", "num_connections": 1});
    if ws.send(Message::text(hello.to_string())).is_err() {
        return;
    }
    let closed = |shared: &(Mutex<FakeState>, Condvar)| {
        let mut state = shared.0.lock().unwrap_or_else(|e| e.into_inner());
        state.connections[index].1 = Some(Instant::now());
        if state.conn.as_ref().is_some_and(|(i, _)| *i == index) {
            state.conn = None;
        }
        shared.1.notify_all();
    };
    loop {
        while let Ok(v) = rx.try_recv() {
            if ws.send(Message::text(v.to_string())).is_err() {
                return closed(shared);
            }
        }
        {
            // Late acks: Slack delivers the envelope again, up to 3 times.
            let mut state = shared.0.lock().unwrap_or_else(|e| e.into_inner());
            if state.conn.as_ref().is_some_and(|(i, _)| *i == index) {
                let now = Instant::now();
                let late: Vec<Unacked> = {
                    let (late, keep) = std::mem::take(&mut state.unacked)
                        .into_iter()
                        .partition(|u| now.duration_since(u.sent) > ACK_DEADLINE);
                    state.unacked = keep;
                    late
                };
                for u in late {
                    if u.retry_attempt < 3 {
                        state.late_redeliveries += 1;
                        send_envelope(&mut state, u.event, u.retry_attempt + 1);
                    }
                }
            }
        }
        match ws.read() {
            Ok(Message::Text(t)) => {
                let v: Value = serde_json::from_str(t.as_str()).unwrap_or(Value::Null);
                if let Some(id) = v.get("envelope_id").and_then(Value::as_str) {
                    let mut state = shared.0.lock().unwrap_or_else(|e| e.into_inner());
                    state.acks += 1;
                    state.unacked.retain(|u| u.envelope_id != id);
                    shared.1.notify_all();
                }
            }
            Ok(Message::Close(_)) => return closed(shared),
            Ok(_) => {}
            Err(tungstenite::Error::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return closed(shared),
        }
    }
}

fn respond(stream: &mut TcpStream, status: u16, retry_after: Option<u64>, body: &Value) {
    let body = body.to_string();
    let extra = retry_after.map_or(String::new(), |s| format!("Retry-After: {s}\r\n"));
    let _ = write!(
        stream,
        "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{extra}Connection: close\r\n\r\n{body}",
        body.len()
    );
}

fn serve_http(mut stream: TcpStream, shared: &(Mutex<FakeState>, Condvar), ws_url: &str) {
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return;
    }
    let path = line.split(' ').nth(1).unwrap_or("").to_owned();
    let mut length = 0;
    let mut auth = String::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).unwrap_or(0) == 0 {
            return;
        }
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                length = v.trim().parse().unwrap_or(0);
            }
            if k.eq_ignore_ascii_case("authorization") {
                auth = v.trim().to_owned();
            }
        }
    }
    let mut body = vec![0u8; length];
    if reader.read_exact(&mut body).is_err() {
        return;
    }
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let method = path.strip_prefix("/api/").unwrap_or("").to_owned();
    let token = if method == "apps.connections.open" {
        APP_TOKEN
    } else {
        BOT_TOKEN
    };
    if auth != format!("Bearer {token}") {
        return respond(
            &mut stream,
            200,
            None,
            &json!({"ok": false, "error": "invalid_auth"}),
        );
    }
    let (lock, cvar) = shared;
    let mut state = lock.lock().unwrap_or_else(|e| e.into_inner());
    let (status, retry, answer) = handle(&mut state, &method, &body, ws_url);
    let ok = answer["ok"] == true;
    state.calls.push((method, body, ok));
    cvar.notify_all();
    drop(state);
    respond(&mut stream, status, retry, &answer);
}

fn handle(
    state: &mut FakeState,
    method: &str,
    body: &Value,
    ws_url: &str,
) -> (u16, Option<u64>, Value) {
    match method {
        "auth.test" => (
            200,
            None,
            json!({"ok": true, "user_id": BOT_ID, "user": "fakebot"}),
        ),
        "apps.connections.open" => (200, None, json!({"ok": true, "url": ws_url})),
        "chat.postMessage" | "chat.update" => {
            let channel = body["channel"].as_str().unwrap_or("").to_owned();
            let route = format!("{method} {channel}");
            let now = Instant::now();
            if state.limited_until.get(&route).is_some_and(|t| *t > now) {
                state.violations += 1;
            }
            let too_soon = state
                .last_post
                .get(&route)
                .is_some_and(|t| now.duration_since(*t) < Duration::from_millis(900));
            if state.force_429 > 0 || too_soon {
                state.force_429 = state.force_429.saturating_sub(1);
                state.rate_limited += 1;
                state
                    .limited_until
                    .insert(route, now + Duration::from_secs(1));
                return (429, Some(1), json!({"ok": false, "error": "ratelimited"}));
            }
            state.last_post.insert(route, now);
            let text = body["text"].as_str().unwrap_or("").to_owned();
            if text.chars().count() > 40_000 {
                state.too_long += 1;
                return (200, None, json!({"ok": false, "error": "msg_too_long"}));
            }
            if method == "chat.update" {
                let ts = body["ts"].as_str().unwrap_or("").to_owned();
                return match state.messages.get_mut(&ts) {
                    Some(m) => {
                        m.2 = text;
                        (200, None, json!({"ok": true, "ts": ts, "channel": channel}))
                    }
                    None => (
                        200,
                        None,
                        json!({"ok": false, "error": "message_not_found"}),
                    ),
                };
            }
            state.next += 1;
            let ts = format!("1700000000.{:06}", state.next);
            let thread = body["thread_ts"].as_str().map(str::to_owned);
            state
                .messages
                .insert(ts.clone(), (channel.clone(), thread, text.clone()));
            state.created.push((ts.clone(), text));
            state.created_at.push((channel.clone(), Instant::now()));
            (200, None, json!({"ok": true, "ts": ts, "channel": channel}))
        }
        "chat.delete" => {
            let ts = body["ts"].as_str().unwrap_or("");
            state.messages.remove(ts);
            (200, None, json!({"ok": true}))
        }
        _ => (200, None, json!({"ok": false, "error": "unknown_method"})),
    }
}
