//! Slack events as gateway messages, and back: which thread a gateway id answers in.

use serde_json::{Value, json};

use crate::message::ChatType;
use crate::platforms::gateway::OutgoingMessage;
use crate::platforms::map_command;

/// The gateway message for an Events API event, or `None` for one the bridge does not
/// answer: a `message` in a DM (`channel_type` `im`) is `dm`; an `app_mention` in a channel
/// is `group`, keyed per sender, with the mention taken out. Bots (itself included), edits
/// and other subtypes are skipped. The id `sl-<channel>-<thread ts>-<ts>` names the thread
/// the reply goes in (the message's own ts when it starts one); a redelivered event has the
/// same id, so the gateway answers `duplicate`.
pub(crate) fn event_message(event: &Value, me: &str) -> Option<OutgoingMessage> {
    let kind = event.get("type")?.as_str()?;
    let dm = match kind {
        "message" if event.get("channel_type").and_then(Value::as_str) == Some("im") => true,
        "app_mention" => false,
        _ => return None,
    };
    if event.get("subtype").is_some_and(|s| !s.is_null())
        || event.get("bot_id").is_some_and(|b| !b.is_null())
    {
        return None;
    }
    let user = event.get("user")?.as_str()?;
    if user == me {
        return None;
    }
    let channel = event.get("channel")?.as_str()?;
    let ts = event.get("ts")?.as_str()?;
    let thread = event.get("thread_ts").and_then(Value::as_str).unwrap_or(ts);
    let text = event.get("text")?.as_str()?;
    let text = text.replace(&format!("<@{me}>"), "");
    let text = text.trim();
    if text.is_empty() {
        return None;
    }
    let mut message = OutgoingMessage::new(
        &format!("sl-{channel}-{thread}-{ts}"),
        channel,
        &map_command(text),
    );
    message.chat_type = if dm { ChatType::Dm } else { ChatType::Group };
    message.user_id = Some(user.to_owned());
    let mut meta = json!({"ts": ts, "mentioned": !dm});
    if !dm {
        // Outside a DM only `app_mention` events come: each is addressed to the bot.
        meta[crate::access::ADDRESSED_KEY] = json!(true);
    }
    // A message inside a thread is in the thread's session; a top-level one in the channel's.
    if event.get("thread_ts").is_some() {
        meta["thread_ts"] = json!(thread);
        message.thread_id = Some(thread.to_owned());
    }
    message.meta = Some(meta.to_string());
    Some(message)
}

/// The thread a gateway id (`sl-<channel>-<thread ts>-<ts>`) is answered in.
pub(crate) fn thread_of(id: &str) -> Option<&str> {
    let rest = id.strip_prefix("sl-")?;
    let mut parts = rest.split('-');
    let _channel = parts.next()?;
    let thread = parts.next()?;
    let _ts = parts.next()?;
    (parts.next().is_none() && !thread.is_empty()).then_some(thread)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dms_and_mentions_are_answered_and_bots_and_channel_chatter_are_not() {
        let dm = json!({"type": "message", "channel_type": "im", "channel": "D1", "user": "U7",
            "ts": "1.1", "text": "!stop"});
        let m = event_message(&dm, "UBOT").expect("dm");
        assert_eq!(m.chat_type, ChatType::Dm);
        assert_eq!(m.text, "/stop");
        assert_eq!(m.id, "sl-D1-1.1-1.1");
        assert_eq!(m.thread_id, None);
        let mention = json!({"type": "app_mention", "channel": "C1", "user": "U7",
            "ts": "2.2", "thread_ts": "1.0", "text": "<@UBOT> hi"});
        let m = event_message(&mention, "UBOT").expect("mention");
        assert_eq!(m.chat_type, ChatType::Group);
        assert_eq!(m.text, "hi");
        assert_eq!(thread_of(&m.id), Some("1.0"));
        assert_eq!(m.thread_id.as_deref(), Some("1.0"));
        let chatter = json!({"type": "message", "channel_type": "channel", "channel": "C1",
            "user": "U7", "ts": "3.3", "text": "hi"});
        assert!(event_message(&chatter, "UBOT").is_none());
        let mut bot = dm.clone();
        bot["bot_id"] = json!("B1");
        assert!(event_message(&bot, "UBOT").is_none());
        let mut edit = dm.clone();
        edit["subtype"] = json!("message_changed");
        assert!(event_message(&edit, "UBOT").is_none());
    }
}
