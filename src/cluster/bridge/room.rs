//! Messages of owned partitions waiting for outbox room (`--cluster`, docs/cluster.md
//! "Bounds"). The owner rebuilds the messages other instances accepted into its partitions
//! (a gained partition's load, the inbox stream) and reserves an outbox event for each
//! result, as admission does; those come on top of what this instance admitted itself, so
//! they could pass `--outbox-cap` (tests/simulation_cluster, `small-outbox`). A rebuilt
//! message for which its platform has no room waits here instead, in the order it came,
//! and is rebuilt once room frees (the bridge's housekeeping, every 100 ms); meanwhile a new
//! message of that platform is refused `backpressure`, so that none overtakes them.
//!
//! Bounded by the owned partitions' messages in Redis (a gain's load holds all of them in
//! memory at once anyway); a partition handed over takes its waiting messages with it (its
//! next owner loads them from Redis).

use std::collections::{HashMap, VecDeque};

use super::super::platforms::Platforms;
use super::super::refusal::Refusal;
use super::side::ClusterSide;
use super::{Effect, Effects, Rooms};
use crate::cluster::tag_parts;
use crate::journal::RecoveredMessage;

/// The rebuilt messages waiting for room, by platform, each in the order it came.
#[derive(Default)]
pub(in crate::server::bridge) struct WaitingForRoom {
    /// Platform → (partition, message), oldest first.
    by_platform: HashMap<String, VecDeque<(u32, RecoveredMessage)>>,
}

impl WaitingForRoom {
    /// How many wait, over every platform.
    pub(in crate::server::bridge) fn len(&self) -> usize {
        self.by_platform.values().map(VecDeque::len).sum()
    }

    /// Whether message `tag` waits here.
    pub(in crate::server::bridge) fn contains(&self, tag: u64) -> bool {
        (self.by_platform.values().flatten()).any(|(_, m)| m.message.seq == tag)
    }

    /// Whether messages of `platform` wait (a new one of it waits behind them).
    pub(in crate::server::bridge) fn any_of(&self, platform: &str) -> bool {
        self.by_platform
            .get(platform)
            .is_some_and(|q| !q.is_empty())
    }

    /// A new message of `platform` is admitted only once none waits: refused `backpressure`.
    pub(in crate::server::bridge) fn gate(
        &self,
        platform: &str,
        cap: usize,
    ) -> Result<(), Refusal> {
        match self.by_platform.get(platform).map_or(0, VecDeque::len) {
            0 => Ok(()),
            n => Err(Refusal::outbox_cap(platform, cap + n, cap)),
        }
    }

    /// Whether a message of partition `p` and `platform` placed before `seq` waits (an own
    /// accept at `seq` is held behind it: `order.rs`). One whose tag is not a cluster tag
    /// (accepted here, loaded) counts as before.
    pub(in crate::server::bridge) fn holds_below(&self, p: u32, platform: &str, seq: u64) -> bool {
        let before = |m: &RecoveredMessage| tag_parts(m.message.seq).is_none_or(|(_, s)| s < seq);
        (self.by_platform.get(platform))
            .is_some_and(|q| q.iter().any(|(q, m)| *q == p && before(m)))
    }

    fn push(&mut self, partition: u32, rm: RecoveredMessage) {
        let platform = rm.message.platform().to_owned();
        self.by_platform
            .entry(platform)
            .or_default()
            .push_back((partition, rm));
    }

    /// The messages of partition `p` leave (handed over): their tags.
    pub(in crate::server::bridge) fn hand_over(&mut self, p: u32) -> Vec<u64> {
        let mut gone = Vec::new();
        for q in self.by_platform.values_mut() {
            q.retain(|(partition, m)| {
                let keep = *partition != p;
                if !keep {
                    gone.push(m.message.seq);
                }
                keep
            });
        }
        self.by_platform.retain(|_, q| !q.is_empty());
        gone
    }
}

impl ClusterSide {
    /// Of a gained partition `p`'s `messages`, in order, those with room for their result
    /// now; the rest wait (each after the first of its platform that does not fit).
    pub(super) fn room_now(
        &mut self,
        p: u32,
        messages: Vec<RecoveredMessage>,
        platforms: &Platforms,
    ) -> Vec<RecoveredMessage> {
        let mut room: HashMap<String, usize> = HashMap::new();
        let mut now = Vec::with_capacity(messages.len());
        for rm in messages {
            let platform = rm.message.platform();
            let left = match room.get_mut(platform) {
                Some(left) => left,
                None => {
                    let fits = match self.waiting.any_of(platform) {
                        true => 0,
                        false => platforms.room_for(platform),
                    };
                    room.entry(platform.to_owned()).or_insert(fits)
                }
            };
            if *left == 0 {
                self.waiting.push(p, rm);
                continue;
            }
            *left -= 1;
            now.push(rm);
        }
        if self.waiting.len() > 0 {
            log::info!(
                "partition {p}: {} message(s) wait for room in their outbox (--outbox-cap)",
                self.waiting.len()
            );
        }
        now
    }

    /// A message of owned partition `p` to rebuild: now if its platform has room for its
    /// result and nothing waits before it, else it waits (in order).
    pub(super) fn rebuild_or_wait(
        &mut self,
        p: u32,
        rm: RecoveredMessage,
        platforms: &Platforms,
        fx: &mut Effects,
    ) {
        let platform = rm.message.platform();
        if self.waiting.any_of(platform) || platforms.room_for(platform) == 0 {
            log::debug!(
                "partition {p}: message {}: waits for room in the outbox of {platform}",
                rm.message.id()
            );
            self.waiting.push(p, rm);
            return;
        }
        fx.push(Effect::Rebuild(rm));
    }

    /// Room may have freed: the next waiting message that now fits, to rebuild (the bridge
    /// rebuilds it and asks again, so that each is measured after the one before: the
    /// platforms in turn, each until it has no room or nothing waits); then the own
    /// accepts of its partition held behind it may go (`order.rs`).
    pub(in crate::server::bridge) fn rebuild_next(
        &mut self,
        mut rooms: Rooms<'_>,
    ) -> Option<Effects> {
        let waiting = &mut self.waiting.by_platform;
        let platforms = &*rooms.delivery.platforms;
        let (platform, q) = waiting
            .iter_mut()
            .find(|(platform, q)| !q.is_empty() && platforms.room_for(platform) > 0)?;
        let (p, rm) = q.pop_front()?;
        if q.is_empty() {
            let platform = platform.clone();
            waiting.remove(&platform);
        }
        let mut fx = vec![Effect::Rebuild(rm)];
        self.release_held(p, &mut rooms, &mut fx);
        Some(fx)
    }
}
