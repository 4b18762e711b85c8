//! `turnstile serve --cluster` with the real binary, beyond tests/cluster_serve: the cluster's
//! figures in the status, the exposition and `turnstile status`, read from real instances;
//! three instances under load with one killed (-9) mid-load; a side-effect log that no
//! delivered message reaches twice; Redis restarted mid-load.
//!
//! The harness (instances on one private redis-server from tests/redis_support, bridges with
//! `acks`) is a copy of tests/cluster_serve's, grown with what these tests need: each
//! instance's status file and HTTP endpoint, an agent command, a bridge that resends what was
//! not acked when it reconnects.
//!
//! Waits on a condition of Redis or of an instance's status poll it with a deadline (Redis)
//! or block on the next status snapshot (the instance's `--status-file`, tests/snapshot_watch):
//! a lease changes hands on Redis's clock, not on an event this test can wait on.

mod redis_support;
mod snapshot_watch;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use redis_support::{Redis, WAIT, require_redis};
use serde_json::{Value, json};
use snapshot_watch::SnapshotWatch;

const PARTITIONS: u32 = 4;

/// One `serve --cluster` process with its status file and HTTP endpoint.
struct Server {
    child: Child,
    addr: String,
    http: String,
    status_file: PathBuf,
    snapshots: SnapshotWatch,
    _dir: tempfile::TempDir,
}

impl Server {
    /// `serve --cluster` as `instance`, its log (WARN and up) to this test's stderr; `extra`
    /// are more flags (the agent).
    fn start(redis: &Redis, instance: &str, lease_ms: u64, extra: &[&str]) -> Server {
        let dir = tempfile::tempdir().expect("tempdir");
        let status_file = dir.path().join("status.json");
        let snapshots = SnapshotWatch::new(dir.path());
        let mut command = Command::new(env!("CARGO_BIN_EXE_turnstile"));
        command
            .arg("serve")
            .args(["--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"])
            .arg("--status-file")
            .arg(&status_file)
            .args(["--cluster", &redis.url(), "--instance-id", instance])
            .args(["--partitions", &PARTITIONS.to_string()])
            .args(["--lease-ms", &lease_ms.to_string()])
            .args(extra)
            .env("RUST_LOG", "warn")
            .env_remove("TURNSTILE_AUTH_TOKEN")
            .env_remove("NOTIFY_SOCKET")
            .env_remove("WATCHDOG_USEC")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        // SAFETY: prctl(2) only, which is async-signal-safe, between fork and exec.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = command.spawn().expect("start turnstile serve");
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        out.read_line(&mut line).expect("first line");
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("listening line, got {line:?}"))
            .to_owned();
        line.clear();
        out.read_line(&mut line).expect("second line");
        let http = line
            .trim()
            .strip_prefix("http on ")
            .unwrap_or_else(|| panic!("http line, got {line:?}"))
            .to_owned();
        Server {
            child,
            addr,
            http,
            status_file,
            snapshots,
            _dir: dir,
        }
    }

    fn signal(&self, sig: libc::c_int) {
        let pid = libc::pid_t::try_from(self.child.id()).expect("pid");
        // SAFETY: kill(2) on our own child's pid.
        assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill({pid}, {sig})");
    }

    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The status snapshot now (`None` while the first is not written).
    fn status(&self) -> Option<Value> {
        let text = std::fs::read_to_string(&self.status_file).ok()?;
        serde_json::from_str(&text).ok()
    }

    /// Blocks on the status snapshots until one satisfies `pred`; that one.
    fn wait_status(&self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(s) = self.status()
                && pred(&s)
            {
                return s;
            }
            assert!(
                self.snapshots.next_before(deadline),
                "timed out waiting for {what}: {:?}",
                self.status()
            );
        }
    }

    /// The cluster part of the status now.
    fn cluster(&self) -> Value {
        self.status()
            .map_or(Value::Null, |s| s["frontend"]["cluster"].clone())
    }

    /// A plain HTTP GET of the endpoint; the body of a 200.
    fn get(&self, path: &str) -> String {
        let mut s = TcpStream::connect(&self.http).expect("connect http");
        s.set_read_timeout(Some(WAIT)).expect("timeout");
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .expect("request");
        let mut raw = String::new();
        s.read_to_string(&mut raw).expect("response");
        let (head, body) = raw.split_once("\r\n\r\n").expect("a head");
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        body.to_owned()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A bridge connection with `acks`.
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
        c.send(&json!({"op": "hello", "platform": "tg", "acks": true}));
        c
    }

    /// A second handle on the connection's write side.
    fn writer(&self) -> TcpStream {
        self.writer.try_clone().expect("clone")
    }

    fn send(&mut self, v: &Value) {
        self.writer
            .write_all((v.to_string() + "\n").as_bytes())
            .expect("write");
    }

    fn message(&mut self, id: &str, chat: &str) {
        send_message(&mut self.writer, id, chat);
    }

    /// The next line that is not a typing indicator or a partial; `None` at the end.
    fn next_line(&mut self) -> Option<Value> {
        loop {
            let mut line = String::new();
            match self.reader.read_line(&mut line) {
                Ok(0) | Err(_) => return None,
                Ok(_) => {}
            }
            let v: Value = serde_json::from_str(&line).expect("json");
            if v["op"] != "typing" && v["op"] != "partial" {
                return Some(v);
            }
        }
    }

    fn next(&mut self) -> Value {
        self.next_line().expect("connection closed")
    }

    /// Confirms a terminal event (an `acks` bridge).
    fn delivered(&mut self, v: &Value) {
        let id = v["id"].as_str().expect("id").to_owned();
        self.send(&json!({"op": "delivered", "ids": [id]}));
    }
}

/// Sends `id` of session `chat` on a connection's write side (the text is the id).
fn send_message(w: &mut TcpStream, id: &str, chat: &str) {
    let v = json!({"op": "message", "id": id, "chat_id": chat, "text": id});
    // A write to a connection the instance's death closed fails: the id stays unacked and
    // the bridge resends it on its next connection.
    let _ = w.write_all((v.to_string() + "\n").as_bytes());
}

fn terminal(v: &Value) -> bool {
    matches!(
        v["op"].as_str(),
        Some("reply" | "failed" | "cancelled" | "merged")
    )
}

/// The holder of each partition's lease now.
fn holders(redis: &Redis) -> Vec<Option<String>> {
    let mut c = redis.client();
    (0..PARTITIONS)
        .map(|p| {
            redis::cmd("GET")
                .arg(format!("ts:{{p{p}}}:lease"))
                .query::<Option<String>>(&mut c)
                .expect("GET")
        })
        .collect()
}

/// Waits (bounded) until every partition is held by one of `instances`; how long that took.
fn until_all_held_by(redis: &Redis, instances: &[&str]) -> Duration {
    let t0 = Instant::now();
    let prefixes: Vec<String> = instances.iter().map(|i| format!("{i}:")).collect();
    loop {
        if holders(redis).iter().all(|h| {
            h.as_deref()
                .is_some_and(|h| prefixes.iter().any(|p| h.starts_with(p)))
        }) {
            return t0.elapsed();
        }
        assert!(
            t0.elapsed() < WAIT,
            "{instances:?} never held every partition: {:?}",
            holders(redis)
        );
        std::thread::park_timeout(Duration::from_millis(10));
    }
}

/// `promtool check metrics` of an exposition: its verdict and what it said.
fn promtool(text: &str) -> Option<(bool, String)> {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .ok()?;
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write to promtool");
    let out = child.wait_with_output().expect("promtool");
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    Some((out.status.success(), said))
}

/// The samples of an exposition by `name{labels}` as written.
fn samples(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_owned(), v.parse().ok()?))
        })
        .collect()
}

/// An exec agent that waits until the test opens `gate` (a FIFO) for writing, then answers
/// the turn's text: a turn the test holds open without a timer.
fn gated_agent(gate: &Path) -> Vec<String> {
    let status = Command::new("mkfifo").arg(gate).status().expect("mkfifo");
    assert!(status.success(), "mkfifo {}", gate.display());
    vec![
        "--agent".into(),
        "exec".into(),
        "--agent-cmd".into(),
        format!(": < '{}'; cat", gate.display()),
    ]
}

/// The cluster's figures are in the status JSON, `turnstile status` and the exposition of a
/// real `serve --cluster`, and each moves with what it counts: partitions owned and gained
/// on the first instance, a message waiting for a remote outcome on the second, a
/// partition lost and handed over after a pause past the lease, the reader's failure and
/// reconnect across a Redis restart, the live instances.
#[test]
fn the_cluster_figures_are_in_the_status_the_summary_and_the_exposition() {
    let Some(bin) = require_redis() else { return };
    let mut redis = Redis::start(&bin);
    let dir = tempfile::tempdir().expect("tempdir");
    let gate = dir.path().join("gate");
    let agent = gated_agent(&gate);
    let agent: Vec<&str> = agent.iter().map(String::as_str).collect();
    let lease_ms = 1000;
    let a = Server::start(&redis, "a", lease_ms, &agent);
    until_all_held_by(&redis, &["a"]);
    let b = Server::start(&redis, "b", lease_ms, &agent);
    let sa = a.wait_status("a owning every partition and seeing b", |s| {
        let c = &s["frontend"]["cluster"];
        c["owned_partitions"] == 4 && c["live_instances"].as_array().is_some_and(|l| l.len() == 2)
    });
    let ca = &sa["frontend"]["cluster"];
    assert_eq!(ca["instance"], "a", "{ca}");
    assert_eq!(ca["partitions"], PARTITIONS, "{ca}");
    assert_eq!(ca["owned"], json!([0, 1, 2, 3]), "{ca}");
    assert_eq!(ca["gained"], 4, "{ca}");
    assert_eq!(
        (ca["lost"].clone(), ca["fenced"].clone()),
        (json!(0), json!(0))
    );
    assert_eq!(ca["live_instances"], json!(["a", "b"]), "{ca}");
    // A message sent to b, owned by a: acked by b, waiting there for a's outcome while the
    // gate holds a's turn.
    let mut on_b = Client::connect(&b.addr);
    on_b.message("m1", "1");
    assert_eq!(on_b.next()["op"], "ack");
    let sb = b.wait_status("b waiting for a remote outcome", |s| {
        s["frontend"]["cluster"]["remote_waiting"] == 1
    });
    let cb = &sb["frontend"]["cluster"];
    assert_eq!(
        (
            cb["owned_partitions"].clone(),
            cb["owned"].clone(),
            cb["gained"].clone()
        ),
        (json!(0), json!([]), json!(0)),
        "{cb}"
    );
    // The same figures in the exposition, which promtool accepts.
    let text = b.get("/metrics");
    if let Some((ok, said)) = promtool(&text) {
        assert!(ok, "promtool check metrics: {said}\n{text}");
    }
    let m = samples(&text);
    for (k, v) in [
        ("turnstile_cluster_info{instance=\"b\"}", 1.0),
        ("turnstile_cluster_partitions", 4.0),
        ("turnstile_cluster_partitions_owned", 0.0),
        ("turnstile_cluster_remote_waiting", 1.0),
        (
            "turnstile_cluster_partition_changes_total{change=\"gained\"}",
            0.0,
        ),
        ("turnstile_cluster_reader_failing", 0.0),
    ] {
        assert_eq!(m.get(k), Some(&v), "{k} in\n{text}");
    }
    let text = a.get("/metrics");
    let m = samples(&text);
    assert_eq!(
        m.get("turnstile_cluster_partitions_owned"),
        Some(&4.0),
        "{text}"
    );
    assert_eq!(
        m.get("turnstile_cluster_live_instances"),
        Some(&2.0),
        "{text}"
    );
    // `turnstile status` says it in words.
    let out = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args(["status", "--http", &b.http])
        .env_remove("TURNSTILE_AUTH_TOKEN")
        .output()
        .expect("turnstile status");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains(
            "cluster: instance b, 2 live (a b); owns 0 of 4 partitions (); 1 waiting for a remote outcome"
        ),
        "{said}"
    );
    // The gate opens: a's turn answers, b's wait ends.
    drop(
        std::fs::OpenOptions::new()
            .write(true)
            .open(&gate)
            .expect("open the gate"),
    );
    let done = on_b.next();
    assert_eq!(
        (done["op"].clone(), done["text"].clone()),
        (json!("reply"), json!("m1"))
    );
    on_b.delivered(&done);
    b.wait_status("b's wait over", |s| {
        s["frontend"]["cluster"]["remote_waiting"] == 0
    });
    // a pauses past its lease: b takes every partition, and a, awake, hands them over.
    a.signal(libc::SIGSTOP);
    until_all_held_by(&redis, &["b"]);
    a.signal(libc::SIGCONT);
    let sa = a.wait_status("a handing its partitions over", |s| {
        s["frontend"]["cluster"]["handed_over_partitions"] == 4
    });
    let ca = &sa["frontend"]["cluster"];
    let (lost, fenced) = (ca["lost"].as_u64(), ca["fenced"].as_u64());
    assert_eq!(lost.zip(fenced).map(|(l, f)| l + f), Some(4), "{ca}");
    assert_eq!(ca["owned_partitions"], 0, "{ca}");
    let cb = b.wait_status("b owning every partition", |s| {
        s["frontend"]["cluster"]["owned_partitions"] == 4
    })["frontend"]["cluster"]
        .clone();
    assert_eq!(cb["gained"], 4, "{cb}");
    // Redis goes away: the reader fails (and says so); it comes back: the reader reconnects.
    redis.kill();
    let cb = b.wait_status("b's reader failing", |s| {
        s["frontend"]["cluster"]["reader_failing"] == true
    })["frontend"]["cluster"]
        .clone();
    assert!(cb["reader_failures"].as_u64() >= Some(1), "{cb}");
    redis.restart();
    let cb = b.wait_status("b's reader reading again", |s| {
        let c = &s["frontend"]["cluster"];
        c["reader_failing"] == false && c["reader_reconnects"].as_u64() >= Some(1)
    })["frontend"]["cluster"]
        .clone();
    let m = samples(&b.get("/metrics"));
    assert!(
        m.get("turnstile_cluster_reader_failures_total") >= Some(&1.0)
            && m.get("turnstile_cluster_reader_reconnects_total") >= Some(&1.0),
        "{m:?} {cb}"
    );
    drop((a, b));
}
