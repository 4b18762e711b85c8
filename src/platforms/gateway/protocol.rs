//! One gateway line in: answers pending messages, filters results already shown, and turns
//! the rest into [`GatewayEvent`]s.

use crossbeam_channel::Sender;
use serde_json::{Value, json};

use super::{Admission, GatewayEvent, Outcome, Shared, TerminalEvent, write_line};

/// What reading one line means for the connection.
pub(super) enum LineResult {
    /// Keep reading.
    Continue,
    /// An `error` line (kept as the reason should the gateway close right after it).
    Error(String),
    /// The bridge dropped its event receiver.
    ReceiverGone,
}

/// The string field `name` of a line, empty when absent.
fn str_field(v: &Value, name: &str) -> String {
    v.get(name)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}

/// Acts on one gateway line: answers pending messages, filters results already shown, and
/// passes the rest on as events.
pub(super) fn handle_line(
    shared: &Shared,
    line: &[u8],
    confirmed: &mut bool,
    events: &Sender<GatewayEvent>,
) -> LineResult {
    let Some(v) = parse(line) else {
        return LineResult::Continue;
    };
    let op = v.get("op").and_then(Value::as_str).unwrap_or_default();
    let id = str_field(&v, "id");
    let session = str_field(&v, "session");
    let event = match op {
        "pong" if *confirmed => None,
        "pong" => {
            *confirmed = true;
            Some(on_pong(shared))
        }
        "ack" | "reject" => Some(on_admission(shared, op, &v, id, session)),
        "typing" => Some(GatewayEvent::Typing {
            session,
            chat_id: str_field(&v, "chat_id"),
            on: v.get("on").and_then(Value::as_bool).unwrap_or(false),
        }),
        "partial" => Some(GatewayEvent::Partial {
            id,
            session,
            text: str_field(&v, "text"),
        }),
        "reply" | "cancelled" | "failed" | "merged" => on_result(shared, op, &v, id, session),
        "error" => return on_error(shared, &v, events),
        other => {
            log::debug!("gateway: ignoring op {other:?}");
            None
        }
    };
    match event.map(|event| events.send(event)) {
        Some(Err(_)) => LineResult::ReceiverGone,
        _ => LineResult::Continue,
    }
}

/// The line as a JSON object; `None` (logged) for an empty line or anything else.
fn parse(line: &[u8]) -> Option<Value> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    if line.is_empty() {
        return None;
    }
    match serde_json::from_slice(line) {
        Ok(v @ Value::Object(_)) => Some(v),
        _ => {
            log::warn!(
                "gateway: ignoring a line that is not a JSON object ({} bytes)",
                line.len()
            );
            None
        }
    }
}

/// The first `pong` of a connection: its hello is confirmed.
fn on_pong(shared: &Shared) -> GatewayEvent {
    shared.lock().connected = true;
    log::info!(
        "gateway: connected to {} as platform {}",
        shared.config.addr,
        shared.config.platform
    );
    GatewayEvent::Connected
}

/// An `ack` or `reject`: the message stops being pending and its waiters get the answer.
fn on_admission(shared: &Shared, op: &str, v: &Value, id: String, session: String) -> GatewayEvent {
    let admission = admission(op, v, session);
    let waiters = {
        let mut state = shared.lock();
        match state.pending.iter().position(|p| p.id == id) {
            Some(i) => state
                .pending
                .remove(i)
                .map(|p| p.waiters)
                .unwrap_or_default(),
            None => Vec::new(),
        }
    };
    for w in waiters {
        let _ = w.try_send(admission.clone());
    }
    GatewayEvent::Admission { id, admission }
}

/// The [`Admission`] an `ack` (`state` running, queued or duplicate) or `reject` line says.
fn admission(op: &str, v: &Value, session: String) -> Admission {
    if op == "reject" {
        Admission::Rejected {
            session: v.get("session").and_then(Value::as_str).map(str::to_owned),
            reason: str_field(v, "reason"),
            detail: str_field(v, "detail"),
        }
    } else if v.get("state").and_then(Value::as_str) == Some("duplicate") {
        Admission::Duplicate { session }
    } else {
        Admission::Accepted {
            session,
            queued: v.get("state").and_then(Value::as_str) == Some("queued"),
            position: v
                .get("position")
                .and_then(Value::as_u64)
                .and_then(|p| usize::try_from(p).ok())
                .unwrap_or(0),
        }
    }
}

/// A terminal event: passed on unless its id was handled before (then confirmed again).
fn on_result(
    shared: &Shared,
    op: &str,
    v: &Value,
    id: String,
    session: String,
) -> Option<GatewayEvent> {
    let outcome = match op {
        "reply" => Outcome::Reply {
            text: str_field(v, "text"),
            truncated: v.get("truncated").and_then(Value::as_bool) == Some(true),
        },
        "cancelled" => Outcome::Cancelled {
            reason: str_field(v, "reason"),
        },
        "failed" => Outcome::Failed {
            error: str_field(v, "error"),
        },
        _ => Outcome::Merged {
            into: str_field(v, "into"),
        },
    };
    let redelivery = v.get("redelivery").and_then(Value::as_bool) == Some(true);
    {
        let mut state = shared.lock();
        if state.shown.contains(&id) {
            // Handled before (the protocol allows a second copy): confirm again so
            // the gateway forgets it, and keep it from the chat.
            log::debug!("gateway: result {id} of {session} was already handled; confirmed again");
            let line = json!({"op": "delivered", "ids": [id]}).to_string();
            write_line(&mut state, &line);
            return None;
        }
    }
    Some(GatewayEvent::Result(TerminalEvent {
        id,
        session,
        outcome,
        redelivery,
    }))
}

/// An `error` line: reported to the bridge, and kept as the reason of a close that follows.
fn on_error(shared: &Shared, v: &Value, events: &Sender<GatewayEvent>) -> LineResult {
    let detail = str_field(v, "detail");
    log::warn!("gateway {}: error: {detail}", shared.config.addr);
    if events
        .send(GatewayEvent::Error {
            detail: detail.clone(),
        })
        .is_err()
    {
        return LineResult::ReceiverGone;
    }
    LineResult::Error(detail)
}
