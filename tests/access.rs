//! Issue 32, the access policy, end to end through the real binary: `turnstile serve` with
//! an `[access.*]` table, spoken to over a real socket with the bridge protocol, its agent a
//! shell command that records every run in a file. Reads have timeouts that only bound a
//! failing run; nothing sleeps to order events.

mod child_support;
mod common;
mod mock_openai;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use child_support::{Proc, die_with_parent};
use common::eventually;
use serde_json::{Value, json};

/// Only a failing run waits this long.
const WAIT: Duration = Duration::from_secs(60);

/// `turnstile serve` with `config` as its `--config` file and an agent that appends one line
/// to `dir/runs` per turn and answers `agent: <user>`.
fn serve(dir: &Path, config: &str, extra: &[&str]) -> (Proc, String) {
    let (serve, addr, _) = serve_on(dir, config, extra, false);
    (serve, addr)
}

/// [`serve`], with the HTTP endpoint on a free port when `http` (its address third).
fn serve_on(dir: &Path, config: &str, extra: &[&str], http: bool) -> (Proc, String, String) {
    let runs = dir.join("runs");
    let agent = format!(
        "echo run >> {}; echo \"agent: $TURNSTILE_USER_ID\"",
        runs.display()
    );
    serve_agent(
        dir,
        config,
        &["--agent", "exec", "--agent-cmd", &agent],
        extra,
        http,
    )
}

/// [`serve_on`] with the agent flags `agent`.
fn serve_agent(
    dir: &Path,
    config: &str,
    agent: &[&str],
    extra: &[&str],
    http: bool,
) -> (Proc, String, String) {
    let path = dir.join("turnstile.toml");
    std::fs::write(&path, config).expect("config");
    let mut child = die_with_parent(
        Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args(["serve", "--listen", "127.0.0.1:0", "--http-listen"])
            .arg(if http { "127.0.0.1:0" } else { "off" })
            .args(agent)
            .arg("--config")
            .arg(&path)
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit()),
    )
    .spawn()
    .expect("start serve");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = |prefix: &str| {
        let mut l = String::new();
        out.read_line(&mut l).expect("a line");
        let at = l.trim().strip_prefix(prefix).map(str::to_owned);
        at.unwrap_or_else(|| panic!("{prefix}…: {l:?}"))
    };
    let addr = line("listening on ");
    let http_addr = if http {
        line("http on ")
    } else {
        String::new()
    };
    (Proc(child), addr, http_addr)
}

/// `turnstile access --http ADDR --platform P ARGS…`: its exit code and stdout and stderr.
fn access_cli(http: &str, token: &str, platform: &str, args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args([
            "access",
            "--http",
            http,
            "--token",
            token,
            "--platform",
            platform,
        ])
        .args(args)
        .env_remove("TURNSTILE_AUTH_TOKEN")
        .output()
        .expect("run turnstile access");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

fn runs(dir: &Path) -> usize {
    std::fs::read_to_string(dir.join("runs")).map_or(0, |s| s.lines().count())
}

struct Client {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Client {
    fn connect(addr: &str, platform: &str) -> Client {
        Client::connect_with(addr, &json!({"op": "hello", "platform": platform}))
    }

    fn connect_with(addr: &str, hello: &Value) -> Client {
        let stream = TcpStream::connect(addr).expect("connect");
        stream.set_read_timeout(Some(WAIT)).expect("timeout");
        let mut c = Client {
            reader: BufReader::new(stream.try_clone().expect("clone")),
            writer: stream,
        };
        c.send(hello);
        c
    }

    fn send(&mut self, v: &Value) {
        writeln!(self.writer, "{v}").expect("write");
    }

    fn recv(&mut self) -> Value {
        let mut line = String::new();
        let n = self.reader.read_line(&mut line).expect("a line in time");
        assert!(n > 0, "connection closed");
        serde_json::from_str(&line).expect("json")
    }

    /// Sends a message from `user` and returns its ack and its terminal event.
    fn ask(&mut self, id: &str, user: &str, text: &str, group: Option<&Value>) -> (Value, Value) {
        let mut m = json!({"op": "message", "id": id, "chat_id": format!("chat-{user}"),
                           "user_id": user, "text": text});
        if let Some(meta) = group {
            m["chat_type"] = json!("group");
            m["chat_id"] = json!("the-group");
            m["meta"] = meta.clone();
        }
        self.send(&m);
        let (mut ack, mut end) = (None, None);
        while end.is_none() {
            let v = self.recv();
            if v["id"] != id {
                continue;
            }
            match v["op"].as_str() {
                Some("ack" | "reject") => ack = Some(v),
                Some("reply" | "failed" | "cancelled" | "merged") => end = Some(v),
                _ => {}
            }
        }
        (
            ack.expect("an ack before the outcome"),
            end.expect("outcome"),
        )
    }
}

fn code_in(reply: &Value) -> String {
    let text = reply["text"].as_str().expect("text");
    let at = text.find("code: ").expect("a code in the notice") + 6;
    text[at..at + 8].to_owned()
}

/// Rows 1 and 4: a stranger gets a one-time code and no agent run; a repeat within the
/// minute gets no second code; the admin's `!approve` lets the next message through.
#[test]
fn row1_a_stranger_is_paired_and_runs_only_once_the_admin_approves() {
    let dir = tempfile::tempdir().expect("dir");
    let config = "[access.matrix]\nadmins = [\"@alice:hs\"]\n";
    let (_serve, addr) = serve(dir.path(), config, &[]);
    let mut c = Client::connect(&addr, "matrix");
    let (ack, first) = c.ask("b1", "@bob:hs", "please run rm -rf /", None);
    assert_eq!(ack["op"], "ack");
    assert_eq!(first["op"], "reply");
    assert_eq!(first["notice"], "pairing", "{first}");
    let code = code_in(&first);
    let (_, again) = c.ask("b2", "@bob:hs", "hello?", None);
    assert_eq!(
        (again["notice"].as_str(), again["text"].as_str()),
        (Some("ignored"), Some(""))
    );
    assert_eq!(runs(dir.path()), 0, "no agent ran for a stranger");
    let (_, approved) = c.ask("a1", "@alice:hs", &format!("!approve {code}"), None);
    assert_eq!(approved["notice"], "admin");
    assert_eq!(approved["text"], "approved @bob:hs");
    let (_, now) = c.ask("b3", "@bob:hs", "hi", None);
    assert_eq!(now["text"], "agent: @bob:hs");
    assert!(now.get("notice").is_none(), "{now}");
    assert_eq!(runs(dir.path()), 1);
}

/// The CLI over the authenticated HTTP endpoint: `turnstile access list` shows a stranger's
/// pending code, `approve` lets their next message reach the agent (applied on the gateway's
/// loop), and a wrong token is refused with nothing changed.
#[test]
fn the_cli_approves_a_pending_code_over_the_http_endpoint() {
    let dir = tempfile::tempdir().expect("dir");
    let config = "[access.matrix]\nmode = \"pairing\"\n";
    let (_serve, addr, http) = serve_on(dir.path(), config, &["--auth-token", "k3y"], true);
    let hello = json!({"op": "hello", "platform": "matrix", "token": "k3y"});
    let mut c = Client::connect_with(&addr, &hello);
    let (_, first) = c.ask("b1", "@bob:hs", "hello", None);
    assert_eq!(first["notice"], "pairing", "{first}");
    let code = code_in(&first);
    let (status, listed) = access_cli(&http, "k3y", "matrix", &["list"]);
    assert_eq!(status, 0, "{listed}");
    assert!(listed.contains(&format!("{code} @bob:hs")), "{listed}");
    let (status, refused) = access_cli(&http, "wrong", "matrix", &["approve", &code]);
    assert_eq!(status, 3, "{refused}");
    assert!(refused.contains("unauthorized"), "{refused}");
    let (_, still) = c.ask("b2", "@bob:hs", "still there?", None);
    assert!(
        still.get("notice").is_some(),
        "a refused call let bob in: {still}"
    );
    assert_eq!(runs(dir.path()), 0);
    let (status, approved) = access_cli(&http, "k3y", "matrix", &["approve", &code]);
    assert_eq!((status, approved.trim()), (0, "approved @bob:hs"));
    let (_, now) = c.ask("b3", "@bob:hs", "hi", None);
    assert_eq!(now["text"], "agent: @bob:hs", "{now}");
    assert_eq!(runs(dir.path()), 1);
    let (status, users) = access_cli(&http, "k3y", "matrix", &["deny", "@bob:hs"]);
    assert_eq!((status, users.trim()), (0, "denied @bob:hs"));
    let (_, denied) = c.ask("b4", "@bob:hs", "again", None);
    assert_eq!(denied["notice"], "denied", "{denied}");
    assert_eq!(runs(dir.path()), 1);
}

/// Row 3: in a group, only messages the bridge marked as addressed to the bot reach it; the
/// rest are acked and answered with an empty `ignored` reply the bridges do not show.
#[test]
fn row3_in_a_mention_only_group_only_messages_to_the_bot_run() {
    let dir = tempfile::tempdir().expect("dir");
    let config = "[access.telegram]\nmode = \"open\"\n";
    let (_serve, addr) = serve(dir.path(), config, &[]);
    let mut c = Client::connect(&addr, "telegram");
    let (ack, chatter) = c.ask("g1", "7", "humans talking", Some(&json!({})));
    assert_eq!(ack["op"], "ack");
    assert_eq!(chatter["notice"], "ignored");
    assert_eq!(runs(dir.path()), 0);
    let (_, asked) = c.ask("g2", "7", "@bot hi", Some(&json!({"to_bot": true})));
    assert_eq!(asked["text"], "agent: 7");
    assert_eq!(runs(dir.path()), 1);
}

/// Row 2: a user past `rate` is told when to come back, no agent runs, and the count
/// survives a gateway restart with `--data-dir`.
#[test]
fn row2_a_rate_limit_is_answered_and_survives_a_restart() {
    let dir = tempfile::tempdir().expect("dir");
    let data = dir.path().join("data");
    let config = "[access.matrix]\nmode = \"open\"\nrate = \"2/hour\"\n";
    let data_arg = ["--data-dir", data.to_str().expect("utf-8")];
    let (serve1, addr) = serve(dir.path(), config, &data_arg);
    let mut c = Client::connect(&addr, "matrix");
    for id in ["r1", "r2"] {
        assert_eq!(c.ask(id, "@u:hs", "x", None).1["text"], "agent: @u:hs");
    }
    let (_, limited) = c.ask("r3", "@u:hs", "x", None);
    assert_eq!(limited["notice"], "rate_limited", "{limited}");
    assert!(
        limited["text"]
            .as_str()
            .expect("text")
            .contains("Try again in")
    );
    assert_eq!(runs(dir.path()), 2);
    // The counters are saved off the reactor, at most once a second: wait for the file to
    // hold the empty bucket (a bounded poll of a file, not a sleep ordering events).
    let state = data.join("access.json");
    eventually("access.json holds the emptied bucket", WAIT, || {
        std::fs::read_to_string(&state).is_ok_and(|s| s.contains("\"@u:hs\":{\"tokens\":0"))
    });
    drop(c);
    // Killed (SIGKILL, reaped): what was saved is all the next start has.
    drop(serve1);
    let (_serve2, addr) = serve(dir.path(), config, &data_arg);
    let mut c = Client::connect(&addr, "matrix");
    let (_, still) = c.ask("r4", "@u:hs", "x", None);
    // Still limited: `rate_limited`, or `ignored` while the last notice is under a minute
    // old (that survived the restart too); never the agent.
    let notice = still["notice"]
        .as_str()
        .unwrap_or("none (the restart forgot the count)");
    assert!(["rate_limited", "ignored"].contains(&notice), "{still}");
    assert_eq!(runs(dir.path()), 2);
}

/// `--check-config` refuses a bad table with exit 2, naming the key.
#[test]
fn check_config_names_the_bad_key_and_exits_2() {
    let dir = tempfile::tempdir().expect("dir");
    for (table, key) in [
        ("[access.matrix]\nrate = \"0/min\"\n", "access.matrix.rate"),
        ("[access.irc]\nmode = \"closed\"\n", "access.irc.mode"),
        ("[access.matrix]\nallow = [\"*\"]\n", "access.matrix.allow"),
    ] {
        let path = dir.path().join("bad.toml");
        std::fs::write(&path, table).expect("write");
        let out = Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args([
                "serve",
                "--check-config",
                "--http-listen",
                "off",
                "--config",
            ])
            .arg(&path)
            .output()
            .expect("run");
        assert_eq!(out.status.code(), Some(2), "{table}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(key), "{key} not named: {err}");
    }
}

/// The `may_use` op (a bridge asks before acting for a user outside a message, as the
/// Matrix bridge does before it accepts an invite): answered in line order, for the
/// connection's platform or the one the query names, with the policy's word; a thousand
/// questions about a stranger mint no code and spend no notice.
#[test]
fn may_use_is_answered_in_order_for_any_platform_and_changes_nothing() {
    let dir = tempfile::tempdir().expect("dir");
    let config = "[access.matrix]\nadmins = [\"@alice:hs\"]\nallow-chats = [\"!open:hs\"]\n";
    let (_serve, addr) = serve(dir.path(), config, &[]);
    let mut c = Client::connect(&addr, "matrix");
    let queries = [
        (json!({"user_id": "@alice:hs"}), true),
        (json!({"user_id": "@bob:hs"}), false),
        (json!({"user_id": "@bob:hs", "chat_id": "!open:hs"}), true),
        (json!({"user_id": "@bob:hs", "platform": "cli"}), true),
        (json!({"user_id": "7", "platform": "telegram"}), false),
    ];
    for (i, (q, _)) in queries.iter().enumerate() {
        let mut q = q.clone();
        q["op"] = json!("may_use");
        q["id"] = json!(format!("q{i}"));
        c.send(&q);
    }
    for (i, (q, allowed)) in queries.iter().enumerate() {
        let a = c.recv();
        assert_eq!(a["op"], "may_use", "{a}");
        assert_eq!(a["id"], format!("q{i}"), "in line order: {a}");
        assert_eq!(a["allowed"], *allowed, "{q}: {a}");
    }
    for i in 0..1000 {
        c.send(&json!({"op": "may_use", "id": format!("f{i}"), "user_id": "@bob:hs"}));
    }
    for i in 0..1000 {
        assert_eq!(c.recv()["id"], format!("f{i}"));
    }
    let (_, first) = c.ask("b1", "@bob:hs", "hello", None);
    assert_eq!(
        first["notice"], "pairing",
        "asking spent the notice: {first}"
    );
    assert_eq!(runs(dir.path()), 0);
}

/// Row 2's budget with the OpenAI agent against the fake server: a turn reporting 1,100
/// tokens spends a 1,000-token day; the next message is answered `budget` (with the reset
/// time) and no request reaches the fake; the count survives a kill -9 with `--data-dir`;
/// the admin is exempt, and `!usage` shows the count.
#[test]
fn row2_a_spent_budget_is_answered_without_a_request_and_survives_a_restart() {
    use mock_openai::{Mock, stream};
    let dir = tempfile::tempdir().expect("dir");
    let data = dir.path().join("data");
    let mock = Mock::start(vec![stream(&["the ", "answer"], 600, 500)]);
    let url = mock.base_url();
    let agent = [
        "--agent",
        "openai",
        "--model",
        "m",
        "--openai-base-url",
        &url,
    ];
    let data_arg = ["--data-dir", data.to_str().expect("utf-8")];
    let config =
        "[access.matrix]\nmode = \"open\"\nadmins = [\"@alice:hs\"]\ntokens-per-day = 1000\n";
    let (serve1, addr, _) = serve_agent(dir.path(), config, &agent, &data_arg, false);
    let mut c = Client::connect(&addr, "matrix");
    assert_eq!(c.ask("t1", "@u:hs", "hi", None).1["text"], "the answer");
    mock.next_request();
    let (_, spent) = c.ask("t2", "@u:hs", "more", None);
    assert_eq!(spent["notice"], "budget", "{spent}");
    let text = spent["text"].as_str().expect("text");
    assert!(text.contains("resets at 00:00 UTC, in "), "{text}");
    // A request would have come before the outcome: none came.
    assert!(
        mock.requests.try_recv().is_err(),
        "a request reached the model"
    );
    let (_, usage) = c.ask("a1", "@alice:hs", "!usage @u:hs", None);
    assert!(
        usage["text"]
            .as_str()
            .expect("text")
            .contains("@u:hs: 1100 tokens today"),
        "{usage}"
    );
    // The admin is exempt: two turns of 10,000 tokens each both run.
    for id in ["a2", "a3"] {
        mock.push([stream(&["for alice"], 5000, 5000)]);
        assert_eq!(c.ask(id, "@alice:hs", "hi", None).1["text"], "for alice");
        mock.next_request();
    }
    // Counters are saved off the reactor, at most once a second: wait for the file to hold
    // the count (a bounded poll of a file, not a sleep ordering events).
    let state = data.join("access.json");
    eventually("access.json holds the count", WAIT, || {
        std::fs::read_to_string(&state).is_ok_and(|s| s.contains("\"used\":1100"))
    });
    drop(c);
    drop(serve1);
    let (_serve2, addr, _) = serve_agent(dir.path(), config, &agent, &data_arg, false);
    let mut c = Client::connect(&addr, "matrix");
    let (_, still) = c.ask("t3", "@u:hs", "and now?", None);
    // `budget`, or `ignored` while the last notice is under a minute old (that survived the
    // restart too); never the model.
    let notice = still["notice"]
        .as_str()
        .unwrap_or("none (the restart forgot the count)");
    assert!(["budget", "ignored"].contains(&notice), "{still}");
    assert!(
        mock.requests.try_recv().is_err(),
        "a request reached the model"
    );
}
