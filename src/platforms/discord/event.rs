//! Discord messages as gateway messages, and back: which message a gateway id answers.

use serde_json::{Value, json};

use crate::message::ChatType;
use crate::platforms::gateway::OutgoingMessage;
use crate::platforms::map_command;

/// The gateway message for a `MESSAGE_CREATE`, or `None` for one the bridge does not answer:
/// from a bot (itself included) or a webhook, not a plain message or reply, empty, or in a
/// guild channel without mentioning the bot (or replying to it). A DM is `dm`; a guild
/// channel (a thread is a channel of its own) is `group`, keyed per sender. The mention is
/// taken out of the text and `!stop`-style commands map to `/stop`.
pub(crate) fn message_create(d: &Value, me: &str) -> Option<OutgoingMessage> {
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
    let mut message = OutgoingMessage::new(&format!("dc-{id}"), channel_id, &map_command(&text));
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

    #[test]
    fn a_dm_is_answered_and_a_guild_message_only_when_it_mentions_the_bot() {
        let dm = message_create(&create("hi", false, &[]), "1").expect("dm");
        assert_eq!(dm.chat_type, ChatType::Dm);
        assert_eq!(dm.id, "dc-500");
        assert_eq!(dm.text, "hi");
        assert!(message_create(&create("hi", true, &[]), "1").is_none());
        let g = message_create(&create("<@1> !stop", true, &["1"]), "1").expect("guild");
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
        assert!(message_create(&bot, "1").is_none());
        assert!(message_create(&create("hi", false, &[]), "7").is_none());
        let mut join = create("hi", false, &[]);
        join["type"] = json!(7);
        assert!(message_create(&join, "1").is_none());
        assert!(message_create(&create("<@1>", true, &["1"]), "1").is_none());
    }

    #[test]
    fn the_reply_target_is_the_message_id() {
        assert_eq!(reply_target("dc-123"), Some("123"));
        assert_eq!(reply_target("tg-1-2"), None);
        assert_eq!(reply_target("dc-../x"), None);
    }
}
