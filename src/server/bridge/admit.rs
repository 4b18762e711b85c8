//! Admission: the one builder that turns a message's fields — from a client's line or from
//! the journal — into a [`Message`], and the pipeline a `message` line goes through (every
//! refusal's wording is in `refusal.rs`).
//!
//! A line is admitted in steps (`Bridge::admit`, in `mod.rs`), each of which may refuse it:
//! its platform (the hello's, or the line's if the connection may name one), the message
//! built from its fields, its platform's duplicate window and outbox room (and the journal's
//! room), then its route and its submission (or its journal record first). Once the runtime
//! decides, the line and its copies get their answer here: [`Routes::accepted`],
//! [`Delivery::refused`].

use std::time::Duration;

use super::conns::Conns;
use super::delivery::Delivery;
use super::platforms::Platforms;
use super::refusal::{Refusal, duplicate_ack, reject_line};
use super::routes::{InFlight, Routes};
use crate::attachments::AttachmentLimits;
use crate::core::AcceptState;

use crate::message::{InvalidInput, Message, SessionKey};
use crate::wire::{MessageFields, ServerOp, encode};

/// Where a message's fields come from, which says what is left to check of its `meta`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Source {
    /// A client's line: the protocol parsed `meta` as an object and serialized it compactly.
    Line,
    /// The journal: `meta` not parsed yet.
    Journal,
}

/// A message that passed every check of its fields.
pub(super) struct Admitted {
    pub(super) message: Message,
    /// Its fields (`platform` set), for its journal record.
    pub(super) fields: MessageFields,
}

/// Builds the message `f` describes on `platform` (which `f.platform` becomes): the one
/// builder of a [`Message`], for a client's line and for a journaled message alike.
pub(super) fn build(
    platform: &str,
    mut f: MessageFields,
    source: Source,
    limits: &AttachmentLimits,
) -> Result<Admitted, Refusal> {
    let key = SessionKey::new(
        platform,
        f.chat_type,
        &f.chat_id,
        f.thread_id.as_deref(),
        f.user_id.as_deref(),
    )?;
    let with_key = |e: InvalidInput| Refusal::from(e).with_session(&key);
    let mut message = Message::new(&f.id, key.clone(), &f.text).map_err(with_key)?;
    message = match (&f.user_id, &f.user_name) {
        (Some(u), name) => message.from_user(u, name.as_deref()).map_err(with_key)?,
        (None, Some(_)) => {
            return Err(with_key(InvalidInput {
                field: "user_name",
                problem: "needs user_id",
            }));
        }
        (None, None) => message,
    };
    message = match (&f.meta, source) {
        (None, _) => message,
        (Some(m), Source::Line) => message.with_object_meta(m).map_err(with_key)?,
        (Some(m), Source::Journal) => message.with_meta(m).map_err(with_key)?,
    };
    debug_assert_eq!(message.context.meta.as_deref(), f.meta.as_deref());
    if !f.attachments.is_empty() {
        // Checked once, when a bridge names the files; a journaled message's were checked
        // then, and its files kept by the start-up sweep.
        if source == Source::Line {
            limits
                .check(&f.attachments)
                .map_err(|e| Refusal::invalid(e).with_session(&key))?;
        }
        message = message.with_attachments(f.attachments.clone());
    }
    f.platform = Some(platform.to_owned());
    Ok(Admitted { message, fields: f })
}

impl Routes {
    /// The runtime accepted the message of `tag`: its line and every copy get their `ack`
    /// (a copy's is a duplicate's), and its duplicate-window entry lasts from now.
    pub(super) fn accepted(
        &mut self,
        tag: u64,
        ack: Vec<u8>,
        platforms: &mut Platforms,
        conns: &mut Conns,
        now: Duration,
    ) {
        let Some(route) = self.get_mut(tag) else {
            return;
        };
        let (conn, copies) = (route.conn, std::mem::take(&mut route.copies));
        platforms.dedup_accepted(&route.platform, route.fp, now);
        for c in std::iter::once(conn).chain(copies) {
            conns.resolve(c, tag, |copy| match copy {
                None => ack.clone(),
                Some((cid, ckey)) => duplicate_ack(cid, ckey),
            });
        }
    }
}

impl Delivery<'_> {
    /// The message of `tag`, whose route `route` was removed, is refused (by the runtime, or
    /// its journal write failed): every line waiting for it gets the `reject` (counted), a
    /// retry of its id is new, and its outbox room goes to what is held.
    pub(super) fn refused(&mut self, tag: u64, route: &InFlight, refusal: Refusal) {
        self.platforms.dedup_forget(&route.platform, route.fp);
        self.platforms.unreserve(&route.platform, None);
        self.release_held(&route.platform);
        self.conns.settled(route.conn);
        let (reason, detail) = (refusal.reason, &refusal.detail);
        let line = |cid: &str, ckey: &SessionKey| reject_line(cid, Some(ckey), reason, detail);
        for &c in std::iter::once(&route.conn).chain(&route.copies) {
            self.conns.resolve(c, tag, |copy| match copy {
                None => line(&route.id, &route.session),
                Some((cid, ckey)) => line(cid, ckey),
            });
        }
        (self.stats).count_rejected(reason, 1 + route.copies.len() as u64);
        self.platforms.maybe_free(&route.platform);
    }
}

/// The `ack` of the message `id` of `session`, accepted in `state` at `position`.
pub(super) fn ack_line(
    id: &str,
    session: &SessionKey,
    state: AcceptState,
    position: usize,
) -> Vec<u8> {
    let state = match state {
        AcceptState::Running => "running",
        AcceptState::Queued => "queued",
    };
    encode(&ServerOp::Ack {
        id,
        session: session.as_str(),
        state,
        position: Some(position),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::StoredMessage;
    use crate::message::ChatType;

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
            attachments: Vec::new(),
        }
    }

    /// What the bridge journals for a message it admitted from a line.
    fn record(a: Admitted, seq: u64) -> StoredMessage {
        StoredMessage {
            seq,
            fields: a.fields,
            dedup_until_ms: 99,
        }
    }

    #[test]
    fn a_line_and_its_journal_record_build_the_same_message() {
        let from_line = build(
            "tg",
            fields(Some(r#"{"k":1}"#)),
            Source::Line,
            &AttachmentLimits::default(),
        )
        .expect("line");
        let message = from_line.message.clone();
        let stored = record(from_line, 5);
        assert_eq!((stored.seq, stored.platform()), (5, "tg"));
        let again = build(
            stored.platform(),
            stored.fields.clone(),
            Source::Journal,
            &AttachmentLimits::default(),
        );
        let again = again.expect("record");
        assert_eq!(again.message, message);
        assert_eq!(again.message.context.meta.as_deref(), Some(r#"{"k":1}"#));
    }

    #[test]
    fn refusals_name_the_session_once_it_is_known() {
        let mut m = fields(None);
        m.chat_id = String::new();
        let r = build("tg", m, Source::Line, &AttachmentLimits::default())
            .err()
            .expect("no chat id");
        assert_eq!((r.reason, r.session.is_none()), ("invalid", true));
        let mut m = fields(None);
        m.user_id = None;
        let r = build("tg", m, Source::Line, &AttachmentLimits::default())
            .err()
            .expect("a name without an id");
        assert_eq!(r.detail, "user_name: needs user_id");
        assert!(r.session.is_some());
        let mut s = record(
            build(
                "tg",
                fields(None),
                Source::Line,
                &AttachmentLimits::default(),
            )
            .expect("ok"),
            1,
        );
        s.fields.meta = Some("[1]".into());
        let r = build(
            s.platform(),
            s.fields.clone(),
            Source::Journal,
            &AttachmentLimits::default(),
        )
        .err()
        .expect("bad stored meta");
        assert!(
            r.after_restart()
                .starts_with("not admitted again after a restart: meta")
        );
    }
}
