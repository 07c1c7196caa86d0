//! The tuner: times the cuBLAS default and cuBLASLt's heuristic candidates (plus the explicit
//! cuBLAS algorithms on GPUs older than sm_80) on the real shape, against each other, and keeps
//! the default unless a candidate that computes the same result is clearly faster.
//!
//! # Steps
//! 1. **Setup** (one-off, reported apart as [`report::SearchReport::setup_ms`]): the search's kernels
//!    (NVRTC-compiled at the process's first search), the cuBLAS and cuBLASLt handles and the
//!    cuBLASLt workspace of the Context (created at their first use), and a heuristic query for
//!    a tiny problem of the same kind, the handle's first for that kind (one-off library costs:
//!    [`report::SearchReport::setup_first_query_ms`]).
//! 2. **Prepare**: cuBLASLt's descriptors for the problem are built **once**
//!    (`LtDescriptors`) and shared by every cuBLASLt candidate of the heuristic query; each
//!    candidate is checked with `cublasLtMatmulAlgoCheck`, its workspace and its alignment
//!    needs. Then the operands ("Search operands" below), in the Context's scratch: one
//!    grow-only device allocation kept between searches (`scratch.rs`), so that only a search
//!    that needs more memory than every earlier one on the Context allocates
//!    ([`report::SearchReport::allocated_bytes`], [`report::SearchPhases::alloc_ms`]);
//!    [`crate::gemm::release_search_scratch`] frees it.
//! 3. **Check**: the default runs into the reference C; every other candidate runs once into the
//!    candidates' C and is compared with it on the device (relative L2 within
//!    [`crate::gemm::tolerance`]; non-finite values only where the default has the same ones). All
//!    comparisons are queued and read back with one synchronisation (on the caller's operands,
//!    one more before them: see below). This run is also each candidate's warm-up.
//! 4. **Time**, two ways by size. Products whose A, B and C fit in the L2
//!    ([`cold_flush_bytes`]) are timed **cold and on GPU time only**
//!    ([`crate::timing::time_interleaved_gpu_cold`]): one launch per sample, queued behind a
//!    write of twice the L2 in scratch and a head start of GPU work that covers its host time.
//!    In a step their weights come from DRAM, and such a small GEMM's call costs the host
//!    10–17 µs, more than its kernel runs: timed warm and back to back, every candidate of the
//!    demo's classifier GEMMs read 16–19 µs (the host) for 5–10 µs of GPU work, and for the f32
//!    classifier forward a split-K kernel chosen at 15.9 µs warm ran 26.7 µs in the step
//!    against the default's 23.2 (H100); cold they time as in the step. Larger products are
//!    timed with [`crate::timing::time_interleaved`]: a sample is a burst of back-to-back
//!    launches worth at least [`MIN_SAMPLE_MS`] of GPU time (one launch for long GEMMs),
//!    whose kernels outlast their calls' host time. Either way candidates take turns
//!    round-robin, [`MIN_ROUNDS`] to [`MAX_ROUNDS`] rounds, as many as fit [`BUDGET_MS`] of GPU
//!    time; a launch is what a call of [`crate::gemm::strided_batched`] queues for that
//!    algorithm (cached descriptors, one `cublasLtMatmul`). (Head starts for every size were
//!    tried: a search of 16 x 1024^3 f16 then took 2.3 s inside the GPU test suite, its head
//!    starts sized by host hiccups of the tests running beside it.)
//!
//!    Products whose output has fewer tiles than the GPU has SMs also get **split-K variants**
//!    of the heuristic's first candidates ([`split_k_counts`]): checked and timed like the rest.
//! 5. **Decide** (the incumbent rule of `crate::tune::rule`, the default being the incumbent): the
//!    cuBLAS default is kept unless a candidate's per-round time ratio to the default has a
//!    median of at most `1 - KEEP_INCUMBENT_MARGIN` (2 % faster)
//!    **and** a 90th percentile below 1 (faster in about nine rounds out of ten, in every round
//!    when there are six or fewer). Among the candidates that pass, the lowest median ratio
//!    wins. The ratios pair samples taken milliseconds apart, so clock and thermal drift cancel;
//!    the margin keeps an equal kernel from replacing the default on noise.
//!
//! # Search operands
//! - **The caller's** (the first [`crate::gemm::strided_batched`] call of a key,
//!   [`crate::gemm::search_on`]): A and B are read where they are, never written or copied. With
//!   beta == 0 the default writes its result into the caller's C (the tuned call that follows
//!   overwrites it) and the candidates write one scratch C (which gets the caller's C once when C
//!   has gaps, so that the gaps compare equal); with beta != 0 C is an input, so the reference
//!   and each candidate start from a copy of the caller's C in the scratch, and the caller's C is
//!   not written. Scratch: one C (beta == 0) or two.
//!
//!   Before any candidate runs, the default's result is looked at on the device (one reduction
//!   over C's matrix elements, [`ResultStats`](caller_data::ResultStats), read back with one synchronisation), and the
//!   caller's data is used only if it can tell a wrong result from a right one
//!   ([`caller_data_unsuitable`](caller_data::caller_data_unsuitable)): the result is finite everywhere (no NaN or Inf in A, B, or C
//!   when beta != 0, and no overflow), at least [`MIN_NONZERO_FRACTION`](caller_data::MIN_NONZERO_FRACTION) of it is nonzero, and
//!   when beta != 0 the product is at least [`MIN_PRODUCT_SHARE`](caller_data::MIN_PRODUCT_SHARE) of its norm. Otherwise the
//!   search falls back to pseudo-random scratch operands, as below, and says why
//!   ([`report::SearchOperands::Fallback`], an `info` trace). Caller data that passes can still check
//!   less than random data in one way: structure that makes two different computations agree
//!   (a symmetric A hides a transpose, identical batches hide a batch stride). The candidates
//!   are cuBLASLt's own kernels for this exact problem description; what the check guards
//!   against is numerical difference (reduced precision, split-K reductions), which any generic
//!   data shows.
//! - **Pseudo-random scratch** (no caller buffers: [`crate::gemm::search`], plain `nnfuse tune`; or the
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

pub(crate) mod caller_data;
pub(crate) mod kernels;
mod operands;
pub(crate) mod report;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::cublas::sys::cublasHandle_t;
use cudarc::cublaslt::sys as lt_sys;
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtrMut};
use half::{bf16, f16};
use once_cell::sync::Lazy;

use self::caller_data::{caller_data_unsuitable, ResultStats};
use self::kernels::KERNELS;
use self::kernels::{diff_kernel, queue_compare, queue_stats, stats_kernel, uniform_kernel};
use self::operands::{caller_operands, init_c, scratch_operands, Operands, Placed, Shape};
use self::report::{
    label, Candidate, Outcome, SearchOperands, SearchPhases, SearchProgress, SearchReport,
};
use super::algo::{Algo, Choice, LtConfig, Origin};
use super::cublas;
use super::lt::{self, LtDescriptors, Ptrs, Scalars, WORKSPACE_BYTES};
use super::problem::{tolerance, Alignment, Compute, Key, Problem, Spans};
use super::scratch::{self, Scratch};
use crate::context::{Context, Locked};
use crate::dtype::{DType, Element};
use crate::error::{CallExt, Error, Result};
use crate::timing::InterleavedOptions;
use crate::tune::race::{ms_since, race, race_gpu_cold, Race};
use crate::tune::rule::judge;

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
) -> Result<(SearchReport, Option<Arc<LtDescriptors>>)> {
    ctx.refuse_under_capture("a GEMM algorithm search", "measure (allocate, synchronise)")?;
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

impl Pending {
    fn of(algo: Algo) -> Pending {
        Pending {
            algo,
            config: None,
            workspace: 0,
            rank: None,
            outcome: None,
            rel_diff: 0.0,
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
    type Kind = (usize, DType, Compute, bool, bool);
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
    if let Ok(plan) = LtDescriptors::new(&tiny, dtype) {
        let _ = plan.heuristics(h, Alignment::MAX, WORKSPACE_BYTES, 1);
    }
    done.insert(kind);
    let ms = ms_since(t);
    tracing::debug!(ms, %dtype, "cuBLASLt first heuristic query of this handle and problem kind");
    ms
}

/// The search's kernels for one data type.
struct Kernels {
    uniform: CudaFunction,
    diff: CudaFunction,
    stats: CudaFunction,
}

/// What the one-off setup (step 1) leaves: the kernels, the Context's scratch cell, the
/// Context's lock with its handles and workspace, and its times.
struct Setup<'a> {
    kernels: Kernels,
    scratch: Arc<Mutex<Scratch>>,
    guard: Locked<'a>,
    blas: cublasHandle_t,
    lt: Option<lt_sys::cublasLtHandle_t>,
    workspace: u64,
    lt_note: Option<String>,
    first_query_ms: f64,
    ms: f64,
}

/// Step 1: the search's kernels, the scratch cell (taken before the Context's lock: the memo has
/// a lock of its own), the handles and the workspace (cached by the Context after the first
/// search), and cuBLASLt's first query for this kind of problem.
fn setup<'a>(ctx: &'a Context, p: &Problem, dtype: DType) -> Result<Setup<'a>> {
    let t_setup = Instant::now();
    // Raw driver calls of the search (memset, memcpy) need the device current on this thread.
    ctx.cuda().bind_to_thread().call("cuCtxSetCurrent")?;
    let kernels = Kernels {
        uniform: ctx.function(&KERNELS, uniform_kernel(dtype))?,
        diff: ctx.function(&KERNELS, diff_kernel(dtype))?,
        stats: ctx.function(&KERNELS, stats_kernel(dtype))?,
    };
    let scratch = scratch::of(ctx)?;
    let mut guard = ctx.lock()?;
    let blas = guard.cublas()?;
    let mut lt_note = None;
    let lt = match guard.cublaslt() {
        Ok(h) => Some(h),
        Err(e) => {
            lt_note = Some(format!("cuBLASLt unavailable: {e}"));
            None
        }
    };
    let workspace = if lt.is_some() {
        guard.workspace(WORKSPACE_BYTES)?
    } else {
        0
    };
    let first_query_ms = lt.map_or(0.0, |h| first_query(h, p, dtype));
    Ok(Setup {
        kernels,
        scratch,
        guard,
        blas,
        lt,
        workspace,
        lt_note,
        first_query_ms,
        ms: ms_since(t_setup),
    })
}

/// Step 2's candidates: the cuBLAS default, the explicit cuBLAS algorithms where they mean
/// something (GPUs older than sm_80), then cuBLASLt's heuristic list, all sharing one set of
/// descriptors and each checked once (`cublasLtMatmulAlgoCheck`, workspace, alignment). Returns
/// them, the descriptors, and whether the explicit cuBLAS algorithms were included; why
/// cuBLASLt gave none goes to `lt_note`.
fn candidates(
    (cc, sms): ((i32, i32), u32),
    lt_handle: Option<lt_sys::cublasLtHandle_t>,
    p: &Problem,
    dtype: DType,
    align: Alignment,
    lt_note: &mut Option<String>,
) -> (Vec<Pending>, Option<Arc<LtDescriptors>>, bool) {
    let explicit_cublas = cc.0 < 8;
    let mut pending = vec![Pending::of(Algo::CUBLAS_DEFAULT)];
    if explicit_cublas {
        for a in cublas::explicit_algos(dtype) {
            pending.push(Pending::of(Algo::Cublas(a)));
        }
    }
    let Some(h) = lt_handle else {
        return (pending, None, explicit_cublas);
    };
    let descriptors = match LtDescriptors::new(p, dtype) {
        Ok(d) => d,
        Err(e) => {
            *lt_note = Some(format!("descriptors could not be built: {e}"));
            return (pending, None, explicit_cublas);
        }
    };
    let list = match descriptors.heuristics(h, align, WORKSPACE_BYTES, MAX_LT_CANDIDATES) {
        Ok(list) => list,
        Err(e) => {
            *lt_note = Some(format!("heuristic query failed: {e}"));
            return (pending, None, explicit_cublas);
        }
    };
    if list.is_empty() {
        *lt_note = Some("cublasLtMatmulAlgoGetHeuristic returned no algorithm".into());
    }
    for (rank, (algo, ws)) in list.into_iter().enumerate() {
        if pending.iter().any(|q| q.algo == Algo::Lt(algo)) {
            continue;
        }
        // Checked once here; every later launch reuses the same descriptors.
        let outcome = match descriptors.check(h, &algo) {
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
    let splits = split_k_counts(p, sms);
    if !splits.is_empty() {
        let variants = split_k_variants(h, &descriptors, align, &pending, &splits);
        pending.extend(variants);
    }
    (pending, Some(Arc::new(descriptors)), explicit_cublas)
}

/// Bytes written before each cold sample, in L2 sizes: enough to evict every operand.
const COLD_FLUSH_L2S: usize = 2;

/// Whether the search times cold samples, and the bytes of scratch to write before each: when
/// A, B and C together fit in `l2` bytes of L2 (a product that large in a step finds its
/// operands in DRAM: weights read once per step), `COLD_FLUSH_L2S` times `l2`; `None` for larger
/// products, which stream from DRAM anyway (or when the L2's size is unknown). Pure.
pub fn cold_flush_bytes(spans: &Spans, elem: usize, l2: usize) -> Option<usize> {
    let bytes = (spans.a + spans.b + spans.c).saturating_mul(elem);
    (l2 > 0 && bytes <= l2).then_some(COLD_FLUSH_L2S * l2)
}

/// Heuristic candidates (in the heuristic's order) from which split-K variants are made.
const SPLIT_K_BASES: usize = 2;
/// Output tile edge of the split-K rule's estimate (cuBLASLt's tiles for such products are
/// 64 wide or narrower).
const SPLIT_K_TILE: usize = 64;
/// Fewest values of K each part of a split keeps.
const SPLIT_K_MIN_PART: usize = 64;

/// The K splits worth timing for `p` on `sms` SMs, none when its output already fills the GPU:
/// products whose output has fewer 64 x 64 tiles than the GPU has SMs (a classifier's forward
/// and data gradient at a small batch) leave most SMs idle with one block per tile, each walking
/// the whole K. Splits of 2 to 32 parts, each part at least [`SPLIT_K_MIN_PART`] long, at most
/// four blocks per SM in all. Pure.
pub(crate) fn split_k_counts(p: &Problem, sms: u32) -> Vec<u32> {
    let tiles = p.m.div_ceil(SPLIT_K_TILE) * p.n.div_ceil(SPLIT_K_TILE) * p.batch.max(1);
    let sms = sms.max(1) as usize;
    if tiles >= sms {
        return Vec::new();
    }
    [2u32, 4, 8, 16, 32]
        .into_iter()
        .filter(|&s| p.k / s as usize >= SPLIT_K_MIN_PART && tiles * s as usize <= 4 * sms)
        .collect()
}

/// Split-K variants of the first [`SPLIT_K_BASES`] heuristic candidates that passed their
/// checks and do not split already; each variant checked as its base was. Variants cuBLASLt
/// refuses are left out (an algorithm without split-K support has none).
fn split_k_variants(
    h: lt_sys::cublasLtHandle_t,
    descriptors: &LtDescriptors,
    align: Alignment,
    pending: &[Pending],
    splits: &[u32],
) -> Vec<Pending> {
    let bases = pending
        .iter()
        .filter(|q| q.rank.is_some() && q.outcome.is_none())
        .filter(|q| q.config.is_some_and(|c| c.splitk <= 1))
        .take(SPLIT_K_BASES);
    let mut out = Vec::new();
    for base in bases {
        let Algo::Lt(algo) = base.algo else { continue };
        for &s in splits {
            let Ok(v) = lt::with_split_k(&algo, s) else {
                break;
            };
            let workspace = match descriptors.check(h, &v) {
                Ok(need) if need <= WORKSPACE_BYTES && lt::check_alignment(&v, align).is_ok() => {
                    need
                }
                _ => continue,
            };
            if out.iter().any(|q: &Pending| q.algo == Algo::Lt(v)) {
                continue;
            }
            out.push(Pending {
                algo: Algo::Lt(v),
                config: lt::config_of(&v).ok(),
                workspace,
                rank: base.rank,
                outcome: None,
                rel_diff: 0.0,
            });
        }
    }
    if !out.is_empty() {
        tracing::debug!(
            variants = out.len(),
            ?splits,
            "GEMM search: split-K variants added"
        );
    }
    out
}

/// Queues the search's GEMMs with the Context's handles: what a call of
/// [`crate::gemm::strided_batched`] queues for an algorithm.
struct Launcher<'a> {
    p: &'a Problem,
    dtype: DType,
    blas: cublasHandle_t,
    lt: Option<lt_sys::cublasLtHandle_t>,
    descriptors: Option<&'a LtDescriptors>,
    scalars: Scalars,
    workspace: u64,
    stream: lt_sys::cudaStream_t,
}

impl Launcher<'_> {
    fn launch(&self, algo: &Algo, ops: &Operands, c: u64) -> Result<()> {
        let ptrs = Ptrs {
            a: ops.a,
            b: ops.b,
            c,
        };
        match (algo, self.lt, self.descriptors) {
            // SAFETY: checked problem; the operands hold its extents (the caller's, validated,
            // or scratch regions of the same spans); the handle is bound to the Context's stream.
            (Algo::Cublas(a), _, _) => unsafe {
                cublas::gemm(self.blas, self.p, self.dtype, *a, ptrs)
            },
            // SAFETY: as above; `a` passed LtDescriptors::check for these descriptors with
            // workspace <= WORKSPACE_BYTES (candidates that did not are never launched) and suits
            // the operands' alignment (the key's, which scratch regions reproduce); the workspace
            // holds WORKSPACE_BYTES while the guard lives.
            (Algo::Lt(a), Some(h), Some(d)) => unsafe {
                d.matmul(
                    h,
                    a,
                    &self.scalars,
                    ptrs,
                    self.workspace,
                    WORKSPACE_BYTES,
                    self.stream,
                )
            },
            (Algo::Lt(_), _, _) => Err(Error::NotSupported("cuBLASLt is unavailable".into())),
        }
    }
}

/// What the steps of one search share.
struct Env<'a> {
    ctx: &'a Context,
    p: &'a Problem,
    key: Key,
    spans: Spans,
    elem: usize,
    shape: Shape,
    kernels: &'a Kernels,
    gemm: Launcher<'a>,
}

impl Env<'_> {
    /// Initialises the C region at `ptr` as `ops` says.
    fn init(&self, ops: &Operands, ptr: u64) -> Result<()> {
        init_c(
            self.ctx,
            &self.kernels.uniform,
            ops.init,
            ptr,
            self.spans.c,
            self.elem,
        )
    }

    /// The reference: the cuBLAS default into `ops.reference`, and the statistics of its result
    /// into slot 0 of `acc` (the old C is the caller's, or none: on scratch only the non-finite
    /// count is looked at).
    fn reference(&self, ops: &Operands, acc: u64) -> Result<()> {
        self.init(ops, ops.reference)?;
        self.gemm
            .launch(&Algo::CUBLAS_DEFAULT, ops, ops.reference)?;
        let (old_c, beta) = if ops.old_c != 0 {
            (ops.old_c, self.p.beta)
        } else {
            (0, 0.0)
        };
        queue_stats(
            self.ctx,
            &self.kernels.stats,
            self.p,
            ops.reference,
            old_c,
            beta,
            acc,
        )
    }
}

/// Host time a fallback to scratch operands took, and what it allocated.
#[derive(Default)]
struct Fallback {
    ms: f64,
    alloc_ms: f64,
    allocated: usize,
}

/// On the caller's operands: looks at the default's result (one synchronisation) and, when the
/// caller's data cannot check the candidates, moves the search to pseudo-random scratch
/// operands (the reference runs again there).
fn fall_back_if_unsuitable(
    env: &Env<'_>,
    scratch: &mut Scratch,
    placed: &mut Placed,
    operands: &mut SearchOperands,
    acc: &CudaSlice<f64>,
    acc_base: u64,
) -> Result<Fallback> {
    let ctx = env.ctx;
    let p = env.p;
    let s = ctx
        .stream()
        .clone_dtoh(&acc.slice(0..4))
        .call("cuMemcpyDtoH")?;
    let st = ResultStats::from_sums(&s, (p.batch * p.m * p.n) as f64);
    let Some(why) = caller_data_unsuitable(&st) else {
        return Ok(Fallback::default());
    };
    tracing::info!(
        problem = %env.key,
        reason = %why,
        "GEMM search: the caller's data cannot check the candidates; searching on \
         pseudo-random scratch operands instead"
    );
    let t_fallback = Instant::now();
    *placed = scratch_operands(ctx, scratch, &env.kernels.uniform, &env.shape)?;
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
    let ms = ms_since(t_fallback);
    env.reference(&placed.ops, acc_base)?;
    *operands = SearchOperands::Fallback(why);
    Ok(Fallback {
        ms,
        alloc_ms: placed.alloc_ms,
        allocated: placed.allocated,
    })
}

/// Runs every candidate not yet decided once into the candidates' C and queues its comparison
/// with the reference into its slot of `acc`; a candidate that fails to run is rejected.
/// Returns the indices compared.
fn run_candidates(
    env: &Env<'_>,
    ops: &Operands,
    pending: &mut [Pending],
    acc_base: u64,
    progress: &mut dyn FnMut(SearchProgress<'_>),
) -> Result<Vec<usize>> {
    let total_steps = pending.len() + 1;
    if env.shape.beta_zero {
        env.init(ops, ops.candidate)?; // the gaps, once: no GEMM writes them
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
        if !env.shape.beta_zero {
            env.init(ops, ops.candidate)?;
        }
        match env.gemm.launch(&c.algo, ops, ops.candidate) {
            Err(e) => c.outcome = Some(Outcome::Rejected(format!("failed to run: {e}"))),
            Ok(()) => {
                queue_compare(
                    env.ctx,
                    &env.kernels.diff,
                    ops.candidate,
                    ops.reference,
                    env.spans.c,
                    acc_base + 32 * i as u64,
                )?;
                compared.push(i);
            }
        }
    }
    Ok(compared)
}

/// Step 3: the reference, then every candidate once (its warm-up too), compared on the device;
/// one synchronisation for all (two on the caller's operands: the default's result is looked at
/// first). Candidates whose result differs from the default's are rejected.
#[allow(clippy::too_many_arguments)]
fn check(
    env: &Env<'_>,
    scratch: &mut Scratch,
    placed: &mut Placed,
    operands: &mut SearchOperands,
    pending: &mut [Pending],
    tol: f64,
    progress: &mut dyn FnMut(SearchProgress<'_>),
) -> Result<Fallback> {
    let ctx = env.ctx;
    progress(SearchProgress {
        done: 0,
        total: pending.len() + 1,
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
    env.reference(&placed.ops, acc_base)?;
    let fallback = if *operands == SearchOperands::Caller {
        fall_back_if_unsuitable(env, scratch, placed, operands, &acc, acc_base)?
    } else {
        Fallback::default()
    };
    let compared = run_candidates(env, &placed.ops, pending, acc_base, progress)?;
    let sums = ctx.stream().clone_dtoh(&acc).call("cuMemcpyDtoH")?;
    if *operands != SearchOperands::Caller && sums.get(1).is_none_or(|&bad| bad != 0.0) {
        // The default's result on the pseudo-random operands is not finite (alpha or beta large
        // enough to overflow the type): the comparisons below say little, and the scratch's
        // patterns are not trusted for the next search.
        scratch.fills.clear();
        tracing::debug!(problem = %env.key, "GEMM search: the default's result on scratch operands has non-finite values");
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
    Ok(fallback)
}

/// Step 4: the survivors (the default first) timed against each other; their outcomes set.
/// Returns the race and the indices of the timed candidates (variant `v` is `timed[v]`).
fn time(
    env: &Env<'_>,
    ops: &Operands,
    pending: &mut [Pending],
    progress: &mut dyn FnMut(SearchProgress<'_>),
) -> Result<(Race, Vec<usize>)> {
    let total_steps = pending.len() + 1;
    let timed: Vec<usize> = (0..pending.len())
        .filter(|&i| pending[i].outcome.is_none())
        .collect();
    let what = format!("timing {} candidates, interleaved", timed.len());
    progress(SearchProgress {
        done: total_steps - 1,
        total: total_steps,
        label: &what,
    });
    let launch = |v: usize, _| env.gemm.launch(&pending[timed[v]].algo, ops, ops.candidate);
    let l2 = env.ctx.info().l2_bytes.max(0) as usize;
    let r = match cold_flush_bytes(&env.spans, env.elem, l2) {
        Some(flush) => race_gpu_cold(env.ctx, search_timing(), timed.len(), flush, launch)?,
        None => race(env.ctx, search_timing(), timed.len(), launch)?,
    };
    let res = &r.timing;
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
    Ok((r, timed))
}

/// Step 5: the winner (the cuBLAS default unless the race's challenger beats it), its median
/// ratio to the default, and the choice to store.
fn decide(
    candidates: &[Candidate],
    challenger: Option<(usize, f64)>,
    timed: &[usize],
) -> Result<(usize, f64, Choice)> {
    let default_ms = candidates
        .first()
        .and_then(Candidate::median_ms)
        .ok_or_else(|| Error::NotSupported("the cuBLAS default could not be timed".into()))?;
    let (winner, best_ratio) = challenger.map_or((0, 1.0), |(v, median)| (timed[v], median));
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
    Ok((winner, best_ratio, choice))
}

/// The search's summary in the log (`info`).
fn log_report(r: &SearchReport, best_ratio: f64) {
    let rejected = r
        .candidates
        .iter()
        .filter(|c| matches!(c.outcome, Outcome::Rejected(_)))
        .count();
    let fastest = r
        .candidates
        .iter()
        .enumerate()
        .filter_map(|(i, c)| c.median_ms().map(|t| (i, t)))
        .min_by(|a, b| a.1.total_cmp(&b.1));
    let ph = &r.phases;
    tracing::info!(
        problem = %r.key,
        candidates = r.candidates.len(),
        rejected,
        lt = r.candidates.iter().filter(|c| matches!(c.algo, Algo::Lt(_))).count(),
        explicit_cublas = r.explicit_cublas,
        rounds = r.rounds,
        winner = %r.choice.label(),
        winner_us = r.choice.median_us,
        default_us = r.choice.default_us,
        winner_vs_default = best_ratio,
        fastest_median = fastest.map_or_else(String::new, |(i, _)| r.candidates[i].label()),
        search_ms = r.wall_ms,
        setup_first_query_ms = r.setup_first_query_ms,
        prepare_ms = ph.prepare_ms,
        candidates_ms = ph.candidates_ms,
        alloc_ms = ph.alloc_ms,
        allocated_bytes = r.allocated_bytes,
        check_ms = ph.check_ms,
        timing_ms = ph.timing_ms,
        operands = %r.operands,
        setup_ms = r.setup_ms,
        "GEMM algorithm search: the default is kept unless a candidate is faster by more than \
         the margin in the median round and faster in nearly every round"
    );
    if let Some(note) = &r.lt_note {
        tracing::info!(problem = %r.key, "GEMM search without cuBLASLt candidates: {note}");
    }
}

/// The search's candidates as reported (one not decided reads as not timed), each logged.
fn into_candidates(pending: Vec<Pending>, key: &Key) -> Vec<Candidate> {
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
    candidates
}

fn typed<T: Element>(
    ctx: &Context,
    p: &Problem,
    key: Key,
    spans: Spans,
    caller: Option<Ptrs>,
    progress: &mut dyn FnMut(SearchProgress<'_>),
) -> Result<(SearchReport, Option<Arc<LtDescriptors>>)> {
    let dtype = T::DTYPE;
    let elem = std::mem::size_of::<T>();

    // 1. One-off setup (cached by the Context after the first search).
    let mut su = setup(ctx, p, dtype)?;

    // 2. Prepare: the candidates (heuristic query, descriptors, checks), then the operands.
    let start = Instant::now();
    // Held until the search ends: queued work uses the scratch.
    let mut scratch = scratch::lock(&su.scratch);
    let align: Alignment = key.align;
    let tol = tolerance(dtype, p.compute, p.k);
    let shape = Shape {
        dtype,
        spans,
        align,
        beta_zero: p.beta == 0.0,
        // Elements of C's span that no matrix covers (ldc > m, or gaps between matrices).
        c_has_gaps: spans.c != p.batch * p.m * p.n,
    };
    let (mut pending, descriptors, explicit_cublas) = candidates(
        (ctx.info().compute_capability, crate::launch::sm_count(ctx)),
        su.lt,
        p,
        dtype,
        align,
        &mut su.lt_note,
    );
    let candidates_ms = ms_since(start);
    let mut placed = match caller {
        Some(c) => caller_operands(ctx, &mut scratch, c, &shape)?,
        None => scratch_operands(ctx, &mut scratch, &su.kernels.uniform, &shape)?,
    };
    let mut alloc_ms = placed.alloc_ms;
    let mut allocated_bytes = placed.allocated;
    let mut operands = if caller.is_some() {
        SearchOperands::Caller
    } else {
        SearchOperands::Scratch
    };
    let env = Env {
        ctx,
        p,
        key,
        spans,
        elem,
        shape,
        kernels: &su.kernels,
        gemm: Launcher {
            p,
            dtype,
            blas: su.blas,
            lt: su.lt,
            descriptors: descriptors.as_deref(),
            scalars: Scalars::of(p),
            workspace: su.workspace,
            stream: ctx.stream().cu_stream() as lt_sys::cudaStream_t,
        },
    };
    let mut prepare_ms = ms_since(start);

    // 3. Check.
    let t_check = Instant::now();
    let fallback = check(
        &env,
        &mut scratch,
        &mut placed,
        &mut operands,
        &mut pending,
        tol,
        progress,
    )?;
    alloc_ms += fallback.alloc_ms;
    allocated_bytes += fallback.allocated;
    // The fallback's scratch preparation is prepare work, wherever it happened.
    let check_ms = ms_since(t_check) - fallback.ms;
    prepare_ms += fallback.ms;

    // 4. Time the survivors against each other (the default first).
    let t_timing = Instant::now();
    let (race, timed) = time(&env, &placed.ops, &mut pending, progress)?;
    drop(scratch);
    drop(su.guard);
    let timing_ms = ms_since(t_timing);
    let candidates = into_candidates(pending, &key);

    // 5. Decide.
    let (winner, best_ratio, choice) = decide(&candidates, race.challenger, &timed)?;
    let wall_ms = ms_since(start);
    let total_steps = candidates.len() + 1;
    progress(SearchProgress {
        done: total_steps,
        total: total_steps,
        label: "",
    });
    let winning = match choice.algo {
        Algo::Lt(_) => descriptors,
        Algo::Cublas(_) => None,
    };
    let report = SearchReport {
        key,
        problem: *p,
        candidates,
        winner,
        choice,
        explicit_cublas,
        lt_note: su.lt_note,
        tolerance: tol,
        rounds: race.timing.rounds,
        wall_ms,
        setup_ms: su.ms,
        setup_first_query_ms: su.first_query_ms,
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
    };
    log_report(&report, best_ratio);
    Ok((report, winning))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Products whose operands fit in L2 are timed cold, behind twice the L2 of scratch writes.
    #[test]
    fn small_products_are_timed_cold() {
        let l2 = 50 << 20;
        // The classifier: 4 MB of weights, f16.
        let fc = Spans {
            a: 1000 * 2048,
            b: 2048 * 32,
            c: 1000 * 32,
        };
        assert_eq!(cold_flush_bytes(&fc, 2, l2), Some(100 << 20));
        let big = Spans {
            a: 4096 * 4096,
            b: 4096 * 4096,
            c: 4096 * 4096,
        };
        assert_eq!(cold_flush_bytes(&big, 2, l2), None);
        assert_eq!(cold_flush_bytes(&fc, 2, 0), None);
    }

    /// The classifier's forward and data gradient at batch 32 get splits; its filter gradient
    /// (K = 32) and a square GEMM that fills the GPU get none; parts stay at least 64 long and
    /// the blocks at most four per SM.
    #[test]
    fn split_k_only_where_the_output_leaves_sms_idle() {
        let sms = 132;
        // fc.fwd 1000 x 32 x 2048: 16 tiles.
        assert_eq!(
            split_k_counts(&Problem::packed(1, 1000, 32, 2048), sms),
            vec![2, 4, 8, 16, 32]
        );
        // fc.dgrad 2048 x 32 x 1000: 32 tiles; 1000 / 16 < 64.
        assert_eq!(
            split_k_counts(&Problem::packed(1, 2048, 32, 1000), sms),
            vec![2, 4, 8]
        );
        // fc.wgrad 2048 x 1000 x 32: 512 tiles.
        assert!(split_k_counts(&Problem::packed(1, 2048, 1000, 32), sms).is_empty());
        assert!(split_k_counts(&Problem::packed(1, 4096, 4096, 4096), sms).is_empty());
        // A batch of small products fills the GPU by itself.
        assert!(split_k_counts(&Problem::packed(256, 64, 64, 4096), sms).is_empty());
        // A short K gets no split whatever the output.
        assert!(split_k_counts(&Problem::packed(1, 64, 64, 100), sms).is_empty());
        // 64 tiles: splits up to 8 (64 * 8 = 512 <= 528 blocks).
        assert_eq!(
            split_k_counts(&Problem::packed(1, 512, 512, 8192), sms),
            vec![2, 4, 8]
        );
    }
}
