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

mod common;
mod redis_support;
mod snapshot_watch;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use redis_support::{
    BridgeClient, ClusterServe, Redis, WAIT, leases, require_redis, terminal, until_all_held_by,
    until_nothing_in_flight,
};
use serde_json::{Value, json};
use snapshot_watch::SnapshotWatch;

const PARTITIONS: u32 = 6;

/// The load tests run one at a time: three instances, Redis and 300 exec turns each, side
/// by side on a loaded 2-core machine, starve the heartbeats past the lease and the test
/// measures churn instead of what it names.
static LOAD: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_load_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    LOAD.lock().unwrap_or_else(|e| e.into_inner())
}

/// One `serve --cluster` process with its status file and HTTP endpoint.
struct Server {
    serve: ClusterServe,
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
        let serve = ClusterServe::spawn(
            ClusterServe::command_at(&redis.url(), "127.0.0.1:0", instance, PARTITIONS, lease_ms)
                .arg("--status-file")
                .arg(&status_file)
                // Each test names who owns what: no rebalancing (tests/cluster_rebalance has it).
                .args(["--cluster-rebalance", "false"])
                .args(extra)
                .env("RUST_LOG", "warn")
                .env_remove("TURNSTILE_AUTH_TOKEN")
                .env_remove("NOTIFY_SOCKET")
                .env_remove("WATCHDOG_USEC")
                .stderr(Stdio::inherit()),
        );
        Server {
            serve,
            status_file,
            snapshots,
            _dir: dir,
        }
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

    /// Blocks on the status snapshots until `read()` (what the endpoint serves, which may be
    /// a snapshot behind the status file) satisfies `pred`; that text.
    fn wait_for(
        &self,
        what: &str,
        read: impl Fn() -> String,
        pred: impl Fn(&str) -> bool,
    ) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            let text = read();
            if pred(&text) {
                return text;
            }
            assert!(
                self.snapshots.next_before(deadline),
                "timed out waiting for {what}: {text}"
            );
        }
    }

    /// [`Server::wait_for`] of `/metrics` until every `(sample, value)` of `want` is in it.
    fn wait_metrics(&self, want: &[(&str, f64)]) -> String {
        let has = |text: &str| {
            let m = samples(text);
            want.iter().all(|(k, v)| m.get(*k) == Some(v))
        };
        self.wait_for(
            &format!("{want:?} in /metrics"),
            || self.get("/metrics"),
            has,
        )
    }

    /// A plain HTTP GET of the endpoint; the body of a 200.
    fn get(&self, path: &str) -> String {
        let answer = common::http::get(self.serve.http(), path, None);
        assert_eq!(answer.status, 200, "{}", answer.head);
        answer.body
    }
}

/// A bridge connection with `acks`.
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
    until_all_held_by(&redis, PARTITIONS, &["a"]);
    let b = Server::start(&redis, "b", lease_ms, &agent);
    let sa = a.wait_status("a owning every partition and seeing b", |s| {
        let c = &s["frontend"]["cluster"];
        c["owned_partitions"] == 6 && c["live_instances"].as_array().is_some_and(|l| l.len() == 2)
    });
    let ca = &sa["frontend"]["cluster"];
    assert_eq!(ca["instance"], "a", "{ca}");
    assert_eq!(ca["partitions"], PARTITIONS, "{ca}");
    assert_eq!(ca["owned"], json!([0, 1, 2, 3, 4, 5]), "{ca}");
    assert_eq!(ca["gained"], 6, "{ca}");
    assert_eq!(
        (ca["lost"].clone(), ca["fenced"].clone()),
        (json!(0), json!(0))
    );
    assert_eq!(ca["live_instances"], json!(["a", "b"]), "{ca}");
    // Rebalancing is off here (`--cluster-rebalance false`); its bound is still shown, as
    // are the early outcomes.
    assert_eq!(
        (
            ca["rebalance"].clone(),
            ca["drain_ms"].clone(),
            ca["draining"].clone(),
            ca["drained_partitions"].clone(),
            ca["early_outcomes"].clone(),
            ca["early_outcomes_dropped"].clone(),
        ),
        (
            json!(false),
            json!(30_000),
            json!([]),
            json!(0),
            json!(0),
            json!(0)
        ),
        "{ca}"
    );
    // A message sent to b, owned by a: acked by b, waiting there for a's outcome while the
    // gate holds a's turn.
    let mut on_b = BridgeClient::connect(&b.serve.addr);
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
    let text = b.wait_metrics(&[
        ("turnstile_cluster_info{instance=\"b\"}", 1.0),
        ("turnstile_cluster_partitions", 6.0),
        ("turnstile_cluster_partitions_owned", 0.0),
        ("turnstile_cluster_remote_waiting", 1.0),
        (
            "turnstile_cluster_partition_changes_total{change=\"gained\"}",
            0.0,
        ),
        ("turnstile_cluster_reader_failing", 0.0),
    ]);
    if let Some((ok, said)) = promtool(&text) {
        assert!(ok, "promtool check metrics: {said}\n{text}");
    }
    a.wait_metrics(&[
        ("turnstile_cluster_partitions_owned", 6.0),
        ("turnstile_cluster_live_instances", 2.0),
    ]);
    // `turnstile status` says it in words.
    let status_cmd = || {
        let out = Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args(["status", "--http", b.serve.http()])
            .env_remove("TURNSTILE_AUTH_TOKEN")
            .output()
            .expect("turnstile status");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    b.wait_for("the cluster line of turnstile status", status_cmd, |said| {
        said.contains(
            "cluster: instance b, 2 live (a b); owns 0 of 6 partitions; 1 waiting for a remote outcome",
        )
    });
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
    a.serve.signal(libc::SIGSTOP);
    until_all_held_by(&redis, PARTITIONS, &["b"]);
    a.serve.signal(libc::SIGCONT);
    // Its bridge fences itself out at its tick (`self_fenced`), its journal thread reports
    // the partitions lost a moment later: each ownership ends once in lost + fenced.
    let sa = a.wait_status("a handing its partitions over", |s| {
        let c = &s["frontend"]["cluster"];
        let ended = c["lost"].as_u64().unwrap_or(0) + c["fenced"].as_u64().unwrap_or(0);
        c["handed_over_partitions"] == 6 && ended >= 6
    });
    let ca = &sa["frontend"]["cluster"];
    let (lost, fenced) = (ca["lost"].as_u64(), ca["fenced"].as_u64());
    assert_eq!(lost.zip(fenced).map(|(l, f)| l + f), Some(6), "{ca}");
    assert_eq!(ca["owned_partitions"], 0, "{ca}");
    let cb = b.wait_status("b owning every partition", |s| {
        s["frontend"]["cluster"]["owned_partitions"] == 6
    })["frontend"]["cluster"]
        .clone();
    assert_eq!(cb["gained"], 6, "{cb}");
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
    assert!(cb["reader_failures"].as_u64() >= Some(1), "{cb}");
    b.wait_for(
        "the reader's failures and reconnects in /metrics",
        || b.get("/metrics"),
        |text| {
            let m = samples(text);
            m.get("turnstile_cluster_reader_failures_total") >= Some(&1.0)
                && m.get("turnstile_cluster_reader_reconnects_total") >= Some(&1.0)
                && m.get("turnstile_cluster_reader_failing") == Some(&0.0)
        },
    );
    drop((a, b));
}

/// One line a load bridge read: which bridge, which of its connections (it reconnects), the
/// line.
struct Line {
    bridge: usize,
    conn: usize,
    v: Value,
}

/// Sends message `id` in chat `chat` on `w`; a write to a connection the instance's death
/// closed fails: the id stays unacked and the bridge resends it on its next connection.
fn send_message(w: &mut TcpStream, id: &str, chat: &str) {
    let v = json!({"op": "message", "id": id, "chat_id": chat, "text": id});
    let _ = w.write_all((v.to_string() + "\n").as_bytes());
}

/// A bridge as a real one behaves, on its own thread: it connects to the first instance of
/// `addrs` that answers, sends its messages, confirms every terminal event, and when the
/// connection ends (the instance died) connects to the next one and resends every message
/// not acked yet, in order. Every line goes to `tx`; it stops when no instance answers or
/// `tx` is gone.
fn load_bridge(
    bridge: usize,
    addrs: Vec<String>,
    messages: Vec<(String, String)>,
    tx: crossbeam_channel::Sender<Line>,
) {
    std::thread::spawn(move || {
        let mut acked: HashSet<String> = HashSet::new();
        let mut at = 0;
        for conn in 0.. {
            let Some(mut c) = addrs[at..].iter().find_map(|a| {
                at += 1;
                TcpStream::connect(a).ok().map(|_| BridgeClient::connect(a))
            }) else {
                return;
            };
            for (id, chat) in messages.iter().filter(|(id, _)| !acked.contains(id)) {
                send_message(&mut c.writer(), id, chat);
            }
            while let Some(v) = c.next_line() {
                if v["op"] == "ack" {
                    acked.insert(v["id"].as_str().unwrap_or_default().to_owned());
                } else if terminal(&v) {
                    c.delivered(&v);
                }
                if tx.send(Line { bridge, conn, v }).is_err() {
                    return;
                }
            }
        }
    });
}

/// What the bridges received, and the counts the load tests print and assert.
#[derive(Default)]
struct Tally {
    acked: HashSet<String>,
    /// Each id's terminal events, in arrival order.
    outcomes: HashMap<String, Vec<Value>>,
    /// Each connection's terminal events' ids by session, in arrival order: those not
    /// marked `redelivery` (the order a bridge sees new results in), and all.
    order: HashMap<(usize, usize, String), Vec<String>>,
    order_all: HashMap<(usize, usize, String), Vec<String>>,
    /// Rejections by id: reason.
    rejected: HashMap<String, String>,
}

impl Tally {
    fn record(&mut self, l: Line) {
        let id = l.v["id"].as_str().unwrap_or_default().to_owned();
        match l.v["op"].as_str() {
            Some("ack") => {
                self.acked.insert(id);
            }
            Some("reject") => {
                let reason = l.v["reason"].as_str().unwrap_or_default().to_owned();
                self.rejected.insert(id, reason);
            }
            _ if terminal(&l.v) => {
                let session = id.split('-').next().unwrap_or_default().to_owned();
                let key = (l.bridge, l.conn, session);
                let mut orders = vec![&mut self.order_all];
                if l.v["redelivery"] != true {
                    orders.push(&mut self.order);
                }
                for order in orders {
                    let ids = order.entry(key.clone()).or_default();
                    if !ids.contains(&id) {
                        ids.push(id.clone());
                    }
                }
                self.outcomes.entry(id).or_default().push(l.v);
            }
            _ => {}
        }
    }

    /// Acked and not answered.
    fn lost(&self) -> Vec<&String> {
        let mut v: Vec<&String> = self
            .acked
            .iter()
            .filter(|id| !self.outcomes.contains_key(*id))
            .collect();
        v.sort();
        v
    }

    /// Reads `rx` until `done` holds or nothing came for [`WAIT`].
    fn until(&mut self, rx: &crossbeam_channel::Receiver<Line>, done: impl Fn(&Tally) -> bool) {
        while !done(self) {
            match rx.recv_timeout(WAIT) {
                Ok(l) => self.record(l),
                Err(_) => return,
            }
        }
    }

    /// Sessions whose replies not marked `redelivery` reached one connection out of sending
    /// order (message numbers after the `-` of the id; interrupted turns and other outcomes
    /// aside).
    fn out_of_order(&self) -> Vec<String> {
        Tally::disordered(&self.order, &self.outcomes)
    }

    /// The same counting the marked copies too: a result sent again (or sent first by an
    /// instance that found its origin gone) after later replies of its session.
    fn late_redeliveries(&self) -> usize {
        Tally::disordered(&self.order_all, &self.outcomes).len()
    }

    fn disordered(
        order: &HashMap<(usize, usize, String), Vec<String>>,
        outcomes: &HashMap<String, Vec<Value>>,
    ) -> Vec<String> {
        let mut bad = Vec::new();
        for ((bridge, conn, session), ids) in order {
            let n: Vec<usize> = ids
                .iter()
                .filter(|id| outcomes[*id][0]["op"] == "reply")
                .filter_map(|id| id.rsplit('-').next()?.parse().ok())
                .collect();
            if n.windows(2).any(|w| w[0] > w[1]) {
                bad.push(format!("{session} on bridge {bridge} conn {conn}: {ids:?}"));
            }
        }
        bad
    }

    /// Every id's copies are one outcome, and at most one copy is not marked `redelivery`
    /// (a second unmarked copy would be a result sent twice as if new); the ids answered
    /// more than once.
    fn check_copies(&self) -> usize {
        for (id, vs) in &self.outcomes {
            assert!(
                vs.iter()
                    .all(|v| v["op"] == vs[0]["op"] && v["text"] == vs[0]["text"]),
                "{id}: two different outcomes: {vs:?}"
            );
            let unmarked = vs.iter().filter(|v| v["redelivery"] != true).count();
            assert!(
                unmarked <= 1,
                "{id}: {unmarked} copies not marked redelivery: {vs:?}"
            );
        }
        self.outcomes.values().filter(|v| v.len() > 1).count()
    }
}

/// Each partition's outcome stream: the seqs published, asserting none twice; their count.
fn outcome_records(redis: &Redis) -> usize {
    let mut c = redis.client();
    let mut published = 0;
    for p in 0..PARTITIONS {
        let entries: Vec<(String, Vec<String>)> = redis::cmd("XRANGE")
            .arg(format!("ts:{{p{p}}}:out"))
            .arg("-")
            .arg("+")
            .query(&mut c)
            .expect("XRANGE");
        let mut seqs: Vec<&String> = entries
            .iter()
            .filter_map(|(_, kv)| kv.chunks(2).find(|f| f[0] == "seq").map(|f| &f[1]))
            .collect();
        let n = seqs.len();
        seqs.sort_unstable();
        seqs.dedup();
        assert_eq!(seqs.len(), n, "partition {p}: an outcome written twice");
        published += n;
    }
    published
}

/// An exec agent that appends the turn's message id to `log` (its side effect), then answers
/// the turn's text.
fn side_effect_agent(log: &Path) -> Vec<String> {
    vec![
        "--agent".into(),
        "exec".into(),
        "--agent-cmd".into(),
        format!(
            "printf '%s\\n' \"$TURNSTILE_MESSAGE_ID\" >> '{}'; cat",
            log.display()
        ),
    ]
}

/// Three instances (`a` started first holds every partition: shedding is off), a bridge
/// with `acks` on each, 300 messages over 30 sessions; kill -9 of `a` mid-load, its bridge
/// reconnecting to a survivor and resending what was not acked. Every acked message gets
/// exactly one outcome record (one outcome-stream entry) and reaches a bridge, replies keep
/// per-session order on each connection, no copy sent twice unmarked; and the side-effect
/// log of the exec agent has every message whose reply a bridge received and confirmed
/// exactly once (none twice).
#[test]
fn three_instances_kill_9_of_one_mid_load_one_outcome_each_and_no_side_effect_twice() {
    three_instances_kill_9(0);
}

/// The same with `b` killed, which owns nothing: the results of the messages it accepted
/// are recorded by `a` and published to `b`. Once `b` leaves the registry, `a`'s reader
/// finds its messages in `a`'s partitions and `a` answers them (marked `redelivery`).
/// Before that (an origin's death noticed only by a load, and `a` loads nothing), 78 of 300
/// acked messages were never answered, all 300 outcomes recorded.
#[test]
fn three_instances_kill_9_of_an_origin_that_owns_nothing_answers_its_messages() {
    three_instances_kill_9(1);
}

/// The three-instance test, killing `names[victim]` after 60 results.
fn three_instances_kill_9(victim: usize) {
    let _one = one_load_at_a_time();
    let Some(bin) = require_redis() else { return };
    let redis = Redis::start(&bin);
    let dir = tempfile::tempdir().expect("tempdir");
    let effects = dir.path().join("side-effects.log");
    let agent = side_effect_agent(&effects);
    let agent: Vec<&str> = agent.iter().map(String::as_str).collect();
    let lease_ms = 1000;
    let names = ["a", "b", "c"];
    let mut servers = vec![Server::start(&redis, names[0], lease_ms, &agent)];
    until_all_held_by(&redis, PARTITIONS, &names[..1]);
    servers.extend(
        names[1..]
            .iter()
            .map(|n| Server::start(&redis, n, lease_ms, &agent)),
    );
    let addrs: Vec<String> = servers.iter().map(|s| s.serve.addr.clone()).collect();
    let (sessions, per_session) = (30, 10);
    let (tx, rx) = crossbeam_channel::unbounded();
    let mut sent = 0;
    for b in 0..names.len() {
        let mut messages = Vec::new();
        for i in 0..per_session {
            for s in (0..sessions).filter(|s| s % names.len() == b) {
                messages.push((format!("s{s}-{i}"), s.to_string()));
            }
        }
        sent += messages.len();
        let order: Vec<String> = (0..addrs.len())
            .map(|k| addrs[(b + k) % addrs.len()].clone())
            .collect();
        load_bridge(b, order, messages, tx.clone());
    }
    drop(tx);
    let mut t = Tally::default();
    t.until(&rx, |t| t.outcomes.len() >= 60);
    let held = leases(&redis, PARTITIONS);
    let count = |n: &str| {
        held.iter()
            .filter(|h| {
                h.as_deref()
                    .is_some_and(|h| h.starts_with(&format!("{n}:")))
            })
            .count()
    };
    let survivors: Vec<&str> = (0..names.len())
        .filter(|&i| i != victim)
        .map(|i| names[i])
        .collect();
    eprintln!(
        "kill -9 of {} (holding {} of {PARTITIONS} partitions) after {} results",
        names[victim],
        count(names[victim]),
        t.outcomes.len()
    );
    servers[victim].serve.kill9();
    let killed = Instant::now();
    let took = until_all_held_by(&redis, PARTITIONS, &survivors);
    let takeover = killed.elapsed().max(took);
    t.until(&rx, |t| t.acked.len() == sent && t.lost().is_empty());
    let lost = t.lost();
    let twice = t.check_copies();
    let disorder = t.out_of_order();
    let published = outcome_records(&redis);
    eprintln!(
        "sent {sent}, acked {}, answered {}, lost {}, duplicated {twice}, out of order {} (sessions with a marked copy after a later reply {}), outcome records {published}; takeover: every partition held by {survivors:?} {takeover:?} after the kill (lease {lease_ms} ms)",
        t.acked.len(),
        t.outcomes.len(),
        lost.len(),
        disorder.len(),
        t.late_redeliveries()
    );
    assert_eq!(
        t.acked.len(),
        sent,
        "every message acked (resent if need be)"
    );
    assert!(lost.is_empty(), "acked and never answered: {lost:?}");
    assert!(disorder.is_empty(), "replies out of order: {disorder:?}");
    assert_eq!(published, sent, "one outcome record per message");
    until_nothing_in_flight(&redis, PARTITIONS);
    // The side effects: a delivered reply's exactly once, nobody's twice.
    let log = std::fs::read_to_string(&effects).expect("the side-effect log");
    let mut done: HashMap<&str, usize> = HashMap::new();
    for id in log.lines() {
        *done.entry(id).or_default() += 1;
    }
    let twice: Vec<(&&str, &usize)> = done.iter().filter(|(_, n)| **n > 1).collect();
    let replies: Vec<&String> = t
        .outcomes
        .iter()
        .filter(|(_, vs)| vs[0]["op"] == "reply")
        .map(|(id, _)| id)
        .collect();
    let missing: Vec<&&String> = replies
        .iter()
        .filter(|id| !done.contains_key(id.as_str()))
        .collect();
    eprintln!(
        "side effects: {} logged, {} replies delivered, {} other outcomes, {} twice",
        log.lines().count(),
        replies.len(),
        t.outcomes.len() - replies.len(),
        twice.len()
    );
    assert!(twice.is_empty(), "side effects run twice: {twice:?}");
    assert!(
        missing.is_empty(),
        "a delivered reply without its side effect: {missing:?}"
    );
    drop(servers);
}

/// Reads a connection on its own thread as bridge `bridge`: every line goes to `tx`, every
/// terminal event is confirmed.
fn pump(mut c: BridgeClient, bridge: usize, tx: crossbeam_channel::Sender<Line>) {
    std::thread::spawn(move || {
        while let Some(v) = c.next_line() {
            if terminal(&v) {
                c.delivered(&v);
            }
            if tx.send(Line { bridge, conn: 0, v }).is_err() {
                return;
            }
        }
    });
}

/// Redis killed mid-load and started again on the same port and directory (append-only,
/// `appendfsync always`), the outage longer than the lease: messages sent meanwhile are
/// answered `reject storage`; every message acked before is answered once Redis is back
/// (its turn run, its outcome delivered), with one outcome record; what was refused is
/// accepted when sent again, and new messages are served.
#[test]
fn redis_restarted_mid_load_refuses_storage_meanwhile_loses_nothing_acked_and_resumes() {
    let _one = one_load_at_a_time();
    let Some(bin) = require_redis() else { return };
    let mut redis = Redis::start(&bin);
    let lease_ms = 1000;
    let a = Server::start(&redis, "a", lease_ms, &[]);
    until_all_held_by(&redis, PARTITIONS, &["a"]);
    let b = Server::start(&redis, "b", lease_ms, &[]);
    let (ca, cb) = (
        BridgeClient::connect(&a.serve.addr),
        BridgeClient::connect(&b.serve.addr),
    );
    let mut writers = [ca.writer(), cb.writer()];
    let (tx, rx) = crossbeam_channel::unbounded();
    pump(ca, 0, tx.clone());
    pump(cb, 1, tx);
    let mut sent: Vec<(String, String)> = Vec::new();
    // Session `s` goes through instance `s % 2`.
    fn send(writers: &mut [TcpStream; 2], sent: &mut Vec<(String, String)>, id: String, s: usize) {
        send_message(&mut writers[s % 2], &id, &s.to_string());
        sent.push((id, s.to_string()));
    }
    let (sessions, per_session) = (20, 6);
    for i in 0..per_session {
        for s in 0..sessions {
            send(&mut writers, &mut sent, format!("s{s}-{i}"), s);
        }
    }
    let mut t = Tally::default();
    t.until(&rx, |t| t.outcomes.len() >= 20);
    redis.kill();
    let killed = Instant::now();
    // New messages during the outage: refused `storage`, never acked.
    let during: Vec<String> = (0..10).map(|k| format!("s{k}-out")).collect();
    for (k, id) in during.iter().enumerate() {
        send(&mut writers, &mut sent, id.clone(), k);
    }
    t.until(&rx, |t| during.iter().all(|id| t.rejected.contains_key(id)));
    for id in &during {
        assert_eq!(
            t.rejected.get(id).map(String::as_str),
            Some("storage"),
            "{id} during the outage"
        );
        assert!(!t.acked.contains(id), "{id} acked during the outage");
    }
    // Past the lease: both instances lose what they hold (a) or never had (b).
    let lost = a.wait_status("a losing its partitions", |s| {
        s["frontend"]["cluster"]["owned_partitions"] == 0
    });
    let outage = killed.elapsed();
    redis.restart();
    let acked_before = t.acked.clone();
    t.until(&rx, |t| {
        acked_before.iter().all(|id| t.outcomes.contains_key(id))
    });
    let back = killed.elapsed();
    // What was refused is sent again, as a bridge does; new messages too.
    let refused: Vec<(String, String)> = sent
        .iter()
        .filter(|(id, _)| !t.acked.contains(id))
        .cloned()
        .collect();
    for (id, chat) in &refused {
        let s: usize = chat.parse().expect("a session number");
        t.rejected.remove(id);
        send(&mut writers, &mut sent, id.clone(), s);
    }
    for s in 0..sessions {
        send(&mut writers, &mut sent, format!("s{s}-after"), s);
    }
    let all: HashSet<String> = sent.iter().map(|(id, _)| id.clone()).collect();
    // A message refused `storage` again (an instance whose registration the outage let
    // lapse accepts nothing until its next heartbeat goes through) is sent again, as a
    // bridge does, until every one is acked; a few rounds at most.
    let session_of: HashMap<String, usize> = sent
        .iter()
        .map(|(id, chat)| (id.clone(), chat.parse().expect("a session number")))
        .collect();
    let mut sent_again = 0;
    for _round in 0..100 {
        t.until(&rx, |t| {
            all.iter()
                .all(|id| t.acked.contains(id) || t.rejected.contains_key(id))
        });
        let again: Vec<String> = (all.iter())
            .filter(|id| !t.acked.contains(*id) && t.rejected.remove(*id).is_some())
            .cloned()
            .collect();
        if again.is_empty() {
            break;
        }
        sent_again += again.len();
        for id in &again {
            let s = session_of[id];
            send_message(&mut writers[s % 2], id, &s.to_string());
        }
    }
    t.until(&rx, |t| {
        all.iter()
            .all(|id| t.acked.contains(id) && t.outcomes.contains_key(id))
    });
    let lost_ids = t.lost();
    let twice = t.check_copies();
    let disorder = t.out_of_order();
    let published = outcome_records(&redis);
    eprintln!(
        "before the outage acked {}; during it {} refused storage; outage {outage:?} (a owned {} partitions then); everything acked before answered {back:?} after the kill; refused again and sent again {sent_again}; sent {}, acked {}, answered {}, lost {}, duplicated {twice}, out of order {} (sessions with a marked copy after a later reply {}), outcome records {published}",
        acked_before.len(),
        during.len(),
        lost["frontend"]["cluster"]["owned_partitions"],
        all.len(),
        t.acked.len(),
        t.outcomes.len(),
        lost_ids.len(),
        disorder.len(),
        t.late_redeliveries()
    );
    assert!(
        lost_ids.is_empty(),
        "acked and never answered: {lost_ids:?}"
    );
    assert_eq!(
        t.acked.len(),
        all.len(),
        "every message acked once sent again"
    );
    assert!(disorder.is_empty(), "replies out of order: {disorder:?}");
    assert_eq!(published, all.len(), "one outcome record per message");
    until_nothing_in_flight(&redis, PARTITIONS);
    drop((a, b));
}

/// An ack for a message queued on another instance carries its `position` (docs/protocol.md):
/// the session's messages in flight across the cluster when Redis accepted it, counting one
/// running on the owner and those accepted before it on any instance.
#[test]
fn an_ack_for_a_message_owned_elsewhere_carries_the_cluster_wide_position() {
    let Some(bin) = require_redis() else { return };
    let redis = Redis::start(&bin);
    let dir = tempfile::tempdir().expect("tempdir");
    let gate = dir.path().join("gate");
    let agent = gated_agent(&gate);
    let agent: Vec<&str> = agent.iter().map(String::as_str).collect();
    let a = Server::start(&redis, "a", 3000, &agent);
    until_all_held_by(&redis, PARTITIONS, &["a"]);
    // Held in Redis is not yet owned: a new owner loads a partition a fence margin after
    // acquiring it (docs/cluster.md, self-fencing), and acks what comes meanwhile `queued`.
    a.wait_status("a owning every partition", |s| {
        s["frontend"]["cluster"]["owned_partitions"] == PARTITIONS
    });
    let b = Server::start(&redis, "b", 3000, &agent);
    a.wait_status("a seeing b", |s| {
        s["frontend"]["cluster"]["live_instances"]
            .as_array()
            .is_some_and(|l| l.len() == 2)
    });
    let (mut on_a, mut on_b) = (
        BridgeClient::connect(&a.serve.addr),
        BridgeClient::connect(&b.serve.addr),
    );
    let ack = |c: &mut BridgeClient| {
        let v = c.next();
        assert_eq!(v["op"], "ack", "{v}");
        (v["id"].clone(), v["state"].clone(), v["position"].clone())
    };
    on_a.message("m0", "7");
    assert_eq!(ack(&mut on_a), (json!("m0"), json!("running"), json!(0)));
    on_b.message("m1", "7");
    assert_eq!(ack(&mut on_b), (json!("m1"), json!("queued"), json!(1)));
    on_b.message("m2", "7");
    assert_eq!(ack(&mut on_b), (json!("m2"), json!("queued"), json!(2)));
    // Each opening of the gate lets the session's next turn answer, in order.
    let open_gate = || {
        drop(
            std::fs::OpenOptions::new()
                .write(true)
                .open(&gate)
                .expect("open the gate"),
        )
    };
    open_gate();
    let done = on_a.next();
    assert_eq!(done["text"], "m0");
    on_a.delivered(&done);
    for id in ["m1", "m2"] {
        open_gate();
        let done = on_b.next();
        assert_eq!(
            (done["op"].clone(), done["text"].clone()),
            (json!("reply"), json!(id))
        );
        on_b.delivered(&done);
    }
    // Confirmed, they leave Redis; with nothing ahead, the next one is queued at position 0.
    until_nothing_in_flight(&redis, PARTITIONS);
    on_b.message("m3", "7");
    assert_eq!(ack(&mut on_b), (json!("m3"), json!("queued"), json!(0)));
    open_gate();
    assert_eq!(on_b.next()["text"], "m3");
}

/// The same (platform, id) sent to another instance with another chat, whose session falls
/// in another partition, is answered `duplicate` (docs/protocol.md: duplicates are per
/// (platform, id)), as the single-node gateway answers it: while the first runs, and after it
/// was answered and confirmed, for the rest of the window.
#[test]
fn the_same_id_with_another_chat_on_another_instance_is_a_duplicate() {
    let Some(bin) = require_redis() else { return };
    let redis = Redis::start(&bin);
    let dir = tempfile::tempdir().expect("tempdir");
    let gate = dir.path().join("gate");
    let agent = gated_agent(&gate);
    let agent: Vec<&str> = agent.iter().map(String::as_str).collect();
    let a = Server::start(&redis, "a", 3000, &agent);
    until_all_held_by(&redis, PARTITIONS, &["a"]);
    // Held in Redis is not yet owned: a new owner loads a partition a fence margin after
    // acquiring it (docs/cluster.md, self-fencing), and acks what comes meanwhile `queued`.
    a.wait_status("a owning every partition", |s| {
        s["frontend"]["cluster"]["owned_partitions"] == PARTITIONS
    });
    let b = Server::start(&redis, "b", 3000, &agent);
    a.wait_status("a seeing b", |s| {
        s["frontend"]["cluster"]["live_instances"]
            .as_array()
            .is_some_and(|l| l.len() == 2)
    });
    let partition = |chat: &str| {
        turnstile::internal::cluster::partition_of(&format!("tg:dm:{chat}"), PARTITIONS)
    };
    let other = (2..100)
        .map(|c| c.to_string())
        .find(|c| partition(c) != partition("1"))
        .expect("a chat in another partition");
    let (mut on_a, mut on_b) = (
        BridgeClient::connect(&a.serve.addr),
        BridgeClient::connect(&b.serve.addr),
    );
    on_a.message("m1", "1");
    let ack = on_a.next();
    assert_eq!(
        (ack["op"].clone(), ack["state"].clone()),
        (json!("ack"), json!("running"))
    );
    // While it runs on a.
    on_b.message("m1", &other);
    let dup = on_b.next();
    assert_eq!(
        (dup["op"].clone(), dup["state"].clone()),
        (json!("ack"), json!("duplicate")),
        "{dup}"
    );
    drop(
        std::fs::OpenOptions::new()
            .write(true)
            .open(&gate)
            .expect("open the gate"),
    );
    let done = on_a.next();
    assert_eq!(done["text"], "m1", "{done}");
    on_a.delivered(&done);
    until_nothing_in_flight(&redis, PARTITIONS);
    // Answered and confirmed: still a duplicate for the rest of the window.
    on_b.message("m1", &other);
    let dup = on_b.next();
    assert_eq!(
        (dup["op"].clone(), dup["state"].clone()),
        (json!("ack"), json!("duplicate")),
        "{dup}"
    );
}
