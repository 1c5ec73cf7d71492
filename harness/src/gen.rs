//! Seeded random inputs shared by the op tests, `csa2 check` and the benchmarks.

use rand::SeedableRng;
use rand_distr::{Distribution, Normal};

/// The seeded generator every op test uses.
pub type Rng = rand::rngs::StdRng;

/// Extension: `Rng::new(seed)`.
pub trait NewRng {
    /// A generator seeded with `seed`.
    fn new(seed: u64) -> Self;
}
impl NewRng for Rng {
    fn new(seed: u64) -> Self {
        rand::rngs::StdRng::seed_from_u64(seed)
    }
}

/// `n` values from N(0, std²).
pub fn rand_normal(rng: &mut Rng, n: usize, std: f32) -> Vec<f32> {
    let d = Normal::new(0.0f32, std).expect("finite std");
    (0..n).map(|_| d.sample(rng)).collect()
}
