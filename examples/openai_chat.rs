//! A terminal chat with the OpenAI-compatible agent, through the runtime: each stdin line is
//! a message of one session (`/stop`, `/new` and `/status` work as in any chat); partial
//! replies are printed as they stream, then the outcome.
//!
//! ```sh
//! cargo run --example openai_chat -- --base-url http://127.0.0.1:11434/v1 --model llama3.2
//! ```
//!
//! The API key, if any, is read from `OPENAI_API_KEY`.

use std::collections::HashSet;
use std::io::BufRead;
use std::time::Duration;

use crossbeam_channel::{select, unbounded};
use turnstile::{ApiKey, OpenAiConfig, OpenAiFactory};
use turnstile::{Builder, EventKind, Message, Outcome, SessionKey};

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    let i = args.iter().position(|a| a == name)?;
    args.get(i + 1).cloned()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (Some(base), Some(model)) = (arg("--base-url"), arg("--model")) else {
        eprintln!("usage: openai_chat --base-url URL --model NAME [--system TEXT]");
        std::process::exit(2);
    };
    let mut cfg = OpenAiConfig::new(base, model);
    cfg.system_prompt = arg("--system");
    cfg.api_key = ApiKey::from_env("OPENAI_API_KEY")?;
    let (runtime, handle, events) = Builder::new(OpenAiFactory::new(cfg)?)
        .partial_interval(Duration::from_millis(300))
        .build()?;
    let reactor = runtime.spawn()?;
    let session = SessionKey::dm("terminal", "me")?;

    enum Input {
        Sent(String),
        Eof,
    }
    let (tx, rx) = unbounded();
    {
        let handle = handle.clone();
        std::thread::spawn(move || {
            for (n, line) in std::io::stdin()
                .lock()
                .lines()
                .map_while(Result::ok)
                .enumerate()
            {
                let text = line.trim();
                if text.is_empty() {
                    continue;
                }
                let id = format!("m{}", n + 1);
                println!("you [{id}]> {text}");
                let sent = Message::new(&id, session.clone(), text)
                    .ok()
                    .is_some_and(|msg| handle.submit(msg).is_ok());
                if sent {
                    let _ = tx.send(Input::Sent(id));
                } else {
                    eprintln!("could not send {text:?}");
                }
            }
            let _ = tx.send(Input::Eof);
        });
    }
    // A message can finish before its Sent notice arrives: remember those too.
    let (mut pending, mut finished_early) = (HashSet::new(), HashSet::new());
    let mut eof = false;
    while !(eof && pending.is_empty()) {
        select! {
            recv(rx) -> input => match input {
                Ok(Input::Sent(id)) => {
                    if !finished_early.remove(&id) {
                        pending.insert(id);
                    }
                }
                Ok(Input::Eof) | Err(_) => eof = true,
            },
            recv(events) -> event => {
                let Ok(e) = event else { break };
                match e.kind {
                    EventKind::Partial(text) => println!("   … [{}] {text}", e.id),
                    EventKind::Finished(outcome) => {
                        if !pending.remove(&*e.id) {
                            finished_early.insert(e.id.to_string());
                        }
                        match outcome {
                            Outcome::Reply(r) => println!("bot [{}]> {r}", e.id),
                            Outcome::Cancelled(why) => println!("bot [{}]: cancelled ({})", e.id, why.as_str()),
                            Outcome::Failed(why) => println!("bot [{}]: failed: {why}", e.id),
                            Outcome::Merged { into } => println!("bot [{}]: merged into {into}", e.id),
                            other => println!("bot [{}]: {other:?}", e.id),
                        }
                    }
                    _ => {}
                }
            },
        }
    }
    if let Some(usage) = handle.status().agent_usage {
        println!(
            "tokens used: {} prompt, {} completion",
            usage.prompt_tokens, usage.completion_tokens
        );
    }
    handle.shutdown();
    let _ = reactor.join();
    Ok(())
}
