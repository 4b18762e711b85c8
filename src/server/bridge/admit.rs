//! Admission: the one builder that turns a message's fields — from a client's line or from
//! the journal — into a [`Message`], and the pipeline a `message` line goes through (every
//! refusal's wording is in `refusal.rs`).
//!
//! A line is admitted in steps, each of which may refuse it: its platform (the hello's, or
//! the line's if the connection may name one), the message built from its fields, its
//! platform's duplicate window and outbox room (and the journal's room), then its route and
//! its submission (or its journal record first).

use std::sync::Arc;
use std::time::Duration;

use super::super::dedup::{Fingerprint, fingerprint};
use super::conns::Answer;
use super::platforms::Claim;
use super::refusal::{Refusal, duplicate_ack};
use super::routes::{InFlight, Phase};
use super::{Action, Bridge, ConnId};
use crate::core::AcceptState;
use crate::journal::StoredMessage;
use crate::message::{ChatType, InvalidInput, Message, SessionKey};
use crate::wire::{MessageFields, ServerOp, check_platform, encode};

/// A platform's metadata (a JSON object, serialized), and whether it was already parsed.
pub(super) enum Meta {
    /// From a client's line: the protocol parsed it as an object and serialized it compactly.
    Parsed(String),
    /// From the journal: not parsed yet.
    Stored(String),
}

impl Meta {
    fn as_str(&self) -> &str {
        match self {
            Meta::Parsed(m) | Meta::Stored(m) => m,
        }
    }
}

/// A message's fields, before they are checked.
pub(super) struct Draft {
    platform: String,
    id: String,
    chat_type: ChatType,
    chat_id: String,
    thread_id: Option<String>,
    user_id: Option<String>,
    user_name: Option<String>,
    meta: Option<Meta>,
    text: String,
}

impl Draft {
    /// The fields of a client's `message` line, for `platform`.
    pub(super) fn from_line(platform: &str, m: MessageFields) -> Draft {
        Draft {
            platform: platform.to_owned(),
            id: m.id,
            chat_type: m.chat_type,
            chat_id: m.chat_id,
            thread_id: m.thread_id,
            user_id: m.user_id,
            user_name: m.user_name,
            meta: m.meta.map(Meta::Parsed),
            text: m.text,
        }
    }

    /// The fields of a journaled message.
    pub(super) fn from_stored(m: &StoredMessage) -> Result<Draft, Refusal> {
        let chat_type = ChatType::parse(&m.chat_type).ok_or(InvalidInput {
            field: "chat_type",
            problem: "unknown",
        })?;
        Ok(Draft {
            platform: m.platform.clone(),
            id: m.id.clone(),
            chat_type,
            chat_id: m.chat_id.clone(),
            thread_id: m.thread_id.clone(),
            user_id: m.user_id.clone(),
            user_name: m.user_name.clone(),
            meta: m.meta.clone().map(Meta::Stored),
            text: m.text.clone(),
        })
    }

    /// The journal record of the admitted message `seq`.
    fn into_stored(self, seq: u64, dedup_until_ms: u64) -> StoredMessage {
        StoredMessage {
            seq,
            platform: self.platform,
            id: self.id,
            chat_type: self.chat_type.as_str().to_string(),
            chat_id: self.chat_id,
            thread_id: self.thread_id,
            user_id: self.user_id,
            user_name: self.user_name,
            meta: self.meta.map(|m| match m {
                Meta::Parsed(m) | Meta::Stored(m) => m,
            }),
            text: self.text,
            dedup_until_ms,
        }
    }
}

/// A message that passed every check of its fields.
pub(super) struct Admitted {
    pub(super) message: Message,
    /// Its fields, for its journal record.
    draft: Draft,
}

/// Builds the message `d` describes: the one builder of a [`Message`], for a client's line
/// and for a journaled message alike.
pub(super) fn build(d: Draft) -> Result<Admitted, Refusal> {
    let key = SessionKey::new(
        &d.platform,
        d.chat_type,
        &d.chat_id,
        d.thread_id.as_deref(),
        d.user_id.as_deref(),
    )?;
    let with_key = |e: InvalidInput| Refusal::from(e).with_session(&key);
    let mut message = Message::new(&d.id, key.clone(), &d.text).map_err(with_key)?;
    message = match (&d.user_id, &d.user_name) {
        (Some(u), name) => message.from_user(u, name.as_deref()).map_err(with_key)?,
        (None, Some(_)) => {
            return Err(with_key(InvalidInput {
                field: "user_name",
                problem: "needs user_id",
            }));
        }
        (None, None) => message,
    };
    message = match &d.meta {
        None => message,
        Some(Meta::Parsed(m)) => message.with_object_meta(m).map_err(with_key)?,
        Some(Meta::Stored(m)) => message.with_meta(m).map_err(with_key)?,
    };
    debug_assert_eq!(
        message.context.meta.as_deref(),
        d.meta.as_ref().map(Meta::as_str)
    );
    Ok(Admitted { message, draft: d })
}

impl Bridge {
    /// A `message` line from `conn`: admitted, or answered with a `reject`.
    pub(super) fn handle_message(&mut self, conn: ConnId, m: MessageFields, now: Duration) {
        let id = m.id.clone();
        if let Err(refusal) = self.admit(conn, m, now) {
            self.answer_refusal(conn, &id, refusal);
        }
    }

    fn admit(&mut self, conn: ConnId, m: MessageFields, now: Duration) -> Result<(), Refusal> {
        let Some(name) = self.sender_platform(conn, m.platform.as_deref())? else {
            return Ok(());
        };
        let admitted = build(Draft::from_line(&name, m))?;
        let fp = fingerprint(&admitted.message.id);
        let (durable, routes) = (self.durable.as_ref(), &mut self.routes);
        let (platform, claim) = self
            .platforms
            .claim(
                &name,
                fp,
                now,
                || durable.map_or(Ok(()), |d| d.room()),
                || routes.new_tag(),
            )
            .map_err(|r| r.with_session(&admitted.message.session))?;
        match claim {
            Claim::Duplicate => {
                let m = &admitted.message;
                self.answer(conn, duplicate_ack(&m.id, &m.session));
            }
            Claim::CopyOf(tag) => {
                if let Some(route) = self.routes.get_mut(tag) {
                    route.copies.push(conn);
                }
                let m = admitted.message;
                let copy = Some((m.id, m.session));
                self.conns
                    .push_answer(conn, Answer::Pending { tag, copy }, now);
            }
            Claim::New(tag) => self.launch(conn, tag, platform, fp, admitted, now),
        }
        Ok(())
    }

    /// The platform a message from `conn` is for (`None`: no such connection): the one its
    /// line names, else its hello's; with a token, only its hello's.
    fn sender_platform(
        &self,
        conn: ConnId,
        named: Option<&str>,
    ) -> Result<Option<String>, Refusal> {
        let Some(c) = self.conns.get(conn) else {
            return Ok(None);
        };
        let hello = c.platform.as_deref();
        let Some(name) = named.or(hello) else {
            return Err(Refusal::no_platform());
        };
        if self.conns.token_required() && hello != Some(name) {
            return Err(Refusal::not_its_platform(hello));
        }
        check_platform(name).map_err(Refusal::invalid)?;
        Ok(Some(name.to_owned()))
    }

    /// A new message takes its route and its place in its connection's answers, then goes to
    /// the runtime — or, with a journal, to the journal first.
    fn launch(
        &mut self,
        conn: ConnId,
        tag: u64,
        platform: Arc<str>,
        fp: Fingerprint,
        admitted: Admitted,
        now: Duration,
    ) {
        let Admitted { message, draft } = admitted;
        let mut route = InFlight::new(
            conn,
            message.id.clone(),
            message.session.clone(),
            platform,
            fp,
        );
        if self.durable.is_some() {
            route.phase = Phase::Journaling;
        }
        self.routes.insert(tag, route);
        self.conns.sent(conn);
        self.conns
            .push_answer(conn, Answer::Pending { tag, copy: None }, now);
        let Some(d) = &mut self.durable else {
            return self.actions.push_back(Action::Submit { tag, message });
        };
        let stored = draft.into_stored(tag, d.wall_ms(now + self.cfg.dedup_window));
        log::debug!("message {tag} waits for the journal");
        self.actions.push_back(d.wait(tag, message, stored));
    }

    /// Answers a line with the `reject` of `refusal`.
    pub(super) fn answer_refusal(&mut self, conn: ConnId, id: &str, refusal: Refusal) {
        self.stats.count_rejected(refusal.reason, 1);
        let line = encode(&ServerOp::Reject {
            id,
            session: refusal.session.as_ref().map(SessionKey::as_str),
            reason: refusal.reason,
            detail: &refusal.detail,
        });
        self.answer(conn, line);
    }

    /// The runtime accepted the message of `tag`: its line and every copy get their ack.
    pub(super) fn handle_accepted(
        &mut self,
        tag: u64,
        (id, session): (&str, &SessionKey),
        state: AcceptState,
        position: usize,
        now: Duration,
    ) {
        let Some(route) = self.routes.get_mut(tag) else {
            return;
        };
        let (conn, copies) = (route.conn, std::mem::take(&mut route.copies));
        self.platforms
            .dedup_accepted(&route.platform, route.fp, now);
        let state = match state {
            AcceptState::Running => "running",
            AcceptState::Queued => "queued",
        };
        let ack = encode(&ServerOp::Ack {
            id,
            session: session.as_str(),
            state,
            position: Some(position),
        });
        for c in std::iter::once(conn).chain(copies) {
            self.conns.resolve(c, tag, |copy| match copy {
                None => ack.clone(),
                Some((cid, ckey)) => duplicate_ack(cid, ckey),
            });
        }
    }

    /// Refuses the message of `tag` (runtime refusal or journal failure): every line waiting
    /// for it gets the `reject`, and a retry of its id is new.
    pub(super) fn refuse(&mut self, tag: u64, refusal: Refusal) {
        let Some(route) = self.routes.remove(tag) else {
            return;
        };
        self.platforms.dedup_forget(&route.platform, route.fp);
        self.platforms.unreserve(&route.platform, None);
        self.delivery().release_held(&route.platform);
        self.conns.settled(route.conn);
        let Refusal { reason, detail, .. } = refusal;
        let line = |cid: &str, ckey: &SessionKey| {
            encode(&ServerOp::Reject {
                id: cid,
                session: Some(ckey.as_str()),
                reason,
                detail: &detail,
            })
        };
        for &c in std::iter::once(&route.conn).chain(&route.copies) {
            self.conns.resolve(c, tag, |copy| match copy {
                None => line(&route.id, &route.session),
                Some((cid, ckey)) => line(cid, ckey),
            });
        }
        self.stats
            .count_rejected(reason, 1 + route.copies.len() as u64);
        self.platforms.maybe_free(&route.platform);
        self.maybe_finish(route.conn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(meta: Option<&str>) -> MessageFields {
        MessageFields {
            id: "m1".into(),
            platform: None,
            chat_type: ChatType::Group,
            chat_id: "c".into(),
            thread_id: None,
            user_id: Some("u".into()),
            user_name: Some("Ann".into()),
            meta: meta.map(Into::into),
            text: "hello".into(),
        }
    }

    #[test]
    fn a_line_and_its_journal_record_build_the_same_message() {
        let from_line = build(Draft::from_line("tg", fields(Some(r#"{"k":1}"#)))).expect("line");
        let stored = from_line.draft.into_stored(5, 99);
        assert_eq!((stored.seq, stored.dedup_until_ms), (5, 99));
        let again = build(Draft::from_stored(&stored).expect("draft")).expect("record");
        assert_eq!(again.message, from_line.message);
        assert_eq!(again.message.context.meta.as_deref(), Some(r#"{"k":1}"#));
    }

    #[test]
    fn refusals_name_the_session_once_it_is_known() {
        let mut m = fields(None);
        m.chat_id = String::new();
        let r = build(Draft::from_line("tg", m)).err().expect("no chat id");
        assert_eq!((r.reason, r.session.is_none()), ("invalid", true));
        let mut m = fields(None);
        m.user_id = None;
        let r = build(Draft::from_line("tg", m))
            .err()
            .expect("a name without an id");
        assert_eq!(r.detail, "user_name: needs user_id");
        assert!(r.session.is_some());
        let mut s = build(Draft::from_line("tg", fields(None)))
            .expect("ok")
            .draft
            .into_stored(1, 0);
        s.meta = Some("[1]".into());
        let r = build(Draft::from_stored(&s).expect("draft"))
            .err()
            .expect("bad stored meta");
        assert!(
            r.after_restart()
                .starts_with("not admitted again after a restart: meta")
        );
    }
}
