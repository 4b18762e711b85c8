//! The access policy's seam in the bridge (issue 32): every message the bridge would submit
//! to the runtime — a new one, one the journal made durable, one recovered — is first
//! decided by [`Policy::decide`](crate::access::Policy). A message answered here with a
//! notice gets the same single terminal outcome as any (its ack, its outcome record with a
//! journal, its outbox room, its duplicate window): a `reply` carrying `"notice"`, and no
//! agent runs for it.
//!
//! [`Access`] is the room: the policy and the wall clock its days and codes are kept in. It
//! answers with decisions (a notice to send, a `may_use` line) and the bridge carries them
//! out (`Bridge::submit`; a message answered with a notice ends in [`Routes::answered`]).

use std::time::Duration;

use super::admit::ack_line;
use super::conns::Conns;
use super::platforms::Platforms;
use super::routes::{Routes, Terminal};
use crate::access::{AccessConfig, AccessFigures, Charge, Decision, Notice, Policy};
use crate::core::{AcceptState, Outcome};
use crate::message::Message;
use crate::wire::{EncodedLine, ServerOp, encode};

/// The access policy, on the wall clock.
pub(super) struct Access {
    policy: Policy,
    /// Wall-clock ms since the epoch at time zero of the bridge's clock (the policy's days
    /// and codes).
    wall_at_zero: u64,
}

impl Access {
    pub(super) fn new(cfg: AccessConfig) -> Access {
        Access {
            policy: Policy::new(cfg),
            wall_at_zero: 0,
        }
    }

    pub(super) fn set_wall_clock(&mut self, epoch_ms: u64) {
        self.wall_at_zero = epoch_ms;
    }

    /// The wall-clock time of the bridge's `now`.
    fn wall_ms(&self, now: Duration) -> u64 {
        self.wall_at_zero + now.as_millis() as u64
    }

    /// The policy's word on `message` at `now`: submit it (with whose budget its turn
    /// spends, kept in its route), or the notice that answers it instead.
    pub(super) fn decide(
        &mut self,
        message: &Message,
        now: Duration,
    ) -> Result<Option<Charge>, (Notice, String)> {
        match self.policy.decide(message, self.wall_ms(now)) {
            Decision::Admit => Ok(self.policy.track(message)),
            Decision::Answer { notice, text } => {
                log::debug!(
                    "session {}: message {} answered by the access policy: {}",
                    message.session,
                    message.id,
                    notice.as_str()
                );
                Err((notice, text))
            }
        }
    }

    /// A message ended with `outcome`: a reply's tokens count against the budget of its
    /// route's `charge`.
    pub(super) fn charge(&mut self, charge: Option<Charge>, outcome: &Outcome, now: Duration) {
        let tokens = match outcome {
            Outcome::Reply(r) => r.tokens,
            _ => None,
        };
        self.policy.charge(charge, tokens, self.wall_ms(now));
    }

    /// The answer to a `may_use` query `id` from a connection whose hello named `hello`: the
    /// `may_use` line with the policy's word, or the error (no platform). Its platform is the
    /// query's, else the hello's.
    pub(super) fn may_use(
        &self,
        hello: Option<&str>,
        id: &str,
        platform: Option<&str>,
        user: &str,
        chat: Option<&str>,
    ) -> Result<Vec<u8>, &'static str> {
        let Some(platform) = platform.or(hello) else {
            return Err("may_use: no platform (give one, or say hello with one)");
        };
        let allowed = self.policy.may_use(platform, user, chat);
        log::debug!("access: may_use {platform} {user}: {allowed}");
        Ok(encode(&ServerOp::MayUse { id, allowed }))
    }

    /// Saves the policy's state if it changed (off the reactor).
    pub(super) fn maybe_save(&mut self, now: Duration) {
        self.policy.maybe_save(self.wall_ms(now));
    }

    pub(super) fn figures(&self) -> AccessFigures {
        self.policy.figures()
    }

    /// The policy, for the shell (persisting, sharing, admin commands, the start-up log),
    /// with the wall-clock time of `now`.
    pub(super) fn policy(&mut self, now: Duration) -> (&mut Policy, u64) {
        let wall_ms = self.wall_ms(now);
        (&mut self.policy, wall_ms)
    }
}

/// The terminal `reply` that carries a notice for `m`, its text cut to `max` bytes.
pub(super) fn notice_line(
    m: &Message,
    notice: Notice,
    mut text: String,
    max: usize,
) -> EncodedLine {
    crate::text::truncate(&mut text, max);
    EncodedLine::Line(encode(&ServerOp::Reply {
        id: &m.id,
        session: m.session.as_str(),
        text: &text,
        truncated: false,
        notice: Some(notice.as_str()),
        attachments: Vec::new(),
    }))
}

impl Routes {
    /// The message of `tag` is answered without running, with `body` (the access policy's
    /// notice): acked as a turn that ran at once, its route ends; its terminal event, or
    /// `None` without the route.
    pub(super) fn answered(
        &mut self,
        tag: u64,
        m: &Message,
        body: EncodedLine,
        platforms: &mut Platforms,
        conns: &mut Conns,
        now: Duration,
    ) -> Option<Terminal> {
        let ack = ack_line(&m.id, &m.session, AcceptState::Running, 0);
        self.accepted(tag, ack, platforms, conns, now);
        let route = self.remove(tag)?;
        debug_assert_eq!(&*route.platform, m.session.platform());
        conns.settled(route.conn);
        Some(Terminal::of(tag, route, body))
    }
}
