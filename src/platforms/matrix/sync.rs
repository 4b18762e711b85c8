//! Reading `/sync` answers: which rooms the bot is in, who invited it, and which events are a
//! human's new messages. Pure (no I/O), so the filtering rules are unit-tested on JSON.
//!
//! Ignored: the bot's own events, edits (`m.replace`), notices (`m.notice`, what bots send,
//! so two bots never talk in a loop), redacted events, events already seen, everything in the
//! first sync (the backlog before the bridge started) and, in a room the bot joins later,
//! everything before its own join.

use std::collections::{HashMap, HashSet, VecDeque};

use serde_json::{Map, Value, json};

use super::answer::{Content, Event, JoinedRoom, SyncAnswer};
use crate::message::Command;
use crate::platforms::map_command;

/// The longest message text handed to the gateway; longer ones are refused with a notice.
pub(crate) const MAX_TEXT_BYTES: usize = 32 * 1024;
/// The longest display name passed on (cut on a character boundary).
const MAX_NAME_BYTES: usize = 256;

/// The sync filter: no presence or account data, lazy-loaded members with the senders'
/// member events in every batch (for display names) and room summaries (for member counts).
pub(crate) fn filter(timeline_limit: u32) -> String {
    json!({
        "presence": {"types": []},
        "account_data": {"types": []},
        "room": {
            "account_data": {"types": []},
            "ephemeral": {"types": []},
            "timeline": {"limit": timeline_limit},
            "state": {"lazy_load_members": true, "include_redundant_members": true},
        }
    })
    .to_string()
}

/// A set that remembers at most `cap` strings, forgetting the oldest first.
#[derive(Debug)]
pub(crate) struct BoundedSet {
    cap: usize,
    order: VecDeque<String>,
    set: HashSet<String>,
}

impl BoundedSet {
    /// An empty set holding at most `cap` (at least 1) strings.
    pub(crate) fn new(cap: usize) -> BoundedSet {
        BoundedSet {
            cap: cap.max(1),
            order: VecDeque::new(),
            set: HashSet::new(),
        }
    }

    /// Adds `s`; returns false when it was there already.
    pub(crate) fn insert(&mut self, s: &str) -> bool {
        if self.set.contains(s) {
            return false;
        }
        if self.order.len() >= self.cap
            && let Some(old) = self.order.pop_front()
        {
            self.set.remove(&old);
        }
        self.order.push_back(s.to_owned());
        self.set.insert(s.to_owned());
        true
    }

    /// Whether `s` is remembered.
    #[cfg(test)]
    pub(crate) fn contains(&self, s: &str) -> bool {
        self.set.contains(s)
    }

    /// How many are remembered.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.order.len()
    }
}

/// The bridge's chat types on Matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ChatKind {
    /// Exactly two joined members: the bot and one human.
    Dm,
    /// Anything else.
    Group,
}

impl ChatKind {
    /// From the room's joined member count.
    pub(crate) fn from_joined(joined: u64) -> ChatKind {
        if joined == 2 {
            ChatKind::Dm
        } else {
            ChatKind::Group
        }
    }

    /// The bridge protocol's name.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ChatKind::Dm => "dm",
            ChatKind::Group => "group",
        }
    }
}

/// A human's new message.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct HumanMessage {
    /// The room.
    pub room: String,
    /// The event's id: the bridge message's id.
    pub event_id: String,
    /// The sender's mxid.
    pub sender: String,
    /// The sender's display name in the room, when known.
    pub sender_name: Option<String>,
    /// The text for the gateway (`!stop` already mapped to `/stop`).
    pub text: String,
    /// The event it replies to.
    pub reply_to: Option<String>,
    /// The root of the thread it is in (`m.thread`); `None` in the main timeline.
    pub thread: Option<String>,
    /// The event's `msgtype`.
    pub msgtype: String,
    /// An attachment's `mxc://` URL (images, files).
    pub url: Option<String>,
    /// The file it carries (issue 36), and once the sync thread fetched it, its entry
    /// (boxed: most messages have none).
    pub media: Option<Box<super::media::Media>>,
    /// It mentions the bot (`m.mentions`, its mxid or display name in the text): a group
    /// message the gateway's `groups = "mention"` lets through (`meta.to_bot`).
    pub to_bot: bool,
}

impl HumanMessage {
    /// Whether the text is one of the gateway's commands.
    pub(crate) fn command(&self) -> Option<Command> {
        Command::parse(&self.text)
    }

    /// The bridge-protocol `message` line for it.
    pub(crate) fn to_bridge(&self, platform: &str, kind: ChatKind) -> Value {
        let mut meta = Map::new();
        meta.insert("event_id".into(), json!(self.event_id));
        meta.insert("room_id".into(), json!(self.room));
        meta.insert("msgtype".into(), json!(self.msgtype));
        if let Some(r) = &self.reply_to {
            meta.insert("reply_to".into(), json!(r));
        }
        if let Some(u) = &self.url {
            meta.insert("url".into(), json!(u));
        }
        if self.to_bot {
            meta.insert(crate::access::ADDRESSED_KEY.into(), json!(true));
        }
        let mut v = json!({
            "op": "message",
            "id": self.event_id,
            "platform": platform,
            "chat_id": self.room,
            "chat_type": kind.as_str(),
            "user_id": self.sender,
            "meta": meta,
            "text": self.text,
        });
        if let Some(n) = &self.sender_name {
            v["user_name"] = json!(n);
        }
        if let Some(t) = &self.thread {
            v["thread_id"] = json!(t);
        }
        v
    }
}

/// What one sync answer asks of the bridge.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Incoming {
    /// The bot was invited to this room, by this user (when the invite says).
    Invite {
        /// The room.
        room: String,
        /// Who invited the bot.
        inviter: Option<String>,
    },
    /// A human's message.
    Message(HumanMessage),
    /// A message the bridge cannot take (too long), to be answered with a notice.
    Refused {
        /// The room.
        room: String,
        /// The event.
        event_id: String,
        /// Why, for the human.
        why: String,
    },
}

/// What the bridge knows of the rooms, across syncs.
#[derive(Debug)]
pub(crate) struct SyncState {
    me: String,
    first_done: bool,
    /// Joined rooms and their joined member count, when known.
    rooms: HashMap<String, Option<u64>>,
    max_rooms: usize,
    /// Invites waiting to be handed to the joiner (room, inviter), oldest first.
    invites: VecDeque<(String, Option<String>)>,
    /// Rooms handed to the joiner and not yet joined (or failed): they count against
    /// `max_rooms` like joined ones.
    joining: HashSet<String>,
    seen: BoundedSet,
    /// Rooms whose timeline had a gap (more events than the filter's limit) since the start.
    pub gaps: u64,
    /// The bot's display name, from the latest member event of its own seen (a mention).
    my_name: Option<String>,
}

/// The body without a reply fallback (`> ` quote lines and the blank line after them), which
/// older clients put before the answer.
fn strip_reply_fallback(body: &str) -> &str {
    if !body.starts_with("> ") && !body.starts_with(">\n") {
        return body;
    }
    let mut rest = body;
    while rest.starts_with('>') {
        match rest.find('\n') {
            Some(i) => rest = &rest[i + 1..],
            None => return body,
        }
    }
    rest.strip_prefix('\n').unwrap_or(rest)
}

fn clean_name(name: &str) -> Option<String> {
    let name: String = name
        .chars()
        .filter(|&c| crate::platforms::name_char(c))
        .collect();
    let name = name.trim();
    (!name.is_empty()).then(|| super::api::cut(name, MAX_NAME_BYTES))
}

impl SyncState {
    /// Knows nothing yet; `me` is the bot's mxid.
    pub(crate) fn new(me: &str, max_rooms: usize, max_seen: usize) -> SyncState {
        SyncState {
            me: me.to_owned(),
            first_done: false,
            rooms: HashMap::new(),
            max_rooms: max_rooms.max(1),
            invites: VecDeque::new(),
            joining: HashSet::new(),
            seen: BoundedSet::new(max_seen),
            gaps: 0,
            my_name: None,
        }
    }

    /// The joined member count of `room`, when known.
    pub(crate) fn joined(&self, room: &str) -> Option<u64> {
        self.rooms.get(room).copied().flatten()
    }

    /// Records `room`'s joined member count (asked of the server).
    pub(crate) fn set_joined(&mut self, room: &str, count: u64) {
        if let Some(slot) = self.rooms.get_mut(room) {
            *slot = Some(count);
        }
    }

    /// Forgets the event ids seen (the learning sync's, before continuing from a stored
    /// position that comes before them).
    pub(crate) fn forget_seen(&mut self) {
        self.seen = BoundedSet::new(self.seen.cap);
    }

    /// Rooms the bot is joined to.
    #[cfg(test)]
    pub(crate) fn room_count(&self) -> usize {
        self.rooms.len()
    }

    /// Whether another room may be joined: joined rooms, joins under way and invites queued
    /// all count against `max_rooms`.
    pub(crate) fn can_join(&self) -> bool {
        self.rooms.len() + self.joining.len() + self.invites.len() < self.max_rooms
    }

    /// Queues an invite to join (or decline), if the bound allows; false (logged) when it
    /// does not.
    pub(crate) fn queue_invite(&mut self, room: &str, inviter: Option<&str>) -> bool {
        let room = room.to_owned();
        if self.rooms.contains_key(&room)
            || self.joining.contains(&room)
            || self.invites.iter().any(|(r, _)| *r == room)
        {
            return true;
        }
        if !self.can_join() {
            warn_limited!(
                "matrix: room {room}: invite ignored, {} rooms joined or being joined already (--max-rooms)",
                self.rooms.len() + self.joining.len() + self.invites.len()
            );
            return false;
        }
        self.invites.push_back((room, inviter.map(str::to_owned)));
        true
    }

    /// Up to `n` queued invites (room, inviter) to hand to the joiner now (they count as
    /// being joined).
    pub(crate) fn take_joins(&mut self, n: usize) -> Vec<(String, Option<String>)> {
        let n = n.min(self.invites.len());
        let rooms: Vec<(String, Option<String>)> = self.invites.drain(..n).collect();
        self.joining.extend(rooms.iter().map(|(r, _)| r.clone()));
        rooms
    }

    /// The joiner is done with `room`: joined (`ok`) or given up.
    pub(crate) fn join_done(&mut self, room: &str, ok: bool) {
        if self.joining.remove(room) && ok {
            self.rooms.entry(room.to_owned()).or_insert(None);
        }
    }

    /// Takes one sync answer; returns what it asks for, in timeline order per room.
    pub(crate) fn absorb(&mut self, sync: &SyncAnswer) -> Vec<Incoming> {
        let mut out = Vec::new();
        let first = !self.first_done;
        self.first_done = true;
        let Some(rooms) = sync.rooms.get() else {
            return out;
        };
        for (room, _) in &rooms.leave.entries {
            self.joining.remove(room);
            self.invites.retain(|(r, _)| r != room);
            if self.rooms.remove(room).is_some() {
                info_redacted!("matrix: left room {room}");
            }
        }
        for (room, entry) in &rooms.join.entries {
            self.absorb_room(room, entry, first, &mut out);
        }
        for (room, invite) in &rooms.invite.entries {
            if !self.rooms.contains_key(room) {
                out.push(Incoming::Invite {
                    room: room.clone(),
                    inviter: invite.inviter(&self.me).map(str::to_owned),
                });
            }
        }
        out
    }

    fn absorb_room(
        &mut self,
        room: &str,
        entry: &JoinedRoom,
        first: bool,
        out: &mut Vec<Incoming>,
    ) {
        let known = self.rooms.contains_key(room);
        if self.joining.remove(room) && !known {
            // A join under way shows up: it was counted, it takes its place.
            self.rooms.insert(room.to_owned(), None);
        }
        let known = self.rooms.contains_key(room);
        if !known {
            if self.rooms.len() >= self.max_rooms {
                warn_limited!(
                    "matrix: room {room}: not tracked, {} rooms already (the bound); its messages are ignored",
                    self.max_rooms
                );
                return;
            }
            self.rooms.insert(room.to_owned(), None);
        }
        if let Some(n) = entry.joined_count() {
            self.rooms.insert(room.to_owned(), Some(n));
        }
        let timeline = entry.timeline.get();
        let events: &[Event] = timeline.map_or(&[], |t| &t.events.items);
        let state: &[Event] = entry.state.get().map_or(&[], |s| &s.events.items);
        // Display names from this batch's member events (state first, then the timeline).
        let mut names: HashMap<&str, &str> = HashMap::new();
        for ev in state.iter().chain(events) {
            if ev.is("m.room.member")
                && let (Some(user), Some(name)) =
                    (ev.state_key.text(), ev.content(|c| &c.displayname))
            {
                if user == self.me {
                    self.my_name = clean_name(name);
                }
                names.insert(user, name);
            }
        }
        if first {
            // The backlog before the start: answered never, even if a later sync repeats it.
            for ev in events {
                if let Some(id) = ev.event_id.text() {
                    self.seen.insert(id);
                }
            }
            return;
        }
        if timeline.is_some_and(|t| t.limited.get() == Some(&true)) && known {
            self.gaps += 1;
            warn_limited!(
                "matrix: room {room}: the sync skipped older events (more than the timeline limit arrived at once); messages in the gap are not answered"
            );
        }
        // In a room joined since the last sync, only what follows the bot's own join counts.
        let start = if known {
            0
        } else {
            match events.iter().rposition(|ev| {
                ev.is("m.room.member")
                    && ev.state_key.text() == Some(self.me.as_str())
                    && ev.content(|c| &c.membership) == Some("join")
            }) {
                Some(i) => i + 1,
                None => events.len(),
            }
        };
        let mut count_changed = false;
        for ev in &events[start..] {
            if ev.is("m.room.member") {
                count_changed = true;
                continue;
            }
            if let Some(item) = self.human_message(room, ev, &names) {
                out.push(item);
            }
        }
        // A membership change without a summary: the count is asked for again when needed.
        if count_changed && entry.joined_count().is_none() {
            self.rooms.insert(room.to_owned(), None);
        }
    }

    fn human_message(
        &mut self,
        room: &str,
        ev: &Event,
        names: &HashMap<&str, &str>,
    ) -> Option<Incoming> {
        if !ev.is("m.room.message") {
            return None;
        }
        let event_id = ev.event_id.text()?;
        let sender = ev.sender.text()?;
        if sender == self.me {
            return None;
        }
        let content = ev.content.get()?;
        let relates = content.relates_to.get();
        if relates.and_then(|r| r.rel_type.text()) == Some("m.replace") {
            return None;
        }
        let msgtype = content.msgtype.text()?;
        if msgtype == "m.notice" {
            return None;
        }
        let body = content.body.text()?;
        if event_id.is_empty() || event_id.len() > 255 || room.len() > 255 || sender.len() > 255 {
            debug_redacted!("matrix: room {room}: an event with an over-long id ignored");
            return None;
        }
        if !self.seen.insert(event_id) {
            return None;
        }
        let (thread, reply_to) = super::threads::thread_and_reply(relates);
        let body = if reply_to.is_some() {
            strip_reply_fallback(body)
        } else {
            body
        };
        let body = body.trim();
        if body.is_empty() {
            return None;
        }
        if body.len() > MAX_TEXT_BYTES {
            return Some(Incoming::Refused {
                room: room.to_owned(),
                event_id: event_id.to_owned(),
                why: format!(
                    "message not passed on: {} bytes, the limit is {MAX_TEXT_BYTES}",
                    body.len()
                ),
            });
        }
        let sender_name = names.get(sender).and_then(|n| clean_name(n));
        let to_bot = self.mentions_me(content, body);
        let text = if msgtype == "m.emote" {
            format!("* {} {body}", sender_name.as_deref().unwrap_or(sender))
        } else {
            map_command(body).into_owned()
        };
        Some(Incoming::Message(HumanMessage {
            room: room.to_owned(),
            event_id: event_id.to_owned(),
            sender: sender.to_owned(),
            sender_name,
            text,
            reply_to,
            thread,
            msgtype: msgtype.to_owned(),
            url: content.url.text().map(str::to_owned),
            media: super::media::of(msgtype, content).map(Box::new),
            to_bot,
        }))
    }

    /// Whether a message mentions the bot: its `m.mentions` names it (clients add the
    /// sender of the event replied to), or the text holds its mxid or its display name.
    fn mentions_me(&self, content: &Content, body: &str) -> bool {
        let me = self.me.as_str();
        let listed = content
            .mentions
            .get()
            .is_some_and(|m| m.user_ids.items.iter().any(|id| id.text() == Some(me)));
        let name = self.my_name.as_deref().filter(|n| !n.trim().is_empty());
        listed
            || body.contains(me)
            || name.is_some_and(|n| body.to_lowercase().contains(&n.to_lowercase()))
    }
}

#[cfg(test)]
impl SyncState {
    /// [`SyncState::absorb`] of `sync` read as the sync thread reads answers (from text).
    pub(crate) fn absorb_value(&mut self, sync: &Value) -> Vec<Incoming> {
        let answer: SyncAnswer = serde_json::from_str(&sync.to_string()).expect("a sync answer");
        self.absorb(&answer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ME: &str = "@bot:hs";
    const ROOM: &str = "!r:hs";

    fn msg(id: &str, sender: &str, body: &str) -> Value {
        json!({"type": "m.room.message", "event_id": id, "sender": sender,
               "content": {"msgtype": "m.text", "body": body}})
    }

    fn member(user: &str, membership: &str, name: &str) -> Value {
        json!({"type": "m.room.member", "state_key": user, "sender": user, "event_id": format!("$m-{user}-{membership}"),
               "content": {"membership": membership, "displayname": name}})
    }

    fn sync_with(room: &str, joined: u64, state: Vec<Value>, timeline: Vec<Value>) -> Value {
        json!({"next_batch": "s1", "rooms": {"join": {room: {
            "summary": {"m.joined_member_count": joined},
            "state": {"events": state},
            "timeline": {"events": timeline, "limited": false},
        }}}})
    }

    fn started() -> SyncState {
        let mut s = SyncState::new(ME, 10, 100);
        // The first sync: the room, with a backlog that must not be answered.
        let first = sync_with(
            ROOM,
            2,
            vec![member("@ann:hs", "join", "Ann")],
            vec![msg("$old", "@ann:hs", "from before the start")],
        );
        assert_eq!(s.absorb_value(&first), vec![]);
        s
    }

    fn messages(out: Vec<Incoming>) -> Vec<HumanMessage> {
        out.into_iter()
            .filter_map(|i| match i {
                Incoming::Message(m) => Some(m),
                _ => None,
            })
            .collect()
    }

    /// Issue 32 row 3: a group message is marked for the bot only when it mentions it.
    #[test]
    fn a_group_message_is_marked_to_the_bot_only_when_it_mentions_it() {
        let mut s = started();
        let names = vec![
            member("@ann:hs", "join", "Ann"),
            member(ME, "join", "Turnstile Bot"),
        ];
        let mut mentioned = msg("$3", "@ann:hs", "hey you");
        mentioned["content"]["m.mentions"] = json!({"user_ids": [ME]});
        let got = messages(s.absorb_value(&sync_with(
            ROOM,
            3,
            names,
            vec![
                msg("$1", "@ann:hs", "chatter among humans"),
                msg("$2", "@ann:hs", "turnstile bot: what is 2+2?"),
                mentioned,
                msg("$4", "@ann:hs", "ask @bot:hs"),
            ],
        )));
        let marks: Vec<bool> = got.iter().map(|m| m.to_bot).collect();
        assert_eq!(marks, [false, true, true, true]);
        let line = got[1].to_bridge("matrix", ChatKind::Group);
        assert_eq!(line["meta"]["to_bot"], true);
        assert!(
            got[0].to_bridge("matrix", ChatKind::Group)["meta"]
                .get("to_bot")
                .is_none()
        );
    }

    #[test]
    fn the_backlog_own_events_edits_notices_and_repeats_are_ignored() {
        let mut s = started();
        let edit = json!({"type": "m.room.message", "event_id": "$e", "sender": "@ann:hs",
            "content": {"msgtype": "m.text", "body": "* fixed",
                        "m.new_content": {"msgtype": "m.text", "body": "fixed"},
                        "m.relates_to": {"rel_type": "m.replace", "event_id": "$1"}}});
        let notice = json!({"type": "m.room.message", "event_id": "$n", "sender": "@other-bot:hs",
            "content": {"msgtype": "m.notice", "body": "beep"}});
        let redacted =
            json!({"type": "m.room.message", "event_id": "$x", "sender": "@ann:hs", "content": {}});
        let out = s.absorb_value(&sync_with(
            ROOM,
            2,
            vec![member("@ann:hs", "join", "Ann")],
            vec![
                msg("$old", "@ann:hs", "the backlog again"),
                msg("$mine", ME, "my own reply"),
                edit,
                notice,
                redacted,
                msg("$1", "@ann:hs", "hello"),
                msg("$1", "@ann:hs", "hello"),
            ],
        ));
        let got = messages(out);
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].event_id, "$1");
        assert_eq!(got[0].sender_name.as_deref(), Some("Ann"));
        // Seen once: a later sync repeating it is ignored too.
        assert!(
            messages(s.absorb_value(&sync_with(
                ROOM,
                2,
                vec![],
                vec![msg("$1", "@ann:hs", "hello")]
            )))
            .is_empty()
        );
    }

    #[test]
    fn the_first_sync_answers_nothing_but_its_invites() {
        let mut s = SyncState::new(ME, 10, 100);
        let first = json!({"next_batch": "s1", "rooms": {
            "join": {ROOM: {"timeline": {"events": [msg("$old", "@ann:hs", "hi")]}}},
            "invite": {"!new:hs": {"invite_state": {"events": [
                {"type": "m.room.member", "state_key": ME, "sender": "@ann:hs",
                 "content": {"membership": "invite"}},
            ]}}},
        }});
        assert_eq!(
            s.absorb_value(&first),
            vec![Incoming::Invite {
                room: "!new:hs".into(),
                inviter: Some("@ann:hs".into())
            }]
        );
        assert_eq!(s.room_count(), 1);
    }

    #[test]
    fn in_a_newly_joined_room_only_what_follows_the_join_counts() {
        let mut s = started();
        let out = s.absorb_value(&sync_with(
            "!new:hs",
            3,
            vec![],
            vec![
                msg("$before", "@ann:hs", "said before the bot came"),
                member(ME, "join", "Bot"),
                msg("$after", "@ann:hs", "said after"),
            ],
        ));
        let got = messages(out);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].event_id, "$after");
        // A new room whose timeline does not show the join (a gap): nothing is answered.
        let out = s.absorb_value(&sync_with(
            "!gap:hs",
            2,
            vec![],
            vec![msg("$g", "@ann:hs", "?")],
        ));
        assert!(messages(out).is_empty());
    }

    #[test]
    fn dm_is_two_joined_members_group_anything_else() {
        assert_eq!(ChatKind::from_joined(2), ChatKind::Dm);
        assert_eq!(ChatKind::from_joined(1), ChatKind::Group);
        assert_eq!(ChatKind::from_joined(3), ChatKind::Group);
        let mut s = started();
        assert_eq!(s.joined(ROOM), Some(2));
        // A third member joins: the summary says 3.
        s.absorb_value(&sync_with(
            ROOM,
            3,
            vec![],
            vec![member("@bob:hs", "join", "Bob")],
        ));
        assert_eq!(s.joined(ROOM), Some(3));
        let m = HumanMessage {
            room: ROOM.into(),
            event_id: "$1".into(),
            sender: "@bob:hs".into(),
            sender_name: Some("Bob".into()),
            text: "hi".into(),
            reply_to: Some("$0".into()),
            thread: None,
            msgtype: "m.text".into(),
            url: None,
            media: None,
            to_bot: false,
        };
        let v = m.to_bridge("matrix", ChatKind::from_joined(3));
        assert_eq!(v["chat_type"], "group");
        assert_eq!(v["chat_id"], ROOM);
        assert_eq!(v["user_id"], "@bob:hs");
        assert_eq!(v["user_name"], "Bob");
        assert_eq!(v["id"], "$1");
        assert_eq!(v["meta"]["event_id"], "$1");
        assert_eq!(v["meta"]["reply_to"], "$0");
        let v = m.to_bridge("matrix", ChatKind::Dm);
        assert_eq!(v["chat_type"], "dm");
    }

    #[test]
    fn a_membership_change_without_a_summary_forgets_the_count() {
        let mut s = started();
        let no_summary = json!({"rooms": {"join": {ROOM: {"timeline": {"events": [member("@bob:hs", "join", "Bob")]}}}}});
        s.absorb_value(&no_summary);
        assert_eq!(s.joined(ROOM), None);
        s.set_joined(ROOM, 3);
        assert_eq!(s.joined(ROOM), Some(3));
    }

    #[test]
    fn bang_and_slash_commands_are_the_gateways_commands() {
        let m = |t: &str| HumanMessage {
            room: ROOM.into(),
            event_id: "$1".into(),
            sender: "@a:hs".into(),
            sender_name: None,
            text: map_command(t).into_owned(),
            reply_to: None,
            thread: None,
            msgtype: "m.text".into(),
            url: None,
            media: None,
            to_bot: false,
        };
        assert_eq!(m("!stop").command(), Some(Command::Stop));
        assert_eq!(m("!new").command(), Some(Command::Reset));
        assert_eq!(m("/status").command(), Some(Command::Status));
        assert_eq!(m("stop").command(), None);
    }

    #[test]
    fn reply_fallbacks_are_stripped_and_long_messages_refused() {
        let mut s = started();
        let reply = json!({"type": "m.room.message", "event_id": "$r", "sender": "@ann:hs",
            "content": {"msgtype": "m.text", "body": "> <@bot:hs> earlier\n> more\n\n!stop",
                        "m.relates_to": {"m.in_reply_to": {"event_id": "$b"}}}});
        let long = msg("$long", "@ann:hs", &"x".repeat(MAX_TEXT_BYTES + 1));
        let out = s.absorb_value(&sync_with(ROOM, 2, vec![], vec![reply, long]));
        let Incoming::Message(m) = &out[0] else {
            panic!("{out:?}")
        };
        assert_eq!(m.text, "/stop");
        assert_eq!(m.reply_to.as_deref(), Some("$b"));
        assert!(matches!(&out[1], Incoming::Refused { event_id, .. } if event_id == "$long"));
    }

    #[test]
    fn rooms_and_remembered_ids_are_bounded() {
        let mut s = SyncState::new(ME, 1, 2);
        s.absorb_value(&sync_with(ROOM, 2, vec![], vec![]));
        assert!(!s.can_join());
        s.absorb_value(&sync_with(
            "!other:hs",
            2,
            vec![],
            vec![member(ME, "join", "b"), msg("$o", "@a:hs", "x")],
        ));
        assert_eq!(s.room_count(), 1);
        let mut seen = BoundedSet::new(2);
        assert!(seen.insert("a"));
        assert!(seen.insert("b"));
        assert!(!seen.insert("b"));
        assert!(seen.insert("c"));
        assert_eq!(seen.len(), 2);
        assert!(!seen.contains("a"));
    }

    #[test]
    fn invites_queued_and_joins_under_way_count_against_max_rooms() {
        let mut s = SyncState::new("@bot:hs", 3, 100);
        for i in 0..10 {
            s.queue_invite(&format!("!r{i}:hs"), None);
        }
        assert!(!s.can_join(), "three invites queued fill a bound of three");
        let first: Vec<String> = s.take_joins(2).into_iter().map(|(r, _)| r).collect();
        assert_eq!(first, ["!r0:hs", "!r1:hs"]);
        assert!(!s.can_join(), "joins under way still count");
        s.join_done("!r0:hs", true);
        s.join_done("!r1:hs", false);
        assert_eq!(s.room_count(), 1);
        assert!(s.can_join(), "a failed join frees its place");
        assert_eq!(s.take_joins(16), [("!r2:hs".to_owned(), None)]);
        assert!(s.take_joins(16).is_empty());
    }
}
