//! The tuner: times the cuBLAS default and cuBLASLt's heuristic candidates (plus the explicit
//! cuBLAS algorithms on GPUs older than sm_80) on the real shape, against each other, and keeps
//! the default unless a candidate that computes the same result is clearly faster.
//!
//! # Steps
//! 1. **Setup** (one-off, reported apart as [`SearchReport::setup_ms`]): the search's kernels
//!    (NVRTC-compiled at the process's first search), the cuBLAS and cuBLASLt handles and the
//!    cuBLASLt workspace of the Context (created at their first use), and a heuristic query for
//!    a tiny problem of the same kind, the handle's first for that kind (one-off library costs:
//!    [`SearchReport::setup_first_query_ms`]).
//! 2. **Prepare**: cuBLASLt's descriptors for the problem are built **once**
//!    ([`super::lt::Plan`]) and shared by every cuBLASLt candidate of the heuristic query; each
//!    candidate is checked with `cublasLtMatmulAlgoCheck`, its workspace and its alignment
//!    needs. Then the operands ("Search operands" below), in the Context's scratch: one
//!    grow-only device allocation kept between searches (`scratch.rs`), so that only a search
//!    that needs more memory than every earlier one on the Context allocates
//!    ([`SearchReport::allocated_bytes`], [`SearchPhases::alloc_ms`]);
//!    [`super::release_search_scratch`] frees it.
//! 3. **Check**: the default runs into the reference C; every other candidate runs once into the
//!    candidates' C and is compared with it on the device (relative L2 within
//!    [`super::tolerance`]; non-finite values only where the default has the same ones). All
//!    comparisons are queued and read back with one synchronisation (on the caller's operands,
//!    one more before them: see below). This run is also each candidate's warm-up.
//! 4. **Time**: [`crate::timing::time_interleaved`] with [`search_timing`]: candidates take turns
//!    round-robin, a sample being a burst of back-to-back launches worth at least
//!    [`MIN_SAMPLE_MS`] of GPU time (one launch for long GEMMs); [`MIN_ROUNDS`] to [`MAX_ROUNDS`]
//!    rounds, as many as fit [`BUDGET_MS`] of GPU time. A launch is what a call of
//!    [`super::strided_batched`] queues for that algorithm (cached descriptors, one
//!    `cublasLtMatmul`), so that when the host is the bottleneck (tiny GEMMs) its cost is
//!    measured too.
//! 5. **Decide** ([`beats_default`]): the cuBLAS default is kept unless a candidate's per-round
//!    time ratio to the default has a median of at most `1 - KEEP_DEFAULT_MARGIN` (2 % faster)
//!    **and** a 90th percentile below 1 (faster in about nine rounds out of ten, in every round
//!    when there are six or fewer). Among the candidates that pass, the lowest median ratio
//!    wins. The ratios pair samples taken milliseconds apart, so clock and thermal drift cancel;
//!    the margin keeps an equal kernel from replacing the default on noise.
//!
//! # Search operands
//! - **The caller's** (the first [`super::strided_batched`] call of a key,
//!   [`super::search_on`]): A and B are read where they are, never written or copied. With
//!   beta == 0 the default writes its result into the caller's C (the tuned call that follows
//!   overwrites it) and the candidates write one scratch C (which gets the caller's C once when C
//!   has gaps, so that the gaps compare equal); with beta != 0 C is an input, so the reference
//!   and each candidate start from a copy of the caller's C in the scratch, and the caller's C is
//!   not written. Scratch: one C (beta == 0) or two.
//!
//!   Before any candidate runs, the default's result is looked at on the device (one reduction
//!   over C's matrix elements, [`ResultStats`], read back with one synchronisation), and the
//!   caller's data is used only if it can tell a wrong result from a right one
//!   ([`caller_data_unsuitable`]): the result is finite everywhere (no NaN or Inf in A, B, or C
//!   when beta != 0, and no overflow), at least [`MIN_NONZERO_FRACTION`] of it is nonzero, and
//!   when beta != 0 the product is at least [`MIN_PRODUCT_SHARE`] of its norm. Otherwise the
//!   search falls back to pseudo-random scratch operands, as below, and says why
//!   ([`SearchOperands::Fallback`], an `info` trace). Caller data that passes can still check
//!   less than random data in one way: structure that makes two different computations agree
//!   (a symmetric A hides a transpose, identical batches hide a batch stride). The candidates
//!   are cuBLASLt's own kernels for this exact problem description; what the check guards
//!   against is numerical difference (reduced precision, split-K reductions), which any generic
//!   data shows.
//! - **Pseudo-random scratch** (no caller buffers: [`super::search`], plain `nnfuse tune`; or the
//!   fallback): A, B and two C's (the default's reference result and the candidates' output),
//!   each placed at the key's alignment; A and B hold deterministic pseudo-random values in
//!   [-1, 1) (written only when the scratch does not already hold the same pattern at the same
//!   place from an earlier search), C the pattern too when beta != 0 (C is then an input: each
//!   candidate starts from the same C), zeros when C has gaps that no matrix covers (so that they
//!   compare equal), nothing otherwise.
//!
//! The scratch stays allocated for the Context's life (like the cuBLASLt workspace): for
//! 16 x 4096^3 f16, 512 MiB after a first call with beta == 0 on the caller's operands (one C,
//! 1 GiB with beta != 0), 2 GiB after a search on scratch operands (A, B, two C's). A process's
//! first search on scratch operands therefore allocates all of that; later ones allocate
//! nothing unless they need more.
//!
//! For a 3 ms GEMM (16 x 4096^3 f16 on an H100) with 9 candidates this is 1 reference run, 8
//! checking runs and 3 rounds of 9 single launches: about 36 launches, ~110 ms of GPU time.

use std::collections::HashSet;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::cublaslt::sys as lt_sys;
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtrMut, PushKernelArg};
use half::{bf16, f16};
use once_cell::sync::Lazy;

use super::cache::{Algo, Choice, LtConfig, Origin};
use super::cublas;
use super::lt::{self, Plan, Ptrs, Scalars, WORKSPACE_BYTES};
use super::problem::{tolerance, Alignment, Key, Problem, Spans};
use super::scratch::{self, scratch_layout, Fill, Scratch};
use crate::context::Context;
use crate::dtype::{DType, Element};
use crate::error::{CallExt, Error, Result};
use crate::timing::{time_interleaved, InterleavedOptions, Paired, Timing};
use crate::util::grid_stride_config;

/// The search's kernels (`kernels/gemm_search.cu`), NVRTC-compiled at first use.
pub use crate::kernels::GEMM_SEARCH as KERNELS;

/// Most cuBLASLt heuristic candidates a search asks for.
pub const MAX_LT_CANDIDATES: usize = 16;
/// GPU time (ms) the timed rounds of one search aim at (more rounds for short GEMMs, never fewer
/// than [`MIN_ROUNDS`]).
pub const BUDGET_MS: f64 = 80.0;
/// Fewest timed rounds (long GEMMs: a 3 ms GEMM needs no more when candidates are interleaved).
pub const MIN_ROUNDS: usize = 3;
/// Most timed rounds (short GEMMs).
pub const MAX_ROUNDS: usize = 11;
/// Least GPU time (ms) of one timing sample: shorter GEMMs are launched several times back to
/// back per sample.
pub const MIN_SAMPLE_MS: f64 = 0.1;
/// A candidate must beat the cuBLAS default by this fraction (median of the per-round time
/// ratios), and in nearly every round, to replace it: see [`beats_default`].
pub const KEEP_DEFAULT_MARGIN: f64 = 0.02;

/// How a search times its candidates (see the module documentation).
pub const fn search_timing() -> InterleavedOptions {
    InterleavedOptions {
        // The checking run before the timing is every candidate's warm-up.
        warmup_rounds: 0,
        min_sample_ms: MIN_SAMPLE_MS,
        max_burst: 256,
        min_rounds: MIN_ROUNDS,
        max_rounds: MAX_ROUNDS,
        budget_ms: BUDGET_MS,
    }
}

/// The decision rule: whether a candidate whose per-round time ratios to the cuBLAS default are
/// `vs_default` (below 1: faster) may replace the default. It must be faster by at least the
/// margin in the median round (`median <= 1 - KEEP_DEFAULT_MARGIN`) and faster in nearly every
/// round (`p90 < 1`: with the nearest-rank percentile that is every round up to 6 rounds, all but
/// one up to 16). Noise (a few percent between samples on an H100) then never trades the default
/// for an equal kernel, and a kernel that is only faster while the clocks are high does not win.
pub fn beats_default(vs_default: &Paired) -> bool {
    vs_default.rounds > 0 && vs_default.median <= 1.0 - KEEP_DEFAULT_MARGIN && vs_default.p90 < 1.0
}

/// How one candidate fared.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Agreed with the default and was timed; times are per GEMM.
    Timed {
        /// Per-GEMM statistics over the timed rounds.
        timing: Timing,
        /// Relative L2 difference from the cuBLAS default's result (0 for the default).
        rel_diff: f64,
        /// GEMMs launched back to back per sample.
        burst: usize,
        /// Per-round time ratios to the cuBLAS default (1 for the default itself).
        vs_default: Option<Paired>,
    },
    /// Not timed, and why.
    Rejected(String),
}

/// One algorithm the search considered.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// The concrete algorithm.
    pub algo: Algo,
    /// Readable attributes (cuBLASLt).
    pub config: Option<LtConfig>,
    /// Workspace bytes (cuBLASLt).
    pub workspace: usize,
    /// Position in cuBLASLt's heuristic list (informational; the choice never stores it).
    pub heuristic_rank: Option<usize>,
    /// Result.
    pub outcome: Outcome,
}

impl Candidate {
    /// Median per-GEMM time in ms, when timed.
    pub fn median_ms(&self) -> Option<f64> {
        match &self.outcome {
            Outcome::Timed { timing, .. } => Some(timing.median_ms),
            Outcome::Rejected(_) => None,
        }
    }

    /// Per-round time ratios to the cuBLAS default, when timed.
    pub fn vs_default(&self) -> Option<Paired> {
        match &self.outcome {
            Outcome::Timed { vs_default, .. } => *vs_default,
            Outcome::Rejected(_) => None,
        }
    }

    /// A short description.
    pub fn label(&self) -> String {
        label(&self.algo, &self.config, self.heuristic_rank)
    }
}

fn label(algo: &Algo, config: &Option<LtConfig>, rank: Option<usize>) -> String {
    let rank = || rank.map_or_else(|| "?".into(), |r| r.to_string());
    match (algo, config) {
        (Algo::Cublas(a), _) => format!("cuBLAS {}", a.name()),
        (Algo::Lt(_), Some(c)) => format!("cuBLASLt #{} {c}", rank()),
        (Algo::Lt(_), None) => format!("cuBLASLt #{} (attributes unreadable)", rank()),
    }
}

/// Where a search's host time went (ms).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SearchPhases {
    /// Everything before the reference run, plus the scratch preparation of a fallback to
    /// scratch operands (which happens after it): `candidates_ms`, `alloc_ms`, fills and copies
    /// queued.
    pub prepare_ms: f64,
    /// Part of `prepare_ms`: heuristic query, descriptors, `cublasLtMatmulAlgoCheck`s.
    pub candidates_ms: f64,
    /// Part of `prepare_ms`: growing the Context's scratch ([`SearchReport::allocated_bytes`];
    /// near 0 when the scratch of an earlier search sufficed).
    pub alloc_ms: f64,
    /// Reference run, one checking run per candidate, comparisons (one synchronisation; one
    /// more on the caller's operands, to look at the default's result first).
    pub check_ms: f64,
    /// Interleaved timing.
    pub timing_ms: f64,
}

/// Which operands a search ran its candidates on.
#[derive(Debug, Clone, PartialEq)]
pub enum SearchOperands {
    /// The caller's A and B (only read) and C: the first [`super::strided_batched`] call of a
    /// key, or [`super::search_on`].
    Caller,
    /// Pseudo-random operands in the Context's scratch: the search had no caller buffers
    /// ([`super::search`], `nnfuse tune`).
    Scratch,
    /// Pseudo-random scratch operands, because the caller's data could not check the candidates
    /// (see [`caller_data_unsuitable`]).
    Fallback(Unsuitable),
}

impl fmt::Display for SearchOperands {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SearchOperands::Caller => f.write_str("the caller's operands"),
            SearchOperands::Scratch => f.write_str("pseudo-random scratch operands"),
            SearchOperands::Fallback(why) => write!(
                f,
                "pseudo-random scratch operands (the caller's data was not used: {why})"
            ),
        }
    }
}

/// Statistics of the cuBLAS default's result over C's matrix elements (never its gaps),
/// computed on the device before the search trusts the caller's data.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ResultStats {
    /// Elements of C's matrices (`batch * m * n`).
    pub elements: f64,
    /// Sum of squares of the finite elements.
    pub sum_sq: f64,
    /// Non-finite elements (NaN, ±Inf).
    pub non_finite: f64,
    /// Finite, nonzero elements.
    pub nonzero: f64,
    /// Sum of squares of the product's part, `result - beta * old C`, over the finite elements
    /// (equal to `sum_sq` when beta is 0).
    pub product_sq: f64,
}

impl ResultStats {
    /// From the four device sums (`sum_sq, non_finite, nonzero, product_sq`) and the element
    /// count; missing sums read as NaN (unsuitable).
    pub fn from_sums(sums: &[f64], elements: f64) -> ResultStats {
        let at = |i: usize| sums.get(i).copied().unwrap_or(f64::NAN);
        ResultStats {
            elements,
            sum_sq: at(0),
            non_finite: at(1),
            nonzero: at(2),
            product_sq: at(3),
        }
    }
}

/// Least fraction of the default's result that must be nonzero for the caller's data to check
/// candidates: where most of the result is exactly 0 (zeroed buffers, padding), a candidate that
/// computes those elements wrongly, or skips them, could still pass.
pub const MIN_NONZERO_FRACTION: f64 = 0.5;

/// Least share of the result's norm that the product `alpha * op(A) op(B)` must have, when beta
/// is not 0, for the caller's data to check candidates: `||result - beta * C|| >= share *
/// ||result||`. Where `beta * C` dominates, an error in the product would hide under it. (The
/// pseudo-random operands give at least 0.5 too: about 0.5 at k = 1, close to 1 for large k.)
pub const MIN_PRODUCT_SHARE: f64 = 0.5;

/// Why the caller's data could not check the search's candidates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Unsuitable {
    /// The default's result has non-finite elements: NaN or Inf in A, B (or C when beta != 0),
    /// or overflow. NaN compares equal to NaN, so these elements would check nothing.
    NonFinite {
        /// How many.
        count: u64,
    },
    /// Too little of the default's result is nonzero ([`MIN_NONZERO_FRACTION`]).
    MostlyZero {
        /// Nonzero elements.
        nonzero: u64,
        /// All elements.
        elements: u64,
    },
    /// `beta * C` dominates the result ([`MIN_PRODUCT_SHARE`]).
    ProductNegligible {
        /// `||result - beta * C|| / ||result||`.
        share: f64,
    },
}

impl fmt::Display for Unsuitable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unsuitable::NonFinite { count } => write!(
                f,
                "the cuBLAS default's result has {count} non-finite elements (NaN or Inf in the                  inputs, or overflow)"
            ),
            Unsuitable::MostlyZero { nonzero, elements } => write!(
                f,
                "only {nonzero} of the {elements} elements of the cuBLAS default's result are                  nonzero (fewer than {:.0}%)",
                MIN_NONZERO_FRACTION * 100.0
            ),
            Unsuitable::ProductNegligible { share } => write!(
                f,
                "alpha * op(A) op(B) is only {share:.3} of the result's norm (beta * C                  dominates; at least {MIN_PRODUCT_SHARE} needed)"
            ),
        }
    }
}

/// The rule for searching on the caller's data: the candidates are compared with the cuBLAS
/// default on the caller's operands only when the default's result there is finite everywhere,
/// nonzero in at least [`MIN_NONZERO_FRACTION`] of its elements, and, when beta is not 0, made
/// at least [`MIN_PRODUCT_SHARE`] of the product (by norm). Otherwise the search falls back to
/// pseudo-random scratch operands and says why (this returns the reason). NaN statistics (not
/// read back) are unsuitable.
pub fn caller_data_unsuitable(s: &ResultStats) -> Option<Unsuitable> {
    if s.non_finite != 0.0 {
        return Some(Unsuitable::NonFinite {
            count: if s.non_finite.is_finite() {
                s.non_finite as u64
            } else {
                u64::MAX
            },
        });
    }
    let mostly_zero = Unsuitable::MostlyZero {
        nonzero: if s.nonzero.is_finite() {
            s.nonzero as u64
        } else {
            0
        },
        elements: s.elements as u64,
    };
    let too_few = s.nonzero.is_nan() || s.nonzero < MIN_NONZERO_FRACTION * s.elements;
    if too_few || s.sum_sq.is_nan() || s.sum_sq <= 0.0 {
        return Some(mostly_zero);
    }
    let share = (s.product_sq / s.sum_sq).sqrt();
    if share.is_nan() || share < MIN_PRODUCT_SHARE {
        return Some(Unsuitable::ProductNegligible { share });
    }
    None
}

/// Everything one search did.
#[derive(Debug, Clone, PartialEq)]
pub struct SearchReport {
    /// What was tuned.
    pub key: Key,
    /// The problem as searched (its alpha and beta).
    pub problem: Problem,
    /// Every candidate, the cuBLAS default first.
    pub candidates: Vec<Candidate>,
    /// Index of the winner in `candidates`.
    pub winner: usize,
    /// What was stored for the key.
    pub choice: Choice,
    /// Whether the explicit `cublasGemmAlgo_t` values were searched (GPUs older than sm_80).
    pub explicit_cublas: bool,
    /// Why cuBLASLt contributed no candidates, if it did not.
    pub lt_note: Option<String>,
    /// The tolerance results were compared with.
    pub tolerance: f64,
    /// Timed rounds (every timed candidate has one sample per round).
    pub rounds: usize,
    /// Host wall time of the search itself (ms): everything from the heuristic query to the
    /// decision (scratch allocation included), what the "under 200 ms per shape" target
    /// measures. One-off setup excluded.
    pub wall_ms: f64,
    /// Host wall time (ms) of the one-off setup this search paid before starting: NVRTC compile
    /// and module load of the search kernels, cuBLAS/cuBLASLt handle creation, workspace
    /// allocation, and cuBLASLt's first heuristic query (`setup_first_query_ms`). Near 0 once a
    /// search has run on the Context.
    pub setup_ms: f64,
    /// Part of `setup_ms`: a heuristic query for a tiny problem of the same kind (types,
    /// transposes), the first of the Context's cuBLASLt handle for that kind, made before the
    /// search so that one-off library costs it pays are not counted as the search's (0 when an
    /// earlier search made it).
    pub setup_first_query_ms: f64,
    /// Where `wall_ms` went.
    pub phases: SearchPhases,
    /// Which operands the candidates were checked and timed on.
    pub operands: SearchOperands,
    /// Bytes of the Context's scratch the search used (C only on the caller's operands).
    pub scratch_bytes: usize,
    /// Bytes this search allocated to grow the Context's scratch (0: an earlier search's
    /// sufficed); the time is in [`SearchPhases::alloc_ms`].
    pub allocated_bytes: usize,
}

impl SearchReport {
    /// The cuBLAS default's median (ms).
    pub fn default_ms(&self) -> Option<f64> {
        self.candidates.first().and_then(Candidate::median_ms)
    }

    /// The winner's median (ms).
    pub fn winner_ms(&self) -> Option<f64> {
        self.candidates
            .get(self.winner)
            .and_then(Candidate::median_ms)
    }
}

/// Progress of a running search (for progress bars).
#[derive(Debug, Clone, Copy)]
pub struct SearchProgress<'a> {
    /// Steps finished (one per candidate checked, one for the timing).
    pub done: usize,
    /// Steps in all.
    pub total: usize,
    /// What is being worked on (empty at the end).
    pub label: &'a str,
}

fn uniform_kernel(dt: DType) -> &'static str {
    match dt {
        DType::F32 => "gemm_uniform_f32",
        DType::F16 => "gemm_uniform_f16",
        DType::BF16 => "gemm_uniform_bf16",
    }
}

fn stats_kernel(dt: DType) -> &'static str {
    match dt {
        DType::F32 => "gemm_stats_f32",
        DType::F16 => "gemm_stats_f16",
        DType::BF16 => "gemm_stats_bf16",
    }
}

fn diff_kernel(dt: DType) -> &'static str {
    match dt {
        DType::F32 => "gemm_diff_f32",
        DType::F16 => "gemm_diff_f16",
        DType::BF16 => "gemm_diff_bf16",
    }
}

/// Fills `n` elements at device pointer `ptr` with the uniform pattern of `seed`.
fn uniform_raw(ctx: &Context, f: &CudaFunction, ptr: u64, n: usize, seed: u64) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let cfg = grid_stride_config(ctx, n, 256);
    let n64 = n as u64;
    let mut b = ctx.stream().launch_builder(f);
    b.arg(&ptr).arg(&n64).arg(&seed);
    // SAFETY: gemm_uniform_<t>(T*, u64, u64) matches; `ptr` holds n elements of the type.
    unsafe { b.launch(cfg) }.call("cuLaunchKernel(gemm_uniform)")?;
    Ok(())
}

/// Fills a buffer with deterministic pseudo-random values uniform in [-1, 1) (a function of the
/// index and `seed`).
pub fn fill_uniform<T: Element, D: DevicePtrMut<T>>(
    ctx: &Context,
    out: &mut D,
    seed: u64,
) -> Result<()> {
    let n = out.len();
    let f = ctx.function(&KERNELS, uniform_kernel(T::DTYPE))?;
    let (ptr, _sync) = out.device_ptr_mut(ctx.stream());
    uniform_raw(ctx, &f, ptr, n, seed)
}

/// Queues the comparison of `n` elements at `got` with `want`: adds (sum of squared
/// differences, sum of squares of `want`, non-finite mismatches) to the three doubles at `acc`.
fn queue_compare(
    ctx: &Context,
    f: &CudaFunction,
    got: u64,
    want: u64,
    n: usize,
    acc: u64,
) -> Result<()> {
    let cfg = grid_stride_config(ctx, n, 256);
    let n64 = n as u64;
    let mut b = ctx.stream().launch_builder(f);
    b.arg(&got).arg(&want).arg(&n64).arg(&acc);
    // SAFETY: gemm_diff_<t>(const T*, const T*, u64, double*) matches; both inputs hold n
    // elements; acc holds 3 doubles; block size 256 as the kernel requires.
    unsafe { b.launch(cfg) }.call("cuLaunchKernel(gemm_diff)")?;
    Ok(())
}

/// Queues the statistics ([`ResultStats`]) of the GEMM result at `r` over `p`'s C matrices:
/// adds them to the four doubles at `acc`. `old_c` (0: none) is the old C that `beta` scaled.
fn queue_stats(
    ctx: &Context,
    f: &CudaFunction,
    p: &Problem,
    r: u64,
    old_c: u64,
    beta: f32,
    acc: u64,
) -> Result<()> {
    let cols = p.batch * p.n;
    // One block per column, capped (grid-stride over columns).
    let cfg = grid_stride_config(ctx, cols.saturating_mul(256), 256);
    let (m, n, ld, stride, batch) = (
        p.m as u64,
        p.n as u64,
        p.ldc as u64,
        p.stride_c as u64,
        p.batch as u64,
    );
    let mut b = ctx.stream().launch_builder(f);
    b.arg(&r)
        .arg(&old_c)
        .arg(&beta)
        .arg(&m)
        .arg(&n)
        .arg(&ld)
        .arg(&stride)
        .arg(&batch)
        .arg(&acc);
    // SAFETY: gemm_stats_<t>(const T*, const T*, float, u64 x5, double*) matches; `r` (and
    // `old_c` when not 0) hold C's span of the checked problem, whose matrix elements are all
    // the kernel reads; acc holds 4 doubles; block size 256 as the kernel requires.
    unsafe { b.launch(cfg) }.call("cuLaunchKernel(gemm_stats)")?;
    Ok(())
}

/// `(relative L2 difference, non-finite mismatches)` from the three sums of [`queue_compare`].
fn judge(sums: &[f64]) -> (f64, f64) {
    match sums {
        [num, den, bad, ..] => ((num / den.max(1e-300)).sqrt(), *bad),
        _ => (f64::NAN, f64::NAN),
    }
}

/// Runs the search for a checked problem, on the caller's operands when `caller` has them (their
/// pointers as validated by the caller, with the alignment in `key`), else on scratch operands.
/// Holds the Context's lock throughout (the handles and the workspace are used by every timed
/// launch). Returns the report and, when the winner is a cuBLASLt algorithm, the problem's
/// descriptors for the cache.
pub(crate) fn run(
    ctx: &Context,
    p: &Problem,
    dtype: DType,
    key: Key,
    spans: Spans,
    caller: Option<Ptrs>,
    progress: &mut dyn FnMut(SearchProgress<'_>),
) -> Result<(SearchReport, Option<Arc<Plan>>)> {
    match dtype {
        DType::F32 => typed::<f32>(ctx, p, key, spans, caller, progress),
        DType::F16 => typed::<f16>(ctx, p, key, spans, caller, progress),
        DType::BF16 => typed::<bf16>(ctx, p, key, spans, caller, progress),
    }
}

struct Pending {
    algo: Algo,
    config: Option<LtConfig>,
    workspace: usize,
    rank: Option<usize>,
    /// Set once decided (rejected, or timed).
    outcome: Option<Outcome>,
    rel_diff: f64,
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Seeds of the pseudo-random scratch operands.
const SEED_A: u64 = 0x5eed_0001;
const SEED_B: u64 = 0x5eed_0002;
const SEED_C: u64 = 0x5eed_0003;

/// What a C region must hold before a GEMM of the search writes it.
#[derive(Debug, Clone, Copy, PartialEq)]
enum CInit {
    /// Nothing: beta is 0 and the GEMM writes every element that is compared.
    Nothing,
    /// Zeros: beta is 0 and C has gaps (compared, never written), which must compare equal.
    Zeros,
    /// The pseudo-random pattern of this seed (scratch operands, beta != 0).
    Uniform(u64),
    /// A copy of the caller's C at this pointer (its values when beta != 0, its gaps otherwise).
    Copy(u64),
}

/// Where a search's GEMMs read and write.
#[derive(Debug, Clone, Copy)]
struct Operands {
    a: u64,
    b: u64,
    /// Receives the cuBLAS default's result (the caller's own C when the search runs on the
    /// caller's operands with beta == 0).
    reference: u64,
    /// Receives each candidate's result, and every timed launch's.
    candidate: u64,
    /// How `reference` and `candidate` are initialised before a GEMM writes them.
    init: CInit,
    /// The old C (`beta * C` is the part of the result that is not the product), when it is the
    /// caller's; 0 otherwise.
    old_c: u64,
}

/// What decides where a search's operands go.
#[derive(Debug, Clone, Copy)]
struct Shape {
    dtype: DType,
    spans: Spans,
    /// The key's alignment (the caller's), which scratch regions reproduce.
    align: Alignment,
    beta_zero: bool,
    /// C's span has elements that no matrix covers (ldc > m, or gaps between matrices).
    c_has_gaps: bool,
}

/// Operands placed in the scratch: the operands, the scratch bytes they use, and the bytes
/// allocated (0: the Context's scratch was large enough) in how long.
struct Placed {
    ops: Operands,
    bytes: usize,
    allocated: usize,
    alloc_ms: f64,
}

/// Places `regions` in the scratch (growing it when needed) and forgets the recorded fills they
/// will overwrite (every region placed here is written by the search). Returns the regions'
/// pointers, the scratch bytes they use, the bytes allocated and how long that took (ms).
fn place(
    ctx: &Context,
    scratch: &mut Scratch,
    regions: &[(usize, u16)],
) -> Result<(Vec<u64>, usize, usize, f64)> {
    let (offsets, total) = scratch_layout(regions);
    let t = Instant::now();
    let (base, allocated) = scratch.ensure(ctx, total)?;
    let alloc_ms = ms_since(t);
    for (&(bytes, _), &off) in regions.iter().zip(&offsets) {
        scratch.fills.overwritten(off, bytes);
    }
    let ptrs = offsets.iter().map(|&o| base + o as u64).collect();
    Ok((ptrs, total, allocated, alloc_ms))
}

/// Pseudo-random operands in the scratch: A, B, the reference C and the candidates' C, each at
/// the key's alignment. A and B are filled with the patterns of [`SEED_A`] and [`SEED_B`] unless
/// the scratch already holds them there (an earlier search of the Context with the same layout
/// prefix); C is initialised per run (see [`CInit`]).
fn scratch_operands(
    ctx: &Context,
    scratch: &mut Scratch,
    uniform_fn: &CudaFunction,
    shape: &Shape,
) -> Result<Placed> {
    let Shape {
        dtype,
        spans,
        align,
        beta_zero,
        c_has_gaps,
    } = *shape;
    let elem = dtype.size();
    let (offsets, total) = scratch_layout(&[
        (spans.a * elem, align.a),
        (spans.b * elem, align.b),
        (spans.c * elem, align.c),
        (spans.c * elem, align.c),
    ]);
    let t = Instant::now();
    let (base, allocated) = scratch.ensure(ctx, total)?;
    let alloc_ms = ms_since(t);
    // The two C regions are written by GEMMs and initialisations: their old records go first,
    // so that a record that runs into them is not trusted for A or B.
    scratch.fills.overwritten(offsets[2], spans.c * elem);
    scratch.fills.overwritten(offsets[3], spans.c * elem);
    for (i, elems, seed) in [(0, spans.a, SEED_A), (1, spans.b, SEED_B)] {
        let want = Fill {
            offset: offsets[i],
            elems,
            dtype,
            seed,
        };
        if scratch.fills.needed(&want) {
            uniform_raw(ctx, uniform_fn, base + offsets[i] as u64, elems, seed)?;
            scratch.fills.filled(want);
        }
    }
    let init = if !beta_zero {
        CInit::Uniform(SEED_C)
    } else if c_has_gaps {
        CInit::Zeros
    } else {
        CInit::Nothing
    };
    Ok(Placed {
        ops: Operands {
            a: base + offsets[0] as u64,
            b: base + offsets[1] as u64,
            reference: base + offsets[2] as u64,
            candidate: base + offsets[3] as u64,
            init,
            old_c: 0,
        },
        bytes: total,
        allocated,
        alloc_ms,
    })
}

/// The caller's operands: A and B are read where they are; with beta == 0 the default writes
/// its result into the caller's C (which the tuned call overwrites afterwards) and only the
/// candidates' C is scratch; with beta != 0 C is an input, so both results go to scratch copies
/// of the caller's C.
fn caller_operands(
    ctx: &Context,
    scratch: &mut Scratch,
    caller: Ptrs,
    shape: &Shape,
) -> Result<Placed> {
    let Shape {
        dtype,
        spans,
        align,
        beta_zero,
        c_has_gaps,
    } = *shape;
    let c_bytes = spans.c * dtype.size();
    if beta_zero {
        let (ptrs, bytes, allocated, alloc_ms) = place(ctx, scratch, &[(c_bytes, align.c)])?;
        Ok(Placed {
            ops: Operands {
                a: caller.a,
                b: caller.b,
                reference: caller.c,
                candidate: ptrs[0],
                // The candidates' C gets the caller's gaps once, so that they compare equal.
                init: if c_has_gaps {
                    CInit::Copy(caller.c)
                } else {
                    CInit::Nothing
                },
                old_c: 0,
            },
            bytes,
            allocated,
            alloc_ms,
        })
    } else {
        let (ptrs, bytes, allocated, alloc_ms) =
            place(ctx, scratch, &[(c_bytes, align.c), (c_bytes, align.c)])?;
        Ok(Placed {
            ops: Operands {
                a: caller.a,
                b: caller.b,
                reference: ptrs[0],
                candidate: ptrs[1],
                init: CInit::Copy(caller.c),
                old_c: caller.c,
            },
            bytes,
            allocated,
            alloc_ms,
        })
    }
}

/// Initialises the C region at `ptr` (`elems` elements of `elem` bytes) as `init` says.
fn init_c(
    ctx: &Context,
    uniform_fn: &CudaFunction,
    init: CInit,
    ptr: u64,
    elems: usize,
    elem: usize,
) -> Result<()> {
    let stream = ctx.stream().cu_stream();
    match init {
        CInit::Nothing => Ok(()),
        CInit::Uniform(seed) => uniform_raw(ctx, uniform_fn, ptr, elems, seed),
        // SAFETY: `ptr` holds `elems` elements of the scratch.
        CInit::Zeros => {
            unsafe { cudarc::driver::result::memset_d8_async(ptr, 0, elems * elem, stream) }
                .call("cuMemsetD8Async")
        }
        CInit::Copy(src) if src == ptr => Ok(()),
        // SAFETY: `src` is the caller's C, validated to hold `elems` elements (its span), and
        // does not overlap the scratch region `ptr`, which holds as many.
        CInit::Copy(src) => {
            unsafe { cudarc::driver::result::memcpy_dtod_async(ptr, src, elems * elem, stream) }
                .call("cuMemcpyDtoDAsync")
        }
    }
}

/// The first heuristic query of a cuBLASLt handle for a kind of problem (data and compute type,
/// transposes) may pay one-off costs of the library (lazy initialisation) that no later search
/// pays again. A query for a tiny problem of the same kind, once per handle and kind, moves that
/// cost into the setup, where it is reported on its own ([`SearchReport::setup_first_query_ms`],
/// part of [`SearchReport::setup_ms`]); it costs microseconds when there is nothing to pay.
/// Returns its time (ms; 0 when the handle already had one).
fn first_query(h: lt_sys::cublasLtHandle_t, p: &Problem, dtype: DType) -> f64 {
    type Kind = (usize, DType, super::Compute, bool, bool);
    static DONE: Lazy<Mutex<HashSet<Kind>>> = Lazy::new(|| Mutex::new(HashSet::new()));
    let kind = (h as usize, dtype, p.compute, p.trans_a, p.trans_b);
    let mut done = match DONE.lock() {
        Ok(g) => g,
        Err(e) => e.into_inner(),
    };
    if done.contains(&kind) {
        return 0.0;
    }
    let t = Instant::now();
    let tiny = Problem::packed_trans(1, 64, 64, 64, p.trans_a, p.trans_b).with_compute(p.compute);
    // Its result does not matter (the real query follows); an error shows there too.
    if let Ok(plan) = lt::Plan::new(&tiny, dtype) {
        let _ = plan.heuristics(h, Alignment::MAX, WORKSPACE_BYTES, 1);
    }
    done.insert(kind);
    let ms = ms_since(t);
    tracing::debug!(ms, %dtype, "cuBLASLt first heuristic query of this handle and problem kind");
    ms
}

fn typed<T: Element>(
    ctx: &Context,
    p: &Problem,
    key: Key,
    spans: Spans,
    caller: Option<Ptrs>,
    progress: &mut dyn FnMut(SearchProgress<'_>),
) -> Result<(SearchReport, Option<Arc<Plan>>)> {
    let dtype = T::DTYPE;
    let elem = std::mem::size_of::<T>();

    // 1. One-off setup (cached by the Context after the first search).
    let t_setup = Instant::now();
    // Raw driver calls below (memset, memcpy) need the device current on this thread.
    ctx.cuda().bind_to_thread().call("cuCtxSetCurrent")?;
    let uniform_fn = ctx.function(&KERNELS, uniform_kernel(dtype))?;
    let diff_fn = ctx.function(&KERNELS, diff_kernel(dtype))?;
    let stats_fn = ctx.function(&KERNELS, stats_kernel(dtype))?;
    // Taken before the Context's lock (the memo has a lock of its own).
    let scratch_cell = scratch::of(ctx)?;
    let mut guard = ctx.lock()?;
    let blas = guard.cublas()?;
    let mut lt_note = None;
    let lt_handle = match guard.cublaslt() {
        Ok(h) => Some(h),
        Err(e) => {
            lt_note = Some(format!("cuBLASLt unavailable: {e}"));
            None
        }
    };
    let workspace = if lt_handle.is_some() {
        guard.workspace(WORKSPACE_BYTES)?
    } else {
        0
    };
    let setup_first_query_ms = lt_handle.map_or(0.0, |h| first_query(h, p, dtype));
    let setup_ms = ms_since(t_setup);

    // 2. Prepare: the candidates (heuristic query, descriptors, checks), then the operands.
    let start = Instant::now();
    // Held until the search ends: queued work uses the scratch.
    let mut scratch = scratch::lock(&scratch_cell);
    let align: Alignment = key.align;
    let tol = tolerance(dtype, p.compute, p.k);
    let beta_zero = p.beta == 0.0;
    // Elements of C's span that no matrix covers (ldc > m, or gaps between matrices).
    let c_has_gaps = spans.c != p.batch * p.m * p.n;

    let cc = ctx.info().compute_capability;
    let explicit_cublas = cc.0 < 8;
    let pending_of = |algo: Algo| Pending {
        algo,
        config: None,
        workspace: 0,
        rank: None,
        outcome: None,
        rel_diff: 0.0,
    };
    // The candidates: the cuBLAS default, explicit cuBLAS algorithms where they mean something,
    // then cuBLASLt's heuristic list, all sharing one set of descriptors.
    let mut pending = vec![pending_of(Algo::CUBLAS_DEFAULT)];
    if explicit_cublas {
        for a in cublas::explicit_algos(dtype) {
            pending.push(pending_of(Algo::Cublas(a)));
        }
    }
    let mut plan: Option<Arc<Plan>> = None;
    if let Some(h) = lt_handle {
        match lt::Plan::new(p, dtype) {
            Ok(pl) => match pl.heuristics(h, align, WORKSPACE_BYTES, MAX_LT_CANDIDATES) {
                Ok(list) => {
                    if list.is_empty() {
                        lt_note =
                            Some("cublasLtMatmulAlgoGetHeuristic returned no algorithm".into());
                    }
                    for (rank, (algo, ws)) in list.into_iter().enumerate() {
                        if pending.iter().any(|q| q.algo == Algo::Lt(algo)) {
                            continue;
                        }
                        // Checked once here; every later launch reuses the same descriptors.
                        let outcome = match pl.check(h, &algo) {
                            Err(e) => Some(Outcome::Rejected(e.to_string())),
                            Ok(need) if need > WORKSPACE_BYTES => Some(Outcome::Rejected(format!(
                                "needs {need} bytes of workspace, more than {WORKSPACE_BYTES}"
                            ))),
                            Ok(_) => lt::check_alignment(&algo, align)
                                .err()
                                .map(|e| Outcome::Rejected(e.to_string())),
                        };
                        pending.push(Pending {
                            algo: Algo::Lt(algo),
                            config: lt::config_of(&algo).ok(),
                            workspace: ws,
                            rank: Some(rank),
                            outcome,
                            rel_diff: 0.0,
                        });
                    }
                    plan = Some(Arc::new(pl));
                }
                Err(e) => lt_note = Some(format!("heuristic query failed: {e}")),
            },
            Err(e) => lt_note = Some(format!("descriptors could not be built: {e}")),
        }
    }
    let candidates_ms = ms_since(start);

    let shape = Shape {
        dtype,
        spans,
        align,
        beta_zero,
        c_has_gaps,
    };
    let mut placed = match caller {
        Some(c) => caller_operands(ctx, &mut scratch, c, &shape)?,
        None => scratch_operands(ctx, &mut scratch, &uniform_fn, &shape)?,
    };
    let mut alloc_ms = placed.alloc_ms;
    let mut allocated_bytes = placed.allocated;
    let mut operands = if caller.is_some() {
        SearchOperands::Caller
    } else {
        SearchOperands::Scratch
    };
    let lt_stream = ctx.stream().cu_stream() as lt_sys::cudaStream_t;
    let scalars = Scalars::of(p);
    let launch = |algo: &Algo, ops: &Operands, c: u64| -> Result<()> {
        let ptrs = Ptrs {
            a: ops.a,
            b: ops.b,
            c,
        };
        match (algo, lt_handle, &plan) {
            // SAFETY: checked problem; the operands hold its extents (the caller's, validated,
            // or scratch regions of the same spans); the handle is bound to the Context's stream.
            (Algo::Cublas(a), _, _) => unsafe { cublas::gemm(blas, p, dtype, *a, ptrs) },
            // SAFETY: as above; `a` passed Plan::check for this plan with workspace <=
            // WORKSPACE_BYTES (candidates that did not are never launched) and suits the
            // operands' alignment (the key's, which scratch regions reproduce); the workspace
            // holds WORKSPACE_BYTES while the guard lives.
            (Algo::Lt(a), Some(h), Some(plan)) => unsafe {
                plan.matmul(h, a, &scalars, ptrs, workspace, WORKSPACE_BYTES, lt_stream)
            },
            (Algo::Lt(_), _, _) => Err(Error::NotSupported("cuBLASLt is unavailable".into())),
        }
    };
    let init = |ops: &Operands, ptr: u64| init_c(ctx, &uniform_fn, ops.init, ptr, spans.c, elem);
    // The statistics of the default's result (slot 0 of `acc`): the old C is the caller's, or
    // none (scratch: only the non-finite count is looked at).
    let stats = |ops: &Operands, acc: u64| {
        let (old_c, beta) = if ops.old_c != 0 {
            (ops.old_c, p.beta)
        } else {
            (0, 0.0)
        };
        queue_stats(ctx, &stats_fn, p, ops.reference, old_c, beta, acc)
    };
    let mut prepare_ms = ms_since(start);

    // 3. Check: the reference, then every candidate once (its warm-up too), compared on the
    // device; one synchronisation for all (two on the caller's operands: the default's result
    // is looked at first).
    let t_check = Instant::now();
    let total_steps = pending.len() + 1;
    progress(SearchProgress {
        done: 0,
        total: total_steps,
        label: "cuBLAS default (reference)",
    });
    // Four doubles per candidate: slot 0 holds the statistics of the default's result, slot i
    // the comparison sums of candidate i.
    let mut acc: CudaSlice<f64> = ctx
        .stream()
        .alloc_zeros(4 * pending.len())
        .call("cuMemAllocAsync")?;
    let acc_base = {
        let (ptr, _sync) = acc.device_ptr_mut(ctx.stream());
        ptr
    };
    init(&placed.ops, placed.ops.reference)?;
    launch(&Algo::CUBLAS_DEFAULT, &placed.ops, placed.ops.reference)?;
    stats(&placed.ops, acc_base)?;
    let mut fallback_ms = 0.0;
    if caller.is_some() {
        let s = ctx
            .stream()
            .clone_dtoh(&acc.slice(0..4))
            .call("cuMemcpyDtoH")?;
        let st = ResultStats::from_sums(&s, (p.batch * p.m * p.n) as f64);
        if let Some(why) = caller_data_unsuitable(&st) {
            tracing::info!(
                problem = %key,
                reason = %why,
                "GEMM search: the caller's data cannot check the candidates; searching on \
                 pseudo-random scratch operands instead"
            );
            let t_fallback = Instant::now();
            placed = scratch_operands(ctx, &mut scratch, &uniform_fn, &shape)?;
            alloc_ms += placed.alloc_ms;
            allocated_bytes += placed.allocated;
            // SAFETY: slot 0 of `acc` (4 doubles), read above.
            unsafe {
                cudarc::driver::result::memset_d8_async(
                    acc_base,
                    0,
                    4 * std::mem::size_of::<f64>(),
                    ctx.stream().cu_stream(),
                )
            }
            .call("cuMemsetD8Async")?;
            fallback_ms = ms_since(t_fallback);
            init(&placed.ops, placed.ops.reference)?;
            launch(&Algo::CUBLAS_DEFAULT, &placed.ops, placed.ops.reference)?;
            stats(&placed.ops, acc_base)?;
            operands = SearchOperands::Fallback(why);
        }
    }
    let ops = placed.ops;
    if beta_zero {
        init(&ops, ops.candidate)?; // the gaps, once: no GEMM writes them
    }
    let mut compared = Vec::new();
    for (i, c) in pending.iter_mut().enumerate().skip(1) {
        if c.outcome.is_some() {
            continue;
        }
        let l = label(&c.algo, &c.config, c.rank);
        progress(SearchProgress {
            done: i,
            total: total_steps,
            label: &l,
        });
        if !beta_zero {
            init(&ops, ops.candidate)?;
        }
        match launch(&c.algo, &ops, ops.candidate) {
            Err(e) => c.outcome = Some(Outcome::Rejected(format!("failed to run: {e}"))),
            Ok(()) => {
                queue_compare(
                    ctx,
                    &diff_fn,
                    ops.candidate,
                    ops.reference,
                    spans.c,
                    acc_base + 32 * i as u64,
                )?;
                compared.push(i);
            }
        }
    }
    let sums = ctx.stream().clone_dtoh(&acc).call("cuMemcpyDtoH")?;
    if operands != SearchOperands::Caller && sums.get(1).is_none_or(|&bad| bad != 0.0) {
        // The default's result on the pseudo-random operands is not finite (alpha or beta large
        // enough to overflow the type): the comparisons below say little, and the scratch's
        // patterns are not trusted for the next search.
        scratch.fills.clear();
        tracing::debug!(problem = %key, "GEMM search: the default's result on scratch operands has non-finite values");
    }
    for i in compared {
        let (rel, bad) = judge(sums.get(4 * i..4 * i + 3).unwrap_or(&[]));
        let c = &mut pending[i];
        if bad > 0.0 || rel.is_nan() || rel > tol {
            c.outcome = Some(Outcome::Rejected(format!(
                "result differs from the cuBLAS default: relative L2 {rel:.2e} (tolerance \
                 {tol:.1e}), {bad} non-finite mismatches"
            )));
        } else {
            c.rel_diff = rel;
        }
    }
    // The fallback's scratch preparation is prepare work, wherever it happened.
    let check_ms = ms_since(t_check) - fallback_ms;
    prepare_ms += fallback_ms;

    // 4. Time the survivors against each other (the default first).
    let t_timing = Instant::now();
    let timed: Vec<usize> = (0..pending.len())
        .filter(|&i| pending[i].outcome.is_none())
        .collect();
    let what = format!("timing {} candidates, interleaved", timed.len());
    progress(SearchProgress {
        done: total_steps - 1,
        total: total_steps,
        label: &what,
    });
    let res = time_interleaved(ctx, search_timing(), timed.len(), |v, _| {
        launch(&pending[timed[v]].algo, &ops, ops.candidate)
    })?;
    for (v, &i) in timed.iter().enumerate() {
        let c = &mut pending[i];
        c.outcome = Some(match (res.timing(v), &res.errors[v]) {
            (Some(timing), None) => Outcome::Timed {
                timing,
                rel_diff: c.rel_diff,
                burst: res.bursts[v],
                vs_default: res.paired(0, v),
            },
            (_, Some(e)) => Outcome::Rejected(format!("failed while timed: {e}")),
            (None, None) => Outcome::Rejected("no timing sample".into()),
        });
    }
    drop(scratch);
    drop(guard);
    let timing_ms = ms_since(t_timing);

    let candidates: Vec<Candidate> = pending
        .into_iter()
        .map(|c| Candidate {
            algo: c.algo,
            config: c.config,
            workspace: c.workspace,
            heuristic_rank: c.rank,
            outcome: c
                .outcome
                .unwrap_or_else(|| Outcome::Rejected("not timed".into())),
        })
        .collect();
    for c in &candidates {
        tracing::debug!(problem = %key, candidate = %c.label(), outcome = ?c.outcome, "GEMM search candidate");
    }

    // 5. Decide.
    let default_ms = candidates
        .first()
        .and_then(Candidate::median_ms)
        .ok_or_else(|| Error::NotSupported("the cuBLAS default could not be timed".into()))?;
    let mut winner = 0;
    let mut best_ratio = 1.0;
    for (i, c) in candidates.iter().enumerate().skip(1) {
        if let Some(r) = c.vs_default() {
            if beats_default(&r) && r.median < best_ratio {
                winner = i;
                best_ratio = r.median;
            }
        }
    }
    let fastest = candidates
        .iter()
        .enumerate()
        .filter_map(|(i, c)| c.median_ms().map(|t| (i, t)))
        .min_by(|a, b| a.1.total_cmp(&b.1));
    let w = &candidates[winner];
    let choice = Choice {
        algo: w.algo,
        config: w.config,
        workspace: w.workspace,
        median_us: w.median_ms().unwrap_or(default_ms) * 1e3,
        default_us: default_ms * 1e3,
        candidates: candidates.len() as u32,
        origin: Origin::Searched,
    };
    let rejected = candidates
        .iter()
        .filter(|c| matches!(c.outcome, Outcome::Rejected(_)))
        .count();
    let wall_ms = ms_since(start);
    progress(SearchProgress {
        done: total_steps,
        total: total_steps,
        label: "",
    });
    tracing::info!(
        problem = %key,
        candidates = candidates.len(),
        rejected,
        lt = candidates.iter().filter(|c| matches!(c.algo, Algo::Lt(_))).count(),
        explicit_cublas,
        rounds = res.rounds,
        winner = %choice.label(),
        winner_us = choice.median_us,
        default_us = choice.default_us,
        winner_vs_default = best_ratio,
        fastest_median = fastest.map_or_else(String::new, |(i, _)| candidates[i].label()),
        search_ms = wall_ms,
        setup_first_query_ms,
        prepare_ms,
        candidates_ms,
        alloc_ms,
        allocated_bytes,
        check_ms,
        timing_ms,
        operands = %operands,
        setup_ms,
        "GEMM algorithm search: the default is kept unless a candidate is faster by more than \
         the margin in the median round and faster in nearly every round"
    );
    if let Some(note) = &lt_note {
        tracing::info!(problem = %key, "GEMM search without cuBLASLt candidates: {note}");
    }
    let winning_plan = match w.algo {
        Algo::Lt(_) => plan,
        Algo::Cublas(_) => None,
    };
    Ok((
        SearchReport {
            key,
            problem: *p,
            candidates,
            winner,
            choice,
            explicit_cublas,
            lt_note,
            tolerance: tol,
            rounds: res.rounds,
            wall_ms,
            setup_ms,
            setup_first_query_ms,
            phases: SearchPhases {
                prepare_ms,
                candidates_ms,
                alloc_ms,
                check_ms,
                timing_ms,
            },
            operands,
            scratch_bytes: placed.bytes,
            allocated_bytes,
        },
        winning_plan,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paired(ratios: &[f64]) -> Paired {
        let base = vec![1.0; ratios.len()];
        Paired::of(&base, ratios).unwrap()
    }

    #[test]
    fn the_default_is_kept_unless_clearly_beaten() {
        // 3 % faster in every round: replaces the default.
        assert!(beats_default(&paired(&[0.97, 0.96, 0.97])));
        // 1 % faster: within the margin.
        assert!(!beats_default(&paired(&[0.99, 0.99, 0.99])));
        // Faster in the median round, slower in one of three: not consistent enough.
        assert!(!beats_default(&paired(&[0.9, 0.95, 1.01])));
        // Eleven rounds: one slower round is tolerated (p90 is the second largest).
        let mut r = vec![0.95; 10];
        r.push(1.05);
        assert!(beats_default(&paired(&r)));
        r[0] = 1.02;
        assert!(!beats_default(&paired(&r)));
        // Exactly at the margin counts.
        assert!(beats_default(&paired(&[0.98, 0.98, 0.98])));
        // No rounds: never.
        let none = Paired {
            median: 0.5,
            p10: 0.5,
            p90: 0.5,
            faster_rounds: 0,
            rounds: 0,
        };
        assert!(!beats_default(&none));
    }

    #[test]
    fn judge_sums() {
        let (rel, bad) = judge(&[4.0, 100.0, 0.0]);
        assert!((rel - 0.2).abs() < 1e-12);
        assert_eq!(bad, 0.0);
        assert!(judge(&[1.0]).0.is_nan());
        assert_eq!(judge(&[0.0, 0.0, 0.0]).0, 0.0);
    }
}
