//! A turn's reply: its text, its flags, and what travels with it (files, the conversation).

use std::fmt;

use crate::journal::MemoryUpdate;

/// Default cap on a reply's (and a partial's) length in bytes, 1 MiB: what
/// [`Reply::bounded`] is given unless a builder or an agent's options say otherwise.
pub const DEFAULT_MAX_REPLY_BYTES: usize = 1 << 20;

/// An agent's reply, or a command's result.
#[derive(Clone, Debug, Default)]
pub struct Reply {
    /// The text.
    pub text: String,
    /// The agent's text was longer than `max_reply_bytes` and was cut (on a UTF-8 boundary).
    pub truncated: bool,
    /// The tokens (prompt + completion) the agent reported for this turn
    /// ([`Agent::turn_usage`](crate::Agent::turn_usage)); `None` when it reports none.
    pub tokens: Option<u64>,
    /// What travels with it besides its text, if anything: boxed, as most replies carry
    /// nothing more and every event is the size of a reply.
    pub(crate) extras: Option<Box<ReplyExtras>>,
}

/// What a reply carries besides its text.
#[derive(Clone, Debug, Default)]
pub(crate) struct ReplyExtras {
    /// Files the agent attached ([`Reply::attachments`]).
    pub(crate) attachments: Vec<crate::Attachment>,
    /// What the reply changes in the session's durable conversation (the openai agent's
    /// history, `/new`'s clear), journaled with its outcome; not part of the reply's value.
    pub(crate) memory: Option<MemoryUpdate>,
}

impl Reply {
    /// `text` cut to at most `max` bytes on a character boundary, flagged when cut.
    pub fn bounded(mut text: String, max: usize) -> Reply {
        let truncated = crate::text::truncate(&mut text, max);
        Reply {
            text,
            truncated,
            tokens: None,
            extras: None,
        }
    }

    /// Files the agent attached ([`Agent::turn_attachments`](crate::Agent::turn_attachments)):
    /// in the gateway's spool, sent with the terminal `reply` (`attachments`,
    /// docs/protocol.md) and deleted once the reply is delivered.
    pub fn attachments(&self) -> &[crate::Attachment] {
        self.extras
            .as_ref()
            .map_or(&[], |e| e.attachments.as_slice())
    }

    /// The same reply, carrying `memory` to its outcome record (`None`: nothing, whatever
    /// it carried before).
    pub(crate) fn remembering(mut self, memory: Option<MemoryUpdate>) -> Reply {
        match (&mut self.extras, memory) {
            (Some(extras), memory) => extras.memory = memory,
            (None, Some(memory)) => self.extras.get_or_insert_default().memory = Some(memory),
            (None, None) => {}
        }
        self
    }

    /// The same reply, carrying the files its agent attached.
    pub(crate) fn attaching(mut self, files: Vec<crate::Attachment>) -> Reply {
        if !files.is_empty() {
            self.extras.get_or_insert_default().attachments = files;
        }
        self
    }

    /// What the reply changes in the durable conversation, taken (for its outcome record).
    pub(crate) fn take_memory(&mut self) -> Option<MemoryUpdate> {
        self.extras.as_mut()?.memory.take()
    }
}

/// Two replies are equal when their texts and flags are: what they change in the durable
/// conversation travels with them but is not what they say.
impl PartialEq for Reply {
    fn eq(&self, other: &Reply) -> bool {
        self.text == other.text
            && self.truncated == other.truncated
            && self.tokens == other.tokens
            && self.attachments() == other.attachments()
    }
}

impl Eq for Reply {}

impl From<String> for Reply {
    fn from(text: String) -> Reply {
        Reply {
            text,
            truncated: false,
            tokens: None,
            extras: None,
        }
    }
}

impl std::ops::Deref for Reply {
    type Target = str;
    fn deref(&self) -> &str {
        &self.text
    }
}

impl fmt::Display for Reply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl From<&str> for Reply {
    fn from(text: &str) -> Reply {
        Reply::from(text.to_owned())
    }
}
