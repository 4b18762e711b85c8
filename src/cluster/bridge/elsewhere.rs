//! Messages run here that another instance accepted, and where their results go: one index
//! by the message's cluster tag, its entry saying which of two exclusive cases it is (a
//! message is never both; one case turns into the other when its origin leaves the
//! registry).

use std::collections::HashMap;

use super::super::routes::Routes;
use crate::cluster::tag_parts;

/// Whose to send the result of a message run here and accepted by another instance is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Whose {
    /// Its origin's, alive: the terminal event is recorded (the record publishes it to
    /// that instance) and not sent here (`silenced`).
    Origin,
    /// This instance's: its origin was taken for dead (the load found no live origin, or
    /// it left the registry), so the result goes out here, marked `redelivery` (the origin
    /// may be alive after all, paused, and send the same outcome from the stream; see
    /// `mark_foreign`).
    Here,
}

/// The messages run here that another instance accepted, by cluster tag.
#[derive(Default)]
pub(in crate::server::bridge) struct AcceptedElsewhere {
    by_tag: HashMap<u64, Whose>,
}

impl AcceptedElsewhere {
    /// Message `tag` was accepted by another live instance: its result is that one's.
    pub(super) fn origin_alive(&mut self, tag: u64) {
        self.by_tag.insert(tag, Whose::Origin);
    }

    /// Message `tag` was accepted by an instance taken for dead: its result goes out here,
    /// marked, unless it is already known to be its live origin's.
    pub(super) fn origin_dead(&mut self, tag: u64) {
        self.by_tag.entry(tag).or_insert(Whose::Here);
    }

    /// The origin of message `tag` left the registry: a result that was its origin's is now
    /// this instance's to send, marked.
    pub(super) fn origin_gone(&mut self, tag: u64) {
        if let Some(whose) = self.by_tag.get_mut(&tag)
            && *whose == Whose::Origin
        {
            *whose = Whose::Here;
        }
    }

    /// Whether the result of message `tag` is its live origin's.
    pub(super) fn is_origins(&self, tag: u64) -> bool {
        self.by_tag.get(&tag) == Some(&Whose::Origin)
    }

    /// The result of message `tag` is no longer its live origin's to send (its message is
    /// handed over; the next owner decides).
    pub(super) fn not_origins(&mut self, tag: u64) {
        if self.is_origins(tag) {
            self.by_tag.remove(&tag);
        }
    }

    /// Message `tag`'s run here ended without its result: whoever runs it next decides.
    pub(super) fn forget(&mut self, tag: u64) {
        self.by_tag.remove(&tag);
    }

    /// Whether the terminal event of `tag`, its outcome recorded, is its live origin's to
    /// send (then it goes nowhere here); the entry is spent either way it answers true.
    pub(super) fn silenced(&mut self, tag: u64) -> bool {
        let silenced = self.is_origins(tag);
        if silenced {
            self.by_tag.remove(&tag);
        }
        silenced
    }

    /// Whether the terminal event of `tag`, going out here, is this instance's to send for
    /// an origin taken for dead (to be marked `redelivery`); the entry is spent. Entries of
    /// that kind are bounded by the messages in flight: past that, those whose message
    /// left another way (handed over, refused) are dropped.
    pub(super) fn take_foreign(&mut self, tag: u64, routes: &Routes) -> bool {
        let foreign = self.by_tag.get(&tag) == Some(&Whose::Here);
        if foreign {
            self.by_tag.remove(&tag);
        }
        let bound = routes.len() + 64;
        // The full count only once the whole index is past the bound.
        if self.by_tag.len() > bound && self.count(Whose::Here) > bound {
            (self.by_tag).retain(|&t, whose| *whose == Whose::Origin || routes.contains(t));
        }
        foreign
    }

    fn count(&self, whose: Whose) -> usize {
        self.by_tag.values().filter(|&&w| w == whose).count()
    }

    /// Checks, in debug builds, that every entry names a message by its cluster tag (one
    /// accepted elsewhere, never one of this bridge's own tags).
    pub(super) fn check(&self) {
        debug_assert!(
            self.by_tag.keys().all(|&t| tag_parts(t).is_some()),
            "a message accepted elsewhere under a bridge's own tag"
        );
    }
}
