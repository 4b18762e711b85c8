//! The [`Renderer`] of the WebSocket bridges (Discord, Slack): gateway results, partials,
//! notices and typing as platform calls ([`ReplyApi`]), results first, under the rate limits.
//!
//! A reply is one message answering the user's, edited in place as partials come, never with
//! the text it already shows; only the newest pending partial of a reply is kept. A text
//! over the platform's limit fills the message and continues in new ones.

use std::collections::{HashMap, VecDeque};
use std::str::FromStr;
use std::time::{Duration, Instant};

use crate::message::SessionKey;
use crate::platforms::BridgeError;
use crate::platforms::gateway::TerminalEvent;
use crate::platforms::split::{Limit, split};

/// A typing indicator lasts 10 s on Discord: renewed this often while a turn runs.
pub(crate) const TYPING_RENEW: Duration = Duration::from_secs(8);

/// How a platform call failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum CallError {
    /// Rate limited (a 429, or a limit known to be reached): call nothing on this route (or,
    /// for a global limit, at all) before this instant.
    Wait(Instant),
    /// The token is wrong. Fatal.
    Unauthorized(String),
    /// This call will never work (channel gone, no permission, …).
    Permanent(String),
    /// Network trouble or a 5xx: try again later.
    Transient(String),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Wait(at) => write!(
                f,
                "rate limited for {:?}",
                at.saturating_duration_since(Instant::now())
            ),
            CallError::Unauthorized(d) | CallError::Permanent(d) | CallError::Transient(d) => {
                f.write_str(d)
            }
        }
    }
}

/// What the renderer asks of a platform.
pub(crate) trait ReplyApi {
    /// The most one message shows.
    fn limit(&self) -> Limit;
    /// The platform message a gateway id answers (what a reply refers to).
    fn reply_target(&self, id: &str) -> Option<String>;
    /// Posts `text` in `channel`: piece `piece` of the reply to message `answers`, or, with
    /// no piece, a notice about it. The new message's id. The same piece of the same reply
    /// is the same post on every try: a platform that can refuse to create a message twice
    /// uses that, so a post repeated after a crash (shown, not yet confirmed to the gateway)
    /// returns the first message instead of a second one.
    fn post(
        &mut self,
        channel: &str,
        answers: Option<&str>,
        piece: Option<usize>,
        text: &str,
    ) -> Result<String, CallError>;
    /// Replaces message `message`'s text.
    fn edit(&mut self, channel: &str, message: &str, text: &str) -> Result<(), CallError>;
    /// Shows that a turn runs in `channel` (a no-op where the platform has no such call).
    fn typing(&mut self, channel: &str) -> Result<(), CallError>;
    /// Removes message `message` (best effort).
    fn delete(&mut self, channel: &str, message: &str);
}
/// Rejection notices waiting at most.
pub(crate) const MAX_NOTICES: usize = 1000;
/// Replies waiting to be shown at most, as a multiple of `max_views`.
const MAX_PENDING_FACTOR: usize = 4;
/// Longest pause after failed calls (doubling from 1 s).
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// One reply being shown.
#[derive(Debug)]
struct View {
    channel: String,
    reply_to: Option<String>,
    /// Messages posted so far and the text each shows.
    posted: Vec<(String, String)>,
    partial: Option<String>,
    result: Option<String>,
    last_edit: Option<Instant>,
}

/// What [`Renderer::step`] did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Nothing to do before this instant (or before a new event, when `None`).
    Idle(Option<Instant>),
    /// Made progress; these results are now fully shown (confirm them to the gateway).
    Worked(Vec<String>),
}

/// The reply side of the bridge, apart from the I/O so its choices are unit-tested.
#[derive(Debug)]
pub(crate) struct Renderer {
    views: HashMap<String, View>,
    order: VecDeque<String>,
    notices: VecDeque<(String, Option<String>, String)>,
    /// Channels whose turn runs, with when their indicator is sent next.
    typing: HashMap<String, Instant>,
    paused_until: Option<Instant>,
    backoff: Duration,
    edit_interval: Duration,
    max_views: usize,
    /// Where a session's replies go ([`chat_of`] unless the platform says otherwise).
    channel_of: fn(&str) -> Option<String>,
}

/// The chat of a session key (`discord:dm:42`, `discord:group:42:user:7`): where its replies
/// go on a platform whose threads are inside the chat's channel (Slack).
pub(crate) fn chat_of(session: &str) -> Option<String> {
    SessionKey::from_str(session)
        .ok()
        .map(|k| k.chat_id().to_owned())
}

impl Renderer {
    /// An empty renderer: partials edited at most every `edit_interval` per reply, at most
    /// `max_views` replies streamed at once (results are always shown).
    pub(crate) fn new(edit_interval: Duration, max_views: usize) -> Renderer {
        Renderer {
            views: HashMap::new(),
            order: VecDeque::new(),
            notices: VecDeque::new(),
            typing: HashMap::new(),
            paused_until: None,
            backoff: Duration::from_secs(1),
            edit_interval,
            max_views: max_views.max(1),
            channel_of: chat_of,
        }
    }

    /// Replies of a session go to the channel `channel_of` names (Discord: a thread is a
    /// channel of its own).
    pub(crate) fn with_channels(mut self, channel_of: fn(&str) -> Option<String>) -> Renderer {
        self.channel_of = channel_of;
        self
    }

    fn view(&mut self, id: &str, session: &str, reply_to: Option<String>) -> Option<&mut View> {
        if !self.views.contains_key(id) {
            let channel = (self.channel_of)(session)?;
            self.views.insert(
                id.to_owned(),
                View {
                    channel,
                    reply_to,
                    posted: Vec::new(),
                    partial: None,
                    result: None,
                    last_edit: None,
                },
            );
            self.order.push_back(id.to_owned());
        }
        self.views.get_mut(id)
    }

    /// A partial reply: the newest text to show for `id` (an older pending one is dropped).
    /// Not shown past `max_views` streamed replies.
    pub(crate) fn partial(
        &mut self,
        id: &str,
        session: &str,
        text: &str,
        reply_to: Option<String>,
    ) {
        if !self.views.contains_key(id) && self.views.len() >= self.max_views {
            return;
        }
        if let Some(view) = self.view(id, session, reply_to)
            && view.result.is_none()
        {
            view.partial = Some(text.to_owned());
        }
    }

    /// A result to show; `false` when there is nothing to show (a merged message, an
    /// unknown session): the caller confirms it at once.
    pub(crate) fn result(&mut self, event: &TerminalEvent, reply_to: Option<String>) -> bool {
        let Some(text) = event.outcome.chat_text() else {
            return false;
        };
        let Some(view) = self.view(&event.id, &event.session, reply_to) else {
            warn_limited!(
                "bridge: result {} for an unknown session; dropped",
                event.id
            );
            return false;
        };
        view.partial = None;
        view.result = Some(text);
        true
    }

    /// A turn of `channel` started or ended.
    pub(crate) fn typing(&mut self, channel: &str, on: bool, now: Instant) {
        if on {
            self.typing.entry(channel.to_owned()).or_insert(now);
        } else {
            self.typing.remove(channel);
        }
    }

    /// A text for a channel that is not a reply (a rejection).
    pub(crate) fn notice(&mut self, channel: &str, reply_to: Option<&str>, text: &str) {
        if self.notices.len() >= MAX_NOTICES {
            warn_limited!("bridge: {MAX_NOTICES} notices wait already; one for {channel} dropped");
            return;
        }
        self.notices.push_back((
            channel.to_owned(),
            reply_to.map(str::to_owned),
            text.to_owned(),
        ));
    }

    /// Whether more gateway events may be taken (else they wait in the gateway's outbox).
    pub(crate) fn has_room(&self) -> bool {
        self.views.len() < self.max_views * MAX_PENDING_FACTOR
    }

    /// Does the most urgent thing there is: a result, a notice, a due partial, a typing
    /// renewal. An error only when the token was refused.
    pub(crate) fn step(
        &mut self,
        api: &mut dyn ReplyApi,
        now: Instant,
    ) -> Result<Step, BridgeError> {
        if let Some(until) = self.paused_until.filter(|t| *t > now) {
            return Ok(Step::Idle(Some(until)));
        }
        if let Some(id) = self
            .order
            .iter()
            .find(|id| self.views.get(*id).is_some_and(|v| v.result.is_some()))
        {
            let id = id.clone();
            return self.render(api, &id, true, now);
        }
        if let Some((channel, reply_to, text)) = self.notices.pop_front() {
            if let Err(e) = api.post(&channel, reply_to.as_deref(), None, &text) {
                self.notices.push_front((channel, reply_to, text));
                return self.failed(e, now).map(|()| Step::Worked(Vec::new()));
            }
            return Ok(Step::Worked(Vec::new()));
        }
        let mut wake: Option<Instant> = None;
        let due = self.order.iter().find_map(|id| {
            let v = self.views.get(id)?;
            v.partial.as_ref()?;
            let at = v.last_edit.map_or(now, |t| t + self.edit_interval);
            if at <= now {
                return Some(id.clone());
            }
            wake = Some(wake.map_or(at, |w: Instant| w.min(at)));
            None
        });
        if let Some(id) = due {
            return self.render(api, &id, false, now);
        }
        let typing = self
            .typing
            .iter()
            .find(|(_, at)| **at <= now)
            .map(|(c, _)| c.clone());
        if let Some(channel) = typing {
            self.typing.insert(channel.clone(), now + TYPING_RENEW);
            if let Err(e) = api.typing(&channel) {
                self.failed(e, now)?;
            }
            return Ok(Step::Worked(Vec::new()));
        }
        let next_typing = self.typing.values().min().copied();
        Ok(Step::Idle(match (wake, next_typing) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }))
    }

    /// Shows reply `id`'s result (`final_`) or newest partial: piece by piece, each only if
    /// it differs from what its message shows.
    fn render(
        &mut self,
        api: &mut dyn ReplyApi,
        id: &str,
        final_: bool,
        now: Instant,
    ) -> Result<Step, BridgeError> {
        let Some(view) = self.views.get_mut(id) else {
            return Ok(Step::Worked(Vec::new()));
        };
        let text = if final_ {
            view.result.clone()
        } else {
            view.partial.clone()
        }
        .filter(|t| !t.trim().is_empty())
        .unwrap_or_else(|| "[empty reply]".to_owned());
        let pieces = split(&text, api.limit());
        for (i, piece) in pieces.iter().enumerate() {
            if view.posted.get(i).is_some_and(|(_, shown)| shown == piece) {
                continue;
            }
            match show_piece(api, view, i, piece) {
                Ok(message_id) => {
                    if i < view.posted.len() {
                        view.posted[i].1 = (*piece).to_owned();
                    } else {
                        view.posted.push((message_id, (*piece).to_owned()));
                    }
                }
                Err(CallError::Permanent(e)) => {
                    warn_limited!(
                        "bridge: reply {id} in channel {} not shown: {e}",
                        view.channel
                    );
                    return Ok(self.give_up(id, final_));
                }
                Err(e) => {
                    self.failed(e, now)?;
                    return Ok(Step::Worked(Vec::new()));
                }
            }
        }
        if final_ {
            // Pieces a longer partial left beyond the result's end go (best effort).
            for (message_id, _) in view.posted.iter().skip(pieces.len()) {
                api.delete(&view.channel, message_id);
            }
            self.views.remove(id);
            self.order.retain(|o| o != id);
            self.backoff = Duration::from_secs(1);
            return Ok(Step::Worked(vec![id.to_owned()]));
        }
        view.partial = None;
        view.last_edit = Some(now);
        self.backoff = Duration::from_secs(1);
        Ok(Step::Worked(Vec::new()))
    }

    /// A piece that can never be shown: a result ends here (confirmed), a partial is
    /// dropped.
    fn give_up(&mut self, id: &str, final_: bool) -> Step {
        if final_ {
            self.views.remove(id);
            self.order.retain(|o| o != id);
            return Step::Worked(vec![id.to_owned()]);
        }
        if let Some(v) = self.views.get_mut(id) {
            v.partial = None;
        }
        Step::Worked(Vec::new())
    }

    /// A failed call: a rate limit or a transient failure pauses every call (the rate
    /// limit until its reset, a failure with a doubling backoff); a refused token ends it.
    fn failed(&mut self, e: CallError, now: Instant) -> Result<(), BridgeError> {
        match e {
            CallError::Wait(until) => self.paused_until = Some(until),
            CallError::Unauthorized(d) => {
                return Err(format!("the platform refused the bot token: {d}"));
            }
            CallError::Permanent(d) | CallError::Transient(d) => {
                warn_limited!("bridge: a call failed: {d}; pausing {:?}", self.backoff);
                self.paused_until = Some(now + self.backoff);
                self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
            }
        }
        Ok(())
    }
}

/// Shows piece `i` of `view`: edits its message, or posts a new one (the first answering
/// the user's message). Returns the message's id.
fn show_piece(
    api: &mut dyn ReplyApi,
    view: &View,
    i: usize,
    piece: &str,
) -> Result<String, CallError> {
    if let Some((message_id, _)) = view.posted.get(i) {
        return api
            .edit(&view.channel, message_id, piece)
            .map(|()| message_id.clone());
    }
    api.post(&view.channel, view.reply_to.as_deref(), Some(i), piece)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::platforms::gateway::TerminalOutcome;

    /// A scripted platform: records calls, answers the next scripted error if any.
    #[derive(Default)]
    struct Script {
        calls: Vec<String>,
        errors: VecDeque<CallError>,
        next: u32,
    }

    impl Script {
        fn answer(&mut self, call: String) -> Result<(), CallError> {
            self.calls.push(call);
            self.errors.pop_front().map_or(Ok(()), Err)
        }
    }

    impl ReplyApi for Script {
        fn limit(&self) -> Limit {
            Limit::Utf16Units(10)
        }
        fn reply_target(&self, id: &str) -> Option<String> {
            Some(id.to_owned())
        }
        fn post(
            &mut self,
            channel: &str,
            answers: Option<&str>,
            piece: Option<usize>,
            text: &str,
        ) -> Result<String, CallError> {
            self.answer(format!("post {channel} {answers:?} {piece:?} {text}"))?;
            self.next += 1;
            Ok(format!("m{}", self.next))
        }
        fn edit(&mut self, channel: &str, message: &str, text: &str) -> Result<(), CallError> {
            self.answer(format!("edit {channel} {message} {text}"))
        }
        fn typing(&mut self, channel: &str) -> Result<(), CallError> {
            self.answer(format!("typing {channel}"))
        }
        fn delete(&mut self, channel: &str, message: &str) {
            let _ = self.answer(format!("delete {channel} {message}"));
        }
    }

    fn result(id: &str, text: &str) -> TerminalEvent {
        TerminalEvent {
            id: id.into(),
            session: "discord:dm:42".into(),
            outcome: TerminalOutcome::Reply {
                text: text.into(),
                truncated: false,
                files: Vec::new(),
            },
            redelivery: false,
        }
    }

    fn run(r: &mut Renderer, api: &mut Script, now: Instant) -> Vec<String> {
        let mut done = Vec::new();
        for _ in 0..20 {
            match r.step(api, now).expect("step") {
                Step::Worked(d) => done.extend(d),
                Step::Idle(_) => break,
            }
        }
        done
    }

    #[test]
    fn a_reply_is_posted_then_edited_split_at_the_limit_and_identical_text_is_not_sent() {
        let mut r = Renderer::new(Duration::from_secs(1), 8);
        let mut api = Script::default();
        let t0 = Instant::now();
        r.partial("a", "discord:dm:42", "Hello", Some("u1".into()));
        run(&mut r, &mut api, t0);
        // The same text again, and a newer one replacing an older pending one.
        r.partial("a", "discord:dm:42", "Hello", Some("u1".into()));
        run(&mut r, &mut api, t0 + Duration::from_secs(2));
        r.partial("a", "discord:dm:42", "Hello wo", Some("u1".into()));
        r.partial("a", "discord:dm:42", "Hello world", Some("u1".into()));
        run(&mut r, &mut api, t0 + Duration::from_secs(4));
        assert!(r.result(&result("a", "Hello world, again"), Some("u1".into())));
        let done = run(&mut r, &mut api, t0 + Duration::from_secs(4));
        assert_eq!(done, ["a"]);
        assert_eq!(
            api.calls,
            [
                "post 42 Some(\"u1\") Some(0) Hello",
                "edit 42 m1 Hello ",
                "post 42 Some(\"u1\") Some(1) world",
                "edit 42 m2 world, ",
                "post 42 Some(\"u1\") Some(2) again",
            ]
        );
    }

    #[test]
    fn results_go_before_partials_and_a_rate_limit_stops_every_call_until_it_passed() {
        let mut r = Renderer::new(Duration::from_secs(1), 8);
        let t0 = Instant::now();
        let mut api = Script {
            errors: [CallError::Wait(t0 + Duration::from_secs(3))].into(),
            ..Script::default()
        };
        r.partial("b", "discord:dm:7", "partial", Some("u2".into()));
        assert!(r.result(&result("a", "final"), Some("u1".into())));
        assert_eq!(
            r.step(&mut api, t0).expect("step"),
            Step::Worked(Vec::new())
        );
        assert_eq!(
            r.step(&mut api, t0 + Duration::from_secs(1)).expect("step"),
            Step::Idle(Some(t0 + Duration::from_secs(3)))
        );
        assert_eq!(api.calls.len(), 1, "nothing called while rate limited");
        let done = run(&mut r, &mut api, t0 + Duration::from_secs(3));
        assert_eq!(done, ["a"]);
        assert_eq!(
            api.calls,
            [
                "post 42 Some(\"u1\") Some(0) final",
                "post 42 Some(\"u1\") Some(0) final",
                "post 7 Some(\"u2\") Some(0) partial",
            ]
        );
    }
}
