//! `turnstile loadgen`: the closed-loop workload over the bridge protocol against a running
//! server, printing the benchmark's JSON line.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::workload::{Percentiles, Report, round, rss_mib, summarize};
use clap::Args;
use serde::Deserialize;

use super::USAGE_ERROR;
use crate::message::ChatType;
use crate::wire::{ClientOp, MessageFields};

/// Flags of `loadgen`.
#[derive(Args, Debug)]
pub(crate) struct LoadgenArgs {
    /// Gateway address.
    #[arg(long, default_value = "127.0.0.1:7878")]
    addr: String,
    /// Concurrent sessions.
    #[arg(long, default_value_t = 100)]
    sessions: usize,
    /// Messages per session, each sent after the previous reply.
    #[arg(long, default_value_t = 100)]
    rounds: usize,
    /// TCP connections the sessions are spread over.
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// Auth token, if the gateway requires one.
    #[arg(long, env = "TURNSTILE_AUTH_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// The server's --status-file, to report its loop lag.
    #[arg(long)]
    status_file: Option<PathBuf>,
    /// Turn workers and agent delay of the server, copied into the report.
    #[arg(long, default_value_t = 0)]
    workers: usize,
    /// See --workers.
    #[arg(long, default_value_t = 0.0)]
    delay_ms: f64,
    /// Open loop instead: --messages messages with unique ids over --sessions sessions from
    /// --connections connections, each connection keeping up to --window unanswered; refused
    /// messages (`backpressure`, `overloaded`, `queue_full`) are sent again later.
    #[arg(long)]
    flood: bool,
    /// Messages of the flood.
    #[arg(long, default_value_t = 1_000_000)]
    messages: usize,
    /// Messages a flood connection keeps unanswered at once.
    #[arg(long, default_value_t = 1_000)]
    window: usize,
    /// Bytes of text per flood message.
    #[arg(long, default_value_t = 16)]
    text_bytes: usize,
    /// The server's pid, to report its peak RSS (VmHWM) and final RSS.
    #[arg(long)]
    server_pid: Option<u32>,
}

#[derive(Deserialize)]
struct Line<'a> {
    op: &'a str,
    #[serde(borrow)]
    id: Option<&'a str>,
    reason: Option<&'a str>,
    error: Option<&'a str>,
    state: Option<&'a str>,
}

/// The hello of a loadgen connection (platform `loadgen`).
fn hello(token: Option<&str>) -> String {
    ClientOp::Hello {
        platform: Some("loadgen".to_owned()),
        token: token.map(str::to_owned),
        acks: false,
    }
    .line()
}

/// A `message` line: a dm in chat `chat_id`.
fn message(id: String, platform: Option<&str>, chat_id: String, text: String) -> String {
    ClientOp::Message(MessageFields {
        id,
        platform: platform.map(str::to_owned),
        chat_id,
        chat_type: ChatType::Dm,
        user_id: None,
        user_name: None,
        thread_id: None,
        meta: None,
        text,
        attachments: Vec::new(),
    })
    .line()
}

/// What makes this run's message ids its own: the start in milliseconds and the process id,
/// so that floods started in the same millisecond (one per instance of a cluster) never send
/// the same `(platform, id)` and have their messages answered `duplicate`.
fn run_tag() -> String {
    let millis = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    format!("{millis}.{}", std::process::id())
}

/// A `duplicate` ack of an id this run sent: someone else sent it first, so its answer went
/// there and this run would wait for it forever.
fn duplicate_error(id: &str) -> String {
    format!("gateway answered duplicate for {id}: another sender used the same id")
}

/// Runs the workload; returns the exit code.
pub(crate) fn run(args: LoadgenArgs) -> i32 {
    if args.flood {
        return flood(&args);
    }
    if args.sessions == 0 || args.rounds == 0 || args.connections == 0 {
        eprintln!("turnstile loadgen: --sessions, --rounds and --connections must be at least 1");
        return USAGE_ERROR;
    }
    let nonce = run_tag();
    let done = Arc::new(AtomicUsize::new(0));
    let total = args.sessions * args.rounds;
    let start = Instant::now();
    let conns = args.connections.min(args.sessions);
    // One result per connection thread: bounded by `--connections`.
    let (results_tx, results) = crossbeam_channel::unbounded();
    for c in 0..conns {
        let sessions: Vec<usize> = (c..args.sessions).step_by(conns).collect();
        let (addr, token, done, rounds) = (
            args.addr.clone(),
            args.token.clone(),
            done.clone(),
            args.rounds,
        );
        let tag = format!("{nonce}-{c}");
        let tx = results_tx.clone();
        thread::spawn(move || {
            let _ = tx.send(drive(
                &addr,
                token.as_deref(),
                &tag,
                &sessions,
                rounds,
                &done,
            ));
        });
    }
    drop(results_tx);
    // Collect each connection's latencies, with a progress line on stderr every second.
    let mut latencies = Vec::with_capacity(total);
    let mut ack_latencies = Vec::with_capacity(total);
    let mut finished = 0;
    while finished < conns {
        match results.recv_timeout(Duration::from_secs(1)) {
            Ok(Ok((mut l, mut a))) => {
                latencies.append(&mut l);
                ack_latencies.append(&mut a);
                finished += 1;
            }
            Ok(Err(e)) => {
                eprintln!("\nturnstile loadgen: {e}");
                return 1;
            }
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                let n = done.load(Ordering::Relaxed);
                eprint!(
                    "\rloadgen: {n}/{total} turns, {:.0} s",
                    start.elapsed().as_secs_f64()
                );
            }
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                eprintln!("\nturnstile loadgen: a connection thread panicked");
                return 1;
            }
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    eprintln!("\rloadgen: {total}/{total} turns, {seconds:.1} s");
    let report = Report {
        system: "turnstile-tcp".into(),
        scenario: "loadgen".into(),
        sessions: args.sessions,
        rounds: args.rounds,
        workers: args.workers,
        delay_ms: args.delay_ms,
        turns: total,
        seconds: round(seconds, 3),
        turns_per_s: round(total as f64 / seconds, 1),
        latency_ms: summarize(&mut latencies).rounded(3),
        ack_latency_ms: Some(summarize(&mut ack_latencies).rounded(3)),
        loop_lag_ms: args.status_file.as_deref().and_then(read_lag),
        rss_mib: round(rss_mib(), 1),
    };
    match serde_json::to_string(&report) {
        Ok(line) => {
            println!("{line}");
            0
        }
        Err(e) => {
            eprintln!("turnstile loadgen: {e}");
            1
        }
    }
}

fn read_lag(path: &std::path::Path) -> Option<Percentiles> {
    let text = std::fs::read_to_string(path).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let lag = &v["loop_lag_ms"];
    let p = Percentiles {
        p50: lag["p50"].as_f64()?,
        p99: lag["p99"].as_f64()?,
        max: lag["max"].as_f64()?,
    };
    Some(p.rounded(3))
}

/// One connection's share of the sessions, closed loop; returns its reply and ack latencies
/// in ms.
fn drive(
    addr: &str,
    token: Option<&str>,
    tag: &str,
    sessions: &[usize],
    rounds: usize,
    done: &AtomicUsize,
) -> Result<(Vec<f64>, Vec<f64>), String> {
    let stream = TcpStream::connect(addr).map_err(|e| format!("cannot connect to {addr}: {e}"))?;
    let _ = stream.set_nodelay(true);
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .map_err(|e| e.to_string())?;
    let mut reader =
        BufReader::with_capacity(256 * 1024, stream.try_clone().map_err(|e| e.to_string())?);
    let mut writer = BufWriter::with_capacity(256 * 1024, stream);
    let io = |e: std::io::Error| e.to_string();
    writeln!(writer, "{}", hello(token)).map_err(io)?;
    let mut sent_at: HashMap<usize, Instant> = HashMap::with_capacity(sessions.len());
    let mut count: HashMap<usize, usize> = HashMap::with_capacity(sessions.len());
    let send = |w: &mut BufWriter<TcpStream>, s: usize, r: usize| -> Result<(), String> {
        let id = format!("lg-{tag}-{s}-{r}");
        let line = message(id, Some("loadgen"), format!("s{s}"), format!("m{r}"));
        writeln!(w, "{line}").map_err(io)
    };
    for &s in sessions {
        sent_at.insert(s, Instant::now());
        send(&mut writer, s, 0)?;
    }
    writer.flush().map_err(io)?;
    let mut latencies = Vec::with_capacity(sessions.len() * rounds);
    let mut ack_latencies = Vec::with_capacity(sessions.len() * rounds);
    let mut remaining = sessions.len() * rounds;
    let mut line = String::new();
    while remaining > 0 {
        line.clear();
        if reader.read_line(&mut line).map_err(io)? == 0 {
            return Err("the gateway closed the connection".into());
        }
        let parsed: Line<'_> =
            serde_json::from_str(&line).map_err(|e| format!("bad line from gateway: {e}"))?;
        match parsed.op {
            "ack" => {
                let s = parsed
                    .id
                    .and_then(|id| id.rsplit('-').nth(1)?.parse::<usize>().ok());
                if parsed.state == Some("duplicate") {
                    return Err(duplicate_error(parsed.id.unwrap_or("-")));
                }
                if let Some(t) = s.and_then(|s| sent_at.get(&s)) {
                    ack_latencies.push(t.elapsed().as_secs_f64() * 1000.0);
                }
            }
            "reply" => {
                let id = parsed.id.unwrap_or("");
                let s: usize = id
                    .rsplit('-')
                    .nth(1)
                    .and_then(|n| n.parse().ok())
                    .ok_or("reply with an unknown id")?;
                if let Some(t) = sent_at.get(&s) {
                    latencies.push(t.elapsed().as_secs_f64() * 1000.0);
                }
                remaining -= 1;
                done.fetch_add(1, Ordering::Relaxed);
                let n = count.entry(s).or_insert(0);
                *n += 1;
                if *n < rounds {
                    sent_at.insert(s, Instant::now());
                    send(&mut writer, s, *n)?;
                }
            }
            "reject" | "failed" | "cancelled" | "error" => {
                return Err(format!(
                    "gateway answered {} for {}: {}",
                    parsed.op,
                    parsed.id.unwrap_or("-"),
                    parsed.reason.or(parsed.error).unwrap_or("")
                ));
            }
            _ => {}
        }
        // Batch writes: flush only when every line already received has been handled.
        if reader.buffer().is_empty() {
            writer.flush().map_err(io)?;
        }
    }
    Ok((latencies, ack_latencies))
}

/// The flood's result line.
#[derive(serde::Serialize)]
struct FloodReport {
    scenario: &'static str,
    messages: usize,
    sessions: usize,
    connections: usize,
    window: usize,
    seconds: f64,
    messages_per_s: f64,
    /// Refusals answered by sending again, by reason.
    retried: HashMap<String, u64>,
    latency_ms: Percentiles,
    /// From sending a message to its `ack` (with `--data-dir`: until it is durable).
    ack_latency_ms: Percentiles,
    loop_lag_ms: Option<Percentiles>,
    server_rss_mib: Option<f64>,
    server_peak_rss_mib: Option<f64>,
}

fn proc_kib(pid: u32, field: &str) -> Option<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = text.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse::<f64>().ok()
}

fn flood(args: &LoadgenArgs) -> i32 {
    if args.messages == 0 || args.sessions == 0 || args.connections == 0 || args.window == 0 {
        eprintln!(
            "turnstile loadgen: --messages, --sessions, --connections and --window must be at least 1"
        );
        return USAGE_ERROR;
    }
    let done = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let conns = args.connections.min(args.messages);
    let results = start_flooders(args, conns, &run_tag(), &done);
    let (mut latencies, retried, mut ack_latencies) =
        match gather(args, conns, &results, &done, start) {
            Ok(g) => g,
            Err(e) => {
                eprintln!("\nturnstile loadgen: {e}");
                return 1;
            }
        };
    let seconds = start.elapsed().as_secs_f64();
    eprintln!("\rloadgen: {0}/{0} messages, {seconds:.1} s", args.messages);
    let report = FloodReport {
        scenario: "flood",
        messages: args.messages,
        sessions: args.sessions,
        connections: conns,
        window: args.window,
        seconds: round(seconds, 3),
        messages_per_s: round(args.messages as f64 / seconds, 1),
        retried,
        latency_ms: summarize(&mut latencies).rounded(3),
        ack_latency_ms: summarize(&mut ack_latencies).rounded(3),
        loop_lag_ms: args.status_file.as_deref().and_then(read_lag),
        server_rss_mib: args
            .server_pid
            .and_then(|p| proc_kib(p, "VmRSS:"))
            .map(|k| round(k / 1024.0, 1)),
        server_peak_rss_mib: args
            .server_pid
            .and_then(|p| proc_kib(p, "VmHWM:"))
            .map(|k| round(k / 1024.0, 1)),
    };
    match serde_json::to_string(&report) {
        Ok(line) => {
            println!("{line}");
            0
        }
        Err(e) => {
            eprintln!("turnstile loadgen: {e}");
            1
        }
    }
}

/// Starts one thread per flood connection; each sends its result on the returned channel.
fn start_flooders(
    args: &LoadgenArgs,
    conns: usize,
    tag: &str,
    done: &Arc<AtomicUsize>,
) -> crossbeam_channel::Receiver<FloodResult> {
    // One result per connection thread: bounded by `--connections`.
    let (results_tx, results) = crossbeam_channel::unbounded();
    for c in 0..conns {
        let mine: Vec<usize> = (c..args.messages).step_by(conns).collect();
        let (addr, token, done) = (args.addr.clone(), args.token.clone(), done.clone());
        let (sessions, window, text) = (args.sessions, args.window, "t".repeat(args.text_bytes));
        let tag = tag.to_owned();
        let tx = results_tx.clone();
        thread::spawn(move || {
            let plan = FloodPlan {
                tag: &tag,
                mine: &mine,
                sessions,
                window,
                text: &text,
            };
            let _ = tx.send(flood_one(&addr, token.as_deref(), plan, &done));
        });
    }
    results
}

/// Waits for every connection's result, printing progress; the first error ends it.
fn gather(
    args: &LoadgenArgs,
    conns: usize,
    results: &crossbeam_channel::Receiver<FloodResult>,
    done: &AtomicUsize,
    start: Instant,
) -> FloodResult {
    let mut latencies = Vec::with_capacity(args.messages);
    let mut ack_latencies = Vec::with_capacity(args.messages);
    let mut retried: HashMap<String, u64> = HashMap::new();
    let mut finished = 0;
    while finished < conns {
        match results.recv_timeout(Duration::from_secs(1)) {
            Ok(Ok((mut l, r, mut a))) => {
                latencies.append(&mut l);
                ack_latencies.append(&mut a);
                for (k, v) in r {
                    *retried.entry(k).or_insert(0) += v;
                }
                finished += 1;
            }
            Ok(Err(e)) => return Err(e),
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                let n = done.load(Ordering::Relaxed);
                eprint!(
                    "\rloadgen: {n}/{} messages, {:.0} s",
                    args.messages,
                    start.elapsed().as_secs_f64()
                );
            }
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                return Err("a connection thread panicked".into());
            }
        }
    }
    Ok((latencies, retried, ack_latencies))
}

/// Reply latencies, refusals by reason, ack latencies.
type FloodResult = Result<(Vec<f64>, HashMap<String, u64>, Vec<f64>), String>;

/// What one flood connection sends: its share of the messages, pipelined up to `window`
/// unanswered.
struct FloodPlan<'a> {
    tag: &'a str,
    mine: &'a [usize],
    sessions: usize,
    window: usize,
    text: &'a str,
}

/// One flood connection's progress: what is in flight, what to resend, what was measured.
struct Flooder<'a> {
    plan: FloodPlan<'a>,
    reader: BufReader<TcpStream>,
    writer: BufWriter<TcpStream>,
    next: usize,
    retry: std::collections::VecDeque<usize>,
    sent_at: HashMap<usize, Instant>,
    retried: HashMap<String, u64>,
    latencies: Vec<f64>,
    ack_latencies: Vec<f64>,
    remaining: usize,
}

fn io_error(e: std::io::Error) -> String {
    e.to_string()
}

/// One flood connection: its messages pipelined up to `window` unanswered, refusals resent.
fn flood_one(
    addr: &str,
    token: Option<&str>,
    plan: FloodPlan<'_>,
    done: &AtomicUsize,
) -> FloodResult {
    let mut f = Flooder::connect(addr, token, plan)?;
    while f.remaining > 0 {
        f.fill_window()?;
        f.read_available(done)?;
    }
    Ok((f.latencies, f.retried, f.ack_latencies))
}

impl<'a> Flooder<'a> {
    fn connect(addr: &str, token: Option<&str>, plan: FloodPlan<'a>) -> Result<Self, String> {
        let stream =
            TcpStream::connect(addr).map_err(|e| format!("cannot connect to {addr}: {e}"))?;
        let _ = stream.set_nodelay(true);
        stream
            .set_read_timeout(Some(Duration::from_secs(300)))
            .map_err(io_error)?;
        let reader = BufReader::with_capacity(256 * 1024, stream.try_clone().map_err(io_error)?);
        let mut writer = BufWriter::with_capacity(256 * 1024, stream);
        writeln!(writer, "{}", hello(token)).map_err(io_error)?;
        let n = plan.mine.len();
        Ok(Flooder {
            sent_at: HashMap::with_capacity(plan.window),
            plan,
            reader,
            writer,
            next: 0,
            retry: Default::default(),
            retried: HashMap::new(),
            latencies: Vec::with_capacity(n),
            ack_latencies: Vec::with_capacity(n),
            remaining: n,
        })
    }

    /// Fills the window: refused messages first, then new ones.
    fn fill_window(&mut self) -> Result<(), String> {
        while self.sent_at.len() < self.plan.window {
            let i = match self.retry.pop_front() {
                Some(i) => i,
                None if self.next < self.plan.mine.len() => {
                    self.next += 1;
                    self.plan.mine[self.next - 1]
                }
                None => break,
            };
            self.sent_at.insert(i, Instant::now());
            let p = &self.plan;
            let id = format!("fl-{}-{i}", p.tag);
            let line = message(id, None, format!("s{}", i % p.sessions), p.text.to_owned());
            writeln!(self.writer, "{line}").map_err(io_error)?;
        }
        self.writer.flush().map_err(io_error)
    }

    /// Reads what is there (at least one line).
    fn read_available(&mut self, done: &AtomicUsize) -> Result<(), String> {
        let mut line = String::new();
        loop {
            line.clear();
            if self.reader.read_line(&mut line).map_err(io_error)? == 0 {
                return Err("the gateway closed the connection".into());
            }
            self.handle(&line, done)?;
            if self.reader.buffer().is_empty() {
                return Ok(());
            }
        }
    }

    /// One line from the gateway: an ack, an outcome, or a refusal to resend.
    fn handle(&mut self, line: &str, done: &AtomicUsize) -> Result<(), String> {
        let parsed: Line<'_> =
            serde_json::from_str(line).map_err(|e| format!("bad line from gateway: {e}"))?;
        let index = || -> Option<usize> { parsed.id?.rsplit('-').next()?.parse().ok() };
        match parsed.op {
            "ack" if parsed.state == Some("duplicate") => {
                return Err(duplicate_error(parsed.id.unwrap_or("-")));
            }
            "ack" => {
                if let Some(t) = index().and_then(|i| self.sent_at.get(&i)) {
                    self.ack_latencies.push(t.elapsed().as_secs_f64() * 1000.0);
                }
            }
            "reply" | "cancelled" | "failed" | "merged" => {
                if let Some(t) = index().and_then(|i| self.sent_at.remove(&i)) {
                    self.latencies.push(t.elapsed().as_secs_f64() * 1000.0);
                    self.remaining -= 1;
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }
            "reject" => {
                let reason = parsed.reason.unwrap_or("");
                if !matches!(reason, "backpressure" | "overloaded" | "queue_full") {
                    return Err(format!(
                        "gateway refused {}: {reason}",
                        parsed.id.unwrap_or("-")
                    ));
                }
                *self.retried.entry(reason.to_owned()).or_insert(0) += 1;
                if let Some(i) = index() {
                    self.sent_at.remove(&i);
                    self.retry.push_back(i);
                }
            }
            "error" => return Err(format!("gateway error: {}", line.trim())),
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_run_tag_names_this_process_so_concurrent_runs_never_share_ids() {
        let tag = run_tag();
        let (millis, pid) = tag.split_once('.').expect("millis.pid");
        assert!(millis.parse::<u128>().is_ok_and(|m| m > 0), "{tag}");
        assert_eq!(pid, std::process::id().to_string(), "{tag}");
    }
}
