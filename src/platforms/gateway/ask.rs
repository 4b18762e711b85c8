//! `may_use` queries: a bridge asks the gateway's access policy whether a user may use the
//! bot before it acts for them outside a message (the Matrix bridge, before it accepts an
//! invite). One query is one line; the gateway answers it in line order with a `may_use`
//! line carrying the same id.

use std::time::Duration;

use crossbeam_channel::{RecvTimeoutError, Sender, bounded};

use super::{Gateway, SendError, Shared, write_line};
use crate::wire::ClientOp;

/// Queries waiting for their answer at once, at most (a bridge asks one at a time; past it
/// a query is refused at once, [`SendError::TooManyPending`]).
pub(super) const MAX_QUERIES: usize = 16;

/// The queries written on the current connection and not answered yet.
#[derive(Default)]
pub(super) struct Queries {
    waiting: Vec<(String, Sender<bool>)>,
    next: u64,
}

impl Queries {
    /// The connection is gone: its queries will not be answered (their askers hear
    /// [`SendError::Closed`] and may ask again).
    pub(super) fn lost(&mut self) {
        self.waiting.clear();
    }
}

impl Gateway {
    /// Whether `user` may use the bot (the gateway's access policy), about the chat `chat`
    /// if given; waits up to `timeout`. An error when the gateway is not connected, did not
    /// answer in time, or the connection dropped: nothing was decided, ask again later.
    pub(crate) fn may_use(
        &self,
        user: &str,
        chat: Option<&str>,
        timeout: Duration,
    ) -> Result<bool, SendError> {
        let (tx, rx) = bounded(1);
        let id = {
            let mut state = self.shared.lock();
            if !state.connected {
                return Err(SendError::Closed);
            }
            if state.queries.waiting.len() >= MAX_QUERIES {
                return Err(SendError::TooManyPending(MAX_QUERIES));
            }
            state.queries.next += 1;
            let id = format!("may_use-{}", state.queries.next);
            let line = ClientOp::MayUse {
                id: id.clone(),
                platform: None,
                user_id: user.to_owned(),
                chat_id: chat.map(str::to_owned),
            }
            .line();
            if !write_line(&mut state, &line) {
                return Err(SendError::Closed);
            }
            state.queries.waiting.push((id.clone(), tx));
            id
        };
        match rx.recv_timeout(timeout) {
            Ok(allowed) => Ok(allowed),
            Err(RecvTimeoutError::Timeout) => {
                self.shared.lock().queries.waiting.retain(|(q, _)| *q != id);
                Err(SendError::TimedOut)
            }
            Err(RecvTimeoutError::Disconnected) => Err(SendError::Closed),
        }
    }
}

/// The gateway's answer to the query `id`: handed to its asker (an answer to no query — one
/// that timed out — is dropped).
pub(super) fn answered(shared: &Shared, id: &str, allowed: bool) {
    let mut state = shared.lock();
    if let Some(i) = state.queries.waiting.iter().position(|(q, _)| q == id) {
        let (_, tx) = state.queries.waiting.swap_remove(i);
        let _ = tx.try_send(allowed);
    }
}
