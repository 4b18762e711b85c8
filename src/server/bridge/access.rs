//! The access policy's seam in the bridge (issue 32): every message the bridge would submit
//! to the runtime — a new one, one the journal made durable, one recovered — is first
//! decided by [`Policy::decide`](crate::access::Policy). A message answered here with a
//! notice gets the same single terminal outcome as any (its ack, its outcome record with a
//! journal, its outbox room, its duplicate window): a `reply` carrying `"notice"`, and no
//! agent runs for it.

use super::{Action, Bridge, ConnId};
use crate::access::{Decision, Notice};
use crate::core::{AcceptState, Outcome};
use crate::message::Message;
use crate::wire::{EncodedLine, ServerOp, encode};

impl Bridge {
    /// Submits the message of `tag` to the runtime, or answers it with the policy's notice.
    pub(super) fn submit(&mut self, tag: u64, message: Message) {
        let wall_ms = self.wall_at_zero + self.now.as_millis() as u64;
        match self.access.decide(&message, wall_ms) {
            Decision::Admit => {
                self.access.track(tag, &message);
                self.actions.push_back(Action::Submit { tag, message });
            }
            Decision::Answer { notice, text } => self.answer_notice(tag, &message, notice, text),
        }
    }

    /// The message of `tag` ended with `outcome`: a reply's tokens count against its user's
    /// budget.
    pub(super) fn charge_tokens(&mut self, tag: u64, outcome: &Outcome) {
        let tokens = match outcome {
            Outcome::Reply(r) => r.tokens,
            _ => None,
        };
        let wall_ms = self.wall_at_zero + self.now.as_millis() as u64;
        self.access.charge(tag, tokens, wall_ms);
    }

    /// Acks the message of `tag` as a turn that ran at once, then ends it with the notice.
    fn answer_notice(&mut self, tag: u64, m: &Message, notice: Notice, mut text: String) {
        let platform = m.session.platform();
        log::debug!(
            "session {}: message {} answered by the access policy: {}",
            m.session,
            m.id,
            notice.as_str()
        );
        let now = self.now;
        self.handle_accepted(tag, (&m.id, &m.session), AcceptState::Running, 0, now);
        let Some(route) = self.routes.remove(tag) else {
            return;
        };
        debug_assert_eq!(&*route.platform, platform);
        self.conns.settled(route.conn);
        self.release_files(route.files.as_deref());
        crate::text::truncate(&mut text, self.cfg.max_reply_bytes);
        let body = EncodedLine::Line(encode(&ServerOp::Reply {
            id: &m.id,
            session: m.session.as_str(),
            text: &text,
            truncated: false,
            notice: Some(notice.as_str()),
            attachments: Vec::new(),
        }));
        self.terminal(tag, route.conn, &route.platform, route.id, body);
    }
}

impl Bridge {
    /// A `may_use` query from `conn`: answered in line order with the policy's word. Its
    /// platform is the query's, else the connection's hello platform.
    pub(super) fn may_use(
        &mut self,
        conn: ConnId,
        id: &str,
        platform: Option<&str>,
        user: &str,
        chat: Option<&str>,
    ) {
        let hello = self.conns.get(conn).and_then(|c| c.platform.clone());
        let Some(platform) = platform.or(hello.as_deref()) else {
            self.error(
                conn,
                "may_use: no platform (give one, or say hello with one)",
            );
            return;
        };
        let allowed = self.access.may_use(platform, user, chat);
        log::debug!("access: may_use {platform} {user}: {allowed}");
        self.answer(conn, encode(&ServerOp::MayUse { id, allowed }));
    }

    /// Keeps the policy's state in `dir/access.json` (loaded now, saved off the reactor).
    pub(in crate::server) fn persist_access(
        &mut self,
        dir: &std::path::Path,
    ) -> std::io::Result<()> {
        self.access.persist_in(dir)
    }

    /// Shares the policy's state through `store` (`--cluster`): loaded now, merged both ways
    /// off the reactor from then on.
    #[cfg(feature = "cli")] // set up by `serve --cluster`
    pub(in crate::server) fn share_access(
        &mut self,
        store: Box<dyn crate::access::shared::SharedStore>,
    ) -> std::io::Result<()> {
        self.access.share(store)
    }

    /// Runs an admin command from outside the chat (`turnstile access`): `command` is its
    /// words without the `!`.
    #[cfg(feature = "cli")] // called by `turnstile access` through serve's HTTP endpoint
    pub(in crate::server) fn access_command(
        &mut self,
        platform: &str,
        command: &str,
    ) -> Result<String, String> {
        let wall_ms = self.wall_at_zero + self.now.as_millis() as u64;
        self.access.operate(platform, command, wall_ms)
    }

    /// Logs the mode in force per platform (once, at start-up).
    pub(in crate::server) fn log_access(&self) {
        self.access.log_summary();
    }
}
