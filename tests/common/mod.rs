//! Shared helpers for the integration tests: a GPU Context, random data, comparisons.
#![allow(dead_code)]

pub mod bn;

use cudarc::driver::CudaSlice;
use nnfuse::conv::ConvPath;
use nnfuse::{Config, Context, DType, Element};

/// Opens device 0 with `config`. GPU tests are `#[ignore]`d, so they only run when asked
/// (`--include-ignored`, as `.gpu/run` does): a missing GPU then is a failure, loudly.
pub fn gpu_with(config: Config) -> Context {
    Context::with_config(0, config).unwrap_or_else(|e| panic!("GPU test needs a CUDA device: {e}"))
}

/// Opens device 0 with the default configuration (ignoring the environment, so that tests are
/// reproducible whatever variables the runner has set).
pub fn gpu() -> Context {
    gpu_with(Config::default())
}

/// Copies `v` to a new device buffer.
pub fn upload<T: Element>(ctx: &Context, v: &[T]) -> CudaSlice<T> {
    ctx.stream().clone_htod(v).expect("upload")
}

/// Copies `b` back to the host.
pub fn download<T: Element>(ctx: &Context, b: &CudaSlice<T>) -> Vec<T> {
    ctx.stream().clone_dtoh(b).expect("download")
}

/// A buffer of `n` NaN (so an element a kernel never writes shows).
pub fn poisoned<T: Element>(ctx: &Context, n: usize) -> CudaSlice<T> {
    let mut b = ctx.stream().alloc_zeros::<T>(n).expect("alloc");
    nnfuse::internals::util::fill(ctx, &mut b, T::from_f64(f64::NAN)).expect("fill");
    b
}

/// The tolerance a convolution route is held to against f64.
pub fn conv_tolerance(path: ConvPath, dtype: DType) -> f64 {
    // Winograd's own rounding (every stage rounds to the data type) is documented per tile and
    // type: reference::winograd::error_bound (bf16 F(4x4) reaches ~3e-2, beyond 1e-2).
    match path.winograd_tile() {
        Some(tile) => nnfuse::reference::winograd::error_bound(dtype, tile).max(dtype.tolerance()),
        None => dtype.tolerance(),
    }
}

/// A square `r`×`r` convolution on an `h`×`h` input: stride 1, dilation 1, padding `r / 2`
/// (the output keeps the input's size for odd `r`).
pub fn square_conv(
    n: usize,
    c_in: usize,
    h: usize,
    c_out: usize,
    r: usize,
    format: nnfuse::TensorFormat,
) -> nnfuse::conv::ConvShape {
    nnfuse::conv::ConvShape::square(n, c_in, h, c_out, r, format)
}

/// ResNet-50's stem at batch `n`: 7x7/2 over 3 channels, 224x224 → 64, padding 3, channels-last
/// (the few-channel kernels' reference problem).
pub fn resnet_stem(n: usize) -> nnfuse::conv::ConvShape {
    nnfuse::conv::ConvShape {
        stride: (2, 2),
        ..nnfuse::conv::ConvShape::square(n, 3, 224, 64, 7, nnfuse::TensorFormat::Nhwc)
    }
}

/// For a result computed with f32 accumulation and rounded once to `T`: the relative L2 error of
/// rounding the exact `want` to `T` itself, and the bound such a result is held to — 1.5x that
/// (+1e-5), at most `path`'s tolerance. The dtype tolerance alone would not show f32
/// accumulation.
pub fn rounding_bound<T: Element>(want: &[f64], path: ConvPath) -> (f64, f64) {
    let (mut num, mut den) = (0.0, 0.0);
    for &w in want {
        let d = T::from_f64(w).to_f64() - w;
        num += d * d;
        den += w * w;
    }
    let floor = (num / den.max(1e-30)).sqrt();
    (
        floor,
        (1.5 * floor + 1e-5).min(conv_tolerance(path, T::DTYPE)),
    )
}

/// Whether two runs' outputs are bit for bit the same.
pub fn same_bits<T: Element>(a: &[T], b: &[T]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.to_f64().to_bits() == y.to_f64().to_bits())
}

/// SplitMix64: small, deterministic per seed, good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    /// A seed that differs between runs (fresh inputs every time), printed for reproduction:
    /// `NNFUSE_TEST_SEED=<seed>` replays a failure's inputs.
    pub fn fresh(tag: &str) -> Self {
        let replay = std::env::var("NNFUSE_TEST_SEED")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok());
        let t = replay.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
        eprintln!(
            "[{tag}] seed = {t}{}",
            if replay.is_some() {
                " (NNFUSE_TEST_SEED)"
            } else {
                ""
            }
        );
        Rng::new(t)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64)
    }
    /// `n` values uniform in [lo, hi), rounded to `T`.
    pub fn vec<T: Element>(&mut self, n: usize, lo: f64, hi: f64) -> Vec<T> {
        (0..n).map(|_| T::from_f64(self.uniform(lo, hi))).collect()
    }
}

/// Widens to f64.
pub fn f64s<T: Element>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

/// ‖got − want‖₂ / ‖want‖₂ (with a floor so an all-zero reference compares absolutely).
/// NaN anywhere gives NaN (which fails every `<=` check).
pub fn rel_l2(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "length mismatch");
    let mut num = 0.0;
    let mut den = 0.0;
    for (g, w) in got.iter().zip(want) {
        num += (g - w) * (g - w);
        den += w * w;
    }
    (num / den.max(1e-30)).sqrt()
}

/// Half the spacing of `dt`'s subnormal numbers: the most that rounding an exact result below
/// the smallest normal number (f16: 6.1e-5) moves it. A result made of such tiny values (e.g. a
/// BatchNorm dx at two values per channel, which cancels to eps/var of its terms) cannot be
/// closer to the f64 reference than this, whatever the kernel's arithmetic.
pub fn half_subnormal_step(dt: nnfuse::DType) -> f64 {
    match dt {
        nnfuse::DType::F32 => 2f64.powi(-150),
        nnfuse::DType::F16 => 2f64.powi(-25),
        nnfuse::DType::BF16 => 2f64.powi(-134),
    }
}

/// [`assert_close`] for an output stored in `dt`: `tol` plus the relative L2 size of rounding
/// every element by up to [`half_subnormal_step`] (negligible unless the values are tiny).
pub fn assert_close_stored(what: &str, dt: nnfuse::DType, got: &[f64], want: &[f64], tol: f64) {
    let norm = want.iter().map(|w| w * w).sum::<f64>().sqrt();
    let floor = half_subnormal_step(dt) * (want.len() as f64).sqrt() / norm.max(1e-300);
    assert_close(what, got, want, tol + floor);
}

/// Per-channel maximum relative error (a non-finite value: infinite).
pub fn max_rel(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "max_rel: lengths differ");
    got.iter()
        .zip(want)
        .map(|(g, w)| {
            if g.is_finite() {
                (g - w).abs() / w.abs().max(1e-300)
            } else {
                f64::INFINITY
            }
        })
        .fold(0.0, f64::max)
}

/// Panics with context when `rel_l2(got, want) > tol` or the result has a NaN/inf.
pub fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    let e = rel_l2(got, want);
    let bad = got.iter().position(|v| !v.is_finite());
    assert!(
        bad.is_none() && e <= tol,
        "{what}: relative L2 error {e:.3e} > {tol:.1e} (first non-finite at {bad:?}); \
         first values got {:?} want {:?}",
        &got[..got.len().min(4)],
        &want[..want.len().min(4)]
    );
}

/// The `nnfuse` binary: cargo's build path, or, where the tests were built on another machine
/// and staged (`scripts/gpu-stage --bins`), the staged copy in `.gpu/bin/exe/`.
pub fn nnfuse_binary() -> std::path::PathBuf {
    let built = std::path::PathBuf::from(env!("CARGO_BIN_EXE_nnfuse"));
    if built.exists() {
        return built;
    }
    let staged = [".gpu/bin/exe/nnfuse", ".gpu/bin/exe/nnfuse.bin.nnfuse"]
        .into_iter()
        .map(std::path::PathBuf::from)
        .find(|p| p.exists());
    staged.unwrap_or_else(|| {
        panic!(
            "the nnfuse binary is neither at {} nor staged in .gpu/bin/exe/ (scripts/gpu-stage \
             --bins)",
            built.display()
        )
    })
}

/// Runs the `nnfuse` binary with `args`: nnfuse's variables and `also_cleared` removed from the
/// environment, then `env` set (in order, so a later pair wins).
pub fn run_nnfuse(
    args: &[&str],
    also_cleared: &[&str],
    env: &[(&str, &str)],
) -> std::process::Output {
    let mut cmd = std::process::Command::new(nnfuse_binary());
    cmd.args(args);
    for var in nnfuse::config::ALL_VARS.iter().chain(also_cleared) {
        cmd.env_remove(var);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("the nnfuse binary runs")
}

/// The stdout of `nnfuse plan ARGS` (run as `out`), which must have succeeded, parsed as
/// exactly one JSON object.
pub fn plan_json(args: &[&str], out: &std::process::Output) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "nnfuse plan {args:?} failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("stdout is not one JSON value ({e}):\n{stdout}"));
    assert!(v.is_object(), "{v}");
    v
}

/// Exit code 2, a message on stderr that names `what`, nothing on stdout.
pub fn exits_2_naming(out: &std::process::Output, what: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    assert!(stderr.contains(what), "stderr should name {what}: {stderr}");
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// A fresh folder under the system's temporary folder (each test file names and makes its own),
/// removed on drop.
pub struct TempDir(pub std::path::PathBuf);

impl TempDir {
    /// The names of the folder's entries, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Whether the test runs under `scripts/sanitize` (compute-sanitizer slows every call 10-100x):
/// bounds on host wall time are skipped there, nothing else.
pub fn under_sanitizer() -> bool {
    std::env::var("NNFUSE_UNDER_SANITIZER").is_ok_and(|v| v == "1")
}
