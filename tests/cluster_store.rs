//! The Redis store (`--cluster`) against a real redis-server (tests/redis_support): fencing,
//! cluster-wide dedup and session caps, lease expiry and takeover, the load of one
//! partition, the start-up checks, and Redis killed and restarted.
//!
//! "Instances" here are several `RedisStore`s with different names on one Redis: exactly
//! what several gateway processes hold. Nothing sleeps to order events; the one wait on a
//! clock — a lease running out in Redis — polls its condition with a deadline.

mod common;
mod redis_support;

use std::time::{Duration, Instant};

use common::eventually;
use redis_support::{Redis, WAIT, require_redis};
use turnstile::internal::cluster::{
    Accept, Acquire, ClusterConfig, Done, Lease, Op, Ownership, RedisStore, Stream, partition_of,
};
use turnstile::internal::journal::now_ms;
use turnstile::{ChatType, MessageFields, StoreErrorKind, StoredMessage, StoredOutcome};

const P: u32 = 4;

fn cfg(r: &Redis, instance: &str) -> ClusterConfig {
    let mut c = ClusterConfig::new(r.url(), instance);
    c.partitions = P;
    c.lease = Duration::from_secs(30);
    c
}

fn store(r: &Redis, instance: &str) -> RedisStore {
    RedisStore::connect(cfg(r, instance)).expect("connect")
}

fn msg(id: &str, chat: &str, until: u64) -> StoredMessage {
    StoredMessage::new(
        0,
        "telegram",
        MessageFields::new(id, chat, &format!("text of {id}")),
        until,
    )
}

fn session(chat: &str) -> String {
    format!("telegram:dm:{chat}")
}

fn part(chat: &str) -> u32 {
    partition_of(&session(chat), P)
}

fn acquired(s: &mut RedisStore, p: u32) -> Lease {
    match s.acquire(p).expect("acquire") {
        Acquire::Acquired(l) => l,
        other => panic!("partition {p}: {other:?}"),
    }
}

fn new_seq(a: Accept) -> u64 {
    match a {
        Accept::New { seq, .. } => seq,
        other => panic!("not accepted: {other:?}"),
    }
}

fn later() -> u64 {
    now_ms() + 600_000
}

fn outcome(text: &str) -> StoredOutcome {
    StoredOutcome {
        head: b"{\"type\":\"done\",\"text\":\"".to_vec(),
        text: text.into(),
        tail: b"\"}\n".to_vec(),
        memory: None,
    }
}

/// Waits (bounded) until Redis's TTL has freed the partition and `s` acquires it.
fn acquire_after_expiry(s: &mut RedisStore, p: u32) -> (Lease, Duration) {
    let t0 = Instant::now();
    let lease = eventually(&format!("partition {p} came free"), WAIT, || {
        match s.acquire(p).expect("acquire") {
            Acquire::Acquired(l) => Some(l),
            _ => None,
        }
    });
    (lease, t0.elapsed())
}

#[test]
fn a_stale_owners_writes_are_fenced_and_change_nothing() {
    let Some(bin) = require_redis() else { return };
    let r = Redis::start(&bin);
    let chat = "1";
    let p = part(chat);
    let mut short = cfg(&r, "a");
    short.lease = Duration::from_millis(200);
    let mut a = RedisStore::connect(short.clone()).expect("a");
    short.instance = "b".into();
    let mut b = RedisStore::connect(short).expect("b");

    let old = acquired(&mut a, p);
    assert!(matches!(b.acquire(p), Ok(Acquire::Taken { ref holder }) if *holder == old.token));
    let seq = new_seq(
        b.accept(p, &session(chat), &msg("m1", chat, later()), 10, now_ms())
            .unwrap(),
    );
    // A is "paused" past its lease: Redis lets it run out, and B takes the partition.
    let (new, waited) = acquire_after_expiry(&mut b, p);
    eprintln!("lease of 200 ms expired and was taken over after {waited:?}");
    assert!(new.epoch > old.epoch, "{new:?} after {old:?}");

    // Every write of the stale owner is refused and leaves the partition as it was.
    for e in [
        a.started(&old, seq, 1).unwrap_err(),
        a.outcome(&old, seq, &outcome("stale")).unwrap_err(),
        a.renew(&old).unwrap_err(),
    ] {
        assert_eq!(e.kind, StoreErrorKind::Fenced, "{e}");
        assert!(e.message.contains(&new.token), "{e}");
    }
    assert!(
        !a.release(&old).unwrap(),
        "a stale release must not free the new lease"
    );
    let loaded = b.load_partition(p, now_ms()).expect("load");
    let m = &loaded.recovered.messages[0];
    assert_eq!((m.starts, m.outcome.clone()), (0, None));
    let mut raw = r.client();
    let published: u64 = redis::cmd("XLEN")
        .arg(format!("ts:{{p{p}}}:out"))
        .query(&mut raw)
        .unwrap();
    assert_eq!(published, 0, "a fenced outcome reached the outcome stream");

    // The new owner's writes go through.
    assert!(b.started(&new, seq, 1).unwrap());
    assert!(b.outcome(&new, seq, &outcome("fresh")).unwrap());
    b.renew(&new).expect("renew");
    let m = b.load_partition(p, now_ms()).unwrap().recovered.messages[0].clone();
    assert_eq!((m.starts, m.outcome), (1, Some(outcome("fresh"))));
    let published: u64 = redis::cmd("XLEN")
        .arg(format!("ts:{{p{p}}}:out"))
        .query(&mut raw)
        .unwrap();
    assert_eq!(published, 1);
    // A second outcome (a retried write) changes nothing and publishes nothing.
    assert!(b.outcome(&new, seq, &outcome("again")).unwrap());
    let m = b.load_partition(p, now_ms()).unwrap().recovered.messages[0].clone();
    assert_eq!(m.outcome, Some(outcome("fresh")));
    let published: u64 = redis::cmd("XLEN")
        .arg(format!("ts:{{p{p}}}:out"))
        .query(&mut raw)
        .unwrap();
    assert_eq!(published, 1);
}

#[test]
fn a_released_lease_is_taken_at_once_with_a_new_epoch() {
    let Some(bin) = require_redis() else { return };
    let r = Redis::start(&bin);
    let (mut a, mut b) = (store(&r, "a"), store(&r, "b"));
    let first = acquired(&mut a, 0);
    assert_eq!(first.token, format!("a:{}", first.epoch));
    // Not even an instance of the same name gets a held lease back (a restarted process
    // must load the partition again).
    let mut a2 = store(&r, "a");
    assert!(matches!(a2.acquire(0), Ok(Acquire::Taken { .. })));
    assert!(a.release(&first).unwrap());
    let second = acquired(&mut b, 0);
    assert_eq!(second.epoch, first.epoch + 1);
    assert_eq!(
        a.renew(&first).unwrap_err().kind,
        StoreErrorKind::Fenced,
        "a released lease cannot be renewed"
    );
}

#[test]
fn dedup_and_the_session_cap_are_cluster_wide() {
    let Some(bin) = require_redis() else { return };
    let r = Redis::start(&bin);
    let (mut a, mut b) = (store(&r, "a"), store(&r, "b"));
    let chat = "7";
    let (p, s) = (part(chat), session(chat));
    let now = now_ms();
    let seq = new_seq(a.accept(p, &s, &msg("m1", chat, later()), 2, now).unwrap());
    // The same (platform, id) through another instance: a duplicate, and nothing written.
    assert_eq!(
        b.accept(p, &s, &msg("m1", chat, later()), 2, now).unwrap(),
        Accept::Duplicate
    );
    // The session's cap counts messages accepted anywhere.
    let seq2 = new_seq(b.accept(p, &s, &msg("m2", chat, later()), 2, now).unwrap());
    assert_eq!(
        a.accept(p, &s, &msg("m3", chat, later()), 2, now).unwrap(),
        Accept::SessionFull
    );
    assert_eq!(
        b.load_partition(p, now).unwrap().recovered.messages.len(),
        2
    );

    // Delivered (by either instance): room again, but the id stays a duplicate.
    assert!(b.delivered(p, seq, now).unwrap());
    assert!(!a.delivered(p, seq, now).unwrap(), "delivered twice");
    assert_eq!(
        a.accept(p, &s, &msg("m1", chat, later()), 2, now).unwrap(),
        Accept::Duplicate
    );
    new_seq(a.accept(p, &s, &msg("m3", chat, later()), 2, now).unwrap());
    // Forgotten (refused after acceptance): the id is new again.
    assert!(a.forget(p, seq2, now).unwrap());
    new_seq(b.accept(p, &s, &msg("m2", chat, later()), 2, now).unwrap());

    // An id whose window ended is new again; an in-flight one stays a duplicate past it.
    // (Another session of the same partition: its own cap.)
    let c8 = (0..100)
        .map(|i| i.to_string())
        .find(|c| c != chat && part(c) == p)
        .unwrap();
    let s8 = session(&c8);
    let short = now + 1_000;
    let s4 = new_seq(a.accept(p, &s8, &msg("m4", &c8, short), 9, now).unwrap());
    assert_eq!(
        a.accept(p, &s8, &msg("m4", &c8, short), 9, now + 5_000)
            .unwrap(),
        Accept::Duplicate,
        "in flight: a duplicate however long it waits"
    );
    assert!(a.delivered(p, s4, now).unwrap());
    assert_eq!(
        a.accept(p, &s8, &msg("m4", &c8, short), 9, now + 500)
            .unwrap(),
        Accept::Duplicate,
        "delivered: a duplicate until its window ends"
    );
    new_seq(
        a.accept(p, &s8, &msg("m4", &c8, short), 9, now + 5_000)
            .unwrap(),
    );
}

#[test]
fn the_load_of_a_partition_gives_back_what_was_accepted_and_not_finished() {
    let Some(bin) = require_redis() else { return };
    let r = Redis::start(&bin);
    let (mut a, mut b) = (store(&r, "a"), store(&r, "b"));
    let chat = "3";
    let (p, s) = (part(chat), session(chat));
    let now = now_ms();
    let mut full = msg("m1", chat, later());
    (
        full.fields.thread_id,
        full.fields.user_id,
        full.fields.user_name,
    ) = (
        Some("t9".into()),
        Some("u1".into()),
        Some("Ünïcödé 🦀".into()),
    );
    full.fields.meta = Some(r#"{"k":[1,2]}"#.into());
    full.fields.text = "line one\nline \"two\" \u{0}".into();
    full.fields.chat_type = ChatType::Group;
    let s1 = new_seq(a.accept(p, &s, &full, 10, now).unwrap());
    // Written in the fields every release so far has written (`ct` the chat type's name):
    // the load below reads a message in that stored format.
    let stored: std::collections::HashMap<String, Vec<u8>> = redis::cmd("HGETALL")
        .arg(format!("ts:{{p{p}}}:m:{s1}"))
        .query(&mut r.client())
        .unwrap();
    let text = |k: &str| {
        stored
            .get(k)
            .map(|v| String::from_utf8_lossy(v).into_owned())
    };
    let fields = ["p", "i", "ct", "c", "th", "u", "un", "meta", "tx"].map(text);
    let want = [
        "telegram",
        "m1",
        "group",
        chat,
        "t9",
        "u1",
        "Ünïcödé 🦀",
        r#"{"k":[1,2]}"#,
        "line one\nline \"two\" \u{0}",
    ]
    .map(|v| Some(v.to_owned()));
    assert_eq!(fields, want);
    let s2 = new_seq(b.accept(p, &s, &msg("m2", chat, later()), 10, now).unwrap());
    let s3 = new_seq(a.accept(p, &s, &msg("m3", chat, later()), 10, now).unwrap());
    let s4 = new_seq(b.accept(p, &s, &msg("m4", chat, later()), 10, now).unwrap());
    assert!(s1 < s2 && s2 < s3 && s3 < s4);
    let lease = acquired(&mut b, p);
    assert!(b.started(&lease, s1, 2).unwrap());
    let binary = StoredOutcome {
        head: vec![0, 255, b'{'],
        text: "ré\"sult\n".into(),
        tail: vec![b'}', b'\n'],
        memory: None,
    };
    assert!(b.outcome(&lease, s2, &binary).unwrap());
    assert!(a.delivered(p, s3, now).unwrap());

    // Another partition's traffic does not show.
    let other = (0..100)
        .map(|i| i.to_string())
        .find(|c| part(c) != p)
        .unwrap();
    new_seq(
        a.accept(
            part(&other),
            &session(&other),
            &msg("x", &other, later()),
            10,
            now,
        )
        .unwrap(),
    );

    let loaded = a.load_partition(p, now).expect("load");
    let got = &loaded.recovered;
    assert_eq!(got.max_seq, s4);
    let seqs: Vec<u64> = got.messages.iter().map(|m| m.message.seq).collect();
    assert_eq!(seqs, vec![s1, s2, s4], "in flight, in order");
    let mut want = full.clone();
    want.seq = s1;
    assert_eq!(got.messages[0].message, want);
    assert_eq!(
        (got.messages[0].starts, got.messages[0].outcome.clone()),
        (2, None)
    );
    assert_eq!(
        (got.messages[1].starts, got.messages[1].outcome.clone()),
        (0, Some(binary))
    );
    assert_eq!(
        (got.messages[2].starts, got.messages[2].outcome.clone()),
        (0, None)
    );
    assert_eq!(loaded.origins.get(&s1).map(String::as_str), Some("a"));
    assert_eq!(loaded.origins.get(&s2).map(String::as_str), Some("b"));
    let mut ids: Vec<&str> = got.dedup.iter().map(|(_, id, _)| id.as_str()).collect();
    ids.sort_unstable();
    assert_eq!(
        ids,
        vec!["m1", "m2", "m3", "m4"],
        "the window keeps the delivered m3"
    );
    assert!(
        got.dedup
            .iter()
            .all(|(pl, _, until)| pl == "telegram" && *until > now)
    );
    assert_ne!(loaded.inbox_after, "0-0");
    // The inbox's last entry is the partition's last accept.
    let mut raw = r.client();
    let last: redis::Value = redis::cmd("XREVRANGE")
        .arg(format!("ts:{{p{p}}}:in"))
        .arg("+")
        .arg("-")
        .arg("COUNT")
        .arg(1)
        .query(&mut raw)
        .unwrap();
    assert!(
        format!("{last:?}").contains(&loaded.inbox_after),
        "{last:?}"
    );
}

#[test]
fn the_start_refuses_a_redis_that_acks_before_fsync_unless_allowed() {
    let Some(bin) = require_redis() else { return };
    let lazy = Redis::start_with(&bin, "everysec");
    let e = RedisStore::connect(cfg(&lazy, "a")).err().expect("refused");
    assert_eq!(e.kind, StoreErrorKind::Unusable, "{e}");
    assert!(e.message.contains("appendfsync everysec"), "{e}");
    assert!(e.message.contains("--cluster-allow-lazy-fsync"), "{e}");
    let mut allowed = cfg(&lazy, "a");
    allowed.allow_lazy_fsync = true;
    RedisStore::connect(allowed).expect("allowed");
}

#[test]
fn the_partition_count_is_fixed_by_the_first_instance() {
    let Some(bin) = require_redis() else { return };
    let r = Redis::start(&bin);
    store(&r, "a");
    let mut other = cfg(&r, "b");
    other.partitions = P * 2;
    let e = RedisStore::connect(other).err().expect("refused");
    assert_eq!(e.kind, StoreErrorKind::Unusable, "{e}");
    assert!(e.message.contains(&format!("has {P} partitions")), "{e}");
}

#[test]
fn redis_down_is_transient_and_an_acked_message_survives_its_kill() {
    let Some(bin) = require_redis() else { return };
    let mut r = Redis::start(&bin);
    let mut a = store(&r, "a");
    let chat = "5";
    let (p, s) = (part(chat), session(chat));
    let seq = new_seq(
        a.accept(p, &s, &msg("m1", chat, later()), 10, now_ms())
            .unwrap(),
    );
    r.kill();
    let e = a
        .accept(p, &s, &msg("m2", chat, later()), 10, now_ms())
        .unwrap_err();
    assert_eq!(e.kind, StoreErrorKind::Transient, "{e}");
    assert_eq!(
        a.load_partition(p, now_ms()).unwrap_err().kind,
        StoreErrorKind::Transient
    );
    r.restart();
    // The same store reconnects by itself; the acked message came back from the
    // append-only file, and the dedup with it.
    let loaded = a.load_partition(p, now_ms()).expect("load after restart");
    assert_eq!(loaded.recovered.messages.len(), 1);
    assert_eq!(loaded.recovered.messages[0].message.seq, seq);
    assert_eq!(
        a.accept(p, &s, &msg("m1", chat, later()), 10, now_ms())
            .unwrap(),
        Accept::Duplicate
    );
    assert!(
        seq < new_seq(
            a.accept(p, &s, &msg("m2", chat, later()), 10, now_ms())
                .unwrap()
        )
    );
}

#[test]
fn the_streams_tell_the_owner_what_was_accepted_and_the_origin_what_finished() {
    let Some(bin) = require_redis() else { return };
    let r = Redis::start(&bin);
    let (mut a, mut b) = (store(&r, "a"), store(&r, "b"));
    let chat = "11";
    let (p, s) = (part(chat), session(chat));
    let s1 = new_seq(
        a.accept(p, &s, &msg("m1", chat, later()), 10, now_ms())
            .unwrap(),
    );
    let s2 = new_seq(
        a.accept(p, &s, &msg("m2", chat, later()), 10, now_ms())
            .unwrap(),
    );
    // The owner reads the inbox: both, in order.
    let got = b
        .read(Stream::Inbox, &[(p, "0-0".into())], 100, None)
        .unwrap();
    assert_eq!(got.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![s1, s2]);
    assert!(got.iter().all(|e| e.partition == p));
    // Each names the instance that accepted it: its own reader skips it unfetched.
    assert!(got.iter().all(|e| e.origin == "a"), "{got:?}");
    let after = got[1].id.clone();
    assert!(
        b.read(Stream::Inbox, &[(p, after)], 100, None)
            .unwrap()
            .is_empty()
    );

    // The origin blocks on the outcome stream (its own connection) until the owner writes.
    let mut reader = store(&r, "a-reader");
    let (tx, rx) = crossbeam_channel::bounded(1);
    let t = std::thread::spawn(move || {
        let _ = tx.send(());
        reader.read(Stream::Outcomes, &[(p, "0-0".into())], 100, Some(WAIT))
    });
    rx.recv().unwrap();
    let lease = acquired(&mut b, p);
    assert!(b.outcome(&lease, s2, &outcome("two")).unwrap());
    let got = t.join().unwrap().expect("read");
    assert_eq!(got.len(), 1);
    assert_eq!(
        (got[0].partition, got[0].seq, got[0].origin.as_str()),
        (p, s2, "a")
    );
    // A read of nothing, without waiting, is empty, not an error.
    let mut fresh = store(&r, "c");
    assert!(
        fresh
            .read(Stream::Outcomes, &[(p, got[0].id.clone())], 10, None)
            .unwrap()
            .is_empty()
    );
}

/// One ownership pass of one instance against Redis, as the journal thread will run it.
fn pass(o: &mut Ownership, s: &mut RedisStore, t0: Instant) {
    let now = t0.elapsed();
    o.set_live(s.heartbeat().expect("heartbeat"));
    let plan = o.plan(now);
    for l in &plan.release {
        s.release(l).expect("release");
    }
    for l in &plan.renew {
        match s.renew(l) {
            Ok(()) => o.renewed(l.partition, now),
            Err(e) if e.is_fenced() => {
                o.fenced(l.partition);
            }
            Err(e) => panic!("{e}"),
        }
    }
    for p in plan.acquire {
        if let Acquire::Acquired(l) = s.acquire(p).expect("acquire") {
            o.acquired(l, now);
        }
    }
}

fn held(o: &Ownership) -> Vec<u32> {
    o.held().map(|l| l.partition).collect()
}

/// Runs passes of `instances` every pass period until `done` holds (bounded).
fn drive(
    instances: &mut [(&mut Ownership, &mut RedisStore)],
    t0: Instant,
    done: impl Fn(&[(&mut Ownership, &mut RedisStore)]) -> bool,
) {
    let deadline = Instant::now() + WAIT;
    loop {
        for (o, s) in instances.iter_mut() {
            pass(o, s, t0);
        }
        if done(instances) {
            return;
        }
        assert!(Instant::now() < deadline, "the partitions never settled");
        std::thread::park_timeout(instances[0].0.pass_every());
    }
}

#[test]
fn instances_share_the_partitions_fairly_and_a_dead_ones_are_taken_over() {
    let Some(bin) = require_redis() else { return };
    let r = Redis::start(&bin);
    let lease = Duration::from_millis(300);
    let mk = |name: &str| {
        let mut c = cfg(&r, name);
        (c.partitions, c.lease) = (8, lease);
        (
            Ownership::new(name, 8, lease),
            RedisStore::connect(c).expect("connect"),
        )
    };
    let (mut oa, mut sa) = mk("a");
    let (mut ob, mut sb) = mk("b");
    let t0 = Instant::now();
    drive(&mut [(&mut oa, &mut sa)], t0, |i| {
        i[0].0.held().count() == 8
    });
    // B joins: A sheds to its fair share, B takes the rest; no partition is held twice.
    drive(&mut [(&mut oa, &mut sa), (&mut ob, &mut sb)], t0, |i| {
        i[0].0.held().count() == 4 && i[1].0.held().count() == 4
    });
    let (ha, hb) = (held(&oa), held(&ob));
    assert!(ha.iter().all(|p| !hb.contains(p)), "{ha:?} and {hb:?}");
    let stale = oa.held().next().cloned().expect("a holds one");

    // A stops (killed or paused): B takes everything once A's leases and registration run out.
    let died = Instant::now();
    drive(&mut [(&mut ob, &mut sb)], t0, |i| {
        i[0].0.held().count() == 8
    });
    eprintln!(
        "takeover of a dead instance's 4 partitions (lease 300 ms, pass every 100 ms): {:?}",
        died.elapsed()
    );
    // A wakes: its planner gives everything up at once, and its old lease writes nothing.
    let plan = oa.plan(t0.elapsed());
    assert_eq!(plan.lost, ha);
    assert_eq!(sa.renew(&stale).unwrap_err().kind, StoreErrorKind::Fenced);
    assert_eq!(
        sa.started(&stale, 1, 1).unwrap_err().kind,
        StoreErrorKind::Fenced
    );
}

#[test]
fn one_pipelined_batch_answers_each_write_and_a_fenced_one_hides_nothing() {
    let Some(bin) = require_redis() else { return };
    let r = Redis::start(&bin);
    let (mut a, mut b) = (store(&r, "a"), store(&r, "b"));
    let chat = "21";
    let (p, s) = (part(chat), session(chat));
    let now = now_ms();
    let s1 = new_seq(a.accept(p, &s, &msg("m1", chat, later()), 10, now).unwrap());
    let good = acquired(&mut b, p);
    let stale = Lease {
        token: format!("a:{}", good.epoch.saturating_sub(1)),
        ..good.clone()
    };
    let (m2, o1) = (msg("m2", chat, later()), outcome("one"));
    let ops = [
        Op::Accept {
            partition: p,
            session: &s,
            message: &m2,
            session_cap: 10,
        },
        Op::Started {
            lease: &stale,
            seq: s1,
            attempt: 1,
        },
        Op::Started {
            lease: &good,
            seq: s1,
            attempt: 1,
        },
        Op::Outcome {
            lease: &good,
            seq: s1,
            outcome: &o1,
        },
        Op::Delivered {
            partition: p,
            seq: s1,
        },
        Op::Delivered {
            partition: p,
            seq: s1,
        },
    ];
    let got = b.write(&ops, now).expect("batch");
    assert_eq!(got.len(), ops.len());
    let s2 = match &got[0] {
        Ok(Done::Accepted(Accept::New { seq, .. })) => *seq,
        other => panic!("{other:?}"),
    };
    assert_eq!(got[1].as_ref().unwrap_err().kind, StoreErrorKind::Fenced);
    assert_eq!(got[2], Ok(Done::Written(true)));
    assert_eq!(got[3], Ok(Done::Written(true)));
    assert_eq!(got[4], Ok(Done::Written(true)));
    assert_eq!(
        got[5],
        Ok(Done::Written(false)),
        "delivered twice: already gone"
    );
    let left = a.load_partition(p, now).unwrap().recovered.messages;
    assert_eq!(
        left.iter().map(|m| m.message.seq).collect::<Vec<_>>(),
        vec![s2]
    );

    // A script cache flushed under the store: that batch fails as a whole, transient,
    // nothing applied, and the next one (a new connection, the scripts loaded again) works.
    let mut raw = r.client();
    let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut raw).unwrap();
    let m3 = msg("m3", chat, later());
    let accept3 = [Op::Accept {
        partition: p,
        session: &s,
        message: &m3,
        session_cap: 10,
    }];
    let got = b.write(&accept3, now).expect("answered");
    assert_eq!(got[0].as_ref().unwrap_err().kind, StoreErrorKind::Transient);
    assert_eq!(
        a.load_partition(p, now).unwrap().recovered.messages.len(),
        1
    );
    let got = b.write(&accept3, now).expect("answered");
    assert!(
        matches!(got[0], Ok(Done::Accepted(Accept::New { .. }))),
        "{got:?}"
    );
}

/// The ownership pass's leases go in one round trip each way: every answer on its own (a
/// taken or fenced one hides none of the others), and a flushed script cache fails that
/// pass transiently, the next one working on a new connection.
#[test]
fn one_pipelined_pass_renews_and_acquires_each_lease_on_its_own() {
    let Some(bin) = require_redis() else { return };
    let r = Redis::start(&bin);
    let (mut a, mut b) = (store(&r, "a"), store(&r, "b"));
    let theirs = acquired(&mut b, 1);
    let got = a.acquire_all(&[0, 1, 2]).expect("answered");
    let mine: Vec<Lease> = got
        .iter()
        .filter_map(|g| match g {
            Ok(Acquire::Acquired(l)) => Some(l.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(
        mine.iter().map(|l| l.partition).collect::<Vec<_>>(),
        vec![0, 2]
    );
    assert!(
        matches!(&got[1], Ok(Acquire::Taken { holder }) if *holder == theirs.token),
        "{got:?}"
    );
    let stale = Lease {
        token: "a:0".into(),
        ..theirs.clone()
    };
    let got = a
        .renew_all(&[mine[0].clone(), stale, mine[1].clone()])
        .expect("answered");
    assert_eq!(got[0], Ok(()));
    assert_eq!(got[1].as_ref().unwrap_err().kind, StoreErrorKind::Fenced);
    assert_eq!(got[2], Ok(()));
    assert!(
        b.renew(&theirs).is_ok(),
        "the fenced renewal changed nothing"
    );

    let mut raw = r.client();
    let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut raw).unwrap();
    let got = a.renew_all(&mine).expect("answered");
    assert!(
        got.iter().all(|g| g
            .as_ref()
            .is_err_and(|e| e.kind == StoreErrorKind::Transient)),
        "{got:?}"
    );
    assert_eq!(a.renew_all(&mine).expect("answered"), vec![Ok(()), Ok(())]);
    assert!(a.acquire_all(&[]).expect("nothing asked").is_empty());
}

/// The duplicate window is per (platform, id) whatever the chat: an id re-sent with a chat of
/// another partition is a duplicate while in flight and, delivered, until its window ends;
/// forgotten, it is new again (docs/cluster.md, `ts:{pK}:ids`).
#[test]
fn dedup_is_per_platform_and_id_whatever_the_chat() {
    let Some(bin) = require_redis() else { return };
    let r = Redis::start(&bin);
    let (mut a, mut b) = (store(&r, "a"), store(&r, "b"));
    let chat = "7";
    let (p, s) = (part(chat), session(chat));
    let other = (0..100)
        .map(|i| i.to_string())
        .find(|c| part(c) != p)
        .expect("a chat of another partition");
    let (q, t) = (part(&other), session(&other));
    let now = now_ms();
    let short = now + 1_000;
    let seq = new_seq(a.accept(p, &s, &msg("m1", chat, short), 9, now).unwrap());
    // The index entry lives in the id's own partition (a hash slot of its own, docs/cluster.md).
    let k = partition_of("telegram\nm1", P);
    let score: Option<String> = redis::cmd("ZSCORE")
        .arg(format!("ts:{{p{k}}}:ids"))
        .arg("telegram\nm1")
        .query(&mut r.client())
        .expect("ZSCORE");
    assert_eq!(score.as_deref(), Some("inf"), "in flight: scored +inf");
    assert_eq!(
        b.accept(q, &t, &msg("m1", &other, short), 9, now + 5_000)
            .unwrap(),
        Accept::Duplicate,
        "in flight: a duplicate however long it waits"
    );
    assert!(a.delivered(p, seq, now).unwrap());
    assert_eq!(
        b.accept(q, &t, &msg("m1", &other, short), 9, now + 500)
            .unwrap(),
        Accept::Duplicate,
        "delivered: a duplicate until its window ends"
    );
    new_seq(
        b.accept(q, &t, &msg("m1", &other, short), 9, now + 5_000)
            .unwrap(),
    );
    // Forgotten (refused after acceptance): new again, with any chat.
    let seq2 = new_seq(a.accept(p, &s, &msg("m2", chat, later()), 9, now).unwrap());
    assert!(a.forget(p, seq2, now).unwrap());
    new_seq(
        b.accept(q, &t, &msg("m2", &other, later()), 9, now)
            .unwrap(),
    );
}

/// Issue 31's throughput work dropped two writes per message: the `dedup` hash (written,
/// never read) and the in-flight `+inf` entry of `dedupx` (a load finds an in-flight id in
/// its message). A partition written by an older version, with both, still loads each id
/// once with its message's window, and its in-flight id is still a duplicate.
#[test]
fn a_message_writes_no_dedup_hash_and_an_older_versions_in_flight_ids_still_load() {
    let Some(bin) = require_redis() else { return };
    let r = Redis::start(&bin);
    let mut a = store(&r, "a");
    let chat = "5";
    let (p, s) = (part(chat), session(chat));
    let now = now_ms();
    let until = later();
    let s1 = new_seq(a.accept(p, &s, &msg("m1", chat, until), 9, now).unwrap());
    let mut raw = r.client();
    let dedupx = format!("ts:{{p{p}}}:dedupx");
    let exists: i64 = redis::cmd("EXISTS")
        .arg(format!("ts:{{p{p}}}:dedup"))
        .arg(&dedupx)
        .query(&mut raw)
        .unwrap();
    assert_eq!(exists, 0, "an in-flight message writes neither");
    let loaded = a.load_partition(p, now).expect("load");
    assert_eq!(
        loaded.recovered.dedup,
        vec![("telegram".to_string(), "m1".to_string(), until)],
        "the in-flight id's window, from its message"
    );
    // An older version's in-flight id: `+inf` in `dedupx` too.
    let s2 = new_seq(a.accept(p, &s, &msg("m2", chat, until), 9, now).unwrap());
    let _: i64 = redis::cmd("ZADD")
        .arg(&dedupx)
        .arg("+inf")
        .arg("telegram\nm2")
        .query(&mut raw)
        .unwrap();
    let mut ids: Vec<(String, u64)> = (a.load_partition(p, now).expect("load").recovered)
        .dedup
        .into_iter()
        .map(|(_, id, until)| (id, until))
        .collect();
    ids.sort_unstable();
    assert_eq!(
        ids,
        vec![("m1".to_string(), until), ("m2".to_string(), until)],
        "each id once, with its message's window"
    );
    assert!(a.delivered(p, s1, now).unwrap());
    assert!(a.delivered(p, s2, now).unwrap());
    let window: Vec<(String, String)> = redis::cmd("ZRANGE")
        .arg(&dedupx)
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query(&mut raw)
        .unwrap();
    assert_eq!(
        window,
        vec![
            ("telegram\nm1".to_string(), until.to_string()),
            ("telegram\nm2".to_string(), until.to_string())
        ],
        "delivered: in the window until it ends"
    );
    assert_eq!(
        a.accept(p, &s, &msg("m2", chat, until), 9, now).unwrap(),
        Accept::Duplicate
    );
}

/// Calls of `EVALSHA` Redis has run since it started (`INFO commandstats`).
fn evalsha_calls(raw: &mut redis::Connection) -> u64 {
    let info: String = redis::cmd("INFO").arg("commandstats").query(raw).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|l| l.split(',').next())
        .map_or(0, |n| n.parse().unwrap())
}

/// A batch's operations of one partition are one call of the batch script (every call costs
/// Redis a few microseconds before its first command), each still answered on its own: one
/// that raises an error (a key of another type) leaves the others of its call applied.
#[test]
fn a_batch_is_one_script_call_per_partition_and_an_operations_error_hides_nothing() {
    let Some(bin) = require_redis() else { return };
    let r = Redis::start(&bin);
    let mut raw = r.client();
    let mut a = store(&r, "a");
    let (c1, c2) = (
        "1",
        (2..)
            .map(|i| i.to_string())
            .find(|c| part(c) != part("1"))
            .unwrap(),
    );
    let (p1, p2) = (part(c1), part(&c2));
    let (l1, l2) = (acquired(&mut a, p1), acquired(&mut a, p2));
    let now = now_ms();
    let (s1, s2) = (session(c1), session(&c2));
    let ms: Vec<StoredMessage> = (0..3).map(|i| msg(&format!("b{i}"), c1, later())).collect();
    let m2 = msg("c0", &c2, later());
    let accept = |m, p, s| Op::Accept {
        partition: p,
        session: s,
        message: m,
        session_cap: 10,
    };
    let before = evalsha_calls(&mut raw);
    let got = a
        .write(
            &[
                accept(&ms[0], p1, &s1),
                accept(&m2, p2, &s2),
                accept(&ms[1], p1, &s1),
                accept(&ms[2], p1, &s1),
            ],
            now,
        )
        .expect("batch");
    assert_eq!(
        evalsha_calls(&mut raw) - before,
        2,
        "one call per partition"
    );
    let seqs: Vec<u64> = (got.into_iter())
        .map(|d| match d {
            Ok(Done::Accepted(a)) => new_seq(a),
            other => panic!("{other:?}"),
        })
        .collect();
    assert!(
        seqs[0] < seqs[2] && seqs[2] < seqs[3],
        "in their order: {seqs:?}"
    );

    // The second message's hash replaced by a string: its `started` raises WRONGTYPE.
    let bad = format!("ts:{{p{p1}}}:m:{}", seqs[2]);
    let _: () = redis::cmd("SET")
        .arg(&bad)
        .arg("x")
        .query(&mut raw)
        .unwrap();
    let o = outcome("done");
    let got = a
        .write(
            &[
                Op::Started {
                    lease: &l1,
                    seq: seqs[0],
                    attempt: 1,
                },
                Op::Started {
                    lease: &l1,
                    seq: seqs[2],
                    attempt: 1,
                },
                Op::Outcome {
                    lease: &l1,
                    seq: seqs[3],
                    outcome: &o,
                },
                Op::Started {
                    lease: &l2,
                    seq: seqs[1],
                    attempt: 1,
                },
            ],
            now,
        )
        .expect("batch");
    assert_eq!(got[0], Ok(Done::Written(true)));
    let e = got[1].as_ref().unwrap_err();
    assert_eq!(e.kind, StoreErrorKind::Transient, "{e}");
    assert!(e.message.contains("WRONGTYPE"), "{e}");
    assert_eq!(
        got[2],
        Ok(Done::Written(true)),
        "after the error, in the same call"
    );
    assert_eq!(got[3], Ok(Done::Written(true)));
    let field = |raw: &mut redis::Connection, seq: u64, f: &str| -> Option<String> {
        let key = format!("ts:{{p{p1}}}:m:{seq}");
        redis::cmd("HGET").arg(key).arg(f).query(raw).unwrap()
    };
    assert_eq!(field(&mut raw, seqs[0], "st").as_deref(), Some("1"));
    assert_eq!(field(&mut raw, seqs[3], "ot").as_deref(), Some("done"));
    // A start of a message that left the store: `gone`, and no hash made of it.
    assert!(a.delivered(p1, seqs[0], now).unwrap());
    assert!(!a.started(&l1, seqs[0], 2).unwrap(), "gone");
    assert_eq!(field(&mut raw, seqs[0], "st"), None, "nothing left behind");
}

/// The duplicate window's expired ids are pruned by one accept in sixteen, up to 1,024 of
/// each set: past their window, a partition's finished ids leave its `dedupx` within
/// sixteen accepts into it, and an `ids` index is pruned by the accepts whose id falls in it
/// (a bound on both sets, as when every accept pruned 64).
#[test]
fn expired_ids_are_pruned_within_sixteen_accepts() {
    let Some(bin) = require_redis() else { return };
    let r = Redis::start(&bin);
    let mut raw = r.client();
    let mut a = store(&r, "a");
    let chat = "1";
    let (p, s) = (part(chat), session(chat));
    let now = now_ms();
    // 40 messages whose window ends 1 s from now, each delivered: 40 ids in the window.
    for i in 0..40 {
        let seq = new_seq(
            a.accept(p, &s, &msg(&format!("old{i}"), chat, now + 1000), 100, now)
                .unwrap(),
        );
        assert!(a.delivered(p, seq, now).unwrap());
    }
    let ids_total = |raw: &mut redis::Connection| -> u64 {
        (0..P)
            .map(|q| {
                redis::cmd("ZCARD")
                    .arg(format!("ts:{{p{q}}}:ids"))
                    .query::<u64>(raw)
                    .unwrap()
            })
            .sum()
    };
    let dedupx = format!("ts:{{p{p}}}:dedupx");
    let card = |raw: &mut redis::Connection| -> u64 {
        redis::cmd("ZCARD").arg(&dedupx).query(raw).unwrap()
    };
    assert_eq!((card(&mut raw), ids_total(&mut raw)), (40, 40));
    // Two seconds on: expired. Sixteen accepts of new ids (windows still open) prune them.
    let then = now + 2000;
    for i in 0..16 {
        a.accept(p, &s, &msg(&format!("new{i}"), chat, later()), 10_000, then)
            .unwrap();
    }
    assert_eq!(card(&mut raw), 0, "every expired id left dedupx");
    // The `ids` index: in the partitions of the ids, pruned as accepts of new ids reach them.
    let mut accepted = 16;
    while ids_total(&mut raw) > accepted {
        assert!(
            accepted < 16 * 64,
            "the expired ids never left the ids index"
        );
        let m = msg(&format!("new{accepted}"), chat, later());
        a.accept(p, &s, &m, 10_000, then).unwrap();
        accepted += 1;
    }
    eprintln!("the ids index held only ids in flight after {accepted} accepts");
    // And an expired id is new again.
    let again = a
        .accept(p, &s, &msg("old0", chat, later()), 10_000, then)
        .unwrap();
    assert!(matches!(again, Accept::New { .. }), "{again:?}");
}
