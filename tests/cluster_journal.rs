//! A cluster member's journal thread (`Journal::start_cluster`) and stream reader
//! (`Reader`) against a real redis-server (tests/redis_support): the bridge's records in,
//! `Committed` reports and arrivals out, exactly as the reactor sees them. Ownership (gained partitions with their messages, fencing, a dead
//! member's partitions taken over), placement (owned here or elsewhere, duplicates and the
//! session cap cluster-wide), Redis down and back, and the leases given back on finish.
//!
//! Other "instances" are plain `RedisStore`s with other names on the same Redis. Nothing
//! sleeps: every wait is for the thread's next report (its waker is a channel), bounded by
//! `WAIT`.

mod common;
mod redis_support;

use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use redis_support::{Redis, WAIT, require_redis};
use turnstile::internal::cluster::{
    Accept, Acquire, Arrival, ClusterConfig, ClusterLink, ClusterReport, Lease, Op, Reader,
    RedisStore, cluster_tag, partition_of, tag_parts,
};
use turnstile::internal::journal::{Committed, Journal, JournalConfig, now_ms};
use turnstile::{MessageFields, Record, StoredMessage, StoredOutcome};

/// Every report so far, merged: the journal's completions and their cluster parts
/// (`ClusterLink::report`); dereferences to the completions.
#[derive(Debug, Default)]
struct Report {
    base: Committed,
    cluster: ClusterReport,
}

impl std::ops::Deref for Report {
    type Target = Committed;
    fn deref(&self) -> &Committed {
        &self.base
    }
}

const P: u32 = 4;

fn cfg(r: &Redis, instance: &str, lease: Duration) -> ClusterConfig {
    let mut c = ClusterConfig::new(r.url(), instance);
    c.partitions = P;
    c.lease = lease;
    c
}

fn store(r: &Redis, instance: &str, lease: Duration) -> RedisStore {
    RedisStore::connect(cfg(r, instance, lease)).expect("connect")
}

/// A member's journal thread and its waker.
struct Member {
    journal: Journal,
    link: ClusterLink,
    woke: Receiver<()>,
    /// Every report so far, merged.
    seen: Report,
}

impl Member {
    fn start(r: &Redis, instance: &str, lease: Duration, session_cap: usize) -> Member {
        Member::start_with(cfg(r, instance, lease), session_cap)
    }

    fn start_with(c: ClusterConfig, session_cap: usize) -> Member {
        let (tx, woke) = crossbeam_channel::unbounded();
        let (journal, link) = Journal::start_cluster(
            RedisStore::connect(c).expect("connect"),
            JournalConfig::default(),
            session_cap,
            move || {
                let _ = tx.send(());
            },
        )
        .expect("start");
        Member {
            journal,
            link,
            woke,
            seen: Report::default(),
        }
    }

    /// Waits for reports until `done` holds of everything reported so far.
    fn until(&mut self, what: &str, done: impl Fn(&Report) -> bool) -> &Report {
        let t0 = Instant::now();
        loop {
            for c in self.journal.completions() {
                merge(&mut self.seen, c, self.link.report());
            }
            if done(&self.seen) {
                return &self.seen;
            }
            let left = WAIT.saturating_sub(t0.elapsed());
            assert!(
                self.woke.recv_timeout(left).is_ok(),
                "{what}: not reported within {WAIT:?}; so far {:?}",
                self.seen
            );
        }
    }
}

fn merge(all: &mut Report, c: Committed, cluster: ClusterReport) {
    let (a, b) = (&mut all.cluster, cluster);
    a.placed.extend(b.placed);
    a.remote.extend(b.remote);
    a.duplicates.extend(b.duplicates);
    a.session_full.extend(b.session_full);
    a.gained.extend(b.gained);
    a.draining.extend(b.draining);
    a.lost.extend(b.lost);
    a.fenced.extend(b.fenced);
    a.unwritten_outcomes.extend(b.unwritten_outcomes);
    if !b.leases.is_empty() {
        a.leases = b.leases;
    }
    let all = &mut all.base;
    all.durable.extend(c.durable);
    all.failed.extend(c.failed);
    all.outcomes.extend(c.outcomes);
    all.taken += c.taken;
    all.retrying = c.retrying;
    if c.error.is_some() {
        all.error = c.error;
    }
}

fn msg(tag: u64, id: &str, chat: &str) -> StoredMessage {
    StoredMessage::new(
        tag,
        "telegram",
        MessageFields::new(id, chat, &format!("text of {id}")),
        now_ms() + 600_000,
    )
}

fn part(chat: &str) -> u32 {
    partition_of(&format!("telegram:dm:{chat}"), P)
}

fn outcome(text: &str) -> StoredOutcome {
    StoredOutcome {
        head: b"{\"type\":\"done\",\"text\":\"".to_vec(),
        text: text.into(),
        tail: b"\"}\n".to_vec(),
        memory: None,
    }
}

/// The cluster tag the bridge's `tag` was placed under.
fn placed(c: &Report, tag: u64) -> u64 {
    c.cluster
        .placed
        .iter()
        .find(|(t, _)| *t == tag)
        .map(|(_, g)| *g)
        .unwrap_or_else(|| panic!("tag {tag} not placed: {c:?}"))
}

fn field(r: &Redis, p: u32, seq: u64, f: &str) -> Option<String> {
    redis::cmd("HGET")
        .arg(format!("ts:{{p{p}}}:m:{seq}"))
        .arg(f)
        .query(&mut r.client())
        .expect("HGET")
}

fn gained(c: &Report) -> Vec<u32> {
    let mut g: Vec<u32> = c.cluster.gained.iter().map(|(p, _)| *p).collect();
    g.sort_unstable();
    g
}

fn acquired(s: &mut RedisStore, p: u32) -> Lease {
    match s.acquire(p).expect("acquire") {
        Acquire::Acquired(l) => l,
        other => panic!("partition {p}: {other:?}"),
    }
}

const LONG: Duration = Duration::from_secs(30);

#[test]
fn alone_a_member_gains_every_partition_and_writes_a_messages_life_under_the_bridges_tag() {
    let Some(bin) = require_redis() else { return };
    let r = Redis::start(&bin);
    let mut a = Member::start(&r, "a", LONG, 10);
    a.until("every partition gained", |c| gained(c) == [0, 1, 2, 3]);

    let chat = "1";
    a.journal.send(Record::Accepted(msg(1, "m1", chat)));
    let c = a.until("accepted", |c| !c.cluster.placed.is_empty());
    assert_eq!(c.durable, vec![1], "owned here: submitted here");
    assert!(c.cluster.remote.is_empty());
    let (p, seq) = tag_parts(placed(c, 1)).expect("a cluster tag");
    assert_eq!(p, part(chat), "the partition of the session");

    // Every later record names the bridge's tag; the thread writes it at (p, seq).
    a.journal.send(Record::Started { seq: 1, attempt: 1 });
    a.journal.send(Record::Outcome {
        seq: 1,
        outcome: outcome("hello"),
    });
    a.until("outcome written", |c| c.outcomes == [1] && c.taken == 3);
    assert_eq!(a.seen.error, None);
    assert_eq!(field(&r, p, seq, "st").as_deref(), Some("1"));
    assert_eq!(field(&r, p, seq, "ot").as_deref(), Some("hello"));
    a.journal.send(Record::Delivered { seq: 1 });
    a.until("delivered", |c| c.taken == 4);
    assert_eq!(field(&r, p, seq, "p"), None, "the message left Redis");
    assert!(a.seen.cluster.fenced.is_empty() && a.seen.cluster.lost.is_empty());
}

#[test]
fn a_message_for_a_partition_owned_elsewhere_is_durable_but_remote_and_any_member_delivers_it() {
    let Some(bin) = require_redis() else { return };
    let r = Redis::start(&bin);
    // B holds every partition before A starts.
    let mut b = store(&r, "b", LONG);
    let leases: Vec<Lease> = (0..P).map(|p| acquired(&mut b, p)).collect();
    let mut a = Member::start(&r, "a", LONG, 10);
    let chat = "2";
    a.journal.send(Record::Accepted(msg(7, "m7", chat)));
    let c = a.until("accepted", |c| !c.cluster.placed.is_empty());
    assert_eq!(c.cluster.remote, vec![7], "owned by B: not submitted here");
    assert!(c.durable.is_empty() && c.cluster.gained.is_empty());
    let (p, seq) = tag_parts(placed(c, 7)).expect("a cluster tag");
    assert_eq!(p, part(chat));
    // The owner runs it (B's writes, under B's lease), and A's bridge delivers it.
    let lease = &leases[p as usize];
    assert!(b.started(lease, seq, 1).expect("started"));
    assert!(b.outcome(lease, seq, &outcome("from b")).expect("outcome"));
    assert_eq!(field(&r, p, seq, "o").as_deref(), Some("a"), "origin: A");
    a.journal.send(Record::Delivered { seq: 7 });
    a.until("delivered", |c| c.taken == 2);
    assert_eq!(field(&r, p, seq, "p"), None, "the message left Redis");
}

#[test]
fn an_owned_write_after_the_lease_moved_is_fenced_changes_nothing_and_drops_the_partition() {
    let Some(bin) = require_redis() else { return };
    let r = Redis::start(&bin);
    let mut a = Member::start(&r, "a", LONG, 10);
    a.until("every partition gained", |c| gained(c) == [0, 1, 2, 3]);
    let chat = "3";
    a.journal.send(Record::Accepted(msg(1, "m1", chat)));
    let c = a.until("accepted", |c| c.durable == [1]);
    let (p, seq) = tag_parts(placed(c, 1)).expect("a cluster tag");
    // The lease moves to B behind A's back (as if A had paused past its TTL).
    let _: () = redis::cmd("DEL")
        .arg(format!("ts:{{p{p}}}:lease"))
        .query(&mut r.client())
        .expect("DEL");
    let mut b = store(&r, "b", LONG);
    let _b_lease = acquired(&mut b, p);

    a.journal.send(Record::Started { seq: 1, attempt: 1 });
    a.until("fenced", |c| c.cluster.fenced == [p]);
    assert_eq!(
        field(&r, p, seq, "st").as_deref(),
        Some("0"),
        "nothing written"
    );
    assert_eq!(a.seen.error, None, "fenced is not a failing store");
    assert_eq!(a.seen.retrying, 0, "a fenced write is not tried again");
    // Dropped: a later owned write of that partition is not even sent.
    a.journal.send(Record::Outcome {
        seq: 1,
        outcome: outcome("stale"),
    });
    a.until("second fenced", |c| {
        c.cluster.fenced.len() == 2 && c.taken == 3
    });
    assert_eq!(field(&r, p, seq, "oh"), None, "no stale outcome");
    assert_eq!(
        a.seen.cluster.unwritten_outcomes,
        vec![1],
        "the bridge is told: never send it"
    );
    let out: u64 = redis::cmd("XLEN")
        .arg(format!("ts:{{p{p}}}:out"))
        .query(&mut r.client())
        .expect("XLEN");
    assert_eq!(out, 0, "nothing published");
}

#[test]
fn duplicates_and_the_session_cap_are_answered_cluster_wide() {
    let Some(bin) = require_redis() else { return };
    let r = Redis::start(&bin);
    let chat = "4";
    let p = part(chat);
    // Another instance accepted m1 of the same session first.
    let mut b = store(&r, "b", LONG);
    let first = b
        .accept(p, "telegram:dm:4", &msg(0, "m1", chat), 2, now_ms())
        .expect("accept");
    assert!(matches!(first, Accept::New { .. }));
    let mut a = Member::start(&r, "a", LONG, 2);
    a.journal.send(Record::Accepted(msg(1, "m1", chat)));
    a.journal.send(Record::Accepted(msg(2, "m2", chat)));
    a.journal.send(Record::Accepted(msg(3, "m3", chat)));
    let c = a.until("three answers", |c| {
        c.cluster.duplicates.len() + c.cluster.placed.len() + c.cluster.session_full.len() == 3
    });
    assert_eq!(c.cluster.duplicates, vec![1], "m1 is B's");
    assert_eq!(placed(c, 2) >> 63, 1);
    assert_eq!(
        c.cluster.session_full,
        vec![3],
        "m1 (B) and m2 (A) fill the cap of 2"
    );
    assert!(c.failed.is_empty());
}

#[test]
fn a_dead_members_partitions_are_gained_with_their_messages_under_cluster_tags() {
    let Some(bin) = require_redis() else { return };
    let r = Redis::start(&bin);
    let lease = Duration::from_millis(300);
    // "Old" holds everything, accepts two messages of one session, starts the first, and
    // dies (it never renews).
    let mut old = store(&r, "old", lease);
    let leases: Vec<Lease> = (0..P).map(|p| acquired(&mut old, p)).collect();
    let chat = "5";
    let p = part(chat);
    let seqs: Vec<u64> = ["m1", "m2"]
        .iter()
        .map(
            |id| match old.accept(p, "telegram:dm:5", &msg(0, id, chat), 10, now_ms()) {
                Ok(Accept::New { seq, .. }) => seq,
                other => panic!("{other:?}"),
            },
        )
        .collect();
    assert!(
        old.started(&leases[p as usize], seqs[0], 1)
            .expect("started")
    );
    let t0 = Instant::now();
    let mut a = Member::start(&r, "a", lease, 10);
    a.until("every partition taken over", |c| gained(c) == [0, 1, 2, 3]);
    eprintln!(
        "takeover: all {P} partitions gained {:?} after the new member started (lease {lease:?})",
        t0.elapsed()
    );
    let (_, loaded) = a
        .seen
        .cluster
        .gained
        .iter()
        .find(|(q, _)| *q == p)
        .expect("p gained");
    let got: Vec<(u64, u32, &str)> = loaded
        .recovered
        .messages
        .iter()
        .map(|m| (m.message.seq, m.starts, m.message.id()))
        .collect();
    let tags = [cluster_tag(p, seqs[0]), cluster_tag(p, seqs[1])];
    assert_eq!(
        got,
        vec![(tags[0], 1, "m1"), (tags[1], 0, "m2")],
        "in order, under cluster tags, the started one marked"
    );
    assert!(
        loaded.origins.is_empty(),
        "the origin is dead: its results go to this member's bridges"
    );
    assert_eq!(loaded.recovered.dedup.len(), 2);
    // The new owner's records name the cluster tags; its writes go through.
    a.journal.send(Record::Started {
        seq: tags[1],
        attempt: 1,
    });
    a.until("started", |c| c.taken == 1);
    assert_eq!(a.seen.error, None);
    assert!(a.seen.cluster.fenced.is_empty());
    assert_eq!(field(&r, p, seqs[1], "st").as_deref(), Some("1"));
    // And the dead one's are refused.
    assert!(old.started(&leases[p as usize], seqs[1], 9).is_err());
}

#[test]
fn with_redis_down_accepts_fail_storage_the_rest_waits_and_goes_through_when_it_returns() {
    let Some(bin) = require_redis() else { return };
    let mut r = Redis::start(&bin);
    let mut a = Member::start(&r, "a", LONG, 10);
    a.until("every partition gained", |c| gained(c) == [0, 1, 2, 3]);
    let chat = "6";
    a.journal.send(Record::Accepted(msg(1, "m1", chat)));
    let c = a.until("accepted", |c| c.durable == [1]);
    let (p, seq) = tag_parts(placed(c, 1)).expect("a cluster tag");
    r.kill();
    a.journal.send(Record::Started { seq: 1, attempt: 1 });
    a.journal.send(Record::Accepted(msg(2, "m2", chat)));
    a.until("failed", |c| c.failed == [2]);
    assert!(a.seen.error.is_some());
    assert_eq!(a.seen.retrying, 1, "the started record waits");
    r.restart();
    a.until("written again", |c| c.retrying == 0 && c.taken == 3);
    assert_eq!(field(&r, p, seq, "st").as_deref(), Some("1"));
    assert!(a.seen.cluster.fenced.is_empty() && a.seen.cluster.lost.is_empty());
}

#[test]
fn finish_gives_the_leases_back_and_leaves_the_registry() {
    let Some(bin) = require_redis() else { return };
    let r = Redis::start(&bin);
    let mut a = Member::start(&r, "a", LONG, 10);
    a.until("every partition gained", |c| gained(c) == [0, 1, 2, 3]);
    let (_, finished) = a.journal.finish(WAIT);
    assert!(finished);
    let mut raw = r.client();
    for p in 0..P {
        let l: Option<String> = redis::cmd("GET")
            .arg(format!("ts:{{p{p}}}:lease"))
            .query(&mut raw)
            .expect("GET");
        assert_eq!(l, None, "partition {p}'s lease given back");
    }
    let live: u64 = redis::cmd("ZCARD")
        .arg("ts:instances")
        .query(&mut raw)
        .expect("ZCARD");
    assert_eq!(live, 0);
    // So another takes them at once, not after the TTL of 30 s.
    let mut b = store(&r, "b", LONG);
    for p in 0..P {
        acquired(&mut b, p);
    }
}

/// A reader and its waker, with what arrived so far: how far it read each owned inbox
/// (`Arrival::Reached`) apart from the rest.
struct Reading {
    reader: Reader,
    woke: Receiver<()>,
    got: Vec<Arrival>,
    reached: Vec<(u32, u64)>,
}

impl Reading {
    fn start(r: &Redis, instance: &str) -> Reading {
        let (tx, woke) = crossbeam_channel::unbounded();
        let reader = Reader::start(store(r, instance, LONG), move || {
            let _ = tx.send(());
        })
        .expect("start");
        Reading {
            reader,
            woke,
            got: Vec::new(),
            reached: Vec::new(),
        }
    }

    fn take(&mut self) {
        for a in self.reader.arrivals() {
            match a {
                Arrival::Reached { partition, seq } => self.reached.push((partition, seq)),
                a => self.got.push(a),
            }
        }
    }

    /// Waits until the reader said it read `p`'s inbox up to `seq` at least; the arrivals
    /// before that word, in order.
    fn until_reached(&mut self, p: u32, seq: u64) -> &[Arrival] {
        let t0 = Instant::now();
        loop {
            self.take();
            if self.reached.iter().any(|&(q, s)| q == p && s >= seq) {
                return &self.got;
            }
            let left = WAIT.saturating_sub(t0.elapsed());
            assert!(
                self.woke.recv_timeout(left).is_ok(),
                "partition {p} not read up to {seq} within {WAIT:?}; so far {:?}",
                self.reached
            );
        }
    }

    fn until(&mut self, what: &str, n: usize) -> &[Arrival] {
        let t0 = Instant::now();
        loop {
            self.take();
            if self.got.len() >= n {
                return &self.got;
            }
            let left = WAIT.saturating_sub(t0.elapsed());
            assert!(
                self.woke.recv_timeout(left).is_ok(),
                "{what}: {n} arrival(s) not within {WAIT:?}; so far {:?}",
                self.got
            );
        }
    }
}

fn accept_as(s: &mut RedisStore, id: &str, chat: &str) -> u64 {
    let session = format!("telegram:dm:{chat}");
    match s.accept(part(chat), &session, &msg(0, id, chat), 10, now_ms()) {
        Ok(Accept::New { seq, .. }) => seq,
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_reader_brings_the_owner_what_others_accept_into_its_partitions_and_only_those() {
    let Some(bin) = require_redis() else { return };
    let r = Redis::start(&bin);
    let (mine, other) = ("7", "8");
    let (p, q) = (part(mine), part(other));
    assert_ne!(p, q, "two partitions");
    let mut b = store(&r, "b", LONG);
    // Accepted before the load: the load has it, so the inbox is read after it.
    let before = accept_as(&mut b, "m0", mine);
    let mut owner = store(&r, "a", LONG);
    let lease = acquired(&mut owner, p);
    let loaded = owner.load_partition(p, now_ms()).expect("load");
    assert_eq!(loaded.recovered.messages[0].message.seq, before);
    let mut a = Reading::start(&r, "a");
    a.reader.own(p, loaded.inbox_after.clone());
    // Its own accept into its own partition is not brought back (its bridge has it), only
    // named as read (`Reached`, which releases it to be submitted): the first arrival is
    // b's, accepted after it.
    let mut a_store = store(&r, "a", LONG);
    let own = accept_as(&mut a_store, "m1a", mine);
    assert!(
        a.until_reached(p, own).is_empty(),
        "its own message brought back: {:?}",
        a.got
    );
    let seq = accept_as(&mut b, "m1", mine);
    let got = a.until("the message accepted by b", 1);
    match &got[0] {
        Arrival::Message {
            partition,
            tag,
            message,
            origin,
        } => {
            assert_eq!((*partition, *tag), (p, cluster_tag(p, seq)));
            assert_eq!(message.message.seq, *tag, "numbered by its cluster tag");
            assert_eq!((message.message.id(), message.starts), ("m1", 0));
            assert_eq!(message.message.fields.text, "text of m1");
            assert_eq!(origin, "b");
        }
        other => panic!("{other:?}"),
    }
    // Another partition's inbox is not this reader's; after disown, neither is p's. An
    // outcome of a's own, published after both accepts, proves they were not missed but
    // left: a read that returns it would have returned them (they were in Redis first).
    a.reader.disown(p);
    let own_seq = accept_as(&mut a_store, "m9", other);
    let _ = accept_as(&mut b, "m2", other);
    let _ = accept_as(&mut b, "m3", mine);
    let mut q_owner = store(&r, "c", LONG);
    let q_lease = acquired(&mut q_owner, q);
    assert!(
        q_owner
            .outcome(&q_lease, own_seq, &outcome("nine"))
            .expect("outcome")
    );
    let got = a.until("its own outcome", 2);
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(
        matches!(&got[1], Arrival::Outcome { tag, .. } if *tag == cluster_tag(q, own_seq)),
        "{got:?}"
    );
    drop(lease);
}

#[test]
fn the_reader_brings_the_origin_the_outcomes_of_its_own_messages_only() {
    let Some(bin) = require_redis() else { return };
    let r = Redis::start(&bin);
    let chat = "9";
    let p = part(chat);
    let mut a_store = store(&r, "a", LONG);
    let mut b = store(&r, "b", LONG);
    let mut owner = store(&r, "c", LONG);
    let lease = acquired(&mut owner, p);
    // An outcome published before the reader starts is not read (the owner's load has it).
    let early = accept_as(&mut a_store, "m0", chat);
    assert!(
        owner
            .outcome(&lease, early, &outcome("early"))
            .expect("outcome")
    );
    // The reader starts from the streams' ends as of its start.
    let mut a = Reading::start(&r, "a");
    let theirs = accept_as(&mut b, "m1", chat);
    let mine = accept_as(&mut a_store, "m2", chat);
    assert!(
        owner
            .outcome(&lease, theirs, &outcome("for b"))
            .expect("outcome")
    );
    assert!(
        owner
            .outcome(&lease, mine, &outcome("for a"))
            .expect("outcome")
    );
    let got = a.until("a's outcome", 1).to_vec();
    assert_eq!(
        got,
        vec![Arrival::Outcome {
            partition: p,
            tag: cluster_tag(p, mine),
            outcome: outcome("for a"),
        }],
        "b's outcome and the one before the start are not a's to send"
    );
}

fn lease_of(r: &Redis, p: u32) -> Option<String> {
    redis::cmd("GET")
        .arg(format!("ts:{{p{p}}}:lease"))
        .query(&mut r.client())
        .expect("GET")
}

/// A second instance joins: the member names its surplus (the top half) to drain instead of
/// releasing it; a draining partition stays its own in Redis and queues no new message here
/// (an accept into it is `remote`); one the bridge says is drained is released at once
/// (reported lost), one never said drained is given up at the drain's bound.
#[test]
fn a_joining_instance_makes_the_member_drain_its_surplus_release_what_is_drained_and_give_up_at_the_bound()
 {
    let Some(bin) = require_redis() else { return };
    let r = Redis::start(&bin);
    let lease = Duration::from_millis(3000);
    let mut c = cfg(&r, "a", lease);
    c.drain = Duration::from_millis(600);
    c.rebalance = true;
    let mut a = Member::start_with(c, 10);
    a.until("every partition gained", |c| gained(c) == [0, 1, 2, 3]);
    let mut b = store(&r, "b", lease);
    b.heartbeat().expect("heartbeat");
    a.until("the surplus named to drain", |c| {
        c.cluster.draining.len() == 2
    });
    let mut draining = a.seen.cluster.draining.clone();
    draining.sort_unstable();
    assert_eq!(draining, vec![2, 3], "the surplus from the top");
    assert!(a.seen.cluster.lost.is_empty(), "nothing released yet");
    for p in 0..P {
        assert!(
            lease_of(&r, p).is_some_and(|l| l.starts_with("a:")),
            "partition {p} still a's while it drains"
        );
    }
    // An accept into a draining partition is placed, acked, and not queued here.
    let chat = (0..100)
        .map(|i| i.to_string())
        .find(|c| part(c) == 3)
        .expect("a chat of partition 3");
    a.journal.send(Record::Accepted(msg(1, "m1", &chat)));
    let c = a.until("accepted", |c| !c.cluster.placed.is_empty());
    assert_eq!(
        (c.durable.clone(), c.cluster.remote.clone()),
        (vec![], vec![1])
    );
    // The bridge drained 3: released now.
    a.link.release_drained(3);
    a.until("3 released", |c| c.cluster.lost.contains(&3));
    assert!(
        !a.seen.cluster.lost.contains(&2),
        "3 was released at once, not at the bound with 2"
    );
    assert_eq!(lease_of(&r, 3), None, "3's lease given back");
    // A partition not draining is never released so.
    a.link.release_drained(0);
    b.heartbeat().expect("heartbeat");
    // 2 was never said drained: given up at the bound, its lease released too.
    a.until("2 given up at the bound", |c| c.cluster.lost.contains(&2));
    assert_eq!(lease_of(&r, 2), None, "2's lease given back");
    assert!(lease_of(&r, 0).is_some_and(|l| l.starts_with("a:")));
    assert!(!a.seen.cluster.lost.contains(&0));
    acquired(&mut b, 3);
    acquired(&mut b, 2);
}

/// The renewals of a pass go in one pipeline, each answered on its own: a lease taken behind
/// the member's back is fenced at its next renewal and reported (once), the others stay its
/// own and are renewed (their TTL set again), and the member serves on with them.
#[test]
fn the_pipelined_renewals_fence_a_lease_taken_away_and_renew_the_others() {
    let Some(bin) = require_redis() else { return };
    let r = Redis::start(&bin);
    let lease = Duration::from_millis(3000);
    let mut a = Member::start(&r, "a", lease, 10);
    a.until("every partition gained", |c| gained(c) == [0, 1, 2, 3]);
    // Shorten the others' TTLs (below the lease, above a pass): only a renewal sets them
    // back to the lease. Then 2 moves to B behind A's back.
    for p in [0, 1, 3] {
        let _: () = redis::cmd("PEXPIRE")
            .arg(format!("ts:{{p{p}}}:lease"))
            .arg(2000)
            .query(&mut r.client())
            .expect("PEXPIRE");
    }
    let _: () = redis::cmd("DEL")
        .arg("ts:{p2}:lease")
        .query(&mut r.client())
        .expect("DEL");
    let mut b = store(&r, "b", LONG);
    let _b_lease = acquired(&mut b, 2);
    a.until("2 fenced at its renewal", |c| c.cluster.fenced.contains(&2));
    assert_eq!(a.seen.cluster.fenced, vec![2]);
    assert!(a.seen.cluster.lost.is_empty(), "{:?}", a.seen.cluster);
    assert!(lease_of(&r, 2).is_some_and(|l| l.starts_with("b:")));
    for p in [0, 1, 3] {
        assert!(
            lease_of(&r, p).is_some_and(|l| l.starts_with("a:")),
            "partition {p} renewed with the others"
        );
        let ttl: i64 = redis::cmd("PTTL")
            .arg(format!("ts:{{p{p}}}:lease"))
            .query(&mut r.client())
            .expect("PTTL");
        assert!(
            ttl > 2000,
            "partition {p}'s TTL not set again by the pass: {ttl} ms"
        );
    }
    // Still its own: an owned write there goes through.
    let chat = (0..100)
        .map(|i| i.to_string())
        .find(|c| part(c) == 0)
        .expect("a chat of partition 0");
    a.journal.send(Record::Accepted(msg(1, "m1", &chat)));
    a.until("accepted", |c| c.durable == [1]);
    a.journal.send(Record::Started { seq: 1, attempt: 1 });
    a.until("started written", |c| c.taken == 2);
    assert_eq!(a.seen.cluster.fenced, vec![2]);
}

/// reader.rs's `MAX_ARRIVALS`: what the reader keeps for the reactor at most.
const MAX_ARRIVALS: usize = 4096;

/// The reader's figure of what waits for the reactor.
fn waiting(r: &Reader) -> usize {
    let mut s = turnstile::ClusterStatus::default();
    r.fill_status(&mut s);
    s.reader_arrivals
}

/// Seed 518 with the real reader: the origin of an inbox message it read counts as seen
/// live, so an origin absent from the registry's next read has left, even though no read
/// ever saw it live: the message is its owner's to answer (`OriginGone`).
#[test]
fn an_inbox_messages_origin_never_seen_live_and_absent_is_taken_for_gone() {
    let Some(bin) = require_redis() else { return };
    let r = Redis::start(&bin);
    let chat = "5";
    let p = part(chat);
    // Never in the registry (no heartbeat): as an origin whose entry lapsed before the
    // owner's reader first read the registry.
    let mut b = store(&r, "b", LONG);
    let session = format!("telegram:dm:{chat}");
    let m = msg(0, "m0", chat);
    let accept = Op::Accept {
        partition: p,
        session: &session,
        message: &m,
        session_cap: 8,
    };
    let done = b.write(&[accept], now_ms()).expect("accept");
    assert!(done.iter().all(Result::is_ok), "{done:?}");
    let mut a = Reading::start(&r, "a");
    a.reader.own(p, "0-0".into());
    let got = a.until("the message, then its origin gone", 2).to_vec();
    assert!(
        matches!(&got[0], Arrival::Message { origin, .. } if origin == "b"),
        "{got:?}"
    );
    assert!(
        matches!(&got[1], Arrival::OriginGone { partition, message, .. }
            if *partition == p && message.message.id() == "m0"),
        "{got:?}"
    );
}

/// The reader's channel to the reactor is bounded: with more in an owned inbox than the
/// bound and a reactor that takes nothing, the reader stops at the bound (it wakes the
/// reactor, then waits for room), and shows it in the status; once the reactor takes what
/// waits, every message arrives, in order, none lost. A handle dropped while its reader
/// waits for room ends it (no hang at shutdown).
#[test]
fn the_readers_arrivals_stop_at_their_bound_lose_nothing_and_a_full_reader_stops() {
    let Some(bin) = require_redis() else { return };
    let r = Redis::start(&bin);
    let chat = "5";
    let p = part(chat);
    let mut b = store(&r, "b", LONG);
    // Live in the registry, as an instance is when it accepts (`Member::commit`): a reader
    // takes an inbox message's origin absent from it for gone (`OriginGone`).
    b.heartbeat().expect("heartbeat");
    let n = MAX_ARRIVALS + 300;
    let session = format!("telegram:dm:{chat}");
    let messages: Vec<StoredMessage> = (0..n).map(|i| msg(0, &format!("m{i}"), chat)).collect();
    for chunk in messages.chunks(512) {
        let ops: Vec<Op> = chunk
            .iter()
            .map(|m| Op::Accept {
                partition: p,
                session: &session,
                message: m,
                session_cap: n + 1,
            })
            .collect();
        let done = b.write(&ops, now_ms()).expect("accepts");
        assert!(done.iter().all(Result::is_ok), "{done:?}");
    }
    for round in ["drained", "dropped full"] {
        let mut a = Reading::start(&r, "a");
        a.reader.own(p, "0-0".into());
        // The reader wakes the reactor before it waits for room: then the channel is full.
        let t0 = Instant::now();
        while waiting(&a.reader) < MAX_ARRIVALS {
            let left = WAIT.saturating_sub(t0.elapsed());
            assert!(
                a.woke.recv_timeout(left).is_ok(),
                "{round}: the reader never filled its channel: {} waiting",
                waiting(&a.reader)
            );
        }
        assert_eq!(waiting(&a.reader), MAX_ARRIVALS, "{round}: past the bound");
        if round == "drained" {
            let got = a.until("every message", n).to_vec();
            let ids: Vec<String> = got
                .iter()
                .map(|a| match a {
                    Arrival::Message { message, .. } => message.message.id().to_owned(),
                    other => panic!("{other:?}"),
                })
                .collect();
            let sent: Vec<String> = messages.iter().map(|m| m.id().to_owned()).collect();
            assert_eq!(ids, sent, "in inbox order, none lost");
            a.until_reached(p, n as u64);
        } else {
            let (done, stopped) = crossbeam_channel::bounded(1);
            std::thread::spawn(move || {
                drop(a);
                let _ = done.send(());
            });
            assert!(
                stopped.recv_timeout(WAIT).is_ok(),
                "dropping a reader waiting for room hung"
            );
        }
    }
}

/// Self-fencing (issue 31 row 2): a partition acquired is loaded and reported only a
/// margin (`--max-clock-skew-ms`) after its acquisition, so the previous owner, which stopped
/// its turns a margin before the lease could expire, is two margins clear; every pass
/// reports each lease's fence deadline, the lease less the margin after its last renewal.
/// Then the bridge fences itself out of one: the thread drops it without releasing it (the
/// lease runs out in Redis) and reports it lost.
#[test]
fn a_partition_is_reported_gained_a_margin_after_its_acquisition_and_a_self_fenced_one_is_dropped()
{
    let Some(bin) = require_redis() else { return };
    let r = Redis::start(&bin);
    let (lease, margin) = (Duration::from_millis(3000), Duration::from_millis(900));
    let mut c = cfg(&r, "a", lease);
    c.max_clock_skew = Some(margin);
    let t0 = Instant::now();
    let mut a = Member::start_with(c, 8);
    a.until("every partition gained", |c| {
        c.cluster.gained.len() == P as usize
    });
    assert!(
        t0.elapsed() >= margin,
        "gained {:?} after the start, before the margin",
        t0.elapsed()
    );
    let leases = a.seen.cluster.leases.clone();
    assert_eq!(leases.len(), P as usize, "{leases:?}");
    for (p, _, at) in &leases {
        // No later than the lease less the margin from now (the renewal was sent before).
        let deadline = a.link.zero() + *at;
        assert!(deadline <= Instant::now() + (lease - margin), "{p}: {at:?}");
        assert!(deadline > Instant::now(), "{p}: {at:?} already past");
    }
    let (p, epoch, _) = leases[0];
    a.link.self_fenced(p, epoch + 1);
    a.link.self_fenced(p, epoch);
    a.until("the fenced partition lost", |c| c.cluster.lost.contains(&p));
    assert_eq!(a.seen.cluster.lost, vec![p], "another epoch is ignored");
    assert!(
        lease_of(&r, p).is_some_and(|l| l == format!("a:{epoch}")),
        "left to expire, not released"
    );
}
