//! `turnstile serve --cluster` as a process: the flags' contract (exclusive with
//! `--data-dir`, the cluster flags need `--cluster`, values checked) and the start-up checks
//! against a real redis-server (tests/redis_support): a Redis that would ack before fsync is
//! refused (exit 2) unless `--cluster-allow-lazy-fsync`, an unreachable one is exit 1.

mod redis_support;

use std::process::{Command, Output};

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
