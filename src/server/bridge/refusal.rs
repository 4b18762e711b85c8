//! Refusals: why a message is not admitted, with the wording of every `reject` line (and of
//! a duplicate's ack). A leaf: every room that refuses (admission, the platforms' bounds, the
//! journal's room, the runtime, the cluster) builds its answer here, and this module uses
//! none of them.

use crate::core::RejectReason;
use crate::message::{InvalidInput, SessionKey};
use crate::wire::{ServerOp, encode};

/// Why a message is not admitted: the `reject` line's reason and detail (the wording of every
/// refusal is here).
#[derive(Debug)]
pub(super) struct Refusal {
    pub(super) reason: &'static str,
    pub(super) detail: String,
    /// The message's session, once it is known.
    pub(super) session: Option<SessionKey>,
}

impl From<InvalidInput> for Refusal {
    fn from(e: InvalidInput) -> Refusal {
        Refusal::invalid(e.to_string())
    }
}

impl Refusal {
    fn new(reason: &'static str, detail: String) -> Refusal {
        Refusal {
            reason,
            detail,
            session: None,
        }
    }

    /// The line's fields are not a valid message.
    pub(super) fn invalid(detail: String) -> Refusal {
        Refusal::new("invalid", detail)
    }

    /// The same refusal, naming the message's session.
    pub(super) fn with_session(mut self, key: &SessionKey) -> Refusal {
        self.session = Some(key.clone());
        self
    }

    /// The `reject` line answering the message `id` with this refusal.
    pub(super) fn reject_line(&self, id: &str) -> Vec<u8> {
        reject_line(id, self.session.as_ref(), self.reason, &self.detail)
    }

    pub(super) fn no_platform() -> Refusal {
        Refusal::invalid("platform is required (no hello named one)".into())
    }

    pub(super) fn not_its_platform(hello: Option<&str>) -> Refusal {
        Refusal::invalid(match hello {
            Some(h) => {
                format!("this connection said hello for {h}; it may only send messages for {h}")
            }
            None => "this connection's hello named no platform; it may send no message".into(),
        })
    }

    pub(super) fn platforms_full(max: usize, name: &str) -> Refusal {
        let detail = format!("{max} platforms are active (--max-platforms); no room for {name}");
        Refusal::new("overloaded", detail)
    }

    pub(super) fn dedup_full(platform: &str, max: usize) -> Refusal {
        let detail = format!(
            "the duplicate window of {platform} holds {max} ids (--dedup-max); retry later"
        );
        Refusal::new("backpressure", detail)
    }

    pub(super) fn outbox_cap(platform: &str, owed: usize, cap: usize) -> Refusal {
        let detail = format!(
            "outbox of {platform} is full: {owed} results owed (--outbox-cap {cap}); deliver them first"
        );
        Refusal::new("backpressure", detail)
    }

    pub(super) fn outbox_bytes(
        platform: &str,
        bytes: usize,
        held: usize,
        cap: usize,
        largest: usize,
    ) -> Refusal {
        let detail = format!(
            "outbox of {platform} is full: {bytes} bytes held for owed results, {held} more waiting for room, and {largest} bytes kept free so the largest result always fits (--outbox-bytes {cap}, --max-reply-bytes); deliver them first"
        );
        Refusal::new("backpressure", detail)
    }

    pub(super) fn journal_full(max: usize) -> Refusal {
        let detail = format!(
            "{max} messages are waiting for the journal (--max-pending-durable); retry later"
        );
        Refusal::new("overloaded", detail)
    }

    /// The runtime refused it.
    pub(super) fn runtime(reason: RejectReason) -> Refusal {
        Refusal::new(reason.as_str(), reason.detail().into())
    }

    /// The journal could not write it.
    pub(super) fn storage(error: Option<&str>) -> Refusal {
        let detail = match error {
            Some(e) => format!("the message could not be made durable: {e}"),
            None => "the message could not be made durable".to_string(),
        };
        Refusal::new("storage", detail)
    }

    /// The failure of a recovered message that is refused this time.
    pub(super) fn after_restart(&self) -> String {
        not_readmitted(&self.detail)
    }
}

/// The failure of a recovered message (acknowledged before the restart) refused this time.
pub(super) fn not_readmitted(why: &str) -> String {
    format!("not admitted again after a restart: {why}")
}

/// The `reject` line of message `id` (of `session`, once known): the one wording of a refusal's
/// line.
pub(super) fn reject_line(
    id: &str,
    session: Option<&SessionKey>,
    reason: &str,
    detail: &str,
) -> Vec<u8> {
    encode(&ServerOp::Reject {
        id,
        session: session.map(SessionKey::as_str),
        reason,
        detail,
    })
}

/// The ack of a line whose id is a duplicate.
pub(super) fn duplicate_ack(id: &str, session: &SessionKey) -> Vec<u8> {
    encode(&ServerOp::Ack {
        id,
        session: session.as_str(),
        state: "duplicate",
        position: None,
    })
}
