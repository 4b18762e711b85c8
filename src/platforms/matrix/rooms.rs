//! A room's session kind, decided once: membership changes never move a conversation.
//!
//! The rule: the first time the bridge hands over a message of a room, the room is a `dm` if
//! it had two joined members then (the bot and the sender, who becomes the DM's **partner**),
//! else a `group`. The decision is kept — in `--state-dir` (the file `matrix-rooms`, written
//! atomically when a room is decided) across restarts — and never taken again:
//!
//! - a DM that gains members stays the partner's DM: the partner's messages keep the room's
//!   `dm` session (its conversation goes on); anyone else there is keyed per sender as in a
//!   group (and, under the gateway's `groups = "mention"`, answered only when they mention the
//!   bot);
//! - a group that shrinks to two members stays a group (one session per sender, as before).
//!
//! Bounded: at most [`MAX_ROOMS`] rooms are remembered; past it the oldest decision is
//! forgotten (that room is decided again from its member count at its next message).

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};

use super::state::write_atomically;
use super::sync::ChatKind;

/// The file in the state directory.
const FILE: &str = "matrix-rooms";
/// Rooms whose kind is remembered at most.
pub(crate) const MAX_ROOMS: usize = 10_000;

/// The rooms decided so far (`partner`: `Some` for a DM).
#[derive(Debug, Default)]
pub(crate) struct RoomKinds {
    decided: HashMap<String, Option<String>>,
    /// Rooms in the order they were decided (the oldest is forgotten first).
    order: VecDeque<String>,
    path: Option<PathBuf>,
}

impl RoomKinds {
    /// The decisions kept in `dir` (none without one). A file that cannot be read is
    /// WARNed about and the rooms are decided again.
    pub(crate) fn open(dir: Option<&Path>) -> RoomKinds {
        let mut kinds = RoomKinds {
            path: dir.map(|d| d.join(FILE)),
            ..RoomKinds::default()
        };
        let Some(path) = &kinds.path else {
            return kinds;
        };
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return kinds,
            Err(e) => {
                warn_limited!(
                    "matrix: cannot read {}: {e}; rooms are decided again",
                    path.display()
                );
                return kinds;
            }
        };
        match serde_json::from_str::<Vec<(String, Option<String>)>>(&text) {
            Ok(list) => {
                for (room, partner) in list.into_iter().rev().take(MAX_ROOMS).rev() {
                    kinds.order.push_back(room.clone());
                    kinds.decided.insert(room, partner);
                }
            }
            Err(e) => warn_limited!(
                "matrix: {} is not a list of rooms ({e}); rooms are decided again",
                path.display()
            ),
        }
        kinds
    }

    /// The session kind of `sender`'s message in `room`, if the room is decided.
    pub(crate) fn known(&self, room: &str, sender: &str) -> Option<ChatKind> {
        Some(match self.decided.get(room)? {
            Some(partner) if partner == sender => ChatKind::Dm,
            _ => ChatKind::Group,
        })
    }

    /// Decides `room` at `sender`'s message from its joined member count (`None`: unknown,
    /// then it is taken as a group this time and decided at a later message).
    pub(crate) fn decide(&mut self, room: &str, sender: &str, joined: Option<u64>) -> ChatKind {
        if let Some(kind) = self.known(room, sender) {
            return kind; // decided once: never again
        }
        let Some(joined) = joined else {
            return ChatKind::Group;
        };
        let kind = ChatKind::from_joined(joined);
        let partner = (kind == ChatKind::Dm).then(|| sender.to_owned());
        if self.order.len() >= MAX_ROOMS
            && let Some(old) = self.order.pop_front()
        {
            self.decided.remove(&old);
        }
        self.order.push_back(room.to_owned());
        self.decided.insert(room.to_owned(), partner);
        debug_assert_eq!(self.order.len(), self.decided.len());
        info_redacted!("matrix: room {room} decided: {} for good", kind.as_str());
        self.save();
        kind
    }

    fn save(&self) {
        let Some(path) = &self.path else {
            return;
        };
        let list: Vec<(&String, &Option<String>)> = self
            .order
            .iter()
            .filter_map(|r| self.decided.get_key_value(r))
            .collect();
        let text = serde_json::to_string(&list).unwrap_or_default();
        if let Err(e) = write_atomically(path, &text) {
            warn_limited!(
                "matrix: cannot write {}: {e} (after a restart rooms are decided again)",
                path.display()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 35 row 4: a DM that gains a third member stays its partner's DM; others there
    /// are keyed as in a group; the decision outlives a restart.
    #[test]
    fn a_dm_that_gains_a_member_stays_its_partners_dm_across_a_restart() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut k = RoomKinds::open(Some(dir.path()));
        assert_eq!(k.known("!dm", "@ann"), None);
        assert_eq!(k.decide("!dm", "@ann", Some(2)), ChatKind::Dm);
        assert_eq!(k.decide("!g", "@ann", Some(3)), ChatKind::Group);
        assert_eq!(k.decide("!unknown", "@ann", None), ChatKind::Group);
        let k = RoomKinds::open(Some(dir.path()));
        assert_eq!(k.known("!dm", "@ann"), Some(ChatKind::Dm));
        assert_eq!(k.known("!dm", "@bob"), Some(ChatKind::Group));
        assert_eq!(k.known("!g", "@ann"), Some(ChatKind::Group));
        assert_eq!(
            k.known("!unknown", "@ann"),
            None,
            "an unknown count decides nothing"
        );
    }

    #[test]
    fn remembered_rooms_are_bounded_and_a_damaged_file_starts_over() {
        let mut k = RoomKinds::open(None);
        for i in 0..MAX_ROOMS + 3 {
            k.decide(&format!("!r{i}"), "@a", Some(2));
        }
        assert_eq!(k.decided.len(), MAX_ROOMS);
        assert_eq!(k.known("!r0", "@a"), None, "the oldest was forgotten");
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join(FILE), "not json").expect("write");
        assert_eq!(RoomKinds::open(Some(dir.path())).known("!x", "@a"), None);
    }
}
