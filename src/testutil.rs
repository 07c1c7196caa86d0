//! Helpers for the crate's own unit tests (GPU unit tests of `pub(crate)` launchers among them):
//! a GPU Context, deterministic random data and relative-error comparison, as `tests/common`
//! offers the integration tests.
#![allow(dead_code)]

use crate::{Config, Context, Element};

/// Device 0 with the default configuration. GPU unit tests are `#[ignore = "needs a CUDA GPU"]`,
/// so a missing GPU is a loud failure when they are asked for.
pub(crate) fn gpu() -> Context {
    gpu_with(Config::default())
}

/// Device 0 with `config`.
pub(crate) fn gpu_with(config: Config) -> Context {
    Context::with_config(0, config).unwrap_or_else(|e| panic!("GPU test needs a CUDA device: {e}"))
}

/// SplitMix64 random numbers.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    /// A seed that differs between runs (printed for reproduction).
    pub(crate) fn fresh(tag: &str) -> Self {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        eprintln!("[{tag}] seed = {t}");
        Rng::new(t)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[lo, hi)`.
    pub(crate) fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64)
    }

    /// `n` values uniform in `[lo, hi)`, rounded to `T`.
    pub(crate) fn vec<T: Element>(&mut self, n: usize, lo: f64, hi: f64) -> Vec<T> {
        (0..n).map(|_| T::from_f64(self.uniform(lo, hi))).collect()
    }
}

/// Widens to f64.
pub(crate) fn f64s<T: Element>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

/// `‖got − want‖₂ / ‖want‖₂`; NaN anywhere gives NaN (which fails every `<=`).
pub(crate) fn rel_l2(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "length mismatch");
    let (mut num, mut den) = (0.0, 0.0);
    for (g, w) in got.iter().zip(want) {
        num += (g - w) * (g - w);
        den += w * w;
    }
    (num / den.max(1e-30)).sqrt()
}
