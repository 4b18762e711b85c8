use super::*;
use std::collections::VecDeque;

use super::api::interpret;
use super::render::{MAX_NOTICES, MAX_PENDING_FACTOR, MAX_STRIKES};
use super::update::{Update, chat_of, reply_target, update_to_message};
use crate::message::{ChatType, SessionKey};
use crate::platforms::gateway::{TerminalEvent, TerminalOutcome};

/// A scripted Bot API: answers from a queue (default: success), records every call.
struct ScriptedApi {
    answers: VecDeque<Result<Value, ApiError>>,
    calls: Vec<(String, Value)>,
    next_message_id: i64,
}

impl ScriptedApi {
    fn new() -> ScriptedApi {
        ScriptedApi {
            answers: VecDeque::new(),
            calls: Vec::new(),
            next_message_id: 100,
        }
    }
}

impl BotApi for ScriptedApi {
    fn call(&mut self, method: &str, params: &Value, _: Duration) -> Result<Value, ApiError> {
        self.calls.push((method.to_owned(), params.clone()));
        if let Some(a) = self.answers.pop_front() {
            return a;
        }
        self.next_message_id += 1;
        Ok(json!({"message_id": self.next_message_id}))
    }

    fn upload(
        &mut self,
        method: &str,
        params: &Value,
        field: &str,
        file: &crate::Attachment,
        timeout: Duration,
    ) -> Result<Value, ApiError> {
        let mut params = params.clone();
        params[field] = json!(file.path);
        self.call(method, &params, timeout)
    }
}

fn result(id: &str, text: &str) -> TerminalEvent {
    TerminalEvent {
        id: id.into(),
        session: "telegram:dm:42".into(),
        outcome: TerminalOutcome::Reply {
            text: text.into(),
            truncated: false,
            files: Vec::new(),
        },
        redelivery: false,
    }
}

fn run_until_idle(r: &mut Renderer, api: &mut ScriptedApi, now: Instant) -> Vec<String> {
    let mut done = Vec::new();
    for _ in 0..100 {
        match r.step(api, now).expect("step") {
            Step::Worked(d) => done.extend(d),
            Step::Idle(_) => return done,
        }
    }
    panic!("never idle");
}

#[test]
fn under_429_only_the_newest_text_is_sent_after_the_wait() {
    let t0 = Instant::now();
    let mut r = Renderer::new(Duration::from_secs(1), 10);
    let mut api = ScriptedApi::new();
    api.answers
        .push_back(Err(ApiError::RetryAfter(Duration::from_secs(3))));
    r.partial("tg-1-7", "telegram:dm:42", "He");
    assert_eq!(r.step(&mut api, t0).expect("step"), Step::Worked(vec![]));
    // Paused: nothing is called however much arrives.
    r.partial("tg-1-7", "telegram:dm:42", "Hell");
    r.partial("tg-1-7", "telegram:dm:42", "Hello");
    assert!(r.result(&result("tg-1-7", "Hello, world")));
    // The wait counts from the 429's answer (a moment after t0).
    let paused = r.step(&mut api, t0 + Duration::from_secs(2)).expect("step");
    assert!(
        matches!(paused, Step::Idle(Some(t)) if t >= t0 + Duration::from_secs(3)),
        "{paused:?}"
    );
    assert_eq!(api.calls.len(), 1);
    let done = run_until_idle(&mut r, &mut api, t0 + Duration::from_secs(4));
    assert_eq!(done, ["tg-1-7"]);
    let sent: Vec<_> = api
        .calls
        .iter()
        .map(|(m, p)| (m.as_str(), p["text"].clone()))
        .collect();
    assert_eq!(
        sent,
        [
            ("sendMessage", json!("He")),
            ("sendMessage", json!("Hello, world"))
        ]
    );
    assert_eq!(api.calls[1].1["reply_parameters"]["message_id"], 7);
}

#[test]
fn partials_edit_in_place_identical_text_is_skipped_and_results_go_first() {
    let t0 = Instant::now();
    let mut r = Renderer::new(Duration::from_secs(1), 10);
    let mut api = ScriptedApi::new();
    r.partial("tg-1-7", "telegram:dm:42", "a");
    run_until_idle(&mut r, &mut api, t0);
    // Within the edit interval the next partial waits; a result of another reply does not.
    r.partial("tg-1-7", "telegram:dm:42", "ab");
    r.result(&TerminalEvent {
        session: "telegram:dm:43".into(),
        ..result("tg-2-8", "other")
    });
    assert_eq!(run_until_idle(&mut r, &mut api, t0), ["tg-2-8"]);
    assert_eq!(api.calls.len(), 2);
    run_until_idle(&mut r, &mut api, t0 + Duration::from_secs(1));
    assert_eq!(api.calls[2].0, "editMessageText");
    assert_eq!(api.calls[2].1["text"], "ab");
    // The result equals what is shown: no call at all.
    r.result(&result("tg-1-7", "ab"));
    assert_eq!(
        run_until_idle(&mut r, &mut api, t0 + Duration::from_secs(2)),
        ["tg-1-7"]
    );
    assert_eq!(api.calls.len(), 3);
}

#[test]
fn a_text_over_4096_utf16_units_continues_in_a_new_message() {
    let t0 = Instant::now();
    let mut r = Renderer::new(Duration::ZERO, 10);
    let mut api = ScriptedApi::new();
    r.partial("tg-1-7", "telegram:dm:42", "start");
    run_until_idle(&mut r, &mut api, t0);
    let long = "🎉 ".repeat(2000); // 6,000 UTF-16 units
    r.result(&result("tg-1-7", &long));
    assert_eq!(run_until_idle(&mut r, &mut api, t0), ["tg-1-7"]);
    let methods: Vec<_> = api.calls.iter().map(|(m, _)| m.as_str()).collect();
    assert_eq!(methods, ["sendMessage", "editMessageText", "sendMessage"]);
    let texts: Vec<String> = api.calls[1..]
        .iter()
        .map(|(_, p)| p["text"].as_str().expect("text").to_owned())
        .collect();
    assert!(texts.iter().all(|t| t.encode_utf16().count() <= 4096));
    assert_eq!(texts.concat(), long);
    assert!(api.calls[2].1.get("reply_parameters").is_none());
}

#[test]
fn repeated_rate_limits_stop_the_partials_of_a_reply() {
    let t0 = Instant::now();
    let mut r = Renderer::new(Duration::ZERO, 10);
    let mut api = ScriptedApi::new();
    for i in 0..MAX_STRIKES {
        api.answers
            .push_back(Err(ApiError::RetryAfter(Duration::from_secs(1))));
        r.partial("tg-1-7", "telegram:dm:42", &format!("p{i}"));
        let _ = r.step(&mut api, t0 + Duration::from_secs(u64::from(i) * 2));
    }
    r.partial("tg-1-7", "telegram:dm:42", "ignored");
    assert_eq!(
        run_until_idle(&mut r, &mut api, t0 + Duration::from_secs(60)),
        Vec::<String>::new()
    );
    assert_eq!(api.calls.len(), MAX_STRIKES as usize);
    r.result(&result("tg-1-7", "final"));
    assert_eq!(
        run_until_idle(&mut r, &mut api, t0 + Duration::from_secs(60)),
        ["tg-1-7"]
    );
    assert_eq!(api.calls.last().expect("call").1["text"], "final");
}

#[test]
fn a_cancelled_turn_keeps_its_shown_text_and_ends_with_the_marker() {
    let t0 = Instant::now();
    let mut r = Renderer::new(Duration::ZERO, 10);
    let mut api = ScriptedApi::new();
    r.partial("tg-1-7", "telegram:dm:42", "half an answer");
    run_until_idle(&mut r, &mut api, t0);
    r.result(&TerminalEvent {
        outcome: TerminalOutcome::Cancelled {
            reason: "stopped".into(),
        },
        ..result("tg-1-7", "")
    });
    assert_eq!(run_until_idle(&mut r, &mut api, t0), ["tg-1-7"]);
    assert_eq!(api.calls[1].0, "editMessageText");
    assert_eq!(
        api.calls[1].1["text"],
        "half an answer\n[cancelled: stopped]"
    );
}

#[test]
fn pending_replies_and_notices_are_bounded() {
    let mut r = Renderer::new(Duration::ZERO, 1);
    for i in 0..MAX_PENDING_FACTOR {
        assert!(r.has_room());
        r.result(&result(&format!("tg-{i}-1"), "x"));
    }
    assert!(
        !r.has_room(),
        "results beyond the bound stay with the gateway"
    );
    // One notice waits per chat: the others are folded into it, and said in it.
    for _ in 0..5 {
        r.notice(("42", None), None, "rejected");
    }
    assert_eq!(r.notices_waiting(), 1);
    let mut folded = Renderer::new(Duration::ZERO, 1);
    for _ in 0..3 {
        folded.notice(("42", None), None, "[not accepted]");
    }
    let mut api = ScriptedApi::new();
    run_until_idle(&mut folded, &mut api, Instant::now());
    assert_eq!(api.calls.len(), 1, "{:?}", api.calls);
    assert_eq!(
        api.calls[0].1["text"],
        "[not accepted] (and 2 more message(s) not accepted)"
    );
    for chat in 0..MAX_NOTICES + 5 {
        r.notice((&chat.to_string(), None), None, "rejected");
    }
    assert_eq!(r.notices_waiting(), MAX_NOTICES);
}

/// `v` read as an update (from text, as the poller reads them).
fn update(v: &Value) -> Update {
    serde_json::from_str(&v.to_string()).expect("an update")
}

#[test]
fn updates_map_to_dm_and_group_messages() {
    let private = json!({"update_id": 5, "message": {"message_id": 9, "text": "/stop@test_bot",
        "chat": {"id": 42, "type": "private"}, "from": {"id": 7, "first_name": "Ann", "username": "ann"}}});
    let m = update_to_message(&update(&private), "test_bot").expect("message");
    assert_eq!(
        (m.id.as_str(), m.chat_id.as_str(), m.chat_type),
        ("tg-5-9", "42", ChatType::Dm)
    );
    assert_eq!(m.text, "/stop");
    assert_eq!(m.user_name.as_deref(), Some("Ann"));
    assert_eq!(reply_target(&m.id), Some(9));
    let group = json!({"update_id": 6, "message": {"message_id": 3, "text": "hi",
        "chat": {"id": -100, "type": "supergroup"}, "from": {"id": 8, "first_name": "Bob"}}});
    let m = update_to_message(&update(&group), "test_bot").expect("message");
    assert_eq!(
        (m.chat_type, m.user_id.as_deref()),
        (ChatType::Group, Some("8"))
    );
    let key = SessionKey::new(
        "telegram",
        m.chat_type,
        &m.chat_id,
        None,
        m.user_id.as_deref(),
    )
    .expect("key");
    assert_eq!(key.to_string(), "telegram:group:-100:user:8");
    assert_eq!(chat_of(&key.to_string()).as_deref(), Some("-100"));
    let photo =
        json!({"update_id": 7, "message": {"message_id": 4, "chat": {"id": 1, "type": "private"}}});
    assert_eq!(update_to_message(&update(&photo), "test_bot"), None);
    let channel = json!({"update_id": 8, "message": {"message_id": 4, "text": "x", "chat": {"id": 1, "type": "channel"}}});
    assert_eq!(update_to_message(&update(&channel), "test_bot"), None);
}

#[test]
fn api_errors_are_classified_and_retry_after_is_read() {
    let e = interpret::<Value>(
        "sendMessage",
        429,
        r#"{"ok":false,"error_code":429,"description":"Too Many Requests: retry after 3","parameters":{"retry_after":3}}"#,
    );
    assert_eq!(e, Err(ApiError::RetryAfter(Duration::from_secs(3))));
    assert!(matches!(
        interpret::<Value>(
            "getMe",
            401,
            r#"{"ok":false,"error_code":401,"description":"Unauthorized"}"#
        ),
        Err(ApiError::Unauthorized(_))
    ));
    assert!(matches!(
        interpret::<Value>(
            "x",
            400,
            r#"{"ok":false,"error_code":400,"description":"Bad Request: chat not found"}"#
        ),
        Err(ApiError::Permanent(_))
    ));
    assert!(matches!(
        interpret::<Value>("x", 502, "<html>"),
        Err(ApiError::Transient(_))
    ));
    assert_eq!(
        interpret::<Value>("x", 200, r#"{"ok":true,"result":{"a":1}}"#),
        Ok(json!({"a":1}))
    );
}

#[test]
fn the_token_is_redacted_from_errors() {
    let mut api = HttpBotApi::new("http://127.0.0.1:1", "123:SECRET");
    let e = api
        .call("getMe", &json!({}), Duration::from_secs(5))
        .expect_err("nothing listens");
    assert!(!e.to_string().contains("SECRET"), "{e}");
    assert_eq!(
        crate::platforms::secrets::redact("https://x/bot123:SECRET/getMe"),
        "https://x/bot<redacted>/getMe"
    );
}

#[test]
fn the_offset_survives_in_the_state_dir_and_a_damaged_file_is_an_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = OffsetStore::new(Some(dir.path())).expect("store");
    assert_eq!(store.load(), Ok(None));
    store.save(42).expect("save");
    assert_eq!(
        OffsetStore::new(Some(dir.path())).expect("store").load(),
        Ok(Some(42))
    );
    std::fs::write(dir.path().join("telegram-offset"), "garbage").expect("write");
    assert!(store.load().is_err());
}

/// Issue 32 row 3: a group message is marked for the bot (`meta.to_bot`) only when it names
/// `@test_bot`, is a `/command@test_bot`, or replies to the bot.
#[test]
fn a_group_message_is_marked_to_the_bot_only_when_addressed() {
    let group = |text: &str, reply_from: Option<&str>| {
        let mut u = json!({"update_id": 6, "message": {"message_id": 3, "text": text,
            "chat": {"id": -100, "type": "supergroup"}, "from": {"id": 8, "first_name": "Bob"}}});
        if let Some(f) = reply_from {
            u["message"]["reply_to_message"] = json!({"message_id": 2, "from": {"username": f}});
        }
        let m = update_to_message(&update(&u), "test_bot").expect("message");
        let meta: serde_json::Value =
            serde_json::from_str(m.meta.as_deref().expect("meta")).expect("json");
        meta.get("to_bot") == Some(&json!(true))
    };
    assert!(!group("chatter", None));
    assert!(!group("ask @test_bot_fan", None), "another handle");
    assert!(group("hey @Test_Bot what now", None));
    assert!(group("/status@test_bot", None));
    assert!(group("thanks", Some("test_bot")));
    assert!(!group("thanks", Some("ann")));
}

/// Issue 30 row 4: a chat with ten results waiting does not hold another chat's first reply
/// behind them: the chats take turns (before: the other chat's reply went out eleventh).
#[test]
fn a_flooding_chat_cannot_hold_another_chats_first_reply() {
    let t0 = Instant::now();
    let mut r = Renderer::new(Duration::from_secs(1), 64);
    let mut api = ScriptedApi::new();
    for i in 0..10 {
        r.result(&result(&format!("tg-{i}-{i}"), &format!("flood {i}")));
    }
    // The other chat's first line is a partial: it goes before the flood's later results too.
    r.partial("tg-50-50", "telegram:dm:43", "hello");
    r.result(&TerminalEvent {
        session: "telegram:dm:44".into(),
        ..result("tg-60-60", "answer")
    });
    run_until_idle(&mut r, &mut api, t0);
    let chats: Vec<i64> = api
        .calls
        .iter()
        .filter(|(m, _)| m == "sendMessage")
        .map(|(_, p)| p["chat_id"].as_i64().expect("chat id"))
        .collect();
    assert_eq!(&chats[..4], [42, 43, 44, 42], "{chats:?}");
    assert_eq!(chats.iter().filter(|c| **c == 42).count(), 10);
    // The flood's own replies keep their order.
    let flood: Vec<&str> = api
        .calls
        .iter()
        .filter(|(_, p)| p["chat_id"] == 42)
        .filter_map(|(_, p)| p["text"].as_str())
        .collect();
    let expected: Vec<String> = (0..10).map(|i| format!("flood {i}")).collect();
    assert_eq!(flood, expected);
}

/// Issue 36 row 4: with Markdown on, pieces go out as `parse_mode: HTML` (a partial's open
/// fence as an open code block), and a cancelled reply keeps what it showed re-rendered
/// from its Markdown (not its HTML escaped); `--format plain` sends the text as it is.
#[test]
fn issue36_markdown_goes_out_as_telegram_html_and_a_cancellation_keeps_its_formatting() {
    use crate::platforms::markdown::Format;
    let t0 = Instant::now();
    let mut r = Renderer::new(Duration::from_secs(1), 10).with_format(Format::Markdown);
    let mut api = ScriptedApi::new();
    r.partial("tg-1-7", "telegram:dm:42", "**Hi** <b>\n\n```py\nx = 1");
    run_until_idle(&mut r, &mut api, t0);
    let (method, params) = &api.calls[0];
    assert_eq!(method, "sendMessage");
    assert_eq!(params["parse_mode"], "HTML");
    assert_eq!(
        params["text"],
        "<b>Hi</b> &lt;b&gt;\n\n<pre><code class=\"language-py\">x = 1</code></pre>"
    );
    let cancelled = TerminalEvent {
        outcome: TerminalOutcome::Cancelled {
            reason: "stopped".into(),
        },
        ..result("tg-1-7", "")
    };
    assert!(r.result(&cancelled));
    run_until_idle(&mut r, &mut api, t0 + Duration::from_secs(2));
    let (method, params) = api.calls.last().expect("the last edit");
    assert_eq!(method, "editMessageText");
    assert_eq!(params["parse_mode"], "HTML");
    let text = params["text"].as_str().expect("text");
    assert!(
        text.starts_with("<b>Hi</b> &lt;b&gt;\n\n<pre><code class=\"language-py\">x = 1\n"),
        "{text}"
    );
    assert!(
        text.contains("cancelled") && !text.contains("&lt;pre"),
        "{text}"
    );

    let mut plain = Renderer::new(Duration::from_secs(1), 10).with_format(Format::Plain);
    let mut api = ScriptedApi::new();
    plain.partial("tg-2-8", "telegram:dm:42", "**Hi** <b>");
    run_until_idle(&mut plain, &mut api, t0);
    assert_eq!(api.calls[0].1["text"], "**Hi** <b>");
    assert!(api.calls[0].1.get("parse_mode").is_none());
}

/// Issue 36 row 3: a reply's file goes after its text and the result is confirmed only
/// then; an upload failing for a reason that may pass is tried [`MAX_UPLOAD_TRIES`] times,
/// never forever, and then the chat is told.
#[test]
fn a_file_is_sent_after_the_text_and_one_that_keeps_failing_is_told_not_retried_forever() {
    use super::upload::MAX_UPLOAD_TRIES;
    let mut t = Instant::now();
    let mut r = Renderer::new(Duration::from_secs(1), 10);
    let mut api = ScriptedApi::new();
    let file = |name: &str| crate::Attachment {
        name: name.into(),
        mime: "text/plain".into(),
        size: 5,
        sha256: None,
        path: Some(format!("/spool/{name}")),
        skipped: None,
    };
    let mut event = result("tg-1-7", "here");
    event.outcome = TerminalOutcome::Reply {
        text: "here".into(),
        truncated: false,
        files: vec![file("a.txt"), file("b.txt")],
    };
    assert!(r.result(&event));
    // The text is shown, then a.txt fails for good: the chat is told, b.txt still goes.
    api.answers.push_back(Ok(json!({"message_id": 1})));
    api.answers
        .push_back(Err(ApiError::Permanent("sendDocument: 400 nope".into())));
    for _ in 0..MAX_UPLOAD_TRIES {
        api.answers
            .push_back(Err(ApiError::Transient("sendDocument: 502".into())));
    }
    let mut done = Vec::new();
    for _ in 0..20 {
        t += Duration::from_secs(100); // past any pause
        match r.step(&mut api, t).expect("step") {
            Step::Worked(d) => done.extend(d),
            Step::Idle(_) => break,
        }
    }
    let calls: Vec<(&str, Value)> = api
        .calls
        .iter()
        .map(|(m, p)| (m.as_str(), p["document"].clone()))
        .collect();
    let mut expected = vec![
        ("sendMessage", Value::Null),
        ("sendDocument", json!("/spool/a.txt")),
    ];
    expected.extend((0..MAX_UPLOAD_TRIES).map(|_| ("sendDocument", json!("/spool/b.txt"))));
    expected.push(("sendMessage", Value::Null));
    assert_eq!(calls, expected);
    assert_eq!(
        api.calls.last().expect("told").1["text"].clone(),
        json!(
            "(file not sent: a.txt, 5 B: sendDocument: 400 nope)\n(file not sent: b.txt, 5 B: failed 5 times: sendDocument: 502)"
        )
    );
    assert_eq!(done, ["tg-1-7"], "confirmed once, after its files");
}
