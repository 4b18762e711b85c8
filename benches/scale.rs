//! Scale and memory of the session table: bytes per session at 10^6 sessions (RSS delta,
//! each case in a fresh child process so freed memory cannot hide a cost), and the
//! per-message cost of the core at 10^3 vs 10^6 sessions.
//!
//! `cargo bench --bench scale` (add `-- --quick` for 10^5 instead of 10^6).

use std::process::Command;
use std::time::{Duration, Instant};

use turnstile::CoreConfig;
use turnstile::internal::core::{Core, Effect, Input, TurnResult};
// The workload helpers belong to the binary (loadgen); the benches share the file.
#[allow(dead_code)]
#[path = "../src/cli/workload.rs"]
mod workload;
use turnstile::{Agent, CancelToken, EchoAgent, Message, SessionKey, TurnError, TurnInput};
use workload::{round, rss_mib};

type AgentCore = Core<(), Box<dyn Agent>>;

/// An agent of no size: boxing it allocates nothing, so a case caching it measures what the
/// runtime holds per session and not the agent (issue 21's goal excludes the agent).
struct NullAgent;

impl Agent for NullAgent {
    fn turn(&mut self, input: &TurnInput<'_>, _: &CancelToken) -> Result<String, TurnError> {
        Ok(input.text.to_owned())
    }
}

/// Which agent a turn with none creates.
#[derive(Clone, Copy)]
enum Make {
    Echo,
    Null,
}

impl Make {
    fn agent(self) -> Box<dyn Agent> {
        match self {
            Make::Echo => Box::new(EchoAgent::default()),
            Make::Null => Box::new(NullAgent),
        }
    }
}

fn cfg(cached: usize, workers: usize) -> CoreConfig {
    CoreConfig {
        turn_workers: workers,
        max_cached_agents: cached,
        ..CoreConfig::default()
    }
}

fn key(i: usize) -> SessionKey {
    SessionKey::dm("telegram", &(1_000_000_000 + i).to_string()).expect("key")
}

/// Accept -> start -> complete -> reply for one message; the agent comes back to the cache,
/// and any cleanup the core asks for completes at once, as the cleanup pool would.
fn full_path(
    core: &mut AgentCore,
    fx: &mut Vec<Effect<(), Box<dyn Agent>>>,
    m: Message,
    make: Make,
) {
    core.handle(
        Duration::ZERO,
        Input::Submit {
            message: m,
            route: (),
        },
        fx,
    );
    let mut inputs = Vec::new();
    for effect in fx.drain(..) {
        match effect {
            Effect::StartTurn(mut job) => {
                let agent = job.agent.take().unwrap_or_else(|| make.agent());
                let result = TurnResult::Reply(job.input.clone().into());
                inputs.push(Input::TurnDone(job.done(Some(agent), result)));
            }
            Effect::Cleanup(job) => inputs.push(Input::CleanupDone {
                job: job.job,
                result: Ok(()),
            }),
            _ => {}
        }
    }
    while let Some(input) = inputs.pop() {
        core.handle(Duration::ZERO, input, fx);
        for effect in fx.drain(..) {
            if let Effect::Cleanup(job) = effect {
                inputs.push(Input::CleanupDone {
                    job: job.job,
                    result: Ok(()),
                });
            }
        }
    }
}

/// A core with `n` sessions, each having run one message through the full path.
fn populate_with(config: CoreConfig, n: usize, make: Make) -> AgentCore {
    let mut core = Core::new(config, Duration::ZERO);
    let mut fx = Vec::new();
    for i in 0..n {
        full_path(
            &mut core,
            &mut fx,
            Message::new(&format!("w{i}"), key(i), "x").expect("msg"),
            make,
        );
    }
    core
}

/// `n` idle sessions, each with a cached agent.
fn populate(n: usize) -> AgentCore {
    populate_with(cfg(n, 64), n, Make::Echo)
}

/// Child process: builds one case and prints the RSS delta per session.
fn child(case: &str, n: usize) {
    let before = rss_mib();
    let (sessions, core_cached) = match case {
        "cached-agent" => {
            let core = populate(n);
            let s = core.stats();
            (s.sessions.total, Some(core))
        }
        "cached-zero-size-agent" => {
            let core = populate_with(cfg(n, 64), n, Make::Null);
            let s = core.stats();
            (s.sessions.total, Some(core))
        }
        "waiting-no-agent" => {
            // One worker: every session but one holds a queued message and no agent.
            let mut core: AgentCore = Core::new(cfg(0, 1), Duration::ZERO);
            let mut fx = Vec::new();
            for i in 0..n {
                let m = Message::new(&format!("w{i}"), key(i), "x").expect("msg");
                core.handle(
                    Duration::ZERO,
                    Input::Submit {
                        message: m,
                        route: (),
                    },
                    &mut fx,
                );
                fx.clear();
            }
            let s = core.stats();
            (s.sessions.total, Some(core))
        }
        "idle-no-agent" => {
            // No cache: a session with no work and no agent gives its slot back.
            let core = populate_with(cfg(0, 64), n, Make::Echo);
            let s = core.stats();
            (s.sessions.total, Some(core))
        }
        _ => panic!("unknown case {case}"),
    };
    let after = rss_mib();
    let per = if sessions == 0 {
        0.0
    } else {
        (after - before) * 1024.0 * 1024.0 / sessions as f64
    };
    println!(
        "{}",
        serde_json::json!({"case": case, "requested": n, "sessions_holding_a_slot": sessions,
            "rss_delta_mib": round(after - before, 1), "bytes_per_session": round(per, 0)})
    );
    drop(core_cached);
}

/// Mean cost of one message's full path with `n` sessions. Each message is built in the
/// timed loop, as a bridge parses it just before submitting (so it is hot in cache, like a
/// real arrival); sessions are visited in a scattered order, as real traffic does.
fn per_message_ns(n: usize, messages: usize) -> f64 {
    let mut core = populate(n);
    let mut fx = Vec::with_capacity(16);
    let start = Instant::now();
    for j in 0..messages {
        let i = (j.wrapping_mul(2_654_435_761)) % n;
        let m = Message::new(&format!("m{j}"), key(i), "hello").expect("msg");
        full_path(&mut core, &mut fx, m, Make::Echo);
    }
    start.elapsed().as_nanos() as f64 / messages as f64
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(pos) = args.iter().position(|a| a == "--child") {
        let case = &args[pos + 1];
        let n: usize = args[pos + 2].parse().expect("count");
        child(case, n);
        return;
    }
    if let Some(pos) = args.iter().position(|a| a == "--per-message") {
        let n: usize = args[pos + 1].parse().expect("session count");
        println!(
            "{{\"sessions\":{n},\"ns_per_message\":{:.1}}}",
            per_message_ns(n, 1_000_000)
        );
        return;
    }
    let quick = args.iter().any(|a| a == "--quick");
    let big = if quick { 100_000 } else { 1_000_000 };
    let exe = std::env::current_exe().expect("own path");
    for case in [
        "cached-agent",
        "cached-zero-size-agent",
        "waiting-no-agent",
        "idle-no-agent",
    ] {
        let out = Command::new(&exe)
            .args(["--child", case, &big.to_string()])
            .output()
            .expect("child");
        print!("{}", String::from_utf8_lossy(&out.stdout));
    }
    let messages = if quick { 200_000 } else { 1_000_000 };
    let small = per_message_ns(1_000, messages);
    let large = per_message_ns(big, messages);
    println!(
        "{}",
        serde_json::json!({"case": "per-message full path in the core", "messages": messages,
            "ns_at_1e3_sessions": round(small, 1), "ns_at_large_sessions": round(large, 1),
            "large_sessions": big, "ratio": round(large / small, 2)})
    );
}
