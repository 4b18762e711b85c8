//! The `turnstile` binary. Until the gateway server lands, it runs one interactive session on
//! stdin: each line is a message (commands `/stop`, `/new`, `/reset`, `/status` work), each
//! outcome is printed. End of input shuts the runtime down gracefully.

use std::io::BufRead;
use std::time::Duration;

use turnstile::{Builder, EchoAgent, EventKind, Message, SessionKey};

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    if let Err(e) = run() {
        eprintln!("turnstile: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::args().nth(1).is_some() {
        println!("usage: turnstile   (reads messages from stdin, one per line; echo agent)");
        return Ok(());
    }
    let (runtime, handle, events) = Builder::new(EchoAgent::factory(Duration::ZERO)).build()?;
    let reactor = runtime.spawn()?;
    let session = SessionKey::dm("cli", "local")?;
    for (n, line) in std::io::stdin().lock().lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let id = format!("line-{}", n + 1);
        handle.submit(Message::new(&id, session.clone(), &line)?)?;
        // One line at a time: wait for this line's outcome before reading the next.
        loop {
            let e = events.recv()?;
            if let EventKind::Finished(outcome) = e.kind
                && *e.id == *id
            {
                println!("{outcome:?}");
                break;
            }
        }
    }
    handle.shutdown();
    let report = reactor.join().map_err(|_| "reactor thread panicked")??;
    eprintln!("shutdown: clean={}", report.clean);
    Ok(())
}
