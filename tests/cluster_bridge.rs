//! The sans-IO bridge as a cluster member (`--cluster`): the journal thread's cluster
//! reports and the stream reader's arrivals played by hand, as tests/bridge.rs plays the
//! runtime. No sockets, no threads, no sleeps.

use std::time::Duration;

use serde_json::{Value, json};
use turnstile::BridgeConfig;
use turnstile::CancelReason;
use turnstile::internal::cluster::{Arrival, ClusterReport, cluster_tag, tag_parts};
use turnstile::internal::journal::Committed;
use turnstile::internal::server::{Action, Bridge, ConnId, Flushed};
use turnstile::{AcceptState, MessageEvent, TurnId};
use turnstile::{EventKind, Message, Outcome, SessionKey};
use turnstile::{MessageFields, Record, RecoveredMessage, StoredMessage, StoredOutcome};

struct Net {
    b: Bridge,
    now: Duration,
    journal: Vec<Record>,
    submitted: Vec<u64>,
    messages: Vec<Message>,
    /// The sessions each `HandOver` action named.
    handed: Vec<Vec<SessionKey>>,
    /// Submissions and hand-overs, in the order they were asked for.
    order: Vec<String>,
}

impl Net {
    fn new() -> Net {
        let cfg = BridgeConfig {
            journal: true,
            ..BridgeConfig::default()
        };
        Net {
            b: Bridge::new(cfg),
            now: Duration::from_secs(1),
            journal: Vec::new(),
            submitted: Vec::new(),
            messages: Vec::new(),
            handed: Vec::new(),
            order: Vec::new(),
        }
    }

    fn pump(&mut self) {
        while let Some(a) = self.b.poll_action() {
            match a {
                Action::Journal(r) => self.journal.push(r),
                Action::Submit { tag, message } => {
                    self.order.push(format!("submit {}", message.id));
                    self.submitted.push(tag);
                    self.messages.push(message);
                }
                Action::HandOver(sessions) => {
                    self.order.push(format!("hand over {}", sessions.len()));
                    self.handed.push(sessions);
                }
                Action::ReleasePartition(p) => self.order.push(format!("release {p}")),
                Action::StartTurn(turn) => self.order.push(format!("start {}", turn.0)),
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

    /// The accepted records asked for so far, taken.
    fn accepted(&mut self) -> Vec<StoredMessage> {
        let (acc, rest): (Vec<Record>, Vec<Record>) = std::mem::take(&mut self.journal)
            .into_iter()
            .partition(|r| matches!(r, Record::Accepted(_)));
        self.journal = rest;
        acc.into_iter()
            .filter_map(|r| match r {
                Record::Accepted(m) => Some(m),
                _ => None,
            })
            .collect()
    }

    fn arrive(&mut self, a: Arrival) {
        self.b.arrived(a, self.now);
        self.pump();
    }

    /// The journal thread's report; the stream reader is taken to have passed the inbox
    /// entries of the messages it places already (it may be ahead of the report or behind
    /// it: `reader_behind` plays the other case).
    fn journaled_with(&mut self, c: Committed, cluster: ClusterReport, now: Duration) {
        for &(_, ct) in &cluster.placed {
            let (partition, seq) = tag_parts(ct).expect("a cluster tag");
            self.b.arrived(Arrival::Reached { partition, seq }, now);
        }
        self.b.journaled_with(c, cluster, now);
        self.pump();
    }

    /// As `journaled_with`, the reader not yet past the inbox entries of what it places.
    fn reader_behind(&mut self, c: Committed, cluster: ClusterReport) {
        self.b.journaled_with(c, cluster, self.now);
        self.pump();
    }

    fn report(&mut self, taken: usize, cluster: ClusterReport) {
        let (c, c_cluster) = (
            Committed {
                taken,
                ..Committed::default()
            },
            cluster,
        );
        self.journaled_with(c, c_cluster, self.now);
        self.pump();
    }
}

impl Net {
    /// Partition `p` owned here, m1 (chat 1) accepted on a new connection and placed in
    /// Redis as `ct`: the connection, m1's acceptance and the message submitted.
    fn placed_m1(&mut self, p: u32, ct: u64) -> (ConnId, StoredMessage, Message) {
        let c = self.connect();
        let _ = self.take(c);
        let mut gained = ClusterReport::default();
        gained.gained.push((p, Default::default()));
        self.report(0, gained);
        self.send(
            c,
            json!({"op": "message", "id": "m1", "chat_id": "1", "text": "hi"}),
        );
        let m = self.accepted().pop().expect("accepted");
        self.report_durable(m.seq, ct);
        let message = self.messages.pop().expect("message");
        (c, m, message)
    }

    /// The journal says accepted message `seq` is durable in Redis as `ct`, in a partition
    /// owned here.
    fn report_durable(&mut self, seq: u64, ct: u64) {
        let (durable, durable_cluster) = (
            Committed {
                taken: 1,
                durable: vec![seq],
                ..Committed::default()
            },
            ClusterReport {
                placed: vec![(seq, ct)],
                ..ClusterReport::default()
            },
        );
        self.journaled_with(durable, durable_cluster, self.now);
        self.pump();
    }
}

fn done(text: &str, id: &str) -> StoredOutcome {
    StoredOutcome {
        head: format!("{{\"op\":\"done\",\"id\":\"{id}\",\"session\":\"tg:dm:1\",\"text\":\"")
            .into_bytes(),
        text: text.into(),
        tail: b"\"}\n".to_vec(),
        memory: None,
    }
}

#[test]
fn a_message_owned_elsewhere_is_acked_once_durable_answered_from_the_stream_and_delivered_here() {
    let mut n = Net::new();
    let c = n.connect();
    let _ = n.take(c);
    n.send(
        c,
        json!({"op": "message", "id": "m1", "chat_id": "1", "text": "hi"}),
    );
    assert!(n.take(c).is_empty(), "no ack before Redis has it");
    let m = n.accepted().pop().expect("an accepted record");
    let g = cluster_tag(3, 17);
    n.report(
        1,
        ClusterReport {
            placed: vec![(m.seq, g)],
            remote: vec![m.seq],
            ..ClusterReport::default()
        },
    );
    let lines = n.take(c);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(
        (lines[0]["op"].as_str(), lines[0]["state"].as_str()),
        (Some("ack"), Some("queued"))
    );
    assert!(n.submitted.is_empty(), "owned elsewhere: never run here");
    assert_eq!(n.b.cluster_status().remote_waiting, 1);

    // An outcome for another instance's message changes nothing; this one's goes out.
    n.arrive(Arrival::Outcome {
        partition: 3,
        tag: cluster_tag(3, 99),
        outcome: done("not yours", "m9"),
    });
    assert!(n.take(c).is_empty());
    n.arrive(Arrival::Outcome {
        partition: 3,
        tag: g,
        outcome: done("hello from b", "m1"),
    });
    let lines = n.take(c);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["text"], "hello from b");
    assert_eq!(n.b.cluster_status().remote_waiting, 0);
    assert!(
        !n.journal
            .iter()
            .any(|r| matches!(r, Record::Outcome { .. })),
        "the owner wrote the outcome; no second record"
    );
    // The bridge confirms it: `delivered` names the bridge's tag (the thread maps it).
    n.send(c, json!({"op": "delivered", "ids": ["m1"]}));
    assert!(
        n.journal
            .iter()
            .any(|r| matches!(r, Record::Delivered { seq } if *seq == m.seq)),
        "{:?}",
        n.journal
    );
}

#[test]
fn a_cluster_duplicate_is_answered_as_one_and_a_full_session_is_refused() {
    let mut n = Net::new();
    let c = n.connect();
    let _ = n.take(c);
    n.send(
        c,
        json!({"op": "message", "id": "m1", "chat_id": "1", "text": "a"}),
    );
    n.send(
        c,
        json!({"op": "message", "id": "m2", "chat_id": "1", "text": "b"}),
    );
    let acc = n.accepted();
    assert_eq!(acc.len(), 2);
    n.report(
        2,
        ClusterReport {
            duplicates: vec![acc[0].seq],
            session_full: vec![acc[1].seq],
            ..ClusterReport::default()
        },
    );
    let lines = n.take(c);
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[0]["op"], "ack");
    assert_eq!(lines[0]["state"], "duplicate", "{:?}", lines[0]);
    assert_eq!(
        (lines[1]["op"].as_str(), lines[1]["reason"].as_str()),
        (Some("reject"), Some("queue_full"))
    );
    assert!(n.submitted.is_empty());
    // Still a duplicate here too.
    n.send(
        c,
        json!({"op": "message", "id": "m1", "chat_id": "1", "text": "a"}),
    );
    let lines = n.take(c);
    assert_eq!(lines[0]["state"], "duplicate", "{lines:?}");
}

#[test]
fn a_gained_partition_and_the_inbox_queue_their_messages_here_and_a_lost_one_is_handed_over() {
    let mut n = Net::new();
    let c = n.connect();
    let _ = n.take(c);
    let stored = |seq: u64, id: &str| RecoveredMessage {
        message: StoredMessage::new(
            seq,
            "tg",
            MessageFields::new(id, "5", &format!("text of {id}")),
            u64::MAX / 4,
        ),
        starts: 0,
        outcome: None,
    };
    let (g1, g2) = (cluster_tag(2, 1), cluster_tag(2, 2));
    let mut loaded = turnstile::internal::cluster::LoadedPartition::default();
    loaded.recovered.messages.push(stored(g1, "m1"));
    n.report(
        0,
        ClusterReport {
            gained: vec![(2, loaded)],
            ..ClusterReport::default()
        },
    );
    assert_eq!(n.submitted, vec![g1], "rebuilt as recovery does");
    n.arrive(Arrival::Message {
        partition: 2,
        tag: g2,
        message: Box::new(stored(g2, "m2")),
        origin: "b".into(),
    });
    // Known already: not queued twice.
    n.arrive(Arrival::Message {
        partition: 2,
        tag: g2,
        message: Box::new(stored(g2, "m2")),
        origin: "b".into(),
    });
    assert_eq!(n.submitted, vec![g1, g2]);
    n.report(
        0,
        ClusterReport {
            lost: vec![2],
            fenced: vec![2, 5],
            ..ClusterReport::default()
        },
    );
    // Handed over once (5 was never owned here): both messages, accepted elsewhere, leave.
    assert_eq!(n.handed.len(), 1);
    assert_eq!(handed_over(&n.b), (1, 2));
    assert!(n.b.cluster_status().owned.is_empty());
    // Read before the hand-over: not queued here.
    n.arrive(Arrival::Message {
        partition: 2,
        tag: cluster_tag(2, 3),
        message: Box::new(stored(cluster_tag(2, 3), "m3")),
        origin: "b".into(),
    });
    assert_eq!(n.submitted, vec![g1, g2]);
}

#[test]
fn an_outcome_the_store_did_not_write_is_never_sent() {
    let mut n = Net::new();
    let c = n.connect();
    let _ = n.take(c);
    n.send(
        c,
        json!({"op": "message", "id": "m1", "chat_id": "1", "text": "hi"}),
    );
    let m = n.accepted().pop().expect("accepted");
    // Owned here: submitted, accepted, run, finished.
    let durable = Committed {
        taken: 1,
        durable: vec![m.seq],
        ..Committed::default()
    };
    n.b.journaled(durable, n.now);
    n.pump();
    assert_eq!(n.submitted, vec![m.seq]);
    let message = n.messages.pop().expect("message");
    let event = |kind| MessageEvent {
        id: message.id.clone(),
        session: message.session.clone(),
        kind,
    };
    n.b.event(
        m.seq,
        event(EventKind::Accepted {
            state: AcceptState::Running,
            position: 0,
        }),
        n.now,
    );
    n.b.event(
        m.seq,
        event(EventKind::Finished(Outcome::Reply("ran".into()))),
        n.now,
    );
    n.pump();
    assert_eq!(
        n.take(c).len(),
        1,
        "the ack only: the reply waits for its record"
    );
    assert!(
        n.journal
            .iter()
            .any(|r| matches!(r, Record::Outcome { seq, .. } if *seq == m.seq))
    );
    // The batch went through, but this outcome was fenced: it never goes out, not with this
    // batch and not with the next.
    let taken = n.journal.len();
    n.journal.clear();
    let (fenced, fenced_cluster) = (
        Committed {
            taken,
            outcomes: vec![m.seq],
            ..Committed::default()
        },
        ClusterReport {
            fenced: vec![0],
            unwritten_outcomes: vec![m.seq],
            ..ClusterReport::default()
        },
    );
    n.journaled_with(fenced, fenced_cluster, n.now);
    n.pump();
    n.report(0, ClusterReport::default());
    assert!(n.take(c).is_empty(), "a fenced outcome reached the bridge");
    assert_eq!(
        n.b.status().journal.map(|j| j.unjournaled_outcomes),
        Some(0),
        "and it is not held either"
    );
}

/// A lost partition's messages leave this instance in place: the runtime is told to hand
/// their sessions over, nothing the runtime says of them afterwards is recorded or sent
/// (not a late reply, not a cancellation), the ones accepted here wait for the next owner's
/// outcome from the stream and get it, and the other partition's message goes on as before.
#[test]
fn a_lost_partition_hands_its_messages_over_without_outcomes_and_the_rest_serves_on() {
    let mut n = Net::new();
    let c = n.connect();
    let _ = n.take(c);
    let mut gained = ClusterReport::default();
    for p in [3, 4] {
        gained.gained.push((p, Default::default()));
    }
    n.report(0, gained);
    assert_eq!(n.b.cluster_status().owned, vec![3, 4]);
    for (id, chat) in [("m1", "1"), ("m2", "1"), ("m3", "2")] {
        n.send(
            c,
            json!({"op": "message", "id": id, "chat_id": chat, "text": id}),
        );
    }
    let acc = n.accepted();
    let (ct1, ct2, ct3) = (cluster_tag(3, 1), cluster_tag(3, 2), cluster_tag(4, 1));
    let (placed, placed_cluster) = (
        Committed {
            taken: 3,
            durable: acc.iter().map(|m| m.seq).collect(),
            ..Committed::default()
        },
        ClusterReport {
            placed: vec![(acc[0].seq, ct1), (acc[1].seq, ct2), (acc[2].seq, ct3)],
            ..ClusterReport::default()
        },
    );
    n.journaled_with(placed, placed_cluster, n.now);
    n.pump();
    // Accepted elsewhere into partition 3: queued here too.
    let other = cluster_tag(3, 9);
    let mut inbox = RecoveredMessage {
        message: acc[0].clone(),
        starts: 0,
        outcome: None,
    };
    (
        inbox.message.seq,
        inbox.message.fields.id,
        inbox.message.fields.chat_id,
    ) = (other, "x".into(), "7".into());
    n.arrive(Arrival::Message {
        partition: 3,
        tag: other,
        message: Box::new(inbox),
        origin: "b".into(),
    });
    assert_eq!(n.submitted.len(), 4);
    let messages = std::mem::take(&mut n.messages);
    let event = |i: usize, kind| MessageEvent {
        id: messages[i].id.clone(),
        session: messages[i].session.clone(),
        kind,
    };
    let running = EventKind::Accepted {
        state: AcceptState::Running,
        position: 0,
    };
    let queued = EventKind::Accepted {
        state: AcceptState::Queued,
        position: 1,
    };
    n.b.event(n.submitted[0], event(0, running.clone()), n.now);
    n.b.event(n.submitted[1], event(1, queued), n.now);
    n.b.event(n.submitted[2], event(2, running), n.now);
    n.pump();
    let _ = n.take(c);
    n.journal.clear();

    n.report(
        0,
        ClusterReport {
            lost: vec![3],
            ..ClusterReport::default()
        },
    );
    let mut handed: Vec<String> = n.handed.concat().iter().map(|k| k.to_string()).collect();
    handed.sort();
    assert_eq!(handed, vec!["tg:dm:1", "tg:dm:7"]);
    assert_eq!(handed_over(&n.b), (1, 3));
    assert_eq!(n.b.cluster_status().owned, vec![4]);
    assert_eq!(
        n.b.cluster_status().remote_waiting,
        2,
        "m1 and m2 wait for the next owner"
    );

    // What the runtime says of them now: discarded.
    let cancelled = || EventKind::Finished(Outcome::Cancelled(CancelReason::HandedOver));
    n.b.event(n.submitted[1], event(1, cancelled()), n.now);
    n.b.event(n.submitted[3], event(3, cancelled()), n.now);
    n.b.event(
        n.submitted[0],
        event(0, EventKind::Finished(Outcome::Reply("late".into()))),
        n.now,
    );
    // The other partition's turn ends as ever: its outcome is recorded.
    n.b.event(
        n.submitted[2],
        event(2, EventKind::Finished(Outcome::Reply("m3 done".into()))),
        n.now,
    );
    n.pump();
    let outcomes: Vec<u64> = n
        .journal
        .iter()
        .filter_map(|r| match r {
            Record::Outcome { seq, .. } => Some(*seq),
            _ => None,
        })
        .collect();
    assert_eq!(
        outcomes,
        vec![n.submitted[2]],
        "no outcome of a handed-over message"
    );
    assert!(n.take(c).is_empty(), "nothing sent before the records");

    // The next owner's outcome comes by the stream, once.
    n.arrive(Arrival::Outcome {
        partition: 3,
        tag: ct1,
        outcome: done("m1 by the next owner", "m1"),
    });
    let lines = n.take(c);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["text"], "m1 by the next owner");
    assert_eq!(n.b.cluster_status().remote_waiting, 1);
    // Lost again (a second report of it): nothing more.
    n.report(
        0,
        ClusterReport {
            fenced: vec![3],
            ..ClusterReport::default()
        },
    );
    assert_eq!((n.handed.len(), handed_over(&n.b)), (1, (1, 3)));
}

/// A message made durable by the report that also loses its partition is submitted before
/// its session is handed over (so it ends with it, in the runtime's order) and waits for the
/// next owner's outcome; a partition gained again afterwards is rebuilt from its load, and
/// its message runs here again, its results going out as any other.
#[test]
fn a_message_durable_in_the_report_that_loses_its_partition_ends_with_it_and_a_regain_rebuilds_it()
{
    let mut n = Net::new();
    let c = n.connect();
    let _ = n.take(c);
    let mut gained = ClusterReport::default();
    gained.gained.push((1, Default::default()));
    n.report(0, gained);
    n.send(
        c,
        json!({"op": "message", "id": "m1", "chat_id": "1", "text": "hi"}),
    );
    let m = n.accepted().pop().expect("accepted");
    let ct = cluster_tag(1, 1);
    let (both, both_cluster) = (
        Committed {
            taken: 1,
            durable: vec![m.seq],
            ..Committed::default()
        },
        ClusterReport {
            placed: vec![(m.seq, ct)],
            lost: vec![1],
            ..ClusterReport::default()
        },
    );
    n.journaled_with(both, both_cluster, n.now);
    n.pump();
    assert_eq!(n.order, vec!["submit m1", "hand over 1"]);
    assert_eq!(
        (n.b.cluster_status().remote_waiting, handed_over(&n.b)),
        (1, (1, 1))
    );
    let message = n.messages.pop().expect("message");
    let event = |kind| MessageEvent {
        id: message.id.clone(),
        session: message.session.clone(),
        kind,
    };
    // The runtime accepts it (the ack goes: it is durable), then ends it handed over.
    n.b.event(
        m.seq,
        event(EventKind::Accepted {
            state: AcceptState::Running,
            position: 0,
        }),
        n.now,
    );
    n.b.event(
        m.seq,
        event(EventKind::Finished(Outcome::Cancelled(
            CancelReason::HandedOver,
        ))),
        n.now,
    );
    n.pump();
    let lines = n.take(c);
    assert_eq!(lines.len(), 1, "the ack only: {lines:?}");
    assert_eq!(lines[0]["op"], "ack");

    // Gained again: the load has it, not started; it runs here and its result goes out.
    let mut loaded = turnstile::internal::cluster::LoadedPartition::default();
    loaded.recovered.messages.push(RecoveredMessage {
        message: m.clone(),
        starts: 0,
        outcome: None,
    });
    let mut again = ClusterReport::default();
    again.gained.push((1, loaded));
    n.report(0, again);
    assert_eq!(
        n.b.cluster_status().remote_waiting,
        0,
        "taken back from its wait"
    );
    assert_eq!(n.submitted, vec![m.seq, m.seq], "submitted again");
    n.journal.clear();
    n.b.event(
        m.seq,
        event(EventKind::Finished(Outcome::Reply("ran again".into()))),
        n.now,
    );
    n.pump();
    assert!(
        n.journal
            .iter()
            .any(|r| matches!(r, Record::Outcome { seq, .. } if *seq == m.seq)),
        "its outcome is recorded again: {:?}",
        n.journal
    );
}

/// The outcome record of a message accepted here is refused (its partition was taken while
/// its turn ran): its terminal event is never sent, and the next owner's outcome, from the
/// stream, goes to its connection instead — the message is answered once, not lost.
#[test]
fn a_refused_outcome_of_a_message_accepted_here_is_answered_by_the_next_owner() {
    let mut n = Net::new();
    let c = n.connect();
    let _ = n.take(c);
    let mut gained = ClusterReport::default();
    gained.gained.push((0, Default::default()));
    n.report(0, gained);
    n.send(
        c,
        json!({"op": "message", "id": "m1", "chat_id": "1", "text": "hi"}),
    );
    let m = n.accepted().pop().expect("accepted");
    let ct = cluster_tag(0, 1);
    let (durable, durable_cluster) = (
        Committed {
            taken: 1,
            durable: vec![m.seq],
            ..Committed::default()
        },
        ClusterReport {
            placed: vec![(m.seq, ct)],
            ..ClusterReport::default()
        },
    );
    n.journaled_with(durable, durable_cluster, n.now);
    n.pump();
    let message = n.messages.pop().expect("message");
    let event = |kind| MessageEvent {
        id: message.id.clone(),
        session: message.session.clone(),
        kind,
    };
    n.b.event(
        m.seq,
        event(EventKind::Accepted {
            state: AcceptState::Running,
            position: 0,
        }),
        n.now,
    );
    n.b.event(
        m.seq,
        event(EventKind::Finished(Outcome::Reply("ran here".into()))),
        n.now,
    );
    n.pump();
    assert_eq!(n.take(c).len(), 1, "the ack only");
    let taken = n.journal.len();
    let (fenced, fenced_cluster) = (
        Committed {
            taken,
            outcomes: vec![m.seq],
            ..Committed::default()
        },
        ClusterReport {
            fenced: vec![0],
            unwritten_outcomes: vec![m.seq],
            ..ClusterReport::default()
        },
    );
    n.journaled_with(fenced, fenced_cluster, n.now);
    n.pump();
    assert!(n.take(c).is_empty(), "a refused outcome reached the bridge");
    n.arrive(Arrival::Outcome {
        partition: 0,
        tag: ct,
        outcome: done("by the next owner", "m1"),
    });
    let lines = n.take(c);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["text"], "by the next owner");
    // Once only.
    n.arrive(Arrival::Outcome {
        partition: 0,
        tag: ct,
        outcome: done("by the next owner", "m1"),
    });
    assert!(n.take(c).is_empty());
}

/// Partition 3 owned here, with three messages in two sessions: m1 running (its `started`
/// record written and durable), m2 queued behind it, m3 queued in another session. Returns
/// the net, the connection, and each message's tag and event builder.
fn draining_setup() -> (Net, ConnId, Vec<u64>, Vec<Message>) {
    let mut n = Net::new();
    let c = n.connect();
    let _ = untyped(n.take(c));
    let mut gained = ClusterReport::default();
    gained.gained.push((3, Default::default()));
    gained.gained.push((4, Default::default()));
    n.report(0, gained);
    for (id, chat) in [("m1", "1"), ("m2", "1"), ("m3", "2")] {
        n.send(
            c,
            json!({"op": "message", "id": id, "chat_id": chat, "text": id}),
        );
    }
    let acc = n.accepted();
    let (placed, placed_cluster) = (
        Committed {
            taken: 3,
            durable: acc.iter().map(|m| m.seq).collect(),
            ..Committed::default()
        },
        ClusterReport {
            placed: (0..3)
                .map(|i| (acc[i].seq, cluster_tag(3, i as u64 + 1)))
                .collect(),
            ..ClusterReport::default()
        },
    );
    n.journaled_with(placed, placed_cluster, n.now);
    n.pump();
    let tags = n.submitted.clone();
    let messages = std::mem::take(&mut n.messages);
    let ev = |i: usize, kind| MessageEvent {
        id: messages[i].id.clone(),
        session: messages[i].session.clone(),
        kind,
    };
    let running = EventKind::Accepted {
        state: AcceptState::Running,
        position: 0,
    };
    let queued = EventKind::Accepted {
        state: AcceptState::Queued,
        position: 1,
    };
    n.b.event(tags[0], ev(0, running), n.now);
    n.b.event(tags[1], ev(1, queued.clone()), n.now);
    n.b.event(tags[2], ev(2, queued), n.now);
    n.b.event(tags[0], ev(0, EventKind::TurnStarted(TurnId(1))), n.now);
    n.pump();
    // m1's `started` is durable: it runs.
    let taken = std::mem::take(&mut n.journal).len();
    n.report(taken, ClusterReport::default());
    assert_eq!(n.order.last().map(String::as_str), Some("start 1"));
    let acks = untyped(n.take(c));
    assert_eq!(acks.len(), 3, "{acks:?}");
    (n, c, tags, messages)
}

fn event_of(m: &Message, kind: EventKind) -> MessageEvent {
    MessageEvent {
        id: m.id.clone(),
        session: m.session.clone(),
        kind,
    }
}

/// A drained partition (the planned release when an instance joins): the session with no
/// turn in progress leaves at once; the running turn is not cut off — it ends, its outcome
/// record is written and its result sent — and only then does its session leave and the
/// journal thread get the release; the queued message behind it is claimed meanwhile but its
/// turn never starts here (no `started` record): the next owner finds it not started, so it
/// is never `interrupted by restart`. Inbox arrivals for it are not queued meanwhile.
#[test]
fn a_draining_partition_starts_no_turn_and_is_released_only_once_its_running_turns_outcome_is_written()
 {
    let (mut n, c, tags, messages) = draining_setup();
    n.order.clear();
    n.report(
        0,
        ClusterReport {
            draining: vec![3],
            ..ClusterReport::default()
        },
    );
    // Session 2 has no turn in progress: handed over at once; session 1 waits for m1.
    let handed: Vec<String> = n.handed.concat().iter().map(|k| k.to_string()).collect();
    assert_eq!(handed, vec!["tg:dm:2"]);
    assert_eq!(n.order, vec!["hand over 1"], "no release while m1 runs");
    assert_eq!(n.b.cluster_status().draining, vec![3]);
    assert_eq!(
        n.b.cluster_status().owned,
        vec![3, 4],
        "owned until released"
    );

    // Another instance's message into the draining partition: not queued here.
    let mut inbox = RecoveredMessage {
        message: n.accepted().pop().unwrap_or_else(|| {
            StoredMessage::new(0, "tg", MessageFields::new("x", "7", "x"), u64::MAX / 4)
        }),
        starts: 0,
        outcome: None,
    };
    inbox.message.seq = cluster_tag(3, 9);
    n.arrive(Arrival::Message {
        partition: 3,
        tag: cluster_tag(3, 9),
        message: Box::new(inbox),
        origin: "b".into(),
    });
    assert_eq!(
        n.submitted, tags,
        "an inbox arrival of a draining partition queued here"
    );

    // m1 ends; the runtime claims m2 next: its turn is held, no `started` record.
    n.b.event(
        tags[0],
        event_of(
            &messages[0],
            EventKind::Finished(Outcome::Reply("m1 done".into())),
        ),
        n.now,
    );
    n.b.event(
        tags[1],
        event_of(&messages[1], EventKind::TurnStarted(TurnId(2))),
        n.now,
    );
    n.pump();
    assert!(
        !n.journal
            .iter()
            .any(|r| matches!(r, Record::Started { seq, .. } if *seq == tags[1])),
        "a turn started in a draining partition: {:?}",
        n.journal
    );
    assert!(
        !n.order.iter().any(|o| o.starts_with("release")),
        "released before m1's outcome was written: {:?}",
        n.order
    );
    assert!(
        untyped(n.take(c)).is_empty(),
        "m1's reply before its record"
    );
    // Its outcome record is durable: the reply goes, then session 1 leaves, then the release.
    let taken = std::mem::take(&mut n.journal).len();
    let written = Committed {
        taken,
        outcomes: vec![tags[0]],
        ..Committed::default()
    };
    n.b.journaled(written, n.now);
    n.pump();
    let lines = untyped(n.take(c));
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["text"], "m1 done");
    assert_eq!(n.order, vec!["hand over 1", "hand over 1", "release 3"]);
    assert_eq!(drained(&n.b), (1, 2), "m2 and m3 handed over");
    assert_eq!(n.b.cluster_status().owned, vec![4]);
    assert!(n.b.cluster_status().draining.is_empty());
    assert_eq!(
        n.b.cluster_status().remote_waiting,
        2,
        "m2 and m3 wait for the next owner's outcome"
    );
    // The held turn ends handed over: nothing recorded, nothing sent.
    n.b.event(
        tags[1],
        event_of(
            &messages[1],
            EventKind::Finished(Outcome::Cancelled(CancelReason::HandedOver)),
        ),
        n.now,
    );
    n.pump();
    assert!(n.journal.is_empty(), "{:?}", n.journal);
    assert!(untyped(n.take(c)).is_empty());
    // The journal thread's report of the release (`lost`) changes nothing more.
    n.report(
        0,
        ClusterReport {
            lost: vec![3],
            ..ClusterReport::default()
        },
    );
    assert_eq!(
        handed_over(&n.b),
        (0, 0),
        "a drained partition is not a lost one"
    );
    assert_eq!(n.order.len(), 3);
}

/// The drain's bound: the journal thread gives a drain up past `ClusterConfig::drain` and
/// reports the partition lost; the running turn is then cut off as a lost partition's is
/// (handed over, its result discarded), and the bridge never asks for a second release.
#[test]
fn a_drain_past_its_bound_is_handed_over_as_a_lost_partition() {
    let (mut n, c, tags, messages) = draining_setup();
    n.order.clear();
    n.report(
        0,
        ClusterReport {
            draining: vec![3],
            ..ClusterReport::default()
        },
    );
    assert_eq!(n.order, vec!["hand over 1"]);
    n.report(
        0,
        ClusterReport {
            lost: vec![3],
            ..ClusterReport::default()
        },
    );
    assert_eq!(n.order, vec!["hand over 1", "hand over 1"], "{:?}", n.order);
    assert_eq!(
        handed_over(&n.b),
        (1, 2),
        "m1 and m2 cut off with the partition"
    );
    assert_eq!(drained(&n.b), (0, 0));
    assert!(n.b.cluster_status().draining.is_empty());
    // m1's late reply is discarded; nothing asks for a release later.
    n.b.event(
        tags[0],
        event_of(
            &messages[0],
            EventKind::Finished(Outcome::Reply("late".into())),
        ),
        n.now,
    );
    n.pump();
    n.report(0, ClusterReport::default());
    assert!(n.journal.is_empty(), "{:?}", n.journal);
    assert!(untyped(n.take(c)).is_empty());
    assert!(
        !n.order.iter().any(|o| o.starts_with("release")),
        "{:?}",
        n.order
    );
}

/// The lines that are not typing indicators.
fn untyped(lines: Vec<Value>) -> Vec<Value> {
    lines.into_iter().filter(|v| v["op"] != "typing").collect()
}

/// A message loaded as the instance stops (an inbox arrival or a gained partition's, the
/// runtime refusing it `shutting_down`) is left in the journal for the next owner: no
/// outcome record, nothing sent (a `failed` would answer it wrongly for good).
#[test]
fn a_message_loaded_while_the_instance_stops_stays_for_the_next_owner() {
    let mut n = Net::new();
    let c = n.connect();
    let _ = n.take(c);
    let g = cluster_tag(2, 1);
    let mut loaded = turnstile::internal::cluster::LoadedPartition::default();
    loaded.recovered.messages.push(RecoveredMessage {
        message: StoredMessage::new(g, "tg", MessageFields::new("m1", "1", "m1"), u64::MAX / 4),
        starts: 0,
        outcome: None,
    });
    n.report(
        0,
        ClusterReport {
            gained: vec![(2, loaded)],
            ..ClusterReport::default()
        },
    );
    assert_eq!(n.submitted, vec![g]);
    let message = n.messages.pop().expect("m1");
    n.b.event(
        g,
        event_of(
            &message,
            EventKind::Rejected(turnstile::RejectReason::ShuttingDown),
        ),
        n.now,
    );
    n.pump();
    assert!(n.journal.is_empty(), "{:?}", n.journal);
    n.report(0, ClusterReport::default());
    assert!(n.take(c).is_empty());
    assert_eq!(n.b.backlog().kept_for_restart, 1);
}

/// A result run here for a message another instance accepted, that instance taken for dead
/// by the load (no live origin), goes out here marked `redelivery`: its origin may be alive
/// after all (paused past its lease) and send the same outcome from the stream. One accepted
/// here goes out unmarked; one whose origin is alive is not sent here at all.
#[test]
fn a_result_for_an_origin_taken_for_dead_is_marked_redelivery() {
    let mut n = Net::new();
    let c = n.connect();
    let _ = n.take(c);
    let stored = |seq: u64, id: &str, chat: &str| RecoveredMessage {
        message: StoredMessage::new(
            seq,
            "tg",
            MessageFields::new(id, chat, &format!("text of {id}")),
            u64::MAX / 4,
        ),
        starts: 0,
        outcome: None,
    };
    let (dead, alive) = (cluster_tag(0, 1), cluster_tag(0, 2));
    let mut loaded = turnstile::internal::cluster::LoadedPartition::default();
    loaded.recovered.messages.push(stored(dead, "m1", "5"));
    loaded.recovered.messages.push(stored(alive, "m2", "6"));
    loaded.origins.insert(alive, "b".into());
    n.report(
        0,
        ClusterReport {
            gained: vec![(0, loaded)],
            ..ClusterReport::default()
        },
    );
    assert_eq!(n.submitted, vec![dead, alive]);
    // One accepted here, into the owned partition.
    n.send(
        c,
        json!({"op": "message", "id": "m3", "chat_id": "7", "text": "hi"}),
    );
    let m = n.accepted().pop().expect("accepted");
    n.report_durable(m.seq, cluster_tag(0, 3));
    let messages = std::mem::take(&mut n.messages);
    let tags = [dead, alive, m.seq];
    assert_eq!(messages.len(), 3);
    for (tag, message) in tags.iter().zip(&messages) {
        let event = |kind| MessageEvent {
            id: message.id.clone(),
            session: message.session.clone(),
            kind,
        };
        n.b.event(
            *tag,
            event(EventKind::Accepted {
                state: AcceptState::Running,
                position: 0,
            }),
            n.now,
        );
        n.b.event(
            *tag,
            event(EventKind::Finished(Outcome::Reply("ran here".into()))),
            n.now,
        );
    }
    n.pump();
    let taken = n.journal.len();
    let written = Committed {
        taken,
        outcomes: tags.to_vec(),
        ..Committed::default()
    };
    n.b.journaled(written, n.now);
    n.pump();
    let lines = n.take(c);
    let by_id: std::collections::HashMap<&str, &Value> = lines
        .iter()
        .filter(|v| v["op"] == "reply")
        .map(|v| (v["id"].as_str().unwrap_or_default(), v))
        .collect();
    assert_eq!(
        by_id.len(),
        2,
        "m2's result is its live origin's: {lines:?}"
    );
    assert_eq!(by_id["m1"]["redelivery"], true, "{lines:?}");
    assert_eq!(by_id["m3"].get("redelivery"), None, "{lines:?}");
}

/// A terminal event whose outcome record failed waits while that record is kept for another
/// try, even through a report that wrote nothing and failed nothing (the ownership pass's),
/// and goes once its record is written: the cluster's journal thread reports an outcome only
/// when its record is written (tests/cluster_three's Redis restart holds the thread to it).
#[test]
fn an_outcome_whose_record_is_kept_for_another_try_is_not_sent_by_a_report_without_a_write() {
    let mut n = Net::new();
    let (c, m, message) = n.placed_m1(0, cluster_tag(0, 1));
    let event = |kind| MessageEvent {
        id: message.id.clone(),
        session: message.session.clone(),
        kind,
    };
    n.b.event(
        m.seq,
        event(EventKind::Accepted {
            state: AcceptState::Running,
            position: 0,
        }),
        n.now,
    );
    n.b.event(
        m.seq,
        event(EventKind::Finished(Outcome::Reply("done".into()))),
        n.now,
    );
    n.pump();
    let taken = n.journal.len();
    let failed = Committed {
        taken,
        retrying: 1,
        error: Some("redis is down".into()),
        ..Committed::default()
    };
    n.b.journaled(failed, n.now);
    n.pump();
    let replies = |lines: Vec<Value>| lines.into_iter().filter(|v| v["op"] == "reply").count();
    assert_eq!(replies(n.take(c)), 0, "sent while its record failed");
    // The ownership pass reports, the record still kept.
    let pass = Committed {
        retrying: 1,
        ..Committed::default()
    };
    n.b.journaled(pass, n.now);
    n.pump();
    assert_eq!(
        replies(n.take(c)),
        0,
        "sent by a report that wrote nothing, its record still unwritten"
    );
    // The kept record written.
    n.b.journaled(
        Committed {
            outcomes: vec![m.seq],
            ..Committed::default()
        },
        n.now,
    );
    n.pump();
    assert_eq!(
        replies(n.take(c)),
        1,
        "never sent once its record was written"
    );
}

/// A partition lost and taken again while a result of it waits for its outcome record (the
/// record still on its way to the journal thread): the load has no outcome for the message,
/// and the result held here is the one that goes once its record is written; the message is
/// not rebuilt (it would be answered again, `interrupted`).
#[test]
fn a_result_held_for_its_record_across_a_loss_and_a_regain_is_sent_once_and_not_rebuilt() {
    let mut n = Net::new();
    let (c, m, message) = n.placed_m1(0, cluster_tag(0, 1));
    let event = |kind| MessageEvent {
        id: message.id.clone(),
        session: message.session.clone(),
        kind,
    };
    n.b.event(
        m.seq,
        event(EventKind::Accepted {
            state: AcceptState::Running,
            position: 0,
        }),
        n.now,
    );
    n.b.event(
        m.seq,
        event(EventKind::Finished(Outcome::Reply("the real one".into()))),
        n.now,
    );
    n.pump();
    // Lost, then taken again; the load has the message started, with no outcome.
    n.report(
        0,
        ClusterReport {
            lost: vec![0],
            ..ClusterReport::default()
        },
    );
    let mut loaded = turnstile::internal::cluster::LoadedPartition::default();
    loaded.recovered.messages.push(RecoveredMessage {
        message: StoredMessage {
            seq: m.seq,
            ..m.clone()
        },
        starts: 1,
        outcome: None,
    });
    let submitted = n.submitted.len();
    n.report(
        0,
        ClusterReport {
            gained: vec![(0, loaded)],
            ..ClusterReport::default()
        },
    );
    assert_eq!(
        n.submitted.len(),
        submitted,
        "rebuilt although its result is held"
    );
    // Its record written (under the new lease): the held result goes, once.
    let taken = n.journal.len();
    n.b.journaled(
        Committed {
            taken,
            outcomes: vec![m.seq],
            ..Committed::default()
        },
        n.now,
    );
    n.pump();
    let done: Vec<Value> = n
        .take(c)
        .into_iter()
        .filter(|v| v["id"] == "m1" && v["op"] != "ack")
        .collect();
    assert_eq!(done.len(), 1, "{done:?}");
    assert_eq!(done[0]["text"], "the real one", "{done:?}");
}

/// Found by a flood through two instances (tests/cluster_flood): the owner's outcome can
/// reach this instance's reader before this instance's journal thread reports the message
/// placed (the rest of its pipelined batch still executing in Redis). It is kept, and goes
/// out after the ack once the report comes.
#[test]
fn an_outcome_that_comes_before_the_report_placing_its_message_is_sent_after_the_ack() {
    let mut n = Net::new();
    let c = n.connect();
    let _ = n.take(c);
    n.send(
        c,
        json!({"op": "message", "id": "m1", "chat_id": "1", "text": "hi"}),
    );
    let m = n.accepted().pop().expect("an accepted record");
    let g = cluster_tag(3, 17);
    n.arrive(Arrival::Outcome {
        partition: 3,
        tag: g,
        outcome: done("hello from b", "m1"),
    });
    assert!(
        n.take(c).is_empty(),
        "nothing before the message is durable"
    );
    assert_eq!(early_outcomes(&n.b), (1, 0));
    n.report(
        1,
        ClusterReport {
            placed: vec![(m.seq, g)],
            remote: vec![m.seq],
            ..ClusterReport::default()
        },
    );
    let lines = n.take(c);
    let ops: Vec<_> = lines.iter().map(|l| l["op"].as_str()).collect();
    assert_eq!(ops, vec![Some("ack"), Some("done")], "{lines:?}");
    assert_eq!(lines[1]["text"], "hello from b");
    assert_eq!(n.b.cluster_status().remote_waiting, 0);
    assert_eq!(early_outcomes(&n.b), (0, 0));
    // Once only: the same entry read again changes nothing.
    n.arrive(Arrival::Outcome {
        partition: 3,
        tag: g,
        outcome: done("hello from b", "m1"),
    });
    assert!(n.take(c).is_empty());
}

/// The SIGSTOP case (tests/cluster_serve): a paused owner wakes with its turn still running;
/// the next owner's outcome (`interrupted`) comes before this instance's own record is
/// refused. It is kept, and sent when the refusal comes, once.
#[test]
fn the_next_owners_outcome_that_comes_while_the_turn_runs_here_is_sent_when_the_record_is_refused()
{
    let mut n = Net::new();
    let ct = cluster_tag(0, 1);
    let (c, m, message) = n.placed_m1(0, ct);
    let event = |kind| MessageEvent {
        id: message.id.clone(),
        session: message.session.clone(),
        kind,
    };
    n.b.event(
        m.seq,
        event(EventKind::Accepted {
            state: AcceptState::Running,
            position: 0,
        }),
        n.now,
    );
    n.pump();
    assert_eq!(n.take(c).len(), 1, "the ack");
    n.arrive(Arrival::Outcome {
        partition: 0,
        tag: ct,
        outcome: done("interrupted, by the next owner", "m1"),
    });
    assert!(n.take(c).is_empty(), "the turn still runs here");
    n.b.event(
        m.seq,
        event(EventKind::Finished(Outcome::Reply("ran here".into()))),
        n.now,
    );
    n.pump();
    let taken = n.journal.len();
    n.report(
        taken,
        ClusterReport {
            fenced: vec![0],
            unwritten_outcomes: vec![m.seq],
            ..ClusterReport::default()
        },
    );
    let lines = n.take(c);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["text"], "interrupted, by the next owner");
    assert_eq!(early_outcomes(&n.b), (0, 0));
}

/// The next owner loads and answers a message queued here before this instance hears that
/// its partition is lost: the outcome is kept and sent at the hand-over.
#[test]
fn the_next_owners_outcome_that_comes_before_the_hand_over_is_sent_at_it() {
    let mut n = Net::new();
    let ct = cluster_tag(2, 5);
    let (c, m, message) = n.placed_m1(2, ct);
    n.b.event(
        m.seq,
        MessageEvent {
            id: message.id.clone(),
            session: message.session.clone(),
            kind: EventKind::Accepted {
                state: AcceptState::Queued,
                position: 1,
            },
        },
        n.now,
    );
    n.pump();
    assert_eq!(n.take(c).len(), 1, "the ack");
    n.arrive(Arrival::Outcome {
        partition: 2,
        tag: ct,
        outcome: done("by the next owner", "m1"),
    });
    assert!(n.take(c).is_empty(), "still queued here");
    n.report(
        0,
        ClusterReport {
            lost: vec![2],
            ..ClusterReport::default()
        },
    );
    assert_eq!(n.handed.len(), 1, "its session is handed over");
    let lines = n.take(c);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["text"], "by the next owner");
    assert_eq!(n.b.cluster_status().remote_waiting, 0);
    assert_eq!(early_outcomes(&n.b), (0, 0));
}

/// Outcomes for messages this instance never learns of are kept within their bound (the
/// messages in flight plus 1,024), the oldest dropped and counted; the newest still match.
#[test]
fn outcomes_kept_for_messages_not_known_here_are_bounded_and_counted() {
    let mut n = Net::new();
    let c = n.connect();
    let _ = n.take(c);
    n.send(
        c,
        json!({"op": "message", "id": "m1", "chat_id": "1", "text": "hi"}),
    );
    let m = n.accepted().pop().expect("accepted");
    // One route in flight: the bound is 1 + 1,024.
    for seq in 1..=1026 {
        n.arrive(Arrival::Outcome {
            partition: 1,
            tag: cluster_tag(1, seq),
            outcome: done("stale", "x"),
        });
    }
    let (kept, dropped) = early_outcomes(&n.b);
    assert!(kept <= 1025, "kept {kept}");
    assert_eq!(kept as u64 + dropped, 1026);
    assert!(dropped > 0);
    // The newest is among those kept: it still reaches its message.
    let g = cluster_tag(1, 1026);
    n.report(
        1,
        ClusterReport {
            placed: vec![(m.seq, g)],
            remote: vec![m.seq],
            ..ClusterReport::default()
        },
    );
    let lines = n.take(c);
    let ops: Vec<_> = lines.iter().map(|l| l["op"].as_str()).collect();
    assert_eq!(ops, vec![Some("ack"), Some("done")], "{lines:?}");
}

/// Found by the same flood, with `--cluster-rebalance`: a message acked here and owned
/// elsewhere, whose partition this instance then gains (a drain hands it over), was rebuilt
/// as a recovered one, its result sent to the platform's newest hello: another connection
/// of the platform, while the one that sent it waited for good. It goes to the sender, not
/// marked (no one sent it before); one loaded with its outcome too.
#[test]
fn a_message_waited_for_here_whose_partition_is_gained_answers_the_connection_that_sent_it() {
    let mut n = Net::new();
    let sender = n.connect();
    let _ = n.take(sender);
    for (id, chat) in [("m1", "1"), ("m2", "2")] {
        n.send(
            sender,
            json!({"op": "message", "id": id, "chat_id": chat, "text": id}),
        );
    }
    let acc = n.accepted();
    let (g1, g2) = (cluster_tag(4, 1), cluster_tag(4, 2));
    n.report(
        2,
        ClusterReport {
            placed: vec![(acc[0].seq, g1), (acc[1].seq, g2)],
            remote: vec![acc[0].seq, acc[1].seq],
            ..ClusterReport::default()
        },
    );
    assert_eq!(n.take(sender).len(), 2, "both acked");
    // A newer connection of the same platform: a recovered message's result would go there.
    let newest = n.connect();
    let _ = n.take(newest);

    let mut loaded = turnstile::internal::cluster::LoadedPartition::default();
    let mut m1 = RecoveredMessage {
        message: acc[0].clone(),
        starts: 0,
        outcome: None,
    };
    m1.message.seq = acc[0].seq;
    let mut m2 = RecoveredMessage {
        message: acc[1].clone(),
        starts: 0,
        outcome: Some(done("answered by the last owner", "m2")),
    };
    m2.message.seq = acc[1].seq;
    loaded.recovered.messages.extend([m1, m2]);
    n.report(
        0,
        ClusterReport {
            gained: vec![(4, loaded)],
            ..ClusterReport::default()
        },
    );
    assert_eq!(n.b.cluster_status().remote_waiting, 0);
    assert_eq!(n.submitted, vec![acc[0].seq], "m1 runs here now");
    let lines = n.take(sender);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["text"], "answered by the last owner");
    assert!(lines[0].get("redelivery").is_none(), "{lines:?}");
    let message = n.messages.pop().expect("m1");
    n.b.event(
        acc[0].seq,
        MessageEvent {
            id: message.id.clone(),
            session: message.session.clone(),
            kind: EventKind::Finished(Outcome::Reply("ran here".into())),
        },
        n.now,
    );
    n.pump();
    let taken = n.journal.len();
    n.b.journaled(
        Committed {
            taken,
            outcomes: vec![acc[0].seq],
            ..Committed::default()
        },
        n.now,
    );
    n.pump();
    let lines = n.take(sender);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["text"], "ran here");
    assert!(
        n.take(newest).is_empty(),
        "nothing for the newer connection"
    );
}

/// A message run here whose outcome write's answer was lost (SIGSTOP then SIGCONT: the
/// write interrupted, the partition then lost): the journal thread gives the write up as
/// unwritten, yet it landed, and the next owner's load finds the outcome and leaves the
/// message alone. The stream entry of this instance's own write proves it landed: the held
/// result goes, once, whichever comes first (found by tests/cluster_serve's SIGSTOP test:
/// "acked and never answered: [s7-2, s9-2, s11-2]").
#[test]
fn an_own_outcome_write_given_up_as_unwritten_that_landed_is_sent_once_in_either_order() {
    for landed_first in [true, false] {
        let mut n = Net::new();
        let ct = cluster_tag(0, 1);
        let (c, m, message) = n.placed_m1(0, ct);
        let event = |kind| MessageEvent {
            id: message.id.clone(),
            session: message.session.clone(),
            kind,
        };
        n.b.event(
            m.seq,
            event(EventKind::Accepted {
                state: AcceptState::Running,
                position: 0,
            }),
            n.now,
        );
        n.b.event(
            m.seq,
            event(EventKind::Finished(Outcome::Reply("ran here".into()))),
            n.now,
        );
        n.pump();
        assert_eq!(n.take(c).len(), 1, "the ack only");
        let landed = Arrival::Landed {
            partition: 0,
            tag: ct,
        };
        if landed_first {
            n.arrive(landed.clone());
            assert!(
                n.take(c).is_empty(),
                "{landed_first}: not before the journal's word"
            );
        }
        let taken = n.journal.len();
        n.report(
            taken,
            ClusterReport {
                lost: vec![0],
                unwritten_outcomes: vec![m.seq],
                ..ClusterReport::default()
            },
        );
        if !landed_first {
            assert!(
                n.take(c).is_empty(),
                "waits for the next owner or the proof"
            );
            n.arrive(landed.clone());
        }
        let lines = n.take(c);
        assert_eq!(lines.len(), 1, "{landed_first}: {lines:?}");
        assert_eq!(lines[0]["text"], "ran here", "{landed_first}");
        // Once: the same entry again, or an outcome of nobody's, changes nothing.
        n.arrive(landed);
        assert!(n.take(c).is_empty(), "{landed_first}");
    }
}

/// Partition 3 owned here and m1 of session 1 placed in it, its turn held for its `started`
/// record (taken by the journal thread, not yet reported): returns the net.
fn held_turn_setup() -> Net {
    let mut n = Net::new();
    let (_, _, message) = n.placed_m1(3, cluster_tag(3, 1));
    let tag = *n.submitted.last().expect("tag");
    let running = EventKind::Accepted {
        state: AcceptState::Running,
        position: 0,
    };
    n.b.event(tag, event_of(&message, running), n.now);
    n.b.event(
        tag,
        event_of(&message, EventKind::TurnStarted(TurnId(1))),
        n.now,
    );
    n.pump();
    assert!(
        matches!(n.journal.last(), Some(Record::Started { .. })),
        "{:?}",
        n.journal
    );
    n.journal.clear();
    n.order.clear();
    n
}

/// Found by tests/simulation_cluster (seed 1's kind): a turn whose `started` record failed
/// and is kept for another try does not start on a report that wrote nothing (the ownership
/// pass's, `retrying` still 1), only once the kept record is written. Started early, it would
/// run with no start in Redis, and a crash then would have the next owner run it again.
#[test]
fn a_held_turn_whose_started_record_is_kept_starts_only_once_it_is_written() {
    let mut n = held_turn_setup();
    let failed = Committed {
        taken: 1,
        retrying: 1,
        error: Some("redis is down".into()),
        ..Committed::default()
    };
    n.b.journaled(failed, n.now);
    n.pump();
    let pass = Committed {
        retrying: 1,
        ..Committed::default()
    };
    n.b.journaled(pass, n.now);
    n.pump();
    assert!(
        n.order.is_empty(),
        "started before its record was written: {:?}",
        n.order
    );
    n.b.journaled(Committed::default(), n.now);
    n.pump();
    assert_eq!(n.order, vec!["start 1"]);
}

/// Found by tests/simulation_cluster (seed 29): a `started` record the journal thread did not
/// write because the partition is no longer held (reported fenced, no error) does not start
/// its turn: the session is handed over and the next owner runs the message.
#[test]
fn a_held_turn_whose_partition_is_fenced_in_the_report_does_not_start() {
    let mut n = held_turn_setup();
    n.report(
        1,
        ClusterReport {
            fenced: vec![3],
            ..ClusterReport::default()
        },
    );
    assert_eq!(
        n.order,
        vec!["hand over 1"],
        "the turn started: {:?}",
        n.order
    );
    assert!(n.b.cluster_status().owned.is_empty());
}

/// Found by tests/simulation_cluster (seed 29): a partition lost and gained again in one
/// report (a paused instance's pass gives it up and acquires it at once) is handed over
/// first and then rebuilt from its load, so it ends owned; the other order ended the
/// rebuilt sessions and counted the partition as not owned while its lease was held.
#[test]
fn a_partition_lost_and_regained_in_one_report_is_handed_over_then_owned() {
    let mut n = held_turn_setup();
    n.report(
        0,
        ClusterReport {
            lost: vec![3],
            gained: vec![(3, Default::default())],
            ..ClusterReport::default()
        },
    );
    assert_eq!(n.order, vec!["hand over 1"], "{:?}", n.order);
    assert_eq!(n.b.cluster_status().owned, vec![3]);
}

/// Partitions lost or fenced since the start, and the messages they handed over.
fn handed_over(b: &Bridge) -> (u64, u64) {
    let s = b.cluster_status();
    (s.handed_over_partitions, s.handed_over_messages)
}

/// Partitions drained and released since the start, and the messages they handed over.
fn drained(b: &Bridge) -> (u64, u64) {
    let s = b.cluster_status();
    (s.drained_partitions, s.drained_messages)
}

/// Outcomes from the stream kept for messages not yet known here, and those dropped.
fn early_outcomes(b: &Bridge) -> (usize, u64) {
    let s = b.cluster_status();
    (s.early_outcomes, s.early_outcomes_dropped)
}

/// A message of chat 1 accepted elsewhere into partition `p` as `seq`, as the reader brings
/// it (its id `id`).
fn inbox_message(like: &StoredMessage, p: u32, seq: u64, id: &str) -> Arrival {
    let tag = cluster_tag(p, seq);
    let mut m = RecoveredMessage {
        message: like.clone(),
        starts: 0,
        outcome: None,
    };
    (m.message.seq, m.message.fields.id) = (tag, id.into());
    Arrival::Message {
        partition: p,
        tag,
        message: Box::new(m),
        origin: "a".into(),
    }
}

/// Partition 2 owned here (gained empty), m2 of chat 1 accepted here and made durable in
/// Redis as seq 2 while the reader has not yet passed seq 1 (m1 of the same chat, accepted
/// by another instance): the connection and m2's stored message.
fn own_accept_behind_the_inbox(n: &mut Net) -> (ConnId, StoredMessage) {
    let c = n.connect();
    let _ = n.take(c);
    let mut gained = ClusterReport::default();
    gained.gained.push((2, Default::default()));
    n.report(0, gained);
    n.send(
        c,
        json!({"op": "message", "id": "m2", "chat_id": "1", "text": "hi"}),
    );
    let m = n.accepted().pop().expect("accepted");
    n.reader_behind(
        Committed {
            taken: 1,
            durable: vec![m.seq],
            ..Committed::default()
        },
        ClusterReport {
            placed: vec![(m.seq, cluster_tag(2, 2))],
            ahead: vec![(m.seq, 1)],
            ..ClusterReport::default()
        },
    );
    (c, m)
}

/// Issue 31 row 1 (seed 37 of tests/simulation_cluster): the owner's own accept, durable
/// before its reader brought an earlier message of the same session accepted elsewhere, is
/// held (not submitted, not acked, counted in the status) until the reader has passed its
/// inbox entry; then it is submitted behind the earlier one.
#[test]
fn an_own_accept_waits_for_the_reader_to_bring_what_the_inbox_has_before_it() {
    let mut n = Net::new();
    let (c, m2) = own_accept_behind_the_inbox(&mut n);
    assert!(n.submitted.is_empty(), "submitted before the inbox's m1");
    assert!(n.take(c).is_empty(), "acked before it is submitted");
    assert_eq!(n.b.cluster_status().order_held, 1);
    // The reader's read: m1 (seq 1), then how far it went; a read that stops before m2's
    // entry releases nothing.
    n.arrive(inbox_message(&m2, 2, 1, "m1"));
    n.arrive(Arrival::Reached {
        partition: 2,
        seq: 1,
    });
    assert_eq!(n.order, vec!["submit m1"]);
    n.arrive(Arrival::Reached {
        partition: 2,
        seq: 2,
    });
    assert_eq!(n.order, vec!["submit m1", "submit m2"]);
    assert_eq!(n.b.cluster_status().order_held, 0);
    assert_eq!(n.b.status().journal.map(|j| j.pending_durable), Some(0));
}

/// A partition lost while an own accept is held there: the message is acked `queued` with
/// Redis's count as its position and waits for the next owner's outcome, never submitted.
#[test]
fn an_own_accept_held_when_its_partition_is_lost_is_acked_and_waits_for_the_next_owner() {
    let mut n = Net::new();
    let (c, _) = own_accept_behind_the_inbox(&mut n);
    n.report(
        0,
        ClusterReport {
            lost: vec![2],
            ..ClusterReport::default()
        },
    );
    assert!(n.submitted.is_empty(), "{:?}", n.order);
    let lines = n.take(c);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(
        (
            lines[0]["op"].as_str(),
            lines[0]["state"].as_str(),
            lines[0]["position"].as_u64()
        ),
        (Some("ack"), Some("queued"), Some(1)),
        "{lines:?}"
    );
    let s = n.b.cluster_status();
    assert_eq!((s.order_held, s.remote_waiting), (0, 1));
    // The reader's late word for a partition no longer owned changes nothing.
    n.arrive(Arrival::Reached {
        partition: 2,
        seq: 2,
    });
    assert!(n.submitted.is_empty(), "{:?}", n.order);
}

/// A partition named to drain while an own accept is held there: the next owner runs it, so
/// it is acked and waits for that owner's outcome, never submitted here.
#[test]
fn an_own_accept_held_when_its_partition_drains_waits_for_the_next_owner() {
    let mut n = Net::new();
    let (c, _) = own_accept_behind_the_inbox(&mut n);
    n.report(
        0,
        ClusterReport {
            draining: vec![2],
            ..ClusterReport::default()
        },
    );
    assert!(n.submitted.is_empty(), "{:?}", n.order);
    let lines = n.take(c);
    assert_eq!(
        (lines[0]["op"].as_str(), lines[0]["state"].as_str()),
        (Some("ack"), Some("queued")),
        "{lines:?}"
    );
    let s = n.b.cluster_status();
    assert_eq!((s.order_held, s.remote_waiting), (0, 1));
}

/// What is held counts against `--max-pending-durable`: at the bound a new message is
/// refused `overloaded` (and admitted again once the reader releases the held one).
#[test]
fn held_own_accepts_are_bounded_by_max_pending_durable() {
    let mut n = Net {
        b: Bridge::new(BridgeConfig {
            journal: true,
            max_pending_durable: 1,
            ..BridgeConfig::default()
        }),
        ..Net::new()
    };
    let (c, _) = own_accept_behind_the_inbox(&mut n);
    n.send(
        c,
        json!({"op": "message", "id": "m3", "chat_id": "1", "text": "hi"}),
    );
    assert!(n.accepted().is_empty(), "m3 admitted past the bound");
    n.arrive(Arrival::Reached {
        partition: 2,
        seq: 2,
    });
    // m2 submitted, its acceptance acks it; m3's refusal comes after it (answers keep the
    // connection's order).
    let m2 = n.messages.pop().expect("m2 submitted");
    let accepted = MessageEvent {
        id: m2.id.clone(),
        session: m2.session.clone(),
        kind: EventKind::Accepted {
            state: AcceptState::Running,
            position: 0,
        },
    };
    n.b.event(n.submitted[0], accepted, n.now);
    n.pump();
    let lines = n.take(c);
    let seen: Vec<(Option<&str>, Option<&str>)> = lines
        .iter()
        .map(|l| (l["op"].as_str(), l["id"].as_str()))
        .collect();
    assert_eq!(
        seen,
        vec![(Some("ack"), Some("m2")), (Some("reject"), Some("m3"))]
    );
    assert_eq!(lines[1]["reason"], "overloaded", "{lines:?}");
    n.send(
        c,
        json!({"op": "message", "id": "m4", "chat_id": "1", "text": "hi"}),
    );
    assert_eq!(n.accepted().len(), 1, "m4 admitted once m2 left the wait");
}

/// Self-fencing (issue 31 row 2): an owned partition past its lease's fence deadline, as
/// the last ownership pass reported it, is handed over at the bridge's own tick (its running
/// turns cancelled by the runtime), without waiting for the journal thread, which is told
/// (`ClusterRequest::Fenced`, with the lease's epoch); a pass that renewed it moves the
/// deadline, and the tick's timer says when the next one falls.
#[test]
fn a_partition_past_its_fence_deadline_is_handed_over_at_the_tick_and_the_thread_told() {
    use turnstile::internal::cluster::ClusterRequest;
    let mut n = Net::new();
    let (_c, _m, message) = n.placed_m1(3, cluster_tag(3, 1));
    let t0 = n.now;
    let ms = |m| t0 + Duration::from_millis(m);
    let pass = |deadline| ClusterReport {
        leases: vec![(3, 7, deadline)],
        ..ClusterReport::default()
    };
    n.report(0, pass(ms(1000)));
    n.b.tick(ms(500));
    // The next housekeeping (every 100 ms) would come after it: the deadline sets the timer
    // (cargo mutants: `Fences::next`, `next_fence` returning `None`).
    assert_eq!(
        n.b.tick(ms(950)),
        ms(1000),
        "the timer is set for the deadline"
    );
    // Renewed: the deadline moves.
    n.report(0, pass(ms(2000)));
    let tick = |n: &mut Net, at| {
        n.b.tick(at);
        let mut fenced = Vec::new();
        while let Some(a) = n.b.poll_action() {
            match a {
                Action::HandOver(sessions) => n.handed.push(sessions),
                Action::Cluster(ClusterRequest::Fenced { partition, epoch }) => {
                    fenced.push((partition, epoch));
                }
                _ => {}
            }
        }
        fenced
    };
    assert!(tick(&mut n, ms(1999)).is_empty());
    assert!(n.handed.is_empty());
    assert_eq!(tick(&mut n, ms(2000)), vec![(3, 7)]);
    assert_eq!(n.handed, vec![vec![message.session.clone()]]);
    let s = n.b.cluster_status();
    assert_eq!((s.owned.clone(), s.self_fenced), (vec![], 1), "{s:?}");
    assert!(tick(&mut n, ms(3000)).is_empty(), "once");
}

/// A partition lost (its lease not renewed in time, by the journal thread's pass) is handed
/// over at once and its fence deadline forgotten: no self-fence follows at that deadline (no
/// `Fenced` request for a lease already given up, no count in `self_fenced`). Found by
/// cargo mutants: `Fences::forget` made a no-op survived every test.
#[test]
fn a_partition_lost_before_its_fence_deadline_is_not_fenced_at_it() {
    use turnstile::internal::cluster::ClusterRequest;
    let mut n = Net::new();
    let (_c, _m, message) = n.placed_m1(3, cluster_tag(3, 1));
    let t0 = n.now;
    let ms = |m| t0 + Duration::from_millis(m);
    n.report(
        0,
        ClusterReport {
            leases: vec![(3, 7, ms(1000))],
            ..ClusterReport::default()
        },
    );
    n.report(
        0,
        ClusterReport {
            lost: vec![3],
            ..ClusterReport::default()
        },
    );
    assert_eq!(n.handed, vec![vec![message.session.clone()]]);
    // The timer is never set in the past (a busy loop): cargo mutants, `Fences::next`.
    assert!(n.b.tick(ms(500)) > ms(500), "a timer in the past");
    n.b.tick(ms(1500));
    let mut fenced = Vec::new();
    while let Some(a) = n.b.poll_action() {
        if let Action::Cluster(ClusterRequest::Fenced { partition, epoch }) = a {
            fenced.push((partition, epoch));
        }
    }
    assert_eq!(
        fenced,
        vec![],
        "a lost partition fenced at its old deadline"
    );
    let s = n.b.cluster_status();
    assert_eq!((s.owned.clone(), s.self_fenced), (vec![], 0), "{s:?}");
}

/// A partition named to drain by the very report that makes an own accept of it durable,
/// the reader not yet past its entry: the accept is not held for the reader. It is
/// submitted, then handed over with its session by the drain (the next owner loads it in
/// inbox order), acked when the runtime takes it, and answered by the next owner's outcome.
/// Held, it would stay held for good, never acked: the drain releases the partition at once
/// (no turn runs there) and the reader's later word for a partition no longer owned
/// releases nothing. Found by cargo mutants: either `&&` of `hold_for_order`'s drain
/// condition made `||` survived every test.
#[test]
fn an_own_accept_durable_in_the_report_that_names_its_partition_to_drain_is_not_held() {
    let mut n = Net::new();
    let c = n.connect();
    let _ = n.take(c);
    let mut gained = ClusterReport::default();
    gained.gained.push((2, Default::default()));
    n.report(0, gained);
    n.send(
        c,
        json!({"op": "message", "id": "m2", "chat_id": "1", "text": "hi"}),
    );
    let m = n.accepted().pop().expect("accepted");
    let ct = cluster_tag(2, 2);
    n.reader_behind(
        Committed {
            taken: 1,
            durable: vec![m.seq],
            ..Committed::default()
        },
        ClusterReport {
            placed: vec![(m.seq, ct)],
            ahead: vec![(m.seq, 1)],
            draining: vec![2],
            ..ClusterReport::default()
        },
    );
    assert_eq!(n.order, vec!["submit m2", "hand over 1", "release 2"]);
    assert_eq!(n.b.cluster_status().order_held, 0);
    // The runtime takes it (the ack), then ends it handed over (nothing sent).
    let message = n.messages.pop().expect("m2");
    let running = EventKind::Accepted {
        state: AcceptState::Running,
        position: 0,
    };
    n.b.event(m.seq, event_of(&message, running), n.now);
    let handed_over = EventKind::Finished(Outcome::Cancelled(CancelReason::HandedOver));
    n.b.event(m.seq, event_of(&message, handed_over), n.now);
    n.pump();
    let lines = n.take(c);
    let ops: Vec<_> = lines
        .iter()
        .map(|l| (l["op"].as_str(), l["id"].as_str()))
        .collect();
    assert_eq!(ops, vec![(Some("ack"), Some("m2"))], "{lines:?}");
    n.arrive(Arrival::Outcome {
        partition: 2,
        tag: ct,
        outcome: done("by the next owner", "m2"),
    });
    let lines = n.take(c);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["text"], "by the next owner");
    let s = n.b.cluster_status();
    assert_eq!((s.order_held, s.remote_waiting), (0, 0), "{s:?}");
    assert_eq!(n.b.status().journal.map(|j| j.pending_durable), Some(0));
}

/// An own accept made durable by the report that gains its partition, with a load that
/// already holds it (behind another instance's message of the same session): the load is
/// rebuilt first (m1), and the own accept waits for nothing more; it is submitted behind it
/// at once. Held for the reader, it would wait for an inbox entry the reader never brings:
/// the reader starts past the load, and a quiet partition brings nothing later. Found by
/// cargo mutants: `Order::loaded` made a no-op, or counting other partitions' seqs,
/// survived every test.
#[test]
fn an_own_accept_in_the_load_of_the_partition_its_report_gains_is_not_held() {
    let mut n = Net::new();
    let c = n.connect();
    let _ = n.take(c);
    n.send(
        c,
        json!({"op": "message", "id": "m2", "chat_id": "1", "text": "hi"}),
    );
    let m2 = n.accepted().pop().expect("accepted");
    let inbox = |message: StoredMessage| RecoveredMessage {
        message,
        starts: 0,
        outcome: None,
    };
    let mut m1 = m2.clone();
    (m1.seq, m1.fields.id) = (cluster_tag(2, 1), "m1".into());
    let mut loaded = turnstile::internal::cluster::LoadedPartition::default();
    loaded.recovered.messages.push(inbox(m1));
    // Accepted here: the load names it by the bridge's tag.
    loaded.recovered.messages.push(inbox(m2.clone()));
    n.reader_behind(
        Committed {
            taken: 1,
            durable: vec![m2.seq],
            ..Committed::default()
        },
        ClusterReport {
            placed: vec![(m2.seq, cluster_tag(2, 2))],
            gained: vec![(2, loaded)],
            ahead: vec![(m2.seq, 1)],
            ..ClusterReport::default()
        },
    );
    assert_eq!(n.order, vec!["submit m1", "submit m2"]);
    assert_eq!(n.b.cluster_status().order_held, 0);
    assert_eq!(n.b.status().journal.map(|j| j.pending_durable), Some(0));
}

/// Another instance's message arriving from the reader between two own accepts of the same
/// session held in its partition (seqs 1 and 3, the arrival 2): the reader has passed every
/// entry before it, so the own accept below it is submitted first, then the arrival; the one
/// above waits for the reader to pass it. Found by cargo mutants: `reached_before` made a
/// no-op, its partition check inverted, its `seq > 1` changed, or releasing through the
/// arrival's seq plus one, each survived every test.
#[test]
fn an_inbox_arrival_between_two_held_own_accepts_goes_between_them() {
    let mut n = Net::new();
    let c = n.connect();
    let _ = n.take(c);
    let mut gained = ClusterReport::default();
    gained.gained.push((2, Default::default()));
    n.report(0, gained);
    for id in ["m1", "m3"] {
        n.send(
            c,
            json!({"op": "message", "id": id, "chat_id": "1", "text": id}),
        );
    }
    let acc = n.accepted();
    n.reader_behind(
        Committed {
            taken: 2,
            durable: vec![acc[0].seq, acc[1].seq],
            ..Committed::default()
        },
        ClusterReport {
            placed: vec![
                (acc[0].seq, cluster_tag(2, 1)),
                (acc[1].seq, cluster_tag(2, 3)),
            ],
            ahead: vec![(acc[0].seq, 0), (acc[1].seq, 2)],
            ..ClusterReport::default()
        },
    );
    assert!(n.order.is_empty(), "{:?}", n.order);
    assert_eq!(n.b.cluster_status().order_held, 2);
    n.arrive(inbox_message(&acc[0], 2, 2, "m2"));
    assert_eq!(n.order, vec!["submit m1", "submit m2"]);
    assert_eq!(n.b.cluster_status().order_held, 1);
    n.arrive(Arrival::Reached {
        partition: 2,
        seq: 3,
    });
    assert_eq!(n.order, vec!["submit m1", "submit m2", "submit m3"]);
    assert_eq!(n.b.cluster_status().order_held, 0);
}
