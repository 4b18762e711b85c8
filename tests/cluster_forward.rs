//! The hello registry's forwards, the bridge's part (`--cluster`, docs/cluster.md "Where
//! the result goes"): an instance holding results of a platform with no connection of it
//! offers them; the instance of the platform's newest hello takes what fits and answers;
//! only the answer drops the first one's copies. The reader's arrivals are played by hand,
//! as in tests/cluster_bridge.rs. No sockets, no threads, no sleeps.

use std::time::Duration;

use serde_json::{Value, json};
use turnstile::BridgeConfig;
use turnstile::internal::cluster::{Arrival, ClusterReport, ClusterRequest, cluster_tag};
use turnstile::internal::journal::Committed;
use turnstile::internal::server::{Action, Bridge, ConnId, Flushed};
use turnstile::{MessageFields, Record, RecoveredMessage, StoredMessage, StoredOutcome};

struct Net {
    b: Bridge,
    now: Duration,
    journal: Vec<Record>,
    requests: Vec<ClusterRequest>,
}

impl Net {
    fn new(cfg: BridgeConfig) -> Net {
        let mut b = Bridge::new(BridgeConfig {
            journal: true,
            ..cfg
        });
        b.set_partitions(4);
        Net {
            b,
            now: Duration::from_secs(1),
            journal: Vec::new(),
            requests: Vec::new(),
        }
    }

    fn pump(&mut self) {
        while let Some(a) = self.b.poll_action() {
            match a {
                Action::Journal(r) => self.journal.push(r),
                Action::Cluster(r) => self.requests.push(r),
                _ => {}
            }
        }
    }

    fn send(&mut self, c: ConnId, v: Value) {
        self.b.line(c, v.to_string().as_bytes(), self.now);
        self.pump();
    }

    fn connect(&mut self) -> ConnId {
        let c = self
            .b
            .connect("10.0.0.1".parse().expect("ip"), self.now)
            .expect("connect");
        self.send(c, json!({"op": "hello", "platform": "tg", "acks": true}));
        c
    }

    fn take(&mut self, c: ConnId) -> Vec<Value> {
        let mut w = Vec::new();
        loop {
            match self.b.write(c, &mut w, self.now).expect("write") {
                Flushed::All => break,
                Flushed::Budget => continue,
                Flushed::Blocked => unreachable!("a Vec never blocks"),
            }
        }
        self.b.acked(c, self.b.written(c));
        self.pump();
        w.split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_slice(l).expect("json"))
            .collect()
    }

    fn arrive(&mut self, a: Arrival) {
        self.b.arrived(a, self.now);
        self.pump();
    }

    fn tick_at(&mut self, now: Duration) {
        self.now = now;
        self.b.tick(now);
        self.pump();
    }

    /// The forwards asked for since the last call.
    fn forwards(&mut self) -> Vec<(String, Vec<u64>)> {
        let (f, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.requests)
            .into_iter()
            .partition(|r| matches!(r, ClusterRequest::Forward { .. }));
        self.requests = rest;
        f.into_iter()
            .filter_map(|r| match r {
                ClusterRequest::Forward { platform, results } => Some((platform, results)),
                _ => None,
            })
            .collect()
    }

    /// Message `id` sent on `c`, acked as owned elsewhere at `ct`.
    fn acked_remote(&mut self, c: ConnId, id: &str, ct: u64) -> u64 {
        self.send(
            c,
            json!({"op": "message", "id": id, "chat_id": "1", "text": "hi"}),
        );
        let seq = self
            .journal
            .iter()
            .rev()
            .find_map(|r| match r {
                Record::Accepted(m) if m.id() == id => Some(m.seq),
                _ => None,
            })
            .expect("accepted");
        let (c2, c2_cluster) = (
            Committed {
                taken: 1,
                ..Committed::default()
            },
            ClusterReport {
                placed: vec![(seq, ct)],
                remote: vec![seq],
                ..ClusterReport::default()
            },
        );
        self.b.journaled_with(c2, c2_cluster, self.now);
        self.pump();
        seq
    }
}

fn done(text: &str, id: &str) -> StoredOutcome {
    StoredOutcome {
        head: format!("{{\"op\":\"reply\",\"id\":\"{id}\",\"session\":\"tg:dm:1\",\"text\":\"")
            .into_bytes(),
        text: text.into(),
        tail: b"\"}\n".to_vec(),
        memory: None,
    }
}

fn stored(ct: u64, id: &str, platform: &str) -> Box<RecoveredMessage> {
    Box::new(RecoveredMessage {
        message: StoredMessage::new(ct, platform, MessageFields::new(id, "1", "hi"), 0),
        starts: 1,
        outcome: Some(done(&format!("re {id}"), id)),
    })
}

#[test]
fn each_hello_is_told_to_the_registry() {
    let mut n = Net::new(BridgeConfig::default());
    let _c = n.connect();
    assert_eq!(n.requests, vec![ClusterRequest::Hello("tg".into())]);
}

#[test]
fn a_result_whose_connection_is_gone_is_offered_again_until_taken_and_only_then_dropped() {
    let mut n = Net::new(BridgeConfig::default());
    let c = n.connect();
    let _ = n.take(c);
    let (g1, g2) = (cluster_tag(1, 7), cluster_tag(2, 8));
    n.acked_remote(c, "m1", g1);
    let m2 = n.acked_remote(c, "m2", g2);
    let _ = n.take(c);
    n.b.disconnected(c);
    n.pump();
    for (g, id) in [(g1, "m1"), (g2, "m2")] {
        n.arrive(Arrival::Outcome {
            partition: 1,
            tag: g,
            outcome: done("r", id),
        });
    }
    assert_eq!(
        n.b.backlog().outboxed,
        2,
        "no connection: both wait in the outbox"
    );
    let t0 = n.now + Duration::from_secs(1);
    n.tick_at(t0);
    assert_eq!(n.forwards(), vec![("tg".to_string(), vec![g1, g2])]);
    // Not again while the offer waits for its answer...
    n.tick_at(t0 + Duration::from_millis(500));
    assert!(n.forwards().is_empty());
    // ... until it is a second old (the target may have died with it).
    n.tick_at(t0 + Duration::from_millis(1000));
    assert_eq!(n.forwards(), vec![("tg".to_string(), vec![g1, g2])]);
    assert_eq!(
        n.b.cluster_status().forwards_waiting,
        2,
        "offered and unanswered"
    );
    // A refusal leaves them; the answer that takes one drops that one only.
    n.arrive(Arrival::Took {
        platform: "tg".into(),
        taken: vec![],
        refused: vec![g1, g2],
    });
    assert_eq!(n.b.backlog().outboxed, 2);
    n.arrive(Arrival::Took {
        platform: "tg".into(),
        taken: vec![g2],
        refused: vec![g1],
    });
    assert_eq!(n.b.backlog().outboxed, 1);
    assert_eq!(n.b.cluster_status().forwarded_out, 1, "one taken away");
    assert!(
        !n.journal
            .iter()
            .any(|r| matches!(r, Record::Delivered { .. })),
        "the taker delivers it: nothing written here"
    );
    // The journal thread forgets the taken one's tag (its `delivered` never comes here).
    let untags: Vec<ClusterRequest> = std::mem::take(&mut n.requests)
        .into_iter()
        .filter(|r| matches!(r, ClusterRequest::Untag(_)))
        .collect();
    assert_eq!(untags, vec![ClusterRequest::Untag(m2)]);
    // The one left still goes to the platform's next hello here.
    let c2 = n.connect();
    let lines = n.take(c2);
    let ids: Vec<&str> = lines.iter().filter_map(|l| l["id"].as_str()).collect();
    assert_eq!(ids, vec!["m1"], "{lines:?}");
    n.tick_at(t0 + Duration::from_secs(5));
    assert!(
        n.forwards().is_empty(),
        "a connection here: nothing offered"
    );
}

#[test]
fn a_forwarded_result_is_taken_marked_within_the_platforms_bounds_once_and_delivered_here() {
    let mut n = Net::new(BridgeConfig {
        outbox_cap: 2,
        ..BridgeConfig::default()
    });
    let c = n.connect();
    let _ = n.take(c);
    n.requests.clear();
    let g: Vec<u64> = (1..=3).map(|s| cluster_tag(3, s)).collect();
    let results = |ids: &[(u64, &str)]| {
        ids.iter()
            .map(|&(t, id)| (t, stored(t, id, "tg")))
            .collect()
    };
    n.arrive(Arrival::Forwarded {
        from: "x".into(),
        platform: "tg".into(),
        results: results(&[(g[0], "m1"), (g[1], "m2"), (g[2], "m3")]),
        missing: vec![cluster_tag(3, 9)],
    });
    // The third is past --outbox-cap (2): refused, left with x.
    assert_eq!(
        n.requests,
        vec![ClusterRequest::Took {
            to: "x".into(),
            platform: "tg".into(),
            taken: vec![g[0], g[1]],
            refused: vec![cluster_tag(3, 9), g[2]],
        }]
    );
    n.requests.clear();
    // Offered again (its answer lost): taken again, sent once.
    n.arrive(Arrival::Forwarded {
        from: "x".into(),
        platform: "tg".into(),
        results: results(&[(g[0], "m1")]),
        missing: vec![],
    });
    assert!(
        matches!(&n.requests[..], [ClusterRequest::Took { taken, .. }] if taken == &vec![g[0]])
    );
    let lines = n.take(c);
    let ids: Vec<&str> = lines.iter().filter_map(|l| l["id"].as_str()).collect();
    assert_eq!(ids, vec!["m1", "m2"], "{lines:?}");
    assert!(lines.iter().all(|l| l["redelivery"] == true), "{lines:?}");
    let s = n.b.cluster_status();
    let (taken, refused) = (s.forwarded_in, s.forwards_refused);
    assert_eq!(
        (taken, refused),
        (2, 2),
        "the one taken again is not counted again"
    );
    // Their `delivered` removes the messages, by their place in Redis.
    n.send(c, json!({"op": "delivered", "ids": ["m1", "m2"]}));
    for t in [g[0], g[1]] {
        assert!(
            n.journal
                .iter()
                .any(|r| matches!(r, Record::Delivered { seq } if *seq == t)),
            "{:?}",
            n.journal
        );
    }
}

#[test]
fn a_forward_to_an_instance_with_no_connection_of_the_platform_is_refused() {
    let mut n = Net::new(BridgeConfig::default());
    let g = cluster_tag(0, 1);
    n.arrive(Arrival::Forwarded {
        from: "x".into(),
        platform: "tg".into(),
        results: vec![(g, stored(g, "m1", "tg"))],
        missing: vec![],
    });
    assert_eq!(
        n.requests,
        vec![ClusterRequest::Took {
            to: "x".into(),
            platform: "tg".into(),
            taken: vec![],
            refused: vec![g],
        }]
    );
    assert_eq!(n.b.backlog().outboxed, 0);
}
