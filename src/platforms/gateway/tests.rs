use super::*;
use crate::message::ChatType;
use serde_json::{Value, json};
use std::io::{BufRead, BufReader};
use std::net::{TcpListener, TcpStream};

const WAIT: Duration = Duration::from_secs(20);

/// A scripted fake gateway: accepts connections one at a time.
struct FakeGateway {
    listener: TcpListener,
}

struct Peer {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl FakeGateway {
    fn new() -> FakeGateway {
        FakeGateway {
            listener: TcpListener::bind("127.0.0.1:0").expect("bind"),
        }
    }
    fn addr(&self) -> String {
        self.listener.local_addr().expect("addr").to_string()
    }
    fn accept(&self) -> Peer {
        let (s, _) = self.listener.accept().expect("accept");
        s.set_read_timeout(Some(WAIT)).expect("timeout");
        Peer {
            reader: BufReader::new(s.try_clone().expect("clone")),
            writer: s,
        }
    }
}

impl Peer {
    fn recv(&mut self) -> Value {
        let mut line = String::new();
        let n = self.reader.read_line(&mut line).expect("a line in time");
        assert!(n > 0, "client closed");
        serde_json::from_str(&line).expect("json")
    }
    fn send(&mut self, v: Value) {
        writeln!(self.writer, "{v}").expect("write");
    }
    /// From now on the peer's lines arrive on a channel (read on a thread of their own),
    /// to wait for a line and a gateway event at once; it closes with the connection.
    fn lines(&mut self) -> Receiver<Value> {
        let (tx, rx) = crossbeam_channel::unbounded();
        // The reader moves to the thread with whatever it has buffered.
        let fresh = BufReader::new(self.writer.try_clone().expect("clone"));
        let mut reader = std::mem::replace(&mut self.reader, fresh);
        std::thread::spawn(move || {
            let mut line = String::new();
            while reader.read_line(&mut line).is_ok_and(|n| n > 0) {
                let v = serde_json::from_str(&line).expect("json");
                line.clear();
                if tx.send(v).is_err() {
                    return;
                }
            }
        });
        rx
    }
    /// Reads the hello and the ping, answers the ping.
    fn handshake(&mut self) -> Value {
        let hello = self.recv();
        assert_eq!(self.recv()["op"], "ping");
        self.send(json!({"op": "pong"}));
        hello
    }
}

fn next(rx: &Receiver<GatewayEvent>) -> GatewayEvent {
    rx.recv_timeout(WAIT).expect("an event in time")
}

fn config(addr: &str) -> GatewayConfig {
    let mut c = GatewayConfig::new(addr, "irc", Some("s3cret".into()));
    c.initial_backoff = Duration::from_millis(5);
    c.max_backoff = Duration::from_millis(20);
    c
}

#[test]
fn hello_carries_acks_and_token_and_messages_carry_every_field() {
    let fake = FakeGateway::new();
    let (gw, rx) = Gateway::connect(config(&fake.addr()));
    let mut peer = fake.accept();
    let hello = peer.handshake();
    assert_eq!(
        hello,
        json!({"op":"hello","platform":"irc","token":"s3cret","acks":true})
    );
    assert_eq!(next(&rx), GatewayEvent::Connected);
    let mut m = OutgoingMessage::new("m1", "#chan", "hi");
    m.chat_type = ChatType::Group;
    m.user_id = Some("ann".into());
    m.user_name = Some("Ann".into());
    m.meta = Some(json!({"reply_to": "x"}).to_string());
    gw.send(&m).expect("send");
    let line = peer.recv();
    assert_eq!(line["op"], "message");
    assert_eq!(line["platform"], "irc");
    assert_eq!(line["chat_type"], "group");
    assert_eq!(line["user_id"], "ann");
    assert_eq!(line["user_name"], "Ann");
    assert_eq!(line["meta"]["reply_to"], "x");
    assert_eq!(line["text"], "hi");
    assert_eq!(gw.pending(), 1);
    peer.send(json!({"op":"ack","id":"m1","session":"irc:group:#chan:user:ann","state":"running","position":0}));
    assert_eq!(
        next(&rx),
        GatewayEvent::Admission {
            id: "m1".into(),
            admission: Admission::Accepted {
                session: "irc:group:#chan:user:ann".into(),
                queued: false,
                position: 0
            }
        }
    );
    assert_eq!(gw.pending(), 0);
    gw.shutdown();
}

#[test]
fn unanswered_messages_are_sent_again_after_a_reconnect_and_results_shown_once() {
    let fake = FakeGateway::new();
    let (gw, rx) = Gateway::connect(config(&fake.addr()));
    let mut first = fake.accept();
    first.handshake();
    assert_eq!(next(&rx), GatewayEvent::Connected);
    gw.send(&OutgoingMessage::new("a", "1", "one"))
        .expect("send");
    gw.send(&OutgoingMessage::new("b", "1", "two"))
        .expect("send");
    assert_eq!(first.recv()["id"], "a");
    assert_eq!(first.recv()["id"], "b");
    // `a` is answered and its result shown; `b` never gets an answer on this connection.
    first.send(json!({"op":"ack","id":"a","session":"irc:dm:1","state":"running"}));
    first.send(json!({"op":"reply","id":"a","session":"irc:dm:1","text":"done"}));
    assert!(matches!(next(&rx), GatewayEvent::Admission { .. }));
    let GatewayEvent::Result(result) = next(&rx) else {
        panic!("a result")
    };
    assert_eq!(result.outcome.chat_text().as_deref(), Some("done"));
    gw.delivered("a");
    assert_eq!(first.recv(), json!({"op":"delivered","ids":["a"]}));
    drop(first);
    assert!(matches!(next(&rx), GatewayEvent::Disconnected { .. }));

    let mut second = fake.accept();
    second.recv(); // hello
    assert_eq!(second.recv()["op"], "ping");
    // Only the unanswered message is sent again.
    let again = second.recv();
    assert_eq!(
        (again["op"].as_str(), again["id"].as_str()),
        (Some("message"), Some("b"))
    );
    second.send(json!({"op":"pong"}));
    assert_eq!(next(&rx), GatewayEvent::Connected);
    // The redelivered result of `a` is confirmed but not shown again; `b`'s is shown.
    second
        .send(json!({"op":"reply","id":"a","session":"irc:dm:1","text":"done","redelivery":true}));
    second
        .send(json!({"op":"reply","id":"b","session":"irc:dm:1","text":"two!","redelivery":true}));
    assert_eq!(second.recv(), json!({"op":"delivered","ids":["a"]}));
    let GatewayEvent::Result(result) = next(&rx) else {
        panic!("b's result")
    };
    assert_eq!((result.id.as_str(), result.redelivery), ("b", true));
    gw.shutdown();
}

#[test]
fn send_and_wait_returns_the_answer_and_pending_is_bounded() {
    let fake = FakeGateway::new();
    let mut c = config(&fake.addr());
    c.max_pending = 2;
    let (gw, rx) = Gateway::connect(c);
    let mut peer = fake.accept();
    peer.handshake();
    assert_eq!(next(&rx), GatewayEvent::Connected);
    let waiter = {
        let gw = gw.clone();
        std::thread::spawn(move || gw.send_and_wait(&OutgoingMessage::new("w", "1", "x"), WAIT))
    };
    assert_eq!(peer.recv()["id"], "w");
    gw.send(&OutgoingMessage::new("v", "1", "y"))
        .expect("second fits");
    assert_eq!(
        gw.send(&OutgoingMessage::new("u", "1", "z")),
        Err(SendError::TooManyPending(2))
    );
    peer.send(
        json!({"op":"reject","id":"w","session":"irc:dm:1","reason":"queue_full","detail":"full"}),
    );
    let answer = waiter.join().expect("thread").expect("answered");
    assert!(matches!(answer, Admission::Rejected { reason, .. } if reason == "queue_full"));
    gw.shutdown();
}

#[test]
fn recent_ids_are_bounded_oldest_first() {
    let mut ids = RecentIds::new(2);
    assert!(ids.insert("a"));
    assert!(!ids.insert("a"));
    ids.insert("b");
    ids.insert("c");
    assert_eq!(ids.len(), 2);
    assert!(!ids.contains("a"));
    assert!(ids.contains("b") && ids.contains("c"));
}

#[test]
fn the_token_never_shows_in_debug_output() {
    let c = GatewayConfig::new("h:1", "irc", Some("s3cret".into()));
    assert!(!format!("{c:?}").contains("s3cret"));
}

/// Issue 30 row 3: an `error` line (no id) answers the oldest message in flight — it ends
/// there, refused, with its waiter told — and a message longer than the gateway's line
/// limit is refused at once, never sent. Before, both stayed pending for ever.
#[test]
fn an_error_line_ends_the_oldest_message_in_flight_and_long_ones_are_refused() {
    let fake = FakeGateway::new();
    let mut c = config(&fake.addr());
    c.max_line_bytes = 400;
    let (gw, rx) = Gateway::connect(c);
    let mut peer = fake.accept();
    peer.handshake();
    assert_eq!(next(&rx), GatewayEvent::Connected);
    let long = OutgoingMessage::new("long", "1", &"x".repeat(400));
    assert!(matches!(
        gw.send(&long),
        Err(SendError::TooLong { limit: 400, .. })
    ));
    assert_eq!(gw.pending(), 0);
    let waiter = {
        let gw = gw.clone();
        std::thread::spawn(move || gw.send_and_wait(&OutgoingMessage::new("a", "1", "x"), WAIT))
    };
    assert_eq!(peer.recv()["id"], "a");
    gw.send(&OutgoingMessage::new("b", "1", "y")).expect("send");
    assert_eq!(peer.recv()["id"], "b");
    peer.send(json!({"op":"error","detail":"line longer than 300 bytes; discarded"}));
    let answer = waiter.join().expect("thread").expect("answered");
    assert!(
        matches!(&answer, Admission::Rejected { reason, detail, .. }
            if reason == "invalid" && detail.contains("longer than 300")),
        "{answer:?}"
    );
    assert!(matches!(
        next(&rx),
        GatewayEvent::Admission { id, admission: Admission::Rejected { .. } } if id == "a"
    ));
    assert_eq!(gw.pending(), 1, "b still waits for its own answer");
    peer.send(json!({"op":"ack","id":"b","session":"irc:dm:1","state":"running"}));
    assert!(matches!(next(&rx), GatewayEvent::Admission { id, .. } if id == "b"));
    // With nothing in flight an error is only reported.
    peer.send(json!({"op":"error","detail":"unknown op"}));
    assert!(matches!(next(&rx), GatewayEvent::Error { .. }));
    gw.shutdown();
}

/// Issue 30 row 5: a retryable refusal (`shutting_down`) is not the message's end: the
/// client holds it, sends it again with the same id, and the bridge only ever hears the
/// acceptance. A refusal that does not pass (`queue_full`) is final at once. Before, the
/// first refusal was final.
#[test]
fn a_retryable_refusal_is_held_and_sent_again_with_the_same_id() {
    let fake = FakeGateway::new();
    let (gw, rx) = Gateway::connect(config(&fake.addr()));
    let mut peer = fake.accept();
    peer.handshake();
    assert_eq!(next(&rx), GatewayEvent::Connected);
    gw.send(&OutgoingMessage::new("m", "1", "hi"))
        .expect("send");
    assert_eq!(peer.recv()["id"], "m");
    peer.send(json!({"op":"reject","id":"m","session":"irc:dm:1","reason":"shutting_down","detail":"draining"}));
    let again = peer.recv();
    assert_eq!(
        (again["op"].as_str(), again["id"].as_str()),
        (Some("message"), Some("m"))
    );
    peer.send(json!({"op":"ack","id":"m","session":"irc:dm:1","state":"running"}));
    assert!(matches!(
        next(&rx),
        GatewayEvent::Admission { id, admission: Admission::Accepted { .. } } if id == "m"
    ));
    gw.send(&OutgoingMessage::new("q", "1", "hi"))
        .expect("send");
    assert_eq!(peer.recv()["id"], "q");
    peer.send(
        json!({"op":"reject","id":"q","session":"irc:dm:1","reason":"queue_full","detail":"full"}),
    );
    assert!(matches!(
        next(&rx),
        GatewayEvent::Admission { admission: Admission::Rejected { reason, .. }, .. } if reason == "queue_full"
    ));
    gw.shutdown();
}

/// Row 5's bounds: past `max_hold` a held message is given up — its bridge told once, with
/// the last reason — and past `max_held` a retryable refusal is final at once.
#[test]
fn held_messages_are_given_up_after_max_hold_and_bounded_by_max_held() {
    let fake = FakeGateway::new();
    let mut c = config(&fake.addr());
    c.max_hold = Duration::from_millis(1500);
    c.max_held = 1;
    let (gw, rx) = Gateway::connect(c);
    let mut peer = fake.accept();
    peer.handshake();
    assert_eq!(next(&rx), GatewayEvent::Connected);
    gw.send(&OutgoingMessage::new("a", "1", "x")).expect("send");
    gw.send(&OutgoingMessage::new("b", "1", "y")).expect("send");
    assert_eq!(peer.recv()["id"], "a");
    assert_eq!(peer.recv()["id"], "b");
    let overloaded = |id: &str| json!({"op":"reject","id":id,"session":"irc:dm:1","reason":"overloaded","detail":"busy"});
    peer.send(overloaded("a"));
    peer.send(overloaded("b"));
    // `b` finds the one place taken: final at once.
    let GatewayEvent::Admission { id, admission } = next(&rx) else {
        panic!("an admission")
    };
    assert_eq!(id, "b");
    assert!(
        matches!(&admission, Admission::Rejected { detail, .. } if detail.contains("not held"))
    );
    // `a` is sent again (and refused again) until its time is up, then given up once: each
    // refusal is answered either by a resend on the wire or by the give-up event, so wait
    // for whichever comes (a short wait for the event raced a loaded machine's client).
    let lines = peer.lines();
    loop {
        crossbeam_channel::select! {
            recv(lines) -> line => {
                let line = line.expect("a resend or the give-up before the connection closed");
                assert_eq!(line["id"], "a", "{line}");
                peer.send(overloaded("a"));
            }
            recv(rx) -> event => {
                let event = event.expect("the gateway's events");
                let GatewayEvent::Admission { id, admission } = event else {
                    panic!("{event:?}")
                };
                assert_eq!(id, "a");
                assert!(
                    matches!(&admission, Admission::Rejected { reason, detail, .. }
                        if reason == "overloaded" && detail.contains("given up")),
                    "{admission:?}"
                );
                break;
            }
            default(WAIT) => panic!("neither a resend of `a` nor its give-up in time"),
        }
    }
    assert_eq!(gw.pending(), 0);
    gw.shutdown();
}

/// Issue 36 row 3: a bridge that cannot upload (IRC, Discord, Slack) shows one line per
/// file the reply carries; one that uploads takes the text without them.
#[test]
fn a_replys_files_are_one_omission_line_each_where_they_are_not_uploaded() {
    let file = |name: &str, size: u64| crate::Attachment {
        name: name.into(),
        mime: String::new(),
        size,
        sha256: None,
        path: Some(format!("/spool/{name}")),
        skipped: None,
    };
    let outcome = TerminalOutcome::Reply {
        text: "the plot".into(),
        truncated: false,
        files: vec![file("plot.png", 123_456), file("data.csv", 12)],
    };
    assert_eq!(
        outcome.chat_text().as_deref(),
        Some("the plot\n(file omitted: plot.png, 120.6 KiB)\n(file omitted: data.csv, 12 B)")
    );
    assert_eq!(outcome.text_without_files().as_deref(), Some("the plot"));
    assert_eq!(outcome.files().len(), 2);
    let only_files = TerminalOutcome::Reply {
        text: String::new(),
        truncated: false,
        files: vec![file("a.txt", 1)],
    };
    assert_eq!(
        only_files.chat_text().as_deref(),
        Some("(file omitted: a.txt, 1 B)")
    );
}
