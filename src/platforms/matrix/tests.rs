//! The main loop's rules against a scripted homeserver and gateway (tests/platforms_matrix.rs
//! checks the same end to end against a real Synapse).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::api::ApiError;
use super::engine::{GatewaySide, Homeserver, Step, SyncEngine};
use super::sync::{ChatKind, HumanMessage};
use super::*;
use crate::message::ChatType;
use crate::platforms::edits::EditLimits;
use crate::platforms::gateway::{
    Admission, GatewayEvent, OutgoingMessage, SendError, TerminalEvent, TerminalOutcome,
};

#[derive(Debug, Clone)]
struct Sent {
    room: String,
    content: Value,
}

impl Sent {
    fn body(&self) -> &str {
        self.content["m.new_content"]["body"]
            .as_str()
            .or(self.content["body"].as_str())
            .unwrap_or("")
    }
    fn is_edit(&self) -> bool {
        self.content["m.relates_to"]["rel_type"] == "m.replace"
    }
    fn edits(&self) -> Option<&str> {
        self.content["m.relates_to"]["event_id"].as_str()
    }
    fn replies_to(&self) -> Option<&str> {
        self.content["m.relates_to"]["m.in_reply_to"]["event_id"].as_str()
    }
}

/// Answers sends from a script (then `Ok`), records what went out. `Err(Transport)` with
/// `keep_lost` set models a server that stored the event but whose answer was lost.
#[derive(Default)]
struct FakeHs {
    answers: VecDeque<Result<(), ApiError>>,
    keep_lost: bool,
    sent: Vec<Sent>,
    /// Transaction ids already answered: the same txn again returns the same event.
    txns: Vec<(String, String)>,
    typing: Vec<(String, bool)>,
    receipts: Vec<(String, String)>,
    /// Upload answers (then the file's `mxc://fake/NAME`), and the names uploaded.
    upload_answers: VecDeque<Result<Option<String>, ApiError>>,
    uploads: Vec<String>,
}

impl Homeserver for FakeHs {
    fn send(&mut self, room: &str, txn: &str, content: &Value) -> Result<String, ApiError> {
        let answer = self.answers.pop_front();
        if let Some(Err(e)) = &answer
            && !(self.keep_lost && matches!(e, ApiError::Transport(_)))
        {
            return Err(e.clone());
        }
        if let Some((_, ev)) = self.txns.iter().find(|(t, _)| t == txn) {
            return Ok(ev.clone());
        }
        let event = format!("$bot{}", self.sent.len());
        self.sent.push(Sent {
            room: room.into(),
            content: content.clone(),
        });
        self.txns.push((txn.into(), event.clone()));
        match answer {
            Some(Err(e)) => Err(e),
            _ => Ok(event),
        }
    }
    fn typing(&mut self, room: &str, on: bool) -> Result<(), ApiError> {
        self.typing.push((room.into(), on));
        Ok(())
    }
    fn receipt(&mut self, room: &str, event: &str) -> Result<(), ApiError> {
        self.receipts.push((room.into(), event.into()));
        Ok(())
    }
    fn upload(
        &mut self,
        _room: &str,
        file: &crate::Attachment,
    ) -> Result<Option<String>, ApiError> {
        self.uploads.push(file.name.clone());
        self.upload_answers
            .pop_front()
            .unwrap_or_else(|| Ok(Some(format!("mxc://fake/{}", file.name))))
    }
}

#[derive(Default)]
struct FakeGw {
    sent: Vec<OutgoingMessage>,
    delivered: Vec<String>,
}

impl GatewaySide for FakeGw {
    fn send(&mut self, message: &OutgoingMessage) -> Result<(), SendError> {
        self.sent.push(message.clone());
        Ok(())
    }
    fn delivered(&mut self, id: &str) {
        self.delivered.push(id.into());
    }
}

const ROOM: &str = "!room:hs";

fn human(id: &str, text: &str) -> HumanMessage {
    HumanMessage {
        room: ROOM.into(),
        event_id: id.into(),
        sender: "@ann:hs".into(),
        sender_name: Some("Ann".into()),
        text: crate::platforms::map_command(text).into_owned(),
        reply_to: None,
        thread: None,
        msgtype: "m.text".into(),
        url: None,
        media: None,
        to_bot: false,
    }
}

fn session() -> String {
    format!("matrix:dm:{}", ROOM.replace(':', "%3A"))
}

fn partial(id: &str, text: &str) -> GatewayEvent {
    GatewayEvent::Partial {
        id: id.into(),
        session: session(),
        text: text.into(),
    }
}

fn result(id: &str, outcome: TerminalOutcome, redelivery: bool) -> GatewayEvent {
    GatewayEvent::Result(TerminalEvent {
        id: id.into(),
        session: session(),
        outcome,
        redelivery,
    })
}

fn reply(text: &str) -> TerminalOutcome {
    TerminalOutcome::Reply {
        text: text.into(),
        truncated: false,
        files: Vec::new(),
    }
}

fn limited() -> Result<(), ApiError> {
    Err(ApiError::RateLimited(Duration::from_secs(2)))
}

struct Rig {
    core: SyncEngine<FakeHs>,
    gw: FakeGw,
    now: Instant,
}

impl Rig {
    fn new() -> Rig {
        Rig {
            core: SyncEngine::new(FakeHs::default(), "matrix", EditLimits::default(), 100),
            gw: FakeGw::default(),
            now: Instant::now(),
        }
    }
    fn human(&mut self, id: &str, text: &str) {
        self.core
            .on_human(&human(id, text), ChatKind::Dm, &mut self.gw);
    }
    fn gateway(&mut self, ev: GatewayEvent) {
        self.core.on_gateway(ev, self.now, &mut self.gw);
    }
    /// Steps until idle; returns the wake-up asked for.
    fn settle(&mut self) -> Option<Instant> {
        for _ in 0..1000 {
            match self
                .core
                .step(self.now, &mut self.gw)
                .expect("no fatal error")
            {
                Step::Worked => {}
                Step::Idle(wake) => return wake,
            }
        }
        panic!("the core never went idle");
    }
    /// Advances the clock to the wake-up asked for and settles again.
    fn wait_and_settle(&mut self) {
        let wake = self.settle();
        if let Some(at) = wake {
            self.now = at;
        }
        self.settle();
    }
    fn sent(&self) -> &[Sent] {
        &self.core.homeserver().sent
    }
    fn bodies(&self) -> Vec<&str> {
        self.sent().iter().map(Sent::body).collect()
    }
}

#[test]
fn a_reply_is_one_message_replying_to_the_human_then_edits_of_it() {
    let mut r = Rig::new();
    r.human("$h1", "hello");
    assert_eq!(r.gw.sent.len(), 1);
    let m = &r.gw.sent[0];
    assert_eq!((m.id.as_str(), m.chat_id.as_str()), ("$h1", ROOM));
    assert_eq!(m.chat_type, ChatType::Dm);
    assert_eq!(m.user_id.as_deref(), Some("@ann:hs"));
    assert_eq!(m.user_name.as_deref(), Some("Ann"));
    assert_eq!(
        m.meta
            .as_deref()
            .and_then(|v| serde_json::from_str::<serde_json::Value>(v).ok())
            .map(|v| v["event_id"].clone()),
        Some("$h1".into())
    );
    r.gateway(partial("$h1", "Hel"));
    r.settle();
    r.gateway(partial("$h1", "Hello"));
    r.settle();
    r.gateway(partial("$h1", "Hello"));
    r.settle();
    r.gateway(result("$h1", reply("Hello"), false));
    r.settle();
    let sent = r.sent();
    assert_eq!(
        sent.len(),
        2,
        "identical texts are not sent again: {:?}",
        r.bodies()
    );
    assert_eq!(sent[0].replies_to(), Some("$h1"));
    assert!(!sent[0].is_edit());
    assert_eq!(sent[0].body(), "Hel");
    assert!(sent[1].is_edit());
    assert_eq!(sent[1].edits(), Some("$bot0"));
    assert_eq!(sent[1].body(), "Hello");
    assert_eq!(sent[1].content["body"], "* Hello");
    assert_eq!(r.gw.delivered, vec!["$h1"]);
    assert_eq!(r.core.stats.identical_skipped, 2);
}

#[test]
fn under_429_only_the_newest_edit_is_kept_and_the_command_answer_goes_first() {
    let mut r = Rig::new();
    r.human("$h1", "write a poem");
    r.gateway(partial("$h1", "a"));
    r.settle(); // the reply's first message
    r.core.homeserver_mut().answers.push_back(limited());
    r.gateway(partial("$h1", "a b"));
    let wake = r.settle().expect("a wait after the 429");
    assert_eq!(wake, r.now + Duration::from_secs(2));
    // While waiting: more partials, a /status and its answer.
    r.gateway(partial("$h1", "a b c"));
    r.gateway(partial("$h1", "a b c d"));
    r.human("$h2", "!status");
    assert_eq!(r.gw.sent[1].text, "/status");
    r.gateway(result("$h2", reply("status: running"), false));
    assert_eq!(r.settle(), Some(wake), "nothing is sent before retry_after");
    r.now = wake;
    r.settle();
    assert_eq!(r.bodies(), vec!["a", "status: running", "a b c d"]);
    assert_eq!(r.sent()[1].content["msgtype"], "m.notice");
    assert_eq!(r.sent()[1].replies_to(), Some("$h2"));
    assert_eq!(r.core.stats.rate_limited, 1);
    assert_eq!(r.gw.delivered, vec!["$h2"]);
    // Messages, notices and edits alike mention nobody (issue 30 row 9).
    for s in r.sent() {
        assert_eq!(s.content["m.mentions"], json!({}), "{}", s.content);
        if s.is_edit() {
            assert_eq!(s.content["m.new_content"]["m.mentions"], json!({}));
        }
    }
}

#[test]
fn repeated_strikes_stop_the_edits_and_only_the_final_is_sent() {
    let mut r = Rig::new();
    r.human("$h1", "long story");
    r.gateway(partial("$h1", "once"));
    r.settle();
    for _ in 0..3 {
        r.core.homeserver_mut().answers.push_back(limited());
    }
    for text in ["once upon", "once upon a", "once upon a time"] {
        r.gateway(partial("$h1", text));
        r.wait_and_settle();
    }
    assert!(r.core.final_only(r.now), "three strikes: final only");
    let before = r.sent().len();
    r.gateway(partial("$h1", "once upon a time there"));
    r.wait_and_settle();
    assert_eq!(r.sent().len(), before, "no edit while final-only");
    r.gateway(result(
        "$h1",
        reply("once upon a time there was a bot"),
        false,
    ));
    r.wait_and_settle();
    assert_eq!(
        r.bodies(),
        vec!["once", "once upon a time there was a bot"],
        "the stale edits were never sent"
    );
    assert!(r.sent()[1].is_edit());
    assert_eq!(r.gw.delivered, vec!["$h1"]);
}

#[test]
fn a_redelivered_result_is_posted_once() {
    let mut r = Rig::new();
    r.human("$h1", "hi");
    r.core.homeserver_mut().answers.push_back(limited());
    r.gateway(result("$h1", reply("answer"), false));
    r.settle(); // refused: waits
    // The connection dropped before it was posted; the gateway sends it again.
    r.gateway(GatewayEvent::Disconnected {
        reason: "test".into(),
    });
    r.gateway(GatewayEvent::Connected);
    r.gateway(result("$h1", reply("answer"), true));
    r.wait_and_settle();
    assert_eq!(r.bodies(), vec!["answer"]);
    assert_eq!(r.gw.delivered, vec!["$h1"]);
}

#[test]
fn a_result_after_a_bridge_restart_finds_its_room_in_the_session_key() {
    let mut r = Rig::new();
    r.gateway(result(
        "$old",
        TerminalOutcome::Failed {
            error: "interrupted by restart".into(),
        },
        true,
    ));
    r.settle();
    assert_eq!(r.sent().len(), 1);
    assert_eq!(r.sent()[0].room, ROOM);
    assert_eq!(r.sent()[0].replies_to(), Some("$old"));
    assert_eq!(r.sent()[0].body(), "[failed: interrupted by restart]");
    assert_eq!(r.gw.delivered, vec!["$old"]);
}

#[test]
fn stop_ends_the_partials_and_the_cancellation_is_a_last_edit_with_a_marker() {
    let mut r = Rig::new();
    r.human("$h1", "slow");
    r.gateway(partial("$h1", "w0"));
    r.settle();
    r.core.homeserver_mut().answers.push_back(limited());
    r.gateway(partial("$h1", "w0 w1"));
    r.settle(); // refused, w0 w1 waits
    r.human("$stop", "!stop");
    assert_eq!(r.gw.sent[1].text, "/stop");
    r.gateway(partial("$h1", "w0 w1 w2")); // late: after the stop
    r.gateway(result(
        "$stop",
        reply("stop: cancelled the running turn"),
        false,
    ));
    r.wait_and_settle();
    assert_eq!(
        r.bodies(),
        vec!["w0", "stop: cancelled the running turn"],
        "no partial is shown once the session was stopped"
    );
    r.gateway(partial("$h1", "w0 w1 w2 w3")); // the agent still winding down
    r.settle();
    r.gateway(result(
        "$h1",
        TerminalOutcome::Cancelled {
            reason: "stopped".into(),
        },
        false,
    ));
    r.wait_and_settle();
    assert_eq!(
        r.bodies(),
        vec![
            "w0",
            "stop: cancelled the running turn",
            &format!("w0\n\n{STOPPED_MARKER}")
        ]
    );
    assert!(r.sent()[2].is_edit());
    assert_eq!(r.gw.delivered, vec!["$stop", "$h1"]);
}

#[test]
fn a_cancellation_with_nothing_shown_posts_nothing_and_is_confirmed() {
    let mut r = Rig::new();
    r.human("$h1", "slow");
    r.gateway(result(
        "$h1",
        TerminalOutcome::Cancelled {
            reason: "stopped".into(),
        },
        false,
    ));
    r.gateway(result(
        "$h2",
        TerminalOutcome::Merged { into: "$h1".into() },
        false,
    ));
    r.settle();
    assert!(r.sent().is_empty());
    assert_eq!(r.gw.delivered, vec!["$h1", "$h2"]);
}

#[test]
fn a_lost_answer_to_the_first_message_is_retried_with_the_same_transaction() {
    let mut r = Rig::new();
    r.human("$h1", "hi");
    r.core.homeserver_mut().keep_lost = true;
    r.core
        .homeserver_mut()
        .answers
        .push_back(Err(ApiError::Transport("reset".into())));
    r.gateway(partial("$h1", "part"));
    r.settle(); // stored by the server, the answer lost: backs off
    r.wait_and_settle(); // the same txn again: the server returns the stored event
    r.gateway(result("$h1", reply("part and whole"), false));
    r.wait_and_settle();
    assert_eq!(
        r.bodies(),
        vec!["part", "part and whole"],
        "one message, one edit"
    );
    assert!(r.sent()[1].is_edit());
    assert_eq!(r.sent()[1].edits(), Some("$bot0"));
}

#[test]
fn a_rejected_message_is_answered_in_the_room() {
    let mut r = Rig::new();
    r.human("$h1", "hi");
    r.gateway(GatewayEvent::Admission {
        id: "$h1".into(),
        admission: Admission::Rejected {
            session: Some(session()),
            reason: "queue_full".into(),
            detail: "32 waiting".into(),
        },
    });
    r.settle();
    assert_eq!(r.bodies(), vec!["[not accepted: queue_full: 32 waiting]"]);
    assert_eq!(r.sent()[0].replies_to(), Some("$h1"));
}

#[test]
fn typing_follows_the_gateway_and_is_refreshed() {
    let mut r = Rig::new();
    let typing = |on| GatewayEvent::Typing {
        session: session(),
        chat_id: ROOM.into(),
        on,
    };
    r.gateway(typing(true));
    let wake = r.settle().expect("a refresh is due later");
    r.gateway(typing(true)); // the gateway's own refresh: nothing new to send
    r.settle();
    assert_eq!(r.core.homeserver().typing, vec![(ROOM.into(), true)]);
    r.now = wake;
    r.settle();
    r.gateway(typing(false));
    r.settle();
    assert_eq!(
        r.core.homeserver().typing,
        vec![
            (ROOM.into(), true),
            (ROOM.into(), true),
            (ROOM.into(), false)
        ]
    );
}

#[test]
fn a_long_final_continues_in_new_messages() {
    let mut r = Rig::new();
    r.human("$h1", "hi");
    let long = "word ".repeat(CHUNK_BYTES / 5 * 2 + 10);
    r.gateway(result("$h1", reply(&long), false));
    r.settle();
    let sent = r.sent();
    assert_eq!(sent.len(), 3);
    assert!(sent.iter().all(|s| s.body().len() <= CHUNK_BYTES));
    assert_eq!(sent.iter().map(Sent::body).collect::<String>(), long);
    assert_eq!(sent[0].replies_to(), Some("$h1"));
    assert_eq!(r.gw.delivered, vec!["$h1"]);
}

#[test]
fn a_permanent_refusal_is_logged_and_the_result_confirmed() {
    let mut r = Rig::new();
    r.human("$h1", "hi");
    r.core
        .homeserver_mut()
        .answers
        .push_back(Err(ApiError::Status {
            what: "PUT /rooms/x/send".into(),
            status: 403,
            errcode: "M_FORBIDDEN".into(),
            error: "not in room".into(),
        }));
    r.gateway(result("$h1", reply("answer"), false));
    r.settle();
    assert!(r.sent().is_empty());
    assert_eq!(r.gw.delivered, vec!["$h1"]);
}

#[test]
fn a_refused_access_token_stops_the_bridge() {
    let mut r = Rig::new();
    r.human("$h1", "hi");
    r.core
        .homeserver_mut()
        .answers
        .push_back(Err(ApiError::Status {
            what: "PUT /rooms/x/send".into(),
            status: 401,
            errcode: "M_UNKNOWN_TOKEN".into(),
            error: "bad".into(),
        }));
    r.gateway(result("$h1", reply("answer"), false));
    assert!(r.core.step(r.now, &mut r.gw).is_err());
}

/// Issue 30 row 4, notices: while a room's refusal notice waits to be posted, later
/// refusals in that room queue no notice of their own (ten refusals: one notice); once it
/// is posted, the next refusal is told again. Before, each refusal queued its own.
#[test]
fn refusal_notices_are_capped_per_room() {
    let mut r = Rig::new();
    let refused = |id: &str| GatewayEvent::Admission {
        id: id.into(),
        admission: Admission::Rejected {
            session: Some(session()),
            reason: "queue_full".into(),
            detail: "32 waiting".into(),
        },
    };
    for i in 0..10 {
        let id = format!("$h{i}");
        r.human(&id, "hi");
        r.gateway(refused(&id));
    }
    r.settle();
    assert_eq!(r.bodies(), vec!["[not accepted: queue_full: 32 waiting]"]);
    r.human("$late", "hi");
    r.gateway(refused("$late"));
    r.settle();
    assert_eq!(r.bodies().len(), 2, "told again once the first was posted");
}

/// Issue 35 row 3: a message in a thread goes to the gateway with its thread; the reply
/// starts in the thread (replying to the human as the fallback), grows by edits of itself,
/// and a result the bridge has no turn for (a restart) finds the thread in the session key.
#[test]
fn a_thread_message_is_answered_in_its_thread_and_edits_stay_edits() {
    let mut r = Rig::new();
    let mut m = human("$h1", "hello");
    m.thread = Some("$root".into());
    r.core.on_human(&m, ChatKind::Dm, &mut r.gw);
    assert_eq!(r.gw.sent[0].thread_id.as_deref(), Some("$root"));
    r.gateway(partial("$h1", "Hel"));
    r.settle();
    r.gateway(result("$h1", reply("Hello"), false));
    r.settle();
    let sent = r.sent();
    assert_eq!(sent.len(), 2, "{:?}", r.bodies());
    let rel = &sent[0].content["m.relates_to"];
    assert_eq!(
        (&rel["rel_type"], &rel["event_id"], &rel["is_falling_back"]),
        (&json!("m.thread"), &json!("$root"), &json!(true))
    );
    assert_eq!(sent[0].replies_to(), Some("$h1"));
    assert!(sent[1].is_edit() && sent[1].edits() == Some("$bot0"));
    // A result redelivered to a restarted bridge: no turn known, the thread from the key.
    r.gateway(GatewayEvent::Result(TerminalEvent {
        id: "$h2".into(),
        session: format!("matrix:dm:{}:thread:$root", ROOM.replace(':', "%3A")),
        outcome: reply("late"),
        redelivery: true,
    }));
    r.wait_and_settle();
    let late = &r.sent()[2].content["m.relates_to"];
    assert_eq!(
        (&late["rel_type"], &late["event_id"]),
        (&json!("m.thread"), &json!("$root"))
    );
    // A stop in the main timeline does not stop the thread's reply.
    let mut t = human("$h3", "slow");
    t.thread = Some("$root".into());
    r.core.on_human(&t, ChatKind::Dm, &mut r.gw);
    r.human("$h4", "!stop");
    r.gateway(partial("$h3", "still streaming"));
    r.wait_and_settle();
    assert_eq!(r.sent().last().map(Sent::body), Some("still streaming"));
}

/// Issue 35 row 5: a message queued behind a running turn gets one read receipt, after
/// every reply waiting (the lowest priority); a message answered first gets none.
#[test]
fn a_queued_message_gets_one_receipt_after_the_replies_waiting() {
    let mut r = Rig::new();
    let accepted = |id: &str, queued: bool| GatewayEvent::Admission {
        id: id.into(),
        admission: Admission::Accepted {
            session: session(),
            queued,
            position: usize::from(queued),
        },
    };
    r.human("$h1", "long");
    r.gateway(accepted("$h1", false));
    r.human("$h2", "next");
    r.human("$h3", "later");
    r.gateway(partial("$h1", "working"));
    r.gateway(accepted("$h2", true));
    r.gateway(accepted("$h3", true));
    r.core.step(r.now, &mut r.gw).expect("a step");
    assert_eq!(r.bodies(), ["working"], "the reply goes before the receipt");
    assert!(r.core.homeserver().receipts.is_empty());
    r.settle();
    assert_eq!(
        r.core.homeserver().receipts,
        [(ROOM.to_owned(), "$h3".to_owned())],
        "one receipt, for the newest queued message (it covers the one before)"
    );
    r.human("$h4", "quick");
    r.gateway(accepted("$h4", true));
    r.gateway(result("$h4", reply("done"), false));
    r.wait_and_settle();
    assert_eq!(
        r.core.homeserver().receipts.len(),
        1,
        "an answered message is not receipted"
    );
}

/// Issue 36 row 4: with Markdown on, a partial inside an open fence shows as an open code
/// block and the result as HTML beside its plain body (an edit carries both); notices and
/// `--format plain` send the text as it is.
#[test]
fn issue36_markdown_renders_partials_and_results_as_html_with_a_plain_body() {
    use crate::platforms::markdown::Format;
    let mut r = Rig::new();
    r.core = SyncEngine::new(FakeHs::default(), "matrix", EditLimits::default(), 100)
        .with_format(Format::Markdown);
    r.human("$h1", "code please");
    r.gateway(partial("$h1", "Here <b>:\n\n```rust\nfn main() {"));
    r.settle();
    let first = &r.sent()[0].content;
    assert_eq!(first["format"], "org.matrix.custom.html");
    assert_eq!(
        first["formatted_body"],
        "<p>Here &lt;b&gt;:</p>\n\n<pre><code class=\"language-rust\">fn main() {</code></pre>"
    );
    assert_eq!(first["body"], "Here <b>:\n\nfn main() {");
    r.gateway(result(
        "$h1",
        reply("Here <b>:\n\n```rust\nfn main() {}\n```\n\n**done**"),
        false,
    ));
    r.wait_and_settle();
    let edit = &r.sent()[1].content;
    let html = "<p>Here &lt;b&gt;:</p>\n\n<pre><code class=\"language-rust\">fn main() {}</code></pre>\n\n<p><strong>done</strong></p>";
    assert_eq!(edit["m.new_content"]["formatted_body"], html);
    assert_eq!(edit["m.new_content"]["format"], "org.matrix.custom.html");
    assert_eq!(
        edit["m.new_content"]["body"],
        "Here <b>:\n\nfn main() {}\n\ndone"
    );
    assert_eq!(edit["formatted_body"], format!("* {html}"));
    assert_eq!(r.gw.delivered, vec!["$h1"]);

    let mut plain = Rig::new();
    plain.core = SyncEngine::new(FakeHs::default(), "matrix", EditLimits::default(), 100)
        .with_format(Format::Plain);
    plain.human("$h2", "hi");
    plain.gateway(result("$h2", reply("**done**"), false));
    plain.settle();
    assert_eq!(plain.sent()[0].content["body"], "**done**");
    assert!(plain.sent()[0].content["formatted_body"].is_null());
}

/// Issue 36 row 3: a reply's files are posted after its text (an image as `m.image`, in
/// the human's thread), and the result is confirmed only once they are; an upload that keeps
/// failing is tried `MAX_UPLOAD_TRIES` times, an encrypted room's file never, and the room
/// is told of each.
#[test]
fn files_follow_the_text_and_one_that_cannot_be_sent_is_told_in_the_room() {
    let mut rig = Rig::new();
    let mut asked = human("$q", "draw");
    asked.thread = Some("$root".into());
    rig.core.on_human(&asked, ChatKind::Dm, &mut rig.gw);
    let file = |name: &str, mime: &str| crate::Attachment {
        name: name.into(),
        mime: mime.into(),
        size: 2048,
        sha256: None,
        path: Some(format!("/spool/{name}")),
        skipped: None,
    };
    let tries = super::engine::MAX_UPLOAD_TRIES;
    rig.core
        .homeserver_mut()
        .upload_answers
        .push_back(Ok(Some("mxc://fake/cat.png".into())));
    for _ in 0..tries {
        rig.core
            .homeserver_mut()
            .upload_answers
            .push_back(Err(ApiError::Transport("reset".into())));
    }
    rig.core.homeserver_mut().upload_answers.push_back(Ok(None));
    rig.gateway(result(
        "$q",
        TerminalOutcome::Reply {
            text: "done".into(),
            truncated: false,
            files: vec![
                file("cat.png", "image/png"),
                file("flaky.bin", ""),
                file("secret.txt", "text/plain"),
            ],
        },
        false,
    ));
    for _ in 0..2 * tries {
        rig.wait_and_settle();
    }
    let shown: Vec<String> = rig
        .core
        .homeserver()
        .sent
        .iter()
        .map(|s| match s.content["msgtype"].as_str() {
            Some("m.image") => format!("[image {}]", s.content["url"].as_str().unwrap_or("")),
            _ => s.body().to_owned(),
        })
        .collect();
    assert_eq!(
        shown,
        [
            "done",
            "[image mxc://fake/cat.png]",
            &format!("(file not sent: flaky.bin, 2.0 KiB: failed {tries} times: reset)"),
            "(file not sent: secret.txt, 2.0 KiB: an encrypted room: files are not uploaded unencrypted)",
        ]
    );
    let image = &rig.core.homeserver().sent[1].content;
    assert_eq!(image["m.relates_to"]["rel_type"], "m.thread");
    assert_eq!(image["m.relates_to"]["event_id"], "$root");
    assert_eq!(
        rig.core.homeserver().uploads.len(),
        tries as usize + 2,
        "flaky.bin tried {tries} times, no more"
    );
    assert_eq!(rig.gw.delivered, ["$q"]);
}
