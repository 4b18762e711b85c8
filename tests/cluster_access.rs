//! Issue 32 with `--cluster`: the access policy's state is shared through Redis. Two real
//! `turnstile serve --cluster` processes on one private redis-server (tests/redis_support):
//! a pairing code minted on A is approved with `turnstile access approve` against B and lets
//! the user in on A; a user's `rate` spent on A still limits them on B after both were
//! killed and B started alone.
//!
//! The state travels once a second, off the loop: waits on it poll the instance (or Redis)
//! with a deadline; nothing sleeps to order events.

mod child_support;
mod common;
mod redis_support;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};

use child_support::{Proc, die_with_parent};
use common::{eventually, holds};
use redis_support::{Redis, WAIT, require_redis, until_all_held_by};
use serde_json::{Value, json};

const PARTITIONS: u32 = 2;
const TOKEN: &str = "k3y";

/// A `serve --cluster` instance on `redis` with `config`, its agent a shell command that
/// appends a line to `dir/runs` per turn; its bridge address and HTTP address.
fn serve(
    dir: &std::path::Path,
    redis: &Redis,
    instance: &str,
    config: &str,
) -> (Proc, String, String) {
    let path = dir.join(format!("{instance}.toml"));
    std::fs::write(&path, config).expect("config");
    let agent = format!(
        "echo run >> {}; echo \"agent: $TURNSTILE_USER_ID\"",
        dir.join("runs").display()
    );
    let mut child = die_with_parent(
        Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--http-listen",
                "127.0.0.1:0",
            ])
            .args(["--agent", "exec", "--agent-cmd", &agent])
            .args(["--cluster", &redis.url(), "--instance-id", instance])
            .args(["--partitions", &PARTITIONS.to_string()])
            .args(["--lease-ms", "1000", "--cluster-rebalance", "false"])
            .arg("--config")
            .arg(&path)
            .env("RUST_LOG", "warn")
            .env("TURNSTILE_AUTH_TOKEN", TOKEN)
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
    let http = line("http on ");
    (Proc(child), addr, http)
}

/// `turnstile access --http ADDR --platform matrix ARGS…`: exit code, stdout and stderr.
fn access_cli(http: &str, args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args([
            "access",
            "--http",
            http,
            "--token",
            TOKEN,
            "--platform",
            "matrix",
        ])
        .args(args)
        .env_remove("TURNSTILE_AUTH_TOKEN")
        .output()
        .expect("run turnstile access");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

/// Asks `turnstile access list` of `http` until its answer contains `needle` (bounded).
fn until_listed(http: &str, needle: &str) {
    eventually(&format!("{needle:?} listed"), WAIT, || {
        let (status, listed) = access_cli(http, &["list"]);
        assert_eq!(status, 0, "{listed}");
        holds(listed, |l| l.contains(needle))
    });
}

fn runs(dir: &std::path::Path) -> usize {
    std::fs::read_to_string(dir.join("runs")).map_or(0, |s| s.lines().count())
}

struct Client {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Client {
    fn connect(addr: &str) -> Client {
        let stream = TcpStream::connect(addr).expect("connect");
        stream.set_read_timeout(Some(WAIT)).expect("timeout");
        let mut c = Client {
            reader: BufReader::new(stream.try_clone().expect("clone")),
            writer: stream,
        };
        c.send(&json!({"op": "hello", "platform": "matrix", "token": TOKEN}));
        c
    }

    fn send(&mut self, v: &Value) {
        writeln!(self.writer, "{v}").expect("write");
    }

    /// Sends a message from `user` and returns its terminal event.
    fn ask(&mut self, id: &str, user: &str, text: &str) -> Value {
        self.send(
            &json!({"op": "message", "id": id, "chat_id": format!("chat-{user}"),
                          "user_id": user, "text": text}),
        );
        loop {
            let mut line = String::new();
            let n = self.reader.read_line(&mut line).expect("a line in time");
            assert!(n > 0, "connection closed");
            let v: Value = serde_json::from_str(&line).expect("json");
            let terminal = matches!(
                v["op"].as_str(),
                Some("reply" | "failed" | "cancelled" | "merged")
            );
            if v["id"] == id && terminal {
                return v;
            }
        }
    }
}

fn code_in(reply: &Value) -> String {
    let text = reply["text"].as_str().expect("text");
    let at = text.find("code: ").expect("a code in the notice") + 6;
    text[at..at + 8].to_owned()
}

#[test]
fn a_code_minted_on_a_and_approved_on_b_lets_the_user_in_on_a() {
    let Some(bin) = require_redis() else { return };
    let redis = Redis::start(&bin);
    let dir = tempfile::tempdir().expect("dir");
    let config = "[access.matrix]\nmode = \"pairing\"\n";
    let (_a, a_addr, a_http) = serve(dir.path(), &redis, "a", config);
    until_all_held_by(&redis, PARTITIONS, &["a"]);
    let (_b, _, b_http) = serve(dir.path(), &redis, "b", config);
    let mut c = Client::connect(&a_addr);
    let first = c.ask("b1", "@bob:hs", "hello");
    assert_eq!(first["notice"], "pairing", "{first}");
    let code = code_in(&first);
    // B learns A's code from Redis within a period.
    until_listed(&b_http, &format!("{code} @bob:hs"));
    let (status, approved) = access_cli(&b_http, &["approve", &code]);
    assert_eq!((status, approved.trim()), (0, "approved @bob:hs"));
    // A learns B's approval within a period.
    until_listed(&a_http, "allowed @bob:hs");
    assert_eq!(runs(dir.path()), 0, "no agent ran for a stranger");
    let now = c.ask("b2", "@bob:hs", "hi");
    assert_eq!(now["text"], "agent: @bob:hs", "{now}");
    assert_eq!(runs(dir.path()), 1);
}

#[test]
fn a_rate_spent_on_a_limits_on_b_after_both_restart() {
    let Some(bin) = require_redis() else { return };
    let redis = Redis::start(&bin);
    let dir = tempfile::tempdir().expect("dir");
    let config = "[access.matrix]\nmode = \"open\"\nrate = \"2/min\"\n";
    let (a, a_addr, _) = serve(dir.path(), &redis, "a", config);
    until_all_held_by(&redis, PARTITIONS, &["a"]);
    let (b, _, _) = serve(dir.path(), &redis, "b", config);
    let mut c = Client::connect(&a_addr);
    for id in ["r1", "r2"] {
        assert_eq!(c.ask(id, "@u:hs", "x")["text"], "agent: @u:hs");
    }
    assert_eq!(c.ask("r3", "@u:hs", "x")["notice"], "rate_limited");
    // The spend reaches Redis within a period: wait for the emptied bucket there.
    let mut rc = redis.client();
    eventually("the spend reached Redis", WAIT, || {
        let bucket: Option<String> = redis::cmd("HGET")
            .arg("ts:{access}:rate:matrix")
            .arg("@u:hs")
            .query(&mut rc)
            .expect("HGET");
        let tokens = bucket.and_then(|b| b.split(' ').next()?.parse::<f64>().ok());
        holds(tokens, |t| t.is_some_and(|t| t < 1.0))
    });
    drop(c);
    // Both killed (SIGKILL, reaped); B alone, freshly started, decides every message now.
    drop((a, b));
    let (_b, b_addr, _) = serve(dir.path(), &redis, "b", config);
    until_all_held_by(&redis, PARTITIONS, &["b"]);
    let mut c = Client::connect(&b_addr);
    let still = c.ask("r4", "@u:hs", "x");
    let notice = still["notice"]
        .as_str()
        .unwrap_or("none (B forgot A's spend)");
    assert_eq!(notice, "rate_limited", "{still}");
    assert_eq!(runs(dir.path()), 2);
}
