//! `turnstile send`: one message to a running gateway, its reply on stdout.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Args;
use serde_json::Value;

use super::USAGE_ERROR;
use super::units::Seconds;
use crate::message::ChatType;
use crate::wire::{ClientOp, MessageFields, ServerLine, ServerOp};

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
    /// A file to send with the message (repeatable). It is copied into the gateway's spool
    /// (--attachments-dir), so `send` runs on the gateway's host.
    #[arg(long = "attach", value_name = "PATH", requires = "attachments_dir")]
    attach: Vec<std::path::PathBuf>,
    /// The gateway's attachments spool (its `--attachments-dir`; it logs the spool at
    /// start-up when it made a temporary one).
    #[arg(long, value_name = "DIR")]
    attachments_dir: Option<std::path::PathBuf>,
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

/// The `--attach` files copied into the spool (streamed, their SHA-256 computed, the
/// default bounds applied): one entry each. A file past a bound is an error, not a skipped
/// entry: the person running `send` is there to be told.
fn copy_attachments(
    args: &SendArgs,
    id: &str,
) -> Result<Vec<crate::Attachment>, Box<dyn std::error::Error>> {
    let Some(dir) = &args.attachments_dir else {
        return Ok(Vec::new());
    };
    let limits = crate::AttachmentLimits {
        dir: Some(
            dir.canonicalize()
                .map_err(|e| format!("--attachments-dir {}: {e}", dir.display()))?,
        ),
        ..crate::AttachmentLimits::default()
    };
    let mut entries = Vec::new();
    for (i, path) in args.attach.iter().enumerate() {
        let shown = path.display();
        let mut file = std::fs::File::open(path).map_err(|e| format!("--attach {shown}: {e}"))?;
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        let offered = crate::platforms::spool::Offered {
            name: crate::platforms::spool::clean_name(name.as_deref().unwrap_or("file")),
            mime: String::new(),
            size: file.metadata().ok().map(|m| m.len()),
        };
        let entry =
            crate::platforms::spool::store(&limits, &offered, &format!("{id}-{i}"), &mut file);
        if let Some(why) = &entry.skipped {
            crate::platforms::spool::discard(&entries);
            return Err(format!("--attach {shown}: {why}").into());
        }
        entries.push(entry);
    }
    Ok(entries)
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
    let hello = ClientOp::Hello {
        platform: Some(args.platform.clone()),
        token: args.token.clone(),
        acks: false,
    };
    let message = ClientOp::Message(MessageFields {
        id: id.clone(),
        platform: Some(args.platform.clone()),
        chat_id: args.chat.clone(),
        chat_type: ChatType::Dm,
        user_id: args.user.clone(),
        user_name: args.user_name.clone(),
        thread_id: None,
        meta: meta.map(|m| m.to_string()),
        text: args.text.join(" "),
        attachments: copy_attachments(args, &id)?,
    });
    writeln!(stream, "{}\n{}", hello.line(), message.line())
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
        let op = match ServerLine::parse(line.as_bytes()) {
            Ok(parsed) => parsed.op,
            // JSON this client cannot read (an op it does not know): not for it.
            Err(_) if serde_json::from_str::<Value>(&line).is_ok() => continue,
            Err(_) => {
                return Err(format!(
                    "{} is not a turnstile server (it answered {:?})",
                    args.addr,
                    line.chars().take(60).collect::<String>()
                )
                .into());
            }
        };
        if let Some(code) = answer(op, &id, args.stream, &mut shown) {
            return Ok(code);
        }
    }
    Err("the gateway closed the connection before the outcome".into())
}

/// What a line from the gateway means for the message `id`: the exit code once it is
/// answered for good, `None` to keep reading.
fn answer(op: ServerOp, id: &str, stream: bool, shown: &mut Shown) -> Option<i32> {
    if let ServerOp::Error { detail } = &op {
        if detail == "unauthorized" {
            eprintln!(
                "error: unauthorized (the gateway needs its auth token: --token or TURNSTILE_AUTH_TOKEN)"
            );
        } else {
            eprintln!("error: {detail}");
        }
        return Some(1);
    }
    let of_this = match &op {
        ServerOp::Ack { id: i, .. }
        | ServerOp::Reject { id: i, .. }
        | ServerOp::Partial { id: i, .. }
        | ServerOp::Reply { id: i, .. }
        | ServerOp::Cancelled { id: i, .. }
        | ServerOp::Failed { id: i, .. }
        | ServerOp::Merged { id: i, .. } => i == id,
        ServerOp::Typing { .. }
        | ServerOp::Error { .. }
        | ServerOp::Pong { .. }
        | ServerOp::MayUse { .. } => false,
    };
    if !of_this {
        return None;
    }
    match op {
        ServerOp::Partial { text, .. } if stream => {
            shown.show(&text);
            return None;
        }
        ServerOp::Reply {
            text, truncated, ..
        } => {
            if stream {
                shown.show(&text);
                println!();
            } else {
                println!("{text}");
            }
            if truncated {
                eprintln!("(the reply was truncated at --max-reply-bytes)");
            }
            return Some(0);
        }
        ServerOp::Reject { reason, detail, .. } => eprintln!("rejected: {reason} ({detail})"),
        ServerOp::Failed { error, .. } => eprintln!("failed: {error}"),
        ServerOp::Cancelled { reason, .. } => eprintln!("cancelled: {reason}"),
        ServerOp::Merged { into, .. } => eprintln!("merged into {into}"),
        _ => return None,
    }
    Some(1)
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
