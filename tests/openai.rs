//! The OpenAI-compatible agent against a scripted mock server (tests/mock_openai), through a
//! real runtime. No test needs the internet; none orders events with sleeps: they wait on
//! events, on the mock's reports and on status snapshots, with timeouts that only bound a
//! failing run.

mod mock_openai;

use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use mock_openai::{End, Mock, Notice, Reply, delta, error, stream};
use turnstile::{
    AgentUsage, Builder, CancelReason, EventKind, Events, FailReason, Handle, Message, Outcome,
    SessionKey,
};
use turnstile::{ApiKey, OpenAiConfig, OpenAiFactory};

const WAIT: Duration = Duration::from_secs(20);
const SYSTEM: &str = "You are terse.";

/// Every log record of every target, at DEBUG and above (what `RUST_LOG=debug` shows).
struct Capture(Mutex<Vec<(log::Level, String)>>);

impl log::Log for Capture {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.level() <= log::Level::Debug
    }
    fn log(&self, r: &log::Record<'_>) {
        if self.enabled(r.metadata()) {
            let line = format!("{} {}", r.target(), r.args());
            self.0
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((r.level(), line));
        }
    }
    fn flush(&self) {}
}

fn logs() -> &'static Capture {
    static C: OnceLock<&'static Capture> = OnceLock::new();
    C.get_or_init(|| {
        let c: &'static Capture = Box::leak(Box::new(Capture(Mutex::new(Vec::new()))));
        let _ = log::set_logger(c);
        log::set_max_level(log::LevelFilter::Debug);
        c
    })
}

fn log_lines(pred: impl Fn(log::Level, &str) -> bool) -> Vec<String> {
    logs()
        .0
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter(|(l, m)| pred(*l, m))
        .map(|(_, m)| m.clone())
        .collect()
}

struct Gateway {
    handle: Handle,
    events: Events,
    reactor: turnstile::RuntimeThread,
    /// The tokens the last reply [`run`](Self::run) returned reported (taken out of it, so
    /// outcomes compare by their text).
    tokens: std::cell::Cell<Option<u64>>,
}

impl Gateway {
    fn start(cfg: OpenAiConfig) -> Gateway {
        logs();
        let factory = OpenAiFactory::new(cfg).expect("valid settings");
        let (rt, handle, events) = Builder::new(factory)
            .partial_interval(Duration::ZERO)
            .tick_interval(Duration::from_millis(10))
            .build()
            .expect("valid runtime settings");
        let reactor = rt.spawn().expect("reactor thread");
        Gateway {
            handle,
            events,
            reactor,
            tokens: std::cell::Cell::new(None),
        }
    }

    fn send(&self, id: &str, session: &SessionKey, text: &str) {
        let msg = Message::new(id, session.clone(), text).expect("valid message");
        self.handle.submit(msg).expect("submitted");
    }

    /// The partials and the outcome of message `id` (events of other messages skipped).
    fn run(&self, id: &str) -> (Vec<String>, Outcome) {
        let mut partials = Vec::new();
        loop {
            let e = self.events.recv_timeout(WAIT).expect("an event in time");
            if &*e.id != id {
                continue;
            }
            match e.kind {
                EventKind::Partial(t) => partials.push(t),
                EventKind::Finished(mut o) => {
                    if let Outcome::Reply(r) = &mut o {
                        self.tokens.set(r.tokens.take());
                    }
                    return (partials, o);
                }
                _ => {}
            }
        }
    }

    fn ask(&self, id: &str, session: &SessionKey, text: &str) -> Outcome {
        self.send(id, session, text);
        self.run(id).1
    }

    /// Waits for a partial of message `id`, returning its text.
    fn first_partial(&self, id: &str) -> String {
        loop {
            let e = self.events.recv_timeout(WAIT).expect("an event in time");
            if &*e.id == id {
                match e.kind {
                    EventKind::Partial(t) => return t,
                    EventKind::Finished(o) => panic!("finished before any partial: {o:?}"),
                    _ => {}
                }
            }
        }
    }

    /// Waits for a log line matching `pred`, checking at each heartbeat (10 ms), for up
    /// to 20 s.
    fn wait_log(&self, pred: impl Fn(log::Level, &str) -> bool) {
        for _ in 0..2000 {
            if !log_lines(&pred).is_empty() {
                return;
            }
            let t = self.handle.status().ticks;
            self.handle
                .wait_status(WAIT, |st| st.ticks > t)
                .expect("heartbeat");
        }
        panic!("the expected log line never came");
    }

    /// The agents' failures (connect, status, stall) once the status shows `want`.
    fn failures_reach(&self, want: (u64, u64, u64)) {
        let seen = |st: &turnstile::Status| {
            st.agent_failures
                .is_some_and(|f| (f.connect, f.status, f.stall) == want)
        };
        if self.handle.wait_status(WAIT, seen).is_none() {
            let now = self.handle.status().agent_failures;
            panic!("failures {want:?} never shown; now {now:?}");
        }
    }

    fn stop(self) {
        self.handle.shutdown();
        let report = self.reactor.join().expect("reactor ran");
        assert!(report.clean, "{report:?}");
    }
}

fn config(mock: &Mock) -> OpenAiConfig {
    let mut cfg = OpenAiConfig::new(mock.base_url(), "test-model");
    cfg.system_prompt = Some(SYSTEM.into());
    cfg
}

fn key(chat: &str) -> SessionKey {
    SessionKey::dm("oa", chat).expect("valid key")
}

fn reply(text: &str) -> Outcome {
    Outcome::Reply(text.into())
}

fn failure(o: &Outcome) -> String {
    match o {
        Outcome::Failed(FailReason::Agent(t)) => t.clone(),
        other => panic!("expected an agent failure, got {other:?}"),
    }
}

/// The WARN lines of session `chat`'s failed turns (what the log says of them).
fn logged(chat: &str) -> String {
    let session = format!("session {}: openai turn failed: ", key(chat));
    log_lines(|l, m| l == log::Level::Warn && m.contains(&session)).join("\n")
}

fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
    v.iter()
        .map(|(r, c)| ((*r).to_owned(), (*c).to_owned()))
        .collect()
}

#[test]
fn streamed_reply_is_assembled_partials_forwarded_and_usage_counted() {
    let mock = Mock::start(vec![
        stream(&["Hel", "lo", " world"], 12, 3),
        stream(&["again"], 20, 1),
    ]);
    let gw = Gateway::start(config(&mock));
    let s = key("stream");
    gw.send("m1", &s, "hi");
    let (partials, outcome) = gw.run("m1");
    assert_eq!(outcome, reply("Hello world"));
    assert_eq!(
        gw.tokens.get(),
        Some(15),
        "the turn's own usage, with its reply"
    );
    assert_eq!(partials, ["Hel", "Hello", "Hello world"]);

    let req = mock.next_request();
    assert_eq!(req.line, "POST /v1/chat/completions HTTP/1.1");
    assert_eq!(req.body["model"], "test-model");
    assert_eq!(req.body["stream"], true);
    assert_eq!(req.body["stream_options"]["include_usage"], true);
    assert_eq!(req.messages(), pairs(&[("system", SYSTEM), ("user", "hi")]));
    assert!(
        !req.headers.contains_key("authorization"),
        "no key configured, yet an Authorization header was sent"
    );

    // Usage is summed across turns and shown in the status snapshot.
    assert_eq!(gw.ask("m2", &s, "more"), reply("again"));
    let want = AgentUsage {
        prompt_tokens: 32,
        completion_tokens: 4,
    };
    let st = gw
        .handle
        .wait_status(WAIT, |st| st.agent_usage == Some(want))
        .unwrap_or_else(|| panic!("usage never reached {want:?}: {:?}", gw.handle.status()));
    let json = serde_json::to_value(&*st).expect("status as JSON");
    assert_eq!(json["agent_usage"]["prompt_tokens"], 32);
    assert_eq!(json["agent_usage"]["completion_tokens"], 4);
    // And by model, as the metrics label it.
    assert_eq!(json["agent_usage_by_model"][0]["model"], "test-model");
    assert_eq!(
        json["agent_usage_by_model"][0]["usage"]["prompt_tokens"],
        32
    );
    gw.stop();
}

#[test]
fn history_is_sent_back_and_trimmed_at_the_bound() {
    let mock = Mock::start(vec![
        stream(&["a1"], 1, 1),
        stream(&["a2"], 1, 1),
        stream(&["a3"], 1, 1),
        stream(&["a4"], 1, 1),
    ]);
    let mut cfg = config(&mock);
    cfg.history_turns = 2;
    let gw = Gateway::start(cfg);
    let s = key("history");
    for i in 1..=4 {
        assert_eq!(
            gw.ask(&format!("m{i}"), &s, &format!("u{i}")),
            reply(&format!("a{i}"))
        );
    }
    let reqs: Vec<_> = (0..4).map(|_| mock.next_request().messages()).collect();
    assert_eq!(reqs[0], pairs(&[("system", SYSTEM), ("user", "u1")]));
    assert_eq!(
        reqs[1],
        pairs(&[
            ("system", SYSTEM),
            ("user", "u1"),
            ("assistant", "a1"),
            ("user", "u2")
        ])
    );
    // At the bound of 2 exchanges, the oldest (u1/a1) is gone.
    assert_eq!(
        reqs[3],
        pairs(&[
            ("system", SYSTEM),
            ("user", "u2"),
            ("assistant", "a2"),
            ("user", "u3"),
            ("assistant", "a3"),
            ("user", "u4")
        ])
    );
    gw.stop();
}

#[test]
fn history_is_trimmed_to_the_character_budget() {
    let mock = Mock::start(vec![
        stream(&["aaaa"], 1, 1),
        stream(&["bbbb"], 1, 1),
        stream(&["cccc"], 1, 1),
    ]);
    let mut cfg = config(&mock);
    // System prompt (14) + new message (4) + one exchange (8) fit in 30; two do not.
    cfg.history_chars = 30;
    let gw = Gateway::start(cfg);
    let s = key("budget");
    assert_eq!(gw.ask("m1", &s, "u111"), reply("aaaa"));
    assert_eq!(gw.ask("m2", &s, "u222"), reply("bbbb"));
    assert_eq!(gw.ask("m3", &s, "u333"), reply("cccc"));
    let reqs: Vec<_> = (0..3).map(|_| mock.next_request().messages()).collect();
    assert_eq!(
        reqs[2],
        pairs(&[
            ("system", SYSTEM),
            ("user", "u222"),
            ("assistant", "bbbb"),
            ("user", "u333")
        ])
    );
    gw.stop();
}

#[test]
fn new_resets_the_history() {
    let mock = Mock::start(vec![stream(&["first"], 1, 1), stream(&["second"], 1, 1)]);
    let gw = Gateway::start(config(&mock));
    let s = key("new");
    assert_eq!(gw.ask("m1", &s, "remember 7"), reply("first"));
    assert!(matches!(gw.ask("n", &s, "/new"), Outcome::Reply(_)));
    // The closed agent reports its session's usage.
    gw.wait_log(|l, m| {
        l == log::Level::Info
            && m.contains(&format!(
                "session {s}: openai agent closed after 1 turns: 1 prompt + 1 completion tokens"
            ))
    });
    assert_eq!(gw.ask("m2", &s, "what number?"), reply("second"));
    let _ = mock.next_request();
    assert_eq!(
        mock.next_request().messages(),
        pairs(&[("system", SYSTEM), ("user", "what number?")])
    );
    gw.stop();
}

/// `/stop` while the server streams (`Endless`) or holds the connection silent (`Hold`):
/// the turn ends `cancelled` by the agent itself (not abandoned past the grace), the
/// connection is closed, and the same agent (with its history) serves the next message.
fn stop_mid_stream(end: End) {
    let mock = Mock::start(vec![
        stream(&["one"], 1, 1),
        Reply::Stream {
            events: vec![delta("partial answer")],
            end,
        },
        stream(&["three"], 1, 1),
    ]);
    let gw = Gateway::start(config(&mock));
    let s = key("stop");
    assert_eq!(gw.ask("m1", &s, "first"), reply("one"));
    gw.send("m2", &s, "second");
    assert_eq!(gw.first_partial("m2"), "partial answer");
    gw.send("stop", &s, "/stop");
    assert_eq!(gw.run("m2").1, Outcome::Cancelled(CancelReason::Stopped));
    mock.wait_notice(|n| *n == Notice::ClientClosed { n: 1 });
    let st = gw
        .handle
        .wait_status(WAIT, |st| st.turns.cancelled == 1)
        .expect("the turn counted as cancelled");
    assert_eq!(st.turns.abandoned, 0, "the turn ignored the cancel: {st:?}");

    assert_eq!(gw.ask("m3", &s, "third"), reply("three"));
    let _ = mock.next_request();
    let _ = mock.next_request();
    assert_eq!(
        mock.next_request().messages(),
        pairs(&[
            ("system", SYSTEM),
            ("user", "first"),
            ("assistant", "one"),
            ("user", "third")
        ]),
        "the agent was replaced, or the stopped exchange entered the history"
    );
    gw.stop();
}

#[test]
fn stop_during_a_stream_cancels_the_turn() {
    stop_mid_stream(End::Endless);
}

#[test]
fn stop_during_a_stalled_stream_cancels_the_turn() {
    stop_mid_stream(End::Hold);
}

#[test]
fn rate_limit_is_retried_after_retry_after() {
    let mock = Mock::start(vec![
        error(429, "rate limited", &[("Retry-After", "1")]),
        stream(&["ok"], 1, 1),
    ]);
    let mut cfg = config(&mock);
    // The agent's own backoff is far shorter than Retry-After: only honouring it waits 1 s.
    cfg.retry_base = Duration::from_millis(10);
    let gw = Gateway::start(cfg);
    let s = key("ratelimit");
    assert_eq!(gw.ask("m1", &s, "hi"), reply("ok"));
    let Notice::Sent { at: refused_at, .. } =
        mock.wait_notice(|n| matches!(n, Notice::Sent { n: 0, .. }))
    else {
        unreachable!()
    };
    let _first = mock.next_request();
    let second = mock.next_request();
    assert!(
        second.at.duration_since(refused_at) >= Duration::from_secs(1),
        "retried {:?} after the 429, before its Retry-After of 1 s",
        second.at.duration_since(refused_at)
    );
    assert_eq!(
        second.messages(),
        pairs(&[("system", SYSTEM), ("user", "hi")])
    );
    let warned = log_lines(|l, m| {
        l == log::Level::Warn && m.contains(&s.to_string()) && m.contains("retry 1/3")
    });
    assert_eq!(warned.len(), 1, "{warned:?}");
    gw.stop();
}

#[test]
fn server_errors_are_retried_then_reported() {
    let mock = Mock::start(vec![
        error(503, "overloaded", &[]),
        error(502, "bad gateway", &[]),
        error(500, "boom", &[]),
        error(503, "still overloaded", &[]),
        error(503, "never asked", &[]),
    ]);
    let mut cfg = config(&mock);
    cfg.retry_base = Duration::from_millis(10);
    let gw = Gateway::start(cfg);
    let text = failure(&gw.ask("m1", &key("5xx"), "hi"));
    assert_eq!(text, "the model server is unavailable (HTTP 503)");
    // Each of the four answers counted as a status failure (issue 33 row 5).
    gw.failures_reach((0, 4, 0));
    let log = logged("5xx");
    assert!(
        log.contains("503 still overloaded") && log.contains("gave up after 3 retries"),
        "{log}"
    );
    for _ in 0..4 {
        let _ = mock.next_request();
    }
    assert!(
        mock.requests
            .recv_timeout(Duration::from_millis(300))
            .is_err(),
        "more than 3 retries"
    );
    gw.stop();
}

#[test]
fn refusals_show_the_status_in_chat_and_the_server_message_in_the_log() {
    let mock = Mock::start(vec![
        error(401, "invalid api key", &[]),
        error(404, "model \"x\" not found", &[]),
        Reply::Status {
            status: 404,
            headers: vec![],
            body: String::new(),
        },
        Reply::Status {
            status: 400,
            headers: vec![],
            body: String::new(),
        },
    ]);
    let gw = Gateway::start(config(&mock));
    let s = key("errors");
    let url = format!("{}/chat/completions", mock.base_url());
    let t401 = failure(&gw.ask("m1", &s, "hi"));
    assert_eq!(t401, "the model server refused the request (HTTP 401)");
    assert!(
        logged("errors").contains(&format!("401 invalid api key (from {url})")),
        "{}",
        logged("errors")
    );
    let t404 = failure(&gw.ask("m2", &s, "hi"));
    assert_eq!(t404, "the model server refused the request (HTTP 404)");
    assert!(logged("errors").contains("404 model \"x\" not found"));
    let _bare = failure(&gw.ask("m3", &s, "hi"));
    let log = logged("errors");
    assert!(
        log.contains("404 Not Found") && log.contains("\"test-model\""),
        "{log}"
    );
    let t400 = failure(&gw.ask("m4", &s, "hi"));
    assert_eq!(t400, "the model server refused the request (HTTP 400)");
    assert!(logged("errors").contains(&format!("400 Bad Request (from {url})")));
    assert_eq!(mock.requests.len(), 4, "a 4xx was retried");
    gw.stop();
}

#[test]
fn api_key_is_sent_but_never_logged_nor_shown() {
    const SECRET: &str = "sk-test-SECRET-4242";
    let mock = Mock::start(vec![
        stream(&["fine"], 1, 1),
        error(401, &format!("Incorrect API key provided: {SECRET}"), &[]),
    ]);
    let mut cfg = config(&mock);
    cfg.api_key = ApiKey::new(SECRET);
    let gw = Gateway::start(cfg);
    let s = key("secret");
    assert_eq!(gw.ask("m1", &s, "hi"), reply("fine"));
    let text = failure(&gw.ask("m2", &s, "hi"));
    assert_eq!(text, "the model server refused the request (HTTP 401)");
    assert!(
        logged("secret").contains("Incorrect API key provided: [redacted]"),
        "{}",
        logged("secret")
    );
    assert_eq!(
        mock.next_request()
            .headers
            .get("authorization")
            .map(String::as_str),
        Some(format!("Bearer {SECRET}").as_str())
    );
    gw.stop();
    let leaked = log_lines(|_, m| m.contains(SECRET));
    assert!(leaked.is_empty(), "the key was logged: {leaked:?}");
    assert!(
        !log_lines(|l, m| l == log::Level::Warn && m.contains("[redacted]")).is_empty(),
        "the failure was not logged at all"
    );
}

#[test]
fn malformed_chunks_fail_the_turn_and_the_agent_goes_on() {
    let mock = Mock::start(vec![
        Reply::Stream {
            events: vec![delta("so far"), "{not json".into()],
            end: End::Done,
        },
        Reply::Stream {
            events: vec![r#"{"choices":{"delta":"x"}}"#.into()],
            end: End::Done,
        },
        stream(&["recovered"], 1, 1),
    ]);
    let gw = Gateway::start(config(&mock));
    let s = key("malformed");
    let t = failure(&gw.ask("m1", &s, "hi"));
    assert_eq!(t, "the model server sent a malformed reply");
    let log = logged("malformed");
    assert!(
        log.contains("malformed stream") && log.contains("event 2"),
        "{log}"
    );
    let t = failure(&gw.ask("m2", &s, "hi"));
    assert_eq!(t, "the model server sent a malformed reply");
    assert_eq!(gw.ask("m3", &s, "hi"), reply("recovered"));
    gw.stop();
}

#[test]
fn a_server_closing_mid_stream_fails_the_turn() {
    let mock = Mock::start(vec![
        Reply::Stream {
            events: vec![delta("half an ans")],
            end: End::Abort,
        },
        Reply::Stream {
            events: vec![delta("half an ans")],
            end: End::Eof,
        },
    ]);
    let gw = Gateway::start(config(&mock));
    let s = key("close");
    let chunked = failure(&gw.ask("m1", &s, "hi"));
    assert_eq!(chunked, "the model server stopped sending the reply");
    assert!(logged("close").contains("closed"), "{}", logged("close"));
    let eof = failure(&gw.ask("m2", &s, "hi"));
    assert_eq!(eof, "the model server ended the reply early");
    assert!(
        logged("close")
            .contains("closed the stream before it finished (11 bytes of reply received)"),
        "{}",
        logged("close")
    );
    gw.stop();
}

#[test]
fn connection_refused_names_the_url_in_the_log_only() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let base = format!("http://127.0.0.1:{port}/v1");
    let gw = Gateway::start(OpenAiConfig::new(&base, "m"));
    let t = failure(&gw.ask("m1", &key("refused"), "hi"));
    assert_eq!(t, "the model server could not be reached");
    gw.failures_reach((1, 0, 0));
    assert!(
        logged("refused").contains(&format!(
            "cannot connect to {base}/chat/completions: connection refused"
        )),
        "{}",
        logged("refused")
    );
    gw.stop();
}

#[test]
fn an_endless_reply_is_cut_at_the_bound_and_its_connection_closed() {
    let mock = Mock::start(vec![Reply::Stream {
        events: vec![delta("partial answer")],
        end: End::Endless,
    }]);
    let mut cfg = config(&mock);
    cfg.max_reply_bytes = 64;
    let factory = OpenAiFactory::new(cfg).expect("valid settings");
    let (rt, handle, events) = Builder::new(factory)
        .max_reply_bytes(64)
        .build()
        .expect("valid runtime settings");
    let gw = Gateway {
        handle,
        events,
        reactor: rt.spawn().expect("reactor thread"),
        tokens: std::cell::Cell::new(None),
    };
    let s = key("endless");
    match gw.ask("m1", &s, "talk forever") {
        Outcome::Reply(r) => {
            assert!(r.truncated, "not flagged truncated");
            assert_eq!(r.text, format!("partial answer{}", ".".repeat(50)));
        }
        other => panic!("expected a truncated reply, got {other:?}"),
    }
    mock.wait_notice(|n| *n == Notice::ClientClosed { n: 0 });
    gw.stop();
}

/// `turnstile serve --agent openai`, configured partly by flags and partly by `--config`,
/// answered through `turnstile send`; its log at TRACE never shows the key.
#[test]
fn the_binary_serves_the_openai_agent() {
    use std::io::{BufRead, BufReader, Read};
    use std::process::{Command, Stdio};
    const SECRET: &str = "sk-cli-SECRET-777";
    let mock = Mock::start(vec![stream(&["from ", "the mock"], 5, 2)]);
    let dir = std::env::temp_dir().join(format!("turnstile-openai-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let prompt = dir.join("prompt.txt");
    std::fs::write(&prompt, "Answer in French.").expect("prompt file");
    let config = dir.join("serve.toml");
    std::fs::write(
        &config,
        format!(
            "agent = \"openai\"\nmodel = \"llama3.2\"\nopenai-base-url = \"{}\"\nhistory-turns = 5\n",
            mock.base_url()
        ),
    )
    .expect("config file");
    /// Kills the server if the test fails before it stops it.
    struct Reaped(std::process::Child);
    impl Drop for Reaped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let bin = env!("CARGO_BIN_EXE_turnstile");
    let mut serve = Command::new(bin)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "off",
            "--config",
        ])
        .arg(&config)
        .arg("--system-prompt-file")
        .arg(&prompt)
        .args(["--openai-api-key-env", "TEST_LLM_KEY"])
        .env("TEST_LLM_KEY", SECRET)
        .env("RUST_LOG", "trace")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map(Reaped)
        .expect("start turnstile serve");
    let mut first = String::new();
    BufReader::new(serve.0.stdout.take().expect("stdout"))
        .read_line(&mut first)
        .expect("first line");
    let addr = first
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("no listening line: {first:?}"))
        .to_owned();
    let out = Command::new(bin)
        .args(["send", "--addr", &addr, "bonjour"])
        .output()
        .expect("run turnstile send");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "from the mock");
    let req = mock.next_request();
    assert_eq!(req.body["model"], "llama3.2");
    assert_eq!(
        req.messages(),
        pairs(&[("system", "Answer in French."), ("user", "bonjour")])
    );
    assert_eq!(
        req.headers.get("authorization").map(String::as_str),
        Some(format!("Bearer {SECRET}").as_str())
    );
    // SAFETY: plain kill(2) on our own child's pid.
    let rc = unsafe { libc::kill(serve.0.id() as i32, libc::SIGTERM) };
    assert_eq!(rc, 0);
    let mut stderr = String::new();
    serve
        .0
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut stderr)
        .expect("read stderr");
    let status = serve.0.wait().expect("wait");
    assert!(status.success(), "{status:?}\n{stderr}");
    assert!(
        stderr.contains("ureq"),
        "no ureq log at all: the check below would prove nothing"
    );
    assert!(!stderr.contains(SECRET), "the key was logged:\n{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_binary_refuses_an_incomplete_openai_setup() {
    let bin = env!("CARGO_BIN_EXE_turnstile");
    let run = |args: &[&str]| {
        let out = std::process::Command::new(bin)
            .args(["serve", "--listen", "127.0.0.1:0", "--agent", "openai"])
            .args(args)
            .env_remove("NO_SUCH_KEY_VAR")
            .output()
            .expect("run serve");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, err) = run(&["--model", "m"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("--openai-base-url"), "{err}");
    let (code, err) = run(&["--openai-base-url", "http://127.0.0.1:1/v1"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("--model"), "{err}");
    let (code, err) = run(&[
        "--model",
        "m",
        "--openai-base-url",
        "http://127.0.0.1:1/v1",
        "--openai-api-key-env",
        "NO_SUCH_KEY_VAR",
    ]);
    assert_eq!(code, Some(2));
    assert!(err.contains("NO_SUCH_KEY_VAR"), "{err}");
    let (code, err) = run(&["--model", "m", "--openai-base-url", "127.0.0.1:11434"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("http://"), "{err}");
}

#[test]
fn sender_prefix_puts_the_sender_and_meta_before_the_text() {
    let mock = Mock::start(vec![stream(&["ok"], 1, 1)]);
    let mut cfg = config(&mock);
    cfg.sender_prefix = true;
    let gw = Gateway::start(cfg);
    let mut msg = Message::new("m1", key("prefix"), "hello").expect("valid message");
    msg.context.user_id = Some("u42".into());
    msg.context.user_name = Some("Alice".into());
    msg.context.meta = Some(r#"{"reply_to":"m0"}"#.into());
    gw.handle.submit(msg).expect("submitted");
    assert_eq!(gw.run("m1").1, reply("ok"));
    assert_eq!(
        mock.next_request().messages(),
        pairs(&[
            ("system", SYSTEM),
            (
                "user",
                "[from: Alice (id u42); meta: {\"reply_to\":\"m0\"}]\nhello"
            )
        ])
    );
    gw.stop();
}

#[test]
fn stop_during_a_retry_wait_cancels_the_turn() {
    let mock = Mock::start(vec![error(429, "slow down", &[("Retry-After", "30")])]);
    let gw = Gateway::start(config(&mock));
    let s = key("retrywait");
    gw.send("m1", &s, "hi");
    // The agent logs the retry just before it starts waiting.
    gw.wait_log(|l, m| l == log::Level::Warn && m.contains("slow down; retry 1/3"));
    gw.send("stop", &s, "/stop");
    assert_eq!(gw.run("m1").1, Outcome::Cancelled(CancelReason::Stopped));
    let st = gw
        .handle
        .wait_status(WAIT, |st| st.turns.cancelled == 1)
        .expect("the turn counted as cancelled");
    assert_eq!(
        st.turns.abandoned, 0,
        "the retry wait ignored the cancel: {st:?}"
    );
    assert_eq!(mock.requests.len(), 1, "retried despite the stop");
    gw.stop();
}

/// A listener whose accept queue is full: the kernel drops further SYNs, so a connect to it
/// hangs (retransmitting) as to a host that does not answer — without leaving 127.0.0.1.
fn unanswering_listener() -> (std::os::fd::OwnedFd, u16, Vec<std::net::TcpStream>) {
    use std::os::fd::FromRawFd;
    // SAFETY: plain socket calls on a descriptor we own; the address struct is ours.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
        assert!(fd >= 0, "socket");
        let owned = std::os::fd::OwnedFd::from_raw_fd(fd);
        let mut addr: libc::sockaddr_in = std::mem::zeroed();
        addr.sin_family = libc::AF_INET as libc::sa_family_t;
        addr.sin_addr.s_addr = u32::from(std::net::Ipv4Addr::LOCALHOST).to_be();
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        let rc = libc::bind(fd, (&raw const addr).cast(), len);
        assert_eq!(rc, 0, "bind");
        assert_eq!(libc::listen(fd, 0), 0, "listen");
        let mut bound: libc::sockaddr_in = std::mem::zeroed();
        let mut blen = len;
        libc::getsockname(fd, (&raw mut bound).cast(), &raw mut blen);
        let port = u16::from_be(bound.sin_port);
        // Fill the accept queue (backlog 0 holds one); later connects get no answer.
        let target = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let fillers = (0..3)
            .filter_map(|_| {
                std::net::TcpStream::connect_timeout(&target, Duration::from_millis(300)).ok()
            })
            .collect();
        (owned, port, fillers)
    }
}

/// Whether a socket is in SYN_SENT towards `port` (from /proc/net/tcp).
fn connecting_to(port: u16) -> bool {
    let tcp = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    let remote = format!("0100007F:{port:04X}");
    tcp.lines().skip(1).any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.len() > 3 && f[2] == remote && f[3] == "02"
    })
}

#[test]
fn stop_during_a_hanging_connect_cancels_the_turn() {
    let (_listener, port, _fillers) = unanswering_listener();
    let mut cfg = OpenAiConfig::new(format!("http://127.0.0.1:{port}/v1"), "m");
    cfg.connect_timeout = Duration::from_secs(60);
    let gw = Gateway::start(cfg);
    let s = key("connect");
    gw.send("m1", &s, "hi");
    let mut seen = false;
    for _ in 0..2000 {
        if connecting_to(port) {
            seen = true;
            break;
        }
        let t = gw.handle.status().ticks;
        gw.handle
            .wait_status(WAIT, |st| st.ticks > t)
            .expect("heartbeat");
    }
    assert!(
        seen,
        "the agent never got stuck connecting: the test proves nothing"
    );
    gw.send("stop", &s, "/stop");
    assert_eq!(gw.run("m1").1, Outcome::Cancelled(CancelReason::Stopped));
    let st = gw
        .handle
        .wait_status(WAIT, |st| st.turns.cancelled == 1)
        .expect("the turn counted as cancelled");
    assert_eq!(
        st.turns.abandoned, 0,
        "the connect ignored the cancel: {st:?}"
    );
    gw.stop();
}

#[test]
fn the_agent_works_without_the_runtime_and_counts_its_session() {
    use turnstile::MessageContext;
    use turnstile::Partials;
    use turnstile::{Agent, CancelToken, TurnInput};
    let mock = Mock::start(vec![
        stream(&["a"], 12, 3),
        stream(&["b"], 20, 1),
        Reply::Stream {
            events: vec![delta("x")],
            end: End::Abort,
        },
    ]);
    let factory = OpenAiFactory::new(config(&mock)).expect("valid settings");
    let s = key("direct");
    let mut agent = factory.agent(&s);
    let ctx = MessageContext::default();
    let partials = Partials::discard();
    let input = |text: &'static str| TurnInput {
        session: &s,
        message_id: "m",
        text,
        context: &ctx,
        partials: &partials,
    };
    let cancel = CancelToken::new();
    assert_eq!(agent.turn(&input("one"), &cancel), Ok("a".to_owned()));
    assert_eq!(agent.turn(&input("two"), &cancel), Ok("b".to_owned()));
    assert!(agent.turn(&input("three"), &cancel).is_err());
    assert_eq!(agent.history_len(), 2, "a failed turn entered the history");
    let want = AgentUsage {
        prompt_tokens: 32,
        completion_tokens: 4,
    };
    assert_eq!(agent.usage(), want);
    assert_eq!(turnstile::AgentFactory::usage(&factory), Some(want));
    let cancelled = CancelToken::new();
    cancelled.cancel();
    assert_eq!(
        agent.turn(&input("four"), &cancelled),
        Err(turnstile::TurnError::Cancelled)
    );
    assert_eq!(
        mock.requests.len(),
        3,
        "a cancelled turn still sent its request"
    );
    assert_eq!(agent.close(), Ok(()));
}

#[test]
fn a_long_error_body_still_yields_its_message() {
    let long = format!("invalid api key {}", "xx ".repeat(1400));
    let mock = Mock::start(vec![error(401, &long, &[])]);
    let gw = Gateway::start(config(&mock));
    let _ = failure(&gw.ask("m1", &key("long"), "hi"));
    let t = logged("long");
    assert!(
        t.contains("401 invalid api key xx xx"),
        "{}",
        &t[..160.min(t.len())]
    );
    gw.stop();
}

#[test]
fn a_silent_server_fails_the_turn_after_the_read_timeout() {
    let mock = Mock::start(vec![Reply::Stream {
        events: vec![delta("a")],
        end: End::Hold,
    }]);
    let mut cfg = config(&mock);
    cfg.read_timeout = Duration::from_millis(300);
    let gw = Gateway::start(cfg);
    let t = failure(&gw.ask("m1", &key("silent"), "hi"));
    assert_eq!(t, "the model server stalled (no reply content for 0.3 s)");
    gw.failures_reach((0, 0, 1));
    let url = format!("{}/chat/completions", mock.base_url());
    assert!(
        logged("silent").contains(&format!(
            "the stream from {url} broke after 1 bytes of reply: {url}: no content for 0.3 s (read timeout)"
        )),
        "{}",
        logged("silent")
    );
    mock.wait_notice(|n| *n == Notice::ClientClosed { n: 0 });
    gw.stop();
}

#[test]
fn a_connect_without_answer_fails_after_the_connect_timeout() {
    let (_listener, port, _fillers) = unanswering_listener();
    let base = format!("http://127.0.0.1:{port}/v1");
    let mut cfg = OpenAiConfig::new(&base, "m");
    cfg.connect_timeout = Duration::from_millis(300);
    let gw = Gateway::start(cfg);
    let t = failure(&gw.ask("m1", &key("connect-timeout"), "hi"));
    assert_eq!(t, "the model server could not be reached");
    assert!(
        logged("connect-timeout").contains(&format!(
            "{base}/chat/completions: connect timed out after 300ms"
        )),
        "{}",
        logged("connect-timeout")
    );
    gw.stop();
}

/// Issue 18 row 6: credentials and query of the base URL reach neither the chat nor the
/// log, and the request path goes before the query.
#[test]
fn a_base_url_with_credentials_and_a_query_stays_out_of_chats_and_logs() {
    const PASS: &str = "PASS-4242";
    const QSECRET: &str = "QSECRET-777";
    let mock = Mock::start(vec![error(503, "down for maintenance", &[])]);
    let base = format!(
        "http://admin:{PASS}@{}/v1?api-version=2024-02&api-key={QSECRET}",
        mock.addr
    );
    let mut cfg = OpenAiConfig::new(&base, "test-model");
    cfg.max_retries = 0;
    let gw = Gateway::start(cfg);
    let t = failure(&gw.ask("m1", &key("userinfo"), "hi"));
    assert_eq!(t, "the model server is unavailable (HTTP 503)");
    let req = mock.next_request();
    assert_eq!(
        req.line,
        format!("POST /v1/chat/completions?api-version=2024-02&api-key={QSECRET} HTTP/1.1")
    );
    // A refused connect says nothing of the address either.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let closed = format!("http://admin:{PASS}@127.0.0.1:{port}/v1?api-key={QSECRET}");
    let gw2 = Gateway::start(OpenAiConfig::new(&closed, "m"));
    let t = failure(&gw2.ask("m1", &key("userinfo-refused"), "hi"));
    assert_eq!(t, "the model server could not be reached");
    assert!(!t.contains("127.0.0.1"), "{t}");
    gw.stop();
    gw2.stop();
    let log = logged("userinfo-refused");
    assert!(
        log.contains(&format!(
            "cannot connect to http://[redacted]@127.0.0.1:{port}/v1/chat/completions?[redacted]"
        )),
        "{log}"
    );
    assert!(logged("userinfo").contains("503 down for maintenance"));
    let leaked = log_lines(|_, m| m.contains(PASS) || m.contains(QSECRET));
    assert!(
        leaked.is_empty(),
        "a secret of the URL was logged: {leaked:?}"
    );
}

/// Issue 18 row 7: a key echoed upper-cased, and key-like strings, are filtered.
#[test]
fn a_transformed_echo_of_the_key_is_filtered_from_chat_and_log() {
    const SECRET: &str = "sk-live-abcdef-9876";
    let upper = SECRET.to_uppercase();
    let mock = Mock::start(vec![error(
        403,
        &format!(
            "key {upper} is not allowed; token Bearer eyJhbGciOi.J9x; id 0123456789abcdef0123456789abcdef"
        ),
        &[],
    )]);
    let mut cfg = config(&mock);
    cfg.api_key = ApiKey::new(SECRET);
    let gw = Gateway::start(cfg);
    let t = failure(&gw.ask("m1", &key("upper"), "hi"));
    assert_eq!(t, "the model server refused the request (HTTP 403)");
    gw.stop();
    let log = logged("upper");
    assert!(log.contains("key [redacted] is not allowed"), "{log}");
    assert!(log.contains("Bearer [redacted]; id [redacted]"), "{log}");
    let leaked = log_lines(|_, m| {
        let m = m.to_ascii_lowercase();
        m.contains(SECRET) || m.contains("eyjhbgcioi") || m.contains("0123456789abcdef0123")
    });
    assert!(leaked.is_empty(), "a secret was logged: {leaked:?}");
}

/// Issue 18 row 8: keep-alives (comments, empty deltas) do not reset the read timeout.
#[test]
fn keep_alives_without_content_fail_the_turn_after_the_read_timeout() {
    let mock = Mock::start(vec![Reply::Stream {
        events: vec![delta("a")],
        end: End::Comments { ms: 20 },
    }]);
    let mut cfg = config(&mock);
    cfg.read_timeout = Duration::from_millis(500);
    let gw = Gateway::start(cfg);
    gw.send("m1", &key("keepalive"), "hi");
    // The server keeps the connection busy: several keep-alives went out...
    for _ in 0..3 {
        mock.wait_notice(|n| *n == Notice::Kept { n: 0 });
    }
    // ...and still the turn fails with the stall, and the connection is closed.
    let (_, o) = gw.run("m1");
    assert_eq!(
        failure(&o),
        "the model server stalled (no reply content for 0.5 s)"
    );
    mock.wait_notice(|n| *n == Notice::ClientClosed { n: 0 });
    assert!(logged("keepalive").contains("no content for 0.5 s (read timeout)"));
    gw.stop();
}

/// Issue 18 row 8: a stream that drips content forever ends at the stream deadline.
#[test]
fn a_dripping_stream_fails_at_the_stream_deadline() {
    let mock = Mock::start(vec![Reply::Stream {
        events: vec![],
        end: End::Endless,
    }]);
    let mut cfg = config(&mock);
    cfg.stream_timeout = Duration::from_millis(600);
    let gw = Gateway::start(cfg);
    gw.send("m1", &key("drip"), "hi");
    let (partials, o) = gw.run("m1");
    assert!(!partials.is_empty(), "content was flowing");
    assert_eq!(
        failure(&o),
        "the model server took longer than 0.6 s to reply"
    );
    mock.wait_notice(|n| *n == Notice::ClientClosed { n: 0 });
    assert!(logged("drip").contains("the reply took longer than 0.6 s (stream timeout)"));
    gw.stop();
}

/// A PNG's signature and header, then every byte value (what a data URL must carry intact).
fn png_bytes() -> Vec<u8> {
    let mut png = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR".to_vec();
    png.extend((0..3000u32).map(|i| (i * 7 % 256) as u8));
    png
}

/// `bytes` written as `name` in `dir`, and the entry a bridge would send for it.
fn spooled(dir: &std::path::Path, name: &str, mime: &str, bytes: &[u8]) -> turnstile::Attachment {
    let path = dir.join(name);
    std::fs::write(&path, bytes).expect("write the spool file");
    turnstile::Attachment {
        name: name.into(),
        mime: mime.into(),
        size: bytes.len() as u64,
        sha256: None,
        path: Some(path.display().to_string()),
        skipped: None,
    }
}

/// Issue 36 item 2: with vision on, an image goes to the model as an `image_url` part whose
/// data URL decodes to the file's bytes; the history keeps its placeholder, so the next
/// request carries `[image: NAME]` and none of the data.
#[test]
fn an_image_reaches_a_vision_model_as_a_data_url_and_the_history_keeps_its_placeholder() {
    use base64::Engine;
    let mock = Mock::start(vec![stream(&["a cat"], 1, 1), stream(&["yes"], 1, 1)]);
    let mut cfg = config(&mock);
    cfg.vision = true;
    let gw = Gateway::start(cfg);
    let spool = tempfile::tempdir().expect("spool");
    let png = png_bytes();
    let photo = spooled(spool.path(), "photo.png", "image/png", &png);
    let s = key("vision");
    let msg = Message::new("m1", s.clone(), "what is this?")
        .expect("valid message")
        .with_attachments(vec![photo]);
    gw.handle.submit(msg).expect("submitted");
    assert_eq!(gw.run("m1").1, reply("a cat"));

    let req = mock.next_request();
    let user = &req.body["messages"][1];
    assert_eq!(user["role"], "user");
    let parts = user["content"].as_array().expect("content parts");
    assert_eq!(parts.len(), 2, "{parts:?}");
    assert_eq!(
        parts[0],
        serde_json::json!({"type": "text", "text": "what is this?\n\n[image: photo.png]"})
    );
    assert_eq!(parts[1]["type"], "image_url");
    let url = parts[1]["image_url"]["url"].as_str().expect("a URL");
    let data = url
        .strip_prefix("data:image/png;base64,")
        .unwrap_or_else(|| panic!("not a PNG data URL: {:.60}", url));
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(data)
        .expect("base64");
    assert!(decoded == png, "the data URL is not the file's bytes");

    assert_eq!(gw.ask("m2", &s, "is it cute?"), reply("yes"));
    let req = mock.next_request();
    assert_eq!(
        req.messages(),
        pairs(&[
            ("system", SYSTEM),
            ("user", "what is this?\n\n[image: photo.png]"),
            ("assistant", "a cat"),
            ("user", "is it cute?")
        ])
    );
    let body = req.body.to_string();
    assert!(
        !body.contains("image_url") && !body.contains(&data[..64]),
        "the next request carries the image: {body:.300}"
    );
    gw.stop();
}

/// Issue 36 item 2, vision off (the default): the image is named, a text file is inlined
/// as the model's text, a PDF is named; the content stays a plain string.
#[test]
fn without_vision_an_image_is_named_and_a_text_file_inlined() {
    let mock = Mock::start(vec![stream(&["noted"], 1, 1)]);
    let gw = Gateway::start(config(&mock));
    let spool = tempfile::tempdir().expect("spool");
    let notes = "line one\nline <two> & \"three\"\n";
    let files = vec![
        spooled(spool.path(), "photo.png", "image/png", &png_bytes()),
        spooled(spool.path(), "notes.txt", "text/plain", notes.as_bytes()),
        spooled(
            spool.path(),
            "report.pdf",
            "application/pdf",
            b"%PDF-1.7 ...",
        ),
    ];
    let msg = Message::new("m1", key("novision"), "see these")
        .expect("valid message")
        .with_attachments(files);
    gw.handle.submit(msg).expect("submitted");
    assert_eq!(gw.run("m1").1, reply("noted"));
    let req = mock.next_request();
    let png = png_bytes().len();
    let want = format!(
        "see these\n\n[attached: photo.png, image/png, {png} bytes]\n\n\
         [file: notes.txt, text/plain, {} bytes]\n{notes}\n[end of notes.txt]\n\n\
         [attached: report.pdf, application/pdf, 12 bytes]",
        notes.len()
    );
    assert_eq!(req.body["messages"][1]["content"], want.as_str());
    assert!(!req.body.to_string().contains("image_url"));
    gw.stop();
}

/// The binary's `openai-vision` and `openai-inline-text-bytes` (config file keys here, the
/// same as the flags), with files from `turnstile send --attach` through the spool.
#[test]
fn the_binary_sends_attached_files_as_its_settings_say() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let mock = Mock::start(vec![stream(&["seen"], 1, 1)]);
    let dir = tempfile::tempdir().expect("temp dir");
    let spool = dir.path().join("spool");
    let config = dir.path().join("serve.toml");
    std::fs::write(
        &config,
        format!(
            "agent = \"openai\"\nmodel = \"m\"\nopenai-base-url = \"{}\"\nopenai-vision = true\nopenai-inline-text-bytes = 5\n",
            mock.base_url()
        ),
    )
    .expect("config file");
    let photo = dir.path().join("photo.png");
    std::fs::write(&photo, png_bytes()).expect("photo");
    let notes = dir.path().join("notes.txt");
    std::fs::write(&notes, "0123456789").expect("notes");
    struct Reaped(std::process::Child);
    impl Drop for Reaped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let bin = env!("CARGO_BIN_EXE_turnstile");
    let mut serve = Command::new(bin)
        .args(["serve", "--listen", "127.0.0.1:0", "--http-listen", "off"])
        .arg("--config")
        .arg(&config)
        .arg("--attachments-dir")
        .arg(&spool)
        .env("RUST_LOG", "warn")
        .env_remove("OPENAI_API_KEY")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map(Reaped)
        .expect("start turnstile serve");
    let mut first = String::new();
    BufReader::new(serve.0.stdout.take().expect("stdout"))
        .read_line(&mut first)
        .expect("first line");
    let addr = first
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("no listening line: {first:?}"))
        .to_owned();
    let out = Command::new(bin)
        .args(["send", "--addr", &addr, "--attachments-dir"])
        .arg(&spool)
        .arg("--attach")
        .arg(&photo)
        .arg("--attach")
        .arg(&notes)
        .arg("look")
        .output()
        .expect("run turnstile send");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "seen",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let req = mock.next_request();
    let parts = req.body["messages"][0]["content"]
        .as_array()
        .unwrap_or_else(|| panic!("content parts: {}", req.body));
    assert_eq!(
        parts[0]["text"],
        "look\n\n[image: photo.png]\n\n[file: notes.txt, unknown type, 10 bytes]\n01234\n\
         [end of notes.txt: cut, the first 5 of 10 bytes shown]"
    );
    let url = parts[1]["image_url"]["url"].as_str().expect("an image URL");
    assert!(
        url.starts_with("data:image/png;base64,iVBORw0KGgo"),
        "{url:.60}"
    );
}
