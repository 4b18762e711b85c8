//! `turnstile send`: one message to a running gateway, its reply on stdout.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Args;
use serde_json::{Value, json};

use super::USAGE_ERROR;
use super::units::Seconds;

/// Flags of `send`.
#[derive(Args, Debug)]
pub(crate) struct SendArgs {
    /// Gateway address.
    #[arg(long, default_value = "127.0.0.1:7878")]
    addr: String,
    /// Platform of the message.
    #[arg(long, default_value = "cli")]
    platform: String,
    /// Chat id.
    #[arg(long, default_value = "local")]
    chat: String,
    /// Sender's user id.
    #[arg(long)]
    user: Option<String>,
    /// Sender's display name (needs --user).
    #[arg(long)]
    user_name: Option<String>,
    /// Platform metadata: a JSON object passed to the agent.
    #[arg(long)]
    meta: Option<String>,
    /// Auth token, if the gateway requires one.
    #[arg(long, env = "TURNSTILE_AUTH_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// How long to wait for the outcome.
    #[arg(long, default_value = "660s")]
    timeout: Seconds,
    /// Print partial replies as they come (each partial's new text), then the rest of the
    /// reply.
    #[arg(long)]
    stream: bool,
    #[command(flatten)]
    tls: crate::platforms::tls::ClientTlsArgs,
    /// The message text.
    #[arg(required = true, num_args = 1..)]
    text: Vec<String>,
}

/// Sends the message; returns the exit code (0 on a reply, 1 otherwise).
pub(crate) fn run(args: SendArgs) -> i32 {
    if args.timeout.0 <= 0.0 {
        eprintln!("turnstile send: --timeout must be a positive number of seconds");
        return USAGE_ERROR;
    }
    match exchange(&args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("turnstile send: {e}");
            1
        }
    }
}

/// A connection error in words: refused, timed out, unreachable.
fn connect_error(addr: &str, e: &std::io::Error) -> String {
    use std::io::ErrorKind::*;
    match e.kind() {
        ConnectionRefused => {
            format!("connection refused by {addr} (is `turnstile serve` running there?)")
        }
        TimedOut | WouldBlock => format!("timed out connecting to {addr}"),
        HostUnreachable | NetworkUnreachable => format!("{addr} is unreachable"),
        InvalidInput => format!("{addr} is not an address (use HOST:PORT)"),
        _ => format!("cannot connect to {addr}: {e}"),
    }
}

fn exchange(args: &SendArgs) -> Result<i32, Box<dyn std::error::Error>> {
    let tls = args.tls.config()?;
    let stream = TcpStream::connect(&args.addr).map_err(|e| connect_error(&args.addr, &e))?;
    let timeout = Duration::from_secs_f64(args.timeout.0);
    stream.set_read_timeout(Some(timeout))?;
    let mut stream = args.tls.wrap(tls.as_ref(), stream, &args.addr, timeout)?;
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let id = format!("send-{}-{nanos}", std::process::id());
    let meta: Option<Value> = match &args.meta {
        Some(m) => {
            Some(serde_json::from_str(m).map_err(|e| format!("--meta is not a JSON object: {e}"))?)
        }
        None => None,
    };
    let hello = json!({"op": "hello", "platform": args.platform, "token": args.token});
    let message = json!({
        "op": "message", "id": id, "platform": args.platform, "chat_id": args.chat,
        "user_id": args.user, "user_name": args.user_name, "meta": meta,
        "text": args.text.join(" "),
    });
    writeln!(stream, "{hello}\n{message}")
        .and_then(|()| stream.flush())
        .map_err(|e| format!("the gateway at {} closed the connection: {e}", args.addr))?;
    let mut shown = Shown::default();
    for line in BufReader::new(stream).lines() {
        let line = line.map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => format!(
                "timed out after {} s waiting for the outcome (--timeout)",
                args.timeout.0
            ),
            std::io::ErrorKind::InvalidData => {
                format!(
                    "{} is not a turnstile server (it sent non-UTF-8 data)",
                    args.addr
                )
            }
            _ => format!("the connection to the gateway failed: {e}"),
        })?;
        let v: Value = serde_json::from_str(&line).map_err(|_| {
            format!(
                "{} is not a turnstile server (it answered {:?})",
                args.addr,
                line.chars().take(60).collect::<String>()
            )
        })?;
        let op = v["op"].as_str().unwrap_or("");
        if op == "error" {
            let detail = v["detail"].as_str().unwrap_or("?");
            if detail == "unauthorized" {
                eprintln!(
                    "error: unauthorized (the gateway needs its auth token: --token or TURNSTILE_AUTH_TOKEN)"
                );
            } else {
                eprintln!("error: {detail}");
            }
            return Ok(1);
        }
        if v["id"].as_str() != Some(id.as_str()) {
            continue;
        }
        match op {
            "partial" if args.stream => {
                shown.show(v["text"].as_str().unwrap_or(""));
                continue;
            }
            "reply" => {
                let text = v["text"].as_str().unwrap_or("");
                if args.stream {
                    shown.show(text);
                    println!();
                } else {
                    println!("{text}");
                }
                if v["truncated"] == true {
                    eprintln!("(the reply was truncated at --max-reply-bytes)");
                }
                return Ok(0);
            }
            "reject" => eprintln!(
                "rejected: {} ({})",
                v["reason"].as_str().unwrap_or("?"),
                v["detail"].as_str().unwrap_or("")
            ),
            "failed" => eprintln!("failed: {}", v["error"].as_str().unwrap_or("?")),
            "cancelled" => eprintln!("cancelled: {}", v["reason"].as_str().unwrap_or("?")),
            "merged" => eprintln!("merged into {}", v["into"].as_str().unwrap_or("?")),
            _ => continue,
        }
        return Ok(1);
    }
    Err("the gateway closed the connection before the outcome".into())
}

/// What `--stream` has printed of the reply so far: each partial is the reply so far, so
/// only its new part is printed; a partial that does not extend what was printed (the agent
/// rewrote its text) starts a new line.
#[derive(Default)]
struct Shown {
    text: String,
}

impl Shown {
    fn show(&mut self, text: &str) {
        let mut out = std::io::stdout().lock();
        let _ = match text.strip_prefix(self.text.as_str()) {
            Some(new) => write!(out, "{new}"),
            None => write!(out, "\n{text}"),
        };
        let _ = out.flush();
        self.text.clear();
        self.text.push_str(text);
    }
}
