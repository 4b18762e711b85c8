//! The bridge protocol's values as a bridge sees them: the message it sends, the answers
//! and events it gets back, and why a send failed.

use crate::wire::{ClientOp, MessageFields};

#[cfg(doc)]
use super::GatewayConfig;

/// A chat message for the gateway: the protocol's `message` fields. Its `platform` is the
/// client's own unless set.
pub(crate) type OutgoingMessage = MessageFields;

/// The `message` line sent for `message` (and sent again after a reconnect), on the platform
/// `platform` unless it names its own.
pub(super) fn message_line(message: &OutgoingMessage, platform: &str) -> String {
    let mut fields = message.clone();
    fields.platform.get_or_insert_with(|| platform.to_owned());
    ClientOp::Message(fields).line()
}

/// The gateway's answer to a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Admission {
    /// Accepted: its turn runs (`queued == false`) or waits behind `position` others.
    Accepted {
        /// The session key.
        session: String,
        /// Waiting behind others rather than running.
        queued: bool,
        /// Messages of the session ahead of it.
        position: usize,
    },
    /// Already accepted earlier (a repeat after a reconnect, or a restarted bridge): not run
    /// again; its result comes (or came) with the first copy.
    Duplicate {
        /// The session key.
        session: String,
    },
    /// Refused; nothing else follows for this id.
    Rejected {
        /// The session key, when one could be built.
        session: Option<String>,
        /// `queue_full`, `overloaded`, `backpressure`, `shutting_down`, `storage`, `invalid`.
        reason: String,
        /// The gateway's explanation.
        detail: String,
    },
}

/// How a message's turn ended (a terminal event).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum TerminalOutcome {
    /// The agent's reply, or a command's answer.
    Reply {
        /// The whole text.
        text: String,
        /// The reply was cut at the gateway's `--max-reply-bytes`.
        truncated: bool,
        /// Files the agent attached, in the gateway's spool: a bridge that can uploads
        /// them before it confirms the reply; the others show [`omitted`] lines.
        files: Vec<crate::Attachment>,
    },
    /// Cancelled: `stopped`, `reset`, `interrupted` or `shutdown`.
    Cancelled {
        /// Why.
        reason: String,
    },
    /// Failed: `agent error: …`, `timeout`, `interrupted by restart`, …
    Failed {
        /// What failed.
        error: String,
    },
    /// The text ran in another message's turn (merge mode); that one carries the reply.
    Merged {
        /// The carrier message's id.
        into: String,
    },
    /// The gateway's access policy ignored it (a group message not addressed to the bot, a
    /// refused user's repeat): nothing to show.
    Ignored,
}

impl TerminalOutcome {
    /// What a chat shows for this outcome; `None` for a merge (the carrier's reply says it).
    /// A reply's files are named in [`omitted`] lines: what a bridge that cannot upload them
    /// shows (IRC, Discord, Slack).
    pub(crate) fn chat_text(&self) -> Option<String> {
        let mut text = self.text_without_files()?;
        if let TerminalOutcome::Reply { files, .. } = self {
            for line in files.iter().map(omitted) {
                if !text.is_empty() {
                    text.push('\n');
                }
                text.push_str(&line);
            }
        }
        Some(text)
    }

    /// The files a reply carries (none for any other outcome).
    pub(crate) fn files(&self) -> &[crate::Attachment] {
        match self {
            TerminalOutcome::Reply { files, .. } => files,
            _ => &[],
        }
    }

    /// [`TerminalOutcome::chat_text`] without the files' lines: for a bridge that uploads
    /// them.
    pub(crate) fn text_without_files(&self) -> Option<String> {
        match self {
            TerminalOutcome::Reply {
                text,
                truncated: true,
                ..
            } => Some(format!("{text}\n[reply truncated by the gateway]")),
            TerminalOutcome::Reply { text, .. } => Some(text.clone()),
            TerminalOutcome::Cancelled { reason } => Some(format!("[cancelled: {reason}]")),
            TerminalOutcome::Failed { error } => Some(format!("[failed: {error}]")),
            TerminalOutcome::Merged { .. } | TerminalOutcome::Ignored => None,
        }
    }
}

/// The line a chat shows for a file it is not sent: `(file omitted: NAME, SIZE)`.
pub(crate) fn omitted(file: &crate::Attachment) -> String {
    format!(
        "(file omitted: {}, {})",
        file.name,
        crate::attachments::human_size(file.size)
    )
}

/// A terminal event: the one result of an accepted message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TerminalEvent {
    /// The message id.
    pub id: String,
    /// The session key (`platform:chat_type:chat_id[…]`; parse it with
    /// [`SessionKey`](crate::SessionKey)'s `FromStr` to find the chat after a restart).
    pub session: String,
    /// How it ended.
    pub outcome: TerminalOutcome,
    /// The gateway may have sent it before (see the protocol's Delivery section). Ids the
    /// client remembers as handled never reach the bridge; this one it does not remember.
    pub redelivery: bool,
}

/// What the gateway client reports to its bridge.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum GatewayEvent {
    /// A hello was confirmed (the gateway answered the ping after it): messages flow.
    Connected,
    /// The connection ended; the client reconnects by itself.
    Disconnected {
        /// What happened (no secret in it).
        reason: String,
    },
    /// The answer to a message.
    Admission {
        /// The message id.
        id: String,
        /// Accepted, duplicate or rejected.
        admission: Admission,
    },
    /// A turn started (`on`), is still running, or ended (`!on`).
    Typing {
        /// The session key.
        session: String,
        /// The chat.
        chat_id: String,
        /// On or off.
        on: bool,
    },
    /// The reply so far of a running turn (cumulative; best effort).
    Partial {
        /// The message id.
        id: String,
        /// The session key.
        session: String,
        /// The text so far.
        text: String,
    },
    /// A terminal event not handled before: show it, then call [`Gateway::delivered`].
    Result(TerminalEvent),
    /// The gateway could not act on a line, or refused the connection (`unauthorized`, …).
    Error {
        /// The gateway's detail.
        detail: String,
    },
}

/// Why a message could not be handed to the client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum SendError {
    /// [`GatewayConfig::max_pending`] messages already wait for their answer.
    TooManyPending(usize),
    /// [`Gateway::send_and_wait`] got no answer in time (the message stays pending and is
    /// sent again after a reconnect; sending it again with the same id is safe).
    TimedOut,
    /// The message's line would be longer than [`GatewayConfig::max_line_bytes`]: the
    /// gateway would discard it. Sending it again cannot help.
    TooLong {
        /// The line's length.
        bytes: usize,
        /// The limit.
        limit: usize,
    },
    /// The client was shut down.
    Closed,
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SendError::TooManyPending(n) => {
                write!(f, "{n} messages already wait for the gateway's answer")
            }
            SendError::TimedOut => write!(f, "no answer from the gateway in time"),
            SendError::TooLong { bytes, limit } => write!(
                f,
                "the message is too long for the gateway ({bytes} bytes as a protocol line, the limit is {limit})"
            ),
            SendError::Closed => write!(f, "the gateway client was shut down"),
        }
    }
}

impl std::error::Error for SendError {}
