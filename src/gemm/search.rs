//! The tuner: times the cuBLAS default and cuBLASLt's heuristic candidates (plus the explicit
//! cuBLAS algorithms on GPUs older than sm_80) on the real shape and keeps the fastest that
//! computes the same result.
//!
//! The search never touches the caller's buffers: it runs on scratch copies of the operands'
//! extents, filled with deterministic pseudo-random values in [-1, 1) (C too when beta != 0, since
//! C is then an input; each candidate starts from the same C), placed at the caller's pointer
//! alignment. Each candidate runs once into a scratch C that is compared on the device with the
//! cuBLAS default's result (relative L2 within [`super::tolerance`], non-finite values only where
//! the default has the same ones); the ones that agree are timed with CUDA events
//! ([`crate::timing::time_gpu`]): a few launches per sample for kernels under 20 µs, and as many
//! samples as fit a budget of about 120 ms of GPU time for the whole search (at least one per
//! candidate). Each launch does what a call of [`super::strided_batched`] does for that
//! algorithm (cuBLASLt descriptors included), so that when the host is the bottleneck (tiny
//! GEMMs) its cost is measured too. The fastest median wins, except that the cuBLAS default is kept unless a
//! candidate beats it by more than [`KEEP_DEFAULT_MARGIN`].

use std::time::Instant;

use cudarc::cublaslt::sys as lt_sys;
use cudarc::driver::{CudaSlice, DevicePtrMut, PushKernelArg};
use half::{bf16, f16};

use super::cache::{Algo, Choice, LtConfig, Origin};
use super::cublas;
use super::lt::{self, Ptrs, Scalars, WORKSPACE_BYTES};
use super::problem::{tolerance, Alignment, Key, Problem, Spans, MAX_ALIGNMENT};
use crate::context::Context;
use crate::dtype::{DType, Element};
use crate::error::{CallExt, Error, Result};
use crate::timing::{time_gpu, Timing, TimingOptions};
use crate::util::grid_stride_config;

/// The search's kernels (`kernels/gemm_search.cu`), NVRTC-compiled at first use.
pub use crate::kernels::GEMM_SEARCH as KERNELS;

/// Most cuBLASLt heuristic candidates a search asks for.
pub const MAX_LT_CANDIDATES: usize = 16;
/// GPU time (ms) the timing of all candidates of one search aims at.
pub const BUDGET_MS: f64 = 120.0;
/// A candidate must beat the cuBLAS default's median by this fraction to replace it (so that
/// noise never trades the default for an equal kernel with more host overhead).
pub const KEEP_DEFAULT_MARGIN: f64 = 0.02;
/// Shortest GPU time (ms) of one timing sample: faster kernels are launched several times per
/// sample so that event overhead does not dominate.
const MIN_SAMPLE_MS: f64 = 0.02;

/// How one candidate fared.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Agreed with the default and was timed; times are per GEMM.
    Timed {
        /// Per-GEMM statistics.
        timing: Timing,
        /// Relative L2 difference from the cuBLAS default's result (0 for the default).
        rel_diff: f64,
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

    /// A short description.
    pub fn label(&self) -> String {
        match (&self.algo, &self.config, self.heuristic_rank) {
            (Algo::Cublas(a), _, _) => format!("cuBLAS {}", a.name()),
            (Algo::Lt(_), Some(c), r) => format!(
                "cuBLASLt #{} {c}",
                r.map_or_else(|| "?".into(), |r| r.to_string())
            ),
            (Algo::Lt(_), None, r) => format!(
                "cuBLASLt #{} (attributes unreadable)",
                r.map_or_else(|| "?".into(), |r| r.to_string())
            ),
        }
    }
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
    /// Timed samples per candidate, and GEMMs per sample.
    pub samples: (usize, usize),
    /// Host wall time of the whole search (ms), allocation and comparisons included.
    pub wall_ms: f64,
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
    /// Candidates finished.
    pub done: usize,
    /// Candidates in all.
    pub total: usize,
    /// The candidate being worked on (empty at the end).
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
fn uniform_raw(ctx: &Context, dt: DType, ptr: u64, n: usize, seed: u64) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let f = ctx.function(&KERNELS, uniform_kernel(dt))?;
    let cfg = grid_stride_config(ctx, n, 256);
    let n64 = n as u64;
    let mut b = ctx.stream().launch_builder(&f);
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
    let (ptr, _sync) = out.device_ptr_mut(ctx.stream());
    uniform_raw(ctx, T::DTYPE, ptr, n, seed)
}

/// `(relative L2 difference, non-finite mismatches)` of `n` elements at `got` against `want`.
fn compare(ctx: &Context, dt: DType, got: u64, want: u64, n: usize) -> Result<(f64, f64)> {
    let stream = ctx.stream();
    let mut acc: CudaSlice<f64> = stream.alloc_zeros(3).call("cuMemAllocAsync")?;
    {
        let f = ctx.function(&KERNELS, diff_kernel(dt))?;
        let cfg = grid_stride_config(ctx, n, 256);
        let n64 = n as u64;
        let (acc_ptr, _sync) = acc.device_ptr_mut(stream);
        let mut b = stream.launch_builder(&f);
        b.arg(&got).arg(&want).arg(&n64).arg(&acc_ptr);
        // SAFETY: gemm_diff_<t>(const T*, const T*, u64, double*) matches; both inputs hold n
        // elements; acc holds 3 doubles; block size 256 as the kernel requires.
        unsafe { b.launch(cfg) }.call("cuLaunchKernel(gemm_diff)")?;
    }
    let v = stream.clone_dtoh(&acc).call("cuMemcpyDtoH")?;
    let (num, den, bad) = (v[0], v[1], v[2]);
    Ok(((num / den.max(1e-300)).sqrt(), bad))
}

/// A scratch buffer of `span` elements whose start has exactly `align` bytes of alignment (256:
/// as allocated), so that the search sees the caller's alignment.
struct Scratch<T> {
    buf: CudaSlice<T>,
    offset: usize,
}

impl<T: Element> Scratch<T> {
    fn new(ctx: &Context, span: usize, align: u16) -> Result<Scratch<T>> {
        let elem = std::mem::size_of::<T>();
        let offset = if align >= MAX_ALIGNMENT {
            0
        } else {
            align as usize / elem
        };
        // SAFETY: scratch memory; every element is written (uniform fill or a zero fill)
        // before anything reads it.
        let buf = unsafe {
            ctx.stream()
                .alloc::<T>(span + MAX_ALIGNMENT as usize / elem)
        }
        .call("cuMemAllocAsync (GEMM search scratch)")?;
        Ok(Scratch { buf, offset })
    }

    /// Device pointer of the whole allocation and of the operand's start.
    fn ptrs(&mut self, ctx: &Context) -> (u64, u64) {
        let elem = std::mem::size_of::<T>() as u64;
        let (base, _sync) = self.buf.device_ptr_mut(ctx.stream());
        (base, base + self.offset as u64 * elem)
    }
}

/// Runs the search for a checked problem. Holds the Context's lock throughout (the handles and
/// the workspace are used by every timed launch).
pub(crate) fn run(
    ctx: &Context,
    p: &Problem,
    dtype: DType,
    key: Key,
    spans: Spans,
    progress: &mut dyn FnMut(SearchProgress<'_>),
) -> Result<SearchReport> {
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
}

fn typed<T: Element>(
    ctx: &Context,
    p: &Problem,
    key: Key,
    spans: Spans,
    progress: &mut dyn FnMut(SearchProgress<'_>),
) -> Result<SearchReport> {
    let start = Instant::now();
    // Raw driver calls below (memset) need the device current on this thread.
    ctx.cuda().bind_to_thread().call("cuCtxSetCurrent")?;
    let dtype = T::DTYPE;
    let align: Alignment = key.align;
    let tol = tolerance(dtype, p.compute, p.k);
    let beta_zero = p.beta == 0.0;

    // Scratch operands with the caller's alignment, pseudo-random contents.
    let mut sa = Scratch::<T>::new(ctx, spans.a, align.a)?;
    let mut sb = Scratch::<T>::new(ctx, spans.b, align.b)?;
    let mut sref = Scratch::<T>::new(ctx, spans.c, align.c)?;
    let mut scand = Scratch::<T>::new(ctx, spans.c, align.c)?;
    let slack = MAX_ALIGNMENT as usize / std::mem::size_of::<T>();
    let (a_base, pa) = sa.ptrs(ctx);
    let (b_base, pb) = sb.ptrs(ctx);
    let (ref_base, pref) = sref.ptrs(ctx);
    let (cand_base, pcand) = scand.ptrs(ctx);
    uniform_raw(ctx, dtype, a_base, spans.a + slack, 0x5eed_0001)?;
    uniform_raw(ctx, dtype, b_base, spans.b + slack, 0x5eed_0002)?;
    let c_seed = 0x5eed_0003;
    // C: the same pseudo-random input for every run when beta != 0; otherwise zeros, so that the
    // elements no GEMM writes (padding) compare equal.
    let init_c = |base: u64| -> Result<()> {
        if beta_zero {
            // SAFETY: `base` holds spans.c + slack elements.
            unsafe {
                cudarc::driver::result::memset_d8_async(
                    base,
                    0,
                    (spans.c + slack) * std::mem::size_of::<T>(),
                    ctx.stream().cu_stream(),
                )
            }
            .call("cuMemsetD8Async")
        } else {
            uniform_raw(ctx, dtype, base, spans.c + slack, c_seed)
        }
    };
    init_c(ref_base)?;
    init_c(cand_base)?;

    let mut guard = ctx.lock()?;
    let blas = guard.cublas()?;
    let cc = ctx.info().compute_capability;
    let explicit_cublas = cc.0 < 8;

    // The candidates: the cuBLAS default, explicit cuBLAS algorithms where they mean something,
    // then cuBLASLt's heuristic list.
    let mut pending = vec![Pending {
        algo: Algo::CUBLAS_DEFAULT,
        config: None,
        workspace: 0,
        rank: None,
    }];
    if explicit_cublas {
        for a in cublas::explicit_algos(dtype) {
            pending.push(Pending {
                algo: Algo::Cublas(a),
                config: None,
                workspace: 0,
                rank: None,
            });
        }
    }
    let mut lt_note = None;
    let mut lt_state = None;
    match (guard.cublaslt(), lt::Plan::new(p, dtype)) {
        (Ok(h), Ok(plan)) => match plan.heuristics(h, align, WORKSPACE_BYTES, MAX_LT_CANDIDATES) {
            Ok(list) => {
                if list.is_empty() {
                    lt_note = Some("cublasLtMatmulAlgoGetHeuristic returned no algorithm".into());
                }
                for (rank, (algo, ws)) in list.into_iter().enumerate() {
                    if pending.iter().any(|q| q.algo == Algo::Lt(algo)) {
                        continue;
                    }
                    pending.push(Pending {
                        algo: Algo::Lt(algo),
                        config: lt::config_of(&algo).ok(),
                        workspace: ws,
                        rank: Some(rank),
                    });
                }
                lt_state = Some((h, plan));
            }
            Err(e) => lt_note = Some(format!("heuristic query failed: {e}")),
        },
        (Err(e), _) | (_, Err(e)) => lt_note = Some(format!("cuBLASLt unavailable: {e}")),
    }
    let workspace = if lt_state.is_some() {
        guard.workspace(WORKSPACE_BYTES)?
    } else {
        0
    };
    let lt_stream = ctx.stream().cu_stream() as lt_sys::cudaStream_t;
    let scalars = Scalars::of(p);

    let launch = |algo: &Algo, c: u64| -> Result<()> {
        let ptrs = Ptrs { a: pa, b: pb, c };
        match algo {
            // SAFETY: checked problem; scratch extents hold it; handle bound to ctx's stream.
            Algo::Cublas(a) => unsafe { cublas::gemm(blas, p, dtype, *a, ptrs) },
            // A fresh plan per launch, as the hot path does, so that the host cost of the
            // descriptors is in the measurement when the GPU outruns the host (tiny GEMMs).
            Algo::Lt(a) => match &lt_state {
                Some((h, _)) => {
                    let plan = lt::Plan::new(p, dtype)?;
                    // SAFETY: as above; `a` passed Plan::check for this problem with workspace
                    // <= WORKSPACE_BYTES.
                    unsafe {
                        plan.matmul(*h, a, &scalars, ptrs, workspace, WORKSPACE_BYTES, lt_stream)
                    }
                }
                None => Err(Error::NotSupported("cuBLASLt is unavailable".into())),
            },
        }
    };

    // Reference result, then a first estimate of the time per GEMM.
    let total = pending.len();
    progress(SearchProgress {
        done: 0,
        total,
        label: "cuBLAS default (reference)",
    });
    launch(&Algo::CUBLAS_DEFAULT, pref)?;
    let estimate = time_gpu(
        ctx,
        TimingOptions {
            warmup: 1,
            max_iters: 3,
            min_iters: 3,
            budget_ms: 0.0,
        },
        |_| launch(&Algo::CUBLAS_DEFAULT, pcand),
    )?;
    let t0 = if estimate.median_ms.is_finite() && estimate.median_ms > 0.0 {
        estimate.median_ms
    } else {
        1e-3
    };
    let reps = ((MIN_SAMPLE_MS / t0).ceil() as usize).clamp(1, 64);
    let samples = ((BUDGET_MS / (total as f64 * reps as f64 * t0)).floor() as usize)
        .saturating_sub(1)
        .clamp(1, 30);
    let opts = TimingOptions {
        warmup: 0,
        max_iters: samples,
        min_iters: samples,
        budget_ms: 0.0,
    };

    let mut candidates = Vec::with_capacity(total);
    for (i, c) in pending.into_iter().enumerate() {
        let label = Candidate {
            algo: c.algo,
            config: c.config,
            workspace: c.workspace,
            heuristic_rank: c.rank,
            outcome: Outcome::Rejected(String::new()),
        }
        .label();
        progress(SearchProgress {
            done: i,
            total,
            label: &label,
        });
        let outcome = (|| -> Result<Outcome> {
            if let (Algo::Lt(a), Some((h, plan))) = (&c.algo, &lt_state) {
                let ws = match plan.check(*h, a) {
                    Ok(ws) => ws,
                    Err(e) => return Ok(Outcome::Rejected(format!("{e}"))),
                };
                if ws > WORKSPACE_BYTES {
                    return Ok(Outcome::Rejected(format!(
                        "needs {ws} bytes of workspace, more than {WORKSPACE_BYTES}"
                    )));
                }
                if let Err(e) = lt::check_alignment(a, align) {
                    return Ok(Outcome::Rejected(e.to_string()));
                }
            }
            let rel_diff = if i == 0 {
                0.0
            } else {
                if !beta_zero {
                    init_c(cand_base)?;
                }
                if let Err(e) = launch(&c.algo, pcand) {
                    return Ok(Outcome::Rejected(format!("failed to run: {e}")));
                }
                let (rel, bad) = compare(ctx, dtype, cand_base, ref_base, spans.c + slack)?;
                if bad > 0.0 || rel.is_nan() || rel > tol {
                    return Ok(Outcome::Rejected(format!(
                        "result differs from the cuBLAS default: relative L2 {rel:.2e} \
                         (tolerance {tol:.1e}), {bad} non-finite mismatches"
                    )));
                }
                rel
            };
            let timed = time_gpu(ctx, opts, |_| {
                for _ in 0..reps {
                    launch(&c.algo, pcand)?;
                }
                Ok(())
            });
            let t = match timed {
                Ok(t) => t,
                Err(e) => return Ok(Outcome::Rejected(format!("failed while timed: {e}"))),
            };
            let per = reps as f64;
            Ok(Outcome::Timed {
                timing: Timing {
                    median_ms: t.median_ms / per,
                    min_ms: t.min_ms / per,
                    p10_ms: t.p10_ms / per,
                    p90_ms: t.p90_ms / per,
                    iters: t.iters,
                },
                rel_diff,
            })
        })()?;
        tracing::debug!(candidate = %label, ?outcome, "GEMM search candidate");
        candidates.push(Candidate {
            algo: c.algo,
            config: c.config,
            workspace: c.workspace,
            heuristic_rank: c.rank,
            outcome,
        });
    }
    drop(guard);
    ctx.synchronize()?;

    let default_ms = candidates
        .first()
        .and_then(Candidate::median_ms)
        .ok_or_else(|| Error::NotSupported("the cuBLAS default could not be timed".into()))?;
    let mut best = 0;
    for (i, c) in candidates.iter().enumerate() {
        if let (Some(t), Some(b)) = (c.median_ms(), candidates[best].median_ms()) {
            if t < b {
                best = i;
            }
        }
    }
    let best_ms = candidates[best].median_ms().unwrap_or(default_ms);
    let winner = if best != 0 && best_ms > default_ms * (1.0 - KEEP_DEFAULT_MARGIN) {
        0
    } else {
        best
    };
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
    let wall_ms = start.elapsed().as_secs_f64() * 1e3;
    progress(SearchProgress {
        done: total,
        total,
        label: "",
    });
    tracing::info!(
        problem = %key,
        candidates = candidates.len(),
        rejected,
        lt = candidates.iter().filter(|c| matches!(c.algo, Algo::Lt(_))).count(),
        explicit_cublas,
        winner = %choice.label(),
        winner_us = choice.median_us,
        default_us = choice.default_us,
        speedup = default_ms / (choice.median_us / 1e3),
        search_ms = wall_ms,
        "GEMM algorithm search"
    );
    if let Some(note) = &lt_note {
        tracing::info!(problem = %key, "GEMM search without cuBLASLt candidates: {note}");
    }
    Ok(SearchReport {
        key,
        problem: *p,
        candidates,
        winner,
        choice,
        explicit_cublas,
        lt_note,
        tolerance: tol,
        samples: (samples, reps),
        wall_ms,
    })
}
