//! Issue 35 row 1 across a cluster: the openai agent's conversation is kept in Redis beside
//! its session's partition, written by the `outcome` script with the outcome it belongs to
//! and read by the next owner. Against a real redis-server (tests/redis_support): the
//! store's writes (an outcome that is not written writes no conversation; the bounds), then
//! two `serve --cluster` processes on the scripted OpenAI server, the owner killed with
//! SIGKILL and the survivor continuing the conversation.
//!
//! Nothing sleeps to order events: the waits on a clock (a key's expiry in Redis, a status
//! file rewritten by the heartbeat) poll their condition with a generous deadline.

mod common;
mod mock_openai;
mod redis_support;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::eventually;
use common::gateway::{Gateway, find};
use mock_openai::{Mock, stream};
use redis_support::{Redis, WAIT, require_redis};
use turnstile::internal::cluster::{
    Accept, Acquire, ClusterConfig, Lease, RedisStore, partition_of,
};
use turnstile::internal::journal::{kept_conversation, now_ms};
use turnstile::{MessageFields, StoreErrorKind, StoredMessage, StoredOutcome};

const P: u32 = 4;

fn store(r: &Redis, instance: &str) -> RedisStore {
    let mut c = ClusterConfig::new(r.url(), instance);
    c.partitions = P;
    c.lease = Duration::from_secs(30);
    RedisStore::connect(c).expect("connect")
}

fn session(chat: &str) -> String {
    format!("telegram:dm:{chat}")
}

fn acquired(s: &mut RedisStore, p: u32) -> Lease {
    match s.acquire(p).expect("acquire") {
        Acquire::Acquired(l) => l,
        other => panic!("partition {p}: {other:?}"),
    }
}

/// Accepts a message in `chat`'s session; its seq.
fn accept(s: &mut RedisStore, id: &str, chat: &str) -> u64 {
    let m = StoredMessage::new(
        0,
        "telegram",
        MessageFields::new(id, chat, "hi"),
        now_ms() + 600_000,
    );
    match s
        .accept(
            partition_of(&session(chat), P),
            &session(chat),
            &m,
            100,
            now_ms(),
        )
        .expect("accept")
    {
        Accept::New { seq, .. } => seq,
        other => panic!("not accepted: {other:?}"),
    }
}

/// An outcome that leaves `chat`'s conversation at `exchanges` (empty: cleared).
fn remembering(chat: &str, exchanges: &[(&str, &str)]) -> StoredOutcome {
    let exchanges = exchanges
        .iter()
        .map(|(u, a)| ((*u).to_owned(), (*a).to_owned()))
        .collect();
    StoredOutcome {
        head: b"{\"op\":\"reply\"}\n".to_vec(),
        memory: Some(kept_conversation(&session(chat), exchanges)),
        ..StoredOutcome::default()
    }
}

/// `chat`'s conversation as stored (the key docs/cluster.md names).
fn stored(r: &Redis, chat: &str) -> Option<String> {
    let s = session(chat);
    let key = format!("ts:{{p{}}}:h:{s}", partition_of(&s, P));
    redis::cmd("GET")
        .arg(key)
        .query(&mut r.client())
        .expect("GET")
}

/// `n` chats whose sessions fall in partition `p`.
fn chats_in(p: u32, n: usize) -> Vec<String> {
    (0..)
        .map(|i| format!("c{i:04}"))
        .filter(|c| partition_of(&session(c), P) == p)
        .take(n)
        .collect()
}

#[test]
fn a_conversation_is_written_only_with_its_outcome_and_never_by_a_fenced_owner() {
    let Some(bin) = require_redis() else { return };
    let redis = Redis::start(&bin);
    let mut a = store(&redis, "a");
    let p = partition_of(&session("ann"), P);
    let lease = acquired(&mut a, p);
    let seq = accept(&mut a, "m1", "ann");
    assert!(
        a.outcome(&lease, seq, &remembering("ann", &[("hi", "hello")]))
            .expect("outcome")
    );
    assert_eq!(
        stored(&redis, "ann").as_deref(),
        Some(r#"[["hi","hello"]]"#)
    );
    let pttl: i64 = redis::cmd("PTTL")
        .arg(format!("ts:{{p{p}}}:h:{}", session("ann")))
        .query(&mut redis.client())
        .expect("PTTL");
    assert!(pttl > 0, "the conversation expires (--history-ttl): {pttl}");
    // Another instance loading the partition (as its next owner would) counts it at once.
    let mut next = store(&redis, "next");
    next.load_partition(p, now_ms()).expect("load");
    let counted = next.history_status([p].into_iter());
    let bytes = (session("ann").len() + r#"[["hi","hello"]]"#.len()) as u64;
    assert_eq!((counted.sessions, counted.bytes), (1, bytes));

    // A stale owner's outcome is fenced: neither it nor its conversation is written.
    let stale = Lease {
        token: format!("{}-stale", lease.token),
        ..lease.clone()
    };
    let seq2 = accept(&mut a, "m2", "ann");
    let e = a
        .outcome(
            &stale,
            seq2,
            &remembering("ann", &[("hi", "hello"), ("x", "y")]),
        )
        .expect_err("fenced");
    assert_eq!(e.kind, StoreErrorKind::Fenced);
    assert_eq!(
        stored(&redis, "ann").as_deref(),
        Some(r#"[["hi","hello"]]"#)
    );
    // An outcome of a message that left the store writes nothing either.
    let other = &chats_in(p, 2)[1];
    assert!(
        !a.outcome(&lease, 999, &remembering(other, &[("q", "a")]))
            .expect("gone")
    );
    assert_eq!(stored(&redis, other), None);
    // A second outcome of the same message (a retried write whose first try landed)
    // changes nothing: the conversation stays the first one's.
    assert!(
        a.outcome(&lease, seq, &remembering("ann", &[("other", "text")]))
            .expect("again")
    );
    assert_eq!(
        stored(&redis, "ann").as_deref(),
        Some(r#"[["hi","hello"]]"#)
    );
    // `/new`'s clear rides its outcome the same way.
    assert!(
        a.outcome(&lease, seq2, &remembering("ann", &[]))
            .expect("cleared")
    );
    assert_eq!(stored(&redis, "ann"), None);
    let s = a.history_status([p].into_iter());
    assert_eq!((s.sessions, s.bytes), (0, 0));
}

#[test]
fn a_partition_keeps_its_share_of_history_bytes_and_forgets_what_expired() {
    let Some(bin) = require_redis() else { return };
    let redis = Redis::start(&bin);
    let mut a = store(&redis, "a");
    let p = 1;
    let chats = chats_in(p, 4);
    let one = (session(&chats[0]).len() + r#"[["q","0123456789"]]"#.len()) as u64;
    // Each partition's share of the bytes: two conversations.
    a.set_history_limits(Duration::from_secs(3600), u64::from(P) * 2 * one);
    let lease = acquired(&mut a, p);
    for chat in &chats[..3] {
        let seq = accept(&mut a, &format!("m-{chat}"), chat);
        a.outcome(&lease, seq, &remembering(chat, &[("q", "0123456789")]))
            .expect("outcome");
        let s = a.history_status([p].into_iter());
        assert!(s.bytes <= 2 * one, "{s:?}");
    }
    let s = a.history_status([p].into_iter());
    assert_eq!((s.sessions, s.bytes, s.evicted), (2, 2 * one, 1));
    assert_eq!(
        stored(&redis, &chats[0]),
        None,
        "the least recently written went"
    );
    assert!(stored(&redis, &chats[2]).is_some());
    // A conversation continued is the most recent again, even within one millisecond or
    // after Redis's clock stepped back (chats[2] written when it read an hour ahead): the
    // next one past the bound evicts chats[2], not chats[1].
    let ahead = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_millis()
        + 3_600_000;
    let _: i64 = redis::cmd("ZADD")
        .arg(format!("ts:{{p{p}}}:hz"))
        .arg(ahead as u64)
        .arg(session(&chats[2]))
        .query(&mut redis.client())
        .expect("ZADD");
    for chat in [&chats[1], &chats[3]] {
        let seq = accept(&mut a, &format!("n-{chat}"), chat);
        a.outcome(&lease, seq, &remembering(chat, &[("q", "0123456789")]))
            .expect("outcome");
    }
    assert!(stored(&redis, &chats[1]).is_some(), "continued, so kept");
    assert_eq!(stored(&redis, &chats[2]), None, "now the least recent");
    // Another partition's figures are not this one's.
    assert_eq!(a.history_status([(p + 1) % P].into_iter()).sessions, 0);

    // A short ttl: the keys expire in Redis, and the next write forgets their bytes.
    let mut b = store(&redis, "b");
    b.set_history_limits(Duration::from_millis(300), 1 << 20);
    let q = 2;
    let chats = chats_in(q, 2);
    let lease = acquired(&mut b, q);
    let seq = accept(&mut b, "e1", &chats[0]);
    b.outcome(&lease, seq, &remembering(&chats[0], &[("q", "a")]))
        .expect("outcome");
    eventually("the conversation expired in Redis", WAIT, || {
        stored(&redis, &chats[0]).is_none()
    });
    let seq = accept(&mut b, "e2", &chats[1]);
    b.outcome(&lease, seq, &remembering(&chats[1], &[("q", "a")]))
        .expect("outcome");
    let s = b.history_status([q].into_iter());
    assert_eq!((s.sessions, s.expired), (1, 1), "{s:?}");
}

/// A `serve --cluster --agent openai` instance `id` on one partition, its status file in `dir`.
fn start(mock: &Mock, redis: &Redis, id: &str, dir: &Path) -> Gateway {
    start_with(mock, redis, id, dir, &[])
}

fn start_with(mock: &Mock, redis: &Redis, id: &str, dir: &Path, extra: &[&str]) -> Gateway {
    Gateway::spawn(
        Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args(["serve", "--listen", "127.0.0.1:0", "--http-listen", "off"])
            .args(mock.agent_args())
            .args(["--cluster", &redis.url(), "--instance-id", id])
            .args(["--partitions", "1", "--lease-ms", "500"])
            .args(["--cluster-rebalance", "false"])
            .args(extra),
        &dir.join(format!("{id}.json")),
    )
}

/// Two instances on one Redis, one partition: `owner` holds it (started first, no
/// rebalancing), `survivor` joined after.
fn two_instances(mock: &Mock, redis: &Redis, dir: &Path) -> (Gateway, Gateway) {
    let owner = start(mock, redis, "owner", dir);
    owner.wait_status("the owner holds the partition", WAIT, |s| {
        find(s, "owned").is_some_and(|o| o == &serde_json::json!([0]))
    });
    let survivor = start(mock, redis, "survivor", dir);
    (owner, survivor)
}

/// The session `turnstile send` talks in by default (platform `cli`, chat `local`).
const SESSION: &str = "cli:dm:local";

/// `turnstile history export --cluster` of `SESSION`, one JSON value a line.
fn export(redis: &Redis) -> Vec<serde_json::Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args(["history", "export", "--session", SESSION])
        .env("TURNSTILE_CLUSTER", redis.url())
        .output()
        .expect("run turnstile history export");
    assert!(out.status.success(), "export: {out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
    v.iter()
        .map(|(r, c)| ((*r).to_owned(), (*c).to_owned()))
        .collect()
}

#[test]
fn a_failover_continues_the_conversation_on_the_next_owner() {
    let Some(bin) = require_redis() else { return };
    let redis = Redis::start(&bin);
    let mock = Mock::start(vec![stream(&["Hello ", "Ann"], 5, 2)]);
    let dir = tempfile::tempdir().expect("dir");
    let (owner, survivor) = two_instances(&mock, &redis, dir.path());
    assert_eq!(owner.send("my name is Ann"), "Hello Ann");
    assert_eq!(
        mock.next_request().messages(),
        pairs(&[("user", "my name is Ann")])
    );
    owner.wait_status("the owner counts the stored conversation", WAIT, |s| {
        find(s, "history").is_some_and(|h| h["sessions"] == 1 && h["bytes"].as_u64() > Some(0))
    });
    // Exported from Redis while both instances run.
    let lines = export(&redis);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["session"], SESSION);
    assert_eq!(lines[0]["user"], "my name is Ann");
    assert_eq!(lines[0]["assistant"], "Hello Ann");
    owner.kill_9();

    mock.push([stream(&["You are Ann"], 9, 3)]);
    // Sent through the survivor: it takes the partition over once the lease runs out.
    assert_eq!(survivor.send("what is my name?"), "You are Ann");
    assert_eq!(
        mock.next_request().messages(),
        pairs(&[
            ("user", "my name is Ann"),
            ("assistant", "Hello Ann"),
            ("user", "what is my name?"),
        ]),
        "the next owner's first request carries the earlier exchange"
    );
    assert_eq!(export(&redis).len(), 2);
    survivor.wait_status("the survivor counts the conversation", WAIT, |s| {
        find(s, "history").is_some_and(|h| h["sessions"] == 1)
    });
}

#[test]
fn new_then_a_failover_leaves_nothing_of_the_old_conversation() {
    let Some(bin) = require_redis() else { return };
    let redis = Redis::start(&bin);
    let mock = Mock::start(vec![stream(&["noted: 7"], 5, 2)]);
    let dir = tempfile::tempdir().expect("dir");
    let (owner, survivor) = two_instances(&mock, &redis, dir.path());
    assert_eq!(owner.send("remember 7"), "noted: 7");
    mock.next_request();
    let reset = owner.send("/new");
    assert!(reset.starts_with("reset"), "{reset}");
    assert_eq!(export(&redis), Vec::<serde_json::Value>::new());
    owner.kill_9();

    mock.push([stream(&["which number?"], 5, 2)]);
    assert_eq!(
        survivor.send("what did I ask you to remember?"),
        "which number?"
    );
    assert_eq!(
        mock.next_request().messages(),
        pairs(&[("user", "what did I ask you to remember?")]),
        "nothing from before /new"
    );
}

#[test]
fn a_conversation_read_on_a_connection_redis_closed_is_read_again_not_started_anew() {
    let Some(bin) = require_redis() else { return };
    let redis = Redis::start(&bin);
    let mock = Mock::start(vec![
        stream(&["Hello ", "Ann"], 5, 2),
        stream(&["Hello Bob"], 5, 2),
    ]);
    let dir = tempfile::tempdir().expect("dir");
    // One cached agent: another session's turn evicts Ann's, so her next message makes a new
    // one, which reads the conversation back on the connection the earlier reads left open.
    let owner = start_with(
        &mock,
        &redis,
        "owner",
        dir.path(),
        &["--max-cached-agents", "1"],
    );
    assert_eq!(owner.send("my name is Ann"), "Hello Ann");
    mock.next_request();
    assert_eq!(owner.send_in("bob", "I am Bob"), "Hello Bob");
    mock.next_request();
    owner.wait_status("Ann's agent is evicted", WAIT, |s| {
        find(s, "cached_agents") == Some(&serde_json::json!(1))
    });
    // Redis closes that connection (its idle `timeout`, a restart, a proxy): the connections
    // whose last command was the read.
    let mut admin = redis.client();
    let clients: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query(&mut admin)
        .expect("CLIENT LIST");
    let readers: Vec<&str> = clients
        .lines()
        .filter(|l| l.contains(" cmd=get "))
        .filter_map(|l| l.split(' ').find_map(|f| f.strip_prefix("id=")))
        .collect();
    assert!(!readers.is_empty(), "{clients}");
    for id in readers {
        let _: redis::Value = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("ID")
            .arg(id)
            .query(&mut admin)
            .expect("CLIENT KILL");
    }
    mock.push([stream(&["You are Ann"], 9, 3)]);
    assert_eq!(owner.send("what is my name?"), "You are Ann");
    assert_eq!(
        mock.next_request().messages(),
        pairs(&[
            ("user", "my name is Ann"),
            ("assistant", "Hello Ann"),
            ("user", "what is my name?"),
        ]),
        "the new agent read the conversation on a new connection"
    );
}
