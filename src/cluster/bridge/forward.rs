//! The bridge's part of the hello registry (`--cluster`, docs/cluster.md "Where the result
//! goes"): a result whose connection is gone goes to the platform's newest hello on any
//! instance.
//!
//! - Each hello here is recorded in Redis ([`ClusterRequest::Hello`], by the reader: the
//!   loop never waits for Redis).
//! - A platform with results in its outbox and no connection here has them **offered**
//!   ([`ClusterRequest::Forward`]) every [`FORWARD_RETRY`] until answered; the reader sends
//!   the offer only if the platform's newest hello is another live instance's.
//! - The instance offered them (`ClusterSide::forwarded`) takes each that fits the platform's
//!   bounds (reserved as an admitted message's result is) and only while it has a
//!   connection of the platform, puts it in the platform's outbox marked `redelivery` (it
//!   may have been seen: its origin's connection may have had it before it went), and
//!   answers what it took and what it refused ([`ClusterRequest::Took`]).
//! - Only that answer makes the first instance drop its copies (`ClusterSide::took`), their
//!   reservations released and nothing written: the taker's `delivered` removes the
//!   message as any other. A forward lost with its target, or refused, leaves the results
//!   where they were.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use super::super::Action;
use super::super::platforms::Platforms;
use super::side::ClusterSide;
use super::{Effect, Effects, Rooms};
use crate::cluster::{ClusterRequest, tag_parts};
use crate::journal::RecoveredMessage;
use crate::liveness::ClusterStatus;
use crate::server::frame::Frame;
use crate::wire::EncodedLine as Body;

/// How long an offer waits for its answer before its results are offered again (an offer
/// to an instance that died, or sent while the registry still named this one).
pub(in crate::server::bridge) const FORWARD_RETRY: Duration = Duration::from_secs(1);
/// Results named by one offer at most (an offer is one stream entry).
const FORWARD_BATCH: usize = 256;

/// The offers and their counts, kept with the cluster's state.
#[derive(Default)]
pub(in crate::server::bridge) struct Forwards {
    /// Results offered and not answered (cluster tag → when): a subset of the outboxes'
    /// results, pruned to them.
    offered: HashMap<u64, Duration>,
    /// Results taken by another instance, taken here, refused here.
    out: u64,
    taken: u64,
    refused: u64,
}

impl Forwards {
    /// Results offered and unanswered, taken away, taken here, refused here.
    pub(in crate::server::bridge) fn fill_status(&self, s: &mut ClusterStatus) {
        s.forwards_waiting = self.offered.len();
        (s.forwarded_out, s.forwarded_in, s.forwards_refused) =
            (self.out, self.taken, self.refused);
    }
}

impl ClusterSide {
    /// A hello of `platform` here: the registry is to be told (off the loop), by this
    /// request.
    pub(in crate::server::bridge) fn hello(&self, platform: &Arc<str>) -> Option<ClusterRequest> {
        self.is_on()
            .then(|| ClusterRequest::Hello(platform.to_string()))
    }

    /// A terminal event about to be delivered learns its cluster tag, by which another
    /// instance can find its message in Redis should it be forwarded.
    pub(in crate::server::bridge) fn stamp(&self, mut frame: Frame) -> Frame {
        if frame.cluster != 0 || frame.terminal_for.is_none() {
            return frame;
        }
        if tag_parts(frame.seq).is_some() {
            frame.cluster = frame.seq;
        } else if let Some(ct) = self.cluster_tag_of(frame.seq) {
            frame.cluster = ct;
        }
        frame
    }

    /// Housekeeping: the results of platforms with no connection here are offered to the
    /// instance of their newest hello, each again once its last offer is [`FORWARD_RETRY`]
    /// old. Returns the offers to make (the bridge marks their results offered, see
    /// `Platforms::mark_offered`, and sends each request).
    fn offers(
        &mut self,
        platforms: &Platforms,
        now: Duration,
    ) -> Vec<(Arc<str>, Vec<u64>, ClusterRequest)> {
        if !self.is_on() {
            return Vec::new();
        }
        let f = &mut self.forwards;
        let mut offers = Vec::new();
        for (platform, tags) in platforms.unattended() {
            let due: Vec<u64> = tags
                .into_iter()
                .filter(|t| {
                    f.offered
                        .get(t)
                        .is_none_or(|&at| now.saturating_sub(at) >= FORWARD_RETRY)
                })
                .take(FORWARD_BATCH)
                .collect();
            if due.is_empty() {
                continue;
            }
            for &t in &due {
                f.offered.insert(t, now);
            }
            let r = ClusterRequest::Forward {
                platform: platform.to_string(),
                results: due.clone(),
            };
            offers.push((platform, due, r));
        }
        // Bounded by the outboxes: an offered result that left another way (a hello here
        // took it, it went stale) is forgotten.
        if f.offered.len() > platforms.outboxed() + 64 {
            let present = platforms.outboxed_tags();
            f.offered.retain(|t, _| present.contains(t));
        }
        offers
    }
}

impl ClusterSide {
    /// Results instance `from` holds for `platform`, whose newest hello is here: each that
    /// fits the platform's bounds goes to its outbox marked `redelivery`; the answer says
    /// which were taken.
    pub(super) fn forwarded(
        &mut self,
        from: String,
        platform: String,
        results: Vec<(u64, Box<RecoveredMessage>)>,
        missing: Vec<u64>,
        rooms: &mut Rooms<'_>,
        fx: &mut Effects,
    ) {
        let (mut taken, mut refused) = (Vec::new(), missing);
        // Taken now (not known here before): what the status counts.
        let mut new = 0;
        let delivery = &mut rooms.delivery;
        let here = delivery.platforms.newest_hello(&platform).is_some();
        let key: Option<Arc<str>> = here.then(|| delivery.platforms.open(&platform)).flatten();
        for (tag, m) in results {
            let (Some(key), Some(outcome)) = (&key, m.outcome.clone()) else {
                refused.push(tag);
                continue;
            };
            // Known here already (an answer lost and the offer made again, or a message of
            // a partition owned here): this instance delivers it either way.
            if rooms.routes.contains(tag)
                || delivery.platforms.outbox_has(key, tag)
                || delivery.conns.terminals().any(|f| f.cluster == tag)
            {
                taken.push(tag);
                continue;
            }
            if m.message.platform() != platform {
                refused.push(tag);
                continue;
            }
            let id: Arc<str> = m.message.id().into();
            let mut frame = Frame::new(Body::from_stored(outcome), Some(key.clone()))
                .of_message(tag, id.clone());
            frame.cluster = tag;
            frame.mark_redelivery();
            match delivery.platforms.take_forwarded(key, frame) {
                true => {
                    log::debug!(
                        "platform {platform}: message {id}: its result, from {from}, taken here"
                    );
                    taken.push(tag);
                    new += 1;
                }
                false => refused.push(tag),
            }
        }
        if let Some(key) = &key {
            delivery.refill_newest(key);
        }
        if !refused.is_empty() {
            log::info!(
                "platform {platform}: {} of {from}'s result(s) refused here (no connection of it, no room within its bounds, or no longer in Redis): they stay there",
                refused.len()
            );
        }
        self.forwards.taken += new;
        self.forwards.refused += refused.len() as u64;
        let r = ClusterRequest::Took {
            to: from,
            platform,
            taken,
            refused,
        };
        fx.push(Effect::Act(Action::Cluster(r)));
    }

    /// The answer to an offer of `platform`'s results: the taken ones leave this instance
    /// (their reservations released, nothing written: the taker delivers them).
    pub(super) fn took(
        &mut self,
        platform: &str,
        taken: &[u64],
        refused: &[u64],
        rooms: &mut Rooms<'_>,
        fx: &mut Effects,
    ) {
        if rooms.durable.is_none() {
            return;
        }
        let f = &mut self.forwards;
        for t in taken {
            f.offered.remove(t);
        }
        // A refused one is offered again once its offer is old enough.
        let _ = refused;
        let set: HashSet<u64> = taken.iter().copied().collect();
        let delivery = &mut rooms.delivery;
        let gone = delivery.platforms.remove_forwarded(platform, &set);
        for frame in &gone {
            // Accepted here: the journal thread forgets its tag's place (no `delivered` of
            // this tag will come; the taker writes it by the cluster tag).
            if frame.seq != 0 && tag_parts(frame.seq).is_none() {
                let r = ClusterRequest::Untag(frame.seq);
                fx.push(Effect::Act(Action::Cluster(r)));
            }
            log::debug!(
                "platform {platform}: message {}: its result was taken by the instance of the platform's newest hello",
                frame.msg_id.as_deref().unwrap_or("?")
            );
        }
        self.forwards.out += gone.len() as u64;
        if !gone.is_empty() {
            log::info!(
                "platform {platform}: {} result(s) handed to the instance of its newest hello",
                gone.len()
            );
            if let Some(key) = delivery.platforms.key(platform) {
                delivery.release_held(&key);
            }
            delivery.platforms.maybe_free(platform);
        }
    }

    /// Housekeeping: the results of platforms with no connection here are offered to the
    /// instance of their newest hello (`offers`), their results marked offered
    /// (`Platforms::mark_offered`: sent from here later, after a hello here before the
    /// answer, they are marked, since the taker may have sent them already:
    /// tests/simulation_cluster, seed 4).
    pub(in crate::server::bridge) fn offer(&mut self, rooms: Rooms<'_>) -> Effects {
        let platforms = rooms.delivery.platforms;
        let offers = self.offers(platforms, rooms.delivery.now);
        let mut fx = Effects::new();
        for (platform, due, r) in offers {
            platforms.mark_offered(&platform, &due);
            fx.push(Effect::Act(Action::Cluster(r)));
        }
        fx
    }
}
