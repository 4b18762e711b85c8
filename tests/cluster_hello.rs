//! The hello registry with the real binary (`serve --cluster`, docs/cluster.md "Where the
//! result goes"): three instances on one private redis-server, `b` owning every partition.
//! A bridge acked on `x` disconnects before its results come (the agent waits for a file
//! the test creates), reconnects to `y` with the same platform, and gets every result from
//! `y`, marked `redelivery`, each once; its `delivered` then removes them from Redis.
//!
//! Waits on a condition in Redis (a lease's holder, the registry's newest hello) poll it
//! with a deadline: those change on Redis, not on an event this test can wait on.

mod common;
mod redis_support;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use common::eventually;
use redis_support::{
    BridgeClient, ClusterServe, Redis, WAIT, require_redis, terminal, until_all_held_by,
    until_nothing_in_flight,
};
use serde_json::{Value, json};

const PARTITIONS: u32 = 4;

/// An instance with its status file.
struct Server {
    serve: ClusterServe,
    status_file: PathBuf,
}

impl Server {
    fn start(redis: &Redis, instance: &str, agent: &[String], dir: &Path) -> Server {
        let status_file = dir.join(format!("{instance}.status.json"));
        let serve = ClusterServe::spawn(
            ClusterServe::command(redis, instance, PARTITIONS, 3000)
                // The test names who owns what: no rebalancing (tests/cluster_rebalance has it).
                .args(["--cluster-rebalance", "false"])
                .arg("--status-file")
                .arg(&status_file)
                .args(agent)
                .env("RUST_LOG", "warn")
                .env_remove("TURNSTILE_AUTH_TOKEN")
                .stderr(Stdio::inherit()),
        );
        Server { serve, status_file }
    }

    /// The cluster's figures in the status snapshot now (`Null` before the first).
    fn cluster(&self) -> Value {
        std::fs::read_to_string(&self.status_file)
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            .map_or(Value::Null, |s| s["frontend"]["cluster"].clone())
    }
}

/// An exec agent that answers the turn's text once `gate` exists: the test holds every
/// turn until its bridge is gone.
fn gated_agent(gate: &Path) -> Vec<String> {
    vec![
        "--agent".into(),
        "exec".into(),
        "--agent-cmd".into(),
        format!(
            "while [ ! -e '{}' ]; do sleep 0.02; done; cat",
            gate.display()
        ),
    ]
}

fn get(redis: &Redis, key: &str) -> Option<String> {
    redis::cmd("GET")
        .arg(key)
        .query(&mut redis.client())
        .expect("GET")
}

/// Waits (bounded) until `f` holds on Redis.
fn until(what: &str, f: impl FnMut() -> bool) {
    eventually(what, WAIT, f);
}

#[test]
fn a_bridge_that_moved_from_x_to_y_before_its_results_came_gets_each_from_y_once_marked() {
    let Some(bin) = require_redis() else { return };
    let redis = Redis::start(&bin);
    let dir = tempfile::tempdir().expect("tempdir");
    let gate = dir.path().join("gate");
    let agent = gated_agent(&gate);
    let _b = Server::start(&redis, "b", &agent, dir.path());
    until_all_held_by(&redis, PARTITIONS, &["b"]);
    let x = Server::start(&redis, "x", &agent, dir.path());
    let y = Server::start(&redis, "y", &agent, dir.path());
    let n = 6;
    let mut on_x = BridgeClient::connect(&x.serve.addr);
    for i in 0..n {
        on_x.send(&json!({"op": "message", "id": format!("m{i}"), "chat_id": format!("{i}"), "text": format!("t{i}")}));
    }
    for _ in 0..n {
        let ack = on_x.next();
        assert_eq!(ack["op"], "ack", "{ack}");
    }
    until("x's hello is the newest", || {
        get(&redis, "ts:hello:tg").is_some_and(|v| v.starts_with("x "))
    });
    drop(on_x);
    let mut on_y = BridgeClient::connect(&y.serve.addr);
    until("y's hello is the newest", || {
        get(&redis, "ts:hello:tg").is_some_and(|v| v.starts_with("y "))
    });
    std::fs::write(&gate, b"").expect("open the gate");
    let mut got: HashMap<String, Vec<Value>> = HashMap::new();
    while got.len() < n {
        let v = on_y.next();
        assert!(terminal(&v), "{v}");
        let id = v["id"].as_str().expect("id").to_owned();
        assert_eq!(v["text"], format!("t{}", &id[1..]), "{v}");
        assert_eq!(
            v["redelivery"], true,
            "sent away from its origin: marked: {v}"
        );
        on_y.send(&json!({"op": "delivered", "ids": [id.clone()]}));
        got.entry(id).or_default().push(v);
    }
    // Confirmed on y: the messages leave Redis.
    until_nothing_in_flight(&redis, PARTITIONS);
    // Each once: a message sent after them is answered with nothing of theirs before it.
    on_y.send(&json!({"op": "message", "id": "last", "chat_id": "last", "text": "last"}));
    loop {
        let v = on_y.next();
        if v["op"] == "ack" {
            continue;
        }
        assert!(terminal(&v), "{v}");
        assert_eq!(v["id"], "last", "a result came twice: {v}");
        break;
    }
    assert!(got.values().all(|copies| copies.len() == 1), "{got:?}");
    // The status says so: x handed all six away and waits for no answer, y took them.
    until("x's status counts the forwards", || {
        let c = x.cluster();
        c["forwarded_out"] == n && c["forwards_waiting"] == 0
    });
    until("y's status counts the forwards", || {
        let c = y.cluster();
        c["forwarded_in"] == n && c["forwards_refused"] == 0 && c["forward_requests"] == 0
    });
}
