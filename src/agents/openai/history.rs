//! A session's conversation, bounded in exchanges and characters, and the user content sent
//! for a message.

use std::collections::VecDeque;

use crate::message::MessageContext;

/// A session's conversation: past exchanges, oldest first, with their character counts.
#[derive(Debug, Default)]
pub(super) struct History {
    turns: VecDeque<Exchange>,
    chars: usize,
}

/// One completed turn: what the user said, what the model answered.
#[derive(Debug)]
pub(super) struct Exchange {
    pub(super) user: String,
    pub(super) assistant: String,
    /// Characters of both.
    chars: usize,
}

impl History {
    /// Adds a completed exchange, then drops the oldest past either bound.
    pub(super) fn push(
        &mut self,
        user: String,
        assistant: String,
        max_turns: usize,
        max_chars: usize,
    ) {
        let chars = user.chars().count() + assistant.chars().count();
        self.turns.push_back(Exchange {
            user,
            assistant,
            chars,
        });
        self.chars += chars;
        while self.turns.len() > max_turns || (self.chars > max_chars && !self.turns.is_empty()) {
            if let Some(old) = self.turns.pop_front() {
                self.chars -= old.chars;
            }
        }
        debug_assert!(self.check(max_turns, max_chars), "{self:?}");
    }

    /// A history holding `exchanges` (a stored conversation, oldest first), within the
    /// bounds in force now (they may have shrunk since it was stored).
    pub(super) fn restored(
        exchanges: Vec<(String, String)>,
        max_turns: usize,
        max_chars: usize,
    ) -> History {
        let mut h = History::default();
        for (user, assistant) in exchanges {
            h.push(user, assistant, max_turns, max_chars);
        }
        h
    }

    /// The exchanges kept, (user, assistant) oldest first: what the journal stores.
    pub(super) fn exchanges(&self) -> Vec<(String, String)> {
        self.turns
            .iter()
            .map(|e| (e.user.clone(), e.assistant.clone()))
            .collect()
    }

    /// The exchanges kept.
    pub(super) fn len(&self) -> usize {
        self.turns.len()
    }

    /// The invariants: `chars` is the sum of the exchanges' characters, each exchange counts
    /// its own, and the history is within both bounds.
    fn check(&self, max_turns: usize, max_chars: usize) -> bool {
        let counted = self
            .turns
            .iter()
            .all(|e| e.chars == e.user.chars().count() + e.assistant.chars().count());
        let total: usize = self.turns.iter().map(|e| e.chars).sum();
        counted && total == self.chars && self.turns.len() <= max_turns && self.chars <= max_chars
    }

    /// The newest exchanges whose characters fit in `budget`, oldest first.
    pub(super) fn fitting(&self, budget: usize) -> impl Iterator<Item = &Exchange> {
        let mut used = 0;
        let kept = self
            .turns
            .iter()
            .rev()
            .take_while(|e| {
                used += e.chars;
                used <= budget
            })
            .count();
        self.turns.iter().skip(self.turns.len() - kept)
    }
}

/// The user content sent for a message.
///
/// Without `sender_prefix` it is the text unchanged. With it, a first line names the
/// sender and carries the bridge's meta, then the text follows on the next line:
///
/// ```text
/// [from: Alice (id u42); meta: {"reply_to":"m7"}]
/// what about tomorrow?
/// ```
///
/// Parts that are absent are left out (`[from: id u42]`, `[meta: {…}]`); with no sender
/// and no meta the text is unchanged.
pub(super) fn user_content(text: &str, ctx: &MessageContext, sender_prefix: bool) -> String {
    if !sender_prefix {
        return text.to_owned();
    }
    let from = match (ctx.user_name.as_deref(), ctx.user_id.as_deref()) {
        (Some(name), Some(id)) => Some(format!("from: {name} (id {id})")),
        (Some(name), None) => Some(format!("from: {name}")),
        (None, Some(id)) => Some(format!("from: id {id}")),
        (None, None) => None,
    };
    let meta = ctx.meta.as_deref().map(|m| format!("meta: {m}"));
    let parts: Vec<String> = from.into_iter().chain(meta).collect();
    if parts.is_empty() {
        text.to_owned()
    } else {
        format!("[{}]\n{text}", parts.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_holds_after_each_push_and_catches_a_miscount() {
        let mut h = History::default();
        for i in 0..10 {
            h.push(format!("user {i}"), "é".repeat(i), 4, 40);
            assert!(h.check(4, 40), "{h:?}");
        }
        h.chars += 1;
        assert!(!h.check(4, 40));
        h.chars -= 1;
        assert!(!h.check(1, 40), "more exchanges than the bound");
    }

    #[test]
    fn history_keeps_the_newest_exchanges_within_both_bounds() {
        let mut h = History::default();
        for i in 0..5 {
            h.push(format!("u{i}"), format!("a{i}"), 3, 1000);
        }
        let users: Vec<&str> = h.turns.iter().map(|e| e.user.as_str()).collect();
        assert_eq!(users, ["u2", "u3", "u4"]);
        assert_eq!(h.chars, 12);
        // 4 characters an exchange: a budget of 9 keeps two.
        let fit: Vec<&str> = h.fitting(9).map(|e| e.user.as_str()).collect();
        assert_eq!(fit, ["u3", "u4"]);
        assert_eq!(h.fitting(3).count(), 0);
        assert_eq!(h.fitting(12).count(), 3);
        // The stored history obeys the character budget too.
        h.push("x".repeat(10), "y".repeat(10), 3, 22);
        assert_eq!(h.turns.len(), 1);
        assert_eq!(h.chars, 20);
        h.push("big".repeat(20), String::new(), 3, 22);
        assert!(h.turns.is_empty() && h.chars == 0);
        // Exactly at the budget is within it.
        let mut h = History::default();
        h.push("ab".into(), "cd".into(), 3, 8);
        h.push("ef".into(), "gh".into(), 3, 8);
        assert_eq!((h.turns.len(), h.chars), (2, 8));
    }

    #[test]
    fn sender_prefix_follows_the_documented_rule() {
        let ctx = MessageContext {
            user_id: Some("u42".into()),
            user_name: Some("Alice".into()),
            meta: Some(r#"{"reply_to":"m7"}"#.into()),
            ..MessageContext::default()
        };
        assert_eq!(user_content("hi", &ctx, false), "hi");
        assert_eq!(
            user_content("hi", &ctx, true),
            "[from: Alice (id u42); meta: {\"reply_to\":\"m7\"}]\nhi"
        );
        let id_only = MessageContext {
            user_id: Some("u42".into()),
            ..MessageContext::default()
        };
        assert_eq!(user_content("hi", &id_only, true), "[from: id u42]\nhi");
        let name_only = MessageContext {
            user_name: Some("Al".into()),
            ..MessageContext::default()
        };
        assert_eq!(user_content("hi", &name_only, true), "[from: Al]\nhi");
        let meta_only = MessageContext {
            meta: Some("{}".into()),
            ..MessageContext::default()
        };
        assert_eq!(user_content("hi", &meta_only, true), "[meta: {}]\nhi");
        assert_eq!(user_content("hi", &MessageContext::default(), true), "hi");
    }
}
