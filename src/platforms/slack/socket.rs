//! The Socket Mode connection, on a thread of its own: `apps.connections.open` → the
//! WebSocket → `hello`; every envelope acknowledged (`{"envelope_id": …}`) — an event only
//! once the main thread says the gateway has it (accepted, duplicate or refused), anything
//! else at once; `disconnect` (a refresh or a warning) → a new connection opened before the
//! old one is closed, so no envelope falls between them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use serde_json::{Value, json};
use tungstenite::Message;

use super::api::WebApi;
use super::event::event_message;
use crate::platforms::gateway::OutgoingMessage;
use crate::platforms::replies::CallError;
use crate::platforms::websocket::{self, Socket};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// What the connection tells the bridge.
#[derive(Debug)]
// One per Slack event, moved once: boxing the message would buy nothing (issue 36 made the
// message's fields one list longer).
#[allow(clippy::large_enum_variant)]
pub(crate) enum Inbound {
    /// A connection said `hello`.
    Up,
    /// A user's message, to acknowledge once the gateway answered it.
    Event {
        envelope_id: String,
        message: OutgoingMessage,
    },
    /// The app-level token was refused.
    Fatal(String),
}

/// Waits `d` unless `stop` is set first.
fn pause(stop: &AtomicBool, d: Duration) {
    let until = Instant::now() + d;
    while !stop.load(Ordering::SeqCst) && Instant::now() < until {
        std::thread::park_timeout(
            until
                .saturating_duration_since(Instant::now())
                .min(Duration::from_millis(50)),
        );
    }
}

/// How opening a connection failed.
enum OpenError {
    Stop,
    Fatal(String),
    Again(String),
}

/// A new connection, up to its `hello`.
fn open(api: &mut WebApi, stop: &AtomicBool) -> Result<Socket, OpenError> {
    let answer = api.call("apps.connections.open", &json!({}), true);
    let url = match answer {
        Ok(v) => v
            .get("url")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| OpenError::Again("apps.connections.open: no url".into()))?,
        Err(CallError::Unauthorized(d)) => {
            return Err(OpenError::Fatal(format!(
                "Slack refused the app-level token ({d}): create one with the connections:write scope (Basic Information → App-Level Tokens) and enable Socket Mode"
            )));
        }
        Err(e) => return Err(OpenError::Again(format!("apps.connections.open: {e}"))),
    };
    let mut ws = websocket::connect(&url, CONNECT_TIMEOUT).map_err(OpenError::Again)?;
    let deadline = Instant::now() + CONNECT_TIMEOUT;
    loop {
        if stop.load(Ordering::SeqCst) {
            return Err(OpenError::Stop);
        }
        if Instant::now() >= deadline {
            return Err(OpenError::Again("no hello in time".into()));
        }
        match ws.read() {
            Ok(Message::Text(t)) => {
                let v: Value = serde_json::from_str(t.as_str()).unwrap_or(Value::Null);
                if v.get("type").and_then(Value::as_str) == Some("hello") {
                    return Ok(ws);
                }
            }
            Ok(Message::Close(_)) => return Err(OpenError::Again("closed before hello".into())),
            Ok(_) => {}
            Err(e) if websocket::is_idle(&e) => {}
            Err(e) => return Err(OpenError::Again(format!("the connection failed: {e}"))),
        }
    }
}

/// Runs Socket Mode until `stop` is set or the token is refused.
pub(crate) fn run_socket(
    mut api: WebApi,
    me: &str,
    to_main: &Sender<Inbound>,
    acks: &Receiver<String>,
    stop: &AtomicBool,
) {
    let mut backoff = Duration::from_secs(1);
    while !stop.load(Ordering::SeqCst) {
        let mut ws = match open(&mut api, stop) {
            Ok(ws) => ws,
            Err(OpenError::Stop) => return,
            Err(OpenError::Fatal(e)) => {
                let _ = to_main.send(Inbound::Fatal(e));
                return;
            }
            Err(OpenError::Again(e)) => {
                warn_limited!(
                    "slack: cannot open a Socket Mode connection: {e}; retrying in {backoff:?}"
                );
                pause(stop, backoff);
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };
        backoff = Duration::from_secs(1);
        if to_main.send(Inbound::Up).is_err() {
            return;
        }
        match converse(&mut ws, &mut api, me, to_main, acks, stop) {
            Ok(()) => return,
            Err(e) => info_redacted!("slack: {e}; reconnecting"),
        }
    }
}

/// Reads envelopes and writes acks until the connection ends (`Err`) or `stop` (`Ok`).
fn converse(
    ws: &mut Socket,
    api: &mut WebApi,
    me: &str,
    to_main: &Sender<Inbound>,
    acks: &Receiver<String>,
    stop: &AtomicBool,
) -> Result<(), String> {
    loop {
        if stop.load(Ordering::SeqCst) {
            let _ = ws.close(None);
            let _ = ws.flush();
            return Ok(());
        }
        while let Ok(id) = acks.try_recv() {
            ack(ws, &id)?;
        }
        let text = match ws.read() {
            Ok(Message::Text(t)) => t,
            Ok(Message::Close(_)) => return Err("Slack closed the connection".into()),
            Ok(_) => continue,
            Err(e) if websocket::is_idle(&e) => {
                let _ = ws.flush();
                continue;
            }
            Err(e) => return Err(format!("the connection failed: {e}")),
        };
        let v: Value = serde_json::from_str(text.as_str()).unwrap_or(Value::Null);
        let envelope_id = v.get("envelope_id").and_then(Value::as_str);
        match (v.get("type").and_then(Value::as_str), envelope_id) {
            (Some("disconnect"), _) => {
                info_redacted!(
                    "slack: disconnect ({}); opening a new connection first",
                    v.get("reason")
                        .and_then(Value::as_str)
                        .unwrap_or("no reason")
                );
                match open(api, stop) {
                    Ok(new) => {
                        let _ = ws.close(None);
                        let _ = ws.flush();
                        *ws = new;
                    }
                    Err(OpenError::Stop) => return Ok(()),
                    Err(OpenError::Fatal(e)) => {
                        let _ = to_main.send(Inbound::Fatal(e));
                        return Ok(());
                    }
                    Err(OpenError::Again(e)) => return Err(e),
                }
            }
            (Some("events_api"), Some(id)) => {
                let message = v
                    .pointer("/payload/event")
                    .and_then(|e| event_message(e, me));
                match message {
                    Some(message) => {
                        debug_redacted!("slack: envelope {id}: message {}", message.id);
                        let inbound = Inbound::Event {
                            envelope_id: id.to_owned(),
                            message,
                        };
                        to_main.send(inbound).map_err(|_| "the bridge stopped")?;
                    }
                    None => ack(ws, id)?,
                }
            }
            (_, Some(id)) => ack(ws, id)?,
            _ => {}
        }
    }
}

fn ack(ws: &mut Socket, envelope_id: &str) -> Result<(), String> {
    ws.send(Message::text(
        json!({"envelope_id": envelope_id}).to_string(),
    ))
    .map_err(|e| format!("writing an ack failed: {e}"))
}
