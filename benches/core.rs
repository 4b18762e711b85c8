//! Criterion micro-benchmarks of the sans-IO core: one message's full path, session lookup
//! at 10^6 sessions, timer insert and fire, the turn-id maps' hashers.

use std::collections::HashMap;
use std::hint::black_box;
use std::time::Duration;

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use turnstile::internal::core::{Core, Effect, Input, TurnResult};
use turnstile::internal::core::{IdHasher, TimerQueue};
use turnstile::{CoreConfig, TurnId};
use turnstile::{Message, SessionKey};

type BenchCore = Core<(), u32>;

fn config(cached: usize) -> CoreConfig {
    CoreConfig {
        turn_workers: 64,
        max_cached_agents: cached,
        ..CoreConfig::default()
    }
}

/// Runs one message through the core: accept, start, complete, reply. Returns the effects seen.
fn one_message(
    core: &mut BenchCore,
    fx: &mut Vec<Effect<(), u32>>,
    message: Message,
    now: Duration,
) -> usize {
    core.handle(now, Input::Submit { message, route: () }, fx);
    let mut n = fx.len();
    let job = fx.drain(..).find_map(|e| match e {
        Effect::StartTurn(job) => Some(job),
        _ => None,
    });
    if let Some(mut job) = job {
        let agent = job.agent.take().unwrap_or(0);
        let result = TurnResult::Reply(job.input.clone().into());
        let done = Input::TurnDone(job.done(Some(agent), result));
        core.handle(now, done, fx);
        n += fx.len();
        fx.clear();
    }
    n
}

/// A core holding `n` idle sessions, each with a cached agent.
pub fn populated(n: usize) -> (BenchCore, Vec<SessionKey>) {
    let mut core = Core::new(config(n), Duration::ZERO);
    let mut fx = Vec::new();
    let keys: Vec<SessionKey> = (0..n)
        .map(|i| SessionKey::dm("bench", &i.to_string()).expect("key"))
        .collect();
    for (i, k) in keys.iter().enumerate() {
        let m = Message::new(&format!("warm{i}"), k.clone(), "x").expect("msg");
        one_message(&mut core, &mut fx, m, Duration::ZERO);
    }
    (core, keys)
}

fn bench_full_path(c: &mut Criterion) {
    let (mut core, keys) = populated(1);
    let mut fx = Vec::with_capacity(16);
    c.bench_function(
        "core: one message accept -> start -> complete -> reply",
        |b| {
            b.iter_batched(
                || Message::new("m", keys[0].clone(), "hello").expect("msg"),
                |m| black_box(one_message(&mut core, &mut fx, m, Duration::ZERO)),
                BatchSize::SmallInput,
            )
        },
    );
}

fn bench_lookup(c: &mut Criterion) {
    let (core, keys) = populated(1_000_000);
    let mut i: usize = 0;
    c.bench_function("core: session lookup at 10^6 sessions", |b| {
        b.iter(|| {
            // A multiplicative step visits the keys in a cache-unfriendly order.
            i = (i + 618_033) % keys.len();
            black_box(core.session(&keys[i]).map(|v| v.slot))
        })
    });
}

fn bench_timers(c: &mut Criterion) {
    let mut q: TimerQueue<u64> = TimerQueue::default();
    let mut now = Duration::ZERO;
    for i in 0..10_000u64 {
        q.insert(Duration::from_micros(i * 100), i);
    }
    let mut seq = 10_000u64;
    c.bench_function("timers: insert + fire at 10^4 pending", |b| {
        b.iter(|| {
            seq += 1;
            now += Duration::from_micros(100);
            q.insert(now + Duration::from_secs(1), seq);
            black_box(q.pop_due(now))
        })
    });
}

/// The maps keyed by turn ids (claimed turns, tickets, start times) see one insert and one
/// remove per turn, with about `turn_workers` entries: SipHash against the core's one
/// multiply (issue 21 §5).
fn bench_id_maps(c: &mut Criterion) {
    fn run<S: std::hash::BuildHasher + Default>(c: &mut Criterion, name: &str) {
        let mut map: HashMap<TurnId, u64, S> = HashMap::default();
        for i in 0..64 {
            map.insert(TurnId(i), i);
        }
        let mut next = 64u64;
        c.bench_function(name, |b| {
            b.iter(|| {
                map.insert(TurnId(next), next);
                let gone = map.remove(&TurnId(next - 64));
                next += 1;
                black_box(gone)
            })
        });
    }
    run::<std::collections::hash_map::RandomState>(
        c,
        "id map: insert + remove at 64 in flight, SipHash",
    );
    run::<std::hash::BuildHasherDefault<IdHasher>>(
        c,
        "id map: insert + remove at 64 in flight, IdHasher",
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = bench_full_path, bench_lookup, bench_timers, bench_id_maps
}
criterion_main!(benches);
