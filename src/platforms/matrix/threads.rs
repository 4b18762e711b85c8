//! Matrix threads (`m.thread`, spec v1.4) as sessions of their own.
//!
//! In: a message whose `m.relates_to` has `rel_type: "m.thread"` belongs to the thread rooted
//! at its `event_id`; that root is the message's `thread_id`, so the gateway keys it apart
//! from the room's main timeline (and `/new` in a thread resets only it). Its `m.in_reply_to`
//! is a real reply only when `is_falling_back` is not set (else it is the fallback clients
//! without threads show).
//!
//! Out: a reply to a thread message goes into the thread — `rel_type: "m.thread"` with the
//! root, `is_falling_back: true` and `m.in_reply_to` the human's event (the fallback), as
//! Element sends it. Its edits are ordinary `m.replace` edits of that reply (the server keeps
//! them in the thread). Typing notices are per room: the spec has no thread typing.

use serde_json::{Value, json};

use super::answer::RelatesTo;

/// The thread root and the event a message really replies to, from its `m.relates_to`.
pub(super) fn thread_and_reply(relates: Option<&RelatesTo>) -> (Option<String>, Option<String>) {
    let Some(r) = relates else {
        return (None, None);
    };
    let reply_to = r
        .in_reply_to
        .get()
        .and_then(|r| r.event_id.text())
        .map(str::to_owned);
    if r.rel_type.text() != Some("m.thread") {
        return (None, reply_to);
    }
    let root = r
        .event_id
        .text()
        .filter(|id| !id.is_empty() && id.len() <= 255)
        .map(str::to_owned);
    let falling_back = r.is_falling_back.get() == Some(&true);
    (root, reply_to.filter(|_| !falling_back))
}

/// Puts a new message (`content`, built as a plain reply or message) into the thread rooted
/// at `root`, replying to `reply_to` as the fallback for clients without threads.
pub(super) fn put_in_thread(content: &mut Value, root: &str, reply_to: Option<&str>) {
    let mut relation = json!({"rel_type": "m.thread", "event_id": root, "is_falling_back": true});
    // The fallback reply points at the event answered, else at the root itself.
    relation["m.in_reply_to"] = json!({"event_id": reply_to.unwrap_or(root)});
    content["m.relates_to"] = relation;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::platforms::matrix::sync::{ChatKind, Incoming, SyncState};

    fn thread_msg(id: &str, root: &str, falling_back: bool, body: &str) -> Value {
        json!({"type": "m.room.message", "event_id": id, "sender": "@ann:hs",
            "content": {"msgtype": "m.text", "body": body, "m.relates_to": {
                "rel_type": "m.thread", "event_id": root, "is_falling_back": falling_back,
                "m.in_reply_to": {"event_id": "$latest"}}}})
    }

    fn absorb(events: Vec<Value>) -> Vec<Incoming> {
        let mut s = SyncState::new("@bot:hs", 10, 100);
        let room = |events: Vec<Value>| {
            json!({"next_batch": "s", "rooms": {"join": {"!r:hs": {
                "summary": {"m.joined_member_count": 2},
                "timeline": {"events": events, "limited": false}}}}})
        };
        assert!(s.absorb_value(&room(vec![])).is_empty());
        s.absorb_value(&room(events))
    }

    /// Issue 35 row 3: a thread message carries its root as `thread_id`; a main-timeline
    /// message none; a fallback `m.in_reply_to` is not taken for a real reply.
    #[test]
    fn a_thread_message_carries_its_root_as_the_thread_and_a_fallback_is_no_reply() {
        let out = absorb(vec![
            thread_msg("$t1", "$root", true, "in the thread"),
            thread_msg("$t2", "$root", false, "a real reply in the thread"),
            json!({"type": "m.room.message", "event_id": "$main", "sender": "@ann:hs",
                "content": {"msgtype": "m.text", "body": "main timeline"}}),
        ]);
        let got: Vec<_> = out
            .iter()
            .map(|i| match i {
                Incoming::Message(m) => (m.thread.clone(), m.reply_to.clone()),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            got,
            [
                (Some("$root".to_owned()), None),
                (Some("$root".to_owned()), Some("$latest".to_owned())),
                (None, None),
            ]
        );
        let Incoming::Message(m) = &out[0] else {
            unreachable!()
        };
        let line = m.to_bridge("matrix", ChatKind::Dm);
        assert_eq!(line["thread_id"], "$root");
    }

    #[test]
    fn a_reply_in_a_thread_names_the_root_and_falls_back_to_the_humans_event() {
        let mut c = json!({"msgtype": "m.text", "body": "hi",
            "m.relates_to": {"m.in_reply_to": {"event_id": "$h"}}});
        put_in_thread(&mut c, "$root", Some("$h"));
        assert_eq!(
            c["m.relates_to"],
            json!({"rel_type": "m.thread", "event_id": "$root", "is_falling_back": true,
                "m.in_reply_to": {"event_id": "$h"}})
        );
    }
}
