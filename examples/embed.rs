//! Embedding turnstile: build a runtime with the echo agent, send a few messages to two
//! sessions, print every event, shut down.
//!
//! Run with `cargo run --example embed`.

use std::time::Duration;

use turnstile::{Builder, EchoAgent, EventKind, Message, SessionKey};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (runtime, handle, events) = Builder::new(EchoAgent::factory(Duration::from_millis(20)))
        .turn_workers(4)
        .build()?;
    let reactor = runtime.spawn()?;

    let alice = SessionKey::dm("telegram", "42")?;
    let bob = SessionKey::dm("discord", "7")?;
    handle.submit(Message::new("m1", alice.clone(), "hello")?)?;
    handle.submit(Message::new("m2", alice.clone(), "are you there?")?)?; // waits for m1
    handle.submit(Message::new("m3", bob, "hi from bob")?)?; // runs alongside m1
    handle.submit(Message::new("m4", alice, "/status")?)?; // a command: answered at once

    let mut finished = 0;
    while finished < 4 {
        let event = events.recv_timeout(Duration::from_secs(10))?;
        println!("{} {} {:?}", event.session, event.id, event.kind);
        if matches!(event.kind, EventKind::Finished(_)) {
            finished += 1;
        }
    }
    handle.shutdown();
    let report = reactor.join()?;
    println!("shutdown clean: {}", report.clean);
    Ok(())
}
