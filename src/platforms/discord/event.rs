//! Discord messages as gateway messages, and back: which message a gateway id answers.

use std::str::FromStr;

use serde_json::{Value, json};

use super::threads::Threads;
use crate::message::{ChatType, SessionKey};
use crate::platforms::gateway::OutgoingMessage;
use crate::platforms::map_command;

/// The gateway message for a `MESSAGE_CREATE`, or `None` for one the bridge does not answer:
/// from a bot (itself included) or a webhook, not a plain message or reply, empty, or in a
/// guild channel without mentioning the bot (or replying to it). A DM is `dm`; a guild
/// channel is `group`, keyed per sender; in a thread (a channel of its own, known from
/// `threads`) the chat is the thread's channel and the thread its `thread_id`. The mention is
/// taken out of the text and `!stop`-style commands map to `/stop`.
pub(crate) fn message_create(d: &Value, me: &str, threads: &Threads) -> Option<OutgoingMessage> {
    let id = d.get("id")?.as_str()?;
    let channel_id = d.get("channel_id")?.as_str()?;
    let author = d.get("author")?;
    let author_id = author.get("id")?.as_str()?;
    if author.get("bot").and_then(Value::as_bool) == Some(true)
        || author_id == me
        || d.get("webhook_id").is_some_and(|w| !w.is_null())
    {
        return None;
    }
    // 0: a message, 19: a reply; joins, pins, calls and the like are not for the agent.
    if !matches!(d.get("type").and_then(Value::as_u64).unwrap_or(0), 0 | 19) {
        return None;
    }
    let content = d.get("content")?.as_str()?;
    let guild_id = d.get("guild_id").and_then(Value::as_str);
    let mentioned = d
        .get("mentions")
        .and_then(Value::as_array)
        .is_some_and(|m| {
            m.iter()
                .any(|u| u.get("id").and_then(Value::as_str) == Some(me))
        })
        || d.pointer("/referenced_message/author/id")
            .and_then(Value::as_str)
            == Some(me);
    if guild_id.is_some() && !mentioned {
        return None;
    }
    let text = without_mention(content, me);
    if text.trim().is_empty() {
        return None;
    }
    let (chat_id, thread_id) = match threads.parent(channel_id) {
        Some(parent) => (parent, Some(channel_id)),
        None => (channel_id, None),
    };
    let mut message = OutgoingMessage::new(&format!("dc-{id}"), chat_id, &map_command(&text));
    message.thread_id = thread_id.map(str::to_owned);
    message.chat_type = if guild_id.is_some() {
        ChatType::Group
    } else {
        ChatType::Dm
    };
    message.user_id = Some(author_id.to_owned());
    message.user_name = author
        .get("global_name")
        .and_then(Value::as_str)
        .or_else(|| author.get("username").and_then(Value::as_str))
        .and_then(display_name);
    let mut meta = json!({"message_id": id, "mentioned": mentioned});
    if let Some(g) = guild_id {
        meta["guild_id"] = json!(g);
        // Every guild message let through names or answers the bot: mark it for the
        // gateway's mention-only groups (docs/access.md).
        meta[crate::access::ADDRESSED_KEY] = json!(true);
    }
    message.meta = Some(meta.to_string());
    Some(message)
}

/// Where a message's replies go: its thread (a channel of its own), else its channel.
pub(crate) fn reply_channel(message: &OutgoingMessage) -> &str {
    message.thread_id.as_deref().unwrap_or(&message.chat_id)
}

/// Where a session's replies go (the renderer's channel): its thread, else its chat.
pub(crate) fn session_channel(session: &str) -> Option<String> {
    let key = SessionKey::from_str(session).ok()?;
    Some(key.thread_id().unwrap_or(key.chat_id()).to_owned())
}

/// The Discord message a gateway id (`dc-<message id>`) answers.
pub(crate) fn reply_target(id: &str) -> Option<&str> {
    id.strip_prefix("dc-")
        .filter(|m| !m.is_empty() && m.bytes().all(|b| b.is_ascii_digit()))
}

/// `<@me> text` or `<@!me> text` → `text` (the mention anywhere, every time).
fn without_mention(text: &str, me: &str) -> String {
    text.replace(&format!("<@{me}>"), "")
        .replace(&format!("<@!{me}>"), "")
        .trim()
        .to_owned()
}

/// A name the protocol takes: no control or bidi characters, 1 to 256 bytes.
fn display_name(name: &str) -> Option<String> {
    let name: String = name
        .chars()
        .filter(|&c| crate::platforms::name_char(c))
        .collect();
    let mut end = name.len().min(256);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    (end > 0).then(|| name[..end].to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn create(content: &str, guild: bool, mentions: &[&str]) -> Value {
        let mut d = json!({"id": "500", "channel_id": "42", "type": 0, "content": content,
            "author": {"id": "7", "username": "ann"},
            "mentions": mentions.iter().map(|m| json!({"id": m})).collect::<Vec<_>>()});
        if guild {
            d["guild_id"] = json!("9");
        }
        d
    }

    fn message_create_plain(d: &Value, me: &str) -> Option<OutgoingMessage> {
        message_create(d, me, &Threads::default())
    }

    #[test]
    fn a_message_in_a_thread_is_in_the_threads_session_and_answered_there() {
        let mut threads = Threads::default();
        threads.dispatch(
            "THREAD_CREATE",
            &json!({"id": "88", "parent_id": "42", "type": 11, "guild_id": "9"}),
        );
        let mut d = create("<@1> hi", true, &["1"]);
        d["channel_id"] = json!("88");
        let m = message_create(&d, "1", &threads).expect("thread message");
        assert_eq!(
            (m.chat_id.as_str(), m.thread_id.as_deref()),
            ("42", Some("88"))
        );
        assert_eq!(reply_channel(&m), "88");
        let key = "discord:group:42:thread:88:user:7";
        assert_eq!(session_channel(key).as_deref(), Some("88"));
        assert_eq!(session_channel("discord:dm:42").as_deref(), Some("42"));
        let plain = message_create(&create("<@1> hi", true, &["1"]), "1", &threads).expect("m");
        assert_eq!((plain.chat_id.as_str(), plain.thread_id), ("42", None));
    }

    #[test]
    fn a_dm_is_answered_and_a_guild_message_only_when_it_mentions_the_bot() {
        let dm = message_create_plain(&create("hi", false, &[]), "1").expect("dm");
        assert_eq!(dm.chat_type, ChatType::Dm);
        assert_eq!(dm.id, "dc-500");
        assert_eq!(dm.text, "hi");
        assert!(message_create_plain(&create("hi", true, &[]), "1").is_none());
        let g = message_create_plain(&create("<@1> !stop", true, &["1"]), "1").expect("guild");
        assert_eq!(g.chat_type, ChatType::Group);
        assert_eq!(g.text, "/stop");
        assert_eq!(g.user_id.as_deref(), Some("7"));
        assert!(
            g.meta
                .as_deref()
                .is_some_and(|m| m.contains("\"mentioned\":true"))
        );
    }

    #[test]
    fn bots_itself_and_system_messages_are_not_answered() {
        let mut bot = create("hi", false, &[]);
        bot["author"]["bot"] = json!(true);
        assert!(message_create_plain(&bot, "1").is_none());
        assert!(message_create_plain(&create("hi", false, &[]), "7").is_none());
        let mut join = create("hi", false, &[]);
        join["type"] = json!(7);
        assert!(message_create_plain(&join, "1").is_none());
        assert!(message_create_plain(&create("<@1>", true, &["1"]), "1").is_none());
    }

    #[test]
    fn the_reply_target_is_the_message_id() {
        assert_eq!(reply_target("dc-123"), Some("123"));
        assert_eq!(reply_target("tg-1-2"), None);
        assert_eq!(reply_target("dc-../x"), None);
    }
}
