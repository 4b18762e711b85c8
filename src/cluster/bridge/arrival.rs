//! What the stream reader brought ([`Arrival`]): an outcome of a message acked here and run
//! elsewhere, an entry of an outcome this instance wrote itself, a message accepted into a
//! partition owned here (or whose origin left), the reader's progress in an inbox, and the
//! forwards of results between instances (see `side.rs` and `forward.rs` for the rules).

use super::early::EARLY_SLACK;
use super::side::ClusterSide;
use super::{Effects, Rooms};
use crate::cluster::Arrival;
use crate::journal::RecoveredMessage;
use crate::server::frame::Frame;
use crate::wire::EncodedLine as Body;

impl ClusterSide {
    /// What the stream reader brought, applied to the rooms lent; what the bridge is to do.
    pub(in crate::server::bridge) fn arrived(
        &mut self,
        a: Arrival,
        mut rooms: Rooms<'_>,
    ) -> Effects {
        let mut fx = Effects::new();
        let rooms = &mut rooms;
        let now = rooms.delivery.now;
        match a {
            Arrival::Outcome { tag, outcome, .. } => {
                let local = self.remote.remove(&tag);
                let orphan = self.orphans.remove(&tag);
                if let Some(local) = local {
                    self.remote_outcome(local, outcome, rooms, &mut fx);
                } else if let Some(o) = orphan {
                    let frame = Frame::new(Body::from_stored(outcome), Some(o.platform.clone()))
                        .of_message(o.tag, o.id);
                    let frame = self.mark_if_taken_for_dead(frame, now);
                    self.deliver(&mut rooms.delivery, o.conn, &o.platform, frame);
                } else {
                    // Before the report that says its message waits here (see `early`).
                    let bound = rooms.routes.len() + EARLY_SLACK;
                    let dropped = self.early.keep(tag, outcome, bound);
                    if dropped > 0 {
                        log::warn!(
                            "{dropped} outcome(s) from the stream for messages not known here were dropped (more than {bound} kept); a message of them still waiting here is not answered by this instance"
                        );
                    }
                }
            }
            Arrival::Landed { tag, .. } => {
                let orphan = self.orphans.remove(&tag);
                if let Some(o) = orphan {
                    // Given up as unwritten, yet written: its own result goes.
                    log::debug!(
                        "message {}: its outcome write landed after all; sent",
                        o.tag
                    );
                    let frame = self.mark_if_taken_for_dead(o.own, now);
                    self.deliver(&mut rooms.delivery, o.conn, &o.platform, frame);
                } else {
                    let bound = rooms.routes.len() + EARLY_SLACK;
                    // Most are of writes whose answer came: dropped at the bound.
                    let _ = self.landed.keep(tag, (), bound);
                }
            }
            Arrival::OriginGone {
                partition,
                tag,
                message,
            } => self.origin_gone(partition, tag, *message, rooms, &mut fx),
            Arrival::Reached { partition, seq } => self.reached(partition, seq, rooms, &mut fx),
            Arrival::Forwarded {
                from,
                platform,
                results,
                missing,
            } => self.forwarded(from, platform, results, missing, rooms, &mut fx),
            Arrival::Took {
                platform,
                taken,
                refused,
            } => self.took(&platform, &taken, &refused, rooms, &mut fx),
            Arrival::Message {
                partition,
                tag,
                message,
                ..
            } => {
                let owned = self.owned.contains(&partition) && !self.drains.is_draining(partition);
                if owned {
                    self.reached_before(partition, tag, rooms, &mut fx);
                }
                // Read before its partition was handed over (or while it drains): its next
                // owner queues it.
                if rooms.routes.contains(tag) || self.waiting.contains(tag) || !owned {
                    return fx;
                }
                // Accepted by another instance, alive a moment ago: its result is its own.
                self.elsewhere.origin_alive(tag);
                self.rebuild_or_wait(partition, *message, rooms.delivery.platforms, &mut fx);
            }
        }
        fx
    }

    /// A message of an owned partition whose origin left the registry: its result is this
    /// instance's to send, marked `redelivery` (the origin may have sent it, or be paused and
    /// send it still). Running or queued here, its result is no longer silenced; its outcome
    /// recorded already, it goes out now, as a recovered one does.
    fn origin_gone(
        &mut self,
        partition: u32,
        tag: u64,
        message: RecoveredMessage,
        rooms: &mut Rooms<'_>,
        fx: &mut Effects,
    ) {
        if !self.owned.contains(&partition) {
            return;
        }
        if rooms.routes.contains(tag) || self.waiting.contains(tag) {
            self.elsewhere.origin_gone(tag);
            return;
        }
        let durable = rooms.durable.as_deref();
        let unjournaled = durable.is_some_and(|d| d.is_unjournaled(tag));
        if self.elsewhere.is_origins(tag) || unjournaled {
            // Its terminal event is on its way here; it is sent once recorded.
            self.elsewhere.origin_gone(tag);
            return;
        }
        if message.outcome.is_some() {
            // Within the platform's outbox bound, as any rebuilt message (`room.rs`).
            self.rebuild_or_wait(partition, message, rooms.delivery.platforms, fx);
        }
    }
}
