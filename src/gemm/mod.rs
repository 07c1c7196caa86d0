//! Strided batched GEMM with a real algorithm search and a persistent tuning cache.
//!
//! [`strided_batched`] computes `C[b] = alpha * op(A[b]) * op(B[b]) + beta * C[b]` for
//! `b in 0..batch`, column-major as cuBLAS and [`crate::reference::gemm`] (see [`Problem`]), for
//! f32, f16 and bf16 data (A, B and C of one type) with f32 accumulation ([`Compute::F32`]:
//! plain `CUBLAS_COMPUTE_32F`, never TF32, so f32 results match an f64 reference to about 1e-6
//! relative) or, for f16 data, f16 accumulation ([`Compute::F16`]).
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use nnfuse::gemm::{self, Problem};
//! let ctx = nnfuse::Context::new(0)?;
//! let (batch, m, n, k) = (16, 1024, 1024, 1024);
//! let s = ctx.stream();
//! let a = s.alloc_zeros::<half::f16>(batch * m * k)?;
//! let b = s.alloc_zeros::<half::f16>(batch * k * n)?;
//! let mut c = s.alloc_zeros::<half::f16>(batch * m * n)?;
//! gemm::strided_batched(&ctx, &Problem::packed(batch, m, n, k), &a, &b, &mut c)?;
//! # Ok(()) }
//! ```
//!
//! # Validation
//! Every argument is checked before anything reaches the GPU, and errors name it: the compute
//! type against the data type, the `int`/`long long` limits of the cuBLAS API, leading
//! dimensions (at least the stored rows), `k >= 1` when C is not empty (`m`, `n` or `batch` of 0
//! is a no-op), each buffer long enough for the last element of the last batch (naming the
//! buffer when one matrix does not fit, the stride when the batches run past its end), C's
//! stride (0 with `batch > 1`, or matrices of two batches sharing an element, is a write race),
//! every buffer on the Context's device, element alignment of the pointers, and C's extent not
//! overlapping A's or B's. A stride of 0
//! for A or B broadcasts.
//!
//! # Algorithm search
//! On sm_80+ cuBLAS ignores its `cublasGemmAlgo_t` argument (all values give bitwise identical
//! results on the H100), so the search chooses between genuinely different kernels from
//! cuBLASLt: per problem key ([`Key`]: device, data and compute types, transposes, m, n, k,
//! batch, leading dimensions, strides, operand alignment, whether beta is 0) it takes up to 16
//! candidates of `cublasLtMatmulAlgoGetHeuristic` plus the cuBLAS default (and, on GPUs older
//! than sm_80 only, the explicit `CUBLAS_GEMM_ALGO*` values), rejects those that
//! `cublasLtMatmulAlgoCheck` refuses or whose result differs from the default's, times the rest
//! against each other with CUDA events (interleaved round-robin, bursts of back-to-back
//! launches), and keeps the cuBLAS default unless a candidate beats it by at least 2 % in the
//! median round and in nearly every round (the incumbent rule that convolution's `auto` shares;
//! the `search` module's documentation has the budget and the rules).
//!
//! The first call of a key searches on the caller's own operands: A and B are only read; C is
//! written only where the call writes it anyway (with beta == 0 the default's result goes there
//! first, then the tuned call's), and the candidates write a scratch C (scratch copies of C when
//! beta != 0). If the caller's data cannot tell right from wrong — the default's result has NaN
//! or Inf (from NaN/Inf inputs or overflow), is mostly zeros, or is dominated by `beta * C` —
//! the search uses pseudo-random scratch operands instead ([`Unsuitable`],
//! [`SearchOperands`]), as [`search`] and `nnfuse tune` always do. Scratch memory is one
//! grow-only allocation per Context, kept between searches ([`search_scratch_bytes`]; free it
//! with [`release_search_scratch`]). The choice is a concrete algorithm ([`Algo`]: the
//! `cublasLtMatmulAlgo_t` bytes, or a `cublasGemmAlgo_t`), never a heuristic rank. The first
//! call for a key pays the search (about 10-120 ms on an H100; the process's first search also
//! pays a one-off setup, NVRTC compile of two small kernels and handle creation, reported apart
//! as [`SearchReport::setup_ms`]); later calls cost one hash lookup, and a cuBLASLt choice keeps
//! its descriptors (built once per key), so a call is the validation, the lookup and one
//! `cublasLtMatmul`. Do not make the first call of a shape inside CUDA graph capture (the search
//! synchronises): tune ahead with [`search`] or `nnfuse tune`, or turn the search off.
//!
//! To run one given algorithm many times (benchmarks, experiments), [`Prepared`] checks it and
//! builds its descriptors once; [`strided_batched_with`] does both on every call.
//!
//! With [`crate::Config::gemm_search`] off (`NNFUSE_GEMM_SEARCH=0`) every call runs
//! `cublasGemmStridedBatchedEx` with `CUBLAS_GEMM_DEFAULT` and nothing is searched or cached.
//!
//! # Tuning cache
//! Choices live in memory for the life of the process (shared by every Context on the same
//! device ordinal), at most [`crate::Config::plan_cache_capacity`] of them (the largest any
//! Context asked for; least recently used evicted first, searched again at their next call).
//! When [`crate::Config::tuning_cache`] (`NNFUSE_TUNING_CACHE`) names a file, it is read at the
//! first cache miss and rewritten atomically after each search (the file that convolution's
//! choices share: format and what is ignored in `docs/ARCHITECTURE.md`, "Tuning"). Entries read from the file are checked
//! (`cublasLtMatmulAlgoCheck` and the algorithm's alignment needs) before their first use.

mod algo;
mod choices;
mod cublas;
mod entry;
pub(crate) mod lt;
mod names;
mod problem;
mod scratch;
mod search;

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::sys as lt_sys;
use cudarc::driver::{DevicePtr, DevicePtrMut};
use once_cell::sync::Lazy;

pub use algo::{Algo, Choice, CublasAlgo, LtAlgo, LtConfig, Origin};
pub use lt::WORKSPACE_BYTES;
pub use problem::{tolerance, Alignment, Compute, Key, Problem, Spans, Validated};
pub use scratch::{held_bytes as search_scratch_bytes, release as release_search_scratch};
pub use search::caller_data::Unsuitable;
pub use search::report::{
    Candidate, Outcome, SearchOperands, SearchPhases, SearchProgress, SearchReport,
};

/// What nnfuse's own tests, benches and CLI reach of the GEMM module: search and cache
/// internals, the tuning file, fills (not a stable API).
#[doc(hidden)]
pub mod internals {
    pub use super::choices::{clear, entries, memory_stats, MemoryStats};
    pub use super::device_tag;
    pub use super::entry::{load_file, save_file, DeviceTag, Loaded};
    pub use super::problem::{c_batches_overlap, check_pointers, MAX_ALIGNMENT};
    pub use super::search::caller_data::{
        caller_data_unsuitable, ResultStats, MIN_NONZERO_FRACTION, MIN_PRODUCT_SHARE,
    };
    pub use super::search::kernels::{fill_uniform, KERNELS};
    pub use super::search::{
        cold_flush_bytes, search_timing, BUDGET_MS, MAX_LT_CANDIDATES, MAX_ROUNDS, MIN_ROUNDS,
        MIN_SAMPLE_MS,
    };
    pub use crate::tune::internals::{
        beats_incumbent as beats_default, FILE_FORMAT, FILE_VERSION,
        KEEP_INCUMBENT_MARGIN as KEEP_DEFAULT_MARGIN,
    };
}

use crate::context::{cublas_version, cublaslt_version, Context};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::validate::{Binder, Need};
use entry::DeviceTag;
use lt::{LtDescriptors, Ptrs};
pub(crate) use problem::{check_operands, check_pointers};

fn ordinal(ctx: &Context) -> u32 {
    ctx.info().ordinal as u32
}

/// The bound the Context asks of the process's choice map.
fn capacity(ctx: &Context) -> usize {
    ctx.config().plan_cache_capacity
}

/// The device and library versions a tuning result of `ctx` is valid for (computed once per
/// device ordinal).
#[doc(hidden)] // reached through `internals`
pub fn device_tag(ctx: &Context) -> Result<DeviceTag> {
    static TAGS: Lazy<Mutex<HashMap<u32, DeviceTag>>> = Lazy::new(|| Mutex::new(HashMap::new()));
    let ord = ordinal(ctx);
    let mut tags = match TAGS.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    };
    if let Some(t) = tags.get(&ord) {
        return Ok(t.clone());
    }
    let tag = DeviceTag {
        name: ctx.info().name.clone(),
        compute_capability: ctx.info().compute_capability,
        cublas: cublas_version()?,
        cublaslt: cublaslt_version()?,
    };
    tags.insert(ord, tag.clone());
    Ok(tag)
}

/// Checks the problem and the buffers (lengths, device, alignment, aliasing); `None` for an
/// empty problem. Returns the spans, the device pointers and the validator's binder (holding
/// the stream-ordering guards, to be kept across the launch). `$bind_c` binds C: `output`, or
/// `output_ref` where C is only borrowed shared.
macro_rules! operands {
    ($ctx:expr, $p:expr, $t:ty, $a:expr, $b:expr, $c:expr, $bind_c:ident) => {{
        match $p.check_buffers(<$t as Element>::DTYPE, $a.len(), $b.len(), $c.len())? {
            Validated::Empty => None,
            Validated::Spans(spans) => {
                let mut bind = Binder::new($ctx);
                let ptrs = Ptrs {
                    a: bind.input::<$t, _>("a", $a, Need::Span(spans.a))?,
                    b: bind.input::<$t, _>("b", $b, Need::Span(spans.b))?,
                    c: bind.$bind_c::<$t, _>("c", $c, Need::Span(spans.c))?,
                };
                problem::check_operands(bind.operands())?;
                Some((spans, ptrs, bind))
            }
        }
    }};
}

/// Queues `cublasGemmStridedBatchedEx` with `algo` for a checked problem.
fn run_cublas(
    ctx: &Context,
    p: &Problem,
    dtype: DType,
    algo: CublasAlgo,
    ptrs: Ptrs,
) -> Result<()> {
    if !algo.is_known() {
        return Err(Error::invalid(
            "algo",
            format!("{} is not a cublasGemmAlgo_t value nnfuse passes", algo.0),
        ));
    }
    let (_lock, h) = cublas_handle(ctx)?;
    crate::profile::stage!(Vendor);
    // SAFETY: the problem was checked and the pointers hold its extents; the handle is bound to
    // the Context's stream, where the operands are used.
    unsafe { cublas::gemm(h, p, dtype, algo, ptrs) }
}

/// The Context's lock and its cuBLAS handle (bound to the Context's stream), held together while
/// a call is queued.
fn cublas_handle(
    ctx: &Context,
) -> Result<(
    crate::context::Locked<'_>,
    cudarc::cublas::sys::cublasHandle_t,
)> {
    crate::profile::stage!(Workspace);
    let mut g = ctx.lock()?;
    let h = g.cublas()?;
    Ok((g, h))
}

/// Queues one `cublasLtMatmul` with prepared descriptors: the whole cost of a cached cuBLASLt
/// choice (lock, handle, workspace pointer, one call).
fn run_lt(
    ctx: &Context,
    p: &Problem,
    descriptors: &LtDescriptors,
    algo: &LtAlgo,
    ptrs: Ptrs,
) -> Result<()> {
    let (_lock, h, ws) = {
        crate::profile::stage!(Workspace);
        let mut g = ctx.lock()?;
        let h = g.cublaslt()?;
        let ws = g.workspace(WORKSPACE_BYTES)?;
        (g, h, ws)
    };
    let stream = ctx.stream().cu_stream() as lt_sys::cudaStream_t;
    crate::profile::stage!(Vendor);
    // SAFETY: the problem was checked and the pointers hold its extents; `descriptors` describes this
    // problem (it depends only on its key); the algorithm passed `cublasLtMatmulAlgoCheck` for
    // it with at most WORKSPACE_BYTES of workspace and suits the operands' alignment (checked
    // when it was searched, prepared, or read from the file and verified); the workspace holds
    // WORKSPACE_BYTES while the guard lives.
    unsafe {
        descriptors.matmul(
            h,
            algo,
            &lt::Scalars::of(p),
            ptrs,
            ws,
            WORKSPACE_BYTES,
            stream,
        )
    }
}

fn verify_lt(
    descriptors: &LtDescriptors,
    h: lt_sys::cublasLtHandle_t,
    a: &LtAlgo,
    align: Alignment,
) -> Result<()> {
    let ws = descriptors.check(h, a)?;
    if ws > WORKSPACE_BYTES {
        return Err(Error::NotSupported(format!(
            "the cuBLASLt algorithm needs {ws} bytes of workspace, more than {WORKSPACE_BYTES}"
        )));
    }
    lt::check_alignment(a, align)
}

/// Builds the descriptors of `p` and checks `a` against them and `align`.
fn descriptors_checked(
    ctx: &Context,
    p: &Problem,
    dtype: DType,
    a: &LtAlgo,
    align: Alignment,
) -> Result<Arc<LtDescriptors>> {
    let descriptors = LtDescriptors::new(p, dtype)?;
    let mut g = ctx.lock()?;
    let h = g.cublaslt()?;
    verify_lt(&descriptors, h, a, align)?;
    Ok(Arc::new(descriptors))
}

/// Checks a choice that came from the file before its first use; returns the descriptors the
/// check built (cuBLASLt), to be cached with it.
fn verify(
    ctx: &Context,
    p: &Problem,
    dtype: DType,
    key: &Key,
    c: &Choice,
) -> Result<Option<Arc<LtDescriptors>>> {
    match &c.algo {
        Algo::Cublas(a) if a.is_known() => Ok(None),
        Algo::Cublas(a) => Err(Error::NotSupported(format!(
            "unknown cublasGemmAlgo_t {}",
            a.0
        ))),
        Algo::Lt(a) => descriptors_checked(ctx, p, dtype, a, key.align).map(Some),
    }
}

fn save(ctx: &Context, path: &std::path::Path) -> Result<()> {
    let tag = device_tag(ctx)?;
    entry::save_file(path, &tag, &choices::entries(ordinal(ctx)))
}

fn search_and_store(
    ctx: &Context,
    p: &Problem,
    dtype: DType,
    key: Key,
    spans: Spans,
    caller: Option<Ptrs>,
    progress: &mut dyn FnMut(SearchProgress<'_>),
) -> Result<(SearchReport, Option<Arc<LtDescriptors>>)> {
    let (report, descriptors) = search::run(ctx, p, dtype, key, spans, caller, progress)?;
    choices::insert(key, report.choice, true, descriptors.clone(), capacity(ctx));
    if let Some(path) = &ctx.config().tuning_cache {
        match save(ctx, path) {
            Ok(()) => tracing::debug!(path = %path.display(), "GEMM tuning cache written"),
            Err(e) => tracing::warn!(
                path = %path.display(),
                error = %e,
                "GEMM tuning cache could not be written; the result stays in memory"
            ),
        }
    }
    Ok((report, descriptors))
}

/// The choice for `key` and its cached cuBLASLt descriptors: from memory, else from the
/// tuning-cache file (checked), else by a search on the caller's operands `ptrs`; a failed
/// search falls back to the cuBLAS default (remembered, with a warning).
fn choose(
    ctx: &Context,
    p: &Problem,
    dtype: DType,
    key: &Key,
    spans: Spans,
    ptrs: Ptrs,
) -> Result<(Choice, Option<Arc<LtDescriptors>>)> {
    let mut slot = choices::lookup_slot(key);
    if slot.is_none() {
        if let Some(path) = &ctx.config().tuning_cache {
            match device_tag(ctx) {
                Ok(tag) => choices::ensure_loaded(path, key.device, &tag, capacity(ctx)),
                Err(e) => tracing::warn!(
                    path = %path.display(),
                    error = %e,
                    "GEMM tuning cache not read: the library versions are unknown"
                ),
            }
            slot = choices::lookup_slot(key);
        }
    }
    match slot {
        Some((c, true, descriptors)) => return Ok((c, descriptors)),
        Some((c, false, _)) => match verify(ctx, p, dtype, key, &c) {
            Ok(descriptors) => {
                tracing::debug!(problem = %key, algo = %c.label(), "GEMM tuning-cache entry checked");
                choices::mark_verified(key, &c.algo, descriptors.clone());
                return Ok((c, descriptors));
            }
            Err(e) => {
                tracing::warn!(
                    problem = %key,
                    error = %e,
                    "GEMM tuning-cache entry rejected; searching again"
                );
                choices::remove(key);
            }
        },
        None => {}
    }
    match search_and_store(ctx, p, dtype, *key, spans, Some(ptrs), &mut |_| {}) {
        Ok((report, descriptors)) => Ok((report.choice, descriptors)),
        // Refused under CUDA-graph capture: the call fails with it, the key stays undecided.
        Err(e) if e.is_capture() => Err(e),
        Err(e) => {
            tracing::warn!(
                problem = %key,
                error = %e,
                "GEMM algorithm search failed; this problem uses the cuBLAS default"
            );
            let c = Choice::fallback();
            choices::insert(*key, c, true, None, capacity(ctx));
            Ok((c, None))
        }
    }
}

/// Strided batched GEMM on the Context's stream (see the module documentation): validates every
/// argument, then runs the tuned algorithm for the problem's key (searching on its first use,
/// unless [`crate::Config::gemm_search`] is off, in which case it runs the cuBLAS default). A
/// cached cuBLASLt choice reuses descriptors built once per key: the call is the validation, one
/// cache lookup and one `cublasLtMatmul`.
///
/// If a tuned algorithm fails to launch, the key falls back to the cuBLAS default (with a
/// warning) and the call is retried with it.
pub fn strided_batched<T, A, B, C>(
    ctx: &Context,
    p: &Problem,
    a: &A,
    b: &B,
    c: &mut C,
) -> Result<()>
where
    T: Element,
    A: DevicePtr<T>,
    B: DevicePtr<T>,
    C: DevicePtrMut<T>,
{
    crate::profile::stage!(Call);
    let dtype = T::DTYPE;
    let Some((spans, ptrs, _guards)) = operands!(ctx, p, T, a, b, c, output) else {
        return Ok(());
    };
    run_checked(ctx, p, dtype, spans, ptrs)
}

/// [`strided_batched`] on raw device pointers, for nnfuse's own multi-step paths (convolution)
/// whose operands live in scratch memory: the problem and the pointers are checked (extents,
/// element alignment, C not overlapping A or B), then the tuned algorithm runs as in
/// [`strided_batched`].
///
/// # Safety
/// `a`, `b` and `c` are device addresses on the Context's device that hold the problem's
/// extents of `dtype` elements, and stay valid until the queued work completes.
#[allow(dead_code)] // used by the convolution paths
pub(crate) unsafe fn strided_batched_raw(
    ctx: &Context,
    p: &Problem,
    dtype: DType,
    a: u64,
    b: u64,
    c: u64,
) -> Result<()> {
    let spans = match p.check(dtype)? {
        Validated::Empty => return Ok(()),
        Validated::Spans(s) => s,
    };
    check_pointers(&spans, dtype.size(), a, b, c)?;
    run_checked(ctx, p, dtype, spans, Ptrs { a, b, c })
}

/// A batched GEMM whose matrices are given by pointer arrays on the device (`cublasGemmBatchedEx`,
/// the default algorithm; no search): for nnfuse's own paths whose batches are not one stride
/// apart (the convolution's filter-gradient pieces). The problem's dimensions and leading
/// dimensions are checked; its strides are ignored.
///
/// # Safety
/// `arrays` is a device address on the Context's device of `3 * p.batch` device addresses (A's,
/// then B's, then C's), written in stream order before the call; each addresses a matrix of
/// `p`'s dimensions of `dtype` elements, no C overlapping another matrix; all stay valid until
/// the queued work completes.
#[allow(dead_code)] // used by the convolution paths
pub(crate) unsafe fn pointer_arrays_raw(
    ctx: &Context,
    p: &Problem,
    dtype: DType,
    arrays: u64,
) -> Result<()> {
    if let Validated::Empty = p.check(dtype)? {
        return Ok(());
    }
    if arrays == 0 || arrays % 8 != 0 {
        return Err(Error::invalid(
            "arrays",
            format!("{arrays:#x} is not an 8-byte aligned device address"),
        ));
    }
    let (_lock, h) = cublas_handle(ctx)?;
    crate::profile::stage!(Vendor);
    // SAFETY: the caller's contract; the handle is bound to the Context's stream.
    unsafe { cublas::gemm_pointer_arrays(h, p, dtype, arrays) }
}

/// The body of [`strided_batched`] once the operands are checked.
fn run_checked(ctx: &Context, p: &Problem, dtype: DType, spans: Spans, ptrs: Ptrs) -> Result<()> {
    if !ctx.config().gemm_search {
        return run_cublas(ctx, p, dtype, CublasAlgo::DEFAULT, ptrs);
    }
    let lookup = crate::profile::enter(crate::profile::Stage::Lookup);
    let align = Alignment::of(p, dtype.size(), ptrs.a, ptrs.b, ptrs.c);
    let key = Key::from_checked(ordinal(ctx), p, dtype, align);
    let (choice, descriptors) = choose(ctx, p, dtype, &key, spans, ptrs)?;
    drop(lookup);
    let result = match (&choice.algo, descriptors) {
        (Algo::Cublas(x), _) => run_cublas(ctx, p, dtype, *x, ptrs),
        (Algo::Lt(x), Some(descriptors)) => run_lt(ctx, p, &descriptors, x, ptrs),
        (Algo::Lt(x), None) => {
            // A verified cuBLASLt choice without descriptors (not expected: the search and the
            // file check keep theirs): build them once and keep them.
            tracing::debug!(problem = %key, "building cuBLASLt descriptors for a cached choice");
            LtDescriptors::new(p, dtype).and_then(|descriptors| {
                let descriptors = Arc::new(descriptors);
                choices::set_descriptors(&key, &choice.algo, descriptors.clone());
                run_lt(ctx, p, &descriptors, x, ptrs)
            })
        }
    };
    match result {
        Err(e) if choice.algo != Algo::CUBLAS_DEFAULT => {
            tracing::warn!(
                problem = %key,
                algo = %choice.label(),
                error = %e,
                "tuned GEMM algorithm failed to launch; this problem uses the cuBLAS default"
            );
            choices::insert(key, Choice::fallback(), true, None, capacity(ctx));
            run_cublas(ctx, p, dtype, CublasAlgo::DEFAULT, ptrs)
        }
        r => r,
    }
}

/// One algorithm made ready for one problem, for benchmarks and experiments: checked once
/// (`cublasLtMatmulAlgoCheck`, workspace, alignment) and, for cuBLASLt, with its descriptors
/// built once, so that [`Prepared::run`] costs what a call of a cached choice of
/// [`strided_batched`] costs: the same validation, then one library call. No search, no cache.
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use nnfuse::gemm::{self, Algo, Alignment, Prepared, Problem};
/// let ctx = nnfuse::Context::new(0)?;
/// let p = Problem::packed(16, 512, 512, 512);
/// let s = ctx.stream();
/// let a = s.alloc_zeros::<half::f16>(16 * 512 * 512)?;
/// let b = s.alloc_zeros::<half::f16>(16 * 512 * 512)?;
/// let mut c = s.alloc_zeros::<half::f16>(16 * 512 * 512)?;
/// let run = Prepared::new(&ctx, &p, nnfuse::DType::F16, &Algo::CUBLAS_DEFAULT, Alignment::MAX)?;
/// run.run(&ctx, &a, &b, &mut c)?;
/// # Ok(()) }
/// ```
pub struct Prepared {
    device: u32,
    problem: Problem,
    dtype: DType,
    algo: Algo,
    descriptors: Option<Arc<LtDescriptors>>,
    /// Bytes of alignment the cuBLASLt algorithm needs for A, B, C, D (0 for cuBLAS).
    need: [u64; 4],
}

impl fmt::Debug for Prepared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Prepared")
            .field("device", &self.device)
            .field("problem", &self.problem)
            .field("dtype", &self.dtype)
            .field("algo", &self.algo)
            .field("need", &self.need)
            .finish()
    }
}

impl Prepared {
    /// Checks `p` for `dtype` data, and `algo` for it with operands aligned as `align` (use
    /// [`Alignment::MAX`] for fresh allocations, or [`key_for`]'s); builds the cuBLASLt
    /// descriptors. Errors say why the algorithm cannot run this problem.
    pub fn new(
        ctx: &Context,
        p: &Problem,
        dtype: DType,
        algo: &Algo,
        align: Alignment,
    ) -> Result<Prepared> {
        let validated = p.check(dtype)?;
        align.check(dtype.size())?;
        let mut prepared = Prepared {
            device: ordinal(ctx),
            problem: *p,
            dtype,
            algo: *algo,
            descriptors: None,
            need: [0; 4],
        };
        match algo {
            Algo::Cublas(a) if !a.is_known() => Err(Error::invalid(
                "algo",
                format!("{} is not a cublasGemmAlgo_t value nnfuse passes", a.0),
            )),
            Algo::Cublas(_) => Ok(prepared),
            Algo::Lt(_) if validated == Validated::Empty => Ok(prepared), // run is a no-op
            Algo::Lt(a) => {
                prepared.descriptors = Some(descriptors_checked(ctx, p, dtype, a, align)?);
                prepared.need = lt::min_alignment(a);
                Ok(prepared)
            }
        }
    }

    /// The algorithm.
    pub fn algo(&self) -> &Algo {
        &self.algo
    }

    /// The problem (with the alpha and beta every run uses).
    pub fn problem(&self) -> &Problem {
        &self.problem
    }

    /// Validates the operands as [`strided_batched`] does (and that they have the data type and
    /// the alignment this was prepared for), then queues the algorithm on the Context's stream.
    pub fn run<T, A, B, C>(&self, ctx: &Context, a: &A, b: &B, c: &mut C) -> Result<()>
    where
        T: Element,
        A: DevicePtr<T>,
        B: DevicePtr<T>,
        C: DevicePtrMut<T>,
    {
        if T::DTYPE != self.dtype {
            return Err(Error::invalid(
                "a",
                format!(
                    "holds {} data; this algorithm was prepared for {}",
                    T::DTYPE,
                    self.dtype
                ),
            ));
        }
        if ordinal(ctx) != self.device {
            return Err(Error::invalid(
                "ctx",
                format!(
                    "is device {}; this algorithm was prepared on device {}",
                    ordinal(ctx),
                    self.device
                ),
            ));
        }
        let p = &self.problem;
        let Some((_spans, ptrs, _guards)) = operands!(ctx, p, T, a, b, c, output) else {
            return Ok(());
        };
        match (&self.algo, &self.descriptors) {
            (Algo::Cublas(x), _) => run_cublas(ctx, p, self.dtype, *x, ptrs),
            (Algo::Lt(x), Some(descriptors)) => {
                let have = Alignment::of(p, self.dtype.size(), ptrs.a, ptrs.b, ptrs.c);
                lt::alignment_suffices(self.need, have)?;
                run_lt(ctx, p, descriptors, x, ptrs)
            }
            (Algo::Lt(_), None) => Err(Error::NotSupported(
                "the cuBLASLt algorithm was prepared for an empty problem".into(),
            )),
        }
    }
}

/// Runs one given algorithm (benchmarks, experiments), after the same validation as
/// [`strided_batched`]; a cuBLASLt algorithm is also checked against the problem and the
/// operands' alignment, with descriptors built for this call. No search, no cache. To run an
/// algorithm many times (benchmarks), use [`Prepared`], which checks and builds once.
pub fn strided_batched_with<T, A, B, C>(
    ctx: &Context,
    p: &Problem,
    a: &A,
    b: &B,
    c: &mut C,
    algo: &Algo,
) -> Result<()>
where
    T: Element,
    A: DevicePtr<T>,
    B: DevicePtr<T>,
    C: DevicePtrMut<T>,
{
    let dtype = T::DTYPE;
    let Some((_spans, ptrs, _guards)) = operands!(ctx, p, T, a, b, c, output) else {
        return Ok(());
    };
    match algo {
        Algo::Cublas(x) => run_cublas(ctx, p, dtype, *x, ptrs),
        Algo::Lt(x) => {
            let align = Alignment::of(p, dtype.size(), ptrs.a, ptrs.b, ptrs.c);
            let descriptors = descriptors_checked(ctx, p, dtype, x, align)?;
            run_lt(ctx, p, &descriptors, x, ptrs)
        }
    }
}

/// The key [`strided_batched`] would use for these operands (checks them first).
pub fn key_for<T, A, B, C>(ctx: &Context, p: &Problem, a: &A, b: &B, c: &C) -> Result<Key>
where
    T: Element,
    A: DevicePtr<T>,
    B: DevicePtr<T>,
    C: DevicePtr<T>,
{
    let dtype = T::DTYPE;
    let Some((_spans, ptrs, _guards)) = operands!(ctx, p, T, a, b, c, output_ref) else {
        return Err(Error::invalid(
            "m",
            "the problem is empty (m, n or batch is 0): it has no key",
        ));
    };
    let align = Alignment::of(p, dtype.size(), ptrs.a, ptrs.b, ptrs.c);
    Ok(Key::from_checked(ordinal(ctx), p, dtype, align))
}

/// The in-memory choice for `key`, if any: the cost of a cached lookup.
pub fn lookup(key: &Key) -> Option<Choice> {
    choices::lookup(key)
}

/// Searches `p` for data of type `dtype` and operands aligned as `align` (use
/// [`Alignment::MAX`] for fresh allocations), on pseudo-random operands in the Context's
/// scratch (kept for later searches: see [`release_search_scratch`]); stores the winner
/// in memory and, when configured, in the tuning-cache file; reports every candidate. Searches
/// even when [`crate::Config::gemm_search`] is off or the key is cached.
pub fn search(ctx: &Context, p: &Problem, dtype: DType, align: Alignment) -> Result<SearchReport> {
    search_with(ctx, p, dtype, align, &mut |_| {})
}

/// [`search`] with a progress callback (called before each candidate and at the end).
pub fn search_with(
    ctx: &Context,
    p: &Problem,
    dtype: DType,
    align: Alignment,
    progress: &mut dyn FnMut(SearchProgress<'_>),
) -> Result<SearchReport> {
    let spans = match p.check(dtype)? {
        Validated::Empty => {
            return Err(Error::invalid(
                "m",
                "the problem is empty (m, n or batch is 0): there is nothing to search",
            ))
        }
        Validated::Spans(s) => s,
    };
    align.check(dtype.size())?;
    let key = Key::from_checked(ordinal(ctx), p, dtype, align);
    search_and_store(ctx, p, dtype, key, spans, None, progress).map(|(report, _)| report)
}

/// Searches `p` on the caller's operands, exactly as the first [`strided_batched`] call of
/// their key does (see the module documentation), and stores the winner like
/// [`search`]; reports every candidate. A and B are only read. When beta is 0, C receives the
/// cuBLAS default's result (the search's reference; a later call overwrites it); otherwise C is
/// left unchanged. Searches even when [`crate::Config::gemm_search`] is off or the key is
/// cached.
pub fn search_on<T, A, B, C>(
    ctx: &Context,
    p: &Problem,
    a: &A,
    b: &B,
    c: &mut C,
) -> Result<SearchReport>
where
    T: Element,
    A: DevicePtr<T>,
    B: DevicePtr<T>,
    C: DevicePtrMut<T>,
{
    search_on_with(ctx, p, a, b, c, &mut |_| {})
}

/// [`search_on`] with a progress callback (called before each candidate and at the end).
pub fn search_on_with<T, A, B, C>(
    ctx: &Context,
    p: &Problem,
    a: &A,
    b: &B,
    c: &mut C,
    progress: &mut dyn FnMut(SearchProgress<'_>),
) -> Result<SearchReport>
where
    T: Element,
    A: DevicePtr<T>,
    B: DevicePtr<T>,
    C: DevicePtrMut<T>,
{
    let dtype = T::DTYPE;
    let Some((spans, ptrs, _guards)) = operands!(ctx, p, T, a, b, c, output) else {
        return Err(Error::invalid(
            "m",
            "the problem is empty (m, n or batch is 0): there is nothing to search",
        ));
    };
    let align = Alignment::of(p, dtype.size(), ptrs.a, ptrs.b, ptrs.c);
    let key = Key::from_checked(ordinal(ctx), p, dtype, align);
    search_and_store(ctx, p, dtype, key, spans, Some(ptrs), progress).map(|(report, _)| report)
}
