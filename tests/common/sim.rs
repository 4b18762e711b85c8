//! What the two deterministic simulations share (tests/simulation.rs, its cluster mode in
//! tests/simulation_cluster.rs): the seeded generator, the environment knobs, a panic's text.

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
