//! A `/sync` answer as the bridge reads it: typed, lenient and bounded (see
//! [`crate::platforms::lenient`]). Only the fields the bridge uses are read; a room or an
//! event of the wrong shape is skipped and counted; at most [`MAX_ROOMS_PER_SYNC`] rooms of
//! each kind and [`MAX_EVENTS_PER_BLOCK`] events of each block are kept of one answer.

use serde::Deserialize;
use serde::de::IgnoredAny;

use crate::platforms::lenient::{Capped, CappedMap, Lenient};

/// Rooms of one kind (joined, invited, left) kept of one sync answer. A homeserver sends
/// only the rooms with news, so only a bot in more rooms than this with news at once loses
/// some (counted and warned about).
pub(crate) const MAX_ROOMS_PER_SYNC: usize = 10_000;
/// Events kept of one room's timeline or state in one answer: ten times the filter's
/// timeline limit (100), so only a broken or hostile server reaches it.
pub(crate) const MAX_EVENTS_PER_BLOCK: usize = 1_000;

/// One `/sync` answer.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct SyncAnswer {
    /// The position to continue from.
    #[serde(default)]
    pub next_batch: Lenient<String>,
    #[serde(default)]
    pub(super) rooms: Lenient<Rooms>,
}

impl SyncAnswer {
    /// Rooms and events this answer held that were malformed or past the bounds, skipped:
    /// told once per answer.
    pub(crate) fn dropped(&self) -> usize {
        let Some(rooms) = self.rooms.get() else {
            return 0;
        };
        let events: usize = rooms
            .join
            .entries
            .iter()
            .map(|(_, r)| {
                r.timeline.get().map_or(0, |t| t.events.dropped())
                    + r.state.get().map_or(0, |s| s.events.dropped())
            })
            .sum();
        rooms.join.dropped() + rooms.invite.dropped() + rooms.leave.dropped() + events
    }
}

/// The answer's `rooms`.
#[derive(Debug, Default, Deserialize)]
pub(super) struct Rooms {
    #[serde(default)]
    pub join: CappedMap<JoinedRoom, MAX_ROOMS_PER_SYNC>,
    #[serde(default)]
    pub invite: CappedMap<InvitedRoom, MAX_ROOMS_PER_SYNC>,
    #[serde(default)]
    pub leave: CappedMap<IgnoredAny, MAX_ROOMS_PER_SYNC>,
}

/// One invite: the room's stripped state, which holds the invite event (its `sender` is
/// who invited the bot).
#[derive(Debug, Deserialize)]
pub(super) struct InvitedRoom {
    #[serde(default)]
    pub invite_state: Lenient<StateBlock>,
}

impl InvitedRoom {
    /// Who invited `me`: the sender of the `m.room.member` invite event for `me`.
    pub(super) fn inviter(&self, me: &str) -> Option<&str> {
        let events = self.invite_state.get().map_or(&[][..], |s| &s.events.items);
        events
            .iter()
            .rfind(|ev| {
                ev.is("m.room.member")
                    && ev.state_key.text() == Some(me)
                    && ev.content(|c| &c.membership) == Some("invite")
            })
            .and_then(|ev| ev.sender.text())
    }
}

/// One joined room's news.
#[derive(Debug, Deserialize)]
pub(super) struct JoinedRoom {
    #[serde(default)]
    pub summary: Lenient<Summary>,
    #[serde(default)]
    pub timeline: Lenient<Timeline>,
    #[serde(default)]
    pub state: Lenient<StateBlock>,
}

impl JoinedRoom {
    /// The room's joined member count, when the answer tells it.
    pub(super) fn joined_count(&self) -> Option<u64> {
        self.summary.get().and_then(|s| s.joined.get().copied())
    }
}

#[derive(Debug, Deserialize)]
pub(super) struct Summary {
    #[serde(default, rename = "m.joined_member_count")]
    pub joined: Lenient<u64>,
}

#[derive(Debug, Deserialize)]
pub(super) struct Timeline {
    #[serde(default)]
    pub events: Capped<Event, MAX_EVENTS_PER_BLOCK>,
    #[serde(default)]
    pub limited: Lenient<bool>,
}

#[derive(Debug, Deserialize)]
pub(super) struct StateBlock {
    #[serde(default)]
    pub events: Capped<Event, MAX_EVENTS_PER_BLOCK>,
}

/// One room event, with the fields the bridge reads.
#[derive(Debug, Deserialize)]
pub(super) struct Event {
    #[serde(default, rename = "type")]
    pub kind: Lenient<String>,
    #[serde(default)]
    pub event_id: Lenient<String>,
    #[serde(default)]
    pub sender: Lenient<String>,
    #[serde(default)]
    pub state_key: Lenient<String>,
    #[serde(default)]
    pub content: Lenient<Content>,
}

impl Event {
    /// Whether it is of type `kind`.
    pub(super) fn is(&self, kind: &str) -> bool {
        self.kind.text() == Some(kind)
    }

    /// The content's string field `f`.
    pub(super) fn content<'a>(
        &'a self,
        f: fn(&'a Content) -> &'a Lenient<String>,
    ) -> Option<&'a str> {
        self.content.get().and_then(|c| f(c).text())
    }
}

#[derive(Debug, Deserialize)]
pub(super) struct Content {
    #[serde(default)]
    pub msgtype: Lenient<String>,
    #[serde(default)]
    pub body: Lenient<String>,
    #[serde(default)]
    pub displayname: Lenient<String>,
    #[serde(default)]
    pub membership: Lenient<String>,
    #[serde(default)]
    pub url: Lenient<String>,
    /// An encrypted room's file: its URL, key, IV and hash.
    #[serde(default)]
    pub file: Lenient<super::encrypted_file::EncryptedFile>,
    /// A file message's name when its `body` is a caption.
    #[serde(default)]
    pub filename: Lenient<String>,
    /// A file message's size and type.
    #[serde(default)]
    pub info: Lenient<super::media::MediaInfo>,
    #[serde(default, rename = "m.relates_to")]
    pub relates_to: Lenient<RelatesTo>,
    #[serde(default, rename = "m.mentions")]
    pub mentions: Lenient<Mentions>,
}

/// `m.mentions`: whom the sender's client says the event mentions (the first 64 read).
#[derive(Debug, Deserialize)]
pub(super) struct Mentions {
    #[serde(default)]
    pub user_ids: Capped<Lenient<String>, 64>,
}

#[derive(Debug, Deserialize)]
pub(super) struct RelatesTo {
    #[serde(default)]
    pub rel_type: Lenient<String>,
    /// The event related to: a thread's root for `rel_type` `m.thread`.
    #[serde(default)]
    pub event_id: Lenient<String>,
    /// A thread reply's `m.in_reply_to` is only a fallback for clients without threads.
    #[serde(default)]
    pub is_falling_back: Lenient<bool>,
    #[serde(default, rename = "m.in_reply_to")]
    pub in_reply_to: Lenient<InReplyTo>,
}

#[derive(Debug, Deserialize)]
pub(super) struct InReplyTo {
    #[serde(default)]
    pub event_id: Lenient<String>,
}
