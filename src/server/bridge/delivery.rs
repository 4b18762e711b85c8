//! Delivery: a message's outcome on its way to the connection that shows it — the terminal
//! line, its charge on the platform's outbox, the outbox, the connection's output, and what
//! the peer confirmed.
//!
//! `Delivery` is the room the bridge hands a result (and a partial or typing line) to: it
//! works over the connections and the platforms it is given, for one input, queues the
//! closing of the sockets it finishes, and *returns decisions* for what it cannot do
//! itself — the messages to journal as delivered ([`Delivery::confirm`],
//! [`Delivery::drop_stale`]) — so the bridge never reaches into the outbox or a
//! connection's queues to move a result.
//!
//! Rules (see the bridge's module documentation): a terminal event goes to the connection
//! that sent the message while it is open, else to its platform's outbox, which feeds the
//! newest connection that said hello for the platform as fast as that connection reads; a
//! result is charged on the outbox's `--outbox-bytes` when it goes and held, in order, until
//! it fits; a confirmed result releases its reservation and its charge, and what is held
//! goes on.

use std::collections::VecDeque;
use std::io::{self, Write};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use super::super::frame::{Flushed, Frame};
use super::config::BridgeConfig;
use super::conns::Conns;
use super::platforms::Platforms;
use super::status::Counters;
use super::{Action, ConnId};
use crate::core::Outcome;
use crate::message::SessionKey;
use crate::wire::{EncodedLine, ServerOp, TextOp, encode};

/// The delivery room over the bridge's connections and platforms, for one input.
pub(super) struct Delivery<'a> {
    pub(super) cfg: &'a BridgeConfig,
    pub(super) conns: &'a mut Conns,
    pub(super) platforms: &'a mut Platforms,
    /// Where what is dropped is counted.
    pub(super) stats: &'a mut Counters,
    /// The bridge's queue of actions for the shell: the sockets this room closes.
    pub(super) actions: &'a mut VecDeque<Action>,
    /// The time of the input.
    pub(super) now: Duration,
}

impl Delivery<'_> {
    /// Sends a terminal event to the message's connection, else its platform's outbox —
    /// once it fits the platform's `--outbox-bytes`: until then it is held, in order
    /// (its bytes are charged when it goes, released by [`Delivery::confirm`]).
    pub(super) fn deliver(&mut self, origin: ConnId, platform: &Arc<str>, frame: Frame) {
        if let Some((origin, frame)) = self.platforms.admit_result(platform, origin, frame) {
            self.send(origin, platform, frame);
        }
    }

    /// A charged result goes to its connection while that is open, else to the outbox.
    fn send(&mut self, origin: ConnId, platform: &Arc<str>, frame: Frame) {
        if self.conns.is_open(origin) {
            return self.conns.push(origin, frame, self.now);
        }
        self.platforms.push_outbox(platform, frame);
        self.refill_newest(platform);
    }

    /// Room freed on `platform`: the held results that now fit go, in order.
    pub(super) fn release_held(&mut self, platform: &Arc<str>) {
        for (origin, frame) in self.platforms.release_held(platform) {
            self.send(origin, platform, frame);
        }
    }

    /// A result's reservation on `platform` is given back without a result (another
    /// instance sends it, or its message left this one): what is held goes, and the
    /// platform is freed if nothing else holds it.
    pub(super) fn give_back(&mut self, platform: &Arc<str>) {
        self.platforms.unreserve(platform, None);
        self.release_held(platform);
        self.platforms.maybe_free(platform);
    }

    /// A terminal event was delivered (confirmed by an `acks` bridge, or acknowledged by its
    /// TCP): its reservation is released and what is held goes on. Returns the message to
    /// journal as delivered (it leaves the journal), if it was journaled.
    #[must_use]
    pub(super) fn confirm(&mut self, f: Frame) -> Option<u64> {
        let p = f.terminal_for?;
        self.platforms.unreserve(&p, Some(&f.body));
        self.release_held(&p);
        self.platforms.maybe_free(&p);
        (f.seq != 0).then_some(f.seq)
    }

    /// Results owed to platforms absent past `--outbox-stale-after`, beyond the newest
    /// `--outbox-stale-keep`, are dropped — each with a WARN naming its session and
    /// message, counted in the status — and their room goes to what is held. Returns the
    /// messages to journal as delivered (they leave the journal: nobody will take them).
    #[must_use]
    pub(super) fn drop_stale(&mut self) -> Vec<u64> {
        let dropped = self.platforms.drop_stale(self.now);
        let mut delivered = Vec::new();
        let mut touched: Vec<Arc<str>> = Vec::new();
        for (platform, f) in dropped {
            let id = f.msg_id.as_deref().unwrap_or("?");
            log::warn!(
                "session {}: message {id}: result dropped undelivered: platform {platform} said no hello for {:?} (--outbox-stale-after) and is owed more than {} results (--outbox-stale-keep)",
                session_of(&f.body),
                self.cfg.outbox_stale_after,
                self.cfg.outbox_stale_keep,
            );
            self.stats.stale_dropped += 1;
            if f.seq != 0 {
                delivered.push(f.seq);
            }
            if !touched.contains(&platform) {
                touched.push(platform);
            }
        }
        for p in touched {
            self.release_held(&p);
            self.platforms.maybe_free(&p);
        }
        delivered
    }

    /// Whether `id` is the newest connection that said hello for its platform and that
    /// platform has a backlog.
    pub(super) fn backlog_for(&self, id: ConnId) -> bool {
        let Some(platform) = self.conns.get(id).and_then(|c| c.platform.as_deref()) else {
            return false;
        };
        self.platforms.newest_hello(platform) == Some(id) && self.platforms.has_backlog(platform)
    }

    /// Feeds `id` its platform's backlog while its queued output is under its bound, if it is
    /// the newest connection that said hello for it.
    pub(super) fn refill(&mut self, id: ConnId) {
        if !self.backlog_for(id) {
            return;
        }
        let Some(platform) = self.conns.get(id).and_then(|c| c.platform.clone()) else {
            return;
        };
        let platforms = &mut *self.platforms;
        self.conns
            .fill(id, self.now, || platforms.pop_outbox(&platform));
    }

    /// Feeds the newest connection that said hello for `platform`, if any.
    pub(super) fn refill_newest(&mut self, platform: &str) {
        if let Some(newest) = self.platforms.newest_hello(platform) {
            self.refill(newest);
        }
    }

    /// A partial reply of message `id` goes to its connection `conn` if that has room; else
    /// it is dropped (and counted).
    pub(super) fn partial(&mut self, conn: Option<ConnId>, id: &str, session: &str, text: String) {
        let Some(conn) = conn.filter(|&c| self.conns.has_room(c)) else {
            self.stats.partials_dropped += 1;
            return;
        };
        let mut text = text;
        crate::text::truncate(&mut text, self.cfg.max_reply_bytes);
        let body = EncodedLine::text_op(TextOp::Partial, id, session, text);
        self.conns.push(conn, Frame::new(body, None), self.now);
    }

    /// A typing line for `session`: to `conn` while it is open, else to the platform's
    /// newest connection; dropped (and counted) when that one's output is over its bound.
    pub(super) fn typing(&mut self, conn: ConnId, session: &SessionKey, on: bool) {
        let target = Some(conn)
            .filter(|&c| self.conns.is_open(c))
            .or_else(|| self.platforms.newest_hello(session.platform()))
            .filter(|&c| self.conns.under_bound(c));
        let Some(target) = target else {
            self.stats.typing_dropped += 1;
            return;
        };
        let line = encode(&ServerOp::Typing {
            session: session.as_str(),
            platform: session.platform(),
            chat_id: session.chat_id(),
            on,
        });
        self.conns.push(target, Frame::line(line), self.now);
    }

    /// Writes `id`'s output into `w`, at most `budget` bytes, feeding it its platform's
    /// backlog as it goes. A write error is returned.
    pub(super) fn write<W: Write + ?Sized>(
        &mut self,
        id: ConnId,
        w: &mut W,
        mut budget: usize,
    ) -> io::Result<Flushed> {
        let how = loop {
            self.refill(id);
            if self.conns.get(id).is_none() {
                return Ok(Flushed::All);
            }
            let (n, how) = self.conns.write_out(id, w, budget, self.now)?;
            budget -= n.min(budget);
            if how != Flushed::All || budget == 0 || !self.backlog_for(id) {
                break how;
            }
        };
        // This pass was its turn (the budget is per wake): only new output marks it again.
        self.conns.clear_dirty(id);
        Ok(how)
    }

    /// Forgets connection `id`: its unwritten terminal events go back to the front of their
    /// outboxes, in order, and on to the platforms' newest hellos. Returns its peer and how
    /// many went back, if it was open.
    pub(super) fn forget(&mut self, id: ConnId) -> Option<(IpAddr, usize)> {
        let gone = self.conns.remove(id)?;
        let moved = gone.undelivered.len();
        let mut touched: Vec<Arc<str>> = Vec::new();
        for f in gone.undelivered.into_iter().rev() {
            let Some(name) = f.terminal_for.clone() else {
                continue;
            };
            self.platforms.push_outbox_front(&name, f);
            if !touched.contains(&name) {
                touched.push(name);
            }
        }
        if let Some(p) = gone.platform {
            self.platforms.detach(&p, id);
            if !touched.contains(&p) {
                touched.push(p);
            }
        }
        for name in touched {
            self.refill_newest(&name);
            self.platforms.maybe_free(&name);
        }
        Some((gone.peer, moved))
    }
}

/// The session a terminal event names (for a WARN): its line, or its head closed off.
fn session_of(body: &EncodedLine) -> String {
    let line: Vec<u8> = match body {
        EncodedLine::Line(l) => l.clone(),
        EncodedLine::Text { head, .. } => [head.as_slice(), b"\"}"].concat(),
    };
    serde_json::from_slice::<serde_json::Value>(&line)
        .ok()
        .and_then(|v| v.get("session")?.as_str().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

/// The terminal event of `outcome`, its text cut to `max` bytes.
pub(super) fn terminal_line(id: &str, session: &str, outcome: Outcome, max: usize) -> EncodedLine {
    match outcome {
        Outcome::Reply(mut reply) => {
            let mut text = std::mem::take(&mut reply.text);
            let cut = crate::text::truncate(&mut text, max);
            let truncated = reply.truncated || cut;
            EncodedLine::reply(id, session, text, truncated, reply.attachments())
        }
        Outcome::Failed(e) => failed_line(id, session, e.to_string(), max),
        Outcome::Cancelled(r) => EncodedLine::Line(encode(&ServerOp::Cancelled {
            id,
            session,
            reason: r.as_str(),
        })),
        Outcome::Merged { into } => EncodedLine::Line(encode(&ServerOp::Merged {
            id,
            session,
            into: &into,
        })),
    }
}

/// A `failed` terminal event saying `why`, cut to `max` bytes.
pub(super) fn failed_line(id: &str, session: &str, mut why: String, max: usize) -> EncodedLine {
    crate::text::truncate(&mut why, max);
    EncodedLine::text_op(TextOp::Failed, id, session, why)
}
