//! Closed-loop loop-latency benchmark through the public library API, with the workload of
//! `../shared/peer/hermes_gateway_bench.py`: S sessions each send R messages one after
//! another (the next after the previous reply), W turn workers, echo agent with delay D.
//! Prints one JSON line per scenario (the peer's fields plus `scenario` and `rss_mib`).
//!
//! `cargo bench --bench loop_latency` runs the full sizes; `-- --quick` (or
//! `TURNSTILE_BENCH_QUICK=1`) a reduced run under 20 s; `-- NAME` runs scenarios whose name
//! contains NAME; `-- --coarse-timers` turns the reactor's timerfd off (millisecond poll
//! timeouts only), to measure what it buys.

use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, unbounded};
// The workload helpers belong to the binary (loadgen); the benches share the file.
#[allow(dead_code)]
#[path = "../src/cli/workload.rs"]
mod workload;
use turnstile::{
    Agent, Builder, CancelToken, EchoAgent, EventKind, Message, Outcome, SessionKey, TurnError,
    TurnInput,
};
use workload::{Percentiles, Report, round, rss_mib, summarize};

struct Scenario {
    name: &'static str,
    sessions: usize,
    rounds: usize,
    quick_rounds: usize,
    workers: usize,
    delay_ms: u64,
    stuck_cleanups: usize,
}

const SCENARIOS: [Scenario; 4] = [
    Scenario {
        name: "raw",
        sessions: 100,
        rounds: 1000,
        quick_rounds: 300,
        workers: 8,
        delay_ms: 0,
        stuck_cleanups: 0,
    },
    Scenario {
        name: "peer-worst",
        sessions: 1000,
        rounds: 5,
        quick_rounds: 2,
        workers: 64,
        delay_ms: 20,
        stuck_cleanups: 0,
    },
    Scenario {
        name: "many-sessions",
        sessions: 10_000,
        rounds: 3,
        quick_rounds: 1,
        workers: 16,
        delay_ms: 1,
        stuck_cleanups: 0,
    },
    Scenario {
        name: "raw-stuck-cleanup",
        sessions: 100,
        rounds: 1000,
        quick_rounds: 300,
        workers: 8,
        delay_ms: 0,
        stuck_cleanups: 4,
    },
];

/// An echo agent whose close() can hang until the benchmark ends.
struct BenchAgent {
    echo: EchoAgent,
    hang_on_close: Option<Receiver<()>>,
}

impl Agent for BenchAgent {
    fn turn(&mut self, input: &TurnInput<'_>, cancel: &CancelToken) -> Result<String, TurnError> {
        self.echo.turn(input, cancel)
    }
    fn close(&mut self) -> Result<(), turnstile::AgentError> {
        if let Some(rx) = &self.hang_on_close {
            let _ = rx.recv(); // never sent: returns only when the benchmark drops the sender
        }
        Ok(())
    }
}

fn run(s: &Scenario, rounds: usize, coarse_timers: bool) -> Report {
    let delay = Duration::from_millis(s.delay_ms);
    let (_never, hang) = unbounded::<()>();
    let hang_for_factory = hang.clone();
    let factory = move |key: &SessionKey| -> Result<Box<dyn Agent>, String> {
        let stuck = key.platform() == "stuck";
        Ok(Box::new(BenchAgent {
            echo: EchoAgent::new(delay),
            hang_on_close: stuck.then(|| hang_for_factory.clone()),
        }))
    };
    let (rt, handle, events) = Builder::new(factory)
        .turn_workers(s.workers)
        .tick_interval(Duration::from_millis(10))
        .cleanup_timeout(Duration::from_secs(3))
        .max_cached_agents(s.sessions + s.stuck_cleanups)
        .precise_timers(!coarse_timers)
        .build()
        .expect("valid settings");
    let reactor = rt.spawn().expect("reactor");

    // Wedge the cleanup pool first: each stuck session runs one turn, then /reset sends its
    // agent to a close() that hangs for the rest of the run.
    for i in 0..s.stuck_cleanups {
        let key = SessionKey::dm("stuck", &i.to_string()).expect("key");
        submit(
            &handle,
            Message::new(&format!("warm{i}"), key.clone(), "x").expect("msg"),
        );
        wait_finished(&events, &format!("warm{i}"));
        submit(
            &handle,
            Message::new(&format!("reset{i}"), key, "/reset").expect("msg"),
        );
        wait_finished(&events, &format!("reset{i}"));
    }

    let keys: Vec<SessionKey> = (0..s.sessions)
        .map(|i| SessionKey::dm("bench", &i.to_string()).expect("key"))
        .collect();
    let mut sent_at = vec![Instant::now(); s.sessions];
    let mut done = vec![0usize; s.sessions];
    let mut latencies = Vec::with_capacity(s.sessions * rounds);
    let start = Instant::now();
    for (i, key) in keys.iter().enumerate() {
        sent_at[i] = Instant::now();
        submit(
            &handle,
            Message::new(&format!("{i}/0"), key.clone(), "m0").expect("msg"),
        );
    }
    let mut finished = 0;
    while finished < s.sessions * rounds {
        let e = events
            .recv_timeout(Duration::from_secs(60))
            .expect("progress");
        let EventKind::Finished(outcome) = e.kind else {
            continue;
        };
        assert!(
            matches!(outcome, Outcome::Reply(_)),
            "unexpected outcome {outcome:?}"
        );
        let i: usize =
            e.id.split('/')
                .next()
                .and_then(|n| n.parse().ok())
                .expect("session index");
        latencies.push(sent_at[i].elapsed().as_secs_f64() * 1000.0);
        finished += 1;
        done[i] += 1;
        if done[i] < rounds {
            sent_at[i] = Instant::now();
            let text = format!("m{}", done[i]);
            submit(
                &handle,
                Message::new(&format!("{i}/{}", done[i]), keys[i].clone(), &text).expect("msg"),
            );
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let status = handle.status();
    let rss = rss_mib();
    handle.shutdown();
    drop(hang);
    reactor.join().expect("reactor run");
    let turns = s.sessions * rounds;
    let lag = status.loop_lag_ms;
    Report {
        system: "turnstile".into(),
        scenario: if coarse_timers {
            format!("{}+coarse-timers", s.name)
        } else {
            s.name.into()
        },
        sessions: s.sessions,
        rounds,
        workers: s.workers,
        delay_ms: s.delay_ms as f64,
        turns,
        seconds: round(seconds, 3),
        turns_per_s: round(turns as f64 / seconds, 1),
        latency_ms: summarize(&mut latencies).rounded(3),
        ack_latency_ms: None,
        loop_lag_ms: Some(
            Percentiles {
                p50: lag.p50,
                p99: lag.p99,
                max: lag.max,
            }
            .rounded(3),
        ),
        rss_mib: round(rss, 1),
    }
}

fn submit(handle: &turnstile::Handle, mut msg: Message) {
    // Closed loop: at most one message per session is outstanding, far below the ingress cap;
    // still, a full ingress is retried rather than counted as sent.
    loop {
        match handle.submit(msg) {
            Ok(()) => return,
            Err(turnstile::SubmitError::Backpressure(m)) => {
                msg = m;
                std::thread::yield_now();
            }
            Err(e) => panic!("submit failed: {e}"),
        }
    }
}

fn wait_finished(events: &Receiver<turnstile::MessageEvent>, id: &str) {
    loop {
        let e = events
            .recv_timeout(Duration::from_secs(30))
            .expect("progress");
        if &*e.id == id && matches!(e.kind, EventKind::Finished(_)) {
            return;
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick =
        args.iter().any(|a| a == "--quick") || std::env::var_os("TURNSTILE_BENCH_QUICK").is_some();
    // Poll timeouts alone (millisecond granularity) instead of the timerfd, for comparison.
    let coarse = args.iter().any(|a| a == "--coarse-timers");
    let filters: Vec<&String> = args.iter().filter(|a| !a.starts_with('-')).collect();
    // An untimed warm-up, so the first scenario does not pay for thread start-up, page faults
    // and allocator growth that later ones get for free.
    run(&SCENARIOS[0], 50, coarse);
    for s in &SCENARIOS {
        if !filters.is_empty() && !filters.iter().any(|f| s.name.contains(f.as_str())) {
            continue;
        }
        let rounds = if quick { s.quick_rounds } else { s.rounds };
        let report = run(s, rounds, coarse);
        println!("{}", serde_json::to_string(&report).expect("json"));
    }
}
