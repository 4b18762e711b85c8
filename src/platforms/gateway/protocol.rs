//! One gateway line in: answers pending messages, filters results already shown, and turns
//! the rest into [`GatewayEvent`]s.

use std::time::Instant;

use crossbeam_channel::Sender;

use super::{Admission, GatewayEvent, Shared, TerminalEvent, TerminalOutcome, hold, write_line};
use crate::wire::{ClientOp, ServerLine, ServerOp};

/// What reading one line means for the connection.
pub(super) enum LineResult {
    /// Keep reading.
    Continue,
    /// An `error` line (kept as the reason should the gateway close right after it).
    Error(String),
    /// The bridge dropped its event receiver.
    ReceiverGone,
}

/// Acts on one gateway line: answers pending messages, filters results already shown, and
/// passes the rest on as events.
pub(super) fn handle_line(
    shared: &Shared,
    line: &[u8],
    confirmed: &mut bool,
    events: &Sender<GatewayEvent>,
) -> LineResult {
    let Some(ServerLine { op, redelivery }) = parse(line) else {
        return LineResult::Continue;
    };
    let event = match op {
        ServerOp::Pong { .. } if *confirmed => None,
        ServerOp::Pong { max_line_bytes } => {
            *confirmed = true;
            Some(on_pong(shared, max_line_bytes))
        }
        ServerOp::Ack {
            id,
            session,
            state,
            position,
        } => {
            let admission = match state.as_str() {
                "duplicate" => Admission::Duplicate { session },
                state => Admission::Accepted {
                    session,
                    queued: state == "queued",
                    position: position.unwrap_or(0),
                },
            };
            on_admission(shared, id, admission)
        }
        ServerOp::Reject {
            id,
            session,
            reason,
            detail,
        } => on_admission(
            shared,
            id,
            Admission::Rejected {
                session,
                reason,
                detail,
            },
        ),
        ServerOp::Typing {
            session,
            chat_id,
            on,
            ..
        } => Some(GatewayEvent::Typing {
            session,
            chat_id,
            on,
        }),
        ServerOp::Partial { id, session, text } => {
            Some(GatewayEvent::Partial { id, session, text })
        }
        op @ (ServerOp::Reply { .. }
        | ServerOp::Cancelled { .. }
        | ServerOp::Failed { .. }
        | ServerOp::Merged { .. }) => terminal(op, redelivery).and_then(|t| on_result(shared, t)),
        ServerOp::MayUse { id, allowed } => {
            super::ask::answered(shared, &id, allowed);
            None
        }
        ServerOp::Error { detail } => return on_error(shared, detail, *confirmed, events),
    };
    match event.map(|event| events.send(event)) {
        Some(Err(_)) => LineResult::ReceiverGone,
        _ => LineResult::Continue,
    }
}

/// The terminal event a `reply`, `cancelled`, `failed` or `merged` line is.
fn terminal(op: ServerOp, redelivery: bool) -> Option<TerminalEvent> {
    let (id, session, outcome) = match op {
        // The access policy's `ignored`: nothing to show, confirmed all the same.
        ServerOp::Reply {
            id,
            session,
            notice: Some(n),
            ..
        } if n == "ignored" => (id, session, TerminalOutcome::Ignored),
        ServerOp::Reply {
            id,
            session,
            text,
            truncated,
            attachments,
            ..
        } => (
            id,
            session,
            TerminalOutcome::Reply {
                text,
                truncated,
                files: attachments,
            },
        ),
        ServerOp::Cancelled {
            id,
            session,
            reason,
        } => (id, session, TerminalOutcome::Cancelled { reason }),
        ServerOp::Failed { id, session, error } => (id, session, TerminalOutcome::Failed { error }),
        ServerOp::Merged { id, session, into } => (id, session, TerminalOutcome::Merged { into }),
        _ => return None,
    };
    Some(TerminalEvent {
        id,
        session,
        outcome,
        redelivery,
    })
}

/// The line as a server op; `None` (logged) for an empty line or anything else.
fn parse(line: &[u8]) -> Option<ServerLine> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    if line.is_empty() {
        return None;
    }
    match ServerLine::parse(line) {
        Ok(parsed) => Some(parsed),
        // An object this client cannot read: an op it does not know (or a field of a type
        // the protocol does not give it).
        Err(e) if e.is_data() && line.starts_with(b"{") => {
            log::debug!("gateway: ignoring a line: {e}");
            None
        }
        Err(_) => {
            warn_limited!(
                "gateway: ignoring a line that is not a JSON object ({} bytes)",
                line.len()
            );
            None
        }
    }
}

/// The first `pong` of a connection: its hello is confirmed.
/// The hello's confirmation: connected. The line limit the gateway announces, if it does,
/// bounds the messages from now on (else the configured `--max-line-bytes` does).
fn on_pong(shared: &Shared, announced: Option<usize>) -> GatewayEvent {
    let limit = {
        let mut state = shared.lock();
        state.connected = true;
        state.max_line_bytes = announced
            .filter(|&n| n > 0)
            .unwrap_or(shared.config.max_line_bytes);
        state.max_line_bytes
    };
    log::info!(
        "gateway: connected to {} as platform {} (lines of at most {limit} bytes)",
        shared.config.addr,
        shared.config.platform
    );
    GatewayEvent::Connected
}

/// An `ack` or `reject`: the message stops being pending and its waiters get the answer —
/// unless it is a retryable refusal the client holds to send again ([`hold`]): then `None`.
fn on_admission(shared: &Shared, id: String, admission: Admission) -> Option<GatewayEvent> {
    let (waiters, admission) = {
        let mut state = shared.lock();
        let admission =
            match hold::on_refusal(&mut state, &shared.config, &id, admission, Instant::now()) {
                hold::Refusal::Held => return None,
                hold::Refusal::Final(admission) => admission,
            };
        let waiters = match state.pending.iter().position(|p| p.id == id) {
            Some(i) => state
                .pending
                .remove(i)
                .map(|p| p.waiters)
                .unwrap_or_default(),
            None => Vec::new(),
        };
        (waiters, admission)
    };
    for w in waiters {
        let _ = w.try_send(admission.clone());
    }
    Some(GatewayEvent::Admission { id, admission })
}

/// A terminal event: passed on unless its id was handled before (then confirmed again).
fn on_result(shared: &Shared, event: TerminalEvent) -> Option<GatewayEvent> {
    {
        let mut state = shared.lock();
        if state.shown.contains(&event.id) {
            // Handled before (the protocol allows a second copy): confirm again so
            // the gateway forgets it, and keep it from the chat.
            log::debug!(
                "gateway: result {} of {} was already handled; confirmed again",
                event.id,
                event.session
            );
            let line = ClientOp::Delivered {
                ids: vec![event.id],
            }
            .line();
            write_line(&mut state, &line);
            return None;
        }
    }
    Some(GatewayEvent::Result(event))
}

/// An `error` line: kept as the reason of a close that follows. Once the hello is confirmed,
/// the gateway answers lines in order, and an `error` there answers the oldest message in
/// flight (a line it could not read, e.g. too long): that message ends, refused `invalid`,
/// so its bridge can tell the human and move on. Otherwise it is reported as it is.
fn on_error(
    shared: &Shared,
    detail: String,
    confirmed: bool,
    events: &Sender<GatewayEvent>,
) -> LineResult {
    let answered = if confirmed {
        shared.lock().oldest_in_flight()
    } else {
        None
    };
    let event = match answered {
        Some(id) => {
            warn_limited!(
                "gateway {}: error answering message {id}: {detail}; the message ends there",
                shared.config.addr
            );
            let refused = Admission::Rejected {
                session: None,
                reason: "invalid".into(),
                detail: crate::platforms::secrets::redact(&detail).into_owned(),
            };
            match on_admission(shared, id, refused) {
                Some(event) => event,
                None => return LineResult::Continue,
            }
        }
        None => {
            warn_limited!("gateway {}: error: {detail}", shared.config.addr);
            GatewayEvent::Error {
                detail: detail.clone(),
            }
        }
    };
    if events.send(event).is_err() {
        return LineResult::ReceiverGone;
    }
    LineResult::Error(detail)
}
