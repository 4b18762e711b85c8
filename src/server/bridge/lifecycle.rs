//! A connection's life over the delivery room: its hello, the errors and refusals it is
//! answered with, closing it and finishing it. Each step works over the connections and the
//! platforms [`Delivery`] borrows for one input, queues the actions that close sockets, and
//! *returns decisions* for what it cannot do itself: what a hello's confirmations release (files,
//! journal records), the platform a hello attached (the cluster's hello registry).

use std::sync::Arc;

use super::super::frame::Frame;
use super::delivery::Delivery;
use super::durable::Durable;
use super::{Action, ConnId};
use crate::journal::Record;
use crate::wire::{ServerOp, check_platform, encode};

/// The `error` line saying `detail`.
pub(super) fn error_line(detail: &str) -> Vec<u8> {
    encode(&ServerOp::Error { detail })
}

/// What results confirmed delivered release, in confirmation order: the files an agent
/// attached leave the spool with their reply (issue 36), and each journaled message leaves
/// the journal (a `delivered` record).
#[derive(Default)]
#[must_use]
pub(super) struct Confirmed(Vec<(Vec<String>, Option<u64>)>);

impl Confirmed {
    /// The actions that carry it out (the journal's only with one).
    pub(super) fn actions(self, mut durable: Option<&mut Durable>) -> Vec<Action> {
        let mut actions = Vec::new();
        for (files, seq) in self.0 {
            if !files.is_empty() {
                actions.push(Action::ReleaseFiles(files));
            }
            if let (Some(seq), Some(d)) = (seq, durable.as_deref_mut()) {
                actions.push(d.record(Record::Delivered { seq }));
            }
        }
        actions
    }
}

/// A hello taken: what its confirmations release, and the platform it attached to (`None`:
/// a hello without a platform).
pub(super) struct Hello {
    pub(super) confirmed: Confirmed,
    pub(super) attached: Option<Arc<str>>,
}

impl Delivery<'_> {
    /// Results delivered (confirmed by an `acks` bridge, acknowledged by their TCP, or
    /// released by switching acks off): each releases its room ([`Delivery::confirm`]).
    pub(super) fn confirm_all(&mut self, frames: Vec<Frame>) -> Confirmed {
        let mut confirmed = Confirmed::default();
        for f in frames {
            let files = f.body.attachment_paths();
            let seq = self.confirm(f);
            confirmed.0.push((files, seq));
        }
        confirmed
    }

    /// A hello from `id` naming `platform` (checked, and opened within `--max-platforms`),
    /// with `acks` (switching it off releases what waited for `delivered`): `id` is
    /// authenticated, leaves its old platform for the new one and is fed its backlog. `None`
    /// when refused (answered with an error) or `id` is gone.
    pub(super) fn hello(
        &mut self,
        id: ConnId,
        platform: Option<String>,
        acks: bool,
    ) -> Option<Hello> {
        let new = match platform {
            None => None,
            Some(name) => {
                if let Err(detail) = check_platform(&name) {
                    self.error(id, &format!("hello: {detail}"));
                    return None;
                }
                let Some(p) = self.platforms.open(&name) else {
                    let max = self.cfg.max_platforms;
                    let detail =
                        format!("hello refused: {max} platforms are active (--max-platforms)");
                    self.error(id, &detail);
                    return None;
                };
                Some(p)
            }
        };
        self.conns.get(id)?;
        let old = self.conns.set_platform(id, new.clone());
        let released = self.conns.set_acks(id, acks);
        let confirmed = self.confirm_all(released);
        self.conns.authenticate(id);
        if let Some(old) = &old {
            self.platforms.detach(old, id);
        }
        if let Some(new) = &new {
            self.platforms.attach(new, id);
        }
        if let Some(old) = old {
            self.platforms.maybe_free(&old);
        }
        self.refill(id);
        Some(Hello {
            confirmed,
            attached: new,
        })
    }

    /// `id` failed to authenticate: answered `unauthorized` (counted, logged within the
    /// budget: a peer causes it) and closing.
    pub(super) fn unauthorized(&mut self, id: ConnId) {
        if let Some(peer) = self.conns.get(id).map(|c| c.peer)
            && let Some(n) = self.conns.refusal_log()
        {
            let more = crate::logfmt::suppressed_note(n);
            log::warn!("connection {id} from {peer}: unauthorized; closing{more}");
        }
        self.stats.count_rejected("unauthorized", 1);
        self.answer(id, error_line("unauthorized"));
        self.set_closing(id);
    }

    /// No further line of `id` counts; it closes once its output is written.
    pub(super) fn set_closing(&mut self, id: ConnId) {
        if let Some(p) = self.conns.set_closing(id) {
            self.platforms.detach(&p, id);
            self.platforms.maybe_free(&p);
        }
    }

    /// Answers `id` with an `error` line (counted).
    pub(super) fn error(&mut self, id: ConnId, detail: &str) {
        self.stats.errors += 1;
        self.answer(id, error_line(detail));
    }

    /// Answers the line `id` sent last with `line`, in line order.
    pub(super) fn answer(&mut self, id: ConnId, line: Vec<u8>) {
        self.conns.push(id, Frame::line(line), self.now);
    }

    /// Closes `id` if it has nothing left to do: closing and written out, or half-closed
    /// with nothing outstanding and every result acknowledged.
    pub(super) fn finish_if_done(&mut self, id: ConnId) {
        let Some(c) = self.conns.get(id) else {
            return;
        };
        if c.closing && c.idle() {
            self.close(id, "closed after error");
        } else if c.read_closed && c.drained() {
            self.close(id, "peer closed");
        }
    }

    /// Closes `id` ([`Delivery::forgotten`]), queueing the action that closes its socket.
    pub(super) fn close(&mut self, id: ConnId, why: &str) {
        if let Some(close) = self.forgotten(id, why) {
            self.actions.push_back(close);
        }
    }

    /// Forgets connection `id` ([`Delivery::forget`]: its unwritten terminal events go back
    /// to the front of their outboxes, in order); the action that closes its socket — a
    /// reset if results went back, so that nothing more of them reaches the peer — unless
    /// it was gone.
    #[must_use]
    pub(super) fn forgotten(&mut self, id: ConnId, why: &str) -> Option<Action> {
        let (peer, moved) = self.forget(id)?;
        log::debug!(
            "connection {id} from {peer} closed: {why}; {moved} undelivered terminal event(s) back to the outbox"
        );
        Some(if moved > 0 {
            Action::Reset(id)
        } else {
            Action::Close(id)
        })
    }
}
