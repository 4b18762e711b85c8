//! What the two deterministic simulations share (tests/simulation.rs, its cluster mode in
//! tests/simulation_cluster.rs): the seeded generator, the environment knobs, a panic's text,
//! the core's settings and a result line's comparable form.

use std::time::Duration;

use serde_json::Value;
use turnstile::CoreConfig;

/// xorshift64*: one seed drives every choice of a run.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    /// True with probability `p` percent.
    pub fn chance(&mut self, p: u64) -> bool {
        self.below(100) < p
    }
}

/// A numeric environment knob (`TURNSTILE_SIM_SEED`, `TURNSTILE_SIM_SEEDS`).
pub fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// The message of a caught panic (a `debug_assert!` of the real code, an `expect`).
pub fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

pub fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// The core's settings in both simulations: small, so that bounds are reached.
pub fn core_config() -> CoreConfig {
    CoreConfig {
        turn_workers: 2,
        queue_cap: 8,
        max_queued_messages: 24,
        turn_timeout: Duration::from_secs(20),
        stop_grace: Duration::from_secs(1),
        drain_timeout: Duration::from_secs(5),
        cleanup_timeout: Duration::from_secs(5),
        ..CoreConfig::default()
    }
}

/// A result line without its `redelivery` mark: two deliveries of one result compare equal.
pub fn canonical(v: &Value) -> String {
    let mut plain = v.clone();
    if let Some(o) = plain.as_object_mut() {
        o.remove("redelivery");
    }
    plain.to_string()
}
