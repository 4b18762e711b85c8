//! "I have it": a message the gateway queued behind a running turn gets the bot's read
//! receipt (`POST /rooms/{room}/receipt/m.read/{event}`): the human's client shows the bot
//! has read it (Element: the bot's avatar under the message) before its turn comes.
//!
//! A receipt rather than an `m.reaction`: it is not a room event, so it costs nothing under
//! the homeserver's message rate limit (`rc_message`) and adds nothing to the timeline, and a
//! receipt for an event covers those before it. The lowest-priority output: sent only when
//! no result, command answer, edit or typing change waits; one per room waits at most (a
//! newer queued message of the room replaces an older one not yet marked, so never more than
//! one receipt per message and a burst costs one request); at most [`MAX_ROOMS`] rooms wait.
//! A failed receipt is not retried (a 429 still pauses the room's queue, as any other).
//! Receipts are unthreaded (no `thread_id`): one covers the room's main timeline and threads.

use std::collections::VecDeque;

/// Rooms with a receipt waiting at most.
pub(crate) const MAX_ROOMS: usize = 1000;

/// Receipts waiting: per room, the newest queued event not marked yet.
#[derive(Debug, Default)]
pub(crate) struct Received {
    waiting: VecDeque<(String, String)>,
}

impl Received {
    /// Event `event` of `room` waits behind a running turn.
    pub(crate) fn queued(&mut self, room: &str, event: &str) {
        if let Some(w) = self.waiting.iter_mut().find(|(r, _)| r == room) {
            // Queued later, so later in the room: its receipt covers the older one.
            event.clone_into(&mut w.1);
            return;
        }
        if self.waiting.len() >= MAX_ROOMS {
            debug_redacted!("matrix: {MAX_ROOMS} rooms wait for a receipt; room {room} gets none");
            return;
        }
        self.waiting.push_back((room.to_owned(), event.to_owned()));
        debug_assert!(self.waiting.len() <= MAX_ROOMS);
    }

    /// The next receipt to send: its room and event.
    pub(crate) fn next(&mut self) -> Option<(String, String)> {
        self.waiting.pop_front()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn receipts_coalesce_per_room_and_are_bounded() {
        let mut r = Received::default();
        r.queued("!a", "$1");
        r.queued("!a", "$2");
        r.queued("!b", "$3");
        assert_eq!(r.next(), Some(("!a".into(), "$2".into())));
        assert_eq!(r.next(), Some(("!b".into(), "$3".into())));
        assert_eq!(r.next(), None);
        for i in 0..MAX_ROOMS + 5 {
            r.queued(&format!("!r{i}"), "$e");
        }
        assert_eq!(r.waiting.len(), MAX_ROOMS);
    }
}
