//! Embedding turnstile in a tokio program with the `async` feature: no glue threads between
//! the two. The agent is an `AsyncAgent`: its turns are futures turnstile hands to the
//! program's tokio runtime (through the spawner given to `Builder::new_async`), so no
//! turnstile thread waits while it types. Four conversations run at once, each a task that
//! awaits its own message's event stream (partial replies included); one of them is stopped
//! mid-turn with `/stop`, which the agent notices through `CancelToken::cancelled()`. The
//! status shows the turns in flight as async tasks while the turn pool has no busy thread.
//!
//! Run with `cargo run --example async_tokio --features async`.

use std::time::Duration;

use tokio::task::JoinSet;
use turnstile::{
    AgentError, AgentFuture, AsyncAgent, Builder, CancelToken, EventKind, Handle, Message, Outcome,
    SessionKey, Task, TurnError, TurnInput,
};

/// Types its reply a word at a time, publishing each partial; gives up as soon as the turn
/// is cancelled. Runs on the program's tokio runtime, not on a turnstile thread.
struct Typist {
    per_word: Duration,
}

impl AsyncAgent for Typist {
    fn turn<'a>(
        &'a mut self,
        input: &'a TurnInput<'a>,
        cancel: &'a CancelToken,
    ) -> AgentFuture<'a, Result<String, TurnError>> {
        Box::pin(async move {
            let mut typed = String::new();
            for word in input.text.split_whitespace() {
                tokio::select! {
                    _ = cancel.cancelled() => return Err(TurnError::Cancelled),
                    _ = tokio::time::sleep(self.per_word) => {}
                }
                if !typed.is_empty() {
                    typed.push(' ');
                }
                typed.push_str(word);
                input.partials.publish(&typed);
            }
            Ok(typed)
        })
    }

    /// Runs as a task too, under the cleanup deadline (an SDK client would disconnect here).
    fn close(&mut self) -> AgentFuture<'_, Result<(), AgentError>> {
        Box::pin(async { Ok(()) })
    }
}

/// One conversation: submits `text` (waiting for ingress room if need be) and prints its
/// events as they stream in; returns the outcome.
async fn converse(handle: Handle, id: &str, chat: &str, text: &str) -> Result<Outcome, String> {
    let session = SessionKey::dm("example", chat).map_err(|e| e.to_string())?;
    let message = Message::new(id, session, text).map_err(|e| e.to_string())?;
    let mut events = handle
        .submit_stream_async(message)
        .await
        .map_err(|e| e.to_string())?;
    while let Some(event) = events.recv().await {
        match event.kind {
            EventKind::Partial(so_far) => println!("{chat:>6} {id}: … {so_far}"),
            EventKind::Finished(outcome) => {
                println!("{chat:>6} {id}: {outcome:?}");
                return Ok(outcome);
            }
            other => println!("{chat:>6} {id}: {other:?}"),
        }
    }
    Err(format!("{id}: the runtime stopped before answering"))
}

/// Waits for `chat`'s turn to start, then stops it.
async fn stop_when_started(handle: Handle, chat: &str) -> Result<Outcome, String> {
    let session = SessionKey::dm("example", chat).map_err(|e| e.to_string())?;
    let message = Message::new("long", session.clone(), "a b c d e f g h i j k l m n o p")
        .map_err(|e| e.to_string())?;
    let mut events = handle
        .submit_stream_async(message)
        .await
        .map_err(|e| e.to_string())?;
    let mut outcome = None;
    while let Some(event) = events.recv().await {
        match event.kind {
            EventKind::TurnStarted(_) => {
                println!("{chat:>6} long: started; sending /stop");
                let stop =
                    Message::new("stop", session.clone(), "/stop").map_err(|e| e.to_string())?;
                handle.submit_async(stop).await.map_err(|e| e.to_string())?;
            }
            EventKind::Finished(o) => {
                println!("{chat:>6} long: {o:?}");
                outcome = Some(o);
            }
            _ => {}
        }
    }
    outcome.ok_or_else(|| "long: no outcome".to_owned())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let tokio = tokio::runtime::Handle::current();
    let (runtime, handle, _events) = Builder::new_async(
        |_: &SessionKey| -> Result<Box<dyn AsyncAgent>, AgentError> {
            Ok(Box::new(Typist {
                per_word: Duration::from_millis(30),
            }))
        },
        // Called on turnstile's reactor thread: hand the task over, never run it inline.
        move |task: Task| {
            tokio.spawn(task);
        },
    )
    .turn_workers(4)
    .partial_interval(Duration::ZERO)
    // Tiny on purpose, so the submits below really wait for room.
    .ingress_capacity(1)
    .build()?;
    // The reactor is turnstile's own thread; the tokio side needs nothing else.
    let reactor = runtime.spawn()?;

    let mut chats = JoinSet::new();
    for (id, chat, text) in [
        ("m1", "alice", "hello there"),
        ("m2", "bob", "how are you today"),
        ("m3", "carol", "streaming one word at a time"),
    ] {
        chats.spawn(converse(handle.clone(), id, chat, text));
    }
    chats.spawn(stop_when_started(handle.clone(), "dave"));
    // While the turns type, they are tasks on this runtime: no turnstile thread is busy.
    let status = handle.clone();
    let seen = tokio::task::spawn_blocking(move || {
        status.wait_status(Duration::from_secs(10), |s| s.workers.async_turns > 0)
    })
    .await?;
    if let Some(s) = seen {
        println!(
            "status: {} async turns in flight, {} busy turn-pool threads",
            s.workers.async_turns, s.workers.turn_threads.busy
        );
    }
    while let Some(done) = chats.join_next().await {
        match done? {
            Ok(Outcome::Reply(_) | Outcome::Cancelled(_)) => {}
            Ok(other) => return Err(format!("unexpected outcome {other:?}").into()),
            Err(e) => return Err(e.into()),
        }
    }

    handle.shutdown();
    let report = tokio::task::spawn_blocking(move || reactor.join()).await??;
    println!("shutdown clean: {}", report.clean);
    Ok(())
}
