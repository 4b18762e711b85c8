//! Issue 35 row 1: the openai agent's conversation lasts as long as the journal does. Real
//! processes: `turnstile serve --agent openai --data-dir D` against the scripted OpenAI
//! server, killed with SIGKILL and started again on the same directory.

mod common;
mod mock_openai;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::gateway::{Gateway, find, wait_status};
use mock_openai::{Mock, stream};

const BIN: &str = env!("CARGO_BIN_EXE_turnstile");
/// The session `turnstile send` talks in by default (platform `cli`, chat `local`).
const SESSION: &str = "cli:dm:local";

/// A gateway on `dir` (its journal and status file) with the openai agent on `mock`.
fn start(mock: &Mock, dir: &Path) -> Gateway {
    Gateway::spawn(
        Command::new(BIN)
            .args(["serve", "--listen", "127.0.0.1:0", "--http-listen", "off"])
            .args(mock.agent_args())
            .arg("--data-dir")
            .arg(dir),
        &dir.join("status.json"),
    )
}

fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
    v.iter()
        .map(|(r, c)| ((*r).to_owned(), (*c).to_owned()))
        .collect()
}

/// `turnstile history export` of `SESSION`, one JSON value a line.
fn export(dir: &Path) -> Vec<serde_json::Value> {
    let out = Command::new(BIN)
        .args(["history", "export", "--session", SESSION, "--data-dir"])
        .arg(dir)
        .output()
        .expect("run turnstile history export");
    assert!(out.status.success(), "export: {out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

#[test]
fn row1_the_conversation_survives_a_kill_9_and_the_restart_continues_it() {
    let mock = Mock::start(vec![stream(&["Hello ", "Ann"], 5, 2)]);
    let dir = tempfile::tempdir().expect("dir");
    let gateway = start(&mock, dir.path());
    assert_eq!(gateway.send("my name is Ann"), "Hello Ann");
    assert_eq!(
        mock.next_request().messages(),
        pairs(&[("user", "my name is Ann")])
    );
    // The reply was sent only once its outcome was durable, and the conversation with it.
    gateway.kill_9();
    let lines = export(dir.path());
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["session"], SESSION);
    assert_eq!(lines[0]["user"], "my name is Ann");
    assert_eq!(lines[0]["assistant"], "Hello Ann");

    mock.push([stream(&["You are Ann"], 9, 3)]);
    let gateway = start(&mock, dir.path());
    assert_eq!(gateway.send("what is my name?"), "You are Ann");
    assert_eq!(
        mock.next_request().messages(),
        pairs(&[
            ("user", "my name is Ann"),
            ("assistant", "Hello Ann"),
            ("user", "what is my name?"),
        ]),
        "the first request after the restart carries the earlier exchange"
    );
    // The status shows the stored conversation (the heartbeat rewrites the file; polled
    // with a generous deadline, never a fixed wait).
    let history = wait_status(
        &dir.path().join("status.json"),
        "journal.history in the status, one session",
        Duration::from_secs(30),
        |s| find(s, "history").filter(|h| h["sessions"] == 1).cloned(),
    );
    assert!(
        history["bytes"].as_u64().is_some_and(|b| b > 0),
        "{history}"
    );
    assert_eq!(history["evicted"], 0);
    gateway.kill_9();
    assert_eq!(export(dir.path()).len(), 2);
}

#[test]
fn new_clears_the_conversation_durably() {
    let mock = Mock::start(vec![stream(&["noted: 7"], 5, 2)]);
    let dir = tempfile::tempdir().expect("dir");
    let gateway = start(&mock, dir.path());
    assert_eq!(gateway.send("remember 7"), "noted: 7");
    mock.next_request();
    let reset = gateway.send("/new");
    assert!(reset.starts_with("reset"), "{reset}");
    gateway.kill_9();
    assert_eq!(export(dir.path()), Vec::<serde_json::Value>::new());

    mock.push([stream(&["which number?"], 5, 2)]);
    let gateway = start(&mock, dir.path());
    assert_eq!(
        gateway.send("what did I ask you to remember?"),
        "which number?"
    );
    assert_eq!(
        mock.next_request().messages(),
        pairs(&[("user", "what did I ask you to remember?")]),
        "nothing from before /new"
    );
}
