//! A real Redis for the cluster tests: Debian's `redis-server`, started by the test on a free
//! local port in a directory of its own (`--appendonly yes --appendfsync always --save ''`),
//! killed when the handle drops (and by the kernel if the test process dies first).
//!
//! Without redis-server installed a test says so and passes, except under `.ci/run`, which
//! sets `TURNSTILE_REQUIRE_REAL_SERVERS=1`: there a missing server fails it.
//!
//! Nothing polls for readiness: the server's own log line `Ready to accept connections`,
//! read from its stdout, says when it listens.
//!
//! A test target that has `mod redis_support;` has `mod common;` too (its waits).

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

pub use crate::common::gateway::Serve;
use crate::common::gateway::die_with_parent;
use crate::common::{eventually, holds};

/// Only a failing run waits this long.
pub const WAIT: Duration = Duration::from_secs(60);

fn redis_server_path() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/sbin")])
        .map(|d| d.join("redis-server"))
        .find(|p| p.is_file())
}

/// redis-server, or `None` (after saying why) when the test may skip.
pub fn require_redis() -> Option<PathBuf> {
    match redis_server_path() {
        Some(p) => Some(p),
        None if std::env::var("TURNSTILE_REQUIRE_REAL_SERVERS").as_deref() == Ok("1") => {
            panic!(
                "redis-server is not installed but TURNSTILE_REQUIRE_REAL_SERVERS=1 (.ci/run installs it: apt-get install -y redis-server)"
            )
        }
        None => {
            // Straight to stderr, past the test harness's capture, so the skip is seen.
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED: redis-server is not installed (apt-get install -y redis-server); this cluster test needs a real Redis"
            );
            None
        }
    }
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// One redis-server process; its data directory outlives a [`Redis::kill`] so that
/// [`Redis::restart`] finds the append-only file again.
pub struct Redis {
    bin: PathBuf,
    dir: tempfile::TempDir,
    port: u16,
    fsync: &'static str,
    /// More redis-server arguments (`--requirepass …`).
    extra: Vec<String>,
    child: Option<Child>,
}

impl Redis {
    /// A Redis that syncs every write before answering (what `--cluster` requires).
    pub fn start(bin: &Path) -> Redis {
        Redis::start_with(bin, "always")
    }

    /// A Redis with `appendfsync` set to `fsync` (`always`, `everysec`, `no`).
    pub fn start_with(bin: &Path, fsync: &'static str) -> Redis {
        Redis::start_args(bin, fsync, &[])
    }

    /// As [`Redis::start_with`], with `extra` redis-server arguments.
    pub fn start_args(bin: &Path, fsync: &'static str, extra: &[&str]) -> Redis {
        let mut r = Redis {
            bin: bin.to_path_buf(),
            dir: tempfile::tempdir().expect("tempdir"),
            port: free_port(),
            fsync,
            extra: extra.iter().map(|a| (*a).to_owned()).collect(),
            child: None,
        };
        r.spawn();
        r
    }

    fn spawn(&mut self) {
        assert!(self.child.is_none());
        let mut child = die_with_parent(
            Command::new(&self.bin)
                .args(["--port", &self.port.to_string()])
                .args(["--bind", "127.0.0.1"])
                .arg("--dir")
                .arg(self.dir.path())
                .args(["--appendonly", "yes", "--appendfsync", self.fsync])
                .args(["--save", ""])
                .args(["--logfile", ""])
                .args(["--daemonize", "no"])
                .args(&self.extra)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::null()),
        )
        .spawn()
        .expect("start redis-server");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = crossbeam_channel::bounded(1);
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            let mut log = Vec::new();
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if line.contains("Ready to accept connections") {
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(Ok(()));
                    }
                } else if tx.is_some() {
                    log.push(line);
                }
            }
            // The log is drained to the end so the server never blocks on a full pipe.
            if let Some(tx) = tx {
                let _ = tx.send(Err(log.join("\n")));
            }
        });
        match rx.recv_timeout(WAIT) {
            Ok(Ok(())) => {}
            Ok(Err(log)) => panic!("redis-server exited before it was ready:\n{log}"),
            Err(_) => panic!("redis-server was not ready within {WAIT:?}"),
        }
        self.child = Some(child);
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Sends `sig` to the server (SIGSTOP, SIGCONT).
    pub fn signal(&self, sig: libc::c_int) {
        let child = self.child.as_ref().expect("running");
        let pid = libc::pid_t::try_from(child.id()).expect("pid");
        // SAFETY: kill(2) on our own child's pid.
        assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill({pid}, {sig})");
    }

    /// kill -9: what Redis acknowledged is in its append-only file (`appendfsync always`).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port and directory.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// A plain client connection for looking at the keys.
    pub fn client(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .expect("client")
            .get_connection_with_timeout(WAIT)
            .expect("connect")
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A `turnstile serve --cluster` instance: a [`Serve`] started by the commands below.
pub type ClusterServe = Serve;

impl Serve {
    /// `turnstile serve` on 127.0.0.1:0 (no HTTP endpoint) in `redis`'s cluster as
    /// `instance`, with `partitions` and a lease of `lease_ms`: the caller adds the agent,
    /// the logging and the rest.
    pub fn command(redis: &Redis, instance: &str, partitions: u32, lease_ms: u64) -> Command {
        ClusterServe::command_at(&redis.url(), "off", instance, partitions, lease_ms)
    }

    /// As [`ClusterServe::command`], in the cluster at `url` (a replica's, one with a
    /// password), its HTTP endpoint on `http` (`off`, or `127.0.0.1:0` for one that
    /// [`Serve::http`] names).
    pub fn command_at(
        url: &str,
        http: &str,
        instance: &str,
        partitions: u32,
        lease_ms: u64,
    ) -> Command {
        let mut command = Serve::local_command(http);
        command
            .args(["--cluster", url, "--instance-id", instance])
            .args(["--partitions", &partitions.to_string()])
            .args(["--lease-ms", &lease_ms.to_string()]);
        command
    }
}

/// A bridge's connection to an instance, `acks` on (platform `tg`).
pub struct BridgeClient {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl BridgeClient {
    /// Connects to `addr` and says hello; reads wait at most [`WAIT`].
    pub fn connect(addr: &str) -> BridgeClient {
        let stream = TcpStream::connect(addr).expect("connect");
        stream.set_read_timeout(Some(WAIT)).expect("timeout");
        let mut c = BridgeClient {
            reader: BufReader::new(stream.try_clone().expect("clone")),
            writer: stream,
        };
        c.send(&json!({"op": "hello", "platform": "tg", "acks": true}));
        c
    }

    /// A second handle on the connection's write side.
    pub fn writer(&self) -> TcpStream {
        self.writer.try_clone().expect("clone")
    }

    pub fn send(&mut self, v: &Value) {
        self.writer
            .write_all((v.to_string() + "\n").as_bytes())
            .expect("write");
    }

    /// Sends message `id` (its text is its id) in chat `chat`.
    pub fn message(&mut self, id: &str, chat: &str) {
        self.send(&json!({"op": "message", "id": id, "chat_id": chat, "text": id}));
    }

    /// The next line that is not a typing indicator or a partial; `None` at the end (or
    /// past the read timeout).
    pub fn next_line(&mut self) -> Option<Value> {
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

    #[track_caller]
    pub fn next(&mut self) -> Value {
        self.next_line().expect("connection closed")
    }

    /// Confirms a terminal event (an `acks` bridge).
    pub fn delivered(&mut self, v: &Value) {
        let id = v["id"].as_str().expect("id").to_owned();
        self.send(&json!({"op": "delivered", "ids": [id]}));
    }
}

/// Whether `v` is a message's terminal event.
pub fn terminal(v: &Value) -> bool {
    matches!(
        v["op"].as_str(),
        Some("reply" | "failed" | "cancelled" | "merged")
    )
}

/// Each partition's lease now (`<instance>:<epoch>`, or none).
pub fn leases(redis: &Redis, partitions: u32) -> Vec<Option<String>> {
    let mut c = redis.client();
    (0..partitions)
        .map(|p| {
            redis::cmd("GET")
                .arg(format!("ts:{{p{p}}}:lease"))
                .query::<Option<String>>(&mut c)
                .expect("GET")
        })
        .collect()
}

/// How many messages Redis holds in flight (accepted, not yet confirmed `delivered`) in
/// `partitions`.
pub fn messages_in_flight(redis: &Redis, partitions: u32) -> u64 {
    let mut c = redis.client();
    (0..partitions)
        .map(|p| {
            redis::cmd("ZCARD")
                .arg(format!("ts:{{p{p}}}:q"))
                .query::<u64>(&mut c)
                .expect("ZCARD")
        })
        .sum()
}

/// Waits (bounded) until Redis holds no message in flight in `partitions`: every outcome
/// confirmed `delivered` reached it (on the instances' clocks, so Redis is polled).
#[track_caller]
pub fn until_nothing_in_flight(redis: &Redis, partitions: u32) {
    eventually("no message in flight in Redis", WAIT, || {
        holds(messages_in_flight(redis, partitions), |n| *n == 0)
    });
}

/// Whether `instance` holds every one of `leases` (tokens `<instance>:<epoch>`).
pub fn all_held_by(leases: &[Option<String>], instance: &str) -> bool {
    all_held_by_any(leases, &[instance])
}

/// Whether one of `instances` holds each of `leases` (tokens `<instance>:<epoch>`).
pub fn all_held_by_any(leases: &[Option<String>], instances: &[&str]) -> bool {
    leases.iter().all(|h| {
        h.as_deref()
            .and_then(|h| h.rsplit_once(':'))
            .is_some_and(|(holder, _)| instances.contains(&holder))
    })
}

/// Waits (bounded) until one of `instances` holds each of the `partitions` leases; how long
/// that took. A lease changes hands on Redis's clock, not on an event a test can wait on, so
/// Redis is polled.
#[track_caller]
pub fn until_all_held_by(redis: &Redis, partitions: u32, instances: &[&str]) -> Duration {
    let t0 = Instant::now();
    eventually(&format!("{instances:?} hold every partition"), WAIT, || {
        holds(leases(redis, partitions), |l| all_held_by_any(l, instances))
    });
    t0.elapsed()
}
