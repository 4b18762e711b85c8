//! Operations over real sockets: the HTTP endpoint (health, readiness, status, metrics and
//! its bounds), systemd notifications and the watchdog, logs, `turnstile status`,
//! `turnstile send` errors, `--check-config`. The real binary, spawned with
//! PR_SET_PDEATHSIG; reads have timeouts that only bound a failing run.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

mod common;
mod snapshot_watch;
use common::gateway::{Serve, turnstile as bin};
use common::http::{Http, get, parse_response};
use snapshot_watch::SnapshotWatch;

const WAIT: Duration = Duration::from_secs(20);

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("turnstile-ops-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

struct Gw {
    /// Its log lines read when `RUST_LOG` was given.
    serve: Serve,
    /// Wakes when the gateway writes its next status snapshot (its `--status-file`).
    snapshots: SnapshotWatch,
}

impl Gw {
    /// `serve` on free ports (bridge and HTTP); stderr captured when `RUST_LOG` is given.
    fn start(args: &[&str], env: &[(&str, &str)]) -> Gw {
        // Every gateway writes a status file, so that a test waiting for a snapshot can
        // block until the next one is written instead of polling on a timer.
        let given = args
            .iter()
            .position(|a| *a == "--status-file")
            .and_then(|i| args.get(i + 1))
            .map(PathBuf::from);
        let own = given.is_none().then(|| {
            static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            temp_dir(&format!("snapshots-{n}")).join("status.json")
        });
        let status_file = given.or(own.clone()).expect("a status file");
        let snapshots = SnapshotWatch::new(status_file.parent().expect("a directory"));
        let mut command = Serve::local_command("127.0.0.1:0");
        command
            .args(["--access-default", "open"])
            .args(
                own.iter()
                    .flat_map(|f| [std::ffi::OsStr::new("--status-file"), f.as_os_str()]),
            )
            .args(args)
            .env("RUST_LOG", "warn")
            .env_remove("NOTIFY_SOCKET")
            .env_remove("WATCHDOG_USEC")
            .env_remove("TURNSTILE_AUTH_TOKEN")
            .stderr(Stdio::inherit());
        for (k, v) in env {
            command.env(k, v);
        }
        let serve = if env.iter().any(|(k, _)| *k == "RUST_LOG") {
            Serve::spawn_logged(&mut command)
        } else {
            Serve::spawn(&mut command)
        };
        Gw { serve, snapshots }
    }

    fn client(&self) -> Client {
        let stream = TcpStream::connect(&self.serve.addr).expect("connect");
        stream.set_read_timeout(Some(WAIT)).expect("timeout");
        Client {
            reader: BufReader::new(stream.try_clone().expect("clone")),
            writer: stream,
        }
    }

    fn signal(&self, sig: i32) {
        self.serve.signal(sig);
    }

    fn get(&self, path: &str, token: Option<&str>) -> Http {
        get(self.serve.http(), path, token)
    }

    fn status(&self) -> Value {
        let r = self.get("/status", None);
        assert_eq!(r.status, 200, "{}", r.body);
        serde_json::from_str(&r.body).expect("status json")
    }

    /// Polls `/status` until `pred` holds (bounded; each poll is a request).
    fn wait_status(&self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        self.wait_status_auth(None, what, pred)
    }

    /// [`Gw::wait_status`] with a bearer token.
    fn wait_status_auth(
        &self,
        token: Option<&str>,
        what: &str,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + WAIT;
        loop {
            let r = self.get("/status", token);
            assert_eq!(r.status, 200, "{}", r.body);
            let s: Value = serde_json::from_str(&r.body).expect("status json");
            if pred(&s) {
                return s;
            }
            assert!(
                self.snapshots.next_before(deadline),
                "timed out waiting for {what}: {s}"
            );
        }
    }

    fn metrics(&self) -> BTreeMap<String, f64> {
        let r = self.get("/metrics", None);
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(
            r.head.contains("text/plain; version=0.0.4"),
            "content type: {}",
            r.head
        );
        prom::parse(&r.body).unwrap_or_else(|e| panic!("invalid exposition: {e}\n{}", r.body))
    }

    /// The next log line containing every needle (the lines before it are skipped).
    fn log_line(&self, needles: &[&str]) -> String {
        self.serve.log().until(needles).0
    }

    /// Waits for exit (bounded) and returns the status and everything logged (not yet read).
    fn wait(mut self) -> (ExitStatus, String) {
        let mut log = String::new();
        if let Some(lines) = self.serve.take_log() {
            // The reader thread ends at EOF, when the process has exited.
            for line in lines.rest() {
                log.push_str(&line);
                log.push('\n');
            }
        }
        let (tx, rx) = crossbeam_channel::bounded(1);
        let mut child = std::mem::replace(
            &mut self.serve.child,
            bin().arg("--version").spawn().expect("spawn"),
        );
        std::thread::spawn(move || {
            let _ = tx.send(child.wait());
        });
        let status = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("exited in time")
            .expect("wait");
        (status, log)
    }
}

struct Client {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

fn msg(id: &str, platform: &str, chat: &str, text: &str) -> Value {
    json!({"op": "message", "id": id, "platform": platform, "chat_id": chat, "text": text})
}

impl Client {
    fn send(&mut self, v: &Value) {
        writeln!(self.writer, "{v}").expect("write");
    }

    fn recv(&mut self) -> Value {
        let mut line = String::new();
        let n = self.reader.read_line(&mut line).expect("a line in time");
        assert!(n > 0, "connection closed");
        serde_json::from_str(&line).expect("json line")
    }

    fn recv_until(&mut self, pred: impl Fn(&Value) -> bool) -> Value {
        loop {
            let v = self.recv();
            if pred(&v) {
                return v;
            }
        }
    }

    fn outcome(&mut self, id: &str) -> Value {
        self.recv_until(|v| {
            v["id"] == id
                && ["reply", "cancelled", "failed", "merged"]
                    .contains(&v["op"].as_str().unwrap_or(""))
        })
    }

    /// The outcomes of `ids`, in whatever order they come.
    fn outcomes(&mut self, ids: &[&str]) -> BTreeMap<String, Value> {
        let mut got = BTreeMap::new();
        while got.len() < ids.len() {
            let v = self.recv();
            let id = v["id"].as_str().unwrap_or("").to_owned();
            if ids.contains(&id.as_str())
                && ["reply", "cancelled", "failed", "merged"]
                    .contains(&v["op"].as_str().unwrap_or(""))
            {
                got.insert(id, v);
            }
        }
        got
    }

    fn ack(&mut self, id: &str) -> Value {
        self.recv_until(|v| v["id"] == id && (v["op"] == "ack" || v["op"] == "reject"))
    }
}

/// A format checker for the Prometheus text exposition format 0.0.4 (what `promtool check
/// metrics` checks of the syntax, and the histogram rules).
mod prom {
    use std::collections::{BTreeMap, HashSet};

    fn metric_name(s: &str) -> bool {
        let mut c = s.chars();
        c.next()
            .is_some_and(|f| f.is_ascii_alphabetic() || f == '_' || f == ':')
            && c.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    }

    fn label_name(s: &str) -> bool {
        let mut c = s.chars();
        c.next()
            .is_some_and(|f| f.is_ascii_alphabetic() || f == '_')
            && c.all(|c| c.is_ascii_alphanumeric() || c == '_')
    }

    fn value(s: &str) -> Result<f64, String> {
        match s {
            "+Inf" => Ok(f64::INFINITY),
            "-Inf" => Ok(f64::NEG_INFINITY),
            "NaN" => Ok(f64::NAN),
            _ => s.parse().map_err(|_| format!("bad value {s:?}")),
        }
    }

    /// Labels of `{...}`: (name, unescaped value) pairs, and the rest of the line.
    type Labels = Vec<(String, String)>;

    fn labels(s: &str) -> Result<(Labels, &str), String> {
        let mut out = Vec::new();
        let mut rest = s;
        loop {
            if let Some(r) = rest.strip_prefix('}') {
                return Ok((out, r));
            }
            let eq = rest.find('=').ok_or("label without =")?;
            let name = &rest[..eq];
            if !label_name(name) {
                return Err(format!("bad label name {name:?}"));
            }
            let mut chars = rest[eq + 1..].char_indices();
            if chars.next().map(|(_, c)| c) != Some('"') {
                return Err("label value not quoted".into());
            }
            let mut v = String::new();
            let mut end = None;
            while let Some((i, c)) = chars.next() {
                match c {
                    '\\' => match chars.next().map(|(_, c)| c) {
                        Some('\\') => v.push('\\'),
                        Some('"') => v.push('"'),
                        Some('n') => v.push('\n'),
                        other => return Err(format!("bad escape {other:?}")),
                    },
                    '"' => {
                        end = Some(eq + 1 + i + 1);
                        break;
                    }
                    '\n' => return Err("raw newline in a label value".into()),
                    c => v.push(c),
                }
            }
            let end = end.ok_or("unterminated label value")?;
            if out.iter().any(|(n, _)| n == name) {
                return Err(format!("label {name} twice"));
            }
            out.push((name.to_owned(), v));
            rest = &rest[end..];
            rest = rest.strip_prefix(',').unwrap_or(rest);
        }
    }

    /// Parses and checks an exposition; the samples by `name{sorted labels}`.
    pub fn parse(text: &str) -> Result<BTreeMap<String, f64>, String> {
        if !text.ends_with('\n') {
            return Err("the exposition must end with a newline".into());
        }
        let mut types: BTreeMap<String, String> = BTreeMap::new();
        let mut helped = HashSet::new();
        let mut finished: HashSet<String> = HashSet::new();
        let mut current: Option<String> = None;
        let mut samples = BTreeMap::new();
        // Per histogram and label set (without le): its buckets in order, sum and count.
        let mut buckets: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
        let mut counts: BTreeMap<String, f64> = BTreeMap::new();
        for (n, line) in text.lines().enumerate() {
            let at = |e: String| format!("line {}: {e}: {line:?}", n + 1);
            if line.is_empty() {
                continue;
            }
            if let Some(c) = line.strip_prefix("# ") {
                let mut parts = c.splitn(3, ' ');
                let (kw, name) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
                match kw {
                    "HELP" | "TYPE" if !metric_name(name) => {
                        return Err(at(format!("bad metric name {name:?}")));
                    }
                    "HELP" if !helped.insert(name.to_owned()) => {
                        return Err(at("second HELP".into()));
                    }
                    "TYPE" => {
                        let t = parts.next().unwrap_or("");
                        if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&t) {
                            return Err(at(format!("bad type {t:?}")));
                        }
                        if types.insert(name.to_owned(), t.to_owned()).is_some() {
                            return Err(at("second TYPE".into()));
                        }
                        if samples
                            .keys()
                            .any(|k: &String| family_of(k, &types) == name)
                        {
                            return Err(at("TYPE after its samples".into()));
                        }
                    }
                    _ => {}
                }
                continue;
            }
            if line.starts_with('#') {
                continue;
            }
            let name_end = line.find(['{', ' ']).ok_or_else(|| at("no value".into()))?;
            let name = &line[..name_end];
            if !metric_name(name) {
                return Err(at(format!("bad metric name {name:?}")));
            }
            let (mut labels, rest) = if let Some(r) = line[name_end..].strip_prefix('{') {
                labels(r).map_err(at)?
            } else {
                (Vec::new(), &line[name_end..])
            };
            let mut fields = rest.split_whitespace();
            let v = value(fields.next().ok_or_else(|| at("no value".into()))?).map_err(at)?;
            if let Some(ts) = fields.next() {
                ts.parse::<i64>().map_err(|_| at("bad timestamp".into()))?;
            }
            if fields.next().is_some() {
                return Err(at("trailing text".into()));
            }
            let family = family_of(name, &types);
            let kind = types.get(&family).map(String::as_str).unwrap_or("untyped");
            if current.as_deref() != Some(family.as_str()) {
                if finished.contains(&family) {
                    return Err(at(format!("samples of {family} are not together")));
                }
                if let Some(prev) = current.replace(family.clone()) {
                    finished.insert(prev);
                }
            }
            if kind == "counter" && (v.is_nan() || v < 0.0) {
                return Err(at("negative counter".into()));
            }
            if kind == "histogram" {
                let le = labels
                    .iter()
                    .find(|(k, _)| k == "le")
                    .map(|(_, v)| v.clone());
                let others: Vec<String> = labels
                    .iter()
                    .filter(|(k, _)| k != "le")
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect();
                let series = format!("{family}{{{}}}", others.join(","));
                if name.ends_with("_bucket") {
                    let le =
                        value(&le.ok_or_else(|| at("bucket without le".into()))?).map_err(at)?;
                    let b = buckets.entry(series).or_default();
                    if b.last().is_some_and(|&(ple, pv)| ple >= le || pv > v) {
                        return Err(at("buckets must rise in le and count".into()));
                    }
                    b.push((le, v));
                } else if name.ends_with("_count") {
                    counts.insert(series, v);
                } else if !name.ends_with("_sum") {
                    return Err(at("histogram sample not _bucket, _sum or _count".into()));
                }
            }
            labels.sort();
            let key = if labels.is_empty() {
                name.to_owned()
            } else {
                let l: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
                format!("{name}{{{}}}", l.join(","))
            };
            if samples.insert(key.clone(), v).is_some() {
                return Err(at(format!("duplicate sample {key}")));
            }
        }
        for (series, b) in &buckets {
            let Some(&(le, n)) = b.last() else { continue };
            if le != f64::INFINITY {
                return Err(format!("{series}: no +Inf bucket"));
            }
            if counts.get(series) != Some(&n) {
                return Err(format!("{series}: +Inf bucket {n} is not _count"));
            }
        }
        for family in types.keys() {
            if !helped.contains(family) {
                return Err(format!("{family}: TYPE without HELP"));
            }
        }
        Ok(samples)
    }

    /// The family a sample belongs to (a histogram's `_bucket`, `_sum`, `_count`).
    fn family_of(name: &str, types: &BTreeMap<String, String>) -> String {
        for suffix in ["_bucket", "_sum", "_count"] {
            if let Some(base) = name.strip_suffix(suffix)
                && types
                    .get(base)
                    .is_some_and(|t| t == "histogram" || t == "summary")
            {
                return base.to_owned();
            }
        }
        name.to_owned()
    }

    #[test]
    fn the_checker_refuses_what_promtool_refuses() {
        let ok = "# HELP a_total A.\n# TYPE a_total counter\na_total{x=\"q\\\"\"} 1\n";
        assert_eq!(parse(ok).unwrap()["a_total{x=\"q\"\"}"], 1.0);
        for bad in [
            "a 1",                                           // no final newline
            "1a 1\n",                                        // bad name
            "a{1x=\"v\"} 1\n",                               // bad label name
            "a{x=v} 1\n",                                    // unquoted value
            "a{x=\"\\t\"} 1\n",                              // bad escape
            "a one\n",                                       // bad value
            "a 1\na 2\n",                                    // duplicate
            "a 1\nb 1\na{x=\"y\"} 1\n",                      // family split
            "# TYPE a counter\n# HELP a A.\na -1\n",         // negative counter
            "# HELP a A.\n# TYPE a gauge\n# TYPE a gauge\n", // second TYPE
            "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\nh_sum 1\nh_count 1\n",
            "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_sum 1\nh_count 1\n",
            "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"+Inf\"} 2\nh_sum 1\nh_count 1\n",
            "# TYPE a gauge\na 1\n", // TYPE without HELP
        ] {
            assert!(parse(bad).is_err(), "accepted {bad:?}");
        }
    }
}

fn m(metrics: &BTreeMap<String, f64>, key: &str) -> f64 {
    *metrics.get(key).unwrap_or_else(|| {
        panic!(
            "no sample {key} in {:#?}",
            metrics.keys().collect::<Vec<_>>()
        )
    })
}

/// A process agent (docs/agent-protocol.md) in Python: a partial then the reply; `fail`
/// answers an error; `wait` sends a partial and answers only its cancel; `slow` ignores
/// everything for 30 s.
fn agent_script(dir: &Path) -> String {
    let path = dir.join("agent.py");
    std::fs::write(
        &path,
        r#"import json, sys, time
for line in sys.stdin:
    op = json.loads(line)
    if op["op"] == "close":
        break
    if op["op"] != "turn":
        continue
    mid, text = op["id"], op["text"]
    def out(o):
        sys.stdout.write(json.dumps(o) + "\n"); sys.stdout.flush()
    if text == "fail":
        out({"op": "error", "id": mid, "message": "boom"})
    elif text == "wait":
        out({"op": "partial", "id": mid, "text": "waiting"})
        for l in sys.stdin:
            if json.loads(l)["op"] == "cancel":
                out({"op": "error", "id": mid, "message": "stopped"})
                break
    elif text == "slow":
        time.sleep(30)
    else:
        out({"op": "partial", "id": mid, "text": text[:1]})
        out({"op": "reply", "id": mid, "text": "re: " + text})
"#,
    )
    .expect("write agent");
    format!("python3 {}", path.display())
}

/// Issue 11: `/metrics` scraped during a load, every family checked against the format
/// rules, the counters seen to move; the status JSON carries the same figures.
#[test]
fn metrics_move_under_load_and_the_exposition_is_valid() {
    let dir = temp_dir("metrics");
    let cmd = agent_script(&dir);
    // The turn timeout comes from the file, shortened by a reload just before the turn that
    // must time out: the other turns keep the default, however slow the machine.
    let cfg = dir.join("turnstile.toml");
    std::fs::write(&cfg, "").expect("write");
    let gw = Gw::start(
        &[
            "--config",
            cfg.to_str().expect("path"),
            "--agent",
            "process",
            "--agent-cmd",
            &cmd,
            "--partial-interval",
            "0",
            "--queue-cap",
            "1",
            "--stop-grace",
            "0.2",
            "--agent-close-grace",
            "0.2",
            "--cleanup-timeout",
            "10",
        ],
        &[("RUST_LOG", "info")],
    );
    let m0 = gw.metrics();
    assert_eq!(m(&m0, "turnstile_turns_total{outcome=\"completed\"}"), 0.0);
    assert!(m(&m0, "turnstile_start_time_seconds") > 1.7e9);
    assert!(m(&m0, "process_resident_memory_bytes") > 1e6);
    assert!(m(&m0, "process_cpu_seconds_total") > 0.0);
    assert!(m(&m0, "process_open_fds") >= 3.0);
    assert!(m(&m0, "process_max_fds") >= m(&m0, "process_open_fds"));
    assert!(m(&m0, "process_start_time_seconds") > 1.7e9);
    assert_eq!(m(&m0, "turnstile_up"), 1.0);

    let mut c = gw.client();
    // A reply, and a failure.
    c.send(&msg("r1", "telegram", "1", "hello"));
    c.send(&msg("f1", "telegram", "2", "fail"));
    let o = c.outcomes(&["r1", "f1"]);
    assert_eq!(o["r1"]["op"], "reply");
    assert_eq!(o["f1"]["op"], "failed");
    // A turn that waits, one queued behind it, one past the queue cap.
    c.send(&msg("w1", "telegram", "3", "wait"));
    c.send(&msg("w2", "telegram", "3", "queued"));
    c.send(&msg("w3", "telegram", "3", "over"));
    assert_eq!(c.ack("w3")["reason"], "queue_full");
    // The waiting turn's partial (a partial racing its own reply may be dropped; this one
    // has no reply to race).
    let partial = c.recv_until(|v| v["op"] == "partial");
    assert_eq!(
        (partial["id"].as_str(), partial["text"].as_str()),
        (Some("w1"), Some("waiting"))
    );
    // An invalid message.
    c.send(&json!({"op": "message", "id": "bad", "platform": "telegram", "text": "x"}));
    assert_eq!(c.ack("bad")["reason"], "invalid");
    let busy = gw.wait_status("a running turn and a queued message", |s| {
        s["turns"]["in_flight"] == 1 && s["sessions"]["queued_messages"] == 1
    });
    assert!(busy["sessions"]["total"].as_u64() >= Some(1), "{busy}");
    let m1 = gw.metrics();
    assert_eq!(m(&m1, "turnstile_turns_running"), 1.0);
    assert_eq!(m(&m1, "turnstile_messages_queued"), 1.0);
    assert!(m(&m1, "turnstile_sessions") >= 1.0);
    assert_eq!(
        m(
            &m1,
            "turnstile_worker_threads{pool=\"turn\",state=\"busy\"}"
        ),
        1.0
    );
    // /stop: the waiting turn cancelled, its queued follower too.
    c.send(&msg("s1", "telegram", "3", "/stop"));
    let o = c.outcomes(&["w1", "w2", "s1"]);
    assert_eq!(o["w1"]["op"], "cancelled");
    assert_eq!(o["w2"]["op"], "cancelled");
    // /new closes the session's agent (a cleanup).
    c.send(&msg("n1", "telegram", "1", "/new"));
    assert_eq!(c.outcome("n1")["op"], "reply");
    // A turn past its timeout is abandoned, its thread replaced; its sender has gone, so
    // its result waits in the platform's outbox.
    std::fs::write(&cfg, "turn-timeout = 1\n").expect("write");
    gw.signal(libc::SIGHUP);
    gw.log_line(&["reload: applied", "turn-timeout=1s"]);
    let mut gone = gw.client();
    gone.send(&msg("t1", "slack", "9", "slow"));
    assert_eq!(gone.ack("t1")["op"], "ack");
    drop(gone);
    let s = gw.wait_status("the abandoned turn, its outbox and the cleanup", |s| {
        s["turns"]["abandoned"] == 1
            && s["frontend"]["outboxes"]["slack"]["outbox_events"] == 1
            && s["cleanups"]["done"].as_u64() >= Some(1)
    });
    assert!(s["workers"]["replaced"].as_u64() >= Some(1), "{s}");
    assert!(
        s["messages"]["partials_forwarded"].as_u64() >= Some(1),
        "{s}"
    );
    assert_eq!(s["rejected_by_reason"]["queue_full"], 1, "{s}");
    assert_eq!(s["frontend"]["rejected"]["invalid"], 1, "{s}");
    assert!(s["process"]["rss_bytes"].as_u64() > Some(1_000_000), "{s}");
    assert!(s["loop_lag_window_ms"]["max"].as_f64().is_some(), "{s}");

    let m2 = gw.metrics();
    assert!(m(&m2, "turnstile_ticks_total") > m(&m0, "turnstile_ticks_total"));
    let lag_count = m(&m2, "turnstile_loop_lag_seconds_count");
    assert!(lag_count > m(&m0, "turnstile_loop_lag_seconds_count"));
    assert_eq!(
        m(&m2, "turnstile_loop_lag_seconds_bucket{le=\"+Inf\"}"),
        lag_count
    );
    assert!(m(&m2, "turnstile_loop_lag_seconds_bucket{le=\"0.00005\"}") <= lag_count);
    assert!(m(&m2, "turnstile_loop_lag_seconds_bucket{le=\"10\"}") <= lag_count);
    assert!(m(&m2, "turnstile_loop_lag_window_seconds{stat=\"max\"}") >= 0.0);
    assert!(m(&m2, "turnstile_turns_total{outcome=\"completed\"}") >= 1.0);
    assert_eq!(m(&m2, "turnstile_turns_total{outcome=\"failed\"}"), 1.0);
    assert_eq!(m(&m2, "turnstile_turns_total{outcome=\"cancelled\"}"), 1.0);
    assert_eq!(m(&m2, "turnstile_turns_total{outcome=\"abandoned\"}"), 1.0);
    assert!(m(&m2, "turnstile_turn_duration_seconds_count") >= 4.0);
    assert!(
        m(&m2, "turnstile_turn_duration_seconds_sum") >= 1.0,
        "the 1 s timeout"
    );
    assert_eq!(
        m(&m2, "turnstile_rejections_total{reason=\"queue_full\"}"),
        1.0
    );
    assert_eq!(
        m(&m2, "turnstile_rejections_total{reason=\"invalid\"}"),
        1.0
    );
    assert_eq!(
        m(&m2, "turnstile_rejections_total{reason=\"overloaded\"}"),
        0.0
    );
    assert!(m(&m2, "turnstile_cleanups_total{result=\"done\"}") >= 1.0);
    assert!(m(&m2, "turnstile_cleanups_total{result=\"timed_out\"}") >= 0.0);
    // The abandoned turn's agent (asleep, deaf to `close`) is killed when it comes back:
    // whether that close has ended, and how, depends on timing; the family is there.
    assert!(m(&m2, "turnstile_cleanups_total{result=\"failed\"}") >= 0.0);
    assert!(m(&m2, "turnstile_cleanup_queue_depth") >= 0.0);
    assert!(m(&m2, "turnstile_replaced_threads_total") >= 1.0);
    assert!(m(&m2, "turnstile_partials_forwarded_total") >= 1.0);
    assert_eq!(m(&m2, "turnstile_messages_queued_cancelled_total"), 1.0);
    assert!(m(&m2, "turnstile_messages_accepted_total") >= 6.0);
    assert_eq!(m(&m2, "turnstile_outbox_depth{platform=\"slack\"}"), 1.0);
    assert!(m(&m2, "turnstile_outbox_bytes{platform=\"slack\"}") > 0.0);
    assert_eq!(
        m(&m2, "turnstile_connections{state=\"authenticated\"}"),
        1.0
    );
    assert_eq!(m(&m2, "turnstile_platforms"), 2.0);
    let threads: f64 = ["idle", "busy", "stuck"]
        .iter()
        .map(|st| {
            m(
                &m2,
                &format!("turnstile_worker_threads{{pool=\"turn\",state=\"{st}\"}}"),
            )
        })
        .sum();
    assert!(threads >= 16.0, "{threads}");
    assert!(m(&m2, "turnstile_http_requests_total{result=\"all\"}") >= 3.0);
    assert_eq!(m(&m2, "turnstile_http_connections{state=\"max\"}"), 64.0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `/healthz` is 200 while serving and 503 with the reason once shutdown began; `/readyz`
/// likewise; the token guards all but `/healthz`.
#[test]
fn healthz_turns_503_during_shutdown_and_the_token_guards_the_rest() {
    let gw = Gw::start(&["--echo-delay-ms", "3000", "--auth-token", "k"], &[]);
    let h = gw.get("/healthz", None);
    assert_eq!((h.status, h.body.as_str()), (200, "ok\n"));
    assert_eq!(gw.get("/readyz", Some("k")).status, 200);
    for path in ["/readyz", "/status", "/metrics"] {
        let r = gw.get(path, None);
        assert_eq!(r.status, 401, "{path}");
        assert!(r.head.contains("WWW-Authenticate: Bearer"), "{}", r.head);
        assert_eq!(gw.get(path, Some("nope")).status, 401, "{path}");
    }
    assert_eq!(gw.get("/status", Some("k")).status, 200);
    // A turn running keeps the drain going.
    let mut c = gw.client();
    c.send(&json!({"op": "hello", "platform": "telegram", "token": "k"}));
    c.send(&msg("m1", "telegram", "1", "x"));
    assert_eq!(c.ack("m1")["op"], "ack");
    gw.signal(libc::SIGTERM);
    // Once a message is refused `shutting_down`, the runtime is draining.
    for i in 0.. {
        let id = format!("late{i}");
        c.send(&msg(&id, "telegram", "2", "y"));
        if c.ack(&id)["reason"] == "shutting_down" {
            break;
        }
    }
    let h = gw.get("/healthz", None);
    assert_eq!((h.status, h.body.as_str()), (503, "shutting down\n"));
    let r = gw.get("/readyz", Some("k"));
    assert_eq!((r.status, r.body.as_str()), (503, "shutting down\n"));
    assert_eq!(c.outcome("m1")["op"], "reply", "the running turn drains");
    let (status, _) = gw.wait();
    assert_eq!(status.code(), Some(0));
}

/// The endpoint's bounds: connections, head size, requests per connection, idle time; and
/// its answers to what it does not serve.
#[test]
fn http_bounds_and_bad_requests() {
    let gw = Gw::start(
        &[
            "--http-max-connections",
            "2",
            "--http-max-header-bytes",
            "200",
            "--http-max-requests",
            "2",
            "--http-idle-timeout",
            "0.3",
        ],
        &[],
    );
    let raw = |req: &str| -> Vec<u8> {
        let mut s = TcpStream::connect(gw.serve.http()).expect("connect");
        s.set_read_timeout(Some(WAIT)).expect("timeout");
        s.write_all(req.as_bytes()).expect("write");
        let mut out = Vec::new();
        s.read_to_end(&mut out).expect("read");
        out
    };
    // Two requests on one connection, then it is closed: the second says so.
    let out = raw(
        "GET /healthz HTTP/1.1\r\n\r\nGET /healthz HTTP/1.1\r\n\r\nGET /healthz HTTP/1.1\r\n\r\n",
    );
    let (first, n) = parse_response(&out);
    assert!(
        first.head.contains("Connection: keep-alive"),
        "{}",
        first.head
    );
    let (second, m2) = parse_response(&out[n..]);
    assert_eq!(second.status, 200);
    assert!(second.head.contains("Connection: close"), "{}", second.head);
    assert_eq!(n + m2, out.len(), "no third response");
    // A head past the bound.
    let big = format!("GET /healthz HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(300));
    assert_eq!(parse_response(&raw(&big)).0.status, 431);
    // Not found, wrong method, malformed.
    assert_eq!(
        parse_response(&raw("GET /nope HTTP/1.1\r\n\r\n")).0.status,
        404
    );
    let r = parse_response(&raw("POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n")).0;
    assert_eq!(r.status, 405);
    assert!(r.head.contains("Allow: GET, HEAD"));
    assert_eq!(parse_response(&raw("BLAH\r\n\r\n")).0.status, 400);
    // An idle connection is closed at the idle timeout, without an answer.
    let mut idle = TcpStream::connect(gw.serve.http()).expect("connect");
    idle.set_read_timeout(Some(WAIT)).expect("timeout");
    let mut buf = Vec::new();
    assert_eq!(idle.read_to_end(&mut buf).expect("closed"), 0);
    // Two connections held (sending half a request): a third evicts the oldest of them and
    // is served; the other is served too.
    let mut held: Vec<TcpStream> = (0..2)
        .map(|_| {
            let mut s = TcpStream::connect(gw.serve.http()).expect("connect");
            s.set_read_timeout(Some(WAIT)).expect("timeout");
            s.write_all(b"GET /healthz HTTP/1.1\r\n").expect("write");
            s
        })
        .collect();
    let third = raw("GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n");
    assert_eq!(parse_response(&third).0.status, 200);
    let mut out = Vec::new();
    let _ = held[0].read_to_end(&mut out);
    assert!(out.is_empty(), "the oldest was evicted without an answer");
    held[1]
        .write_all(b"Connection: close\r\n\r\n")
        .expect("write");
    held[1].read_to_end(&mut out).expect("read");
    assert_eq!(parse_response(&out).0.status, 200);
    // The status is the last tick's: wait for one taken after all this.
    let s = gw.wait_status("the HTTP figures", |s| {
        let h = &s["frontend"]["http"];
        h["evicted"].as_u64() >= Some(1)
            && h["idle_closed"].as_u64().unwrap_or(0) + h["head_timeouts"].as_u64().unwrap_or(0)
                >= 1
            && h["bad_requests"].as_u64() >= Some(4)
    });
    let h = &s["frontend"]["http"];
    assert_eq!(
        (
            &h["max_connections"],
            &h["max_header_bytes"],
            &h["max_requests"],
            &h["idle_timeout_s"]
        ),
        (&json!(2), &json!(200), &json!(2), &json!(0.3)),
        "{s}"
    );
    let mm = gw.metrics();
    assert!(
        m(
            &mm,
            "turnstile_http_connections_closed_total{reason=\"evicted\"}"
        ) >= 1.0
    );
    assert!(m(&mm, "turnstile_http_requests_total{result=\"bad_request\"}") >= 4.0);
}

/// A failing agent leaves a WARN with its session; every message a DEBUG line with its
/// fields; `--log-format json` makes each line one JSON object with the fields lifted out;
/// the message text never shows above DEBUG.
#[test]
fn logs_a_failed_turn_at_warn_with_its_session_and_every_message_at_debug() {
    let gw = Gw::start(
        &[
            "--agent",
            "exec",
            "--agent-cmd",
            "echo nope; exit 2",
            "--log-format",
            "json",
        ],
        &[("RUST_LOG", "turnstile=debug")],
    );
    let mut c = gw.client();
    c.send(&msg("secret-id", "telegram", "77", "the secret text"));
    assert_eq!(c.outcome("secret-id")["op"], "failed");
    gw.signal(libc::SIGTERM);
    let (status, log) = gw.wait();
    assert_eq!(status.code(), Some(0), "{log}");
    let lines: Vec<Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let warn = lines
        .iter()
        .find(|v| {
            v["level"] == "WARN" && v["msg"].as_str().unwrap_or("").starts_with("turn failed")
        })
        .unwrap_or_else(|| panic!("no WARN for the failed turn: {log}"));
    assert_eq!(warn["session"], "telegram:dm:77", "{warn}");
    assert_eq!(warn["id"], "secret-id");
    assert_eq!(warn["outcome"], "failed:agent");
    assert!(warn["ms"].is_u64(), "{warn}");
    assert!(warn["turn"].is_u64(), "{warn}");
    for kind in ["accepted", "finished"] {
        assert!(
            lines.iter().any(|v| v["level"] == "DEBUG"
                && v["msg"].as_str().unwrap_or("").starts_with(kind)
                && v["session"] == "telegram:dm:77"),
            "no DEBUG {kind} line: {log}"
        );
    }
    for v in &lines {
        if v["level"] != "DEBUG" && v["level"] != "TRACE" {
            assert!(!v.to_string().contains("the secret text"), "{v}");
        }
    }
}

/// systemd: READY=1 once listening, WATCHDOG=1 pings from the ticks while the loop is
/// healthy, none while it is wedged (while `/healthz` answers 503), pings again after;
/// STATUS= lines; STOPPING=1.
#[test]
fn watchdog_pings_stop_while_the_loop_is_wedged() {
    let dir = temp_dir("notify");
    let sock_path = dir.join("notify.sock");
    let sock = UnixDatagram::bind(&sock_path).expect("bind notify socket");
    sock.set_read_timeout(Some(WAIT)).expect("timeout");
    let fifo = dir.join("wedge");
    let c = std::ffi::CString::new(fifo.to_str().expect("path")).expect("cstr");
    // SAFETY: mkfifo with a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let gw = Gw::start(
        &[],
        &[
            ("NOTIFY_SOCKET", sock_path.to_str().expect("path")),
            ("WATCHDOG_USEC", "200000"),
            ("TURNSTILE_TEST_WEDGE", fifo.to_str().expect("path")),
        ],
    );
    let recv = |sock: &UnixDatagram| -> String {
        let mut buf = [0u8; 512];
        let n = sock.recv(&mut buf).expect("a notification in time");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    let mut seen = Vec::new();
    while !(seen.iter().any(|m: &String| m == "WATCHDOG=1")
        && seen
            .iter()
            .any(|m: &String| m.starts_with("STATUS=running: ")))
    {
        seen.push(recv(&sock));
    }
    assert!(seen[0].starts_with("READY=1"), "{seen:?}");
    assert!(
        seen.iter().any(|m| m.starts_with("STATUS=running: ")),
        "{seen:?}"
    );
    // Wedge the loop: SIGUSR1, then the next tick blocks opening the FIFO until we open it.
    gw.signal(libc::SIGUSR1);
    // Opened on a thread, so a gateway that never opens its end (built without the hook,
    // or dead) fails the test instead of hanging it.
    let (tx, rx) = crossbeam_channel::bounded(1);
    let path = fifo.clone();
    std::thread::spawn(move || {
        let _ = tx.send(std::fs::OpenOptions::new().write(true).open(&path));
    });
    let mut writer = rx
        .recv_timeout(WAIT)
        .expect("the reactor opened the wedge (is the binary built with test-hooks?)")
        .expect("open the wedge");
    // The reactor is now inside the tick, reading the FIFO. What it sent before is queued.
    sock.set_nonblocking(true).expect("nonblocking");
    let mut buf = [0u8; 512];
    while sock.recv(&mut buf).is_ok() {}
    sock.set_nonblocking(false).expect("blocking");
    // For five watchdog periods nothing arrives: the loop that would send is stuck.
    sock.set_read_timeout(Some(Duration::from_millis(500)))
        .expect("timeout");
    match sock.recv(&mut buf) {
        Err(e) => assert!(
            matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
            "{e}"
        ),
        Ok(n) => panic!(
            "a notification from a wedged loop: {}",
            String::from_utf8_lossy(&buf[..n])
        ),
    }
    // The HTTP endpoint is served on its own thread (issue 18 row 4): a wedged loop is
    // answered, and reported by the age of its last snapshot, not waited for.
    let h = gw.get("/healthz", None);
    assert_eq!(h.status, 503, "{}", h.body);
    assert!(h.body.contains("last heartbeat tick"), "{}", h.body);
    // Release it: pings resume.
    writer.write_all(b"x").expect("write");
    drop(writer);
    sock.set_read_timeout(Some(WAIT)).expect("timeout");
    while recv(&sock) != "WATCHDOG=1" {}
    // The late tick was seen (the wedge less one tick period): an unhealthy lag, which
    // sent no ping; the window's percentiles show it.
    let s = gw.status();
    assert!(
        s["loop_lag_window_ms"]["max"].as_f64() >= Some(400.0),
        "{s}"
    );
    assert_eq!(
        s["loop_lag_window_ms"]["max"], s["loop_lag_ms"]["max"],
        "{s}"
    );
    gw.signal(libc::SIGTERM);
    while !recv(&sock).starts_with("STOPPING=1") {}
    let (status, _) = gw.wait();
    assert_eq!(status.code(), Some(0));
    let _ = std::fs::remove_dir_all(&dir);
}

fn status_cmd(args: &[&str]) -> (i32, String, String) {
    let out = bin()
        .arg("status")
        .args(args)
        .env_remove("TURNSTILE_AUTH_TOKEN")
        .output()
        .expect("run status");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `turnstile status`: 0 for a fresh snapshot of a running gateway (file or HTTP), 1 for a
/// stale or stopped one, 3 when there is none.
#[test]
fn status_subcommand_exit_codes_for_fresh_stale_and_missing() {
    let dir = temp_dir("statuscmd");
    let file = dir.join("status.json");
    let file_arg = file.to_str().expect("path");
    let gw = Gw::start(&["--status-file", file_arg, "--auth-token", "k"], &[]);
    // The file is written by its own thread after the first ticks.
    let deadline = Instant::now() + WAIT;
    let (code, out, err) = loop {
        let r = status_cmd(&["--status-file", file_arg]);
        if r.0 == 0 || !gw.snapshots.next_before(deadline) {
            break r;
        }
    };
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("state: running"), "{out}");
    assert!(out.contains("loop lag: last minute p50"), "{out}");
    assert!(out.contains("verdict: healthy"), "{out}");
    let (code, out, err) = status_cmd(&["--http", gw.serve.http(), "--token", "k"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("connections: 0"), "{out}");
    let (code, _, err) = status_cmd(&["--http", gw.serve.http()]);
    assert_eq!(code, 3);
    assert!(err.contains("unauthorized"), "{err}");
    // Stale: the same snapshot, a minute older.
    let mut v: Value =
        serde_json::from_str(&std::fs::read_to_string(&file).expect("read")).expect("json");
    let updated = v["process"]["updated_unix_s"].as_f64().expect("updated");
    v["process"]["updated_unix_s"] = json!(updated - 60.0);
    let stale = dir.join("stale.json");
    std::fs::write(&stale, v.to_string()).expect("write");
    let (code, out, _) = status_cmd(&["--status-file", stale.to_str().expect("path")]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("verdict: unhealthy: the snapshot is 6"),
        "{out}"
    );
    // Stopped: the last snapshot after a clean exit.
    gw.signal(libc::SIGTERM);
    let (status, _) = gw.wait();
    assert_eq!(status.code(), Some(0));
    let (code, out, _) = status_cmd(&["--status-file", file_arg]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("verdict: unhealthy: state is stopped"),
        "{out}"
    );
    // Missing, and nothing listening.
    let (code, _, err) = status_cmd(&["--status-file", dir.join("none").to_str().expect("p")]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("cannot read the status file"), "{err}");
    let free = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = free.local_addr().expect("addr").to_string();
    drop(free);
    let (code, _, err) = status_cmd(&["--http", &addr]);
    assert_eq!(code, 3);
    assert!(err.contains("connection refused"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn send_cmd(args: &[&str]) -> (i32, String) {
    let out = bin()
        .arg("send")
        .args(args)
        .env_remove("TURNSTILE_AUTH_TOKEN")
        .output()
        .expect("run send");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `turnstile send` says what went wrong in words: refused, not a turnstile server, timeout.
#[test]
fn send_errors_are_in_words() {
    let free = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = free.local_addr().expect("addr").to_string();
    drop(free);
    let (code, err) = send_cmd(&["--addr", &addr, "hi"]);
    assert_eq!(code, 1);
    assert!(err.contains("connection refused"), "{err}");

    // A server that answers something else.
    let other = TcpListener::bind("127.0.0.1:0").expect("bind");
    let other_addr = other.local_addr().expect("addr").to_string();
    let t = std::thread::spawn(move || {
        let (mut s, _) = other.accept().expect("accept");
        let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
        // And one that never answers.
        let (s2, _) = other.accept().expect("accept");
        let mut b = [0u8; 1024];
        let _ = (&s2).read(&mut b);
        let mut s2 = s2;
        let _ = s2.read_to_end(&mut Vec::new());
    });
    let (code, err) = send_cmd(&["--addr", &other_addr, "hi"]);
    assert_eq!(code, 1);
    assert!(err.contains("is not a turnstile server"), "{err}");
    let (code, err) = send_cmd(&["--addr", &other_addr, "--timeout", "0.3", "hi"]);
    assert_eq!(code, 1);
    assert!(err.contains("timed out after 0.3 s"), "{err}");
    t.join().expect("peer thread");
}

/// `serve --check-config`: 0 for valid flags and file, 2 naming what is wrong.
#[test]
fn check_config_exits_zero_or_two() {
    let dir = temp_dir("check");
    let good = dir.join("good.toml");
    std::fs::write(&good, "queue-cap = 4\nhttp-listen = \"off\"\n").expect("write");
    let out = bin()
        .args([
            "serve",
            "--check-config",
            "--config",
            good.to_str().expect("p"),
        ])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "configuration ok\n");
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "http-listen = \"nowhere\"\n").expect("write");
    let out = bin()
        .args([
            "serve",
            "--check-config",
            "--config",
            bad.to_str().expect("p"),
        ])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--http-listen nowhere"));
    let out = bin()
        .args(["serve", "--check-config", "--http-listen", "0.0.0.0:1"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("needs --auth-token"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// SIGHUP re-reads the config file: a new queue cap and token apply to what comes next, a
/// setting needing a restart is named in a WARN, a broken file is refused and the settings in
/// force stay.
#[test]
fn sighup_applies_a_new_queue_cap_and_token_and_refuses_a_broken_file() {
    let dir = temp_dir("reload");
    let cfg = dir.join("turnstile.toml");
    std::fs::write(&cfg, "queue-cap = 1\nauth-token = \"a\"\n").expect("write");
    let gw = Gw::start(
        &[
            "--config",
            cfg.to_str().expect("path"),
            "--echo-delay-ms",
            "60000",
        ],
        &[("RUST_LOG", "info")],
    );
    let hello = |c: &mut Client, token: &str| {
        c.send(&json!({"op": "hello", "platform": "telegram", "token": token}));
    };
    let mut c = gw.client();
    hello(&mut c, "a");
    for id in ["m1", "m2"] {
        c.send(&msg(id, "telegram", "1", "x"));
        assert_eq!(c.ack(id)["op"], "ack", "{id}");
    }
    c.send(&msg("m3", "telegram", "1", "x"));
    assert_eq!(c.ack("m3")["reason"], "queue_full");

    std::fs::write(
        &cfg,
        "queue-cap = 3\nauth-token = \"b\"\nturn-workers = 4\n",
    )
    .expect("write");
    gw.signal(libc::SIGHUP);
    let warn = gw.log_line(&["reload:", "needs a restart"]);
    assert!(
        warn.contains("WARN") && warn.contains("turn-workers"),
        "{warn}"
    );
    let applied = gw.log_line(&["reload: applied"]);
    assert!(
        applied.contains("queue-cap=3") && applied.contains("auth-token=set"),
        "{applied}"
    );
    assert!(
        !applied.contains("\"b\""),
        "the token is never logged: {applied}"
    );
    c.send(&msg("m4", "telegram", "1", "x"));
    assert_eq!(
        c.ack("m4")["op"],
        "ack",
        "the new cap applies to the next message"
    );
    // The new token for new connections (and the HTTP endpoint); the old one no more.
    let mut old = gw.client();
    hello(&mut old, "a");
    assert_eq!(old.recv()["detail"], "unauthorized");
    let mut new = gw.client();
    hello(&mut new, "b");
    new.send(&msg("n1", "telegram", "2", "x"));
    assert_eq!(new.ack("n1")["op"], "ack");
    assert_eq!(gw.get("/status", Some("b")).status, 200);
    assert_eq!(gw.get("/status", Some("a")).status, 401);

    std::fs::write(&cfg, "queue-cap = \"lots\"\n").expect("write");
    gw.signal(libc::SIGHUP);
    let refused = gw.log_line(&["reload refused"]);
    assert!(
        refused.contains("ERROR") && refused.contains("queue-cap"),
        "{refused}"
    );
    // Still 3: m2 and m4 wait, m5 is the third, m6 one too many.
    c.send(&msg("m5", "telegram", "1", "x"));
    assert_eq!(c.ack("m5")["op"], "ack");
    c.send(&msg("m6", "telegram", "1", "x"));
    assert_eq!(c.ack("m6")["reason"], "queue_full");
    let _ = std::fs::remove_dir_all(&dir);
}

/// With `--data-dir` and the HTTP endpoint both on, the journal thread's wake-ups reach the
/// bridge server on the journal's own poll token (once they shared one with the HTTP
/// listener and were taken as accepts; acks came through only because every wake also
/// drained the journal).
#[test]
fn journal_wakes_reach_the_server_on_their_own_token_with_http_on() {
    let dir = temp_dir("journal-token");
    let data = dir.join("data");
    let gw = Gw::start(&["--data-dir", data.to_str().expect("path")], &[]);
    let mut c = gw.client();
    c.send(&json!({"op": "hello", "platform": "tg", "acks": true}));
    for i in 0..3 {
        c.send(&msg(&format!("m{i}"), "tg", "1", "hi"));
        let ack = c.recv_until(|v| v["op"] == "ack");
        assert_eq!(ack["id"], format!("m{i}"), "{ack}");
    }
    let s = gw.wait_status("journal wakes", |s| {
        s["frontend"]["journal"]["wakes"].as_u64().unwrap_or(0) > 0
    });
    assert!(
        s["frontend"]["journal"]["batches"].as_u64().unwrap_or(0) > 0,
        "{s}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// With `--log-format json` every line is one JSON object: the shutdown report's figures are
/// fields (not a Rust `Debug` dump), and a fatal start-up error is an ERROR record too.
#[test]
fn json_logs_carry_the_shutdown_report_as_fields_and_start_up_errors_as_records() {
    let gw = Gw::start(&["--log-format", "json"], &[("RUST_LOG", "info")]);
    gw.signal(libc::SIGTERM);
    let (status, log) = gw.wait();
    assert_eq!(status.code(), Some(0), "{log}");
    let done: Value = log
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .find(|v| {
            v["msg"]
                .as_str()
                .unwrap_or("")
                .starts_with("shutdown complete")
        })
        .unwrap_or_else(|| panic!("no shutdown line: {log}"));
    assert_eq!(done["clean"], "true", "{done}");
    assert_eq!(done["turns_abandoned"], 0, "{done}");
    assert!(
        !done["msg"]
            .as_str()
            .unwrap_or("")
            .contains("ShutdownReport {"),
        "{done}"
    );

    let out = bin()
        .args(["--log-format", "json", "serve", "--queue-cap", "0"])
        .output()
        .expect("run serve");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    let line: Value =
        serde_json::from_str(err.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {err}"));
    assert_eq!(line["level"], "ERROR", "{line}");
    assert!(
        line["msg"].as_str().unwrap_or("").contains("--queue-cap"),
        "{line}"
    );
}

/// The running build is visible: `--version` names the revision, `/status` carries the
/// version, `/metrics` a `turnstile_build_info` sample, and the first log line says it.
#[test]
fn the_build_is_visible_in_version_status_metrics_and_the_log() {
    let out = bin().arg("--version").output().expect("--version");
    let version = String::from_utf8_lossy(&out.stdout);
    assert!(
        version.starts_with(&format!(
            "turnstile {} (revision ",
            env!("CARGO_PKG_VERSION")
        )),
        "{version}"
    );
    let gw = Gw::start(&[], &[("RUST_LOG", "info")]);
    let first = gw.log_line(&["turnstile"]);
    assert!(first.contains("starting"), "the first log line: {first}");
    assert!(first.contains(env!("CARGO_PKG_VERSION")), "{first}");
    let s = gw.status();
    assert_eq!(s["version"], env!("CARGO_PKG_VERSION"), "{s}");
    assert!(s["revision"].as_str().is_some_and(|r| !r.is_empty()), "{s}");
    let m = gw.metrics();
    let info = m
        .iter()
        .find(|(k, _)| k.starts_with("turnstile_build_info{"))
        .unwrap_or_else(|| panic!("no build info: {m:?}"));
    assert_eq!(*info.1, 1.0);
    assert!(
        info.0
            .contains(&format!("version=\"{}\"", env!("CARGO_PKG_VERSION"))),
        "{}",
        info.0
    );
}

/// Opens a connection that sends nothing (an idle client holding a slot).
fn idle_conn(addr: &str) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect idle");
    s.set_read_timeout(Some(WAIT)).expect("timeout");
    s
}

/// 64+ idle connections held open (more opened between probes): `/healthz` still answers
/// 200, with and without `--auth-token` (the oldest idle connections make room).
#[test]
fn healthz_answers_while_idle_connections_fill_every_slot() {
    for token in [None, Some("s3cret-token")] {
        let mut args = vec![];
        if let Some(t) = token {
            args.extend(["--auth-token", t]);
        }
        let gw = Gw::start(&args, &[]);
        let mut held: Vec<TcpStream> = (0..70).map(|_| idle_conn(gw.serve.http())).collect();
        for i in 0..20 {
            held.push(idle_conn(gw.serve.http()));
            let h = gw.get("/healthz", None);
            assert_eq!((h.status, h.body.as_str()), (200, "ok\n"), "probe {i}");
        }
        if let Some(t) = token {
            assert_eq!(gw.get("/status", Some(t)).status, 200);
        }
        let s = gw.wait_status_auth(token, "evictions counted", |s| {
            s["frontend"]["http"]["evicted"].as_u64() >= Some(20)
        });
        let h = &s["frontend"]["http"];
        assert_eq!(h["refused"], json!(0), "{h}");
        assert_eq!(h["max_per_peer"], json!(16), "{h}");
        assert_eq!(h["head_timeout_s"], json!(2.0), "{h}");
        drop(held);
    }
}

/// 10,000 wrong-token requests give a bounded number of log lines, the rest counted as
/// suppressed: every request is accounted for in the lines.
#[test]
fn a_wrong_token_flood_is_logged_at_a_rate_limit() {
    let gw = Gw::start(&["--auth-token", "right-token"], &[("RUST_LOG", "info")]);
    const CONNS: usize = 100;
    const PER_CONN: usize = 100;
    let req = "GET /metrics HTTP/1.1\r\nAuthorization: Bearer wrong\r\n\r\n".repeat(PER_CONN);
    std::thread::scope(|scope| {
        for _ in 0..4 {
            let (req, addr) = (&req, gw.serve.http());
            scope.spawn(move || {
                for _ in 0..CONNS / 4 {
                    let mut s = TcpStream::connect(addr).expect("connect");
                    s.set_read_timeout(Some(WAIT)).expect("timeout");
                    s.write_all(req.as_bytes()).expect("write");
                    let mut out = Vec::new();
                    s.read_to_end(&mut out).expect("read");
                    let n = String::from_utf8_lossy(&out)
                        .matches("HTTP/1.1 401")
                        .count();
                    assert_eq!(n, PER_CONN);
                }
            });
        }
    });
    let total = (CONNS * PER_CONN) as u64;
    let (mut lines, mut counted) = (0u64, 0u64);
    let number = |line: &str, after: &str| -> u64 {
        line.split(after).nth(1).map_or(0, |rest| {
            rest.trim_start_matches(['(', ' '])
                .split(' ')
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or(0)
        })
    };
    while counted < total {
        let line = gw.log_line(&["unauthorized request"]);
        if line.contains("unauthorized request for") {
            lines += 1;
            counted += 1;
            if let Some(i) = line.find(" (") {
                counted += number(&line[i..], " (");
            }
        } else {
            // "http: N more unauthorized requests suppressed"
            counted += number(&line, "http: ");
            lines += 1;
        }
    }
    assert_eq!(counted, total);
    assert!(lines <= 200, "{lines} lines for {total} wrong tokens");
}

/// A peer at its cap: a new connection evicts that peer's oldest idle one (closed without
/// an answer); the others stay.
#[test]
fn a_peer_over_its_cap_loses_its_oldest_idle_connection() {
    let gw = Gw::start(
        &[
            "--http-max-per-peer",
            "2",
            "--http-head-timeout",
            "60",
            "--http-idle-timeout",
            "60",
        ],
        &[],
    );
    let mut a = idle_conn(gw.serve.http());
    let mut b = idle_conn(gw.serve.http());
    // The third: a is closed (the oldest), then this one is served.
    let h = gw.get("/healthz", None);
    assert_eq!(h.status, 200);
    let mut buf = Vec::new();
    assert_eq!(a.read_to_end(&mut buf).expect("evicted"), 0);
    // b is still open and served.
    b.write_all(b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n")
        .expect("write");
    b.read_to_end(&mut buf).expect("read");
    assert_eq!(parse_response(&buf).0.status, 200);
    let s = gw.wait_status("the eviction", |s| {
        s["frontend"]["http"]["evicted"].as_u64() >= Some(1)
    });
    assert_eq!(s["frontend"]["http"]["max_per_peer"], json!(2));
}

/// A first request head not complete within `--http-head-timeout` closes the connection
/// (the idle timeout is far longer).
#[test]
fn a_first_head_not_sent_in_time_is_closed() {
    let gw = Gw::start(
        &["--http-head-timeout", "0.3", "--http-idle-timeout", "60"],
        &[],
    );
    let mut s = idle_conn(gw.serve.http());
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        .expect("write");
    let mut buf = Vec::new();
    assert_eq!(s.read_to_end(&mut buf).expect("closed"), 0);
    let st = gw.wait_status("the head timeout", |s| {
        s["frontend"]["http"]["head_timeouts"].as_u64() >= Some(1)
    });
    assert_eq!(st["frontend"]["http"]["head_timeout_s"], json!(0.3));
    assert_eq!(st["frontend"]["http"]["idle_closed"], json!(0));
}

/// `/metrics` and `/status` are rendered once per status snapshot: hundreds of pipelined
/// requests cost at most two renders per tick.
#[test]
fn metrics_and_status_are_rendered_once_per_snapshot() {
    let gw = Gw::start(&[], &[]);
    let pair = "GET /metrics HTTP/1.1\r\n\r\nGET /status HTTP/1.1\r\n\r\n".repeat(50);
    let mut bodies = std::collections::BTreeSet::new();
    for _ in 0..4 {
        let mut s = idle_conn(gw.serve.http());
        s.write_all(pair.as_bytes()).expect("write");
        let mut out = Vec::new();
        s.read_to_end(&mut out).expect("read");
        let mut at = 0;
        while at < out.len() {
            let (r, n) = parse_response(&out[at..]);
            assert_eq!(r.status, 200);
            bodies.insert(r.body);
            at += n;
        }
    }
    let s = gw.wait_status("the 400 requests counted", |s| {
        s["frontend"]["http"]["requests"].as_u64() >= Some(400)
    });
    let renders = s["frontend"]["http"]["renders"].as_u64().expect("renders");
    let ticks = s["ticks"].as_u64().expect("ticks");
    assert!(
        renders <= 2 * ticks + 2,
        "{renders} renders in {ticks} ticks"
    );
    assert!(bodies.len() as u64 <= renders, "{} bodies", bodies.len());
}

/// The supervised bridges' series (only with `[[bridge]]` tables).
const SUPERVISED_SERIES: [&str; 3] = [
    "turnstile_bridge_up",
    "turnstile_bridge_restarts_total",
    "turnstile_bridge_state",
];

/// Every series `contrib/alerts.yml` and `contrib/grafana-dashboard.json` name exists in a
/// scrape of a running gateway (with `--data-dir`, so the journal's too), with the label
/// values they select: a renamed metric breaks this test, not an operator's pager.
#[test]
fn the_dashboard_and_the_alerts_name_only_series_the_gateway_exports() {
    let dir = temp_dir("contrib-series");
    // The platform pairs strangers, so the access policy's series have samples.
    let config = dir.join("access.toml");
    std::fs::write(&config, "[access.tg]\nmode = \"pairing\"\n").expect("config");
    let gw = Gw::start(
        &[
            "--data-dir",
            dir.join("data").to_str().expect("path"),
            "--config",
            config.to_str().expect("path"),
        ],
        &[],
    );
    // A platform with an outbox, and a message through the journal.
    let mut c = gw.client();
    c.send(&json!({"op": "hello", "platform": "tg", "acks": true}));
    c.send(&msg("m1", "tg", "1", "hi"));
    assert_eq!(c.outcome("m1")["op"], "reply");
    let mut stranger = msg("m2", "tg", "2", "let me in");
    stranger["user_id"] = json!("stranger");
    c.send(&stranger);
    assert_eq!(c.outcome("m2")["notice"], "pairing");
    gw.wait_status("the platform and the pairing notice in the status", |s| {
        s["frontend"]["outboxes"]["tg"].is_object()
            && s["frontend"]["access"]["refused"]["tg:pairing"] == 1
    });
    let scraped = gw.metrics();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("contrib");
    let mut checked = 0;
    for file in ["alerts.yml", "grafana-dashboard.json"] {
        let text = std::fs::read_to_string(root.join(file)).expect("contrib file");
        let mut rest = text.as_str();
        while let Some(at) = rest.find("turnstile_") {
            let tail = &rest[at..];
            let end = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(tail.len());
            let name = &tail[..end];
            if name.starts_with("turnstile_tls_") || SUPERVISED_SERIES.contains(&name) {
                // Exported only with TLS on (tests/tls.rs finds it in a TLS gateway's
                // scrape), or with `[[bridge]]` tables (tests/serve_bridges.rs).
                rest = &tail[end..];
                continue;
            }
            // `{k="v",…}` right after the name: the label values it selects.
            let selector: Vec<(String, String)> = tail[end..]
                .strip_prefix('{')
                .and_then(|s| s.split_once('}'))
                .map(|(inner, _)| {
                    inner
                        .split(',')
                        .filter_map(|kv| kv.split_once('='))
                        .map(|(k, v)| {
                            (
                                k.trim().to_owned(),
                                v.trim().trim_matches(|c| c == '"' || c == '\\').to_owned(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| {
                    name.strip_suffix(s).filter(|f| {
                        scraped
                            .keys()
                            .any(|k| k.starts_with(&format!("{f}_bucket")))
                    })
                })
                .unwrap_or(name);
            let found = scraped.keys().any(|k| {
                let (n, labels) = k.split_once('{').unwrap_or((k.as_str(), ""));
                (n == name || (family != name && n.starts_with(family)))
                    && selector
                        .iter()
                        .all(|(lk, lv)| labels.contains(&format!("{lk}=\"{lv}\"")))
            });
            assert!(
                found,
                "{file} names {name}{selector:?}, which the gateway does not export"
            );
            checked += 1;
            rest = &tail[end..];
        }
    }
    assert!(
        checked >= 20,
        "only {checked} series found in the contrib files"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
