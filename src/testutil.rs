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

/// The first `n` of `items` under `scripts/sanitize` (`NNFUSE_UNDER_SANITIZER=1`), else all.
/// racecheck's host memory grows with every instrumented launch: the full Winograd grids took
/// 177 GB to over 500 GB per process on the H100/H200 machines (killed by the OOM killer,
/// docs/RELIABILITY.md), while their first shapes already run every kernel variant.
pub(crate) fn sanitizer_subset<T>(mut items: Vec<T>, n: usize) -> Vec<T> {
    if std::env::var("NNFUSE_UNDER_SANITIZER").is_ok_and(|v| v == "1") {
        items.truncate(n);
    }
    items
}

/// SplitMix64 random numbers.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    /// A seed that differs between runs (printed for reproduction): `NNFUSE_TEST_SEED=<seed>`
    /// replays a failure's inputs.
    pub(crate) fn fresh(tag: &str) -> Self {
        let replay = std::env::var("NNFUSE_TEST_SEED")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok());
        let t = replay.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
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

/// `n` values uniform in `[0, 1)` from xorshift64 (shifts 13, 7, 17): the generator of the
/// direct and im2col tests, which their expected values were computed with.
pub(crate) fn xorshift_unit(seed: u64, n: usize) -> impl Iterator<Item = f64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n).map(move |_| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64
    })
}

/// `n` values uniform in `[-1, 1)` from [`xorshift_unit`].
pub(crate) fn xorshift_values(seed: u64, n: usize) -> Vec<f64> {
    xorshift_unit(seed, n).map(|u| u * 2.0 - 1.0).collect()
}

/// `n` values uniform in `[0, 1)` from xorshift64* (shifts 12, 25, 27): the generator of the
/// f64 references' and the Winograd emulators' tests.
pub(crate) fn xorshift_star_unit(seed: u64, n: usize) -> impl Iterator<Item = f64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n).map(move |_| {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        (s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    })
}

/// `n` values uniform in `[-1, 1)` from [`xorshift_star_unit`].
pub(crate) fn xorshift_star_values(seed: u64, n: usize) -> Vec<f64> {
    xorshift_star_unit(seed, n).map(|u| u * 2.0 - 1.0).collect()
}

/// A square `r`×`r` convolution on an `h`×`h` input: stride 1, dilation 1, padding `r / 2`
/// (the output keeps the input's size for odd `r`).
pub(crate) fn square_conv(
    n: usize,
    c_in: usize,
    h: usize,
    c_out: usize,
    r: usize,
    format: crate::TensorFormat,
) -> crate::conv::ConvShape {
    crate::conv::ConvShape::square(n, c_in, h, c_out, r, format)
}

/// A 3×3 NHWC convolution, stride 1, dilation 1, padding `pad`: the shape of the Winograd
/// tests.
pub(crate) fn winograd_shape(
    n: usize,
    c_in: usize,
    c_out: usize,
    h: usize,
    w: usize,
    pad: (usize, usize),
) -> crate::conv::ConvShape {
    crate::conv::ConvShape {
        w,
        pad,
        ..square_conv(n, c_in, h, c_out, 3, crate::TensorFormat::Nhwc)
    }
}

/// `file` compiled for compute_80 (needs NVRTC), as text.
pub(crate) fn ptx_of(file: &crate::kernels::KernelFile) -> String {
    match crate::kernels::compile(file, "compute_80").unwrap() {
        crate::kernels::Image::Ptx(b) | crate::kernels::Image::Cubin(b) => {
            String::from_utf8_lossy(&b).into_owned()
        }
    }
}

/// The kernels a PTX text defines (each `.visible .entry` line, from the kernel's name on).
pub(crate) fn ptx_entries(ptx: &str) -> Vec<&str> {
    ptx.lines()
        .filter_map(|l| l.trim().strip_prefix(".visible .entry "))
        .collect()
}

/// Values exactly representable in f16, bf16 and f32 (multiples of 1/256 in [-1, 1], never
/// 0), so one f64 reference serves every type.
pub(crate) fn exact_values(rng: &mut Rng, n: usize) -> Vec<f64> {
    (0..n)
        .map(|_| {
            let v = (rng.uniform(-1.0, 1.0) * 256.0).round() / 256.0;
            if v == 0.0 {
                1.0 / 256.0
            } else {
                v
            }
        })
        .collect()
}

/// [`square_conv`] in NHWC.
pub(crate) fn square_nhwc(
    n: usize,
    c_in: usize,
    h: usize,
    c_out: usize,
    r: usize,
) -> crate::conv::ConvShape {
    square_conv(n, c_in, h, c_out, r, crate::TensorFormat::Nhwc)
}
