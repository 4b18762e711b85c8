//! The soak (issue 33 item 8): the real `turnstile serve --data-dir` with a streaming process
//! agent, the real `turnstile bridge telegram` against a small fake Bot API of its own (below),
//! and a steady mixed load for 30 minutes by default: chats that send and wait for their
//! answer, some long replies (streamed as partials, then split past 4,096 units), `/new`,
//! new chats (new sessions) all the time, and the bridge restarted every minute (a reconnect,
//! its offset resumed). Every 10 s it samples the gateway's RSS, open fds and threads, the
//! data directory's size (journal and spool) and the bridge's RSS, and at the end prints each
//! one's slope per hour (least squares, over the run after its warm-up: `SOAK_WARMUP_SECS`,
//! by default the first fifth; the duplicate windows fill for `--dedup-window`, 600 s).
//!
//! `SOAK_SECS` sets the length (e.g. `SOAK_SECS=120 cargo bench --bench soak`), `SOAK_CHATS`
//! the chats talking at once (default 8), `SOAK_BIN` the `turnstile` binary to run (default
//! the one cargo built). A load, not a race: each chat waits for its answer.
//!
//! The fake is not Telegram: `getMe`, long-polled `getUpdates` with offsets, `sendMessage`,
//! `editMessageText` and `sendChatAction` answered `ok`, nothing checked, nothing kept but
//! the updates not yet confirmed and a count of messages per chat.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

const BOT_TOKEN: &str = "123456:SOAK-fake-token";
const GATEWAY_TOKEN: &str = "soak-gateway-token";
/// A chat that gets no answer in this long moves on (counted as unanswered).
const ANSWER_WAIT: Duration = Duration::from_secs(60);

/// The agent: "long …" streams five partials then a reply of ~6,000 characters (the bridge
/// splits it); anything else is echoed.
const AGENT: &str = r#"
import json, sys
def out(o):
    sys.stdout.write(json.dumps(o) + "\n"); sys.stdout.flush()
for line in sys.stdin:
    m = json.loads(line)
    if m.get("op") != "turn":
        continue
    i, t = m["id"], m["text"]
    if t.startswith("long"):
        for k in range(1, 6):
            out({"op": "partial", "id": i, "text": "part " * (40 * k)})
        out({"op": "reply", "id": i, "text": "long reply " * 550})
    else:
        out({"op": "reply", "id": i, "text": "echo: " + t})
"#;

#[derive(Default)]
struct Fake {
    pending: Vec<Value>,
    next_update: i64,
    next_message: i64,
    /// `sendMessage` calls per chat (a chat's answer has arrived when its count moves).
    sent: HashMap<i64, u64>,
}

type Shared = Arc<(Mutex<Fake>, Condvar)>;

fn lock(s: &Shared) -> std::sync::MutexGuard<'_, Fake> {
    s.0.lock().unwrap_or_else(|e| e.into_inner())
}

fn start_fake() -> (String, Shared) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind the fake");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let shared: Shared = Arc::default();
    let s = shared.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { return };
            let s = s.clone();
            std::thread::spawn(move || serve_http(stream, &s));
        }
    });
    (url, shared)
}

/// Requests on one connection until it closes (the bridge keeps its connections alive).
fn serve_http(stream: TcpStream, shared: &Shared) {
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let mut out = stream;
    loop {
        let mut request_line = String::new();
        if reader.read_line(&mut request_line).unwrap_or(0) == 0 {
            return;
        }
        let path = request_line.split(' ').nth(1).unwrap_or("").to_owned();
        let mut length = 0usize;
        loop {
            let mut header = String::new();
            if reader.read_line(&mut header).unwrap_or(0) == 0 {
                return;
            }
            let header = header.trim_end();
            if header.is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                length = value.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0u8; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        let params: Value = serde_json::from_slice(&body).unwrap_or(json!({}));
        let method = path.rsplit('/').next().unwrap_or("").to_owned();
        let answer = handle(&method, &params, shared);
        let body = answer.to_string();
        let head = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        if out.write_all(head.as_bytes()).is_err() || out.write_all(body.as_bytes()).is_err() {
            return;
        }
    }
}

fn handle(method: &str, params: &Value, shared: &Shared) -> Value {
    let (mutex, cvar) = &**shared;
    let mut fake = mutex.lock().unwrap_or_else(|e| e.into_inner());
    match method {
        "getMe" => {
            json!({"ok": true, "result": {"id": 999, "is_bot": true, "first_name": "Soak", "username": "soak_bot"}})
        }
        "getUpdates" => {
            if let Some(o) = params.get("offset").and_then(Value::as_i64) {
                fake.pending.retain(|u| u["update_id"].as_i64() >= Some(o));
            }
            let timeout = params.get("timeout").and_then(Value::as_u64).unwrap_or(0);
            let deadline = Instant::now() + Duration::from_secs(timeout);
            while fake.pending.is_empty() && Instant::now() < deadline {
                let left = deadline.saturating_duration_since(Instant::now());
                fake = cvar
                    .wait_timeout(fake, left)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            let updates: Vec<Value> = fake.pending.iter().take(100).cloned().collect();
            json!({"ok": true, "result": updates})
        }
        "sendMessage" => {
            let chat = params["chat_id"].as_i64().unwrap_or(0);
            *fake.sent.entry(chat).or_default() += 1;
            fake.next_message += 1;
            cvar.notify_all();
            json!({"ok": true, "result": {"message_id": fake.next_message, "chat": {"id": chat}}})
        }
        "editMessageText" => {
            json!({"ok": true, "result": {"message_id": params["message_id"].clone()}})
        }
        _ => json!({"ok": true, "result": true}),
    }
}

/// A user writing `text` in chat `chat`; returns the chat's `sendMessage` count before it.
fn say(shared: &Shared, chat: i64, text: &str) -> u64 {
    let mut fake = lock(shared);
    fake.next_update += 1;
    let (update, message) = (fake.next_update, fake.next_update);
    fake.pending.push(
        json!({"update_id": update, "message": {"message_id": message,
        "text": text, "chat": {"id": chat, "type": "private"},
        "from": {"id": chat, "is_bot": false, "first_name": "Soak"}}}),
    );
    let before = fake.sent.get(&chat).copied().unwrap_or(0);
    shared.1.notify_all();
    before
}

/// Waits (bounded) for chat `chat`'s next message; false when none came.
fn answered(shared: &Shared, chat: i64, before: u64) -> bool {
    let deadline = Instant::now() + ANSWER_WAIT;
    let mut fake = lock(shared);
    loop {
        if fake.sent.get(&chat).copied().unwrap_or(0) > before {
            // The chat is done with: forget it, so the fake does not grow.
            fake.sent.remove(&chat);
            return true;
        }
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        fake = shared
            .1
            .wait_timeout(fake, deadline - now)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

fn command(bin: &str) -> Command {
    let mut c = Command::new(bin);
    // SAFETY: prctl(2) only, async-signal-safe, between fork and exec.
    unsafe {
        c.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    c
}

fn start_serve(bin: &str, dir: &Path) -> (Child, String) {
    let script = dir.join("agent.py");
    std::fs::write(&script, AGENT).expect("agent script");
    let cmd = format!("exec python3 {}", script.display());
    let mut serve = command(bin)
        .args(["serve", "--listen", "127.0.0.1:0", "--http-listen", "off"])
        .args(["--agent", "process", "--agent-cmd", &cmd])
        .args(["--max-cached-agents", "16", "--agent-idle-ttl", "30"])
        .args(["--partial-interval", "0.05"])
        .arg("--data-dir")
        .arg(dir.join("data"))
        .env("RUST_LOG", "warn")
        .env("TURNSTILE_AUTH_TOKEN", GATEWAY_TOKEN)
        .stdout(Stdio::piped())
        .stderr(Stdio::from(
            std::fs::File::create(dir.join("serve.log")).expect("serve log"),
        ))
        .spawn()
        .expect("start serve");
    let mut line = String::new();
    BufReader::new(serve.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("the listening line");
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("not a listening line: {line:?}"))
        .to_owned();
    (serve, addr)
}

fn start_bridge(bin: &str, gateway: &str, api: &str, dir: &Path) -> Child {
    command(bin)
        .args([
            "bridge",
            "telegram",
            "--gateway",
            gateway,
            "--api-base",
            api,
        ])
        .args(["--poll-timeout", "5"])
        .arg("--state-dir")
        .arg(dir.join("tg-state"))
        .env("TELEGRAM_BOT_TOKEN", BOT_TOKEN)
        .env("TURNSTILE_AUTH_TOKEN", GATEWAY_TOKEN)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::from(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(dir.join("bridge.log"))
                .expect("bridge log"),
        ))
        .spawn()
        .expect("start the bridge")
}

fn stop(child: &mut Child) {
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let _ = child.wait();
}

/// `/proc/<pid>/status` field `name` (the first number in it).
fn proc_status(pid: u32, name: &str) -> f64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(f64::NAN)
}

fn fds(pid: u32) -> f64 {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(f64::NAN, |d| d.count() as f64)
}

fn dir_bytes(dir: &Path) -> f64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0.0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len() as f64,
            Err(_) => 0.0,
        })
        .sum()
}

/// Least-squares slope of `ys` over `ts` (seconds), per hour.
fn slope_per_hour(ts: &[f64], ys: &[f64]) -> f64 {
    let n = ts.len() as f64;
    let (mt, my) = (ts.iter().sum::<f64>() / n, ys.iter().sum::<f64>() / n);
    let cov: f64 = ts.iter().zip(ys).map(|(t, y)| (t - mt) * (y - my)).sum();
    let var: f64 = ts.iter().map(|t| (t - mt) * (t - mt)).sum();
    if var == 0.0 { 0.0 } else { cov / var * 3600.0 }
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One chat's loop: a message, its answer, and again; every so often a long reply, `/new`,
/// or a move to a new chat (a new session).
fn chat_loop(
    shared: Shared,
    first_chat: i64,
    stride: i64,
    stop: Arc<AtomicBool>,
    counts: Arc<[AtomicU64; 3]>,
) {
    let mut chat = first_chat;
    let mut n: u64 = 0;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let text = match n % 10 {
            3 => "long please".to_owned(),
            7 => "/new".to_owned(),
            _ => format!("hello {n}"),
        };
        let before = say(&shared, chat, &text);
        let k = if answered(&shared, chat, before) {
            0
        } else {
            1
        };
        counts[k].fetch_add(1, Ordering::Relaxed);
        if n % 10 == 9 {
            chat += stride;
            counts[2].fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// One figure of a sample.
type Figure = fn(&Sample) -> f64;

struct Sample {
    t: f64,
    rss_mib: f64,
    fds: f64,
    threads: f64,
    data_kib: f64,
    bridge_rss_mib: f64,
}

fn main() {
    let secs = env_u64("SOAK_SECS", 1800);
    let every = Duration::from_secs(env_u64("SOAK_SAMPLE_SECS", 10));
    let chats = env_u64("SOAK_CHATS", 8) as i64;
    // `SOAK_BIN`: a copy of the binary, so that a build during the run does not change
    // what the bridge restarts run.
    let bin_path = std::env::var("SOAK_BIN").unwrap_or(env!("CARGO_BIN_EXE_turnstile").to_owned());
    let bin = bin_path.as_str();
    let dir = tempfile::tempdir().expect("tempdir");
    let dir: PathBuf = dir.keep();
    let (api, shared) = start_fake();
    let (mut serve, gateway) = start_serve(bin, &dir);
    let mut bridge = start_bridge(bin, &gateway, &api, &dir);
    let stop_flag = Arc::new(AtomicBool::new(false));
    let counts: Arc<[AtomicU64; 3]> = Arc::new(Default::default());
    let users: Vec<_> = (0..chats)
        .map(|i| {
            let (s, f, c) = (shared.clone(), stop_flag.clone(), counts.clone());
            std::thread::spawn(move || chat_loop(s, 1_000 + i, chats, f, c))
        })
        .collect();
    println!(
        "soak: {secs} s, {chats} chats, sampling every {every:?}; files in {}",
        dir.display()
    );
    println!(
        "{:>6} {:>9} {:>5} {:>7} {:>10} {:>10} {:>9} {:>7}",
        "t_s", "rss_MiB", "fds", "threads", "data_KiB", "bridge_MiB", "answered", "lost"
    );
    let start = Instant::now();
    let mut samples: Vec<Sample> = Vec::new();
    let mut next_restart = Duration::from_secs(60);
    let mut restarts = 0;
    while start.elapsed() < Duration::from_secs(secs) {
        std::thread::sleep(every);
        let t = start.elapsed();
        let s = Sample {
            t: t.as_secs_f64(),
            rss_mib: proc_status(serve.id(), "VmRSS:") / 1024.0,
            fds: fds(serve.id()),
            threads: proc_status(serve.id(), "Threads:"),
            data_kib: dir_bytes(&dir.join("data")) / 1024.0,
            bridge_rss_mib: proc_status(bridge.id(), "VmRSS:") / 1024.0,
        };
        println!(
            "{:>6.0} {:>9.1} {:>5} {:>7} {:>10.0} {:>10.1} {:>9} {:>7}",
            s.t,
            s.rss_mib,
            s.fds,
            s.threads,
            s.data_kib,
            s.bridge_rss_mib,
            counts[0].load(Ordering::Relaxed),
            counts[1].load(Ordering::Relaxed)
        );
        samples.push(s);
        // After the sample: a bridge just started is not measured.
        if t >= next_restart {
            stop(&mut bridge);
            bridge = start_bridge(bin, &gateway, &api, &dir);
            restarts += 1;
            next_restart += Duration::from_secs(60);
        }
    }
    stop_flag.store(true, Ordering::Relaxed);
    stop(&mut bridge);
    // Users waiting for an answer give up at their deadline; don't wait for them.
    drop(users);
    stop(&mut serve);
    let warm_up = env_u64("SOAK_WARMUP_SECS", secs / 5) as f64;
    let warm: Vec<&Sample> = samples.iter().filter(|s| s.t >= warm_up).collect();
    let ts: Vec<f64> = warm.iter().map(|s| s.t).collect();
    let series: [(&str, Figure); 5] = [
        ("gateway RSS (MiB)", |s| s.rss_mib),
        ("gateway open fds", |s| s.fds),
        ("gateway threads", |s| s.threads),
        ("data dir (KiB)", |s| s.data_kib),
        ("bridge RSS (MiB)", |s| s.bridge_rss_mib),
    ];
    println!(
        "\nsoak summary: {:.0} s, {} answered, {} unanswered, {} new chats, {restarts} bridge restarts; slopes from {warm_up:.0} s on",
        start.elapsed().as_secs_f64(),
        counts[0].load(Ordering::Relaxed),
        counts[1].load(Ordering::Relaxed),
        counts[2].load(Ordering::Relaxed)
    );
    println!(
        "{:<20} {:>10} {:>10} {:>10} {:>14}",
        "series", "first", "min", "max", "slope_per_hour"
    );
    for (name, f) in series {
        let ys: Vec<f64> = warm.iter().map(|s| f(s)).collect();
        let min = ys.iter().copied().fold(f64::INFINITY, f64::min);
        let max = ys.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        println!(
            "{name:<20} {:>10.1} {min:>10.1} {max:>10.1} {:>+14.2}",
            ys.first().copied().unwrap_or(f64::NAN),
            slope_per_hour(&ts, &ys)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
