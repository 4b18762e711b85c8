//! Forum topics (supergroups with topics on) as sessions of their own.
//!
//! In: a message with `is_topic_message` carries its topic's `message_thread_id`, which
//! becomes the gateway message's `thread_id` (so the session key holds it, and `/new` in a
//! topic resets only it). Outside forums Telegram also sets `message_thread_id` on a reply
//! chain; without `is_topic_message` it is not a topic and is ignored.
//!
//! Out: every message a reply posts and its typing (`sendChatAction`) carry the topic's
//! `message_thread_id`, read back from the session key; `editMessageText` needs none (a
//! message stays where it was posted). A message in the General topic has no topic id and
//! is answered in General.

use std::str::FromStr;

use serde_json::{Value, json};

use crate::message::SessionKey;

/// The topic of a message: its `message_thread_id` when it is a topic message.
pub(super) fn topic_of(is_topic_message: Option<&bool>, thread: Option<&i64>) -> Option<i64> {
    thread.copied().filter(|_| is_topic_message == Some(&true))
}

/// The topic a session key names (`telegram:group:-100:thread:5:user:7` → 5).
pub(super) fn topic_of_session(session: &str) -> Option<i64> {
    SessionKey::from_str(session)
        .ok()?
        .thread_id()
        .and_then(|t| t.parse().ok())
}

/// Puts a `sendMessage` or `sendChatAction` call into `topic`, if there is one.
pub(super) fn in_topic(params: &mut Value, topic: Option<i64>) {
    if let Some(t) = topic {
        params["message_thread_id"] = json!(t);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::platforms::telegram::update::{Update, update_to_message};

    fn update(extra: Value) -> Update {
        let mut m = json!({"message_id": 9, "text": "hi @bot", "chat": {"id": -100, "type": "supergroup"},
            "from": {"id": 7, "is_bot": false, "first_name": "Ann"}});
        for (k, v) in extra.as_object().into_iter().flatten() {
            m[k] = v.clone();
        }
        // Read from text, as the poller reads answers (lenient fields borrow raw JSON).
        serde_json::from_str(&json!({"update_id": 1, "message": m}).to_string()).expect("update")
    }

    /// Issue 35 row 3: a topic message's session holds the topic; a reply chain's
    /// `message_thread_id` outside a forum does not make a topic.
    #[test]
    fn a_topic_message_carries_its_topic_and_a_reply_chain_does_not() {
        let m = update_to_message(
            &update(json!({"message_thread_id": 5, "is_topic_message": true})),
            "bot",
        )
        .expect("a message");
        assert_eq!(m.thread_id.as_deref(), Some("5"));
        let key = SessionKey::new(
            "telegram",
            m.chat_type,
            &m.chat_id,
            m.thread_id.as_deref(),
            m.user_id.as_deref(),
        )
        .expect("key");
        assert_eq!(key.as_str(), "telegram:group:-100:thread:5:user:7");
        assert_eq!(topic_of_session(key.as_str()), Some(5));
        let chain = update_to_message(&update(json!({"message_thread_id": 5})), "bot").expect("m");
        assert_eq!(chain.thread_id, None);
        assert_eq!(topic_of_session("telegram:group:-100:user:7"), None);
        let mut p = json!({"chat_id": -100});
        in_topic(&mut p, Some(5));
        assert_eq!(p["message_thread_id"], 5);
    }
}
