//! The bridge's rules as deterministic tests of the sans-IO [`Bridge`]: no sockets, no
//! threads, no sleeps. Lines go in as bytes, the runtime's events are played by hand, output
//! is written into in-memory writers, time is a number. Each test names the row of issue 8's
//! table (or the rule) it pins; each fails on the old server's behaviour.

use std::collections::HashMap;
use std::io::{self, Write};
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use serde_json::{Value, json};
use turnstile::BridgeConfig;
use turnstile::internal::journal::Committed as Completion;
use turnstile::internal::server::{Action, Bridge, ConnId, Flushed};
use turnstile::{AcceptState, MessageEvent, Reply, TurnId};
use turnstile::{CancelReason, EventKind, Message, Outcome, RejectReason};
use turnstile::{
    MemStore, MessageFields, Record, Recovered, RecoveredMessage, Store, StoredMessage,
    StoredOutcome,
};

const S: Duration = Duration::from_secs(1);

fn peer(n: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 0, 0, n))
}

/// A writer that takes at most `room` more bytes, then blocks.
struct Pipe {
    data: Vec<u8>,
    room: usize,
}

impl Write for Pipe {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = buf.len().min(self.room);
        if n == 0 && !buf.is_empty() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        self.room -= n;
        self.data.extend_from_slice(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A writer whose peer is gone.
struct Broken;

impl Write for Broken {
    fn write(&mut self, _: &[u8]) -> io::Result<usize> {
        Err(io::ErrorKind::BrokenPipe.into())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The bridge with a pretend shell and runtime around it.
struct Net {
    b: Bridge,
    now: Duration,
    /// Bytes written to each connection and not yet read by the test.
    wire: HashMap<ConnId, Vec<u8>>,
    /// Submitted messages by tag.
    sub: HashMap<u64, Message>,
    /// Tags in submission order.
    order: Vec<u64>,
    closed: Vec<ConnId>,
    /// Closed discarding unsent data (results went back to the outbox).
    reset: Vec<ConnId>,
    /// Journal records asked for and not yet committed.
    journal: Vec<Record>,
    /// Of them, how many a failed write kept (the journal thread does not count them as
    /// taken again).
    kept: usize,
    /// Held turns released, in order.
    released: Vec<TurnId>,
    /// Spool files handed to the janitor (issue 36).
    released_files: Vec<String>,
}

impl Net {
    fn new(cfg: BridgeConfig) -> Net {
        Net {
            b: Bridge::new(cfg),
            now: Duration::ZERO,
            wire: HashMap::new(),
            sub: HashMap::new(),
            order: Vec::new(),
            closed: Vec::new(),
            reset: Vec::new(),
            journal: Vec::new(),
            kept: 0,
            released: Vec::new(),
            released_files: Vec::new(),
        }
    }

    fn connect(&mut self) -> ConnId {
        self.connect_from(peer(1)).expect("connected")
    }

    fn connect_from(&mut self, p: IpAddr) -> Result<ConnId, Value> {
        self.b
            .connect(p, self.now)
            .map_err(|line| serde_json::from_slice(&line).expect("json"))
    }

    fn pump(&mut self) {
        while let Some(a) = self.b.poll_action() {
            match a {
                Action::Submit { tag, message } => {
                    self.order.push(tag);
                    self.sub.insert(tag, message);
                }
                Action::Close(c) => self.closed.push(c),
                Action::Reset(c) => {
                    self.closed.push(c);
                    self.reset.push(c);
                }
                Action::Journal(r) => self.journal.push(r),
                Action::StartTurn(turn) => self.released.push(turn),
                Action::ReleaseFiles(paths) => self.released_files.extend(paths),
                #[cfg(feature = "cluster")]
                Action::HandOver(_) | Action::ReleasePartition(_) | Action::Cluster(_) => {
                    unreachable!("no cluster here")
                }
            }
        }
    }

    fn raw(&mut self, c: ConnId, line: &[u8]) {
        self.b.line(c, line, self.now);
        self.pump();
    }

    fn send(&mut self, c: ConnId, v: Value) {
        self.raw(c, v.to_string().as_bytes());
    }

    fn hello(&mut self, c: ConnId, platform: &str) {
        self.send(c, json!({"op": "hello", "platform": platform}));
    }

    /// Writes all of `c`'s output (as a reading client would take it), budget pass by pass.
    fn take(&mut self, c: ConnId) -> Vec<Value> {
        let mut w = Vec::new();
        for _ in 0..100_000 {
            match self.b.write(c, &mut w, self.now).expect("write") {
                Flushed::All => break,
                Flushed::Budget => continue,
                Flushed::Blocked => unreachable!("a Vec never blocks"),
            }
        }
        // A reading client's TCP acknowledges what it received.
        self.b.acked(c, self.b.written(c));
        self.pump();
        self.wire.entry(c).or_default().extend_from_slice(&w);
        self.lines(c)
    }

    /// The complete lines on `c`'s wire.
    fn lines(&mut self, c: ConnId) -> Vec<Value> {
        let buf = self.wire.entry(c).or_default();
        let end = buf.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        let whole: Vec<u8> = buf.drain(..end).collect();
        whole
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_slice(l).expect("json line"))
            .collect()
    }

    fn last_tag(&self) -> u64 {
        *self.order.last().expect("a submission")
    }

    fn event(&mut self, tag: u64, kind: EventKind) {
        let m = &self.sub[&tag];
        let ev = MessageEvent {
            id: m.id.clone(),
            session: m.session.clone(),
            kind,
        };
        self.b.event(tag, ev, self.now);
        self.pump();
    }

    fn accept(&mut self, tag: u64) {
        self.event(
            tag,
            EventKind::Accepted {
                state: AcceptState::Running,
                position: 0,
            },
        );
    }

    fn reply(&mut self, tag: u64, text: &str) {
        self.event(tag, EventKind::Finished(Outcome::Reply(text.into())));
    }

    fn tick(&mut self, by: Duration) {
        self.now += by;
        self.b.tick(self.now);
        self.pump();
    }

    fn platforms(&self) -> usize {
        self.b.status().platforms
    }

    /// The journal thread writes every record asked for into `store` and reports success.
    fn commit(&mut self, store: &mut MemStore) {
        let batch = std::mem::take(&mut self.journal);
        store.write(&batch).expect("memory store");
        let mut c = completion(&batch, None);
        c.taken -= std::mem::take(&mut self.kept);
        self.b.journaled(c, self.now);
        self.pump();
    }

    /// The journal thread's write fails: accepted messages failed, other records kept.
    fn fail_journal(&mut self) {
        let batch = std::mem::take(&mut self.journal);
        let mut c = completion(&batch, Some("no space left on device"));
        c.taken -= self.kept;
        self.journal = batch
            .into_iter()
            .filter(|r| !matches!(r, Record::Accepted(_)))
            .collect();
        self.kept = self.journal.len();
        self.b.journaled(c, self.now);
        self.pump();
    }
}

fn completion(batch: &[Record], error: Option<&str>) -> Completion {
    let accepted: Vec<u64> = batch
        .iter()
        .filter_map(|r| match r {
            Record::Accepted(m) => Some(m.seq),
            _ => None,
        })
        .collect();
    let outcomes = batch
        .iter()
        .filter_map(|r| match r {
            Record::Outcome { seq, .. } => Some(*seq),
            _ => None,
        })
        .collect();
    Completion {
        durable: if error.is_none() {
            accepted.clone()
        } else {
            Vec::new()
        },
        failed: if error.is_some() {
            accepted
        } else {
            Vec::new()
        },
        outcomes,
        taken: batch.len(),
        retrying: if error.is_some() {
            batch
                .iter()
                .filter(|r| !matches!(r, Record::Accepted(_)))
                .count()
        } else {
            0
        },
        error: error.map(str::to_string),
    }
}

fn msg(id: &str, chat: &str, text: &str) -> Value {
    json!({"op": "message", "id": id, "chat_id": chat, "text": text})
}

fn ops(lines: &[Value]) -> Vec<String> {
    lines
        .iter()
        .map(|v| {
            let op = v["op"].as_str().unwrap_or("?");
            let id = v["id"].as_str().or(v["detail"].as_str()).unwrap_or("");
            let extra = v["state"]
                .as_str()
                .or(v["reason"].as_str())
                .or(v["text"].as_str())
                .unwrap_or("");
            format!("{op} {id} {extra}").trim().to_owned()
        })
        .collect()
}

fn cfg() -> BridgeConfig {
    BridgeConfig::default()
}

fn tokened() -> BridgeConfig {
    BridgeConfig {
        auth_token: Some("s3cret".into()),
        ..cfg()
    }
}

// ---------------------------------------------------------------------------------------
// Row 1: platforms are validated, capped and freed when empty.

#[test]
fn row1_hellos_with_distinct_platforms_leave_nothing_behind() {
    let mut n = Net::new(cfg());
    let long = "p".repeat(60_000);
    let c = n.connect();
    n.send(c, json!({"op": "hello", "platform": long}));
    let out = n.take(c);
    assert_eq!(out[0]["op"], "error");
    assert!(
        out[0]["detail"]
            .as_str()
            .unwrap()
            .contains("platform must be")
    );
    assert_eq!(n.platforms(), 0, "an invalid name made a platform");
    for i in 0..5_000 {
        let c = n.connect();
        n.hello(c, &format!("platform-{i}"));
        assert_eq!(n.platforms(), 1);
        n.b.disconnected(c);
    }
    assert_eq!(n.platforms(), 0, "empty platforms were kept");
    assert_eq!(n.b.status().connections, 1);
}

#[test]
fn row3_the_platform_cap_answers_error_to_a_hello_and_overloaded_to_a_message() {
    let mut n = Net::new(BridgeConfig {
        max_platforms: 2,
        ..cfg()
    });
    let c = n.connect();
    n.hello(c, "a");
    let d = n.connect();
    n.hello(d, "b");
    let e = n.connect();
    n.hello(e, "c");
    let out = n.take(e);
    assert_eq!(out[0]["op"], "error");
    assert!(
        out[0]["detail"]
            .as_str()
            .unwrap()
            .contains("--max-platforms")
    );
    n.send(
        e,
        json!({"op": "message", "id": "1", "platform": "c", "chat_id": "1", "text": "x"}),
    );
    let out = n.take(e);
    assert_eq!(ops(&out), ["reject 1 overloaded"]);
    assert!(n.order.is_empty());
    // Once a platform empties, there is room.
    n.b.disconnected(d);
    n.hello(e, "c");
    n.send(e, msg("2", "1", "x"));
    assert_eq!(n.order.len(), 1);
    assert_eq!(n.platforms(), 2);
}

#[test]
fn platform_names_in_messages_are_validated() {
    let mut n = Net::new(cfg());
    let c = n.connect();
    for bad in ["tele gram", "a:b", ""] {
        n.send(
            c,
            json!({"op": "message", "id": "1", "platform": bad, "chat_id": "1", "text": "x"}),
        );
    }
    let out = n.take(c);
    assert_eq!(out.len(), 3);
    assert!(out.iter().all(|v| v["reason"] == "invalid"), "{out:?}");
    assert_eq!(n.platforms(), 0);
}

// ---------------------------------------------------------------------------------------
// Rows 2 and 3: the outbox is kept by admission, in events and in bytes.

#[test]
fn row3_each_accepted_message_reserves_its_result_and_a_full_outbox_answers_backpressure() {
    let mut n = Net::new(BridgeConfig {
        outbox_cap: 10,
        ..cfg()
    });
    let c = n.connect();
    n.hello(c, "tg");
    for i in 0..12 {
        n.send(c, msg(&format!("m{i}"), &format!("chat{i}"), "x"));
    }
    assert_eq!(n.order.len(), 10, "more admitted than the outbox can hold");
    for tag in n.order.clone() {
        n.accept(tag);
    }
    let out = n.take(c);
    let rejects: Vec<&Value> = out.iter().filter(|v| v["op"] == "reject").collect();
    assert_eq!(rejects.len(), 2);
    assert!(rejects.iter().all(|v| v["reason"] == "backpressure"));
    assert_eq!(n.b.status().outboxes["tg"].reserved_events, 10);
    // The bridge goes away: all ten results wait, none dropped, none over the cap.
    n.b.disconnected(c);
    for tag in n.order.clone() {
        n.reply(tag, "r");
    }
    let st = n.b.status();
    assert_eq!(
        (
            st.outboxes["tg"].outbox_events,
            st.outboxes["tg"].reserved_events
        ),
        (10, 10)
    );
    // Delivering them frees the room.
    let d = n.connect();
    n.hello(d, "tg");
    let got = n.take(d);
    assert_eq!(got.iter().filter(|v| v["op"] == "reply").count(), 10);
    assert_eq!(n.platforms(), 1, "the dedup window keeps the platform");
    assert_eq!(n.b.status().outboxes["tg"].reserved_events, 0);
    n.send(d, msg("m-new", "chat", "x"));
    assert_eq!(n.order.len(), 11);
}

#[test]
fn row2_outbox_bytes_reserve_an_envelope_and_charge_a_result_when_it_exists() {
    // Issue 18 row 2 (this replaces the old rule, where each message reserved
    // --max-reply-bytes + 8 KiB at admission): a message reserves its envelope; its result's
    // text is charged when the result exists; admission keeps every owed envelope plus one
    // largest result within the bound; the refusal names the bound.
    let env = turnstile::internal::server::TERMINAL_ENVELOPE;
    let mut n = Net::new(BridgeConfig {
        max_reply_bytes: 1000,
        outbox_bytes: 6 * env,
        ..cfg()
    });
    let c = n.connect();
    n.hello(c, "tg");
    for i in 0..5 {
        n.send(c, msg(&format!("m{i}"), &format!("c{i}"), "x"));
    }
    assert_eq!(
        n.order.len(),
        4,
        "4 envelopes + one largest result fit 6 x 8 KiB"
    );
    assert_eq!(n.b.status().outboxes["tg"].reserved_bytes, 4 * env);
    for t in n.order.clone() {
        n.accept(t);
    }
    let rejects: Vec<Value> = n
        .take(c)
        .into_iter()
        .filter(|v| v["op"] == "reject")
        .collect();
    assert_eq!(ops(&rejects), ["reject m4 backpressure"]);
    let detail = rejects[0]["detail"].as_str().unwrap_or("");
    assert!(
        detail.contains(&format!("--outbox-bytes {}", 6 * env)),
        "{detail}"
    );
    // The bridge goes away; a result's text is charged once it exists, and held, not lost.
    n.b.disconnected(c);
    let t = n.order[0];
    n.reply(t, &"r".repeat(1000));
    let held = n.b.status().outboxes["tg"].reserved_bytes;
    assert!(held > 4 * env + 1000 && held < 4 * env + 1200, "{held}");
    let d = n.connect();
    n.hello(d, "tg");
    let got = n.take(d);
    assert_eq!(got.iter().filter(|v| v["op"] == "reply").count(), 1);
    assert_eq!(n.b.status().outboxes["tg"].reserved_bytes, 3 * env);
}

#[test]
fn row2_a_result_that_does_not_fit_is_held_then_delivered_in_order_never_past_outbox_bytes() {
    // Four replies of 20,000 bytes owed at once within 64 KiB: the second does not fit
    // beside the first, so it (and every later one) waits, in order, and goes as the
    // earlier ones are delivered; the status never shows more than --outbox-bytes.
    let env = turnstile::internal::server::TERMINAL_ENVELOPE;
    let cap = 8 * env;
    let mut n = Net::new(BridgeConfig {
        max_reply_bytes: 20_000,
        outbox_bytes: cap,
        ..cfg()
    });
    let c = n.connect();
    n.hello(c, "tg");
    for i in 0..4 {
        n.send(c, msg(&format!("m{i}"), "chat", "x"));
    }
    assert_eq!(n.order.len(), 4);
    for t in n.order.clone() {
        n.accept(t);
    }
    assert_eq!(ops(&n.take(c)).len(), 4, "four acks");
    for (i, t) in n.order.clone().into_iter().enumerate() {
        n.reply(t, &format!("{i}").repeat(20_000));
        let st = &n.b.status().outboxes["tg"];
        assert!(st.reserved_bytes <= cap, "{} > {cap}", st.reserved_bytes);
    }
    let st = n.b.status().outboxes["tg"].clone();
    assert_eq!((st.reserved_events, st.held_events), (4, 3), "{st:?}");
    assert_eq!(st.held_bytes, 3 * 20_000);
    // While results wait for room, the platform takes no new message; the detail says why.
    n.send(c, msg("m4", "chat", "x"));
    let out = n.take(c);
    let replies: Vec<&Value> = out.iter().filter(|v| v["op"] == "reply").collect();
    let reject = out.iter().find(|v| v["op"] == "reject").expect("a reject");
    assert_eq!(reject["reason"], "backpressure");
    let detail = reject["detail"].as_str().unwrap_or("");
    assert!(
        detail.contains(&format!("--outbox-bytes {cap}")),
        "{detail}"
    );
    assert!(detail.contains("waiting for room"), "{detail}");
    // And why "full" while less than the cap is held: room for one largest result is kept.
    assert!(
        detail.contains("kept free so the largest result always fits"),
        "{detail}"
    );
    let mut got: Vec<String> = replies
        .iter()
        .map(|v| v["id"].as_str().unwrap_or("").to_owned())
        .collect();
    // Each delivery frees room for the next held one.
    for _ in 0..10 {
        let st = &n.b.status().outboxes;
        if let Some(st) = st.get("tg") {
            assert!(st.reserved_bytes <= cap, "{} > {cap}", st.reserved_bytes);
        }
        for v in n.take(c) {
            if v["op"] == "reply" {
                assert_eq!(v["text"].as_str().map(str::len), Some(20_000));
                got.push(v["id"].as_str().unwrap_or("").to_owned());
            }
        }
    }
    assert_eq!(got, ["m0", "m1", "m2", "m3"], "every result, in order");
    assert!(
        !n.b.status().outboxes.contains_key("tg") || {
            let st = &n.b.status().outboxes["tg"];
            (st.reserved_events, st.held_events, st.reserved_bytes) == (0, 0, 0)
        }
    );
}

#[test]
fn row2_a_held_result_is_durable_and_comes_back_after_a_restart() {
    // With a journal, a result held for room has its outcome record: a crash does not lose
    // it, and recovery holds it again within the bound.
    let env = turnstile::internal::server::TERMINAL_ENVELOPE;
    let cap = 8 * env;
    let small = BridgeConfig {
        max_reply_bytes: 20_000,
        outbox_bytes: cap,
        ..durable()
    };
    let mut store = MemStore::new();
    let mut n = Net::new(small.clone());
    let c = n.connect();
    n.hello(c, "tg");
    for i in 0..3 {
        n.send(c, msg(&format!("m{i}"), &format!("c{i}"), "x"));
    }
    n.commit(&mut store);
    for t in n.order.clone() {
        n.accept(t);
        n.reply(t, &"z".repeat(20_000));
    }
    n.commit(&mut store);
    assert_eq!(n.b.status().outboxes["tg"].held_events, 1);
    // Crash: what the journal holds comes back.
    let r = store.load(0).unwrap();
    assert_eq!(r.messages.len(), 3);
    assert!(r.messages.iter().all(|m| m.outcome.is_some()));
    let mut n = Net::new(small);
    n.b.recover(r, 0, Duration::ZERO);
    n.pump();
    let st = n.b.status().outboxes["tg"].clone();
    assert!(st.reserved_bytes <= cap, "{st:?}");
    assert_eq!((st.outbox_events, st.held_events), (2, 1), "{st:?}");
    let d = n.connect();
    n.hello(d, "tg");
    let mut got = Vec::new();
    for _ in 0..5 {
        got.extend(
            n.take(d)
                .into_iter()
                .filter(|v| v["op"] == "reply")
                .map(|v| v["id"].as_str().unwrap_or("").to_owned()),
        );
    }
    assert_eq!(got, ["m0", "m1", "m2"]);
    assert_eq!(
        kinds(&n.journal),
        ["delivered 1", "delivered 2", "delivered 3"]
    );
}

#[test]
fn row2_stale_owed_results_are_bounded_at_age_and_count_and_shown_in_the_status() {
    // A platform no bridge has said hello for during --outbox-stale-after keeps only its
    // newest --outbox-stale-keep waiting results; the older are dropped, counted, and taken
    // out of the journal. Before that age nothing is dropped.
    let mut store = MemStore::new();
    let mut n = Net::new(BridgeConfig {
        outbox_stale_after: 10 * S,
        outbox_stale_keep: 2,
        ..durable()
    });
    let c = n.connect();
    n.hello(c, "lg");
    for i in 0..5 {
        n.send(c, msg(&format!("m{i}"), &format!("u{i}"), "x"));
    }
    n.commit(&mut store);
    for t in n.order.clone() {
        n.accept(t);
    }
    n.b.disconnected(c);
    for t in n.order.clone() {
        n.reply(t, "r");
    }
    n.commit(&mut store);
    n.tick(S);
    let st = n.b.status().outboxes["lg"].clone();
    assert_eq!(
        (st.outbox_events, st.stale, st.stale_dropped),
        (5, false, 0)
    );
    assert!(st.absent_ms.is_some(), "{st:?}");
    n.tick(9 * S);
    n.tick(S);
    let status = n.b.status();
    let st = &status.outboxes["lg"];
    assert_eq!(
        (
            st.outbox_events,
            st.reserved_events,
            st.stale,
            st.stale_dropped
        ),
        (2, 2, true, 3),
        "{st:?}"
    );
    assert_eq!(status.stale_dropped, 3);
    assert_eq!(
        kinds(&n.journal),
        ["delivered 1", "delivered 2", "delivered 3"]
    );
    n.commit(&mut store);
    let left: Vec<u64> = store
        .load(0)
        .unwrap()
        .messages
        .iter()
        .map(|m| m.message.seq)
        .collect();
    assert_eq!(left, [4, 5], "the journal keeps what the outbox keeps");
    // The newest are still delivered when a bridge comes back.
    let d = n.connect();
    n.hello(d, "lg");
    assert_eq!(ops(&n.take(d)), ["reply m3 r", "reply m4 r"]);
}

#[test]
fn row2_after_five_abandoned_loadgen_runs_a_later_run_is_accepted_once_stale_results_go() {
    // The issue's report: each run leaves 2,000 results owed and goes; on main the sixth run
    // is refused at once, forever. With the defaults, an hour of absence trims them to
    // --outbox-stale-keep (1,000) and a later run is accepted.
    let d = cfg();
    let mut n = Net::new(cfg());
    let mut id = 0;
    // A run names its platform in each line (no hello: it takes no backlog), reads its
    // acks and leaves before its turns end.
    let mut run = |n: &mut Net| {
        let c = n.connect();
        let before = n.order.len();
        for _ in 0..2000 {
            id += 1;
            let mut m = msg(&format!("r{id}"), &format!("u{id}"), "x");
            m["platform"] = json!("loadgen");
            n.send(c, m);
        }
        let tags = n.order[before..].to_vec();
        for &t in &tags {
            n.accept(t);
        }
        let refused = n.take(c).into_iter().find(|v| v["op"] == "reject");
        n.b.disconnected(c);
        for &t in &tags {
            n.reply(t, "ok");
        }
        refused
    };
    for _ in 0..5 {
        assert_eq!(run(&mut n), None);
    }
    let refused = run(&mut n).expect("the sixth run meets --outbox-cap");
    let detail = refused["detail"].as_str().unwrap_or("");
    assert!(
        detail.contains(&format!("--outbox-cap {}", d.outbox_cap)),
        "{detail}"
    );
    // Housekeeping notes the absence, then drops what is stale (a budget per pass).
    n.tick(Duration::from_millis(100));
    n.tick(d.outbox_stale_after);
    for _ in 0..5 {
        n.tick(Duration::from_millis(100));
    }
    let status = n.b.status();
    let st = &status.outboxes["loadgen"];
    assert_eq!(st.reserved_events, d.outbox_stale_keep, "{st:?}");
    assert_eq!(
        status.stale_dropped as usize,
        5 * 2000 - d.outbox_stale_keep
    );
    assert_eq!(run(&mut n), None, "a later run is accepted");
}

#[test]
fn row2_with_the_defaults_a_burst_of_1000_users_on_one_platform_is_all_accepted() {
    // On main: 254 acked, 746 `reject backpressure` (1.008 MiB reserved per message).
    let mut n = Net::new(cfg());
    let mut conns = Vec::new();
    for i in 0..1000 {
        let c = n.connect();
        n.hello(c, "telegram");
        n.send(c, msg(&format!("u{i}"), &format!("user{i}"), "hi"));
        conns.push(c);
    }
    assert_eq!(n.order.len(), 1000, "every message admitted");
    for tag in n.order.clone() {
        n.accept(tag);
    }
    let mut acks = 0;
    for c in conns {
        for v in n.take(c) {
            assert_ne!(v["op"], "reject", "{v}");
            acks += usize::from(v["op"] == "ack");
        }
    }
    assert_eq!(acks, 1000);
    assert_eq!(n.b.status().outboxes["telegram"].reserved_events, 1000);
}

#[test]
fn row2_with_the_defaults_outbox_cap_is_the_bound_that_binds_and_is_named() {
    let cap = cfg().outbox_cap;
    let mut n = Net::new(cfg());
    let c = n.connect();
    n.hello(c, "telegram");
    for i in 0..=cap {
        n.send(c, msg(&format!("m{i}"), &format!("chat{i}"), "x"));
    }
    assert_eq!(n.order.len(), cap);
    for t in n.order.clone() {
        n.accept(t);
    }
    let out = n.take(c);
    let rejects: Vec<&Value> = out.iter().filter(|v| v["op"] == "reject").collect();
    assert_eq!(rejects.len(), 1);
    assert_eq!(rejects[0]["reason"], "backpressure");
    let detail = rejects[0]["detail"].as_str().unwrap_or("");
    assert!(detail.contains(&format!("--outbox-cap {cap}")), "{detail}");
}

#[test]
fn a_refused_message_gives_its_reservation_back() {
    let mut n = Net::new(BridgeConfig {
        outbox_cap: 1,
        ..cfg()
    });
    let c = n.connect();
    n.hello(c, "tg");
    n.send(c, msg("a", "1", "x"));
    let tag = n.last_tag();
    n.event(tag, EventKind::Rejected(RejectReason::QueueFull));
    assert_eq!(n.b.status().outboxes["tg"].reserved_events, 0);
    n.send(c, msg("a", "1", "x"));
    assert_eq!(n.order.len(), 2, "a refused id must be retryable");
    assert_eq!(ops(&n.take(c)), ["reject a queue_full"]);
    assert_eq!(n.b.status().rejected["queue_full"], 1);
}

// ---------------------------------------------------------------------------------------
// Row 4: a huge result neither disconnects its reader nor poisons later connections.

#[test]
fn row4_a_huge_reply_flows_to_a_slow_reader_and_an_interrupted_one_goes_whole_to_the_next() {
    let big = "\"".repeat(3 << 20);
    let mut n = Net::new(BridgeConfig {
        max_reply_bytes: 4 << 20,
        write_budget: 64 * 1024,
        ..cfg()
    });
    let a = n.connect();
    n.hello(a, "tg");
    n.send(a, msg("big", "1", "x"));
    let tag = n.last_tag();
    n.accept(tag);
    n.reply(tag, &big);
    // A reads slowly: 100 KB at a time. Each pass writes at most the budget.
    let mut pipe = Pipe {
        data: Vec::new(),
        room: 100_000,
    };
    assert_eq!(n.b.write(a, &mut pipe, n.now).unwrap(), Flushed::Budget);
    assert!(pipe.data.len() <= 64 * 1024 + 1024, "{}", pipe.data.len());
    assert_eq!(n.b.write(a, &mut pipe, n.now).unwrap(), Flushed::Blocked);
    // A is still served: a ping is answered after the reply.
    n.send(a, json!({"op": "ping"}));
    // A goes away in the middle of the reply: it goes back to the outbox, whole.
    n.b.disconnected(a);
    assert_eq!(n.b.status().outboxes["tg"].outbox_events, 1);
    // Three later bridges say hello and send: none is disconnected; the first gets the
    // reply whole, the others do not get it again.
    for k in 0..3 {
        let b = n.connect();
        n.hello(b, "tg");
        n.send(b, msg(&format!("after-{k}"), "2", "y"));
        let t = n.last_tag();
        n.accept(t);
        n.reply(t, "y");
        let out = n.take(b);
        assert!(n.closed.is_empty(), "a later bridge was disconnected");
        let big_lines: Vec<&Value> = out.iter().filter(|v| v["id"] == "big").collect();
        if k == 0 {
            assert_eq!(big_lines.len(), 1);
            assert_eq!(big_lines[0]["text"].as_str().map(str::len), Some(big.len()));
        } else {
            assert!(big_lines.is_empty());
        }
        assert!(
            out.iter()
                .any(|v| v["op"] == "reply" && v["id"] == format!("after-{k}"))
        );
        n.b.disconnected(b);
    }
    assert_eq!(n.b.backlog().outboxed, 0);
}

// ---------------------------------------------------------------------------------------
// Row 5: a backlog is paced by its reader, and what a closed connection did not deliver goes
// back to the front of the outbox, in order.

#[test]
fn row5_a_backlog_is_paced_and_an_interrupted_delivery_resumes_in_order() {
    let mut n = Net::new(BridgeConfig {
        max_write_buffer: 64 * 1024,
        max_reply_bytes: 1024,
        ..cfg()
    });
    let a = n.connect();
    n.hello(a, "tg");
    for i in 0..5_000 {
        n.send(a, msg(&format!("{i:06}"), &format!("c{i}"), "x"));
    }
    let tags = n.order.clone();
    for &t in &tags {
        n.accept(t);
    }
    n.take(a);
    n.b.disconnected(a);
    for &t in &tags {
        let text = format!("reply {}", n.sub[&t].id);
        n.reply(t, &text);
    }
    assert_eq!(n.b.status().outboxes["tg"].outbox_events, 5_000);
    // B collects the backlog, reads 50 KB, stalls and drops.
    let b = n.connect();
    n.hello(b, "tg");
    let mut pipe = Pipe {
        data: Vec::new(),
        room: 50_000,
    };
    let _ = n.b.write(b, &mut pipe, n.now).unwrap();
    let _ = n.b.write(b, &mut pipe, n.now).unwrap();
    let fed = n.b.status().outboxes["tg"].outbox_events;
    assert!(
        fed > 3_000,
        "the whole backlog was pushed at a stalled reader: {fed} left"
    );
    // B's TCP acknowledged what it received; what was written past that is not delivered.
    n.b.acked(b, pipe.data.len() as u64);
    n.b.disconnected(b);
    let got_b: Vec<String> = String::from_utf8_lossy(&pipe.data)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .map(|v| v["id"].as_str().unwrap_or("").to_owned())
        .collect();
    // C gets everything B did not take whole, in order, from where B stopped.
    let c = n.connect();
    n.hello(c, "tg");
    let got_c: Vec<String> = n
        .take(c)
        .iter()
        .filter(|v| v["op"] == "reply")
        .map(|v| v["id"].as_str().unwrap_or("").to_owned())
        .collect();
    let all: Vec<String> = got_b.iter().chain(&got_c).cloned().collect();
    let want: Vec<String> = (0..5_000).map(|i| format!("{i:06}")).collect();
    assert_eq!(all, want, "lost or out of order");
}

// ---------------------------------------------------------------------------------------
// Row 6: a large reply costs the loop bounded work per pass.

#[test]
fn row6_a_large_reply_is_encoded_as_it_is_written_within_the_budget() {
    let mut n = Net::new(BridgeConfig {
        max_reply_bytes: 8 << 20,
        write_budget: 256 * 1024,
        ..cfg()
    });
    let a = n.connect();
    let other = n.connect();
    n.hello(a, "tg");
    n.hello(other, "tg");
    n.send(a, msg("big", "1", "x"));
    n.send(other, msg("small", "2", "x"));
    let (t1, t2) = (n.order[0], n.order[1]);
    n.accept(t1);
    n.accept(t2);
    n.reply(t1, &"\"".repeat(8 << 20));
    n.send(other, json!({"op": "ping"}));
    // Every pass on A writes at most the budget; the other connection is served between.
    let mut w = Vec::new();
    let mut passes = 0;
    loop {
        let before = w.len();
        let how = n.b.write(a, &mut w, n.now).unwrap();
        assert!(w.len() - before <= 256 * 1024 + 64);
        passes += 1;
        if passes == 1 {
            let out = n.take(other);
            assert_eq!(ops(&out), ["ack small running", "pong"]);
        }
        if how == Flushed::All {
            break;
        }
    }
    assert!(passes >= 64, "{passes}");
    let line: Value = serde_json::from_slice(&w[w.iter().position(|&b| b == b'\n').unwrap() + 1..])
        .expect("the reply line");
    assert_eq!(line["text"].as_str().map(str::len), Some(8 << 20));
}

#[test]
fn replies_over_the_limit_are_cut_on_a_character_boundary_and_marked() {
    let mut n = Net::new(BridgeConfig {
        max_reply_bytes: 5,
        ..cfg()
    });
    let a = n.connect();
    n.hello(a, "tg");
    n.send(a, msg("m", "1", "x"));
    let t = n.last_tag();
    n.accept(t);
    n.reply(t, "abcdé");
    let out = n.take(a);
    assert_eq!(out[1]["text"], "abcd");
    assert_eq!(out[1]["truncated"], true);
    n.send(a, msg("m2", "1", "x"));
    let t = n.last_tag();
    n.accept(t);
    n.event(
        t,
        EventKind::Finished(Outcome::Reply({
            let mut cut = Reply::from("ok");
            cut.truncated = true;
            cut
        })),
    );
    let out = n.take(a);
    assert_eq!(
        (out[1]["text"].as_str(), &out[1]["truncated"]),
        (Some("ok"), &json!(true))
    );
}

// ---------------------------------------------------------------------------------------
// Row 7: connections that never authenticate are bounded and timed out.

#[test]
fn row7_idle_unauthenticated_connections_cannot_lock_the_bridge_out() {
    let mut n = Net::new(BridgeConfig {
        max_unauthenticated: 8,
        max_unauthenticated_per_peer: 4,
        hello_timeout: 5 * S,
        ..tokened()
    });
    // 10.0.0.9 and 10.0.0.10 share a /24: the per-peer cap counts them together, and a
    // fifth from that prefix closes its oldest (issue 33 row 1).
    let idle: Vec<ConnId> = (0..4).map(|_| n.connect_from(peer(9)).unwrap()).collect();
    let fifth = n.connect_from(peer(10)).unwrap();
    n.pump();
    assert_eq!(n.closed, vec![idle[0]], "the prefix's oldest makes room");
    assert_eq!(n.b.status().unauthenticated, 4);
    // Other prefixes fill the global cap: 4 + 2 + 2.
    let other = |a: u8| IpAddr::V4(Ipv4Addr::new(10, a, 0, 1));
    let mut later = Vec::new();
    for a in [1, 1, 2, 2] {
        later.push(n.connect_from(other(a)).unwrap());
    }
    assert_eq!(n.b.status().unauthenticated, 8);
    assert_eq!(n.b.status().connections_refused, 1);
    // At the global cap a newcomer from a fresh prefix closes the oldest of the prefix
    // holding the most (10.0.0.0/24's), not a connection of the small prefixes.
    let real = n.connect_from(other(3)).unwrap();
    n.pump();
    assert_eq!(n.closed, vec![idle[0], idle[1]]);
    n.send(
        real,
        json!({"op": "hello", "platform": "tg", "token": "s3cret"}),
    );
    assert_eq!(n.b.status().unauthenticated, 7);
    // The rest time out (at 5 s exactly); the bridge that said hello stays.
    n.tick(4 * S);
    assert_eq!(n.closed.len(), 2, "closed before the deadline");
    n.tick(S);
    let waited: Vec<ConnId> = [&idle[2..], &[fifth], &later[..]].concat();
    for c in &waited {
        assert_eq!(n.take(*c)[0]["detail"], "no hello within 5s");
    }
    assert_eq!(n.closed.len(), 2 + waited.len());
    assert_eq!(n.b.status().unauthenticated, 0);
    assert_eq!(n.b.status().connections_refused, 2 + 7);
    n.tick(10 * S);
    assert!(!n.closed.contains(&real));
}

/// At the global cap the victim is the oldest waiting connection of the largest prefix:
/// never a connection that said hello, never the older one of a smaller prefix.
#[test]
fn at_the_cap_neither_a_bridge_nor_a_small_prefix_is_evicted() {
    let mut n = Net::new(BridgeConfig {
        max_unauthenticated: 3,
        max_unauthenticated_per_peer: 3,
        hello_timeout: 5 * S,
        ..tokened()
    });
    let at = |a: u8| IpAddr::V4(Ipv4Addr::new(10, a, 0, 1));
    let real = n.connect_from(at(9)).unwrap();
    n.send(
        real,
        json!({"op": "hello", "platform": "tg", "token": "s3cret"}),
    );
    let lone = n.connect_from(at(1)).unwrap();
    let a = n.connect_from(at(2)).unwrap();
    let b = n.connect_from(at(2)).unwrap();
    n.connect_from(at(3)).unwrap();
    n.pump();
    assert_eq!(
        n.closed,
        vec![a],
        "not {real} (said hello) nor {lone} (a prefix of one)"
    );
    assert!(!n.closed.contains(&b));
}

#[test]
fn without_a_token_connections_are_capped_but_never_timed_out() {
    let mut n = Net::new(BridgeConfig {
        max_connections: 2,
        ..cfg()
    });
    let a = n.connect();
    n.connect();
    let e = n.connect_from(peer(2)).unwrap_err();
    assert_eq!(e["detail"], "too many connections (2)");
    n.tick(60 * S);
    assert!(n.closed.is_empty());
    n.b.disconnected(a);
    n.connect_from(peer(2)).unwrap();
}

// ---------------------------------------------------------------------------------------
// Row 9: a half-closed client keeps getting its events.

#[test]
fn row9_a_half_closed_client_gets_its_result_then_is_closed() {
    let mut n = Net::new(cfg());
    let a = n.connect();
    n.hello(a, "tg");
    let other = n.connect();
    n.hello(other, "tg");
    n.send(a, msg("m", "1", "x"));
    let t = n.last_tag();
    n.accept(t);
    n.b.read_closed(a);
    n.pump();
    assert!(n.closed.is_empty(), "closed with a message outstanding");
    assert!(!n.b.wants_read(a));
    n.reply(t, "answer");
    let out = n.take(a);
    assert_eq!(ops(&out), ["ack m running", "reply m answer"]);
    assert!(
        n.take(other).is_empty(),
        "the result went to another bridge"
    );
    // Closed once the peer's TCP acknowledged it (take() plays a reading client).
    assert_eq!(n.closed, [a]);
    assert!(n.reset.is_empty(), "a delivered connection was reset");
    assert_eq!(n.b.status().outboxes["tg"].reserved_events, 0);
}

#[test]
fn row9_a_reset_after_end_of_stream_sends_the_result_back_to_the_outbox() {
    let mut n = Net::new(cfg());
    let a = n.connect();
    n.hello(a, "tg");
    n.send(a, msg("m", "1", "x"));
    let t = n.last_tag();
    n.accept(t);
    n.take(a);
    n.b.read_closed(a);
    n.reply(t, "answer");
    // Written into a socket whose peer had closed both ways: never acknowledged...
    let mut void = Vec::new();
    assert_eq!(n.b.write(a, &mut void, n.now).unwrap(), Flushed::All);
    n.pump();
    assert!(
        n.closed.is_empty(),
        "closed before the result was acknowledged"
    );
    assert_eq!(n.b.awaiting_ack(), [a]);
    n.b.disconnected(a); // ...the peer answers with a reset
    let b = n.connect();
    n.hello(b, "tg");
    assert_eq!(ops(&n.take(b)), ["reply m answer"]);
}

#[test]
fn a_half_closed_client_with_nothing_outstanding_is_closed_at_once() {
    let mut n = Net::new(cfg());
    let a = n.connect();
    n.send(a, json!({"op": "ping"}));
    n.take(a);
    n.b.read_closed(a);
    n.pump();
    assert_eq!(n.closed, [a]);
}

// ---------------------------------------------------------------------------------------
// Row 10: with a token, a connection acts only for its hello's platform.

#[test]
fn row10_a_bridge_cannot_act_for_another_platform() {
    let mut n = Net::new(tokened());
    let d = n.connect();
    n.send(
        d,
        json!({"op": "hello", "platform": "discord", "token": "s3cret"}),
    );
    n.send(d, json!({"op": "message", "id": "1001", "platform": "telegram", "chat_id": "42", "text": "x"}));
    n.send(d, json!({"op": "message", "id": "n", "platform": "telegram", "chat_id": "42", "text": "/new"}));
    let out = n.take(d);
    assert_eq!(ops(&out), ["reject 1001 invalid", "reject n invalid"]);
    assert!(out[0]["detail"].as_str().unwrap().contains("discord"));
    assert!(n.order.is_empty());
    // Telegram's own 1001 is new to telegram.
    let t = n.connect();
    n.send(
        t,
        json!({"op": "hello", "platform": "telegram", "token": "s3cret"}),
    );
    n.send(t, msg("1001", "42", "x"));
    assert_eq!(n.order.len(), 1);
    // Its own platform is fine, named or not.
    n.send(
        d,
        json!({"op": "message", "id": "1001", "platform": "discord", "chat_id": "42", "text": "x"}),
    );
    assert_eq!(n.order.len(), 2);
}

#[test]
fn a_hello_without_a_platform_under_a_token_may_send_nothing() {
    let mut n = Net::new(tokened());
    let c = n.connect();
    n.send(c, json!({"op": "hello", "token": "s3cret"}));
    n.send(
        c,
        json!({"op": "message", "id": "1", "platform": "tg", "chat_id": "1", "text": "x"}),
    );
    assert_eq!(ops(&n.take(c)), ["reject 1 invalid"]);
}

// ---------------------------------------------------------------------------------------
// Row 11: duplicate windows are per platform; a flood cannot evict another's ids.

#[test]
fn row11_one_platforms_flood_cannot_evict_anothers_ids() {
    let mut n = Net::new(BridgeConfig {
        dedup_max: 100,
        ..cfg()
    });
    let tg = n.connect();
    n.hello(tg, "telegram");
    n.send(tg, msg("real", "1", "x"));
    let t = n.last_tag();
    n.accept(t);
    n.reply(t, "done");
    n.take(tg);
    let junk = n.connect();
    n.hello(junk, "junk");
    for i in 0..150 {
        n.send(junk, msg(&format!("j{i}"), &format!("c{i}"), "x"));
        let t = n.last_tag();
        if n.sub[&t].id.as_ref() == format!("j{i}") {
            n.accept(t);
            n.reply(t, "r");
        }
    }
    let out = n.take(junk);
    let refused = out.iter().filter(|v| v["reason"] == "backpressure").count();
    assert_eq!(refused, 50, "a full window must refuse, not evict");
    // Telegram's redelivery inside its window is still a duplicate.
    n.tick(60 * S);
    n.send(tg, msg("real", "1", "x"));
    assert_eq!(ops(&n.take(tg)), ["ack real duplicate"]);
    // After the window, the junk platform's ids expire and it has room again.
    n.tick(600 * S);
    n.send(junk, msg("j-late", "c", "x"));
    assert_eq!(n.sub[&n.last_tag()].id.as_ref(), "j-late");
}

#[test]
fn ids_expire_after_the_window_and_an_expired_platform_is_freed() {
    let mut n = Net::new(BridgeConfig {
        dedup_window: 10 * S,
        ..cfg()
    });
    let c = n.connect();
    n.send(
        c,
        json!({"op": "message", "id": "x", "platform": "p", "chat_id": "1", "text": "x"}),
    );
    let t = n.last_tag();
    n.accept(t);
    n.reply(t, "r");
    n.take(c);
    assert_eq!(n.platforms(), 1);
    n.tick(5 * S);
    n.send(
        c,
        json!({"op": "message", "id": "x", "platform": "p", "chat_id": "1", "text": "x"}),
    );
    assert_eq!(ops(&n.take(c)), ["ack x duplicate"]);
    n.tick(6 * S);
    assert_eq!(n.platforms(), 0, "an expired window kept its platform");
}

// ---------------------------------------------------------------------------------------
// Row 12: after `unauthorized`, no further line counts.

#[test]
fn row12_after_unauthorized_nothing_more_is_processed() {
    let mut n = Net::new(tokened());
    let c = n.connect();
    let mut burst = Vec::new();
    for _ in 0..3_999 {
        burst.push(json!({"op": "hello", "platform": "tg", "token": "wrong"}).to_string());
    }
    burst.push(json!({"op": "hello", "platform": "tg", "token": "s3cret"}).to_string());
    burst.push(msg("m", "1", "x").to_string());
    for line in &burst {
        n.raw(c, line.as_bytes());
    }
    n.b.line_too_long(c);
    assert!(!n.b.wants_read(c));
    assert!(
        n.order.is_empty(),
        "a message was accepted after unauthorized"
    );
    assert_eq!(ops(&n.take(c)), ["error unauthorized"]);
    assert_eq!(n.closed, [c]);
    assert_eq!(n.b.status().rejected["unauthorized"], 1);
}

#[test]
fn unauthenticated_connections_must_start_with_a_hello_carrying_the_token() {
    let mut n = Net::new(tokened());
    for first in [
        json!({"op": "ping"}),
        msg("m", "1", "x"),
        json!({"op": "hello", "platform": "tg"}),
        json!({"op": "hello", "platform": "tg", "token": "s3cre"}),
    ] {
        let c = n.connect();
        n.send(c, first);
        assert_eq!(ops(&n.take(c)), ["error unauthorized"]);
    }
    let c = n.connect();
    n.b.line_too_long(c);
    assert_eq!(ops(&n.take(c)), ["error unauthorized"]);
    // A later hello with a wrong token closes an authenticated connection too.
    let c = n.connect();
    n.send(
        c,
        json!({"op": "hello", "platform": "tg", "token": "s3cret"}),
    );
    n.send(c, json!({"op": "ping"}));
    n.send(c, json!({"op": "hello", "platform": "tg", "token": "nope"}));
    n.send(c, json!({"op": "ping"}));
    assert_eq!(ops(&n.take(c)), ["pong", "error unauthorized"]);
    assert!(n.closed.contains(&c));
    assert_eq!(n.platforms(), 0);
}

// ---------------------------------------------------------------------------------------
// Row 13: one answer per line, in line order; a duplicate is decided with admission.

#[test]
fn row13_a_duplicate_in_the_same_write_shares_the_originals_fate_in_order() {
    let mut n = Net::new(cfg());
    let c = n.connect();
    n.hello(c, "p");
    n.send(c, msg("a", "1", "x"));
    n.send(c, msg("b", "1", "x"));
    n.send(c, msg("b", "1", "x"));
    n.send(c, json!({"op": "ping"}));
    assert_eq!(n.order.len(), 2, "the copy was submitted");
    // Nothing is written before the first line's admission.
    assert!(n.take(c).is_empty(), "answers overtook a pending one");
    let (ta, tb) = (n.order[0], n.order[1]);
    n.accept(ta);
    n.event(tb, EventKind::Rejected(RejectReason::QueueFull));
    assert_eq!(
        ops(&n.take(c)),
        [
            "ack a running",
            "reject b queue_full",
            "reject b queue_full",
            "pong"
        ]
    );
    assert_eq!(n.b.status().rejected["queue_full"], 2, "one per line");
    // Accepted: the copy is a duplicate; copies from other connections too.
    let d = n.connect();
    n.send(c, msg("c", "1", "x"));
    n.send(
        d,
        json!({"op": "message", "id": "c", "platform": "p", "chat_id": "9", "text": "x"}),
    );
    n.send(c, msg("c", "1", "x"));
    let tc = n.last_tag();
    n.accept(tc);
    assert_eq!(ops(&n.take(c)), ["ack c running", "ack c duplicate"]);
    assert_eq!(ops(&n.take(d)), ["ack c duplicate"]);
}

#[test]
fn acks_carry_state_and_position_and_a_late_duplicate_is_acked_at_once() {
    let mut n = Net::new(cfg());
    let c = n.connect();
    n.hello(c, "p");
    n.send(c, msg("a", "1", "x"));
    let t = n.last_tag();
    n.event(
        t,
        EventKind::Accepted {
            state: AcceptState::Queued,
            position: 3,
        },
    );
    n.send(c, msg("a", "1", "x"));
    let out = n.take(c);
    assert_eq!(
        out,
        [
            json!({"op": "ack", "id": "a", "session": "p:dm:1", "state": "queued", "position": 3}),
            json!({"op": "ack", "id": "a", "session": "p:dm:1", "state": "duplicate"}),
        ]
    );
}

// ---------------------------------------------------------------------------------------
// Row 14 (the bridge's part): a forced exit answers what is still running.

#[test]
fn row14_a_forced_exit_answers_running_messages_cancelled_shutdown() {
    let mut n = Net::new(cfg());
    let c = n.connect();
    n.hello(c, "tg");
    n.send(c, msg("run", "1", "x"));
    n.send(c, msg("wait", "2", "x"));
    for t in n.order.clone() {
        n.accept(t);
    }
    n.take(c);
    n.b.abandon_all();
    assert_eq!(
        ops(&n.take(c)),
        ["cancelled run shutdown", "cancelled wait shutdown"]
    );
}

// ---------------------------------------------------------------------------------------
// Delivery and routing.

#[test]
fn a_result_goes_to_its_connection_else_the_newest_hello_else_the_outbox() {
    let mut n = Net::new(cfg());
    let a = n.connect();
    n.hello(a, "tg");
    let old = n.connect();
    n.hello(old, "tg");
    n.send(a, msg("m1", "1", "x"));
    n.send(a, msg("m2", "2", "x"));
    let (t1, t2) = (n.order[0], n.order[1]);
    n.accept(t1);
    n.accept(t2);
    n.reply(t1, "one");
    assert_eq!(
        ops(&n.take(a)),
        ["ack m1 running", "ack m2 running", "reply m1 one"]
    );
    n.b.disconnected(a);
    let newest = n.connect();
    n.hello(newest, "tg");
    n.reply(t2, "two");
    assert!(n.take(old).is_empty());
    assert_eq!(ops(&n.take(newest)), ["reply m2 two"]);
    // No hello left: the outbox keeps it until one comes.
    n.b.disconnected(old);
    n.b.disconnected(newest);
    let c = n.connect();
    n.send(
        c,
        json!({"op": "message", "id": "m3", "platform": "tg", "chat_id": "3", "text": "x"}),
    );
    let t3 = n.last_tag();
    n.accept(t3);
    n.take(c);
    n.b.disconnected(c);
    n.event(
        t3,
        EventKind::Finished(Outcome::Cancelled(CancelReason::Stopped)),
    );
    assert_eq!(n.b.backlog().outboxed, 1);
    let d = n.connect();
    n.hello(d, "tg");
    assert_eq!(ops(&n.take(d)), ["cancelled m3 stopped"]);
    assert_eq!(n.b.backlog().outboxed, 0);
}

#[test]
fn typing_follows_the_turn_and_is_refreshed() {
    let mut n = Net::new(BridgeConfig {
        typing_refresh: 4 * S,
        ..cfg()
    });
    let c = n.connect();
    n.send(
        c,
        json!({"op": "message", "id": "m", "platform": "tg", "chat_id": "5", "text": "x"}),
    );
    let t = n.last_tag();
    n.accept(t);
    n.event(t, EventKind::TurnStarted(TurnId(1)));
    n.tick(3 * S);
    n.tick(2 * S);
    n.tick(S / 2); // refreshed at 5 s: the next is due at 9 s, not now
    n.event(t, EventKind::TurnEnded(TurnId(1)));
    n.reply(t, "r");
    let out = n.take(c);
    let typing: Vec<bool> = out
        .iter()
        .filter(|v| v["op"] == "typing")
        .map(|v| v["on"] == true)
        .collect();
    assert_eq!(typing, [true, true, false]);
    assert_eq!(out[1]["chat_id"], "5");
    assert_eq!(out.last().unwrap()["op"], "reply");
}

#[test]
fn a_connection_that_takes_no_output_is_closed_after_the_stall_timeout() {
    let mut n = Net::new(BridgeConfig {
        write_stall_timeout: 10 * S,
        ..cfg()
    });
    let a = n.connect();
    n.hello(a, "tg");
    n.send(a, msg("m", "1", "x"));
    let t = n.last_tag();
    n.accept(t);
    n.reply(t, "r");
    let mut full = Pipe {
        data: Vec::new(),
        room: 0,
    };
    assert_eq!(n.b.write(a, &mut full, n.now).unwrap(), Flushed::Blocked);
    // A blocked write is no progress; a byte taken is.
    n.tick(5 * S);
    assert_eq!(n.b.write(a, &mut full, n.now).unwrap(), Flushed::Blocked);
    n.tick(4 * S);
    n.tick(900 * Duration::from_millis(1));
    assert!(n.closed.is_empty());
    assert!(n.b.has_output(a));
    let mut one = Pipe {
        data: Vec::new(),
        room: 1,
    };
    assert_eq!(n.b.write(a, &mut one, n.now).unwrap(), Flushed::Blocked);
    n.tick(100 * Duration::from_millis(1));
    assert!(n.closed.is_empty(), "closed while making progress");
    n.tick(9 * S);
    n.tick(900 * Duration::from_millis(1));
    assert_eq!(n.closed, [a]);
    assert_eq!(n.reset, [a], "its unsent copy could still reach the peer");
    let b = n.connect();
    n.hello(b, "tg");
    assert_eq!(ops(&n.take(b)), ["reply m r"]);
}

#[test]
fn a_client_that_does_not_read_stops_being_read() {
    let mut n = Net::new(BridgeConfig {
        max_write_buffer: 1_000,
        ..cfg()
    });
    let a = n.connect();
    for _ in 0..100 {
        n.send(a, json!({"op": "ping"}));
        if !n.b.wants_read(a) {
            break;
        }
    }
    assert!(!n.b.wants_read(a));
    n.take(a);
    assert!(n.b.wants_read(a));
    // Exactly at the bound is over it: one pong line (with the line limit) is 37 bytes.
    let mut n = Net::new(BridgeConfig {
        max_write_buffer: 37,
        ..cfg()
    });
    let a = n.connect();
    n.send(a, json!({"op": "ping"}));
    assert!(!n.b.wants_read(a));
    n.b.read_closed(a);
    n.pump();
    assert!(!n.b.wants_read(a), "a half-closed connection is not read");
}

#[test]
fn a_write_error_sends_unwritten_results_back_to_the_outbox() {
    let mut n = Net::new(cfg());
    let a = n.connect();
    n.hello(a, "tg");
    n.send(a, msg("m", "1", "x"));
    let t = n.last_tag();
    n.accept(t);
    n.reply(t, "r");
    assert!(n.b.write(a, &mut Broken, n.now).is_err());
    n.b.disconnected(a);
    let b = n.connect();
    n.hello(b, "tg");
    assert_eq!(ops(&n.take(b)), ["reply m r"]);
}

// ---------------------------------------------------------------------------------------
// Issue 7 §2–§3: sender, meta, partials.

#[test]
fn sender_and_meta_reach_the_message_and_bad_meta_is_invalid() {
    let mut n = Net::new(cfg());
    let c = n.connect();
    n.hello(c, "tg");
    n.send(
        c,
        json!({"op": "message", "id": "m", "chat_id": "1", "text": "hi", "user_id": "7",
               "user_name": "Ann", "meta": {"reply_to": "m0"}}),
    );
    let t = n.last_tag();
    n.accept(t);
    let m = &n.sub[&t];
    assert_eq!(m.context.user_id.as_deref(), Some("7"));
    assert_eq!(m.context.user_name.as_deref(), Some("Ann"));
    assert_eq!(m.context.meta.as_deref(), Some(r#"{"reply_to":"m0"}"#));
    assert_eq!(
        m.session.as_str(),
        "tg:dm:1",
        "a DM sender is not part of the key"
    );
    let big = json!({"x": "a".repeat(17 * 1024)});
    n.send(
        c,
        json!({"op": "message", "id": "b", "chat_id": "1", "text": "hi", "meta": big}),
    );
    n.send(
        c,
        json!({"op": "message", "id": "c", "chat_id": "1", "text": "hi", "user_name": "Bob"}),
    );
    n.send(
        c,
        json!({"op": "message", "id": "d", "chat_id": "1", "text": "hi", "meta": "x"}),
    );
    let out = n.take(c);
    let rejects: Vec<&Value> = out.iter().filter(|v| v["op"] == "reject").collect();
    assert_eq!(rejects.len(), 3, "{out:?}");
    assert!(rejects.iter().all(|v| v["reason"] == "invalid"));
    assert!(rejects[0]["detail"].as_str().unwrap().contains("meta"));
    assert!(rejects[1]["detail"].as_str().unwrap().contains("user_name"));
    assert_eq!(n.order.len(), 1);
}

#[test]
fn partials_go_to_the_messages_connection_best_effort_and_never_to_the_outbox() {
    let mut n = Net::new(BridgeConfig {
        max_write_buffer: 2_000,
        ..cfg()
    });
    let a = n.connect();
    n.hello(a, "tg");
    n.send(a, msg("m", "1", "x"));
    let t = n.last_tag();
    n.accept(t);
    n.event(t, EventKind::Partial("hel".into()));
    n.event(t, EventKind::Partial("hello".into()));
    let out = n.take(a);
    assert_eq!(
        out[1],
        json!({"op": "partial", "id": "m", "session": "tg:dm:1", "text": "hel"})
    );
    assert_eq!(out[2]["text"], "hello");
    // Over its output bound: dropped, not queued.
    for i in 0..100 {
        n.event(t, EventKind::Partial(format!("{i} {}", "x".repeat(100))));
    }
    let queued = n.take(a).len();
    assert!(queued < 30, "{queued}");
    // Connection gone: dropped, never outboxed.
    n.b.disconnected(a);
    n.event(t, EventKind::Partial("late".into()));
    assert_eq!(n.b.backlog().outboxed, 0);
    assert!(n.b.status().partials_dropped > 70);
    n.reply(t, "hello world");
    let b = n.connect();
    n.hello(b, "tg");
    assert_eq!(ops(&n.take(b)), ["reply m hello world"]);
}

#[test]
fn malformed_lines_get_errors_and_the_connection_keeps_working() {
    let mut n = Net::new(cfg());
    let c = n.connect();
    n.raw(c, b"{nope");
    n.raw(c, b"[1]");
    n.b.line_too_long(c);
    n.send(
        c,
        json!({"op": "message", "id": "x", "text": "hi", "platform": "p"}),
    );
    n.send(
        c,
        json!({"op": "message", "id": "y", "chat_id": "1", "text": "hi"}),
    );
    n.send(c, json!({"op": "ping"}));
    let out = n.take(c);
    assert_eq!(out.len(), 6);
    assert_eq!(out[2]["detail"], "line longer than 65536 bytes; discarded");
    assert_eq!(ops(&out[3..5]), ["reject x invalid", "reject y invalid"]);
    assert!(
        out[4]["detail"]
            .as_str()
            .unwrap()
            .contains("platform is required")
    );
    assert_eq!(out[5]["op"], "pong");
    assert_eq!(n.b.status().errors, 3);
    assert_eq!(n.b.status().rejected["invalid"], 2);
}

#[test]
fn status_counts_connections_platforms_and_outboxes() {
    let mut n = Net::new(tokened());
    let c = n.connect();
    let _pending = n.connect();
    n.send(
        c,
        json!({"op": "hello", "platform": "tg", "token": "s3cret"}),
    );
    n.send(c, msg("m", "1", "x"));
    let st = n.b.status();
    assert_eq!(
        (st.connections, st.unauthenticated, st.platforms),
        (2, 1, 1)
    );
    let tg = &st.outboxes["tg"];
    assert_eq!(
        (tg.connections, tg.reserved_events, tg.dedup_ids),
        (1, 1, 1)
    );
    // Issue 18 row 2: a message reserves its envelope (was --max-reply-bytes + 8 KiB).
    assert_eq!(
        tg.reserved_bytes,
        turnstile::internal::server::TERMINAL_ENVELOPE
    );
    let v = serde_json::to_value(&st).unwrap();
    assert_eq!(v["outboxes"]["tg"]["outbox_events"], 0);
}

#[test]
fn the_largest_possible_result_fits_its_reservation() {
    // Debug builds assert that every result fits the room reserved for it at admission:
    // a reply at the length limit, with the longest id, chat, thread and (group) user.
    let mut n = Net::new(BridgeConfig {
        max_reply_bytes: 100,
        ..cfg()
    });
    let c = n.connect();
    n.hello(c, &"p".repeat(64));
    let long = "\"%:".repeat(85);
    n.send(
        c,
        json!({"op": "message", "id": long, "chat_id": long, "thread_id": long,
               "user_id": long, "chat_type": "group", "text": "x"}),
    );
    let t = n.last_tag();
    n.accept(t);
    n.reply(t, &"\"".repeat(100));
    n.event(
        t,
        EventKind::Finished(Outcome::Failed(turnstile::FailReason::Agent(
            "\"".repeat(500),
        ))),
    );
    let out = n.take(c);
    assert_eq!(out[1]["text"].as_str().map(str::len), Some(100));
    assert_eq!(out.len(), 2, "a second terminal for one message");
}

/// A `may_use` query is answered with the policy's word for the query's platform, else the
/// hello's (an open policy here: allowed), in line order behind a pending ack; with no
/// platform at all it gets an error naming what is missing (the access room's decision,
/// carried out by the bridge).
#[test]
fn a_may_use_query_is_answered_in_line_order_with_the_policys_word() {
    let mut n = Net::new(BridgeConfig::default());
    let c = n.connect();
    n.hello(c, "tg");
    n.send(c, msg("1", "42", "hi"));
    n.send(c, json!({"op": "may_use", "id": "q1", "user_id": "u"}));
    assert!(
        n.take(c).is_empty(),
        "the answer waits behind the pending ack"
    );
    let tag = n.last_tag();
    n.accept(tag);
    let out = n.take(c);
    assert_eq!(ops(&out), ["ack 1 running", "may_use q1"]);
    assert_eq!(out[1]["allowed"], json!(true));
    let bare = n.connect();
    n.send(bare, json!({"op": "hello"}));
    n.send(bare, json!({"op": "may_use", "id": "q2", "user_id": "u"}));
    n.send(
        bare,
        json!({"op": "may_use", "id": "q3", "user_id": "u", "platform": "tg"}),
    );
    let out = n.take(bare);
    assert_eq!(
        ops(&out),
        [
            "error may_use: no platform (give one, or say hello with one)",
            "may_use q3"
        ]
    );
    assert_eq!(out[1]["allowed"], json!(true));
}

#[test]
fn core_rejections_name_their_reason_with_a_detail() {
    let mut n = Net::new(cfg());
    let c = n.connect();
    n.hello(c, "tg");
    n.send(c, msg("a", "1", "x"));
    n.send(c, msg("b", "2", "x"));
    let (ta, tb) = (n.order[0], n.order[1]);
    n.event(ta, EventKind::Rejected(RejectReason::QueueFull));
    n.event(tb, EventKind::Rejected(RejectReason::ShuttingDown));
    let out = n.take(c);
    assert_eq!(out[0]["detail"], "the session's queue is full");
    assert_eq!(out[1]["reason"], "shutting_down");
    assert_eq!(out[1]["detail"], "the gateway is shutting down");
    assert_eq!(out[1]["session"], "tg:dm:2");
    assert_eq!(n.b.status().rejected["shutting_down"], 1);
    let n = Net::new(BridgeConfig {
        max_platforms: 3,
        ..cfg()
    });
    assert_eq!(n.b.config().max_platforms, 3);
}

#[test]
fn a_half_closing_bridge_hands_the_backlog_to_the_previous_hello() {
    let mut n = Net::new(cfg());
    let a = n.connect();
    n.hello(a, "tg");
    n.send(a, msg("m", "1", "x"));
    let t = n.last_tag();
    n.accept(t);
    n.take(a);
    n.b.disconnected(a);
    let older = n.connect();
    n.hello(older, "tg");
    n.take(older);
    let newer = n.connect();
    n.hello(newer, "tg");
    n.send(newer, json!({"op": "ping"}));
    n.b.read_closed(newer);
    n.pump();
    n.reply(t, "r");
    assert_eq!(ops(&n.take(older)), ["reply m r"]);
    assert_eq!(ops(&n.take(newer)), ["pong"]);
}

#[test]
fn typing_is_dropped_when_no_connection_can_take_it() {
    let mut n = Net::new(BridgeConfig {
        max_write_buffer: 10,
        ..cfg()
    });
    let c = n.connect();
    n.hello(c, "tg");
    n.send(c, msg("m", "1", "x"));
    let t = n.last_tag();
    n.accept(t);
    // The ack alone is over this connection's tiny bound.
    n.event(t, EventKind::TurnStarted(TurnId(1)));
    assert_eq!(n.b.status().typing_dropped, 1);
    n.take(c);
    n.b.disconnected(c);
    n.event(t, EventKind::TurnEnded(TurnId(1)));
    assert_eq!(n.b.status().typing_dropped, 2);
}

#[test]
fn output_marks_a_connection_to_write_and_a_write_is_its_turn() {
    let mut n = Net::new(cfg());
    let a = n.connect();
    let b = n.connect();
    n.send(a, json!({"op": "ping"}));
    n.send(a, json!({"op": "ping"}));
    assert_eq!(n.b.take_dirty(), [a]);
    assert!(n.b.take_dirty().is_empty());
    n.send(b, json!({"op": "ping"}));
    n.send(a, json!({"op": "ping"}));
    n.take(a);
    assert_eq!(
        n.b.take_dirty(),
        [b],
        "a connection just written was listed again"
    );
    assert!(!n.b.has_output(a) && n.b.has_output(b));
}

#[test]
fn a_result_is_released_only_once_acknowledged_and_a_silent_peer_is_closed() {
    let mut n = Net::new(BridgeConfig {
        outbox_cap: 1,
        write_stall_timeout: 10 * S,
        ..cfg()
    });
    let a = n.connect();
    n.hello(a, "tg");
    n.send(a, msg("m", "1", "x"));
    let t = n.last_tag();
    n.accept(t);
    n.reply(t, "r");
    let mut w = Vec::new();
    n.b.write(a, &mut w, n.now).unwrap();
    let written = n.b.written(a);
    assert_eq!(written, w.len() as u64);
    // Still owed until the peer's TCP acknowledges the whole line.
    n.send(a, msg("m2", "2", "x"));
    n.b.acked(a, written - 1);
    assert_eq!(n.b.status().outboxes["tg"].reserved_events, 1);
    n.b.acked(a, written);
    assert_eq!(n.b.status().outboxes["tg"].reserved_events, 0);
    assert!(n.b.awaiting_ack().is_empty());
    // A peer that acknowledges nothing for the stall timeout is closed; the result returns.
    n.send(a, msg("m3", "3", "x"));
    let t3 = n.last_tag();
    n.accept(t3);
    n.reply(t3, "r3");
    let mut w = Vec::new();
    n.b.write(a, &mut w, n.now).unwrap();
    n.tick(5 * S);
    n.b.acked(a, written); // no progress: the stall clock keeps running
    n.tick(4 * S);
    n.tick(900 * Duration::from_millis(1));
    assert!(n.closed.is_empty());
    n.tick(100 * Duration::from_millis(1));
    assert_eq!(n.closed, [a]);
    let b = n.connect();
    n.hello(b, "tg");
    assert_eq!(ops(&n.take(b)), ["reply m3 r3"]);
}

#[test]
fn deadlines_are_checked_every_100_ms_not_at_every_wake() {
    let mut n = Net::new(BridgeConfig {
        write_stall_timeout: 10 * S,
        ..cfg()
    });
    assert_eq!(n.b.tick(Duration::ZERO), Duration::from_millis(100));
    assert_eq!(
        n.b.tick(Duration::from_millis(50)),
        Duration::from_millis(100)
    );
    let a = n.connect();
    n.send(a, json!({"op": "ping"}));
    let mut full = Pipe {
        data: Vec::new(),
        room: 0,
    };
    n.b.write(a, &mut full, n.now).unwrap();
    n.tick(9 * S + Duration::from_millis(950));
    // Due at 10 s, but the last check was at 9.95 s: the next is at 10.05 s.
    n.tick(Duration::from_millis(50));
    assert!(n.closed.is_empty());
    n.tick(Duration::from_millis(50));
    assert_eq!(n.closed, [a]);
    assert_eq!(n.b.status().connections_refused, 1);
}

#[test]
fn a_partial_is_dropped_exactly_at_the_output_bound() {
    let ack =
        json!({"op": "ack", "id": "m", "session": "tg:dm:1", "state": "running", "position": 0});
    let mut n = Net::new(BridgeConfig {
        max_write_buffer: ack.to_string().len() + 1,
        ..cfg()
    });
    let a = n.connect();
    n.hello(a, "tg");
    n.send(a, msg("m", "1", "x"));
    let t = n.last_tag();
    n.accept(t);
    n.event(t, EventKind::Partial("p".into()));
    assert_eq!(n.b.status().partials_dropped, 1);
    assert_eq!(ops(&n.take(a)), ["ack m running"]);
}

#[test]
fn one_write_pass_takes_at_most_the_write_budget_even_from_a_backlog() {
    // A small output bound: the pass refills from the outbox several times within its budget.
    let mut n = Net::new(BridgeConfig {
        write_budget: 1_000,
        max_write_buffer: 100,
        ..cfg()
    });
    let a = n.connect();
    n.hello(a, "tg");
    for i in 0..100 {
        n.send(a, msg(&format!("m{i}"), &format!("c{i}"), "x"));
    }
    for t in n.order.clone() {
        n.accept(t);
    }
    n.take(a);
    n.b.disconnected(a);
    for t in n.order.clone() {
        n.reply(t, "r");
    }
    let b = n.connect();
    n.hello(b, "tg");
    let mut w = Vec::new();
    assert_eq!(n.b.write(b, &mut w, n.now).unwrap(), Flushed::Budget);
    assert!((1_000..1_100).contains(&w.len()), "{}", w.len());
}

#[test]
fn a_second_hello_moves_only_that_connection() {
    let mut n = Net::new(cfg());
    let a = n.connect();
    let b = n.connect();
    n.hello(a, "tg");
    n.hello(b, "tg");
    n.hello(a, "discord");
    let st = n.b.status();
    assert_eq!(
        (
            st.outboxes["tg"].connections,
            st.outboxes["discord"].connections
        ),
        (1, 1)
    );
    n.hello(a, "discord");
    assert_eq!(n.b.status().outboxes["discord"].connections, 1);
    n.send(a, json!({"op": "hello"}));
    assert_eq!(n.platforms(), 1, "the platform it left was not freed");
}

#[test]
fn a_blocked_write_is_no_progress_for_the_stall_clock() {
    let mut n = Net::new(BridgeConfig {
        write_stall_timeout: 10 * S,
        ..cfg()
    });
    let a = n.connect();
    let b = n.connect();
    for c in [a, b] {
        n.send(c, json!({"op": "ping"}));
    }
    let mut full = Pipe {
        data: Vec::new(),
        room: 0,
    };
    n.b.write(a, &mut full, n.now).unwrap();
    n.b.write(b, &mut full, n.now).unwrap();
    n.tick(5 * S);
    n.b.write(a, &mut full, n.now).unwrap(); // nothing taken
    let mut one = Pipe {
        data: Vec::new(),
        room: 1,
    };
    n.b.write(b, &mut one, n.now).unwrap(); // one byte taken
    n.tick(5 * S);
    assert_eq!(n.closed, [a]);
    n.tick(5 * S);
    assert_eq!(n.closed, [a, b]);
}

#[test]
fn results_rescued_from_a_connection_go_at_once_to_their_platforms_newest_hello() {
    let mut n = Net::new(cfg());
    let b = n.connect();
    n.hello(b, "tg");
    let a = n.connect();
    n.send(
        a,
        json!({"op": "message", "id": "m", "platform": "tg", "chat_id": "1", "text": "x"}),
    );
    let t = n.last_tag();
    n.accept(t);
    n.reply(t, "r");
    let mut void = Vec::new();
    n.b.write(a, &mut void, n.now).unwrap(); // written, never acknowledged
    n.b.take_dirty();
    n.b.disconnected(a);
    assert_eq!(
        n.b.take_dirty(),
        [b],
        "the rescued result waits for an unrelated event"
    );
    assert_eq!(ops(&n.take(b)), ["reply m r"]);
}

/// One generational id: a connection's handle kept after it closed names nothing, even when
/// a new connection reuses its slot, so a late line or write for the old one never reaches
/// the new one.
#[test]
fn a_closed_connections_handle_never_reaches_the_one_reusing_its_slot() {
    let mut n = Net::new(BridgeConfig::default());
    let old = n.connect();
    n.b.disconnected(old);
    n.pump();
    let new = n.connect();
    assert_eq!(old.index(), new.index(), "the slot is reused");
    assert_ne!(old, new);
    n.send(old, json!({"op": "ping"}));
    assert!(
        n.take(new).is_empty(),
        "the old handle's ping was answered on the new one"
    );
    n.send(new, json!({"op": "ping"}));
    assert_eq!(
        n.take(new),
        vec![json!({"op": "pong", "max_line_bytes": 65_536})]
    );
}

// ---------------------------------------------------------------------------------------
// Durability (issue 10): the journal as records and completions, without a disk.

fn durable() -> BridgeConfig {
    BridgeConfig {
        journal: true,
        ..cfg()
    }
}

fn kinds(records: &[Record]) -> Vec<String> {
    records
        .iter()
        .map(|r| match r {
            Record::Accepted(m) => format!("accepted {}", m.seq),
            Record::Started { seq, attempt } => format!("started {seq} {attempt}"),
            Record::Outcome { seq, .. } => format!("outcome {seq}"),
            Record::Delivered { seq } => format!("delivered {seq}"),
            Record::Forget { seq } => format!("forget {seq}"),
        })
        .collect()
}

#[test]
fn an_ack_and_an_outcome_wait_for_their_records_to_be_durable() {
    let mut store = MemStore::new();
    let mut n = Net::new(durable());
    let c = n.connect();
    n.hello(c, "tg");
    n.send(c, msg("1", "42", "hi"));
    assert!(n.order.is_empty(), "submitted before it was durable");
    assert!(n.take(c).is_empty(), "answered before it was durable");
    assert_eq!(kinds(&n.journal), ["accepted 1"]);
    assert_eq!(n.b.status().journal.unwrap().pending_durable, 1);
    n.commit(&mut store);
    assert_eq!(n.order, [1]);
    n.accept(1);
    n.event(1, EventKind::TurnStarted(TurnId(1)));
    assert_eq!(ops(&n.take(c)), ["ack 1 running", "typing"]);
    n.reply(1, "hello");
    assert!(
        n.take(c).is_empty(),
        "the reply went out before its record was durable"
    );
    assert_eq!(kinds(&n.journal), ["started 1 1", "outcome 1"]);
    n.commit(&mut store);
    assert_eq!(ops(&n.take(c)), ["reply 1 hello"]);
    // Without acks, the TCP acknowledgement (in take) delivers it: the message leaves.
    assert_eq!(kinds(&n.journal), ["delivered 1"]);
    n.commit(&mut store);
    let r = store.load(0).unwrap();
    assert!(r.messages.is_empty());
    assert_eq!(r.dedup.len(), 1, "the id stays in the duplicate window");
}

#[test]
fn a_failed_journal_write_rejects_storage_and_holds_outcomes_until_a_write_succeeds() {
    let mut store = MemStore::new();
    let mut n = Net::new(durable());
    let c = n.connect();
    n.hello(c, "tg");
    n.send(c, msg("1", "42", "first"));
    n.commit(&mut store);
    n.accept(1);
    n.send(c, msg("2", "43", "second"));
    n.reply(1, "one");
    // The disk fails: the new message is refused; the acked one's outcome waits for its
    // record (a bridge that had it could be answered differently after a crash).
    n.fail_journal();
    let out = n.take(c);
    assert_eq!(ops(&out), ["ack 1 running", "reject 2 storage"]);
    assert!(out[1]["detail"].as_str().unwrap().contains("no space left"));
    let st = n.b.status();
    assert!(st.journal.as_ref().unwrap().failing);
    assert_eq!(st.journal.as_ref().unwrap().unjournaled_outcomes, 1);
    assert_eq!(st.rejected["storage"], 1);
    assert_eq!(n.order, [1], "a message that is not durable was submitted");
    // The outcome's record is kept for another try; the refused id is new again.
    assert_eq!(kinds(&n.journal), ["outcome 1"]);
    n.fail_journal();
    assert!(
        n.take(c).is_empty(),
        "an outcome went out on a failed retry"
    );
    n.send(c, msg("2", "43", "second"));
    n.commit(&mut store);
    assert_eq!(n.order, [1, 3], "the retry is journaled and submitted anew");
    n.accept(3);
    assert_eq!(
        ops(&n.take(c)),
        ["ack 2 running", "reply 1 one"],
        "the outcome goes once its record is durable (after the answer ahead of it)"
    );
    assert!(
        !n.b.status().journal.unwrap().failing,
        "writes succeed again"
    );
    let r = store.load(0).unwrap();
    assert_eq!(r.messages.len(), 2, "message 1 (its outcome) and message 3");
    assert!(r.messages[0].outcome.is_some());
}

#[test]
fn a_turn_is_released_to_its_agent_only_once_its_started_record_is_durable() {
    let mut store = MemStore::new();
    let mut n = Net::new(durable());
    let c = n.connect();
    n.hello(c, "tg");
    n.send(c, msg("1", "42", "first"));
    n.commit(&mut store);
    n.accept(1);
    n.event(1, EventKind::TurnStarted(TurnId(7)));
    assert_eq!(kinds(&n.journal), ["started 1 1"]);
    assert!(
        n.released.is_empty(),
        "released before its record was written"
    );
    // While the journal cannot write, the turn waits.
    n.fail_journal();
    n.fail_journal();
    assert!(n.released.is_empty(), "released though its record failed");
    n.commit(&mut store);
    assert_eq!(n.released, [TurnId(7)]);
    assert_eq!(store.load(0).unwrap().messages[0].starts, 1);
    // Other records becoming durable release nothing more.
    n.send(c, msg("2", "42", "second"));
    n.commit(&mut store);
    assert_eq!(n.released, [TurnId(7)]);
    let _ = n.take(c);
}

#[test]
fn a_runtime_refusal_after_journaling_forgets_the_message() {
    let mut store = MemStore::new();
    let mut n = Net::new(durable());
    let c = n.connect();
    n.hello(c, "tg");
    n.send(c, msg("1", "42", "hi"));
    n.commit(&mut store);
    n.event(1, EventKind::Rejected(RejectReason::QueueFull));
    // A bridge told `reject` retries the id as new: the journal must not bring it back.
    assert!(
        n.take(c).is_empty(),
        "refused before its forget record was durable"
    );
    assert_eq!(kinds(&n.journal), ["forget 1"]);
    n.fail_journal();
    assert!(
        n.take(c).is_empty(),
        "refused though its forget record failed"
    );
    n.commit(&mut store);
    assert_eq!(ops(&n.take(c)), ["reject 1 queue_full"]);
    let r = store.load(0).unwrap();
    assert!(r.messages.is_empty() && r.dedup.is_empty());
}

#[test]
fn pending_durability_is_bounded_and_answers_overloaded() {
    let mut n = Net::new(BridgeConfig {
        max_pending_durable: 2,
        ..durable()
    });
    let c = n.connect();
    n.hello(c, "tg");
    for i in 0..3 {
        n.send(c, msg(&i.to_string(), "42", "x"));
    }
    // Answers leave in line order: the refusal waits behind the two pending acks.
    assert!(n.take(c).is_empty());
    let j = n.b.status().journal.unwrap();
    assert_eq!(
        (j.pending_durable, j.max_pending_durable, j.queued_records),
        (2, 2, 2)
    );
    let mut store = MemStore::new();
    n.commit(&mut store);
    n.accept(1);
    n.accept(2);
    let out = n.take(c);
    assert_eq!(
        ops(&out),
        ["ack 0 running", "ack 1 running", "reject 2 overloaded"]
    );
    assert!(
        out[2]["detail"]
            .as_str()
            .unwrap()
            .contains("--max-pending-durable")
    );
    n.send(c, msg("2", "42", "x"));
    assert_eq!(n.b.status().journal.unwrap().pending_durable, 1);
}

#[test]
fn an_acks_bridge_keeps_results_until_it_confirms_them_and_gets_them_again_marked() {
    let mut store = MemStore::new();
    let mut n = Net::new(durable());
    let c = n.connect();
    n.send(c, json!({"op": "hello", "platform": "tg", "acks": true}));
    n.send(c, msg("1", "42", "hi"));
    n.commit(&mut store);
    n.accept(1);
    n.reply(1, "hello");
    n.commit(&mut store);
    assert_eq!(ops(&n.take(c)), ["ack 1 running", "reply 1 hello"]);
    // Its TCP took the reply, but only `delivered` counts.
    assert!(n.journal.is_empty());
    let st = n.b.status();
    assert_eq!(
        (st.awaiting_delivery, st.outboxes["tg"].reserved_events),
        (1, 1)
    );
    n.b.disconnected(c);
    let d = n.connect();
    n.send(d, json!({"op": "hello", "platform": "tg", "acks": true}));
    let out = n.take(d);
    assert_eq!(ops(&out), ["reply 1 hello"]);
    assert_eq!(out[0]["redelivery"], true);
    n.send(d, json!({"op": "delivered", "ids": ["1", "unknown"]}));
    assert_eq!(kinds(&n.journal), ["delivered 1"]);
    let st = n.b.status();
    assert_eq!((st.awaiting_delivery, st.platforms), (0, 1));
    assert_eq!(st.outboxes["tg"].reserved_events, 0);
    // A malformed confirmation is an error line.
    n.send(d, json!({"op": "delivered", "ids": [1]}));
    assert_eq!(n.take(d)[0]["op"], "error");
}

#[test]
fn the_redelivery_set_is_bounded_by_the_outbox() {
    let mut store = MemStore::new();
    let mut n = Net::new(BridgeConfig {
        outbox_cap: 2,
        ..durable()
    });
    let c = n.connect();
    n.send(c, json!({"op": "hello", "platform": "tg", "acks": true}));
    for i in 1..=2 {
        n.send(c, msg(&i.to_string(), &i.to_string(), "x"));
        n.commit(&mut store);
        n.accept(i);
        n.reply(i, "r");
        n.commit(&mut store);
    }
    n.take(c);
    // Two results await confirmation: the platform owes them, and a third message waits.
    n.send(c, msg("3", "3", "x"));
    assert_eq!(ops(&n.take(c)), ["reject 3 backpressure"]);
    n.send(c, json!({"op": "delivered", "ids": ["1"]}));
    n.send(c, msg("3", "3", "x"));
    assert!(n.take(c).is_empty(), "waits for the journal");
    assert_eq!(kinds(&n.journal), ["delivered 1", "accepted 3"]);
}

fn stored(seq: u64, id: &str, chat: &str) -> StoredMessage {
    StoredMessage::new(
        seq,
        "tg",
        MessageFields {
            user_id: Some("7".into()),
            user_name: Some("Ann".into()),
            meta: Some("{\"k\":1}".into()),
            ..MessageFields::new(id, chat, &format!("text of {id}"))
        },
        1_000_600_000,
    )
}

fn journal_of(messages: Vec<(StoredMessage, u32, Option<StoredOutcome>)>) -> Recovered {
    Recovered {
        dedup: messages
            .iter()
            .map(|(m, _, _)| (m.platform().to_owned(), m.id().to_owned(), m.dedup_until_ms))
            .collect(),
        max_seq: messages.iter().map(|(m, _, _)| m.seq).max().unwrap_or(0),
        messages: messages
            .into_iter()
            .map(|(message, starts, outcome)| RecoveredMessage {
                message,
                starts,
                outcome,
            })
            .collect(),
    }
}

/// A journal with: a waiting message, an interrupted turn, a turn interrupted twice, a
/// reply not yet delivered, then a later waiting message of the first session.
fn crashed_journal() -> Recovered {
    let reply = StoredOutcome {
        head: b"{\"op\":\"reply\",\"id\":\"d\",\"session\":\"tg:dm:4\",\"text\":\"done\"}\n"
            .to_vec(),
        ..StoredOutcome::default()
    };
    journal_of(vec![
        (stored(10, "a", "1"), 0, None),
        (stored(11, "b", "2"), 1, None),
        (stored(12, "c", "3"), 2, None),
        (stored(13, "d", "4"), 1, Some(reply)),
        (stored(14, "e", "1"), 0, None),
    ])
}

#[test]
fn recovery_requeues_in_order_and_fails_interrupted_turns() {
    let mut n = Net::new(durable());
    let counts =
        n.b.recover(crashed_journal(), 1_000_000_000, Duration::ZERO);
    n.pump();
    assert_eq!(
        (
            counts.messages,
            counts.requeued,
            counts.interrupted,
            counts.poisoned,
            counts.outcomes
        ),
        (5, 2, 2, 0, 1)
    );
    assert_eq!(
        n.order,
        [10, 14],
        "waiting messages in their original order"
    );
    let m = &n.sub[&10];
    assert_eq!(m.session.as_str(), "tg:dm:1");
    assert_eq!(m.context.user_name.as_deref(), Some("Ann"));
    assert_eq!(m.context.meta.as_deref(), Some("{\"k\":1}"));
    assert_eq!(kinds(&n.journal), ["outcome 11", "outcome 12"]);
    let mut store = MemStore::new();
    n.commit(&mut store);
    let c = n.connect();
    n.hello(c, "tg");
    let out = n.take(c);
    assert_eq!(ops(&out), ["reply d done", "failed b", "failed c"]);
    assert_eq!(out[0]["redelivery"], true);
    assert_eq!(out[1]["error"], "interrupted by restart");
    // New messages continue the sequence; a recovered one's outcome goes to the outbox.
    n.send(c, msg("f", "9", "x"));
    assert_eq!(kinds(&n.journal).last().unwrap(), "accepted 15");
    n.accept(10);
    n.reply(10, "A");
    n.commit(&mut store);
    n.accept(15);
    assert_eq!(ops(&n.take(c)), ["ack f running", "reply a A"]);
}

#[test]
fn with_resume_an_interrupted_turn_runs_again_and_one_interrupted_twice_is_poison() {
    let mut n = Net::new(BridgeConfig {
        resume_interrupted: true,
        ..durable()
    });
    let counts =
        n.b.recover(crashed_journal(), 1_000_000_000, Duration::ZERO);
    n.pump();
    assert_eq!(
        (
            counts.requeued,
            counts.resumed,
            counts.interrupted,
            counts.poisoned
        ),
        (3, 1, 0, 1)
    );
    assert_eq!(n.order, [10, 11, 14]);
    assert_eq!(kinds(&n.journal), ["outcome 12"]);
    // Its next start is its second: journaled as such, so another crash makes it poison.
    n.accept(11);
    n.event(11, EventKind::TurnStarted(TurnId(5)));
    assert_eq!(kinds(&n.journal)[1], "started 11 2");
    let mut store = MemStore::new();
    n.commit(&mut store);
    let c = n.connect();
    n.hello(c, "tg");
    let out = n.take(c);
    let poison = out.iter().find(|v| v["id"] == "c").unwrap();
    assert_eq!(poison["op"], "failed");
    assert!(poison["error"].as_str().unwrap().starts_with("poison"));
}

#[test]
fn the_duplicate_window_survives_a_restart() {
    let mut n = Net::new(durable());
    let mut r = journal_of(vec![]);
    // Two ids remembered: one still inside its window, one past it.
    r.dedup = vec![
        ("tg".into(), "old".into(), 1_000_000_500),
        ("tg".into(), "seen".into(), 1_000_300_000),
    ];
    // A message still in flight whose window ran out while it waited stays a duplicate.
    let mut waiting = stored(3, "waiting", "2");
    waiting.dedup_until_ms = 999_000_000;
    r.messages.push(RecoveredMessage {
        message: waiting,
        starts: 0,
        outcome: None,
    });
    r.max_seq = 3;
    let counts = n.b.recover(r, 1_000_000_000, Duration::ZERO);
    n.pump();
    assert_eq!(counts.dedup_ids, 3);
    let c = n.connect();
    n.hello(c, "tg");
    n.send(c, msg("seen", "1", "again"));
    n.tick(Duration::from_secs(1));
    n.send(c, msg("old", "1", "again"));
    n.send(c, msg("waiting", "2", "again"));
    n.commit(&mut MemStore::new());
    n.accept(4);
    assert_eq!(
        ops(&n.take(c)),
        [
            "ack seen duplicate",
            "ack old running",
            "ack waiting duplicate"
        ]
    );
    assert_eq!(
        n.order,
        [3, 4],
        "the waiting message requeued, then only the expired id"
    );
}

#[test]
fn a_recovered_message_the_runtime_refuses_still_gets_a_terminal_event() {
    let mut n = Net::new(durable());
    n.b.recover(crashed_journal(), 1_000_000_000, Duration::ZERO);
    n.pump();
    n.journal.clear();
    n.event(14, EventKind::Rejected(RejectReason::QueueFull));
    assert_eq!(kinds(&n.journal), ["outcome 14"]);
    let mut store = MemStore::new();
    n.commit(&mut store);
    let c = n.connect();
    n.hello(c, "tg");
    let out = n.take(c);
    let e = out.iter().find(|v| v["id"] == "e").unwrap();
    assert_eq!(e["op"], "failed");
    assert!(e["error"].as_str().unwrap().contains("queue_full"));
}

#[test]
fn a_journaled_id_expires_at_the_wall_clock_time_its_window_ends() {
    let mut n = Net::new(durable());
    let window = n.b.config().dedup_window;
    // Time zero of the bridge's clock is 1,000,000 ms after the epoch; the message arrives
    // 5 s later, so its id is remembered until 1,005,000 ms plus the window.
    n.b.set_wall_clock(1_000_000);
    n.tick(Duration::from_secs(5));
    let c = n.connect();
    n.hello(c, "tg");
    n.send(c, msg("1", "42", "hi"));
    let until: Vec<u64> = n
        .journal
        .iter()
        .filter_map(|r| match r {
            Record::Accepted(m) => Some(m.dedup_until_ms),
            _ => None,
        })
        .collect();
    assert_eq!(until, [1_005_000 + window.as_millis() as u64]);
}

/// Reload (issue 11): a new token admits new hellos and refuses the old one; removing the
/// token, or adding one where there was none, is refused (it needs a restart) and changes
/// nothing.
#[test]
fn a_reloaded_token_applies_to_new_hellos_and_a_change_needing_a_restart_is_refused() {
    let mut n = Net::new(tokened());
    let before = n.connect();
    n.send(
        before,
        json!({"op": "hello", "platform": "tg", "token": "s3cret"}),
    );
    assert!(n.b.set_auth_token(Some("n3w")));
    assert!(
        !n.b.set_auth_token(None),
        "removing the token needs a restart"
    );
    let old = n.connect();
    n.send(
        old,
        json!({"op": "hello", "platform": "tg", "token": "s3cret"}),
    );
    assert_eq!(n.take(old)[0]["op"], "error");
    assert_eq!(n.b.status().rejected["unauthorized"], 1);
    let new = n.connect();
    n.send(
        new,
        json!({"op": "hello", "platform": "tg", "token": "n3w"}),
    );
    n.send(new, msg("1", "42", "x"));
    assert_eq!(n.order.len(), 1, "the new token admits");
    // Authenticated before the reload: stays so.
    n.send(before, msg("2", "43", "y"));
    assert_eq!(n.order.len(), 2);

    let mut open = Net::new(cfg());
    assert!(open.b.set_auth_token(None), "no token before, none after");
    assert!(
        !open.b.set_auth_token(Some("x")),
        "adding a token needs a restart"
    );
    let c = open.connect();
    open.hello(c, "tg");
    open.send(c, msg("1", "42", "x"));
    assert_eq!(
        open.order.len(),
        1,
        "still open: the refused token was not applied"
    );
}

/// Shutdown's flush waits for outcomes whose records are not durable yet: the bridge counts
/// them until their record is written.
#[test]
fn outcomes_waiting_for_their_record_are_counted_until_it_is_durable() {
    let mut store = MemStore::new();
    let mut n = Net::new(durable());
    let c = n.connect();
    n.hello(c, "tg");
    n.send(c, msg("1", "42", "hi"));
    n.commit(&mut store);
    n.accept(1);
    assert_eq!(n.b.backlog().unjournaled, 0);
    n.reply(1, "hello");
    assert_eq!(n.b.backlog().unjournaled, 1);
    n.send(c, msg("2", "43", "hi"));
    n.commit(&mut store);
    n.accept(2);
    n.reply(2, "again");
    assert_eq!(
        n.b.backlog().unjournaled,
        1,
        "the first was written with the second's batch"
    );
    n.commit(&mut store);
    assert_eq!(n.b.backlog().unjournaled, 0);
}

/// A second hello on the same connection: repeating `acks` keeps what awaits confirmation;
/// switching acks off counts it as delivered, as it would have been without acks.
#[test]
fn a_repeated_hello_keeps_unconfirmed_results_and_switching_acks_off_delivers_them() {
    let mut store = MemStore::new();
    let mut n = Net::new(durable());
    let c = n.connect();
    n.send(c, json!({"op": "hello", "platform": "tg", "acks": true}));
    n.send(c, msg("1", "42", "hi"));
    n.commit(&mut store);
    n.accept(1);
    n.reply(1, "hello");
    n.commit(&mut store);
    assert_eq!(ops(&n.take(c)), ["ack 1 running", "reply 1 hello"]);
    n.send(c, json!({"op": "hello", "platform": "tg", "acks": true}));
    assert_eq!(
        n.b.status().awaiting_delivery,
        1,
        "still waits for `delivered`"
    );
    assert!(n.journal.is_empty());
    n.send(c, json!({"op": "hello", "platform": "tg"}));
    assert_eq!(n.b.status().awaiting_delivery, 0);
    assert_eq!(kinds(&n.journal), ["delivered 1"]);
}

/// The journal's figures in the status count every batch and every failed one.
#[test]
fn the_status_counts_journal_batches_and_failed_ones() {
    let mut store = MemStore::new();
    let mut n = Net::new(durable());
    let c = n.connect();
    n.hello(c, "tg");
    n.send(c, msg("1", "42", "a"));
    n.commit(&mut store);
    n.send(c, msg("2", "43", "b"));
    n.commit(&mut store);
    n.send(c, msg("3", "44", "c"));
    n.fail_journal();
    let j = n.b.status().journal.unwrap();
    assert_eq!((j.batches, j.failed_batches, j.failing), (3, 1, true));
    n.commit(&mut store);
    let j = n.b.status().journal.unwrap();
    assert_eq!((j.batches, j.failed_batches, j.failing), (4, 1, false));
}

/// `delivered` confirms exactly the ids it names, whatever order the results wait in.
#[test]
fn delivered_confirms_only_the_ids_it_names() {
    let mut store = MemStore::new();
    let mut n = Net::new(durable());
    let c = n.connect();
    n.send(c, json!({"op": "hello", "platform": "tg", "acks": true}));
    for i in 1..=2 {
        n.send(c, msg(&i.to_string(), &i.to_string(), "x"));
        n.commit(&mut store);
        n.accept(i);
        n.reply(i, "r");
        n.commit(&mut store);
    }
    assert_eq!(
        ops(&n.take(c)),
        ["ack 1 running", "reply 1 r", "ack 2 running", "reply 2 r"]
    );
    n.send(c, json!({"op": "delivered", "ids": ["2"]}));
    assert_eq!(kinds(&n.journal), ["delivered 2"]);
    assert_eq!(n.b.status().awaiting_delivery, 1);
}

/// Issue 17 §4: with a journal, a message a graceful shutdown cut off (`cancelled:
/// shutdown`, queued or running) is not answered and gets no outcome record — it stays in
/// the journal for the next start (queued again, or interrupted if its turn started) — and
/// its outbox reservation is released. Without a journal it is answered as before.
#[test]
fn a_shutdown_cancel_stays_in_the_journal_and_is_not_answered() {
    let shutdown = EventKind::Finished(Outcome::Cancelled(CancelReason::Shutdown));
    let mut store = MemStore::new();
    let mut n = Net::new(durable());
    let c = n.connect();
    n.hello(c, "tg");
    n.send(c, msg("1", "42", "running"));
    n.send(c, msg("2", "42", "queued"));
    n.commit(&mut store);
    n.accept(1);
    n.event(1, EventKind::TurnStarted(TurnId(1)));
    n.accept(2);
    assert_eq!(
        ops(&n.take(c)),
        ["ack 1 running", "ack 2 running", "typing"]
    );
    n.event(1, EventKind::TurnEnded(TurnId(1)));
    n.event(1, shutdown.clone());
    n.event(2, shutdown.clone());
    let out = ops(&n.take(c));
    assert!(
        out.iter().all(|o| o == "typing"),
        "answered at shutdown: {out:?}"
    );
    assert_eq!(
        kinds(&n.journal),
        ["started 1 1"],
        "an outcome was recorded"
    );
    n.commit(&mut store);
    // Still owed (by the next process): the reservations stay.
    assert_eq!(n.b.status().outboxes["tg"].reserved_events, 2);
    let left = store.load(0).unwrap();
    let kept: Vec<(&str, u32, bool)> = left
        .messages
        .iter()
        .map(|m| (m.message.id(), m.starts, m.outcome.is_some()))
        .collect();
    assert_eq!(kept, [("1", 1, false), ("2", 0, false)]);

    // No journal: nothing would survive the process, so the cancel is answered.
    let mut n = Net::new(cfg());
    let c = n.connect();
    n.hello(c, "tg");
    n.send(c, msg("1", "42", "queued"));
    let tag = n.last_tag();
    n.accept(tag);
    n.event(tag, shutdown);
    assert_eq!(ops(&n.take(c)), ["ack 1 running", "cancelled 1 shutdown"]);
}

// ---------------------------------------------------------------------------------------
// Issue 36: attachments name files in the spool only, and leave it with their route.

/// A message may name only regular files inside the gateway's spool (a hostile bridge must
/// not make an agent read `/etc/passwd`), at most `max_files` of them; an admitted message
/// reaches the runtime with its files, which are handed to the janitor once its route
/// ended, never while it runs, and never for a refused message (its bridge may send it
/// again).
#[test]
fn attachments_come_from_the_spool_only_and_leave_it_when_their_route_ends() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let spool = tmp.path().canonicalize().expect("canonical");
    std::fs::write(spool.join("a.txt"), b"hello").expect("write");
    let inside = spool.join("a.txt").to_string_lossy().into_owned();
    let mut config = cfg();
    config.attachments.dir = Some(spool.clone());
    config.attachments.max_files = 2;
    // Limits the status reports as they are set (not the defaults).
    config.attachments.spool_bytes = 1 << 20;
    config.attachments.max_file_bytes = 4096;
    let mut net = Net::new(config);
    let c = net.connect();
    net.hello(c, "tg");
    let entry = |path: &str| {
        json!({"name": "a.txt", "mime": "text/plain", "size": 5,
               "sha256": "ab".repeat(32), "path": path})
    };
    let with = |id: &str, files: Vec<Value>| json!({"op": "message", "id": id, "chat_id": "1", "text": "see", "attachments": files});
    let elsewhere = tempfile::tempdir().expect("tempdir");
    let outside = elsewhere.path().join("secret.txt");
    std::fs::write(&outside, b"not for the agent").expect("secret");
    net.send(c, with("m1", vec![entry(&outside.to_string_lossy())]));
    net.send(c, with("m2", vec![entry(&inside); 3]));
    let lines = net.take(c);
    assert_eq!(ops(&lines), ["reject m1 invalid", "reject m2 invalid"]);
    let detail = lines[0]["detail"].as_str().expect("detail");
    assert!(
        detail.contains("not inside the gateway's attachments directory"),
        "{detail}"
    );
    assert_eq!(
        lines[1]["detail"],
        "attachments: more than --max-attachments 2"
    );
    assert!(net.order.is_empty(), "nothing refused was submitted");
    assert!(
        net.released_files.is_empty(),
        "a refused message's files stay"
    );

    net.send(c, with("m3", vec![entry(&inside)]));
    let tag = net.last_tag();
    let files = net.sub[&tag].context.attachments();
    assert_eq!(files.len(), 1);
    assert_eq!(files[0].path.as_deref(), Some(inside.as_str()));
    net.accept(tag);
    assert!(net.released_files.is_empty(), "kept while the turn runs");
    net.reply(tag, "seen");
    assert_eq!(net.released_files, [inside]);
    assert_eq!(ops(&net.take(c)), ["ack m3 running", "reply m3 seen"]);
    let status = net.b.status().attachments.expect("spool in the status");
    assert_eq!(
        (
            status.max_files,
            status.spool_bytes,
            status.max_file_bytes,
            status.dir
        ),
        (2, 1 << 20, 4096, spool.display().to_string())
    );
}
