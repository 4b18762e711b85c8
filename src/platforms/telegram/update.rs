//! Telegram updates as gateway messages, and back: which message a gateway id answers, which
//! chat a session key names.

use std::str::FromStr;

use serde::Deserialize;
use serde_json::json;

use crate::message::{ChatType, SessionKey};
use crate::platforms::gateway::OutgoingMessage;
use crate::platforms::lenient::{Capped, Lenient};
use crate::platforms::map_command;

/// The most updates kept of one `getUpdates` answer: the Bot API's own maximum `limit` (and
/// its default), so only a broken or hostile server ever sends more.
pub(crate) const MAX_UPDATES: usize = 100;

/// A `getUpdates` result: at most [`MAX_UPDATES`] updates, malformed and surplus ones
/// counted.
pub(crate) type Updates = Capped<Update, MAX_UPDATES>;

/// One update, with what the bridge reads of it (the rest of the update is skipped unread).
#[derive(Debug, Deserialize)]
pub(crate) struct Update {
    /// Its id: the offset moves past it.
    pub update_id: i64,
    #[serde(default)]
    pub(super) message: Lenient<Message>,
}

#[derive(Debug, Deserialize)]
pub(super) struct Message {
    message_id: i64,
    #[serde(default)]
    text: Lenient<String>,
    /// The text of a photo or document message.
    #[serde(default)]
    caption: Lenient<String>,
    #[serde(default)]
    pub(super) photo: Lenient<Vec<super::files::PhotoSize>>,
    #[serde(default)]
    pub(super) document: Lenient<super::files::Document>,
    chat: Chat,
    #[serde(default)]
    from: Lenient<User>,
    #[serde(default)]
    reply_to_message: Lenient<Replied>,
    /// The forum topic (with `is_topic_message`); outside forums a reply chain's id.
    #[serde(default)]
    message_thread_id: Lenient<i64>,
    #[serde(default)]
    is_topic_message: Lenient<bool>,
}

#[derive(Debug, Deserialize)]
struct Chat {
    id: i64,
    #[serde(rename = "type")]
    kind: String,
}

#[derive(Debug, Deserialize)]
struct User {
    #[serde(default)]
    id: Lenient<i64>,
    #[serde(default)]
    is_bot: Lenient<bool>,
    #[serde(default)]
    first_name: Lenient<String>,
    #[serde(default)]
    last_name: Lenient<String>,
    #[serde(default)]
    username: Lenient<String>,
}

#[derive(Debug, Deserialize)]
struct Replied {
    message_id: i64,
    #[serde(default)]
    from: Lenient<User>,
}

/// The gateway message for one update, or `None` for an update the bridge does not handle
/// (not a text message, a channel post, from a bot). A leading `/cmd@this_bot` loses its
/// `@this_bot`, and `!stop`-style commands map to `/stop`.
pub(crate) fn update_to_message(update: &Update, bot_username: &str) -> Option<OutgoingMessage> {
    let update_id = update.update_id;
    let m = update.message.get()?;
    // A photo or document may come without a caption: its text is then empty.
    let has_file = m.photo.get().is_some_and(|p| !p.is_empty()) || m.document.get().is_some();
    let text = m
        .text
        .text()
        .or(m.caption.text())
        .or(has_file.then_some(""))?;
    let message_id = m.message_id;
    let chat_type = match m.chat.kind.as_str() {
        "private" => ChatType::Dm,
        "group" | "supergroup" => ChatType::Group,
        _ => return None,
    };
    let from = m.from.get();
    if from.and_then(|f| f.is_bot.get().copied()).unwrap_or(false) {
        return None;
    }
    let user_id = from.and_then(|f| f.id.get()).map(i64::to_string);
    let user_name = from.and_then(user_name);
    if chat_type == ChatType::Group && user_id.is_none() {
        // An anonymous group admin: no user to key the session on.
        return None;
    }
    let to_bot = chat_type == ChatType::Group && addresses_bot(m, text, bot_username);
    let text = map_command(&without_mention(text, bot_username)).into_owned();
    let mut message = OutgoingMessage::new(
        &format!("tg-{update_id}-{message_id}"),
        &m.chat.id.to_string(),
        &text,
    );
    message.chat_type = chat_type;
    message.user_id = user_id;
    message.user_name = user_name;
    let mut meta = json!({"message_id": message_id});
    if let Some(topic) =
        super::topics::topic_of(m.is_topic_message.get(), m.message_thread_id.get())
    {
        // A forum topic is a conversation of its own: its session key holds the topic.
        message.thread_id = Some(topic.to_string());
        meta["message_thread_id"] = json!(topic);
    }
    if let Some(r) = m.reply_to_message.get() {
        meta["reply_to"] = json!(r.message_id);
    }
    if let Some(u) = from.and_then(|f| f.username.text()) {
        meta["username"] = json!(u);
    }
    if to_bot {
        meta[crate::access::ADDRESSED_KEY] = json!(true);
    }
    message.meta = Some(meta.to_string());
    Some(message)
}

/// Whether a group message is for the bot: it names `@bot_username` (a mention, or a
/// `/command@bot_username`), or it replies to the bot's message.
fn addresses_bot(m: &Message, text: &str, bot_username: &str) -> bool {
    if bot_username.is_empty() {
        return false;
    }
    let replied_to_bot = m
        .reply_to_message
        .get()
        .and_then(|r| r.from.get())
        .and_then(|u| u.username.text())
        .is_some_and(|u| u.eq_ignore_ascii_case(bot_username));
    let lower = text.to_ascii_lowercase();
    let handle = format!("@{}", bot_username.to_ascii_lowercase());
    let named = lower.match_indices(&handle).any(|(at, h)| {
        let next = lower[at + h.len()..].chars().next();
        !next.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
    });
    replied_to_bot || named
}

/// The Telegram message a gateway id (`tg-<update_id>-<message_id>`) answers.
pub(crate) fn reply_target(id: &str) -> Option<i64> {
    let rest = id.strip_prefix("tg-")?;
    let (_, message_id) = rest.split_once('-')?;
    message_id.parse().ok()
}

/// The Telegram chat of a session key (`telegram:dm:42`, `telegram:group:-100:user:7`).
pub(crate) fn chat_of(session: &str) -> Option<String> {
    SessionKey::from_str(session)
        .ok()
        .map(|k| k.chat_id().to_owned())
}

/// The sender's display name: first and last name, else the username; cut to what the
/// protocol allows (1 to 256 bytes without control characters).
fn user_name(from: &User) -> Option<String> {
    let first = from.first_name.text().unwrap_or("");
    let last = from.last_name.text().unwrap_or("");
    let name = format!("{first} {last}").trim().to_owned();
    let name = if name.is_empty() {
        from.username.text()?.to_owned()
    } else {
        name
    };
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

/// `/stop@this_bot` (how Telegram clients send a command in a group) → `/stop`; any other
/// text as it is.
fn without_mention(text: &str, bot_username: &str) -> String {
    let mut text = text.to_owned();
    if text.starts_with('/') && !bot_username.is_empty() {
        let end = text.find(char::is_whitespace).unwrap_or(text.len());
        if let Some(at) = text[..end].find('@')
            && text[at + 1..end].eq_ignore_ascii_case(bot_username)
        {
            text.replace_range(at..end, "");
        }
    }
    text
}
