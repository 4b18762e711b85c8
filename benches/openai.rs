//! Overhead of the OpenAI-compatible agent per turn.
//!
//! A mock OpenAI-compatible server runs in a child process (this same binary with
//! `--mock-child`), so the gateway's CPU time (`getrusage(RUSAGE_SELF)`) excludes it. The
//! mock answers every request with a streamed reply of `--tokens` chunks (default 200), one
//! HTTP chunk (one write) per token, as fast as it can, then `data: [DONE]` and the chunked
//! terminator, and reports the CLOCK_MONOTONIC time of that last byte with the request's
//! tag. The gateway side is a real runtime with the openai agent: `--sessions` sessions
//! (default 100) each send `--rounds` messages one after another (closed loop; 100 turn
//! workers, so all sessions are in flight at once). Printed, one JSON line per agent:
//!
//! - `cpu_us_per_turn`: the gateway process's user+system CPU over the measured rounds,
//!   divided by the turns (the load driver's own share is in it, and tiny);
//! - `added_latency_ms`: from the mock's last byte to the runtime's reply event reaching the
//!   driver thread, p50/p99/max;
//! - the echo agent on the same loop, for the runtime's own share.
//!
//! `--token-rate R` paces each stream at R tokens a second, as a model would (default 0:
//! as fast as the mock can write, which saturates the 2 cores and measures queueing).
//!
//! `cargo bench --bench openai [-- --sessions N --rounds R --tokens T --token-rate R]`

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use turnstile::{AgentFactory, Builder, EchoAgent, EventKind, Message, Outcome, SessionKey};
use turnstile::{OpenAiConfig, OpenAiFactory};

fn mono_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// User and system CPU of this process, in microseconds.
fn cpu_us() -> (u64, u64) {
    // SAFETY: getrusage fills the struct we own.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let us = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
    (us(ru.ru_utime), us(ru.ru_stime))
}

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

// ---------------------------------------------------------------- the mock (child process)

fn mock_child(tokens: usize, rate: usize) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let out = Arc::new(Mutex::new(std::io::stdout()));
    {
        let mut o = out.lock().expect("stdout");
        writeln!(o, "port {}", listener.local_addr().expect("addr").port()).expect("write");
        o.flush().expect("flush");
    }
    // The parent closing our stdin ends the child.
    thread::spawn(|| {
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
        std::process::exit(0);
    });
    let mut chunks: Vec<Vec<u8>> = Vec::with_capacity(tokens + 3);
    let frame = |data: &str| {
        let payload = format!("data: {data}\n\n");
        format!("{:x}\r\n{payload}\r\n", payload.len()).into_bytes()
    };
    for i in 0..tokens {
        let word = if i == 0 { "tok" } else { " tok" };
        chunks.push(frame(&format!(
            r#"{{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1,"model":"bench","choices":[{{"index":0,"delta":{{"content":"{word}"}},"finish_reason":null}}]}}"#
        )));
    }
    chunks.push(frame(
        r#"{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1,"model":"bench","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#,
    ));
    chunks.push(frame(&format!(
        r#"{{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1,"model":"bench","choices":[],"usage":{{"prompt_tokens":100,"completion_tokens":{tokens},"total_tokens":{}}}}}"#,
        100 + tokens
    )));
    let mut last = frame("[DONE]");
    last.extend_from_slice(b"0\r\n\r\n");
    chunks.push(last);
    let chunks = Arc::new(chunks);
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let (chunks, out) = (Arc::clone(&chunks), Arc::clone(&out));
        thread::spawn(move || serve_conn(conn, &chunks, &out, rate));
    }
}

fn serve_conn(conn: TcpStream, chunks: &[Vec<u8>], out: &Mutex<std::io::Stdout>, rate: usize) {
    // Paced like a model generating `rate` tokens a second (0: as fast as possible).
    let gap = (rate > 0).then(|| Duration::from_secs_f64(1.0 / rate as f64));
    let _ = conn.set_nodelay(true);
    let Ok(mut w) = conn.try_clone() else { return };
    let mut r = BufReader::new(conn);
    loop {
        let mut len = 0usize;
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        loop {
            line.clear();
            if r.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':')
                && k.eq_ignore_ascii_case("content-length")
            {
                len = v.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0; len];
        if r.read_exact(&mut body).is_err() {
            return;
        }
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        let tag = v["messages"]
            .as_array()
            .and_then(|m| m.last())
            .and_then(|m| m["content"].as_str())
            .unwrap_or("")
            .to_owned();
        if w
            .write_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            .is_err()
        {
            return;
        }
        let start = Instant::now();
        for (i, c) in chunks.iter().enumerate() {
            if let Some(gap) = gap {
                let due = start + gap * i as u32;
                let now = Instant::now();
                if due > now {
                    thread::sleep(due - now);
                }
            }
            if w.write_all(c).is_err() {
                return;
            }
        }
        let t = mono_ns();
        let mut o = out.lock().expect("stdout");
        let _ = writeln!(o, "done {tag} {t}");
        let _ = o.flush();
    }
}

// ---------------------------------------------------------------- the gateway (parent)

struct Figures {
    turns: usize,
    seconds: f64,
    cpu_us_per_turn: f64,
    sys_share: f64,
    latencies_us: Vec<u64>,
}

fn run(
    factory: impl AgentFactory,
    sessions: usize,
    rounds: usize,
    done: Option<&Mutex<HashMap<String, u64>>>,
    warmup: usize,
) -> Figures {
    let (rt, handle, events) = Builder::new(factory)
        .turn_workers(sessions)
        .build()
        .expect("runtime settings");
    let reactor = rt.spawn().expect("reactor");
    let keys: Vec<SessionKey> = (0..sessions)
        .map(|i| SessionKey::dm("bench", &format!("s{i}")).expect("key"))
        .collect();
    let mut reply_ns: HashMap<String, u64> = HashMap::new();
    let send = |s: usize, r: usize| {
        let tag = format!("s{s}r{r}");
        let msg = Message::new(&tag, keys[s].clone(), &tag).expect("message");
        handle.submit(msg).expect("submit");
    };
    let total_rounds = warmup + rounds;
    for s in 0..sessions {
        send(s, 0);
    }
    let mut finished = 0usize;
    let mut measuring_since: Option<(Instant, (u64, u64))> = None;
    let mut measured = 0usize;
    while finished < sessions * total_rounds {
        let e = events
            .recv_timeout(Duration::from_secs(120))
            .expect("an event");
        let EventKind::Finished(outcome) = e.kind else {
            continue;
        };
        let now = mono_ns();
        assert!(
            matches!(outcome, Outcome::Reply(_)),
            "turn {} ended {outcome:?}",
            e.id
        );
        finished += 1;
        let (s, r) = {
            let t = &e.id[1..];
            let (s, r) = t.split_once('r').expect("tag");
            (
                s.parse::<usize>().expect("session"),
                r.parse::<usize>().expect("round"),
            )
        };
        if r >= warmup {
            measured += 1;
            reply_ns.insert(e.id.to_string(), now);
        }
        if r + 1 == warmup {
            // Warm-up done for this session: it waits for the others, then all start the
            // measured rounds together, with the clock.
            if finished == sessions * warmup {
                measuring_since = Some((Instant::now(), cpu_us()));
                for s in 0..sessions {
                    send(s, warmup);
                }
            }
        } else if r + 1 < total_rounds {
            send(s, r + 1);
        }
    }
    let (since, cpu0) = measuring_since.unwrap_or((Instant::now(), cpu_us()));
    let seconds = since.elapsed().as_secs_f64();
    let (user1, sys1) = cpu_us();
    let (user, sys) = (user1 - cpu0.0, sys1 - cpu0.1);
    let cpu = user + sys;
    handle.shutdown();
    let _ = reactor.join();
    let mut latencies_us = Vec::new();
    if let Some(done) = done {
        // The mock's reports may trail the replies by a moment: wait for them.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let d = done.lock().expect("done map");
            if reply_ns.keys().all(|k| d.contains_key(k)) || Instant::now() > deadline {
                for (k, &t) in &reply_ns {
                    if let Some(&m) = d.get(k) {
                        latencies_us.push(t.saturating_sub(m) / 1000);
                    }
                }
                break;
            }
            drop(d);
            thread::yield_now();
        }
    }
    latencies_us.sort_unstable();
    Figures {
        turns: measured,
        seconds,
        cpu_us_per_turn: cpu as f64 / measured.max(1) as f64,
        sys_share: sys as f64 / cpu.max(1) as f64,
        latencies_us,
    }
}

fn pct(v: &[u64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let i = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    v[i] as f64 / 1000.0
}

fn main() {
    let tokens = arg("--tokens", 200);
    if std::env::args().any(|a| a == "--mock-child") {
        mock_child(tokens, arg("--token-rate", 0));
        return;
    }
    let sessions = arg("--sessions", 100);
    let rounds = arg("--rounds", 20);
    let warmup = 2; // at least 1
    let exe = std::env::current_exe().expect("current exe");
    let mut child = Command::new(exe)
        .args(["--mock-child", "--tokens", &tokens.to_string()])
        .args(["--token-rate", &arg("--token-rate", 0).to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the mock");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let port: u16 = lines
        .next()
        .and_then(Result::ok)
        .and_then(|l| l.strip_prefix("port ").and_then(|p| p.parse().ok()))
        .expect("the mock's port");
    let done = Arc::new(Mutex::new(HashMap::new()));
    {
        let done = Arc::clone(&done);
        thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                let mut parts = line.split(' ');
                if let (Some("done"), Some(tag), Some(t)) =
                    (parts.next(), parts.next(), parts.next())
                    && let Ok(t) = t.parse::<u64>()
                {
                    done.lock().expect("done map").insert(tag.to_owned(), t);
                }
            }
        });
    }
    let cfg = OpenAiConfig::new(format!("http://127.0.0.1:{port}/v1"), "bench");
    let factory = OpenAiFactory::new(cfg).expect("factory");
    let f = run(factory, sessions, rounds, Some(&done), warmup);
    println!(
        "{}",
        serde_json::json!({
            "agent": "openai",
            "sessions": sessions,
            "rounds": rounds,
            "tokens_per_reply": tokens,
            "token_rate": arg("--token-rate", 0),
            "turns": f.turns,
            "seconds": (f.seconds * 1000.0).round() / 1000.0,
            "turns_per_s": (f.turns as f64 / f.seconds).round(),
            "cpu_us_per_turn": f.cpu_us_per_turn.round(),
            "cpu_system_share": (f.sys_share * 100.0).round() / 100.0,
            "added_latency_ms": {
                "n": f.latencies_us.len(),
                "p50": pct(&f.latencies_us, 0.5),
                "p99": pct(&f.latencies_us, 0.99),
                "max": pct(&f.latencies_us, 1.0),
            },
        })
    );
    drop(child.stdin.take());
    let _ = child.wait();
    let e = run(
        EchoAgent::factory(Duration::ZERO),
        sessions,
        rounds,
        None,
        warmup,
    );
    println!(
        "{}",
        serde_json::json!({
            "agent": "echo (baseline)",
            "sessions": sessions,
            "rounds": rounds,
            "turns": e.turns,
            "cpu_us_per_turn": e.cpu_us_per_turn.round(),
        })
    );
}
