//! `turnstile history export --http` while a single-node gateway runs: the running gateway
//! holds its journal locked, so the conversation is read by the gateway itself, on its HTTP
//! endpoint's thread (`GET /history`), behind the endpoint's token. Real processes:
//! `turnstile serve --agent openai --data-dir D` against the scripted OpenAI server.

mod common;
mod mock_openai;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};

use mock_openai::{Mock, stream};

const BIN: &str = env!("CARGO_BIN_EXE_turnstile");
/// The session `turnstile send` talks in by default (platform `cli`, chat `local`).
const SESSION: &str = "cli:dm:local";
const TOKEN: &str = "history-export-token";

/// A running gateway with its bridge and HTTP addresses, killed when dropped.
struct Gateway {
    child: Child,
    addr: String,
    http: String,
}

impl Gateway {
    fn start(mock: &Mock, dir: &Path) -> Gateway {
        let mut child = Command::new(BIN)
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--http-listen",
                "127.0.0.1:0",
            ])
            .args(["--agent", "openai", "--model", "m"])
            .args(["--openai-base-url", &mock.base_url()])
            .arg("--data-dir")
            .arg(dir)
            .env("TURNSTILE_AUTH_TOKEN", TOKEN)
            .env_remove("OPENAI_API_KEY")
            .env_remove("NOTIFY_SOCKET")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start turnstile serve");
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = |prefix: &str| {
            let mut line = String::new();
            out.read_line(&mut line).expect("a line");
            line.trim()
                .strip_prefix(prefix)
                .unwrap_or_else(|| panic!("no {prefix:?} line: {line:?}"))
                .to_owned()
        };
        let addr = line("listening on ");
        let http = line("http on ");
        Gateway { child, addr, http }
    }

    /// Sends `text` with `turnstile send` and returns the reply.
    fn send(&self, text: &str) -> String {
        let out = Command::new(BIN)
            .args(["send", "--addr", &self.addr, "--timeout", "60s", text])
            .env("TURNSTILE_AUTH_TOKEN", TOKEN)
            .output()
            .expect("run turnstile send");
        assert!(out.status.success(), "send {text:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// `turnstile history export --http` of `session`, with `token` in the environment.
    fn export(&self, session: &str, token: Option<&str>) -> Output {
        let mut command = Command::new(BIN);
        command
            .args(["history", "export", "--session", session])
            .args(["--http", &self.http, "--timeout", "60s"])
            .env_remove("TURNSTILE_AUTH_TOKEN")
            .env_remove("TURNSTILE_CLUSTER");
        if let Some(token) = token {
            command.env("TURNSTILE_AUTH_TOKEN", token);
        }
        command.output().expect("run turnstile history export")
    }

    /// The status code of `GET path` on the HTTP endpoint, with `bearer` if given.
    fn status_of(&self, path: &str, bearer: Option<&str>) -> u16 {
        common::http::get(&self.http, path, bearer).status
    }

    fn running(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_none()
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The exported lines, one JSON value each.
fn lines(out: &Output) -> Vec<serde_json::Value> {
    assert!(out.status.success(), "export: {out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_running_gateway_exports_a_conversation_over_its_endpoint_behind_its_token() {
    let mock = Mock::start(vec![
        stream(&["Hello ", "Ann"], 5, 2),
        stream(&["You are Ann"], 9, 3),
    ]);
    let dir = tempfile::tempdir().expect("dir");
    let mut gateway = Gateway::start(&mock, dir.path());
    assert_eq!(gateway.send("my name is Ann"), "Hello Ann");

    // The journal is the running gateway's: read directly, it is refused, saying why.
    let locked = Command::new(BIN)
        .args(["history", "export", "--session", SESSION, "--data-dir"])
        .arg(dir.path())
        .env_remove("TURNSTILE_CLUSTER")
        .output()
        .expect("run turnstile history export");
    assert_eq!(locked.status.code(), Some(1), "{locked:?}");
    assert!(
        stderr(&locked).contains("held by a running gateway"),
        "{locked:?}"
    );

    // Through the gateway: the conversation so far, while it runs.
    let got = lines(&gateway.export(SESSION, Some(TOKEN)));
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0]["session"], SESSION);
    assert_eq!(got[0]["user"], "my name is Ann");
    assert_eq!(got[0]["assistant"], "Hello Ann");

    // It follows the conversation as it goes on.
    assert_eq!(gateway.send("what is my name?"), "You are Ann");
    let got = lines(&gateway.export(SESSION, Some(TOKEN)));
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(got[1]["user"], "what is my name?");
    assert_eq!(got[1]["assistant"], "You are Ann");

    // A session with nothing stored prints nothing; a key that is not one is named.
    let none = gateway.export("cli:dm:nobody", Some(TOKEN));
    assert_eq!(lines(&none), Vec::<serde_json::Value>::new());
    assert!(none.stdout.is_empty());
    let bad = gateway.export("not-a-key", Some(TOKEN));
    assert_eq!(bad.status.code(), Some(2), "{bad:?}");
    assert!(bad.stdout.is_empty());
    assert!(
        stderr(&bad).contains("--session \"not-a-key\"")
            && stderr(&bad).contains("platform:chat_type:chat_id"),
        "{bad:?}"
    );

    // The token is required: no token, or a wrong one, is a 401 and exit 1, nothing printed.
    for token in [None, Some("wrong")] {
        let refused = gateway.export(SESSION, token);
        assert_eq!(refused.status.code(), Some(1), "{token:?}: {refused:?}");
        assert!(refused.stdout.is_empty());
        assert!(stderr(&refused).contains("unauthorized"), "{refused:?}");
    }
    let path = "/history?session=cli%3Adm%3Alocal";
    assert_eq!(gateway.status_of(path, None), 401);
    assert_eq!(gateway.status_of(path, Some("wrong")), 401);
    assert_eq!(gateway.status_of(path, Some(TOKEN)), 200);
    assert_eq!(gateway.status_of("/history?session=nope", Some(TOKEN)), 400);
    assert!(gateway.running(), "the gateway ran throughout");
}
