//! The runtime's sync `Events` stream is bounded for an embedder that never reads it: once
//! it holds `events_backlog` unread events, partial replies are skipped (counted in the
//! status and the metrics), while accepted, turn and outcome events are always sent.
//! Real threads: the runtime's reactor and turn pool, agents publishing partials as fast as
//! they can.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use turnstile::{
    Agent, Builder, CancelToken, EventKind, Message, Outcome, SessionKey, TurnError, TurnInput,
};

/// Generous: a loaded 2-core machine.
const WAIT: Duration = Duration::from_secs(120);
const BACKLOG: usize = 16;
const MESSAGES: usize = 6;
/// Partials each turn publishes (the whole reply so far each time).
const PARTIALS: usize = 400;
/// Events of a message other than partials: accepted, turn started, turn ended, outcome.
const OTHER_EVENTS: usize = 4;

/// Publishes the reply growing by one character, [`PARTIALS`] times, counting what the
/// worker's throttle forwarded to the reactor.
struct Streamer(Arc<AtomicU64>);

impl Agent for Streamer {
    fn turn(&mut self, input: &TurnInput<'_>, _: &CancelToken) -> Result<String, TurnError> {
        let mut so_far = String::new();
        for _ in 0..PARTIALS {
            so_far.push('x');
            if input.partials.publish(&so_far) {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(format!("{} {so_far}", input.text))
    }
}

/// An embedder that never reads its `Events` while turns stream partials: the stream holds
/// at most the backlog plus four events per message, every outcome still arrives whole, and
/// `partials_skipped` counts exactly the partials that were not sent.
#[test]
fn an_embedder_that_never_reads_holds_the_backlog_plus_four_events_a_message() {
    let published = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&published);
    let factory = move |_: &SessionKey| -> Result<Box<dyn Agent>, String> {
        Ok(Box::new(Streamer(Arc::clone(&counter))))
    };
    let (runtime, handle, events) = Builder::new(factory)
        .turn_workers(2)
        .partial_interval(Duration::ZERO)
        .events_backlog(BACKLOG)
        .build()
        .expect("valid settings");
    let reactor = runtime.spawn().expect("reactor thread");
    for i in 0..MESSAGES {
        // Two messages a session: the second waits behind the first's turn.
        let chat = SessionKey::dm("t", &(i / 2).to_string()).expect("key");
        let message = Message::new(&format!("m{i}"), chat, &format!("m{i}")).expect("message");
        handle.submit(message).expect("submitted");
    }
    // Nothing is read until every turn is over and its partials are counted.
    let status = handle
        .wait_status(WAIT, |s| {
            s.turns.completed == MESSAGES as u64
                && s.messages.partials_forwarded + s.messages.partials_skipped
                    == published.load(Ordering::Relaxed)
        })
        .expect("every turn done, its partials counted");
    let published = published.load(Ordering::Relaxed);
    assert_eq!(published, (MESSAGES * PARTIALS) as u64, "none throttled");
    let unread = events.len();
    assert!(
        unread <= BACKLOG + OTHER_EVENTS * MESSAGES,
        "the stream holds {unread} unread events, past {BACKLOG} + {OTHER_EVENTS} x {MESSAGES}"
    );
    let skipped = status.messages.partials_skipped;
    assert!(skipped > 0, "{status:?}");
    // Now read everything: each message's events whole, partials only as many as were sent.
    let (mut partials, mut finished, mut others) = (0u64, HashMap::new(), 0usize);
    for event in events.try_iter() {
        match event.kind {
            EventKind::Partial(text) => {
                assert!(text.chars().all(|c| c == 'x'), "{text}");
                partials += 1;
            }
            EventKind::Finished(outcome) => {
                finished.insert(event.id.to_string(), outcome);
                others += 1;
            }
            EventKind::Accepted { .. } | EventKind::TurnStarted(_) | EventKind::TurnEnded(_) => {
                others += 1;
            }
            EventKind::Rejected(reason) => panic!("{} rejected: {reason:?}", event.id),
            _ => {}
        }
    }
    assert_eq!(
        others,
        OTHER_EVENTS * MESSAGES,
        "every non-partial event sent"
    );
    assert!(partials <= BACKLOG as u64, "{partials} partials sent");
    assert_eq!(partials, status.messages.partials_forwarded);
    assert_eq!(
        partials + skipped,
        published,
        "each partial sent or skipped"
    );
    for i in 0..MESSAGES {
        let id = format!("m{i}");
        let whole = format!("{id} {}", "x".repeat(PARTIALS));
        match finished.get(&id) {
            Some(Outcome::Reply(reply)) => assert_eq!(reply.text, whole),
            other => panic!("{id}: {other:?}"),
        }
    }
    handle.shutdown();
    assert!(reactor.join().expect("clean run").clean);
}

/// Floods the stream with partials on "flood"; otherwise publishes [`STEPS`] partials, each
/// once the test says go (so the reader is never behind by more than one).
struct Stepped(crossbeam_channel::Receiver<()>);

/// Partials of a stepped turn.
const STEPS: usize = BACKLOG * 2;

impl Agent for Stepped {
    fn turn(&mut self, input: &TurnInput<'_>, _: &CancelToken) -> Result<String, TurnError> {
        let mut so_far = String::new();
        let flood = input.text == "flood";
        for _ in 0..if flood { PARTIALS } else { STEPS } {
            if !flood && self.0.recv_timeout(WAIT).is_err() {
                return Err(TurnError::Cancelled);
            }
            so_far.push('x');
            input.partials.publish(&so_far);
        }
        Ok(so_far)
    }
}

/// Skipping lasts only while the reader is behind: once it has read the stream, the next
/// turn's partials are all sent again.
#[test]
fn partials_flow_again_once_the_reader_caught_up() {
    let (go, steps) = crossbeam_channel::unbounded();
    let factory = move |_: &SessionKey| -> Result<Box<dyn Agent>, String> {
        Ok(Box::new(Stepped(steps.clone())))
    };
    let (runtime, handle, events) = Builder::new(factory)
        .partial_interval(Duration::ZERO)
        .events_backlog(BACKLOG)
        .build()
        .expect("valid settings");
    let reactor = runtime.spawn().expect("reactor thread");
    let chat = SessionKey::dm("t", "1").expect("key");
    let send = |text: &str| {
        let message = Message::new(text, chat.clone(), text).expect("message");
        handle.submit(message).expect("submitted");
    };
    // Behind: the first turn fills the backlog and the rest of its partials are skipped.
    send("flood");
    let behind = handle
        .wait_status(WAIT, |s| {
            s.turns.completed == 1 && s.messages.partials_skipped > 0
        })
        .expect("the first turn done, partials skipped");
    let skipped = behind.messages.partials_skipped;
    let drained = events.try_iter().count();
    assert!(drained >= BACKLOG, "{drained} events read");
    // Caught up: each partial of the second turn is read before the next is published.
    send("step");
    let mut partials = 0;
    go.send(()).expect("the agent waits");
    loop {
        let event = events.recv_timeout(WAIT).expect("an event");
        match event.kind {
            EventKind::Partial(text) => {
                partials += 1;
                assert_eq!(text.len(), partials);
                let _ = go.send(());
            }
            EventKind::Finished(outcome) => {
                assert!(matches!(outcome, Outcome::Reply(r) if r.text.len() == STEPS));
                break;
            }
            _ => {}
        }
    }
    assert_eq!(
        partials, STEPS,
        "every partial sent once the reader caught up"
    );
    let after = handle
        .wait_status(WAIT, |s| s.turns.completed == 2)
        .expect("done");
    assert_eq!(after.messages.partials_skipped, skipped, "none skipped");
    handle.shutdown();
    assert!(reactor.join().expect("clean run").clean);
}
