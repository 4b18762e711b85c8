//! `turnstile serve` with `[[bridge]]` tables, the children seen from outside: each child's
//! environment holds its own platform's secret and no other's, and a child flooding its
//! stderr cannot flood serve's log. The children are a small script standing in for
//! `turnstile bridge` (`TURNSTILE_TEST_BRIDGE_EXE`, a `test-hooks` hook): it prints the NAMES
//! of its environment variables, never their values.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::eventually;
use crossbeam_channel::Receiver;

const WAIT: Duration = Duration::from_secs(30);
const MATRIX_SECRET: &str = "matrix-secret-4d1f";
const TELEGRAM_SECRET: &str = "123:telegram-secret-9a2b";
const NICKSERV_SECRET: &str = "nickserv-secret-77c3";
const OTHER_SECRET: &str = "other-secret-0e5d";
const GATEWAY_TOKEN: &str = "gateway-token-51aa";

/// Stands in for `turnstile bridge <platform> …`: its argv is `--log-format F bridge
/// <platform> …`. `names` prints each variable's name; `flood N` prints N lines. Then it
/// closes its stderr (so serve sees its end) and waits to be stopped.
const PROBE: &str = r#"#!/usr/bin/env python3
import os, signal, sys
platform = sys.argv[4]
mode = open(os.path.join(os.path.dirname(__file__), "mode")).read().split()
if mode[0] == "link":
    # Says hello, reports its platform connection down, logs an ERROR holding its secret;
    # each write to the FIFO `go` moves it on: link up, then exit 3.
    import json, socket
    host, port = sys.argv[sys.argv.index("--gateway") + 1].rsplit(":", 1)
    conn = socket.create_connection((host, int(port)))
    f = conn.makefile("rw")
    def send(o):
        f.write(json.dumps(o) + "\n"); f.flush()
    send({"op": "hello", "platform": platform, "token": os.environ["TURNSTILE_AUTH_TOKEN"]})
    send({"op": "ping"})
    f.readline()
    send({"op": "link", "state": "down", "detail": "homeserver unreachable: connection refused"})
    sys.stderr.write("[2026-01-01T00:00:00Z ERROR turnstile] sync failed for %s\n" % os.environ["MATRIX_ACCESS_TOKEN"])
    sys.stderr.flush()
    go = os.path.join(os.path.dirname(__file__), "go")
    open(go).read()
    send({"op": "link", "state": "up"})
    open(go).read()
    sys.exit(3)
elif mode[0] == "names":
    for name in sorted(os.environ):
        sys.stderr.write("probe %s: %s\n" % (platform, name))
    sys.stderr.write("probe %s: done\n" % platform)
else:
    sys.stderr.write("flood line from the bridge\n" * int(mode[1]))
sys.stderr.flush()
os.close(2)
signal.pause()
"#;

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `serve` with `config`, the probe as its bridges' program; its stderr, line by line.
fn serve(dir: &Path, config: &str, mode: &str, env: &[(&str, &str)]) -> (Proc, Receiver<String>) {
    let (proc, log, _) = serve_with(dir, config, mode, env, false);
    (proc, log)
}

/// [`serve`], with the HTTP endpoint on a free port when `http` (its address returned).
fn serve_with(
    dir: &Path,
    config: &str,
    mode: &str,
    env: &[(&str, &str)],
    http: bool,
) -> (Proc, Receiver<String>, Option<String>) {
    let probe = dir.join("probe.py");
    std::fs::write(&probe, PROBE).expect("probe");
    std::fs::set_permissions(&probe, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::write(dir.join("mode"), mode).expect("mode");
    let path = dir.join("turnstile.toml");
    std::fs::write(&path, config).expect("config");
    let mut command = Command::new(env!("CARGO_BIN_EXE_turnstile"));
    command
        .args(["serve", "--listen", "127.0.0.1:0", "--http-listen"])
        .arg(if http { "127.0.0.1:0" } else { "off" })
        .args(["--access-default", "open"])
        .arg("--config")
        .arg(&path)
        .env("RUST_LOG", "info")
        .env("TURNSTILE_TEST_BRIDGE_EXE", &probe)
        .env("TURNSTILE_AUTH_TOKEN", GATEWAY_TOKEN)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(if http { Stdio::piped() } else { Stdio::null() })
        .stderr(Stdio::piped());
    // SAFETY: prctl(2) only, which is async-signal-safe, between fork and exec.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = command.spawn().expect("start serve");
    let http_addr = child.stdout.take().map(|out| {
        let mut lines = BufReader::new(out).lines();
        let mut addr = None;
        for line in lines.by_ref().take(2) {
            let line = line.expect("a stdout line");
            addr = addr.or(line.strip_prefix("http on ").map(str::to_owned));
        }
        addr.expect("an `http on` line")
    });
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = crossbeam_channel::unbounded();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    (Proc(child), rx, http_addr)
}

fn line(log: &Receiver<String>) -> String {
    let line = log.recv_timeout(WAIT).expect("a log line in time");
    for secret in [
        MATRIX_SECRET,
        TELEGRAM_SECRET,
        NICKSERV_SECRET,
        OTHER_SECRET,
        GATEWAY_TOKEN,
    ] {
        assert!(!line.contains(secret), "a secret in serve's log: {line}");
    }
    line
}

/// Each child's environment: its platform's secret (and those its flags name), the gateway's
/// token and the ordinary process variables; never another platform's secret or anything
/// else of serve's.
#[test]
fn each_bridge_child_holds_only_its_own_secret() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = "[[bridge]]\nplatform = \"irc\"\nargs = [\"--server\", \"127.0.0.1:1\", \"--nick\", \"bot\", \"--nickserv-password-env\", \"NICKSERV_PASS\"]\n\n\
        [[bridge]]\nplatform = \"matrix\"\nargs = [\"--homeserver\", \"http://127.0.0.1:1\"]\n\n\
        [[bridge]]\nplatform = \"telegram\"\nargs = [\"--api-base\", \"http://127.0.0.1:1\", \"--bot-token-env\", \"MY_BOT_TOKEN\"]\n";
    let (_serve, log) = serve(
        dir.path(),
        config,
        "names",
        &[
            ("MATRIX_ACCESS_TOKEN", MATRIX_SECRET),
            ("TELEGRAM_BOT_TOKEN", TELEGRAM_SECRET),
            ("MY_BOT_TOKEN", TELEGRAM_SECRET),
            ("NICKSERV_PASS", NICKSERV_SECRET),
            ("SOME_OTHER_SECRET", OTHER_SECRET),
            ("LC_TIME", "C"),
            ("TZ", "UTC"),
        ],
    );
    let mut names: HashMap<String, BTreeSet<String>> = HashMap::new();
    let mut done = BTreeSet::new();
    while done.len() < 3 {
        let line = line(&log);
        let Some(rest) = line.strip_prefix("probe ") else {
            continue;
        };
        let (platform, name) = rest.split_once(": ").expect("probe line");
        if name == "done" {
            done.insert(platform.to_owned());
        } else {
            names
                .entry(platform.to_owned())
                .or_default()
                .insert(name.to_owned());
        }
    }
    let own = [
        ("irc", "NICKSERV_PASS"),
        ("matrix", "MATRIX_ACCESS_TOKEN"),
        ("telegram", "MY_BOT_TOKEN"),
    ];
    for (platform, secret) in own {
        let env = &names[platform];
        for kept in [
            secret,
            "TURNSTILE_AUTH_TOKEN",
            "PATH",
            "RUST_LOG",
            "LC_TIME",
            "TZ",
        ] {
            assert!(
                env.contains(kept),
                "{platform}: {kept} missing from {env:?}"
            );
        }
        let others = ["NICKSERV_PASS", "MATRIX_ACCESS_TOKEN", "MY_BOT_TOKEN"]
            .into_iter()
            .filter(|v| *v != secret)
            .chain([
                "TELEGRAM_BOT_TOKEN",
                "SOME_OTHER_SECRET",
                "TURNSTILE_TEST_BRIDGE_EXE",
            ]);
        for other in others {
            assert!(!env.contains(other), "{platform}: holds {other}: {env:?}");
        }
        assert!(
            !env.iter().any(|n| n.starts_with("CARGO")),
            "{platform}: serve's whole environment: {env:?}"
        );
    }
}

/// A child printing 100,000 lines on its stderr: serve's log gets the budget's burst and
/// rate of them, and counts the rest "(N more suppressed)" — every line accounted for.
#[test]
fn a_bridge_childs_stderr_flood_is_bounded_in_serves_log() {
    const FLOOD: u64 = 100_000;
    let dir = tempfile::tempdir().expect("tempdir");
    let config = "[[bridge]]\nplatform = \"irc\"\nargs = [\"--server\", \"127.0.0.1:1\", \"--nick\", \"bot\"]\n";
    let started = Instant::now();
    let (_serve, log) = serve(dir.path(), config, &format!("flood {FLOOD}"), &[]);
    let (mut logged, mut suppressed, mut total) = (0u64, 0u64, 0u64);
    while logged + suppressed < FLOOD {
        let line = line(&log);
        total += 1;
        if line == "flood line from the bridge" {
            logged += 1;
        } else if let Some(rest) = line.split("its stderr is rate-limited (").nth(1) {
            let n = rest.split(' ').next().expect("count");
            suppressed += n.parse::<u64>().expect("a count");
        }
        // The burst (100) and 10 lines a second after it, with room to spare.
        let bound = 200 + 20 * started.elapsed().as_secs();
        assert!(logged <= bound, "{logged} flood lines in serve's log");
    }
    assert_eq!(logged + suppressed, FLOOD);
    assert!(suppressed > 0);
    assert!(total < 1_000, "{total} lines in serve's log");
}

/// `serve --check-config --config <tables>` with `env` (and none of the bridges' secret
/// variables but those): its exit code and stderr, checked to hold no secret.
fn check_config(dir: &Path, tables: &str, env: &[(&str, &str)]) -> (i32, String) {
    let path = dir.join("check.toml");
    std::fs::write(&path, tables).expect("config");
    let out = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args([
            "serve",
            "--check-config",
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "off",
        ])
        .arg("--config")
        .arg(&path)
        .env_remove("MATRIX_ACCESS_TOKEN")
        .env_remove("TELEGRAM_BOT_TOKEN")
        .env_remove("NICKSERV_PASS")
        .envs(env.iter().copied())
        .output()
        .expect("run serve --check-config");
    let text =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    for secret in [MATRIX_SECRET, TELEGRAM_SECRET, NICKSERV_SECRET] {
        assert!(!text.contains(secret), "a secret in the output: {text}");
    }
    (out.status.code().expect("an exit code"), text)
}

/// `--check-config` checks each `[[bridge]]` table for what serve will need: its secret
/// variables set (named in the error, never shown), its flags as the bridge parses them, its
/// state directory writable; a failure exits 2 naming the table (index and platform).
#[test]
fn check_config_checks_what_each_bridge_will_need() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path().display();
    let telegram = format!(
        "[[bridge]]\nplatform = \"telegram\"\nargs = [\"--state-dir\", \"{d}/telegram/new\"]\n\n"
    );
    let matrix = format!(
        "[[bridge]]\nplatform = \"matrix\"\nargs = [\"--homeserver\", \"https://m.example\", \"--state-dir\", \"{d}/matrix\"]\n\n"
    );
    let irc = "[[bridge]]\nplatform = \"irc\"\nargs = [\"--server\", \"127.0.0.1:6667\", \"--nick\", \"bot\", \"--nickserv-password-env\", \"NICKSERV_PASS\"]\n\n";
    let all = format!("{telegram}{matrix}{irc}");
    let secrets = [
        ("TELEGRAM_BOT_TOKEN", TELEGRAM_SECRET),
        ("MATRIX_ACCESS_TOKEN", MATRIX_SECRET),
        ("NICKSERV_PASS", NICKSERV_SECRET),
    ];
    let (code, text) = check_config(dir.path(), &all, &secrets);
    assert_eq!((code, text.trim()), (0, "configuration ok"));

    // The matrix table's token unset.
    let (code, text) = check_config(dir.path(), &all, &[secrets[0], secrets[2]]);
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("[[bridge]] #2 (matrix)"), "{text}");
    assert!(
        text.contains("MATRIX_ACCESS_TOKEN (--access-token-env)"),
        "{text}"
    );
    // The IRC table's NickServ password empty.
    let (code, text) = check_config(
        dir.path(),
        &all,
        &[secrets[0], secrets[1], ("NICKSERV_PASS", "")],
    );
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("[[bridge]] #3 (irc)"), "{text}");
    assert!(
        text.contains("NICKSERV_PASS (--nickserv-password-env)"),
        "{text}"
    );
    // The telegram table's token, under the name its flag gives.
    let renamed =
        "[[bridge]]\nplatform = \"telegram\"\nargs = [\"--bot-token-env\", \"MY_BOT_TOKEN\"]\n";
    let (code, text) = check_config(dir.path(), renamed, &secrets);
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("[[bridge]] #1 (telegram)"), "{text}");
    assert!(text.contains("MY_BOT_TOKEN"), "{text}");

    // Flags the bridge would refuse: SASL without its password's variable.
    let sasl = "[[bridge]]\nplatform = \"irc\"\nargs = [\"--server\", \"s:6667\", \"--nick\", \"b\", \"--sasl-account\", \"a\"]\n";
    let (code, text) = check_config(dir.path(), sasl, &secrets);
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("[[bridge]] #1 (irc)"), "{text}");
    assert!(text.contains("--sasl-password-env"), "{text}");

    // A state directory that cannot be made: a file stands where it would be.
    std::fs::write(dir.path().join("matrix"), "a file").expect("file");
    let (code, text) = check_config(dir.path(), &all, &secrets);
    assert_eq!(code, 2, "{text}");
    assert!(
        text.contains("[[bridge]] #2 (matrix): --state-dir"),
        "{text}"
    );
    assert!(text.contains("not a directory"), "{text}");
    std::fs::remove_file(dir.path().join("matrix")).expect("rm");
    let (code, text) = check_config(dir.path(), &all, &secrets);
    assert_eq!((code, text.trim()), (0, "configuration ok"));
    // Nothing was created by the check.
    assert!(!dir.path().join("telegram/new").exists());
    assert!(!dir.path().join("matrix").exists());
}

/// `GET path` from the HTTP endpoint at `addr` (with the gateway's token): the body.
fn http_get(addr: &str, path: &str) -> String {
    common::http::get(addr, path, Some(GATEWAY_TOKEN)).body
}

/// Polls `/status` (bounded) until the first supervised bridge's entry satisfies `pred`.
fn wait_bridge(
    http: &str,
    what: &str,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    eventually(what, WAIT, || {
        let status: serde_json::Value =
            serde_json::from_str(&http_get(http, "/status")).expect("status json");
        let entry = status["frontend"]["bridges"][0].clone();
        if pred(&entry) { Ok(entry) } else { Err(entry) }
    })
}

/// Lets the probe go on (it waits on the FIFO `go`), bounded.
fn go(dir: &Path) {
    let fifo = dir.join("go");
    let (tx, rx) = crossbeam_channel::bounded(1);
    std::thread::spawn(move || {
        let r = std::fs::OpenOptions::new()
            .write(true)
            .open(&fifo)
            .and_then(|mut f| std::io::Write::write_all(&mut f, b"go"));
        let _ = tx.send(r);
    });
    rx.recv_timeout(WAIT)
        .expect("the probe opened the FIFO")
        .expect("write");
}

/// Issue 33 row 5: a supervised bridge in `/status`, `/metrics` and `turnstile status`:
/// `reconnecting` with the reason it reported over the protocol (`link` down) and its last
/// ERROR line with its secret redacted, `ready` once it reports the link up, and after its
/// exit a restart counted with how it exited.
#[test]
fn a_supervised_bridge_is_seen_in_the_status_and_the_metrics() {
    let dir = tempfile::tempdir().expect("tempdir");
    let made = Command::new("mkfifo")
        .arg(dir.path().join("go"))
        .status()
        .expect("mkfifo");
    assert!(made.success());
    let config =
        "[[bridge]]\nplatform = \"matrix\"\nargs = [\"--homeserver\", \"http://127.0.0.1:1\"]\n";
    let env = [("MATRIX_ACCESS_TOKEN", MATRIX_SECRET)];
    let (_serve, _log, http) = serve_with(dir.path(), config, "link", &env, true);
    let http = http.expect("http");
    let down = wait_bridge(&http, "reconnecting with its last error", |b| {
        b["state"] == "reconnecting" && b["last_error"].is_string()
    });
    assert_eq!(down["platform"], "matrix");
    assert_eq!(down["reason"], "homeserver unreachable: connection refused");
    assert_eq!(down["restarts"], 0);
    let last_error = down["last_error"].as_str().expect("last_error");
    assert!(
        last_error.contains("sync failed for <redacted>"),
        "{last_error}"
    );
    assert!(!last_error.contains(MATRIX_SECRET), "{last_error}");
    let metrics = http_get(&http, "/metrics");
    assert!(
        metrics.contains("turnstile_bridge_up{platform=\"matrix\",table=\"1\"} 0"),
        "{metrics}"
    );
    assert!(metrics.contains(
        "turnstile_bridge_state{platform=\"matrix\",table=\"1\",state=\"reconnecting\"} 1"
    ));
    // Every supervised series the dashboard and the alerts name is in the scrape.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("contrib");
    for file in ["alerts.yml", "grafana-dashboard.json"] {
        let text = std::fs::read_to_string(root.join(file)).expect("contrib file");
        for name in ["turnstile_bridge_up", "turnstile_bridge_restarts_total"] {
            assert!(text.contains(name), "{file} does not name {name}");
            assert!(
                metrics.contains(&format!("\n{name}{{")),
                "{name} not scraped"
            );
        }
    }
    let summary = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args(["status", "--http", &http, "--token", GATEWAY_TOKEN])
        .output()
        .expect("turnstile status");
    let text = String::from_utf8_lossy(&summary.stdout);
    assert!(
        text.contains("bridge #1 (matrix): reconnecting since ")
            && text.contains("(homeserver unreachable: connection refused); 0 restarts"),
        "{text}"
    );
    assert!(!text.contains(MATRIX_SECRET));
    go(dir.path());
    let up = wait_bridge(&http, "ready", |b| b["state"] == "ready");
    assert!(up["reason"].is_null(), "{up}");
    assert!(
        http_get(&http, "/metrics")
            .contains("turnstile_bridge_up{platform=\"matrix\",table=\"1\"} 1")
    );
    go(dir.path());
    let restarted = wait_bridge(&http, "restarted", |b| b["restarts"] == 1);
    assert_eq!(restarted["last_exit"], "exit status: 3");
    assert!(
        http_get(&http, "/metrics")
            .contains("turnstile_bridge_restarts_total{platform=\"matrix\",table=\"1\"} 1")
    );
}
