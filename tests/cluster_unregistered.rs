//! The seed-382 rule with the real binary and a real `redis-server` (tests/redis_support):
//! an instance whose heartbeat has never reached the registry, or whose registry entry has
//! lapsed since (seed 518), acks nothing `queued`, and nothing an instance acked is lost.
//!
//! Why the rule: an owner that reads a message from its inbox keeps the result for the
//! message's origin, which sends it from the outcome stream. Should the origin die, the
//! owner sends the result itself when it sees the origin leave the registry; an origin that
//! never entered it never leaves it, so a message it acked and then died with is never
//! answered (tests/simulation_cluster, seed 382). So the journal thread writes no accept
//! while the registry may not hold it live — before one of its heartbeats went through,
//! or once the last one no longer covers now (`Member::commit`, `registered_until`): refused
//! `storage`, as while Redis is out of reach, and the bridge sends it again elsewhere.
//!
//! The trigger is real, no mock: instance A logs in to Redis as an ACL user that may use
//! every key of the cluster but the registry's sorted set (`ts:instances`), so A's id claim,
//! leases, inboxes and accepts work while its heartbeat is refused `NOPERM`. B, the default
//! user, owns every partition. The bridge sends messages to A, A is killed (never
//! registered), the bridge says hello to B and sends again what was not acked; every
//! message is answered. The agent waits for a gate file the test creates only after A is
//! dead, so no result can reach the bridge through A: without the rule A acks the messages,
//! B runs them and keeps their results for A, and they are never answered.
//!
//! Waits are on lines from the gateways and on Redis (polled with a deadline for what only
//! Redis's clock moves: a lease, the registry); only a failing run reaches them.

mod common;
mod redis_support;

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, ErrorKind, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::eventually;
use redis_support::{ClusterServe, Redis, WAIT, require_redis, until_all_held_by};
use serde_json::{Value, json};

const PARTITIONS: u32 = 4;

/// `serve --cluster url` as `instance` (a password in the URL is WARNed of: the test's own);
/// its exec agent waits for `gate` to exist, then answers.
fn start(url: &str, instance: &str, gate: &Path) -> ClusterServe {
    // The agent's own wait for the test's gate file: it orders nothing in the test, which
    // waits for lines from the gateways.
    let agent = format!(
        "cat >/dev/null; while [ ! -e '{}' ]; do sleep 0.05; done; echo \"done $TURNSTILE_MESSAGE_ID\"",
        gate.display()
    );
    ClusterServe::spawn(
        ClusterServe::command_at(url, "off", instance, PARTITIONS, 2000)
            // Who owns what is this test's to say: no rebalancing.
            .args(["--cluster-rebalance", "false"])
            .args(["--agent", "exec", "--agent-cmd", &agent])
            .env("RUST_LOG", "warn")
            .env_remove("TURNSTILE_AUTH_TOKEN")
            .stderr(Stdio::inherit()),
    )
}

/// A bridge's connection to one instance, `acks` on.
struct Bridge {
    w: TcpStream,
    r: BufReader<TcpStream>,
}

impl Bridge {
    fn connect(addr: &str) -> Bridge {
        let s = TcpStream::connect(addr).expect("connect");
        // Short reads: each wait below has its own deadline.
        s.set_read_timeout(Some(Duration::from_millis(500)))
            .expect("timeout");
        let mut b = Bridge {
            w: s.try_clone().expect("clone"),
            r: BufReader::new(s),
        };
        b.send(json!({"op": "hello", "platform": "tg", "acks": true}));
        b
    }

    fn send(&mut self, v: Value) {
        self.w
            .write_all((v.to_string() + "\n").as_bytes())
            .expect("write");
    }

    fn message(&mut self, id: &str) {
        let chat = format!("c-{id}");
        self.send(json!({"op": "message", "id": id, "chat_id": chat, "text": id}));
    }

    /// The next line for a message (an ack, a refusal or a result; a result is confirmed),
    /// or `None` if none came within the read timeout.
    fn next(&mut self) -> Option<Value> {
        loop {
            let mut line = String::new();
            match self.r.read_line(&mut line) {
                Ok(0) => panic!("the gateway closed the connection"),
                Ok(_) => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return None;
                }
                Err(e) => panic!("read: {e}"),
            }
            let v: Value = serde_json::from_str(&line).expect("json line");
            if v["op"] == "reply" || v["op"] == "failed" {
                self.send(json!({"op": "delivered", "id": v["id"]}));
            }
            if v.get("id").is_some() {
                return Some(v);
            }
        }
    }
}

/// Whether `instance` is live in the registry now: its entry's score is its expiry (Redis's
/// clock, in ms since the epoch: this host's).
fn registered(redis: &Redis, instance: &str) -> bool {
    let score: Option<f64> = redis::cmd("ZSCORE")
        .arg("ts:instances")
        .arg(instance)
        .query(&mut redis.client())
        .expect("ZSCORE");
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as f64;
    score.is_some_and(|expiry| expiry > now_ms)
}

/// Waits (bounded) until `instance`'s registration is `live` or not: it changes on
/// Redis's clock (a heartbeat, an expiry), so Redis is polled.
fn until_registered(redis: &Redis, instance: &str, live: bool) {
    eventually(
        &format!("{instance} live={live} in the registry"),
        WAIT,
        || registered(redis, instance) == live,
    );
}

/// User `unlisted` (password `pw`): every key of the cluster but, unless `with_registry`,
/// the registry's sorted set — the partitions, the id claim (`{ts:instances}:id:…`), the
/// generation, the partition count, the hello registry, the forwards and the shared access
/// state. A change applies to its open connections at once.
fn set_unlisted_acl(redis: &Redis, with_registry: bool) {
    let mut rules = vec![
        "on",
        "resetkeys",
        ">pw",
        "+@all",
        "~ts:{p*",
        "~{ts:instances}:id:*",
        "~ts:generation",
        "~ts:partitions",
        "~ts:hello:*",
        "~ts:fwd:*",
        "~ts:{access}:*",
    ];
    if with_registry {
        rules.push("~ts:instances");
    }
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("unlisted")
        .arg(&rules[..])
        .query(&mut redis.client())
        .expect("ACL SETUSER");
}

#[test]
fn an_instance_never_registered_acks_nothing_and_nothing_acked_is_lost() {
    let Some(bin) = require_redis() else { return };
    let redis = Redis::start(&bin);
    let dir = tempfile::tempdir().expect("tempdir");
    let gate = dir.path().join("gate");
    set_unlisted_acl(&redis, false);
    let url_unlisted = redis.url().replace("redis://", "redis://unlisted:pw@");
    let b = start(&redis.url(), "b", &gate);
    until_all_held_by(&redis, PARTITIONS, &["b"]);
    let a = start(&url_unlisted, "a", &gate);
    refused_by_a_answered_by_b(&redis, a, &b, &gate, "never registered");
}

/// The rule extended (tests/simulation_cluster, seed 518; tests/cluster_serve's pause): A
/// registers, then its heartbeats are refused until its registry entry has expired; A then
/// acks nothing `queued` either (an owner may have seen it leave, or never seen it live),
/// and nothing it acked is lost once it is killed.
#[test]
fn an_instance_whose_registration_lapsed_acks_nothing_and_nothing_acked_is_lost() {
    let Some(bin) = require_redis() else { return };
    let redis = Redis::start(&bin);
    let dir = tempfile::tempdir().expect("tempdir");
    let gate = dir.path().join("gate");
    set_unlisted_acl(&redis, true);
    let url_unlisted = redis.url().replace("redis://", "redis://unlisted:pw@");
    let b = start(&redis.url(), "b", &gate);
    until_all_held_by(&redis, PARTITIONS, &["b"]);
    let a = start(&url_unlisted, "a", &gate);
    until_registered(&redis, "a", true);
    set_unlisted_acl(&redis, false);
    until_registered(&redis, "a", false);
    refused_by_a_answered_by_b(&redis, a, &b, &gate, "registration lapsed");
}

/// A bridge sends four messages to `a`, which is not live in the registry (`why`): each is
/// refused `storage`; `a` is killed, the bridge sends them to `b`, the gate opens, and
/// each is answered once.
fn refused_by_a_answered_by_b(
    redis: &Redis,
    mut a: ClusterServe,
    b: &ClusterServe,
    gate: &Path,
    why: &str,
) {
    let ids: Vec<String> = (0..4).map(|i| format!("m{i}")).collect();
    let mut to_a = Bridge::connect(&a.addr);
    for id in &ids {
        to_a.message(id);
    }
    // One answer each: an ack or a refusal (no result can come: the agents wait).
    let mut first: HashMap<String, Value> = HashMap::new();
    let t0 = Instant::now();
    while first.len() < ids.len() {
        assert!(t0.elapsed() < WAIT, "a answered only {first:?}");
        let Some(v) = to_a.next() else { continue };
        let id = v["id"].as_str().expect("id").to_owned();
        first.entry(id).or_insert(v);
    }
    // Still not in the registry: every answer above came from an unregistered instance.
    assert!(!registered(redis, "a"), "a registered despite its ACL");
    a.kill9();
    drop(to_a);

    // The bridge moves to B and sends again what A did not ack (as a bridge does with a
    // `reject` that says "retry later").
    let acked_by_a: HashSet<&String> = (ids.iter())
        .filter(|id| first[id.as_str()]["op"] == "ack")
        .collect();
    let mut to_b = Bridge::connect(&b.addr);
    for id in ids.iter().filter(|id| !acked_by_a.contains(id)) {
        to_b.message(id);
    }
    std::fs::write(gate, b"open").expect("open the gate");
    let mut answered: HashMap<String, Value> = HashMap::new();
    let t0 = Instant::now();
    while answered.len() < ids.len() {
        assert!(
            t0.elapsed() < WAIT,
            "never answered: {:?} (acked by a, {why}: {acked_by_a:?})",
            ids.iter()
                .filter(|id| !answered.contains_key(*id))
                .collect::<Vec<_>>()
        );
        let Some(v) = to_b.next() else { continue };
        if v["op"] == "reply" || v["op"] == "failed" {
            let id = v["id"].as_str().expect("id").to_owned();
            let again = answered.insert(id.clone(), v.clone());
            assert!(again.is_none(), "{id} answered twice: {v}");
        }
    }
    for id in &ids {
        let v = &first[id];
        assert_eq!(
            (v["op"].as_str(), v["reason"].as_str()),
            (Some("reject"), Some("storage")),
            "{id}: the answer of an instance not live in the registry ({why}): {v}"
        );
        assert_eq!(
            answered[id]["text"].as_str(),
            Some(format!("done {id}").as_str()),
            "{id}: its result"
        );
    }
}
