//! "I have it": a message the gateway queued behind a running turn gets a 👀 reaction
//! (`setMessageReaction`), so the user sees the bot has it before its turn comes.
//!
//! The lowest-priority output: sent only when no notice, reply, edit or typing waits; one
//! per chat waits at most (a newer queued message of the chat replaces an older one not yet
//! marked: never more than one reaction per message, and a burst costs one call); at most
//! [`MAX_CHATS`] chats wait (past it a mark is not kept). A failed mark is never retried
//! (a 429 still pauses every call, as any other).

use std::collections::VecDeque;

use serde_json::{Value, json};

use super::api::chat_param;

/// Chats with a mark waiting at most.
pub(crate) const MAX_CHATS: usize = 1000;
/// The reaction: one of the emoji a bot may set.
pub(crate) const EMOJI: &str = "👀";

/// Marks waiting: per chat, the newest queued message not marked yet.
#[derive(Debug, Default)]
pub(crate) struct Received {
    waiting: VecDeque<(String, i64)>,
}

impl Received {
    /// Message `message_id` of `chat_id` waits behind a running turn.
    pub(crate) fn queued(&mut self, chat_id: &str, message_id: i64) {
        if let Some(w) = self.waiting.iter_mut().find(|(c, _)| c == chat_id) {
            w.1 = w.1.max(message_id);
            return;
        }
        if self.waiting.len() >= MAX_CHATS {
            debug_redacted!(
                "telegram: {MAX_CHATS} chats wait for a mark; chat {chat_id} gets none"
            );
            return;
        }
        self.waiting.push_back((chat_id.to_owned(), message_id));
    }

    /// The next mark to send: its chat and the `setMessageReaction` parameters.
    pub(crate) fn next(&mut self) -> Option<(String, Value)> {
        let (chat_id, message_id) = self.waiting.pop_front()?;
        let params = json!({
            "chat_id": chat_param(&chat_id),
            "message_id": message_id,
            "reaction": [{"type": "emoji", "emoji": EMOJI}],
        });
        Some((chat_id, params))
    }

    /// Marks waiting.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.waiting.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 35 row 5: marks coalesce per chat (the newest message) and are bounded.
    #[test]
    fn marks_coalesce_per_chat_and_are_bounded() {
        let mut r = Received::default();
        r.queued("42", 10);
        r.queued("42", 11);
        r.queued("7", 3);
        assert_eq!(r.len(), 2);
        let (chat, p) = r.next().expect("a mark");
        assert_eq!((chat.as_str(), &p["message_id"]), ("42", &json!(11)));
        assert_eq!(p["reaction"][0]["emoji"], EMOJI);
        for c in 0..MAX_CHATS + 10 {
            r.queued(&format!("c{c}"), 1);
        }
        assert_eq!(r.len(), MAX_CHATS);
    }
}
