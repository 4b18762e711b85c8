//! `turnstile serve --cluster` as a process: the flags' contract (exclusive with
//! `--data-dir`, the cluster flags need `--cluster`, values checked) and the start-up checks
//! against a real redis-server (tests/redis_support): a Redis that would ack before fsync is
//! refused (exit 2) unless `--cluster-allow-lazy-fsync`, an unreachable one is exit 1; a
//! second process with a live instance's `--instance-id` is refused (exit 2), while a process
//! restarted after a crash takes its id back.

mod common;
mod redis_support;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};

use redis_support::{Redis, free_port, require_redis};

fn serve(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .arg("serve")
        .args(["--listen", "127.0.0.1:0", "--http-listen", "off"])
        .args(args)
        .env_remove("TURNSTILE_AUTH_TOKEN")
        .output()
        .expect("run turnstile")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn cluster_and_data_dir_are_exclusive_and_exit_2_naming_both() {
    let dir = tempfile::tempdir().expect("tempdir");
    let o = serve(&[
        "--cluster",
        "redis://127.0.0.1:1",
        "--data-dir",
        dir.path().to_str().expect("utf-8"),
        "--check-config",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("--cluster") && e.contains("--data-dir"), "{e}");
    assert!(e.contains("exclusive"), "{e}");
}

#[test]
fn the_cluster_flags_need_cluster_and_are_checked() {
    for (args, needle) in [
        (&["--instance-id", "a"][..], "--instance-id needs --cluster"),
        (&["--partitions", "8"][..], "--partitions needs --cluster"),
        (&["--lease-ms", "500"][..], "--lease-ms needs --cluster"),
        (
            &["--cluster-allow-lazy-fsync"][..],
            "--cluster-allow-lazy-fsync needs --cluster",
        ),
        (
            &["--cluster-rebalance"][..],
            "--cluster-rebalance needs --cluster",
        ),
        (
            &["--cluster", "http://x", "--check-config"][..],
            "not a Redis URL",
        ),
        (
            &["--cluster", "redis://127.0.0.1:1", "--partitions", "0"][..],
            "--partitions 0: must be from 1 to 16384",
        ),
        (
            &["--cluster", "redis://127.0.0.1:1", "--lease-ms", "10"][..],
            "--lease-ms 10: must be from 100",
        ),
        (
            &["--cluster", "redis://127.0.0.1:1", "--instance-id", " "][..],
            "--instance-id",
        ),
        (
            &["--cluster-drain-ms", "5000"][..],
            "--cluster-drain-ms needs --cluster",
        ),
        (
            &["--cluster-min-replicas", "1"][..],
            "--cluster-min-replicas needs --cluster",
        ),
        (
            &[
                "--cluster",
                "redis://127.0.0.1:1",
                "--cluster-min-replicas",
                "17",
            ][..],
            "--cluster-min-replicas 17: must be from 0 to 16",
        ),
        (
            &[
                "--cluster",
                "redis://127.0.0.1:1",
                "--cluster-rebalance",
                "false",
                "--cluster-drain-ms",
                "5000",
            ][..],
            "--cluster-drain-ms needs rebalancing",
        ),
        (
            &[
                "--cluster",
                "redis://127.0.0.1:1",
                "--cluster-rebalance",
                "maybe",
            ][..],
            "--cluster-rebalance",
        ),
        (
            &[
                "--cluster",
                "redis://127.0.0.1:1",
                "--cluster-rebalance",
                "--cluster-drain-ms",
                "99",
            ][..],
            "--cluster-drain-ms 99: must be from 100 to 3600000",
        ),
        (
            &["--max-clock-skew-ms", "100"][..],
            "--max-clock-skew-ms needs --cluster",
        ),
        // The fence (the lease less the skew) must come after the second renewal (2/3).
        (
            &[
                "--cluster",
                "redis://127.0.0.1:1",
                "--lease-ms",
                "900",
                "--max-clock-skew-ms",
                "300",
            ][..],
            "--max-clock-skew-ms 300: leaves no room in --lease-ms 900",
        ),
    ] {
        let o = serve(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(needle), "{args:?}: {}", stderr(&o));
    }
}

#[test]
fn an_unreachable_redis_is_worth_a_restart_exit_1() {
    let port = free_port().to_string();
    let url = format!("redis://127.0.0.1:{port}");
    let o = serve(&["--cluster", &url, "--check-config"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains(&url), "{}", stderr(&o));
    // A password in the URL never reaches the log, whatever fails.
    for url in [
        format!("redis://:hunter2@127.0.0.1:{port}"),
        "http://:hunter2@x".to_owned(),
    ] {
        let o = serve(&["--cluster", &url, "--check-config"]);
        assert_ne!(o.status.code(), Some(0));
        assert!(!stderr(&o).contains("hunter2"), "{}", stderr(&o));
        assert!(!String::from_utf8_lossy(&o.stdout).contains("hunter2"));
    }
    let o = serve(&[
        "--cluster",
        &format!("redis://:hunter2@127.0.0.1:{port}"),
        "--check-config",
    ]);
    assert!(
        stderr(&o).contains(&format!("redis://***@127.0.0.1:{port}")),
        "{}",
        stderr(&o)
    );
}

#[test]
fn a_redis_that_acks_before_fsync_is_refused_unless_allowed() {
    let Some(bin) = require_redis() else { return };
    let lazy = Redis::start_with(&bin, "everysec");
    let url = lazy.url();
    let o = serve(&["--cluster", &url, "--check-config"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("appendfsync everysec"), "{e}");
    assert!(e.contains("--cluster-allow-lazy-fsync"), "{e}");
    let o = serve(&[
        "--cluster",
        &url,
        "--cluster-allow-lazy-fsync",
        "--check-config",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("a Redis crash can lose acknowledged messages"),
        "{}",
        stderr(&o)
    );

    let safe = Redis::start(&bin);
    let o = serve(&[
        "--cluster",
        &safe.url(),
        "--partitions",
        "8",
        "--check-config",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // The partition count is the first instance's: another is refused, exit 2.
    let o = serve(&[
        "--cluster",
        &safe.url(),
        "--partitions",
        "16",
        "--check-config",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("has 8 partitions"), "{}", stderr(&o));
}

/// A `serve --cluster` process, running once its `listening on` line came.
struct Running(Child);

impl Running {
    fn start(url: &str, id: &str) -> Running {
        let (running, first) = Running::spawn(url, id);
        assert!(first.starts_with("listening on "), "got {first:?}");
        running
    }

    /// The process and its first line on stdout (empty if it exited without one).
    fn spawn(url: &str, id: &str) -> (Running, String) {
        // A lease long enough that a loaded machine's first renewal of the claim (made at
        // start-up, renewed by the member thread's heartbeats) comes within it: at 500 ms a
        // full suite's load let the first's claim expire before its first heartbeat, and
        // the twin took the id.
        Running::spawn_with(&["--cluster", url, "--instance-id", id, "--lease-ms", "2000"])
    }

    /// `serve` with `args`, and its first line on stdout.
    fn spawn_with(args: &[&str]) -> (Running, String) {
        let mut child = Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .arg("serve")
            .args(["--listen", "127.0.0.1:0", "--http-listen", "off"])
            .args(args)
            .env_remove("TURNSTILE_AUTH_TOKEN")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start turnstile serve");
        let mut first = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut first)
            .expect("first line");
        (Running(child), first)
    }

    /// Its stderr, once killed.
    fn killed(self) -> String {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.0.id() as libc::pid_t, libc::SIGKILL) };
        self.exited().1
    }

    /// Its exit code and stderr, once it exited.
    fn exited(mut self) -> (Option<i32>, String) {
        let mut e = String::new();
        if let Some(mut err) = self.0.stderr.take() {
            std::io::Read::read_to_string(&mut err, &mut e).expect("stderr");
        }
        let status = self.0.wait().expect("wait");
        (status.code(), e)
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_second_process_with_a_live_instance_id_is_refused_exit_2_naming_both() {
    let Some(bin) = require_redis() else { return };
    let redis = Redis::start(&bin);
    let first = Running::start(&redis.url(), "gw-twin");
    // The twin waits out one lease (the holder might be a crashed process) and, the claim
    // renewed meanwhile, is refused: before, it started and acked messages never run.
    let (twin, line) = Running::spawn(&redis.url(), "gw-twin");
    assert_eq!(line, "", "the twin started");
    let (code, e) = twin.exited();
    assert_eq!(code, Some(2), "{e}");
    assert!(e.contains("--instance-id \"gw-twin\" is live"), "{e}");
    assert!(e.contains(&format!("pid {} on ", first.pid())), "{e}");
    // Another id joins beside it.
    let _other = Running::start(&redis.url(), "gw-other");
    // A crash (kill -9) leaves the claim to expire: the restarted process takes the id.
    drop(first);
    let _again = Running::start(&redis.url(), "gw-twin");
}

#[test]
fn a_refused_password_exits_2_and_a_password_on_the_command_line_is_warned_never_shown() {
    let Some(bin) = require_redis() else { return };
    let redis = Redis::start_args(&bin, "always", &["--requirepass", "s3cret"]);
    let at = format!("127.0.0.1:{}", redis.port());
    // A wrong password, or none where one is needed: the configuration's to fix, exit 2
    // (systemd does not restart it), the password never shown.
    for url in [format!("redis://:wr0ng@{at}"), format!("redis://{at}")] {
        let o = serve(&["--cluster", &url, "--check-config"]);
        assert_eq!(o.status.code(), Some(2), "{url}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("authentication refused"),
            "{}",
            stderr(&o)
        );
        assert!(!stderr(&o).contains("wr0ng"), "{}", stderr(&o));
    }
    // The right one on the command line: it serves, and says where the password belongs.
    let url = format!("redis://:s3cret@{at}");
    let (running, line) = Running::spawn_with(&["--cluster", &url]);
    assert!(line.starts_with("listening on "), "got {line:?}");
    let e = running.killed();
    assert!(
        e.contains("the Redis password was given in the --cluster URL"),
        "{e}"
    );
    assert!(e.contains(&format!("redis://***@{at}")), "{e}");
    assert!(!e.contains("s3cret"), "{e}");
    // In the config file: no warning.
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("serve.toml");
    std::fs::write(&config, format!("cluster = {url:?}\n")).expect("write config");
    let (running, line) = Running::spawn_with(&["--config", config.to_str().expect("utf-8")]);
    assert!(line.starts_with("listening on "), "got {line:?}");
    let e = running.killed();
    assert!(!e.contains("password was given"), "{e}");
    assert!(!e.contains("s3cret"), "{e}");
}
