//! The hello registry and the forward streams against a real redis-server
//! (tests/redis_support): the store's commands (`set_hellos`, `hello_of`, `fwd_add`,
//! `fwd_read`, `fwd_end`, the stream's bound) and the reader carrying out the bridge's
//! requests (`Reader::request`) and bringing what the forward stream names
//! (`Arrival::Forwarded`, `Arrival::Took`). Nothing sleeps: every wait is for the reader's
//! next batch (its waker is a channel), bounded by `WAIT`.

mod common;
mod redis_support;

use std::time::{Duration, Instant};

use common::{eventually, holds};
use crossbeam_channel::Receiver;
use redis_support::{Redis, WAIT, require_redis};
use turnstile::ClusterStatus;
use turnstile::internal::cluster::{
    Accept, Acquire, Arrival, ClusterConfig, ClusterRequest, FWD_MAXLEN, FwdEntry, Reader,
    RedisStore, cluster_tag, partition_of,
};
use turnstile::internal::journal::now_ms;
use turnstile::{MessageFields, StoredMessage, StoredOutcome};

const P: u32 = 4;
const LONG: Duration = Duration::from_secs(30);

fn store(r: &Redis, instance: &str) -> RedisStore {
    let mut c = ClusterConfig::new(r.url(), instance);
    c.partitions = P;
    c.lease = LONG;
    c.allow_lazy_fsync = true;
    RedisStore::connect(c).expect("connect")
}

fn msg(id: &str, chat: &str) -> StoredMessage {
    StoredMessage::new(
        0,
        "tg",
        MessageFields::new(id, chat, &format!("text of {id}")),
        now_ms() + 600_000,
    )
}

struct Reading {
    reader: Reader,
    woke: Receiver<()>,
    got: Vec<Arrival>,
}

impl Reading {
    fn start(r: &Redis, instance: &str) -> Reading {
        let (tx, woke) = crossbeam_channel::unbounded();
        let reader = Reader::start(store(r, instance), move || {
            let _ = tx.send(());
        })
        .expect("start");
        Reading {
            reader,
            woke,
            got: Vec::new(),
        }
    }

    fn until(&mut self, what: &str, n: usize) -> Vec<Arrival> {
        let t0 = Instant::now();
        loop {
            self.got.extend(self.reader.arrivals());
            if self.got.len() >= n {
                return std::mem::take(&mut self.got);
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

impl Reading {
    /// Waits (bounded) until the reader's last read of the registry found `live`.
    fn until_live(&self, live: &[&str]) {
        eventually(&format!("live instances {live:?}"), WAIT, || {
            let mut s = ClusterStatus::default();
            self.reader.fill_status(&mut s);
            holds(s.live_instances, |l| l == live)
        });
    }

    /// An answer to this reader's own instance, waited for: the requests before it were
    /// carried out (they go in order).
    fn marker(&mut self) {
        self.reader.request(ClusterRequest::Took {
            to: "x".into(),
            platform: "marker".into(),
            taken: vec![],
            refused: vec![],
        });
        let got = self.until("the marker", 1);
        assert!(
            got.iter()
                .all(|a| matches!(a, Arrival::Took { platform, .. } if platform == "marker")),
            "{got:?}"
        );
    }
}

fn xlen(r: &Redis, key: &str) -> usize {
    redis::cmd("XLEN")
        .arg(format!("ts:fwd:{key}"))
        .query(&mut r.client())
        .expect("XLEN")
}

#[test]
fn the_registry_names_the_last_hello_and_the_forward_stream_round_trips_within_its_bound() {
    let Some(bin) = require_redis() else { return };
    let r = Redis::start_with(&bin, "no");
    let (mut x, mut y) = (store(&r, "x"), store(&r, "y"));
    assert_eq!(x.hello_of("tg").expect("hello of"), None);
    x.set_hellos(&["tg".into(), "irc".into()], 5)
        .expect("hello");
    y.set_hellos(&["tg".into()], 4).expect("hello");
    // The last write Redis applied wins, whatever the writers' clocks said.
    assert_eq!(x.hello_of("tg").expect("tg"), Some(("y".into(), 4)));
    assert_eq!(y.hello_of("irc").expect("irc"), Some(("x".into(), 5)));

    let start = y.fwd_end().expect("end");
    assert_eq!(start, "0-0");
    let fwd = FwdEntry::Forward {
        from: "x".into(),
        platform: "tg".into(),
        results: vec![cluster_tag(1, 2), cluster_tag(3, 4)],
    };
    let took = FwdEntry::Took {
        from: "x".into(),
        platform: "tg".into(),
        taken: vec![cluster_tag(1, 2)],
        refused: vec![],
    };
    x.fwd_add("y", &fwd).expect("add");
    x.fwd_add("y", &took).expect("add");
    let got = y.fwd_read(&start, 10).expect("read");
    assert_eq!(
        got.iter().map(|(_, e)| e.clone()).collect::<Vec<_>>(),
        vec![Some(fwd), Some(took)]
    );
    assert!(y.fwd_read(&got[1].0, 10).expect("read").is_empty());
    assert_eq!(y.fwd_end().expect("end"), got[1].0);
    assert!(
        x.fwd_read("0-0", 10).expect("read").is_empty(),
        "x's own stream is empty"
    );
    // An entry of a bad shape is skipped, and the stream goes on after it.
    let _: String = redis::cmd("XADD")
        .arg("ts:fwd:y")
        .arg("*")
        .arg(&["kind", "fwd", "from", "x", "platform", "tg", "a", "1,zz"][..])
        .query(&mut r.client())
        .expect("XADD");
    let good = FwdEntry::Forward {
        from: "x".into(),
        platform: "tg".into(),
        results: vec![cluster_tag(0, 1)],
    };
    x.fwd_add("y", &good).expect("add");
    let after: Vec<_> = y
        .fwd_read(&got[1].0, 10)
        .expect("read")
        .into_iter()
        .map(|(_, e)| e)
        .collect();
    assert_eq!(after, vec![None, Some(good)]);

    // Pushed past its bound, the stream keeps about FWD_MAXLEN (`MAXLEN ~` trims whole
    // nodes of 100 entries).
    let e = FwdEntry::Took {
        from: "x".into(),
        platform: "tg".into(),
        taken: vec![],
        refused: vec![],
    };
    for _ in 0..FWD_MAXLEN + 500 {
        x.fwd_add("y", &e).expect("add");
    }
    let len: usize = redis::cmd("XLEN")
        .arg("ts:fwd:y")
        .query(&mut r.client())
        .expect("XLEN");
    assert!(
        (FWD_MAXLEN..FWD_MAXLEN + 200).contains(&len),
        "{len} entries"
    );
}

#[test]
fn the_reader_records_hellos_forwards_to_the_newest_hellos_live_instance_and_carries_answers() {
    let Some(bin) = require_redis() else { return };
    let r = Redis::start(&bin);
    // A message with its outcome in Redis, as its owner would leave it.
    let chat = "5";
    let p = partition_of(&format!("tg:dm:{chat}"), P);
    let mut owner = store(&r, "b");
    let seq = match owner
        .accept(p, &format!("tg:dm:{chat}"), &msg("m1", chat), 10, now_ms())
        .expect("accept")
    {
        Accept::New { seq, .. } => seq,
        other => panic!("{other:?}"),
    };
    let lease = match owner.acquire(p).expect("acquire") {
        Acquire::Acquired(l) => l,
        other => panic!("{other:?}"),
    };
    let outcome = StoredOutcome {
        head: b"{\"op\":\"reply\",\"text\":\"".to_vec(),
        text: "answer".into(),
        tail: b"\"}\n".to_vec(),
        memory: None,
    };
    assert!(owner.outcome(&lease, seq, &outcome).expect("outcome"));
    let ct = cluster_tag(p, seq);

    let mut x = Reading::start(&r, "x");
    let mut y = Reading::start(&r, "y");
    let (mut xs, mut ys) = (store(&r, "x"), store(&r, "y"));
    xs.heartbeat().expect("heartbeat");
    ys.heartbeat().expect("heartbeat");
    y.reader.request(ClusterRequest::Hello("tg".into()));
    // The registry names y once its reader wrote it, and x's reader sends an offer only
    // to an instance its last read of the registry found live.
    x.until_live(&["x", "y"]);
    let mut offers = 0;
    while xlen(&r, "y") == 0 {
        x.reader.request(ClusterRequest::Forward {
            platform: "tg".into(),
            results: vec![ct, cluster_tag(p, seq + 100)],
        });
        x.marker();
        offers += 1;
        assert!(offers < 100, "never forwarded");
    }
    let forwarded = y.until("the forward", 1).remove(0);
    let Arrival::Forwarded {
        from,
        platform,
        results,
        missing,
    } = forwarded
    else {
        unreachable!()
    };
    assert_eq!((from.as_str(), platform.as_str()), ("x", "tg"));
    assert_eq!(missing, vec![cluster_tag(p, seq + 100)], "not in Redis");
    assert_eq!(results.len(), 1);
    assert_eq!(results[0].0, ct);
    assert_eq!(results[0].1.message.seq, ct, "numbered by its cluster tag");
    assert_eq!(results[0].1.message.id(), "m1");
    assert_eq!(
        results[0].1.outcome.as_ref().map(|o| o.text.as_str()),
        Some("answer")
    );
    // y's answer reaches x.
    y.reader.request(ClusterRequest::Took {
        to: "x".into(),
        platform: "tg".into(),
        taken: vec![ct],
        refused: vec![cluster_tag(p, seq + 100)],
    });
    let got = x.until("y's answer", 1);
    assert!(
        got.contains(&Arrival::Took {
            platform: "tg".into(),
            taken: vec![ct],
            refused: vec![cluster_tag(p, seq + 100)],
        }),
        "{got:?}"
    );
    drop(lease);
}

#[test]
fn the_reader_keeps_results_here_when_the_newest_hello_is_its_own_or_a_dead_instances() {
    let Some(bin) = require_redis() else { return };
    let r = Redis::start(&bin);
    let mut x = Reading::start(&r, "x");
    let mut xs = store(&r, "x");
    xs.heartbeat().expect("heartbeat");
    x.until_live(&["x"]);
    // "z" said the newest hello but is not in the registry; then x itself.
    store(&r, "z").set_hellos(&["tg".into()], 1).expect("hello");
    for round in 0..2 {
        if round == 1 {
            x.reader.request(ClusterRequest::Hello("tg".into()));
        }
        x.reader.request(ClusterRequest::Forward {
            platform: "tg".into(),
            results: vec![cluster_tag(0, 1)],
        });
        x.marker();
        // x's own stream has the markers only.
        assert_eq!(
            (xlen(&r, "z"), xlen(&r, "x")),
            (0, round + 1),
            "round {round}"
        );
    }
}

/// The reader's requests wait for Redis within their bound: past 4,096 a new one is dropped
/// and counted (the status says both); once Redis is back they are carried out in order.
#[test]
fn requests_wait_for_redis_within_their_bound_and_go_when_it_is_back() {
    let Some(bin) = require_redis() else { return };
    let mut r = Redis::start(&bin);
    let x = Reading::start(&r, "x");
    r.kill();
    let bound = 4096;
    x.reader.request(ClusterRequest::Hello("tg".into()));
    for i in 1..bound + 5 {
        x.reader.request(ClusterRequest::Hello(format!("p{i}")));
    }
    let status = || {
        let mut s = ClusterStatus::default();
        x.reader.fill_status(&mut s);
        s
    };
    eventually("five forward requests dropped", WAIT, || {
        holds(status(), |s| s.forward_requests_dropped >= 5).map_err(Box::new)
    });
    let s = status();
    assert_eq!((s.forward_requests, s.forward_requests_dropped), (bound, 5));
    r.restart();
    eventually("no forward request left", WAIT, || {
        holds(status(), |s| s.forward_requests == 0).map_err(Box::new)
    });
    let mut st = store(&r, "y");
    assert_eq!(
        st.hello_of("tg").expect("tg").map(|h| h.0),
        Some("x".into())
    );
    let last = format!("p{}", bound - 1);
    assert_eq!(
        st.hello_of(&last).expect("last").map(|h| h.0),
        Some("x".into())
    );
    let dropped = format!("p{bound}");
    assert_eq!(
        st.hello_of(&dropped).expect("dropped"),
        None,
        "past the bound"
    );
}

/// The instance that answers a forward with what it took becomes those messages' origin
/// (`ADOPT`), so that the partition's owner answers them again should it die before its
/// bridge confirmed them (tests/simulation_cluster, seed 23); a message gone from Redis
/// meanwhile (delivered) is not written back.
#[test]
fn an_answer_makes_the_taker_the_origin_of_what_it_took_and_nothing_else() {
    let Some(bin) = require_redis() else { return };
    let r = Redis::start(&bin);
    let chat = "7";
    let p = partition_of(&format!("tg:dm:{chat}"), P);
    let mut origin = store(&r, "a");
    let seq = match origin
        .accept(p, &format!("tg:dm:{chat}"), &msg("m1", chat), 10, now_ms())
        .expect("accept")
    {
        Accept::New { seq, .. } => seq,
        other => panic!("{other:?}"),
    };
    let origin_of = |seq: u64| -> Option<String> {
        redis::cmd("HGET")
            .arg(format!("ts:{{p{p}}}:m:{seq}"))
            .arg("o")
            .query(&mut r.client())
            .expect("HGET")
    };
    assert_eq!(origin_of(seq).as_deref(), Some("a"));
    let gone = seq + 100;
    let took = FwdEntry::Took {
        from: "y".into(),
        platform: "tg".into(),
        taken: vec![cluster_tag(p, seq), cluster_tag(p, gone)],
        refused: vec![],
    };
    store(&r, "y").fwd_add("a", &took).expect("answer");
    assert_eq!(
        origin_of(seq).as_deref(),
        Some("y"),
        "the taker is the origin"
    );
    let exists: bool = redis::cmd("EXISTS")
        .arg(format!("ts:{{p{p}}}:m:{gone}"))
        .query(&mut r.client())
        .expect("EXISTS");
    assert!(!exists, "a message gone from Redis stays gone");
    let loaded = origin.load_partition(p, now_ms()).expect("load");
    assert_eq!(loaded.origins.get(&seq).map(String::as_str), Some("y"));
}
