//! The tuner: times the cuBLAS default and cuBLASLt's heuristic candidates (plus the explicit
//! cuBLAS algorithms on GPUs older than sm_80) on the real shape, against each other, and keeps
//! the default unless a candidate that computes the same result is clearly faster.
//!
//! # Steps
//! 1. **Setup** (one-off, reported apart as [`SearchReport::setup_ms`]): the search's kernels
//!    (NVRTC-compiled at the process's first search), the cuBLAS and cuBLASLt handles and the
//!    cuBLASLt workspace of the Context (created at their first use).
//! 2. **Prepare**: one scratch allocation holding A, B and two C's (the default's reference
//!    result and the candidates' output), each placed at the caller's pointer alignment; A and B
//!    filled with deterministic pseudo-random values in [-1, 1) (C too when beta != 0, since C is
//!    then an input: each candidate starts from the same C; zeros when C has gaps that no matrix
//!    covers, so that they compare equal; nothing otherwise). The caller's buffers are never
//!    touched. cuBLASLt's descriptors for the problem are built **once** ([`super::lt::Plan`])
//!    and shared by every cuBLASLt candidate; each candidate is checked with
//!    `cublasLtMatmulAlgoCheck`, its workspace and its alignment needs.
//! 3. **Check**: the default runs into the reference C; every other candidate runs once into the
//!    other C and is compared with it on the device (relative L2 within [`super::tolerance`];
//!    non-finite values only where the default has the same ones). All comparisons are queued
//!    and read back with one synchronisation. This run is also each candidate's warm-up.
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
//! For a 3 ms GEMM (16 x 4096^3 f16 on an H100) with 9 candidates this is 1 reference run, 8
//! checking runs and 3 rounds of 9 single launches: about 36 launches, ~110 ms of GPU time.

use std::sync::Arc;
use std::time::Instant;

use cudarc::cublaslt::sys as lt_sys;
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtrMut, PushKernelArg};
use half::{bf16, f16};

use super::cache::{Algo, Choice, LtConfig, Origin};
use super::cublas;
use super::lt::{self, Plan, Ptrs, Scalars, WORKSPACE_BYTES};
use super::problem::{tolerance, Alignment, Key, Problem, Spans, MAX_ALIGNMENT};
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
    /// Scratch allocation and fills, heuristic query, descriptors, `cublasLtMatmulAlgoCheck`s.
    pub prepare_ms: f64,
    /// Reference run, one checking run per candidate, comparisons (one synchronisation).
    pub check_ms: f64,
    /// Interleaved timing.
    pub timing_ms: f64,
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
    /// Host wall time of the search itself (ms): everything from scratch allocation to the
    /// decision, what the "under 200 ms per shape" target measures. One-off setup excluded.
    pub wall_ms: f64,
    /// Host wall time (ms) of the one-off setup this search paid before starting: NVRTC compile
    /// and module load of the search kernels, cuBLAS/cuBLASLt handle creation, workspace
    /// allocation. Near 0 once a search has run on the Context.
    pub setup_ms: f64,
    /// Where `wall_ms` went.
    pub phases: SearchPhases,
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

/// `(relative L2 difference, non-finite mismatches)` from the three sums of [`queue_compare`].
fn judge(sums: &[f64]) -> (f64, f64) {
    match sums {
        [num, den, bad, ..] => ((num / den.max(1e-300)).sqrt(), *bad),
        _ => (f64::NAN, f64::NAN),
    }
}

/// Byte offsets of regions of `(bytes, alignment)` in one allocation whose base is 256-byte
/// aligned: each region starts at the next multiple of 256 plus its alignment when that is below
/// 256, so that its start has exactly that alignment (the caller's, as cuBLASLt sees it). Returns
/// the offsets and the total size.
pub(crate) fn scratch_layout(regions: &[(usize, u16)]) -> (Vec<usize>, usize) {
    let max = MAX_ALIGNMENT as usize;
    let mut offsets = Vec::with_capacity(regions.len());
    let mut cursor = 0usize;
    for &(bytes, align) in regions {
        let base = cursor.div_ceil(max) * max;
        let start = if (align as usize) < max {
            base + align as usize
        } else {
            base
        };
        offsets.push(start);
        cursor = start + bytes;
    }
    (offsets, cursor.div_ceil(max) * max)
}

/// Runs the search for a checked problem. Holds the Context's lock throughout (the handles and
/// the workspace are used by every timed launch). Returns the report and, when the winner is a
/// cuBLASLt algorithm, the problem's descriptors for the cache.
pub(crate) fn run(
    ctx: &Context,
    p: &Problem,
    dtype: DType,
    key: Key,
    spans: Spans,
    progress: &mut dyn FnMut(SearchProgress<'_>),
) -> Result<(SearchReport, Option<Arc<Plan>>)> {
    match dtype {
        DType::F32 => typed::<f32>(ctx, p, key, spans, progress),
        DType::F16 => typed::<f16>(ctx, p, key, spans, progress),
        DType::BF16 => typed::<bf16>(ctx, p, key, spans, progress),
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

fn typed<T: Element>(
    ctx: &Context,
    p: &Problem,
    key: Key,
    spans: Spans,
    progress: &mut dyn FnMut(SearchProgress<'_>),
) -> Result<(SearchReport, Option<Arc<Plan>>)> {
    let dtype = T::DTYPE;
    let elem = std::mem::size_of::<T>();

    // 1. One-off setup (cached by the Context after the first search).
    let t_setup = Instant::now();
    // Raw driver calls below (memset) need the device current on this thread.
    ctx.cuda().bind_to_thread().call("cuCtxSetCurrent")?;
    let uniform_fn = ctx.function(&KERNELS, uniform_kernel(dtype))?;
    let diff_fn = ctx.function(&KERNELS, diff_kernel(dtype))?;
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
    let setup_ms = ms_since(t_setup);

    // 2. Prepare.
    let start = Instant::now();
    let align: Alignment = key.align;
    let tol = tolerance(dtype, p.compute, p.k);
    let beta_zero = p.beta == 0.0;
    // Elements of C's span that no matrix covers (ldc > m, or gaps between matrices).
    let c_has_gaps = spans.c != p.batch * p.m * p.n;
    let (offsets, total) = scratch_layout(&[
        (spans.a * elem, align.a),
        (spans.b * elem, align.b),
        (spans.c * elem, align.c),
        (spans.c * elem, align.c),
    ]);
    // SAFETY: scratch memory; A and B are filled below, and every element of a C region that is
    // compared is either written by the GEMM or initialised below (zeros or the C pattern).
    let mut scratch: CudaSlice<u8> =
        unsafe { ctx.stream().alloc::<u8>(total) }.call("cuMemAllocAsync (GEMM search scratch)")?;
    let base = {
        let (ptr, _sync) = scratch.device_ptr_mut(ctx.stream());
        ptr
    };
    let at = |i: usize| base + offsets[i] as u64;
    let (pa, pb, pref, pcand) = (at(0), at(1), at(2), at(3));
    uniform_raw(ctx, &uniform_fn, pa, spans.a, 0x5eed_0001)?;
    uniform_raw(ctx, &uniform_fn, pb, spans.b, 0x5eed_0002)?;
    let c_seed = 0x5eed_0003;
    let init_c = |ptr: u64| -> Result<()> {
        if !beta_zero {
            uniform_raw(ctx, &uniform_fn, ptr, spans.c, c_seed)
        } else if c_has_gaps {
            // SAFETY: `ptr` holds spans.c elements of the scratch allocation.
            unsafe {
                cudarc::driver::result::memset_d8_async(
                    ptr,
                    0,
                    spans.c * elem,
                    ctx.stream().cu_stream(),
                )
            }
            .call("cuMemsetD8Async")
        } else {
            Ok(()) // every element is written before it is read
        }
    };

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
    let lt_stream = ctx.stream().cu_stream() as lt_sys::cudaStream_t;
    let scalars = Scalars::of(p);
    let launch = |algo: &Algo, c: u64| -> Result<()> {
        let ptrs = Ptrs { a: pa, b: pb, c };
        match (algo, lt_handle, &plan) {
            // SAFETY: checked problem; the scratch regions hold its extents; the handle is bound
            // to the Context's stream.
            (Algo::Cublas(a), _, _) => unsafe { cublas::gemm(blas, p, dtype, *a, ptrs) },
            // SAFETY: as above; `a` passed Plan::check for this plan with workspace <=
            // WORKSPACE_BYTES (candidates that did not are never launched); the workspace holds
            // WORKSPACE_BYTES while the guard lives.
            (Algo::Lt(a), Some(h), Some(plan)) => unsafe {
                plan.matmul(h, a, &scalars, ptrs, workspace, WORKSPACE_BYTES, lt_stream)
            },
            (Algo::Lt(_), _, _) => Err(Error::NotSupported("cuBLASLt is unavailable".into())),
        }
    };
    let prepare_ms = ms_since(start);

    // 3. Check: the reference, then every candidate once (its warm-up too), compared on the
    // device; one synchronisation for all.
    let t_check = Instant::now();
    let total_steps = pending.len() + 1;
    progress(SearchProgress {
        done: 0,
        total: total_steps,
        label: "cuBLAS default (reference)",
    });
    init_c(pref)?;
    launch(&Algo::CUBLAS_DEFAULT, pref)?;
    if beta_zero {
        init_c(pcand)?; // zeros in the gaps, once: no GEMM writes them
    }
    let mut acc: CudaSlice<f64> = ctx
        .stream()
        .alloc_zeros(3 * pending.len())
        .call("cuMemAllocAsync")?;
    let acc_base = {
        let (ptr, _sync) = acc.device_ptr_mut(ctx.stream());
        ptr
    };
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
            init_c(pcand)?;
        }
        match launch(&c.algo, pcand) {
            Err(e) => c.outcome = Some(Outcome::Rejected(format!("failed to run: {e}"))),
            Ok(()) => {
                queue_compare(
                    ctx,
                    &diff_fn,
                    pcand,
                    pref,
                    spans.c,
                    acc_base + 24 * i as u64,
                )?;
                compared.push(i);
            }
        }
    }
    let sums = ctx.stream().clone_dtoh(&acc).call("cuMemcpyDtoH")?;
    for i in compared {
        let (rel, bad) = judge(sums.get(3 * i..).unwrap_or(&[]));
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
    let check_ms = ms_since(t_check);

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
        launch(&pending[timed[v]].algo, pcand)
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
    // The scratch is freed in stream order after the queued work.
    drop(scratch);
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
            phases: SearchPhases {
                prepare_ms,
                check_ms,
                timing_ms,
            },
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
    fn scratch_regions_have_the_callers_alignment() {
        let (off, total) = scratch_layout(&[(1000, 256), (10, 2), (300, 16), (300, 16)]);
        assert_eq!(off, vec![0, 1024 + 2, 1280 + 16, 1792 + 16]);
        assert_eq!(total, 2304);
        for (o, a) in off.iter().zip([256usize, 2, 16, 16]) {
            let got = 1usize << (o | 256).trailing_zeros();
            assert_eq!(got, a, "offset {o}");
        }
        // Regions never overlap.
        let sizes = [1000, 10, 300, 300];
        for i in 1..4 {
            assert!(off[i] >= off[i - 1] + sizes[i - 1]);
        }
        assert_eq!(scratch_layout(&[]), (vec![], 0));
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
