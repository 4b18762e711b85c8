//! What the Discord and Slack end-to-end tests share: a real `turnstile serve` with a
//! streaming process agent (or the built-in echo agent), the agent's FIFO the test writes to
//! let it go on, the gateway's status file, and the bridge processes' exits.
//!
//! Nothing sleeps to order events: the agent waits on the FIFO, which the test writes once it
//! has seen what it waits for, and every wait has a deadline.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crossbeam_channel::{Receiver, bounded};
use serde_json::Value;

use crate::child_support::{Proc, die_with_parent};
use crate::common::gateway::wait_status;

/// The gateway's auth token: the bridges must present it, and never log it.
pub const GATEWAY_TOKEN: &str = "gateway-secret-4711";
/// Only a failing run waits this long.
pub const WAIT: Duration = Duration::from_secs(60);

/// The streaming process agent (`agent.py FIFO N`): for "stream", a partial, (FIFO) a longer
/// partial, (FIFO) a result of "Hello world " and N party emoji; for "ticks K", K partials
/// 50 ms apart, then a result (the figures' stream); for "where", its session key; anything
/// else is echoed with its chat type.
pub const AGENT: &str = r#"
import json, sys, time
fifo, n = sys.argv[1], int(sys.argv[2])
def out(o):
    sys.stdout.write(json.dumps(o) + "\n"); sys.stdout.flush()
for line in sys.stdin:
    m = json.loads(line)
    if m.get("op") != "turn":
        continue
    i, t = m["id"], m["text"]
    if t == "stream":
        out({"op": "partial", "id": i, "text": "Hello"})
        open(fifo).read()
        out({"op": "partial", "id": i, "text": "Hello world"})
        open(fifo).read()
        out({"op": "reply", "id": i, "text": "Hello world " + "\U0001F389 " * n})
    elif t.startswith("ticks "):
        k = int(t.split()[1])
        for j in range(1, k + 1):
            out({"op": "partial", "id": i, "text": "tick %d" % j})
            time.sleep(0.05)
        out({"op": "reply", "id": i, "text": "ticks done %d" % k})
    elif t == "where":
        out({"op": "reply", "id": i, "text": "session " + m["session"]})
    else:
        out({"op": "reply", "id": i, "text": "echo: %s (%s)" % (t, m["chat_type"])})
"#;

/// The final text of the agent's "stream" with `n` emoji.
pub fn stream_text(n: usize) -> String {
    format!("Hello world {}", "🎉 ".repeat(n))
}

/// A running gateway.
pub struct Setup {
    /// First, so the gateway stops before its directory goes.
    serve: Proc,
    pub dir: tempfile::TempDir,
    pub fifo: PathBuf,
    /// Where the bridges connect (`127.0.0.1:port`).
    pub gateway: String,
    status: PathBuf,
}

impl Setup {
    /// The gateway with the streaming agent, its "stream" result `n` emoji long.
    pub fn start(n: usize) -> Setup {
        Setup::start_on("127.0.0.1:0", n)
    }

    /// The same, listening on `listen`.
    pub fn start_on(listen: &str, n: usize) -> Setup {
        let dir = tempfile::tempdir().expect("tempdir");
        let script = dir.path().join("agent.py");
        std::fs::write(&script, AGENT).expect("agent");
        let fifo = dir.path().join("go.fifo");
        let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
        assert!(made.success());
        let cmd = format!("exec python3 {} {} {n}", script.display(), fifo.display());
        let agent = ["--agent", "process", "--agent-cmd", &cmd].map(str::to_owned);
        Setup::launch(dir, fifo, listen, &agent)
    }

    /// The gateway with the built-in echo agent (answers at once: the rate-limit tests).
    pub fn echo() -> Setup {
        let dir = tempfile::tempdir().expect("tempdir");
        let fifo = dir.path().join("unused.fifo");
        Setup::launch(dir, fifo, "127.0.0.1:0", &["--agent".into(), "echo".into()])
    }

    fn launch(dir: tempfile::TempDir, fifo: PathBuf, listen: &str, agent: &[String]) -> Setup {
        let status = dir.path().join("status.json");
        let mut serve = die_with_parent(
            Command::new(env!("CARGO_BIN_EXE_turnstile"))
                .args(["serve", "--listen", listen, "--http-listen", "off"])
                .args(["--access-default", "open"])
                .args(agent)
                .args(["--partial-interval", "0"])
                .arg("--status-file")
                .arg(&status)
                .env("RUST_LOG", "warn")
                .env("TURNSTILE_AUTH_TOKEN", GATEWAY_TOKEN)
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit()),
        )
        .spawn()
        .expect("start serve");
        let line = lines(serve.stdout.take().expect("stdout"))
            .recv_timeout(WAIT)
            .expect("listening");
        let gateway = line
            .strip_prefix("listening on ")
            .expect("listening line")
            .to_owned();
        Setup {
            dir,
            fifo,
            serve: Proc(serve),
            gateway,
            status,
        }
    }

    /// Lets the agent go on (it waits on the FIFO), bounded.
    pub fn go(&self) {
        let fifo = self.fifo.clone();
        let (tx, rx) = bounded(1);
        std::thread::spawn(move || {
            let r = std::fs::OpenOptions::new()
                .write(true)
                .open(&fifo)
                .and_then(|mut f| f.write_all(b"go"));
            let _ = tx.send(r);
        });
        rx.recv_timeout(WAIT)
            .expect("the agent opened the FIFO")
            .expect("write");
    }

    /// Waits until every message of `platform` is answered and every result was confirmed
    /// `delivered` ([`wait_all_delivered`]).
    pub fn wait_all_delivered(&self, platform: &str) {
        wait_all_delivered(&self.status, platform);
    }

    /// Stops the gateway (SIGTERM) and waits for its exit.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        self.serve.terminate()
    }
}

/// Waits (bounded, on the `--status-file` the gateway rewrites every 100 ms) until every
/// message of `platform` is answered and every result was confirmed `delivered`.
pub fn wait_all_delivered(status: &Path, platform: &str) {
    wait_status(
        status,
        &format!("every result of {platform} confirmed delivered"),
        WAIT,
        |status| {
            let bridge = &status["frontend"];
            let figure = |p: &str| bridge.pointer(p).and_then(Value::as_u64);
            let awaiting = figure("/awaiting_delivery");
            let reserved = figure(&format!("/outboxes/{platform}/reserved_events"));
            (awaiting == Some(0) && reserved == Some(0)).then_some(())
        },
    );
}

/// Lines of a child's stdout (or stderr) on a channel.
pub fn lines(stdout: impl Read + Send + 'static) -> Receiver<String> {
    let (tx, rx) = bounded(16);
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}
