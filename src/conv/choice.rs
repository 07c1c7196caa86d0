//! How a measured convolution decides, and where the decision is kept.
//!
//! # The first call of a problem (`auto`, or any policy with several variants)
//! [`measure`] runs every concrete route (cuDNN's algorithms, im2col + GEMM, Winograd per tile
//! and engine, direct) on the caller's inputs into scratch outputs:
//! 1. **Reference**: the forward's is nnfuse's direct kernel with an f32 output (not rounded to
//!    the data type); the gradients' (and the forward's when the direct kernel cannot run) is
//!    the incumbent's own result, widened to f32. If the reference on the caller's data is not
//!    finite everywhere or mostly zero (fewer than [`MIN_NONZERO_FRACTION`] nonzero), it cannot
//!    tell right from wrong, and pseudo-random inputs in `[-1, 1)` are used instead (said in the
//!    report).
//! 2. **Check**: each route runs once into a NaN-poisoned output and is compared with the
//!    reference on the device (relative L2 error, every element). It fails when any element is
//!    not finite or the error exceeds [`check_tolerance`]. A Winograd route is also refused when
//!    its error exceeds `max(2 x baseline, winograd_error_floor(dtype))`
//!    ([`WINOGRAD_ERROR_FACTOR`], [`winograd_error_floor`]), the baseline being cuDNN's error
//!    (its first passing algorithm), else the first passing non-Winograd route's. This run is
//!    every route's warm-up (and pays a GEMM path's first-call GEMM search).
//! 3. **Time** ([`measure_timing`]): the routes that passed take turns
//!    ([`crate::timing::time_interleaved`]), and the incumbent — the first route that passed:
//!    cuDNN's first algorithm, or without cuDNN the first candidate — is kept unless another is
//!    clearly faster by the incumbent rule the GEMM search shares (`crate::tune::rule`: at
//!    least 2 % in the median round and faster in ~90 % of rounds). A route that failed its check is never
//!    chosen.
//!
//! # Where decisions live
//! Each `Conv2d` keeps its decision per direction (the hot path). Decisions that cost something
//! (a measurement, cuDNN's Find) are also kept per process in a bounded LRU map
//! ([`crate::lru::Lru`], [`crate::Config::plan_cache_capacity`] entries), keyed by device,
//! direction, problem, dtype and every setting that changes the candidates ([`ChoiceKey`]), so
//! that another Context does not measure again; and, when [`crate::Config::tuning_cache`] is
//! set, in the tuning-cache file, under its `"conv"` member (the GEMM choices' file; each writer
//! keeps the other's part). Entries read back from the file are **trusted with the path's own
//! validation**: the route must be eligible in the problem's plan (else the entry is ignored and
//! the problem measured again), and a route that fails at run time falls back (cuDNN, else the
//! direct kernel / im2col + GEMM) with a warning, remembered. A **Winograd** route read from the
//! file ([`verify_before_use`]) is also held to the measurement's accuracy rule before it is
//! used: [`verify`] checks it with the plan's non-Winograd candidates as the baseline (steps 1
//! and 2 above, no timing; the choice's report says so, with 0 rounds); if it is refused or
//! fails, the problem is measured again, with a warning.

use std::cell::Cell;
use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use cudarc::driver::{CudaSlice, DevicePtr, PushKernelArg};
use once_cell::sync::Lazy;
use serde_json::{json, Map, Value};

use super::cudnn::{CudnnAlgo, CudnnConv, CudnnMath, CudnnPtrs};
use super::plan::{ConvPath, ConvPlan, Direction, Route};
use super::route::{self, Exec};
use super::sizes::{reduction_len, true_f32_bound};
use super::{direct, ConvShape, GraphEngine, WinogradEngine};
use crate::config::{Config, ConvAlgoPolicy, CudnnApi, WinogradGemmPolicy};
use crate::context::Context;
use crate::device_check::{diff_kernel, launch3, read_acc, stats, widen_kernel};
use crate::dtype::DType;
use crate::error::{CallExt, Error, Result};
use crate::kernels::{self, KernelFile};
use crate::layout::TensorFormat;
use crate::timing::{InterleavedOptions, Paired};
use crate::tune::budget::{
    keep_checking, one_time_ms, skipped_note, timing_deadline, Budget, ONE_TIME_CHECK_MS,
};
use crate::tune::file::{self, Section, FILE_FORMAT, FILE_VERSION};
use crate::tune::race::{ms_since, race_gpu};
use crate::tune::rule::{self, judge};
use crate::tune::store::{self, LruStore};

// ---------------------------------------------------------------------------------------------
// cuDNN's algorithm search mode.

pub use crate::config::{CudnnSearch, ENV_CONV_CUDNN_SEARCH};

/// Most of cuDNN's heuristic algorithms timed in [`CudnnSearch::Heuristic`] mode.
pub const MAX_CUDNN_CANDIDATES: usize = 5;

/// The process-wide override of [`set_cudnn_search`]: 0 none, 1 heuristic, 2 find.
static SEARCH: AtomicU8 = AtomicU8::new(0);

/// The override of [`set_cudnn_search`], if one was set.
fn search_override() -> Option<CudnnSearch> {
    match SEARCH.load(Ordering::Relaxed) {
        1 => Some(CudnnSearch::Heuristic),
        2 => Some(CudnnSearch::Find),
        _ => None,
    }
}

/// The cuDNN search mode of a convolution planned under `config` (a Context's): the override
/// of [`set_cudnn_search`] when one was set, else [`Config::cudnn_search`]
/// (`NNFUSE_CONV_CUDNN_SEARCH`, checked where the Config was read).
pub(crate) fn search_for(config: &Config) -> CudnnSearch {
    search_override().unwrap_or(config.cudnn_search)
}

/// The process's cuDNN search mode outside any Context: [`set_cudnn_search`]'s, else
/// `NNFUSE_CONV_CUDNN_SEARCH`'s as [`Config::from_env_once`] reads it (an unknown value is that
/// Config's error, [`Error::Config`] naming the variable: here heuristic), else heuristic. A
/// convolution takes its Context's [`Config::cudnn_search`] under the same override.
pub fn cudnn_search() -> CudnnSearch {
    search_override().unwrap_or_else(|| {
        Config::from_env_once()
            .map(|c| c.cudnn_search)
            .unwrap_or_default()
    })
}

const fn code(m: CudnnSearch) -> u8 {
    match m {
        CudnnSearch::Heuristic => 1,
        CudnnSearch::Find => 2,
    }
}

/// Sets the process's cuDNN search mode for convolutions planned from now on, over every
/// Context's [`Config::cudnn_search`] (a `Conv2d` already made keeps its mode).
pub fn set_cudnn_search(mode: CudnnSearch) {
    SEARCH.store(code(mode), Ordering::Relaxed);
}

// ---------------------------------------------------------------------------------------------
// Thresholds of the check.

/// Least fraction of nonzero reference elements for the caller's data to check candidates.
pub const MIN_NONZERO_FRACTION: f64 = 0.5;

/// A Winograd route is refused when its error exceeds this many times the baseline's.
pub const WINOGRAD_ERROR_FACTOR: f64 = 2.0;

/// The error below which Winograd is never refused, per data type: about half a unit in the
/// last place of a value of magnitude 1 for the halves (f16 `2^-11 ≈ 4.9e-4`, bf16
/// `2^-8 ≈ 3.9e-3`), where the output's own rounding dominates; `1e-6` for f32, so that f32 is
/// not refused for 1e-7 against cuDNN's 3e-8.
pub const fn winograd_error_floor(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-6,
        DType::F16 => 4.9e-4,
        DType::BF16 => 3.9e-3,
    }
}

/// Relative L2 error against the reference above which a route is wrong, not merely less
/// accurate: f32 `1e-4`, f16 `1e-2`, bf16 `2e-2` (a wrong kernel is off by O(1)).
pub const fn check_tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-4,
        DType::F16 => 1e-2,
        DType::BF16 => 2e-2,
    }
}

/// Whether `r` computes f32 data in true single precision: nnfuse's im2col + GEMM
/// (`CUBLAS_COMPUTE_32F`, never TF32) and direct kernel, and cuDNN's legacy algorithms with
/// `CUDNN_FMA_MATH` (the only math [`usable`](super::cudnn::usable) keeps for f32, non-fused
/// Winograd excluded). Not a graph engine config (its notes do not prove it) nor nnfuse's
/// Winograd (its transforms round). Pure.
pub(crate) fn is_true_f32(r: &Route) -> bool {
    match r.path {
        ConvPath::Im2colGemm | ConvPath::Direct | ConvPath::DirectFilter => true,
        ConvPath::Cudnn => r.cudnn_algo.is_some_and(|a| a.math == CudnnMath::Fma),
        ConvPath::CudnnGraph
        | ConvPath::CudnnDual
        | ConvPath::CudnnTiled
        | ConvPath::StemFilter
        | ConvPath::StemForward
        | ConvPath::WinogradF2x3
        | ConvPath::WinogradF4x3 => false,
    }
}

/// Whether a route of `path` may name a cuDNN graph engine config: the graph path's own, and
/// the tiled path's (the config of its tiled problem). Pure.
pub(crate) fn names_graph_engine(path: ConvPath) -> bool {
    matches!(path, ConvPath::CudnnGraph | ConvPath::CudnnTiled)
}

/// Whether a route of `path` is measured right after the incumbent
/// ([`distinct_after_incumbent`]): the dual and tiled paths and nnfuse's filter-gradient
/// kernel, which run kernels unlike the incumbent's.
fn measured_second(path: ConvPath) -> bool {
    matches!(
        path,
        ConvPath::CudnnDual
            | ConvPath::DirectFilter
            | ConvPath::CudnnTiled
            | ConvPath::StemFilter
            | ConvPath::StemForward
    )
}

/// Moves the routes of paths measured second ([`measured_second`]: `cudnn_dual`,
/// `direct_filter`, `cudnn_tiled`) right after the incumbent, in their order: each stands for
/// a kernel unlike the incumbent's, often far from it (H100, f32 3x3 64@56: the dual forward
/// 157 against 249 µs), while the graph engine configs listed before them are variants of the
/// incumbent's; under a first call's budget they must not be the routes the budget leaves out
/// (a demo on a fresh machine: cut behind ten configs). Pure.
pub(crate) fn distinct_after_incumbent(execs: &mut Vec<Exec>) {
    if execs.len() < 3 {
        return;
    }
    let rest = execs.split_off(1);
    let (second, others): (Vec<Exec>, Vec<Exec>) = rest
        .into_iter()
        .partition(|e| measured_second(e.route.path));
    execs.extend(second);
    execs.extend(others);
}

/// The order in which routes are tried for the check's reference (the first that runs gives
/// it): `execs` as measured, except that for f32 the true-f32 routes ([`is_true_f32`]) come
/// first, so that a graph engine config is never the reference of f32 routes while a true-f32
/// route runs. Pure.
pub(crate) fn reference_order(execs: &[Exec], dtype: DType) -> Vec<Exec> {
    if dtype != DType::F32 {
        return execs.to_vec();
    }
    let (exact, rest): (Vec<Exec>, Vec<Exec>) = execs.iter().partition(|e| is_true_f32(&e.route));
    exact.into_iter().chain(rest).collect()
}

/// Whether `e` is an f32 graph engine config (the dual path runs one too), which runs only once
/// checked against a true-f32 route. Pure.
pub(crate) fn needs_true_f32_check(e: &Exec, dtype: DType) -> bool {
    dtype == DType::F32
        && matches!(
            e.route.path,
            ConvPath::CudnnGraph | ConvPath::CudnnDual | ConvPath::CudnnTiled
        )
}

/// Drops the f32 graph engine configs of `execs` when no true-f32 route is among them to hold
/// them to (they would all be refused); returns why, when it dropped any. Pure.
pub(crate) fn drop_uncheckable_f32_graph(execs: &mut Vec<Exec>, dtype: DType) -> Option<String> {
    let graph = execs.iter().any(|e| needs_true_f32_check(e, dtype));
    if !graph || execs.iter().any(|e| is_true_f32(&e.route)) {
        return None;
    }
    execs.retain(|e| !needs_true_f32_check(e, dtype));
    Some(
        "f32: no true-f32 route (legacy cuDNN with FMA math, im2col + GEMM) can run beside \
         cuDNN's graph engine configs to check them, so they are not measured"
            .into(),
    )
}

/// The route a measurement that could check nothing runs unmeasured: the first of `execs`
/// that is no f32 graph engine config (those run only once checked), else the first. Pure.
pub(crate) fn unmeasured_incumbent(execs: &[Exec], dtype: DType) -> usize {
    execs
        .iter()
        .position(|e| !needs_true_f32_check(e, dtype))
        .unwrap_or(0)
}

/// The paths a plan's candidate routes are measured as: each its own, and the cuDNN route also
/// as its graph engine configs (`cudnn_graph`), which `candidate_execs` lists in its place.
/// Pure.
pub(crate) fn measured_paths(candidates: &[Route]) -> Vec<ConvPath> {
    let mut paths: Vec<ConvPath> = candidates.iter().map(|r| r.path).collect();
    if paths.contains(&ConvPath::Cudnn) && !paths.contains(&ConvPath::CudnnGraph) {
        paths.push(ConvPath::CudnnGraph);
    }
    paths
}

/// The measurement's winner `w` when its path is one of the plan's `paths`, else the fastest
/// passing candidate of those paths (a route that joined only as a check's reference — the
/// true-f32 companion of a plan listing a single graph path — does not win over the plan); `w`
/// when no candidate of the plan's paths passed. Pure.
pub(crate) fn winner_within(report: &AutoReport, w: usize, paths: &[ConvPath]) -> usize {
    let allowed = |r: &CandidateReport| paths.contains(&r.route.path);
    if report.candidates.get(w).is_none_or(allowed) {
        return w;
    }
    report
        .candidates
        .iter()
        .enumerate()
        .filter(|(_, r)| allowed(r) && passed(r))
        .filter_map(|(i, r)| r.median_ms.map(|m| (i, m)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map_or(w, |(i, _)| i)
}

/// Holds f32 graph engine configs to true f32: each that passed the check is refused when the
/// reference was not true f32 (`reference_true_f32`: nothing to hold it to) or its error exceeds
/// `bound` ([`true_f32_bound`]). No effect for f16/bf16 (their graph configs are meant to use
/// tensor cores). Pure: tested on the CPU.
pub(crate) fn refuse_untrue_f32_graph(
    reports: &mut [CandidateReport],
    dtype: DType,
    reference_true_f32: bool,
    bound: f64,
) {
    if dtype != DType::F32 {
        return;
    }
    for r in reports.iter_mut() {
        if !passed(r) || r.route.path != ConvPath::CudnnGraph {
            continue;
        }
        let why = match r.rel_l2 {
            _ if !reference_true_f32 => Some(
                "f32 through the graph API is checked against a true-f32 reference (im2col + \
                 GEMM, direct or legacy cuDNN with FMA math), and none ran"
                    .to_string(),
            ),
            Some(e) if e.is_nan() || e > bound => Some(format!(
                "relative L2 error {e:.2e} against the true-f32 reference exceeds the true-f32 \
                 bound {bound:.1e} (TF32 gives ~3e-4): not true f32"
            )),
            Some(_) => None,
            None => Some("no error measured against the true-f32 reference".to_string()),
        };
        if let Some(why) = why {
            r.outcome = Outcome::Refused(why);
        }
    }
}

/// How the measurement times its routes: no warm-up rounds (the check run was each route's),
/// samples of at least 0.1 ms, 3 to 11 rounds within 60 ms of GPU time.
pub const fn measure_timing() -> InterleavedOptions {
    InterleavedOptions {
        warmup_rounds: 0,
        min_sample_ms: 0.1,
        max_burst: 64,
        min_rounds: 3,
        max_rounds: 11,
        budget_ms: 60.0,
    }
}

/// The runoff's timing ([`rule::runoff`]): up to 9 more rounds among a few close contenders,
/// bounded by its own budget of 8 ms (no first-call deadline; at least 4 rounds).
pub(crate) const fn runoff_timing() -> InterleavedOptions {
    InterleavedOptions {
        warmup_rounds: 0,
        min_sample_ms: 0.1,
        max_burst: 64,
        min_rounds: 4,
        max_rounds: 9,
        budget_ms: 8.0,
    }
}

// ---------------------------------------------------------------------------------------------
// Choices and reports.

/// Where a decision came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChoiceOrigin {
    /// The plan had one route (and cuDNN's heuristic one algorithm): nothing to measure.
    Planned,
    /// cuDNN's Find picked the algorithm of the only route.
    CudnnFind,
    /// Measured on this process's first call (docs/CONV.md, "The first call").
    Measured,
    /// Read from the in-memory cache (another Context measured it).
    Memory,
    /// Read from the tuning-cache file.
    File,
    /// The chosen route failed at run time; this is the fallback.
    Fallback,
}

impl ChoiceOrigin {
    /// `planned`, `cudnn_find`, `measured`, `memory`, `file`, `fallback`.
    pub const fn name(self) -> &'static str {
        match self {
            ChoiceOrigin::Planned => "planned",
            ChoiceOrigin::CudnnFind => "cudnn_find",
            ChoiceOrigin::Measured => "measured",
            ChoiceOrigin::Memory => "memory",
            ChoiceOrigin::File => "file",
            ChoiceOrigin::Fallback => "fallback",
        }
    }
}

/// The decision for one direction of one problem.
#[derive(Debug, Clone, PartialEq)]
pub struct ConvChoice {
    /// What runs.
    pub route: Route,
    /// Where the decision came from.
    pub origin: ChoiceOrigin,
    /// The winner's median time when measured (µs; NaN otherwise).
    pub median_us: f64,
    /// The incumbent's median time in the same measurement (µs; NaN otherwise).
    pub incumbent_us: f64,
    /// Routes measured (0 when nothing was).
    pub candidates: u32,
    /// Notes: cuDNN algorithms excluded (workspace, math, determinism), fallbacks.
    pub notes: Vec<String>,
}

impl ConvChoice {
    /// A decision without measurement.
    pub fn planned(route: Route, origin: ChoiceOrigin) -> ConvChoice {
        ConvChoice {
            route,
            origin,
            median_us: f64::NAN,
            incumbent_us: f64::NAN,
            candidates: 0,
            notes: Vec::new(),
        }
    }
}

impl fmt::Display for ConvChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.route, self.origin.name())?;
        if self.median_us.is_finite() {
            write!(
                f,
                ", {:.1} us against the incumbent's {:.1} us among {} routes",
                self.median_us, self.incumbent_us, self.candidates
            )?;
        }
        Ok(())
    }
}

/// How one route fared in a measurement.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Checked and timed.
    Passed,
    /// Failed to run or to match the reference.
    Failed(String),
    /// Correct, but Winograd's error exceeded the allowance.
    Refused(String),
    /// Not checked or timed: the first call's decision budget was spent before its turn
    /// ([`crate::Config::conv_tune_budget_ms`]), its kernels were not compiled yet ("kernels
    /// not compiled yet (compiling in the background)"), or (a decision for accumulating
    /// calls) it cannot add to the output ("cannot add: ...").
    Skipped(String),
}

/// One route of a measurement.
#[derive(Debug, Clone, PartialEq)]
pub struct CandidateReport {
    /// The route.
    pub route: Route,
    /// Its relative L2 error against the reference (None: did not run).
    pub rel_l2: Option<f64>,
    /// How it fared.
    pub outcome: Outcome,
    /// Its median time per run (ms), when timed.
    pub median_ms: Option<f64>,
    /// Its per-round time ratio to the incumbent, when timed (not for the incumbent itself).
    pub vs_incumbent: Option<Paired>,
    /// Host time (ms) its latest timed launch took to queue, when timed.
    pub host_ms: Option<f64>,
    /// Wall time (ms) of its check run under a budget, its first-call costs (plan building,
    /// kernel loads) included; `None` when not checked or not waited for (exhaustive).
    pub check_ms: Option<f64>,
    /// Timed once only: its estimate was far slower than the fastest's under a budget.
    pub pruned: bool,
    /// Its median time per run (ms) in the runoff of the close challengers, when it ran in one.
    pub runoff_ms: Option<f64>,
}

/// Everything one measurement did.
#[derive(Debug, Clone, PartialEq)]
pub struct AutoReport {
    /// The direction measured.
    pub direction: Direction,
    /// Every route, in measuring order.
    pub candidates: Vec<CandidateReport>,
    /// Index of the incumbent (first route that passed).
    pub incumbent: usize,
    /// Index of the winner.
    pub winner: usize,
    /// What the reference was (`direct_f32` or the label of the route whose result it was).
    pub reference: String,
    /// `caller` or `random` (and why).
    pub operands: String,
    /// The baseline error Winograd is held to (cuDNN's, else the first passing non-Winograd).
    pub baseline_error: Option<f64>,
    /// The Winograd allowance: `max(2 x baseline, floor)`.
    pub winograd_allowance: f64,
    /// Timed rounds.
    pub rounds: usize,
    /// Rounds of the runoff among the challengers close to the best (0: none ran).
    pub runoff_rounds: usize,
    /// Milliseconds of the checks not charged to the budget as one-time costs (a slow check run
    /// again: what its first run took beyond the second, its kernels' loading).
    pub one_time_ms: f64,
    /// Host wall time of the whole measurement (ms), buffers and cuDNN queries included.
    pub wall_ms: f64,
    /// Of which: reference and check runs, with the first-call costs (GEMM searches,
    /// kernel loads) of the routes.
    pub check_ms: f64,
    /// Of which: the interleaved timing.
    pub timing_ms: f64,
    /// Of the timing: GPU time (ms) of the head starts queued before its samples.
    pub head_start_ms: f64,
    /// Whether the routes ran adding to the output (the decision of accumulating calls: each
    /// checked adding into a zero-filled output, timed adding), else overwriting it.
    pub accumulate: bool,
}

impl fmt::Display for AutoReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{}{} measured in {:.1} ms (check {:.1}, timing {:.1}: {} rounds, head starts {:.1}); \
             reference {}, {} operands; Winograd allowance {:.2e} (baseline {})",
            self.direction,
            if self.accumulate {
                " (accumulating: each route adds into a zero-filled output)"
            } else {
                ""
            },
            self.wall_ms,
            self.check_ms,
            self.timing_ms,
            self.rounds,
            self.head_start_ms,
            self.reference,
            self.operands,
            self.winograd_allowance,
            self.baseline_error
                .map_or_else(|| "none".to_string(), |e| format!("{e:.2e}"))
        )?;
        if self.one_time_ms > 0.0 {
            writeln!(
                f,
                "one-time costs not charged to the budget: {:.1} ms (slow checks run again)",
                self.one_time_ms
            )?;
        }
        if self.runoff_rounds > 0 {
            writeln!(
                f,
                "runoff: the challengers within {:.0} % of the best, {} more rounds among them; \
                 the lowest median wins",
                crate::tune::rule::RUNOFF_SPREAD * 100.0,
                self.runoff_rounds
            )?;
        }
        for (i, c) in self.candidates.iter().enumerate() {
            let mark = if i == self.winner {
                "*"
            } else if i == self.incumbent {
                "i"
            } else {
                " "
            };
            write!(f, " {mark} {:<40}", c.route.label())?;
            match c.rel_l2 {
                Some(e) => write!(f, " err {e:.2e}")?,
                None => write!(f, " err   -     ")?,
            }
            if let Some(t) = c.median_ms {
                write!(f, " {:>9.1} us", t * 1e3)?;
            }
            if let Some(p) = &c.vs_incumbent {
                write!(f, " {:.3}x", p.median)?;
            }
            if let Some(h) = c.host_ms {
                write!(f, " (host {:.0} us)", h * 1e3)?;
            }
            if let Some(t) = c.check_ms {
                write!(f, " [check {t:.1} ms]")?;
            }
            if c.pruned {
                write!(f, " timed once: over twice the fastest")?;
            }
            if let Some(t) = c.runoff_ms {
                write!(f, " runoff {:.1} us", t * 1e3)?;
            }
            match &c.outcome {
                Outcome::Passed => writeln!(f)?,
                Outcome::Failed(why) => writeln!(f, " FAILED: {why}")?,
                Outcome::Refused(why) => writeln!(f, " refused: {why}")?,
                Outcome::Skipped(why) => writeln!(f, " skipped: {why}")?,
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// The process-wide cache.

/// What a measured decision depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChoiceKey {
    /// Device ordinal.
    pub device: u32,
    /// Direction.
    pub direction: Direction,
    /// The problem.
    pub shape: ShapeKey,
    /// Data type.
    pub dtype: DType,
    /// Convolution policy.
    pub policy: PolicyKey,
    /// Winograd engine policy.
    pub winograd_gemm: WinogradKey,
    /// Deterministic algorithms only.
    pub deterministic: bool,
    /// Workspace cap in MiB.
    pub workspace_mb: usize,
    /// cuDNN search mode.
    pub cudnn_search: SearchKey,
    /// cuDNN API policy ([`crate::config::CudnnApi`]).
    pub cudnn_api: ApiKey,
    /// The calls' mode: `true` for a gradient added to its output (measured in that mode: the
    /// routes that can add, each timed adding), `false` for overwriting calls. Never `true`
    /// for the forward.
    pub accumulate: bool,
}

/// [`ConvShape`] as an ordered key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ShapeKey(pub [usize; 13], pub bool);

impl ShapeKey {
    /// The key of `s`.
    pub fn of(s: &ConvShape) -> ShapeKey {
        ShapeKey(
            [
                s.n,
                s.c_in,
                s.h,
                s.w,
                s.c_out,
                s.kh,
                s.kw,
                s.stride.0,
                s.stride.1,
                s.pad.0,
                s.pad.1,
                s.dilation.0,
                s.dilation.1,
            ],
            s.format == TensorFormat::Nhwc,
        )
    }

    /// The shape back.
    pub fn shape(&self) -> ConvShape {
        let v = &self.0;
        ConvShape {
            n: v[0],
            c_in: v[1],
            h: v[2],
            w: v[3],
            c_out: v[4],
            kh: v[5],
            kw: v[6],
            stride: (v[7], v[8]),
            pad: (v[9], v[10]),
            dilation: (v[11], v[12]),
            format: if self.1 {
                TensorFormat::Nhwc
            } else {
                TensorFormat::Nchw
            },
        }
    }
}

/// [`ConvAlgoPolicy`] as an ordered key (its name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyKey(pub &'static str);
/// [`WinogradGemmPolicy`] as an ordered key (its name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WinogradKey(pub &'static str);
/// [`CudnnSearch`] as an ordered key (its name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SearchKey(pub &'static str);
/// [`crate::config::CudnnApi`] as an ordered key (its name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ApiKey(pub &'static str);

impl ChoiceKey {
    /// The key of a plan's calls that overwrite (`accumulate = false`) or add to their output,
    /// under a search mode on a device (the forward's calls always overwrite).
    pub fn of(device: u32, plan: &ConvPlan, search: CudnnSearch, accumulate: bool) -> ChoiceKey {
        ChoiceKey {
            device,
            direction: plan.direction,
            shape: ShapeKey::of(&plan.shape),
            dtype: plan.dtype,
            policy: PolicyKey(plan.policy.name()),
            winograd_gemm: WinogradKey(plan.winograd_gemm.name()),
            deterministic: plan.deterministic,
            workspace_mb: plan.workspace_cap_bytes >> 20,
            cudnn_search: SearchKey(search.name()),
            cudnn_api: ApiKey(plan.cudnn_api.name()),
            accumulate: accumulate && plan.direction != Direction::Forward,
        }
    }
}

static CACHE: Lazy<Mutex<LruStore<ChoiceKey, ConvChoice>>> =
    Lazy::new(|| Mutex::new(LruStore::new(crate::config::DEFAULT_PLAN_CACHE_CAPACITY)));

fn cache() -> MutexGuard<'static, LruStore<ChoiceKey, ConvChoice>> {
    store::lock(&CACHE)
}

/// The cached decision for `key`, if any (a use for the LRU order).
pub fn lookup(key: &ChoiceKey) -> Option<ConvChoice> {
    cache().lru.get(key).cloned()
}

/// Stores a decision, keeping at most `capacity` entries (least recently used evicted).
pub(crate) fn insert(key: ChoiceKey, choice: ConvChoice, capacity: usize) {
    cache().insert(key, choice, capacity);
}

/// Entries in the process-wide cache now.
pub fn cached_len() -> usize {
    cache().lru.len()
}

/// Forgets every process-wide decision and which files were read (files are untouched); each
/// `Conv2d` still keeps its own. For tests and benchmarks.
pub fn clear() {
    cache().clear();
}

// ---------------------------------------------------------------------------------------------
// The tuning-cache file's "conv" member.

/// The device and library versions a convolution decision is valid for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConvDeviceTag {
    /// Device name.
    pub name: String,
    /// Compute capability.
    pub compute_capability: (i32, i32),
    /// cuDNN version (0 when absent).
    pub cudnn: usize,
    /// cuBLAS version (the GEMM paths' library).
    pub cublas: (i32, i32, i32),
}

impl ConvDeviceTag {
    fn to_json(&self) -> Value {
        json!({
            "name": self.name,
            "compute_capability": [self.compute_capability.0, self.compute_capability.1],
            "cudnn": self.cudnn,
            "cublas": [self.cublas.0, self.cublas.1, self.cublas.2],
        })
    }

    fn from_json(v: &Value) -> Option<ConvDeviceTag> {
        let cc = v.get("compute_capability")?.as_array()?;
        let cb = v.get("cublas")?.as_array()?;
        let i = |x: &Value| x.as_i64().and_then(|v| i32::try_from(v).ok());
        Some(ConvDeviceTag {
            name: v.get("name")?.as_str()?.to_string(),
            compute_capability: (i(cc.first()?)?, i(cc.get(1)?)?),
            cudnn: usize::try_from(v.get("cudnn")?.as_u64()?).ok()?,
            cublas: (i(cb.first()?)?, i(cb.get(1)?)?, i(cb.get(2)?)?),
        })
    }
}

impl fmt::Display for ConvDeviceTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (sm_{}{}), cuDNN {}, cuBLAS {}.{}.{}",
            self.name,
            self.compute_capability.0,
            self.compute_capability.1,
            self.cudnn,
            self.cublas.0,
            self.cublas.1,
            self.cublas.2
        )
    }
}

/// The tag of `ctx`'s device (computed once per ordinal).
pub fn device_tag(ctx: &Context) -> Result<ConvDeviceTag> {
    static TAGS: Lazy<Mutex<HashMap<usize, ConvDeviceTag>>> =
        Lazy::new(|| Mutex::new(HashMap::new()));
    let ord = ctx.info().ordinal;
    let mut tags = match TAGS.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    };
    if let Some(t) = tags.get(&ord) {
        return Ok(t.clone());
    }
    let cudnn = if crate::context::cudnn_present() {
        crate::context::cudnn_version().unwrap_or(0)
    } else {
        0
    };
    let tag = ConvDeviceTag {
        name: ctx.info().name.clone(),
        compute_capability: ctx.info().compute_capability,
        cudnn,
        cublas: crate::context::cublas_version()?,
    };
    tags.insert(ord, tag.clone());
    Ok(tag)
}

fn policy_from_name(s: &str) -> Option<&'static str> {
    s.parse::<ConvAlgoPolicy>().ok().map(ConvAlgoPolicy::name)
}

fn winograd_from_name(s: &str) -> Option<&'static str> {
    s.parse::<WinogradGemmPolicy>()
        .ok()
        .map(WinogradGemmPolicy::name)
}

fn engine_from_name(s: &str) -> Option<WinogradEngine> {
    WinogradEngine::ALL.into_iter().find(|e| e.name() == s)
}

/// One cache entry as JSON (the file's format; see docs/CONV.md).
pub fn entry_to_json(key: &ChoiceKey, c: &ConvChoice) -> Value {
    let s = key.shape.shape();
    let finite = |v: f64| v.is_finite().then_some(v);
    json!({
        "key": {
            "direction": key.direction.name(),
            "dtype": key.dtype.name(),
            "format": s.format.name(),
            "n": s.n, "c_in": s.c_in, "h": s.h, "w": s.w, "c_out": s.c_out,
            "kh": s.kh, "kw": s.kw,
            "stride": [s.stride.0, s.stride.1],
            "pad": [s.pad.0, s.pad.1],
            "dilation": [s.dilation.0, s.dilation.1],
            "policy": key.policy.0,
            "winograd_gemm": key.winograd_gemm.0,
            "deterministic": key.deterministic,
            "workspace_mb": key.workspace_mb,
            "cudnn_search": key.cudnn_search.0,
            "cudnn_api": key.cudnn_api.0,
            "accumulate": key.accumulate,
        },
        "choice": {
            "path": c.route.path.name(),
            "engine": c.route.engine.map(|e| e.name()),
            "cudnn_algo": c.route.cudnn_algo.map(|a| a.name()),
            "cudnn_math": c.route.cudnn_algo.map(|a| a.math.name()),
            "graph_engine": c.route.graph_engine.map(|e| e.label()),
            "origin": c.origin.name(),
        },
        "median_us": finite(c.median_us),
        "incumbent_us": finite(c.incumbent_us),
        "candidates": c.candidates,
    })
}

/// Parses [`entry_to_json`]'s format for device `ordinal`; why not, when it does not parse or
/// describes an impossible route.
pub fn entry_from_json(
    v: &Value,
    ordinal: u32,
) -> std::result::Result<(ChoiceKey, ConvChoice), String> {
    let k = v.get("key").ok_or("no key")?;
    let c = v.get("choice").ok_or("no choice")?;
    let key = key_from_json(k, ordinal)?;
    let route = route_from_json(c, key.direction)?;
    let f = |name: &str| v.get(name).and_then(Value::as_f64).unwrap_or(f64::NAN);
    let choice = ConvChoice {
        route,
        origin: ChoiceOrigin::File,
        median_us: f("median_us"),
        incumbent_us: f("incumbent_us"),
        candidates: v
            .get("candidates")
            .and_then(Value::as_u64)
            .map_or(0, |c| c.min(u32::MAX as u64) as u32),
        notes: Vec::new(),
    };
    Ok((key, choice))
}

/// The string field `f` of `o`.
fn str_field(o: &Value, f: &str) -> std::result::Result<String, String> {
    o.get(f)
        .and_then(Value::as_str)
        .map(String::from)
        .ok_or_else(|| format!("{f} is missing or not a string"))
}

/// The non-negative integer field `f` of `o`.
fn usize_field(o: &Value, f: &str) -> std::result::Result<usize, String> {
    o.get(f)
        .and_then(Value::as_u64)
        .and_then(|v| usize::try_from(v).ok())
        .ok_or_else(|| format!("{f} is missing or not an integer"))
}

/// The field `f` of `o` as a pair of integers.
fn pair_field(o: &Value, f: &str) -> std::result::Result<(usize, usize), String> {
    let a = o
        .get(f)
        .and_then(Value::as_array)
        .ok_or_else(|| format!("{f} is not a pair"))?;
    let g = |i: usize| a.get(i).and_then(Value::as_u64).map(|v| v as usize);
    match (a.len(), g(0), g(1)) {
        (2, Some(x), Some(y)) => Ok((x, y)),
        _ => Err(format!("{f} is not a pair of integers")),
    }
}

/// The `"key"` object of an entry, for device `ordinal`.
fn key_from_json(k: &Value, ordinal: u32) -> std::result::Result<ChoiceKey, String> {
    let num = |f: &str| usize_field(k, f);
    let pair = |f: &str| pair_field(k, f);
    let direction: Direction = str_field(k, "direction")?
        .parse()
        .map_err(|e: Error| e.to_string())?;
    let dtype: DType = str_field(k, "dtype")?
        .parse()
        .map_err(|e: Error| e.to_string())?;
    let format = match str_field(k, "format")?.as_str() {
        "nchw" => TensorFormat::Nchw,
        "nhwc" => TensorFormat::Nhwc,
        f => return Err(format!("format {f:?}")),
    };
    let shape = ConvShape {
        n: num("n")?,
        c_in: num("c_in")?,
        h: num("h")?,
        w: num("w")?,
        c_out: num("c_out")?,
        kh: num("kh")?,
        kw: num("kw")?,
        stride: pair("stride")?,
        pad: pair("pad")?,
        dilation: pair("dilation")?,
        format,
    };
    shape.out_hw().map_err(|e| e.to_string())?;
    let policy = policy_from_name(&str_field(k, "policy")?).ok_or("unknown policy")?;
    let winograd_gemm =
        winograd_from_name(&str_field(k, "winograd_gemm")?).ok_or("unknown winograd_gemm")?;
    let search =
        CudnnSearch::parse(&str_field(k, "cudnn_search")?).ok_or("unknown cudnn_search")?;
    // Entries written before the graph route existed were measured with the legacy API.
    let cudnn_api = match k.get("cudnn_api") {
        None | Some(Value::Null) => CudnnApi::Legacy.name(),
        Some(v) => v
            .as_str()
            .and_then(|n| n.parse::<CudnnApi>().ok())
            .map(CudnnApi::name)
            .ok_or("unknown cudnn_api")?,
    };
    let deterministic = k
        .get("deterministic")
        .and_then(Value::as_bool)
        .ok_or("deterministic is not a boolean")?;
    // Entries written before decisions were made per mode were measured overwriting.
    let accumulate = match k.get("accumulate") {
        None | Some(Value::Null) => false,
        Some(v) => v.as_bool().ok_or("accumulate is not a boolean")?,
    };
    if accumulate && direction == Direction::Forward {
        return Err("a forward entry never accumulates".into());
    }
    Ok(ChoiceKey {
        device: ordinal,
        direction,
        shape: ShapeKey::of(&shape),
        dtype,
        policy: PolicyKey(policy),
        winograd_gemm: WinogradKey(winograd_gemm),
        deterministic,
        workspace_mb: num("workspace_mb")?,
        cudnn_search: SearchKey(search.name()),
        cudnn_api: ApiKey(cudnn_api),
        accumulate,
    })
}

/// The `"choice"` object of an entry of direction `direction`: a route well formed for its
/// path.
fn route_from_json(c: &Value, direction: Direction) -> std::result::Result<Route, String> {
    let path: ConvPath = str_field(c, "path")?
        .parse()
        .map_err(|e: Error| e.to_string())?;
    let engine = match c.get("engine") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_str()
                .and_then(engine_from_name)
                .ok_or("unknown engine")?,
        ),
    };
    let present = |f: &str| c.get(f).filter(|v| !v.is_null());
    let cudnn_algo = match (present("cudnn_algo"), present("cudnn_math")) {
        (None, None) => None,
        (Some(a), Some(m)) => {
            let math = m
                .as_str()
                .and_then(CudnnMath::from_name)
                .ok_or("unknown cudnn_math")?;
            Some(
                a.as_str()
                    .and_then(|n| CudnnAlgo::from_name(direction, n, math))
                    .ok_or("unknown cudnn_algo")?,
            )
        }
        _ => return Err("cudnn_algo and cudnn_math go together".into()),
    };
    let graph_engine = match present("graph_engine") {
        None => None,
        Some(v) => Some(
            v.as_str()
                .and_then(GraphEngine::parse)
                .ok_or("graph_engine is not an engine config such as eng45{} or eng12{k2=1}")?,
        ),
    };
    // A cudnn_tiled choice may name the engine config of its tiled problem.
    if (path == ConvPath::CudnnGraph && graph_engine.is_none())
        || (graph_engine.is_some() && !names_graph_engine(path))
    {
        return Err(
            "a cudnn_graph choice names its graph_engine, and only it and cudnn_tiled may".into(),
        );
    }
    match path {
        ConvPath::Cudnn if cudnn_algo.is_none() || engine.is_some() => {
            return Err("a cuDNN choice names its algorithm and no engine".into())
        }
        ConvPath::CudnnGraph if engine.is_some() || cudnn_algo.is_some() => {
            return Err("a cudnn_graph choice names no Winograd engine or legacy algorithm".into())
        }
        ConvPath::WinogradF2x3 | ConvPath::WinogradF4x3
            if engine.is_none() || cudnn_algo.is_some() =>
        {
            return Err("a Winograd choice names its engine and no cuDNN algorithm".into())
        }
        ConvPath::Im2colGemm | ConvPath::Direct if engine.is_some() || cudnn_algo.is_some() => {
            return Err(format!("a {path} choice names no engine or algorithm"))
        }
        _ => {}
    }
    Ok(Route {
        path,
        engine,
        cudnn_algo,
        graph_engine,
    })
}

/// The `"conv"` member's entries for `tag` in the file at `path` (warnings for what was
/// ignored). Never fails: a missing file is empty; an unreadable or corrupt one is ignored.
pub fn load_file(
    path: &Path,
    tag: &ConvDeviceTag,
    ordinal: u32,
) -> (Vec<(ChoiceKey, ConvChoice)>, Vec<String>) {
    let mut warnings = Vec::new();
    let mut out = Vec::new();
    let text = match file::read(path) {
        Ok(Some(t)) => t,
        Ok(None) => return (out, warnings),
        Err(e) => {
            warnings.push(format!("cannot be read: {e}"));
            return (out, warnings);
        }
    };
    let doc: Value = match serde_json::from_str(&text) {
        Ok(v) => v,
        Err(e) => {
            warnings.push(format!("not valid JSON: {e}"));
            return (out, warnings);
        }
    };
    let Some(sections) = doc
        .get("conv")
        .and_then(|c| c.get("sections"))
        .and_then(Value::as_array)
    else {
        return (out, warnings);
    };
    for sec in sections {
        let Some(t) = sec.get("device").and_then(ConvDeviceTag::from_json) else {
            warnings.push("a conv section has no readable device".into());
            continue;
        };
        if t != *tag {
            continue;
        }
        for (i, e) in entries_of(sec).enumerate() {
            match entry_from_json(e, ordinal) {
                Ok(kc) => out.push(kc),
                Err(why) => warnings.push(format!("conv entry {i} ignored: {why}")),
            }
        }
    }
    (out, warnings)
}

/// The entries of a section (none when it has no array of them).
fn entries_of(sec: &Value) -> impl Iterator<Item = &Value> {
    sec.get("entries")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
}

/// Reads the file into the process-wide cache once per (file, device): entries already in
/// memory win.
pub(crate) fn ensure_loaded(path: &Path, ordinal: u32, tag: &ConvDeviceTag, capacity: usize) {
    if cache().loaded.contains(path, ordinal) {
        return;
    }
    let (entries, warnings) = load_file(path, tag, ordinal);
    for w in &warnings {
        tracing::warn!(path = %path.display(), "convolution tuning cache: {w}");
    }
    let added = {
        let mut c = cache();
        c.loaded.insert(path, ordinal);
        c.fill(entries, capacity)
    };
    if added > 0 {
        tracing::info!(path = %path.display(), entries = added, "convolution tuning cache read");
    }
}

/// Whether an entry is worth writing to the file (it cost something to find).
fn persistent(o: ChoiceOrigin) -> bool {
    matches!(
        o,
        ChoiceOrigin::Measured
            | ChoiceOrigin::CudnnFind
            | ChoiceOrigin::File
            | ChoiceOrigin::Memory
    )
}

/// The file's document as it is now, or a fresh one when it is missing or not an nnfuse tuning
/// file (which is then replaced, with a warning).
fn current_doc(path: &Path) -> Value {
    let doc = match file::read(path) {
        Ok(Some(text)) => match serde_json::from_str::<Value>(&text) {
            Ok(v) if v.get("format").and_then(Value::as_str) == Some(FILE_FORMAT) => v,
            _ => {
                tracing::warn!(
                    path = %path.display(),
                    "tuning cache is not an nnfuse tuning file; it is replaced"
                );
                Value::Null
            }
        },
        _ => Value::Null,
    };
    if doc.is_object() {
        doc
    } else {
        json!({
            "format": FILE_FORMAT,
            "version": FILE_VERSION,
            "sections": [],
        })
    }
}

/// Merges the process's entries for `tag` (device `ordinal`) into the file's `"conv"` member:
/// other devices' sections and this device's entries for other keys are kept, the GEMM part of
/// the file is untouched; written atomically under the file lock the GEMM writer shares.
pub fn save_file(path: &Path, tag: &ConvDeviceTag, ordinal: u32) -> Result<()> {
    let mine: Vec<(ChoiceKey, Value)> = cache()
        .lru
        .iter()
        .filter(|(k, c)| k.device == ordinal && persistent(c.origin))
        .map(|(k, c)| {
            let k0 = ChoiceKey { device: 0, ..*k };
            (k0, entry_to_json(&k0, c))
        })
        .collect();
    let _guard = file::lock();
    let mut doc = current_doc(path);
    let conv = doc
        .get("conv")
        .cloned()
        .filter(Value::is_object)
        .unwrap_or_else(|| json!({ "version": 1, "sections": [] }));
    let old = conv
        .get("sections")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let classify = |sec: &Value| match sec.get("device").and_then(ConvDeviceTag::from_json) {
        Some(t) if t == *tag => Section::Mine(entries_of(sec).cloned().collect()),
        Some(_) => Section::Other,
        None => Section::Unreadable,
    };
    let key_of = |e: &Value| entry_from_json(e, 0).ok().map(|(k, _)| k);
    let (mut sections, merged) = file::merge_sections(old, classify, key_of, mine);
    sections.push(json!({
        "device": tag.to_json(),
        "entries": merged,
    }));
    let mut conv_obj = Map::new();
    conv_obj.insert("version".into(), json!(1));
    conv_obj.insert("sections".into(), Value::Array(sections));
    if let Some(obj) = doc.as_object_mut() {
        obj.insert("conv".into(), Value::Object(conv_obj));
    }
    file::write_atomic(path, &file::pretty(path, &doc)?)
}

// ---------------------------------------------------------------------------------------------
// The measurement.

/// What [`measure`] works on.
pub(crate) struct MeasureInput<'a> {
    pub ctx: &'a Context,
    pub shape: &'a ConvShape,
    pub dtype: DType,
    pub direction: Direction,
    pub cudnn: Option<&'a CudnnConv>,
    /// Concrete routes in measuring order (the first is the incumbent).
    pub execs: &'a [Exec],
    /// The caller's operands by cuDNN's roles; the output role's address is never used.
    pub operands: CudnnPtrs,
    /// Element counts of the x, w and y roles.
    pub lens: [usize; 3],
    /// The decision's budget (begun with the decision: finalizing cuDNN's engine configs
    /// counted against it already).
    pub budget: Budget,
    /// Whether the forward's reference may be the direct kernel's f32 output; `false` when
    /// `conv_direct.cu` is not compiled yet under a budget (the incumbent's result then is).
    pub direct_reference: bool,
    /// Whether the routes are checked and timed adding their gradient to the output (the
    /// decision of accumulating calls; every route given can add): the output is zero-filled
    /// before each check instead of NaN-poisoned. The reference is computed overwriting.
    pub accumulate: bool,
}

/// The operands a measurement checks on and the reference computed on them.
struct Checked {
    operands: CudnnPtrs,
    /// What the reference was (`direct_f32` or a route's label).
    reference: String,
    /// Whether it was computed in true f32 (f32 data; [`is_true_f32`]).
    true_f32: bool,
    /// Which operands (`caller`, or `random (why)`).
    note: String,
    /// The pseudo-random operands' buffers, alive as long as the measurement.
    _random: Vec<CudaSlice<u8>>,
}

/// What a `Conv2d`'s first call may need besides its candidates' own kernels: the check's
/// comparisons and the timing's head start (small: waited for when not ready), the forward's
/// reference (`conv_direct.cu`) and the pseudo-random operands and GEMM search
/// (`gemm_search.cu`). Compiled in the background when a problem is planned, so that they are
/// ready by its first call.
pub(crate) static FIRST_CALL_KERNELS: [&KernelFile; 4] = [
    &kernels::CONV_CHECK,
    &kernels::TIMING,
    &kernels::GEMM_SEARCH,
    &kernels::CONV_DIRECT,
];

/// Starts compiling [`FIRST_CALL_KERNELS`] in the background (those neither ready nor in
/// progress); cheap when they are.
pub(crate) fn prepare_first_call_kernels(ctx: &Context) {
    ctx.prepare_kernels(&FIRST_CALL_KERNELS);
}

/// Which role (0 = x, 1 = w, 2 = y) is the output of `d`.
pub(crate) const fn output_role(d: Direction) -> usize {
    match d {
        Direction::Forward => 2,
        Direction::BackwardData => 0,
        Direction::BackwardFilter => 1,
    }
}

fn with_role(mut p: CudnnPtrs, role: usize, ptr: u64) -> CudnnPtrs {
    match role {
        0 => p.x = ptr,
        1 => p.w = ptr,
        _ => p.y = ptr,
    }
    p
}

fn raw_ptr(s: &CudaSlice<u8>, ctx: &Context) -> u64 {
    s.device_ptr(ctx.stream()).0
}

fn alloc_bytes(ctx: &Context, bytes: usize) -> Result<CudaSlice<u8>> {
    // SAFETY: scratch; every user writes before it reads.
    unsafe { ctx.stream().alloc::<u8>(bytes.max(256)) }.call("cuMemAllocAsync")
}

const fn uniform_kernel(d: DType) -> &'static str {
    match d {
        DType::F32 => "gemm_uniform_f32",
        DType::F16 => "gemm_uniform_f16",
        DType::BF16 => "gemm_uniform_bf16",
    }
}

fn uniform(ctx: &Context, dtype: DType, out: u64, n: usize, seed: u64) -> Result<()> {
    let f = ctx.function(&kernels::GEMM_SEARCH, uniform_kernel(dtype))?;
    let cfg = crate::util::grid_stride_config(ctx, n, 256);
    let n64 = n as u64;
    let mut l = ctx.stream().launch_builder(&f);
    l.arg(&out).arg(&n64).arg(&seed);
    // SAFETY: gemm_uniform_<t>(T*, u64 n, u64 seed) with n elements behind `out`.
    unsafe { l.launch(cfg) }.call("cuLaunchKernel(gemm_uniform)")?;
    Ok(())
}

fn poison(ctx: &Context, ptr: u64, bytes: usize) -> Result<()> {
    // 0xFF bytes are NaN in f32, f16 and bf16 alike.
    fill_bytes(ctx, ptr, bytes, 0xFF)
}

/// Sets `bytes` bytes at `ptr` to `byte` (0: zeros in f32, f16 and bf16 alike).
fn fill_bytes(ctx: &Context, ptr: u64, bytes: usize, byte: u8) -> Result<()> {
    // A raw driver call: the Context must be current on this thread.
    ctx.cuda().bind_to_thread().call("cuCtxSetCurrent")?;
    // SAFETY: `ptr` holds `bytes` bytes allocated on this stream.
    unsafe { cudarc::driver::result::memset_d8_async(ptr, byte, bytes, ctx.stream().cu_stream()) }
        .call("cuMemsetD8Async")
}

/// Measures `inp.execs` (see the module documentation) and returns the index of the winner
/// with the report. Errors: only when nothing could be checked at all (no reference); routes
/// that fail are reported, not errors.
pub(crate) fn measure(inp: &MeasureInput<'_>) -> Result<(usize, AutoReport)> {
    let t0 = Instant::now();
    let bench = Bench::new(inp)?;
    // 1. The reference, on the caller's operands or, when they cannot tell, random ones.
    let checked = bench.reference_operands()?;
    let (operands, reference, operands_note) = (
        checked.operands,
        checked.reference.clone(),
        checked.note.clone(),
    );
    // 2. Check every route against it; f32 graph configs are held to true f32, Winograd to
    // its allowance.
    let mut reports = bench.check_routes(operands)?;
    let check_ms = ms_since(t0);
    hold_to_true_f32(inp, &checked, &mut reports);
    let (baseline, allowance) = refuse_inaccurate_winograd(&mut reports, inp.dtype);
    let report = |reports: Vec<CandidateReport>,
                  incumbent,
                  winner,
                  (rounds, runoff_rounds, timing_ms, head_ms)| AutoReport {
        direction: inp.direction,
        candidates: reports,
        incumbent,
        winner,
        reference: reference.clone(),
        operands: operands_note.clone(),
        baseline_error: baseline,
        winograd_allowance: allowance,
        rounds,
        runoff_rounds,
        one_time_ms: bench.credited_ms.get(),
        wall_ms: ms_since(t0),
        check_ms,
        timing_ms,
        head_start_ms: head_ms,
        accumulate: inp.accumulate,
    };
    let alive: Vec<usize> = (0..reports.len())
        .filter(|&i| passed(&reports[i]))
        .collect();
    let Some(&incumbent) = alive.first() else {
        return Err(Error::NotSupported(format!(
            "no route passed the numerical check:\n{}",
            report(reports, 0, 0, (0, 0, 0.0, 0.0))
        )));
    };
    // 3. Time the survivors against each other; the incumbent is kept unless clearly beaten.
    let t1 = Instant::now();
    let (winner, rounds, runoff_rounds, head_ms) = if alive.len() > 1 {
        bench.time_routes(operands, &alive, &mut reports)?
    } else {
        (incumbent, 0, 0, 0.0)
    };
    let timing_ms = ms_since(t1);
    Ok((
        winner,
        report(
            reports,
            incumbent,
            winner,
            (rounds, runoff_rounds, timing_ms, head_ms),
        ),
    ))
}

/// Puts the failed check of a tuning file's route (`line`, from [`verify`]) into the report of
/// the measurement that replaced it: in place of that route's line when the measurement did
/// not run it (skipped for its budget), else appended. Pure: tested on the CPU.
pub(crate) fn with_refused(report: &mut AutoReport, line: CandidateReport) {
    match report.candidates.iter_mut().find(|c| c.route == line.route) {
        Some(c) if c.rel_l2.is_none() => *c = line,
        Some(_) => {}
        None => report.candidates.push(line),
    }
}

/// Appends the candidates a first call did not run (`routes`, each with why) to its report, as
/// `Outcome::Skipped` lines after the ones it measured (indices of the incumbent and winner
/// unchanged). Pure: tested on the CPU.
pub(crate) fn with_not_run<S: AsRef<str>>(report: &mut AutoReport, routes: &[(Route, S)]) {
    for (route, why) in routes {
        report.candidates.push(CandidateReport {
            route: *route,
            rel_l2: None,
            outcome: Outcome::Skipped(why.as_ref().to_string()),
            median_ms: None,
            vs_incumbent: None,
            host_ms: None,
            check_ms: None,
            pruned: false,
            runoff_ms: None,
        });
    }
}

/// Whether a cached `choice` for `dtype` data must pass [`verify`] before it is used: a
/// Winograd route or an f32 graph route read from the tuning file. A Winograd route's error
/// depends on the data's range, which the measurement that wrote it judged (or not: a file is
/// editable and may come from elsewhere), so it is held to the same allowance as a measured
/// one; an f32 graph engine config is held to true f32 ([`refuse_untrue_f32_graph`]) whatever
/// wrote the file (another cuDNN, or nnfuse before the check existed). Routes this process
/// measured passed those checks already. Pure: tested on the CPU.
pub(crate) fn verify_before_use(choice: &ConvChoice, dtype: DType) -> bool {
    choice.origin == ChoiceOrigin::File
        && (choice.route.path.winograd_tile().is_some()
            || (dtype == DType::F32 && choice.route.path == ConvPath::CudnnGraph))
}

/// Checks the last of `inp.execs` as [`measure`] would (steps 1 and 2: the reference, the
/// check, Winograd's allowance against the baseline among the others), without timing.
/// Returns whether it passed, and the report (its winner the route under test, 0 rounds).
pub(crate) fn verify(inp: &MeasureInput<'_>) -> Result<(bool, AutoReport)> {
    let t0 = Instant::now();
    // No budget: the route under test comes last and its allowance needs the baseline among
    // the others, so a budget that skipped them would leave a file's route unchecked.
    let unbudgeted = MeasureInput {
        budget: Budget::new(0),
        ..*inp
    };
    let inp = &unbudgeted;
    let bench = Bench::new(inp)?;
    let checked = bench.reference_operands()?;
    let mut reports = bench.check_routes(checked.operands)?;
    let check_ms = ms_since(t0);
    hold_to_true_f32(inp, &checked, &mut reports);
    let (baseline, allowance) = refuse_inaccurate_winograd(&mut reports, inp.dtype);
    let tested = reports.len().saturating_sub(1);
    let ok = reports.last().is_some_and(passed);
    let incumbent = (0..reports.len())
        .find(|&i| passed(&reports[i]))
        .unwrap_or(tested);
    Ok((
        ok,
        AutoReport {
            direction: inp.direction,
            candidates: reports,
            incumbent,
            winner: tested,
            reference: checked.reference.clone(),
            operands: checked.note.clone(),
            baseline_error: baseline,
            winograd_allowance: allowance,
            rounds: 0,
            runoff_rounds: 0,
            one_time_ms: 0.0,
            wall_ms: ms_since(t0),
            check_ms,
            timing_ms: 0.0,
            head_start_ms: 0.0,
            accumulate: inp.accumulate,
        },
    ))
}

/// The note of a report whose measurement skipped candidates for the budget (`None`: none
/// skipped).
pub(crate) fn budget_note(report: &AutoReport, budget: &Budget) -> Option<String> {
    let skipped: Vec<String> = report
        .candidates
        .iter()
        .filter(|c| matches!(c.outcome, Outcome::Skipped(_)))
        .map(|c| c.route.label())
        .collect();
    (!skipped.is_empty()).then(|| skipped_note(&skipped, budget.total_ms().unwrap_or(0.0)))
}

/// [`refuse_untrue_f32_graph`] with the measurement's reference and its problem's bound.
fn hold_to_true_f32(inp: &MeasureInput<'_>, checked: &Checked, reports: &mut [CandidateReport]) {
    let bound = true_f32_bound(reduction_len(inp.shape, inp.direction));
    refuse_untrue_f32_graph(reports, inp.dtype, checked.true_f32, bound);
}

fn passed(r: &CandidateReport) -> bool {
    r.outcome == Outcome::Passed
}

/// The Winograd allowance of a check: the baseline error (cuDNN's first passing algorithm's,
/// else the first passing non-Winograd route's) and `max(2 x baseline, floor)`. Passing
/// Winograd routes whose error exceeds it are refused (only when there is a baseline).
fn refuse_inaccurate_winograd(reports: &mut [CandidateReport], dtype: DType) -> (Option<f64>, f64) {
    let is_winograd = |r: &CandidateReport| r.route.path.winograd_tile().is_some();
    let baseline = reports
        .iter()
        .find(|r| passed(r) && r.route.path.is_cudnn())
        .or_else(|| reports.iter().find(|r| passed(r) && !is_winograd(r)))
        .and_then(|r| r.rel_l2);
    let allowance =
        (WINOGRAD_ERROR_FACTOR * baseline.unwrap_or(0.0)).max(winograd_error_floor(dtype));
    if baseline.is_some() {
        for r in reports.iter_mut() {
            if passed(r) && is_winograd(r) {
                if let Some(e) = r.rel_l2 {
                    if e > allowance {
                        r.outcome = Outcome::Refused(format!(
                            "error {e:.2e} exceeds {WINOGRAD_ERROR_FACTOR}x the baseline's \
                             {:.2e} (allowance {allowance:.2e})",
                            baseline.unwrap_or(0.0)
                        ));
                    }
                }
            }
        }
    }
    (baseline, allowance)
}

/// One measurement's buffers and how it runs a route: the routes write this measurement's own
/// output buffer; the reference goes to an f32 buffer; three doubles of `acc` per check.
struct Bench<'a> {
    inp: &'a MeasureInput<'a>,
    target: route::Target<'a>,
    out_role: usize,
    out_len: usize,
    elem: usize,
    /// The routes' output (the measurement's own buffer) and the f32 reference.
    out: u64,
    refp: u64,
    acc: CudaSlice<f64>,
    accp: u64,
    _bufs: [CudaSlice<u8>; 2],
    /// The decision's budget, its start moved past the checks' one-time costs.
    budget: Cell<Budget>,
    /// Milliseconds of one-time costs not charged so far.
    credited_ms: Cell<f64>,
}

impl<'a> Bench<'a> {
    fn new(inp: &'a MeasureInput<'a>) -> Result<Bench<'a>> {
        let ctx = inp.ctx;
        let out_role = output_role(inp.direction);
        let out_len = inp.lens[out_role];
        let elem = inp.dtype.size();
        let out_buf = alloc_bytes(ctx, out_len * elem)?;
        let ref_buf = alloc_bytes(ctx, out_len * 4)?;
        let acc = ctx
            .stream()
            .alloc_zeros::<f64>(3 * (inp.execs.len() + 2))
            .call("cuMemAllocAsync")?;
        let out = raw_ptr(&out_buf, ctx);
        let refp = raw_ptr(&ref_buf, ctx);
        let accp = raw_ptr_f64(&acc, ctx);
        Ok(Bench {
            inp,
            target: route::Target {
                ctx,
                shape: inp.shape,
                dtype: inp.dtype,
                cudnn: inp.cudnn,
                graph_plans: None,
            },
            out_role,
            out_len,
            elem,
            out,
            refp,
            acc,
            accp,
            _bufs: [out_buf, ref_buf],
            budget: Cell::new(inp.budget),
            credited_ms: Cell::new(0.0),
        })
    }

    /// The address of check slot `i` of `acc` (three doubles).
    fn acc_at(&self, i: usize) -> u64 {
        self.accp + (3 * i * std::mem::size_of::<f64>()) as u64
    }

    /// Runs route `e` on operands `p` into the measurement's output, in the measurement's
    /// mode (adding to the output when it measures accumulating calls).
    fn run(&self, e: Exec, p: CudnnPtrs) -> Result<()> {
        self.run_mode(e, p, self.inp.accumulate)
    }

    /// Runs route `e` on operands `p` into the measurement's output, adding to it with
    /// `accumulate`.
    fn run_mode(&self, e: Exec, p: CudnnPtrs, accumulate: bool) -> Result<()> {
        let out = with_role(p, self.out_role, self.out);
        // SAFETY: the caller's inputs were validated by the dispatcher (extents, device); the
        // output is this measurement's own buffer of the output's extent.
        unsafe { route::run(&self.target, self.inp.direction, e, out, accumulate) }
    }

    /// The reference on operands `p`, into the f32 reference buffer; returns its description
    /// and whether it is true f32 (f32 data computed by a true-f32 route: [`is_true_f32`]).
    fn reference(&self, p: CudnnPtrs) -> Result<(String, bool)> {
        let (ctx, dtype) = (self.inp.ctx, self.inp.dtype);
        if self.inp.direction == Direction::Forward && self.inp.direct_reference {
            // SAFETY: as `run`; ref_buf holds out_len f32.
            match unsafe {
                direct::forward_f32_out(ctx, self.inp.shape, dtype, p.x, p.w, self.refp)
            } {
                Ok(()) => return Ok(("direct_f32".into(), dtype == DType::F32)),
                Err(e) => tracing::debug!(error = %e, "direct f32 reference unavailable"),
            }
        }
        let mut last = None;
        for e in reference_order(self.inp.execs, dtype) {
            // Overwriting: the plain gradient, whatever the measurement's mode.
            match self.run_mode(e, p, false) {
                Ok(()) => {
                    let widen = widen_kernel(dtype);
                    launch3(ctx, widen, self.out, self.refp, self.out_len, None)?;
                    let exact = dtype == DType::F32 && is_true_f32(&e.route);
                    return Ok((e.route.label(), exact));
                }
                Err(err) => last = Some(err),
            }
        }
        Err(last.unwrap_or_else(|| Error::NotSupported("no route to measure".into())))
    }

    /// The operands of the check and the reference on them: the caller's, unless the reference
    /// there is not finite everywhere or mostly zero; then pseudo-random inputs (their buffers
    /// are kept in the result, to live as long as the measurement).
    fn reference_operands(&self) -> Result<Checked> {
        let (ctx, dtype, out_len) = (self.inp.ctx, self.inp.dtype, self.out_len);
        let mut operands = self.inp.operands;
        let (ref_name, true_f32) = self.reference(operands)?;
        stats(ctx, self.refp, out_len, self.acc_at(0))?;
        let a = read_acc(ctx, &self.acc)?;
        let (nonfinite, nonzero) = (a[0], a[1]);
        if !(nonfinite > 0.0 || nonzero < MIN_NONZERO_FRACTION * out_len as f64) {
            return Ok(Checked {
                operands,
                reference: ref_name,
                true_f32,
                note: "caller".to_string(),
                _random: Vec::new(),
            });
        }
        let why = if nonfinite > 0.0 {
            format!("the reference on the caller's data has {nonfinite} non-finite elements")
        } else {
            format!(
                "only {nonzero} of the reference's {out_len} elements are nonzero on the \
                 caller's data"
            )
        };
        tracing::info!(%why, "convolution measurement uses pseudo-random inputs");
        let mut random = Vec::new();
        let inputs: Vec<usize> = (0..3).filter(|&r| r != self.out_role).collect();
        for (i, &r) in inputs.iter().enumerate() {
            let buf = alloc_bytes(ctx, self.inp.lens[r] * self.elem)?;
            let ptr = raw_ptr(&buf, ctx);
            uniform(ctx, dtype, ptr, self.inp.lens[r], 0x5EED_C0DE + i as u64)?;
            operands = with_role(operands, r, ptr);
            random.push(buf);
        }
        let (ref_name, true_f32) = self.reference(operands)?;
        Ok(Checked {
            operands,
            reference: ref_name,
            true_f32,
            note: format!("random ({why})"),
            _random: random,
        })
    }

    /// Runs every route once into a NaN-poisoned output and compares it with the reference on
    /// the device (one read-back for all); a route fails when it cannot run, has a non-finite
    /// element, or its relative L2 error exceeds [`check_tolerance`]. When measuring
    /// accumulating calls, each route adds into a zero-filled output instead (its result then
    /// is the plain gradient, compared alike): the check proves the adding mode, but an element
    /// a route leaves unwritten reads 0 rather than NaN, so it is caught by the error bound
    /// only (an unwritten region of a nonzero reference), not by the non-finite count. Under a budget, routes
    /// whose turn comes after the checks' share of it is spent are skipped
    /// ([`keep_checking`]; each check waits for the GPU so that the clock sees its cost).
    /// A slow check's route run once more: what its check took beyond the rerun is a one-time
    /// cost (its kernels' module loaded at the first launch), not charged to the budget
    /// ([`one_time_ms`]); the credit so far is kept in `self.budget` and `self.credited_ms`.
    fn credit_one_time(&self, e: Exec, operands: CudnnPtrs, check_ms: f64) -> Result<()> {
        let t = Instant::now();
        // The check's comparison has consumed the output already; the next check resets it.
        if self.run(e, operands).is_err() {
            return Ok(());
        }
        self.inp.ctx.synchronize()?;
        let total = self.inp.budget.total_ms().unwrap_or(0.0);
        let ms = one_time_ms(check_ms, ms_since(t), self.credited_ms.get(), total);
        self.credited_ms.set(self.credited_ms.get() + ms);
        self.budget.set(self.budget.get().past_one_time(ms));
        Ok(())
    }

    fn check_routes(&self, operands: CudnnPtrs) -> Result<Vec<CandidateReport>> {
        let (ctx, dtype, out_len) = (self.inp.ctx, self.inp.dtype, self.out_len);
        let n = self.inp.execs.len();
        let budget = &self.inp.budget;
        let mut failed: Vec<Option<String>> = vec![None; n];
        let mut skipped = vec![false; n];
        let mut check_ms: Vec<Option<f64>> = vec![None; n];
        let mut started = Instant::now();
        for (i, e) in self.inp.execs.iter().enumerate() {
            if !budget.exhaustive() && i > 0 {
                ctx.synchronize()?;
                // The previous check, waited for: its wall time is what it cost the budget.
                let ms = ms_since(started);
                check_ms[i - 1] = Some(ms);
                let prev = self.inp.execs[i - 1];
                // Only cuDNN's: its first launch of an engine loads the engine's kernels (lazily,
                // once per process). nnfuse's own routes' first-call costs (a GEMM search) are
                // the problem's and stay charged.
                if ms > ONE_TIME_CHECK_MS && failed[i - 1].is_none() && prev.route.path.is_cudnn() {
                    self.credit_one_time(prev, operands, ms)?;
                }
            }
            let b = self.budget.get();
            if !keep_checking(i, b.spent_ms(), b.total_ms()) {
                skipped[i..].iter_mut().for_each(|s| *s = true);
                break;
            }
            started = Instant::now();
            if self.inp.accumulate {
                fill_bytes(ctx, self.out, out_len * self.elem, 0)?;
            } else {
                poison(ctx, self.out, out_len * self.elem)?;
            }
            match self.run(*e, operands) {
                Ok(()) => launch3(
                    ctx,
                    diff_kernel(dtype),
                    self.out,
                    self.refp,
                    out_len,
                    Some(self.acc_at(i + 2)),
                )?,
                Err(err) => failed[i] = Some(err.to_string()),
            }
        }
        let a = read_acc(ctx, &self.acc)?;
        if let Some(last) = (0..n).rev().find(|&i| !skipped[i]) {
            if !budget.exhaustive() {
                check_ms[last] = Some(ms_since(started));
            }
        }
        let tol = check_tolerance(dtype);
        let mut reports: Vec<CandidateReport> = Vec::with_capacity(n);
        for (i, e) in self.inp.execs.iter().enumerate() {
            let (rel, outcome) = match &failed[i] {
                _ if skipped[i] => (
                    None,
                    Outcome::Skipped(format!(
                        "decision budget of {:.0} ms spent",
                        budget.total_ms().unwrap_or(0.0)
                    )),
                ),
                Some(why) => (None, Outcome::Failed(why.clone())),
                None => {
                    let (rel, bad) = judge(a.get(3 * (i + 2)..3 * (i + 3)).unwrap_or(&[]));
                    let outcome = if bad > 0.0 {
                        Outcome::Failed(format!("{bad} elements are NaN or Inf"))
                    } else if rel.is_nan() || rel > tol {
                        Outcome::Failed(format!(
                            "relative L2 error {rel:.2e} against the reference exceeds {tol:.0e}"
                        ))
                    } else {
                        Outcome::Passed
                    };
                    (Some(rel), outcome)
                }
            };
            reports.push(CandidateReport {
                route: e.route,
                rel_l2: rel,
                outcome,
                median_ms: None,
                vs_incumbent: None,
                host_ms: None,
                check_ms: check_ms[i],
                pruned: false,
                runoff_ms: None,
            });
        }
        Ok(reports)
    }

    /// Times the routes `alive` (the incumbent first) against each other and fills their
    /// reports. The winner: a route that beats the incumbent by the incumbent rule, else the
    /// incumbent; if the incumbent failed while timed, the fastest survivor by median. Returns
    /// the winner, the timed rounds and the head starts' GPU time (ms).
    fn time_routes(
        &self,
        operands: CudnnPtrs,
        alive: &[usize],
        reports: &mut [CandidateReport],
    ) -> Result<(usize, usize, usize, f64)> {
        // GPU time only: a legacy cuDNN call queues for 60-100 us of host time, more than many
        // kernels take; each burst waits behind a head start that covers its queuing.
        let deadline = timing_deadline(&self.budget.get());
        let r = self.race(operands, alive, measure_timing(), deadline)?;
        let res = &r.timing;
        for (v, &i) in alive.iter().enumerate() {
            let rep = &mut reports[i];
            rep.median_ms = res.timing(v).map(|t| t.median_ms);
            rep.host_ms = res.host_ms.get(v).copied();
            rep.pruned = res.pruned.get(v).copied().unwrap_or(false);
            if let Some(err) = &res.errors[v] {
                rep.outcome = Outcome::Failed(format!("failed while timed: {err}"));
                continue;
            }
            if v > 0 {
                rep.vs_incumbent = res.paired(0, v);
            }
        }
        let incumbent = alive[0];
        let mut best = r.challenger.map(|(v, m)| (alive[v], m));
        if !passed(&reports[incumbent]) {
            // The incumbent failed while timed: the fastest survivor by median.
            best = alive
                .iter()
                .filter(|&&i| passed(&reports[i]))
                .filter_map(|&i| reports[i].median_ms.map(|m| (i, m)))
                .min_by(|a, b| a.1.total_cmp(&b.1));
        }
        match best {
            Some((i, _)) if passed(&reports[incumbent]) => {
                let (w, runoff_rounds) = self.runoff(operands, alive, reports, i)?;
                Ok((w, res.rounds, runoff_rounds, res.head_start_ms))
            }
            Some((i, _)) => Ok((i, res.rounds, 0, res.head_start_ms)),
            None if !passed(&reports[incumbent]) => Err(Error::NotSupported(
                "every route failed while being timed".into(),
            )),
            None => Ok((incumbent, res.rounds, 0, res.head_start_ms)),
        }
    }

    /// Times the candidates `ids` (report indices, the first as the incumbent) against each
    /// other on `operands`, GPU time only.
    fn race(
        &self,
        operands: CudnnPtrs,
        ids: &[usize],
        opts: InterleavedOptions,
        deadline: Option<Instant>,
    ) -> Result<crate::tune::race::Race> {
        race_gpu(self.inp.ctx, opts, ids.len(), deadline, |v, _| {
            self.run(self.inp.execs[ids[v]], operands)
        })
    }

    /// The runoff: when challengers other than `best` beat the incumbent within
    /// [`RUNOFF_SPREAD`](crate::tune::rule::RUNOFF_SPREAD) of it, they and `best` are timed
    /// again among themselves ([`runoff_timing`]) and the lowest median wins. Returns the
    /// winner (a report index) and the runoff's rounds (0: none ran, `best` wins).
    fn runoff(
        &self,
        operands: CudnnPtrs,
        alive: &[usize],
        reports: &mut [CandidateReport],
        best: usize,
    ) -> Result<(usize, usize)> {
        let contenders = rule::runoff(
            alive[1..]
                .iter()
                .filter(|&&i| passed(&reports[i]) && !reports[i].pruned)
                .map(|&i| (i, reports[i].vs_incumbent)),
        );
        if contenders.len() < 2 {
            return Ok((best, 0));
        }
        let r = self.race(operands, &contenders, runoff_timing(), None)?;
        let medians: Vec<Option<f64>> = (0..contenders.len())
            .map(|v| match &r.timing.errors[v] {
                Some(_) => None,
                None => r.timing.timing(v).map(|t| t.median_ms),
            })
            .collect();
        for (v, &i) in contenders.iter().enumerate() {
            reports[i].runoff_ms = medians[v];
        }
        let w = rule::runoff_winner(&medians).map_or(best, |v| contenders[v]);
        tracing::debug!(
            contenders = ?contenders.iter().map(|&i| reports[i].route.label()).collect::<Vec<_>>(),
            runoff_us = ?medians.iter().map(|m| m.map(|t| t * 1e3)).collect::<Vec<_>>(),
            winner = %reports[w].route.label(),
            "runoff among the close challengers"
        );
        Ok((w, r.timing.rounds))
    }
}

fn raw_ptr_f64(s: &CudaSlice<f64>, ctx: &Context) -> u64 {
    s.device_ptr(ctx.stream()).0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conv::problem::WinogradTile;
    use crate::conv::sizes::{TRUE_F32_BOUND_CAP, TRUE_F32_BOUND_FLOOR};

    /// One candidate's line of a report: `route`, its error, time (ms) and outcome.
    fn line_of(
        route: Route,
        rel_l2: Option<f64>,
        ms: Option<f64>,
        outcome: Outcome,
    ) -> CandidateReport {
        CandidateReport {
            route,
            rel_l2,
            outcome,
            median_ms: ms,
            vs_incumbent: None,
            host_ms: None,
            check_ms: None,
            pruned: false,
            runoff_ms: None,
        }
    }

    /// A measurement's report of `candidates` (incumbent and winner the first) for the pure
    /// report functions' tests.
    fn report_of(direction: Direction, candidates: Vec<CandidateReport>) -> AutoReport {
        AutoReport {
            direction,
            candidates,
            incumbent: 0,
            winner: 0,
            reference: "direct_f32".into(),
            operands: "caller".into(),
            baseline_error: Some(1e-4),
            winograd_allowance: 4.9e-4,
            rounds: 3,
            runoff_rounds: 0,
            one_time_ms: 0.0,
            wall_ms: 1.0,
            check_ms: 0.5,
            timing_ms: 0.5,
            head_start_ms: 0.0,
            accumulate: false,
        }
    }

    /// A tuning file's route that failed its check shows in the report of the measurement that
    /// replaced it: in place of a line the budget skipped, appended when absent, and a line the
    /// measurement ran itself is kept.
    #[test]
    fn a_refused_file_route_shows_in_the_new_report() {
        let route = |path: ConvPath| Route {
            path,
            engine: path.winograd_tile().map(|_| WinogradEngine::TensorCore),
            cudnn_algo: None,
            graph_engine: None,
        };
        let line = |path, rel: Option<f64>, outcome| line_of(route(path), rel, None, outcome);
        let failed = || {
            line(
                ConvPath::WinogradF4x3,
                Some(3e-3),
                Outcome::Failed("over the allowance".into()),
            )
        };
        let report = |cands| report_of(Direction::Forward, cands);
        let skipped = Outcome::Skipped("decision budget of 70 ms spent".into());
        let mut r = report(vec![
            line(ConvPath::Im2colGemm, Some(1e-4), Outcome::Passed),
            line(ConvPath::WinogradF4x3, None, skipped),
        ]);
        with_refused(&mut r, failed());
        assert_eq!(r.candidates.len(), 2);
        assert_eq!(r.candidates[1], failed());
        let mut r = report(vec![line(
            ConvPath::Im2colGemm,
            Some(1e-4),
            Outcome::Passed,
        )]);
        with_refused(&mut r, failed());
        assert_eq!(r.candidates.len(), 2);
        assert_eq!(r.candidates[1], failed());
        let ran = line(ConvPath::WinogradF4x3, Some(2e-4), Outcome::Passed);
        let mut r = report(vec![ran.clone()]);
        with_refused(&mut r, failed());
        assert_eq!(r.candidates, vec![ran]);
    }

    /// A plan that lists one graph path measures its true-f32 companion only as the check's
    /// reference: the fastest passing route of the plan's path wins over a faster companion;
    /// the companion runs only when nothing of the plan's path passed.
    #[test]
    fn a_check_companion_does_not_win_over_the_plans_path() {
        let line =
            |path, ms: f64, outcome| line_of(Route::path(path), Some(1e-7), Some(ms), outcome);
        let report = |cands| report_of(Direction::BackwardFilter, cands);
        let tiled = [ConvPath::CudnnTiled];
        let failed = || Outcome::Failed("not true f32".into());
        // The measured tiled route 33.3 us, a slower one, the companion 29.2 us: tiled wins.
        let r = report(vec![
            line(ConvPath::CudnnTiled, 0.0333, Outcome::Passed),
            line(ConvPath::CudnnTiled, 0.0400, Outcome::Passed),
            line(ConvPath::Cudnn, 0.0292, Outcome::Passed),
        ]);
        assert_eq!(winner_within(&r, 2, &tiled), 0);
        // Nothing of the plan's path passed: the companion stays the winner.
        let r = report(vec![
            line(ConvPath::CudnnTiled, 0.0333, failed()),
            line(ConvPath::Cudnn, 0.0292, Outcome::Passed),
        ]);
        assert_eq!(winner_within(&r, 1, &tiled), 1);
        // A winner of the plan's paths is kept, even where another is faster (measure's rule).
        let both = [ConvPath::CudnnTiled, ConvPath::Cudnn];
        let r = report(vec![
            line(ConvPath::CudnnTiled, 0.0333, Outcome::Passed),
            line(ConvPath::Cudnn, 0.0292, Outcome::Passed),
        ]);
        assert_eq!(winner_within(&r, 0, &both), 0);
        assert_eq!(winner_within(&r, 1, &both), 1);
        // The cuDNN route is measured as its graph engine configs: a graph config may win an
        // `auto` plan's measurement (the check's companion of a lone tiled plan may not).
        let auto = measured_paths(&[
            Route::path(ConvPath::Cudnn),
            Route::path(ConvPath::Im2colGemm),
        ]);
        let r = report(vec![
            line(ConvPath::Im2colGemm, 0.1030, Outcome::Passed),
            line(ConvPath::CudnnGraph, 0.0280, Outcome::Passed),
        ]);
        assert_eq!(winner_within(&r, 1, &auto), 1);
        assert_eq!(
            measured_paths(&[Route::path(ConvPath::CudnnTiled)]),
            vec![ConvPath::CudnnTiled]
        );
    }

    /// Candidates not run for want of compiled kernels follow the measured lines as Skipped,
    /// leaving the winner and the incumbent where they were.
    #[test]
    fn candidates_not_run_are_skipped_lines_after_the_measured_ones() {
        let mut r = AutoReport {
            direction: Direction::Forward,
            candidates: vec![CandidateReport {
                route: Route::path(ConvPath::Im2colGemm),
                rel_l2: Some(1e-4),
                outcome: Outcome::Passed,
                median_ms: Some(0.1),
                vs_incumbent: None,
                host_ms: None,
                check_ms: None,
                pruned: false,
                runoff_ms: None,
            }],
            incumbent: 0,
            winner: 0,
            reference: "im2col_gemm".into(),
            operands: "caller".into(),
            baseline_error: Some(1e-4),
            winograd_allowance: 4.9e-4,
            rounds: 0,
            runoff_rounds: 0,
            one_time_ms: 0.0,
            wall_ms: 1.0,
            check_ms: 1.0,
            timing_ms: 0.0,
            head_start_ms: 0.0,
            accumulate: false,
        };
        let why = crate::tune::budget::NOT_COMPILED;
        with_not_run(&mut r, &[(Route::path(ConvPath::Direct), why)]);
        assert_eq!((r.winner, r.incumbent, r.candidates.len()), (0, 0, 2));
        assert_eq!(r.candidates[1].outcome, Outcome::Skipped(why.into()));
        assert_eq!(r.candidates[1].rel_l2, None);
        assert!(format!("{r}").contains("skipped: kernels not compiled yet"));
    }

    /// Only a Winograd route, or an f32 graph route, read from the tuning file is checked
    /// before use: a measured one was checked when it was measured, and the other paths' error
    /// does not depend on it.
    #[test]
    fn only_winograd_and_f32_graph_routes_from_the_file_are_verified_before_use() {
        let route = |path: ConvPath| Route {
            path,
            engine: path.winograd_tile().map(|_| WinogradEngine::TensorCore),
            cudnn_algo: None,
            graph_engine: None,
        };
        let origins = [
            ChoiceOrigin::Planned,
            ChoiceOrigin::CudnnFind,
            ChoiceOrigin::Measured,
            ChoiceOrigin::Memory,
            ChoiceOrigin::File,
            ChoiceOrigin::Fallback,
        ];
        for dtype in DType::ALL {
            for path in ConvPath::ALL {
                for origin in origins {
                    let c = ConvChoice::planned(route(path), origin);
                    let want = origin == ChoiceOrigin::File
                        && (matches!(path, ConvPath::WinogradF2x3 | ConvPath::WinogradF4x3)
                            || (path == ConvPath::CudnnGraph && dtype == DType::F32));
                    assert_eq!(
                        verify_before_use(&c, dtype),
                        want,
                        "{path} {origin:?} {dtype}"
                    );
                }
            }
        }
    }

    fn exec(route: Route) -> Exec {
        Exec {
            route,
            cudnn_ws: 0,
            winograd: None,
        }
    }

    fn graph_route(index: i64) -> Route {
        Route::graph(GraphEngine::new(index, &[]).unwrap())
    }

    fn legacy_route(math: CudnnMath) -> Route {
        Route::cudnn(CudnnAlgo {
            direction: Direction::BackwardFilter,
            id: 1,
            math,
        })
    }

    fn checked(route: Route, rel: f64) -> CandidateReport {
        CandidateReport {
            route,
            rel_l2: Some(rel),
            outcome: Outcome::Passed,
            median_ms: None,
            vs_incumbent: None,
            host_ms: None,
            check_ms: None,
            pruned: false,
            runoff_ms: None,
        }
    }

    /// The bound grows with the sum's length from 1e-5 and stays at 5e-5, far below TF32's
    /// ~3e-4 and the 6.6e-4 of the engine config that had no TF32 note.
    #[test]
    fn the_true_f32_bound_follows_the_reduction_length() {
        assert_eq!(true_f32_bound(0), TRUE_F32_BOUND_FLOOR);
        assert_eq!(true_f32_bound(64 * 9), TRUE_F32_BOUND_FLOOR);
        let vgg_wgrad = true_f32_bound(16 * 56 * 56);
        assert!(
            vgg_wgrad > TRUE_F32_BOUND_FLOOR && vgg_wgrad < 3e-5,
            "{vgg_wgrad}"
        );
        assert_eq!(true_f32_bound(usize::MAX), TRUE_F32_BOUND_CAP);
        // TF32 (~3e-4) and the 6.6e-4 config stay out whatever the length.
        let tf32 = 3e-4;
        assert!(tf32 / true_f32_bound(1 << 20) > 5.9);
        assert!(true_f32_bound(1 << 20) < check_tolerance(DType::F32));
    }

    /// Which routes compute f32 in true single precision, and that the reference of f32 data
    /// is taken from one of them first (graph engine configs and Winograd last).
    #[test]
    fn an_f32_reference_comes_from_a_true_f32_route() {
        let im2col = Route::path(ConvPath::Im2colGemm);
        let wino = Route::winograd(WinogradTile::F4x3, WinogradEngine::Direct);
        assert!(is_true_f32(&im2col) && is_true_f32(&Route::path(ConvPath::Direct)));
        assert!(is_true_f32(&legacy_route(CudnnMath::Fma)));
        assert!(!is_true_f32(&legacy_route(CudnnMath::TensorOp)));
        assert!(!is_true_f32(&legacy_route(CudnnMath::Default)));
        assert!(!is_true_f32(&graph_route(0)) && !is_true_f32(&wino));
        assert!(!is_true_f32(&Route::path(ConvPath::CudnnGraph)));
        let execs = [
            exec(graph_route(45)),
            exec(graph_route(0)),
            exec(wino),
            exec(im2col),
            exec(legacy_route(CudnnMath::Fma)),
        ];
        let order: Vec<Route> = reference_order(&execs, DType::F32)
            .iter()
            .map(|e| e.route)
            .collect();
        assert_eq!(
            order,
            vec![
                im2col,
                legacy_route(CudnnMath::Fma),
                graph_route(45),
                graph_route(0),
                wino
            ]
        );
        // Halves keep the measuring order (the incumbent's result).
        let halves: Vec<Route> = reference_order(&execs, DType::F16)
            .iter()
            .map(|e| e.route)
            .collect();
        assert_eq!(halves[0], graph_route(45));
    }

    /// The dual route is measured second, whatever the number of engine configs before it;
    /// the incumbent and the others keep their order.
    #[test]
    fn the_dual_route_follows_the_incumbent() {
        let dual = Route::path(ConvPath::CudnnDual);
        let im2col = Route::path(ConvPath::Im2colGemm);
        let mut execs = vec![
            exec(graph_route(45)),
            exec(graph_route(0)),
            exec(graph_route(3)),
            exec(legacy_route(CudnnMath::Fma)),
            exec(dual),
            exec(im2col),
        ];
        distinct_after_incumbent(&mut execs);
        let order: Vec<Route> = execs.iter().map(|e| e.route).collect();
        assert_eq!(
            order,
            vec![
                graph_route(45),
                dual,
                graph_route(0),
                graph_route(3),
                legacy_route(CudnnMath::Fma),
                im2col
            ]
        );
        // Already second, alone, or absent: unchanged.
        let mut two = vec![exec(graph_route(45)), exec(dual)];
        distinct_after_incumbent(&mut two);
        assert_eq!(two[1].route, dual);
        let mut one = vec![exec(dual)];
        distinct_after_incumbent(&mut one);
        assert_eq!(one.len(), 1);
        let mut none = vec![exec(graph_route(45)), exec(im2col)];
        distinct_after_incumbent(&mut none);
        assert_eq!(none[1].route, im2col);
        // nnfuse's filter-gradient kernel likewise.
        let filter = Route::path(ConvPath::DirectFilter);
        let mut wgrad = vec![
            exec(graph_route(17)),
            exec(graph_route(0)),
            exec(im2col),
            exec(filter),
        ];
        distinct_after_incumbent(&mut wgrad);
        assert_eq!(wgrad[1].route, filter);
        assert_eq!(wgrad[3].route, im2col);
        // Two of them keep their order, both before the configs.
        let tiled = Route::path(ConvPath::CudnnTiled);
        let mut both = vec![
            exec(graph_route(17)),
            exec(graph_route(0)),
            exec(filter),
            exec(im2col),
            exec(tiled),
        ];
        distinct_after_incumbent(&mut both);
        let order: Vec<Route> = both.iter().map(|e| e.route).collect();
        assert_eq!(
            order,
            vec![graph_route(17), filter, tiled, graph_route(0), im2col]
        );
    }

    /// The gate: an f32 graph engine config is refused beyond the true-f32 bound (TF32's
    /// ~3e-4, the 6.6e-4 seen on the H100) or when the reference was not true f32; within it,
    /// or for the halves, or for other paths, nothing changes.
    #[test]
    fn the_gate_refuses_f32_graph_configs_that_are_not_true_f32() {
        let bound = true_f32_bound(5 * 31 * 13);
        let im2col = Route::path(ConvPath::Im2colGemm);
        let mut reports = vec![
            checked(graph_route(1), 1.2e-7),
            checked(graph_route(2), 3.0e-4),
            checked(graph_route(3), 6.6e-4),
            checked(graph_route(4), bound * 1.01),
            checked(graph_route(5), f64::NAN),
            checked(im2col, 3.0e-4),
        ];
        refuse_untrue_f32_graph(&mut reports, DType::F32, true, bound);
        assert_eq!(reports[0].outcome, Outcome::Passed);
        for r in &reports[1..5] {
            match &r.outcome {
                Outcome::Refused(why) => assert!(why.contains("not true f32"), "{why}"),
                o => panic!("{}: {o:?}", r.route),
            }
        }
        // Not a graph route: the check's own tolerance judged it.
        assert_eq!(reports[5].outcome, Outcome::Passed);
        // Without a true-f32 reference even an accurate-looking config is refused.
        let mut alone = vec![checked(graph_route(1), 1.2e-7)];
        refuse_untrue_f32_graph(&mut alone, DType::F32, false, bound);
        assert!(matches!(&alone[0].outcome, Outcome::Refused(w) if w.contains("none ran")));
        // Halves are not held to it.
        let mut half = vec![checked(graph_route(2), 3.0e-4)];
        refuse_untrue_f32_graph(&mut half, DType::F16, false, bound);
        assert_eq!(half[0].outcome, Outcome::Passed);
        // A failed route stays failed (not turned into a refusal).
        let mut failed = vec![checked(graph_route(2), 3.0e-4)];
        failed[0].outcome = Outcome::Failed("x".into());
        refuse_untrue_f32_graph(&mut failed, DType::F32, true, bound);
        assert_eq!(failed[0].outcome, Outcome::Failed("x".into()));
    }

    /// f32 graph configs are measured only beside a true-f32 route, and a measurement that
    /// checked nothing runs a route that needs no check.
    #[test]
    fn f32_graph_configs_never_run_unchecked() {
        let im2col = exec(Route::path(ConvPath::Im2colGemm));
        let mut only_graph = vec![exec(graph_route(1)), exec(graph_route(2))];
        let why = drop_uncheckable_f32_graph(&mut only_graph, DType::F32);
        assert!(only_graph.is_empty() && why.is_some());
        let mut with_ref = vec![exec(graph_route(1)), im2col];
        assert_eq!(drop_uncheckable_f32_graph(&mut with_ref, DType::F32), None);
        assert_eq!(with_ref.len(), 2);
        let mut halves = vec![exec(graph_route(1))];
        assert_eq!(drop_uncheckable_f32_graph(&mut halves, DType::BF16), None);
        assert_eq!(halves.len(), 1);
        assert_eq!(unmeasured_incumbent(&with_ref, DType::F32), 1);
        assert_eq!(unmeasured_incumbent(&with_ref, DType::F16), 0);
        assert!(needs_true_f32_check(&with_ref[0], DType::F32));
        assert!(!needs_true_f32_check(&with_ref[1], DType::F32));
    }

    /// `v` with `v[at[0]][at[1]] = value` is refused by `entry_from_json`, saying `why`.
    fn assert_refused(v: &Value, at: [&str; 2], value: Value, why: &str) {
        let mut bad = v.clone();
        bad[at[0]][at[1]] = value;
        let e = entry_from_json(&bad, 0).unwrap_err();
        assert!(e.contains(why), "{at:?} = {}: {e}", bad[at[0]][at[1]]);
    }

    /// A convolution takes its Context's `cudnn_search` (the library's tests set no
    /// process-wide override), not the environment's.
    #[test]
    fn the_search_mode_is_the_contexts_config() {
        assert_eq!(search_override(), None);
        for mode in [CudnnSearch::Find, CudnnSearch::Heuristic] {
            let c = Config {
                cudnn_search: mode,
                ..Config::default()
            };
            assert_eq!(search_for(&c), mode);
        }
    }

    fn key() -> ChoiceKey {
        let s = ConvShape {
            n: 3,
            c_in: 30,
            h: 31,
            w: 14,
            c_out: 129,
            kh: 3,
            kw: 3,
            stride: (1, 2),
            pad: (2, 1),
            dilation: (1, 1),
            format: TensorFormat::Nhwc,
        };
        ChoiceKey {
            device: 0,
            direction: Direction::BackwardData,
            shape: ShapeKey::of(&s),
            dtype: DType::BF16,
            policy: PolicyKey("auto"),
            winograd_gemm: WinogradKey("seed"),
            deterministic: true,
            workspace_mb: 64,
            cudnn_search: SearchKey("find"),
            cudnn_api: ApiKey("auto"),
            accumulate: false,
        }
    }

    #[test]
    fn graph_entries_round_trip_and_are_checked() {
        let k = key();
        let e = GraphEngine::new(57, &[(2, 1), (5, 0)]).unwrap();
        let c = ConvChoice {
            route: Route::graph(e),
            origin: ChoiceOrigin::Measured,
            median_us: 7.5,
            incumbent_us: 9.0,
            candidates: 6,
            notes: vec![],
        };
        let v = entry_to_json(&k, &c);
        assert_eq!(v["choice"]["graph_engine"], json!("eng57{k2=1,k5=0}"));
        assert_eq!(v["key"]["cudnn_api"], json!("auto"));
        let (k2, c2) = entry_from_json(&v, 0).unwrap();
        assert_eq!(k2, k);
        assert_eq!(c2.route, Route::graph(e));
        assert_eq!(c2.route.label(), "cudnn_graph:eng57{k2=1,k5=0}");
        // The engine config goes with the graph path only, and must parse.
        assert_refused(&v, ["choice", "graph_engine"], json!(null), "graph_engine");
        assert_refused(
            &v,
            ["choice", "graph_engine"],
            json!("engine 57"),
            "graph_engine",
        );
        assert_refused(&v, ["choice", "path"], json!("im2col_gemm"), "graph_engine");
        assert_refused(&v, ["key", "cudnn_api"], json!("backend"), "cudnn_api");
        // Entries from before the graph route: measured with the legacy API.
        let mut old = entry_to_json(
            &k,
            &ConvChoice::planned(Route::path(ConvPath::Im2colGemm), ChoiceOrigin::Measured),
        );
        if let Some(o) = old["key"].as_object_mut() {
            o.remove("cudnn_api");
        }
        if let Some(o) = old["choice"].as_object_mut() {
            o.remove("graph_engine");
        }
        assert_eq!(
            entry_from_json(&old, 0).unwrap().0.cudnn_api,
            ApiKey("legacy")
        );
    }

    #[test]
    fn entries_round_trip() {
        let k = key();
        assert_eq!(k.shape.shape().pad, (2, 1));
        for route in [
            Route::path(ConvPath::Im2colGemm),
            Route::winograd(super::super::WinogradTile::F4x3, WinogradEngine::Direct),
            Route::winograd(super::super::WinogradTile::F2x3, WinogradEngine::Fused),
            Route::cudnn(CudnnAlgo {
                direction: Direction::BackwardData,
                id: 1,
                math: CudnnMath::TensorOp,
            }),
        ] {
            let c = ConvChoice {
                route,
                origin: ChoiceOrigin::Measured,
                median_us: 12.5,
                incumbent_us: f64::NAN,
                candidates: 4,
                notes: vec![],
            };
            let v = entry_to_json(&k, &c);
            let (k2, c2) = entry_from_json(&v, 0).unwrap();
            assert_eq!(k2, k);
            assert_eq!(c2.route, route);
            assert_eq!(c2.origin, ChoiceOrigin::File);
            assert_eq!(c2.median_us, 12.5);
            assert!(c2.incumbent_us.is_nan());
            assert_eq!(c2.candidates, 4);
            // Device ordinals are the loader's.
            assert_eq!(entry_from_json(&v, 3).unwrap().0.device, 3);
        }
    }

    /// The calls' mode is part of the key and of the file's entry: an accumulating entry and an
    /// overwriting one of the same problem round-trip as different keys; an entry written before
    /// the flag existed reads as overwriting; a forward entry never accumulates.
    #[test]
    fn the_accumulate_flag_is_keyed_and_round_trips() {
        let c = ConvChoice::planned(Route::path(ConvPath::Im2colGemm), ChoiceOrigin::Measured);
        for accumulate in [false, true] {
            let k = ChoiceKey {
                accumulate,
                ..key()
            };
            let v = entry_to_json(&k, &c);
            assert_eq!(v["key"]["accumulate"], json!(accumulate));
            let (k2, _) = entry_from_json(&v, 0).unwrap();
            assert_eq!(k2, k);
        }
        assert_ne!(
            ChoiceKey {
                accumulate: true,
                ..key()
            },
            key()
        );
        // Old format: no flag (or null) means overwriting calls.
        let acc = ChoiceKey {
            accumulate: true,
            ..key()
        };
        for old in [None, Some(Value::Null)] {
            let mut v = entry_to_json(&acc, &c);
            match (v["key"].as_object_mut(), old) {
                (Some(o), None) => {
                    o.remove("accumulate");
                }
                (Some(o), Some(n)) => {
                    o.insert("accumulate".into(), n);
                }
                (None, _) => unreachable!(),
            }
            assert!(!entry_from_json(&v, 0).unwrap().0.accumulate);
        }
        let good = entry_to_json(&acc, &c);
        assert_refused(&good, ["key", "accumulate"], json!("yes"), "accumulate");
        assert_refused(
            &good,
            ["key", "direction"],
            json!("forward"),
            "never accumulates",
        );
    }

    /// The key of a plan carries the mode, and the forward's is always overwriting.
    #[test]
    fn a_plans_key_carries_the_mode() {
        let s = crate::testutil::square_conv(2, 16, 8, 16, 3, TensorFormat::Nhwc);
        let cfg = Config::default();
        for d in Direction::ALL {
            let p = crate::conv::plan(&crate::conv::ConvPlanRequest {
                shape: s,
                dtype: DType::F16,
                direction: d,
                config: &cfg,
                cudnn_present: true,
                cudnn_graph: true,
            })
            .unwrap();
            let over = ChoiceKey::of(0, &p, CudnnSearch::Heuristic, false);
            let acc = ChoiceKey::of(0, &p, CudnnSearch::Heuristic, true);
            assert!(!over.accumulate);
            assert_eq!(acc.accumulate, d != Direction::Forward, "{d}");
            assert_eq!(
                ChoiceKey {
                    accumulate: false,
                    ..acc
                },
                over
            );
        }
    }

    #[test]
    fn malformed_entries_say_why() {
        let k = key();
        let good = entry_to_json(
            &k,
            &ConvChoice::planned(Route::path(ConvPath::Direct), ChoiceOrigin::Measured),
        );
        assert_refused(
            &good,
            ["choice", "engine"],
            json!("tensor_core"),
            "names no engine",
        );
        assert_refused(
            &good,
            ["choice", "path"],
            json!("winograd_f4x3"),
            "Winograd",
        );
        assert_refused(&good, ["key", "stride"], json!([0, 1]), "stride");
        assert_refused(&good, ["key", "policy"], json!("fft"), "policy");
        assert_refused(&good, ["choice", "path"], json!("cudnn"), "cuDNN");
        let mut bad = good;
        bad["choice"]["cudnn_algo"] = json!("ALGO_0");
        assert!(entry_from_json(&bad, 0).unwrap_err().contains("together"));
    }

    #[test]
    fn file_round_trip_keeps_other_parts() {
        let dir = std::env::temp_dir().join(format!("nnfuse-conv-cache-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tuning.json");
        // A GEMM part and a foreign device's conv section that must survive.
        let other = ConvDeviceTag {
            name: "Other GPU".into(),
            compute_capability: (8, 0),
            cudnn: 90000,
            cublas: (12, 0, 0),
        };
        let start = json!({
            "format": FILE_FORMAT,
            "version": FILE_VERSION,
            "sections": [ { "device": "gemm stuff", "entries": [] } ],
            "conv": { "version": 1, "sections": [ { "device": other.to_json(), "entries": [] } ] },
        });
        std::fs::write(&path, serde_json::to_string(&start).unwrap()).unwrap();
        let tag = ConvDeviceTag {
            name: "Test GPU".into(),
            compute_capability: (9, 0),
            cudnn: 91900,
            cublas: (13, 1, 0),
        };
        let k = ChoiceKey {
            device: 77,
            ..key()
        };
        let c = ConvChoice {
            route: Route::path(ConvPath::Im2colGemm),
            origin: ChoiceOrigin::Measured,
            median_us: 3.0,
            incumbent_us: 4.0,
            candidates: 2,
            notes: vec![],
        };
        insert(k, c.clone(), 16);
        // The same problem's accumulating calls: a decision of their own, kept beside it.
        let k_acc = ChoiceKey {
            accumulate: true,
            ..k
        };
        let c_acc = ConvChoice {
            route: Route::graph(GraphEngine::new(3, &[]).unwrap()),
            ..c.clone()
        };
        insert(k_acc, c_acc.clone(), 16);
        save_file(&path, &tag, 77).unwrap();
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(doc["sections"][0]["device"], json!("gemm stuff"));
        assert_eq!(doc["conv"]["sections"].as_array().unwrap().len(), 2);
        let (mut entries, warnings) = load_file(&path, &tag, 5);
        assert!(warnings.is_empty(), "{warnings:?}");
        entries.sort_by_key(|e| e.0);
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].0, ChoiceKey { device: 5, ..k });
        assert_eq!(entries[0].1.route, c.route);
        assert_eq!(entries[1].0, ChoiceKey { device: 5, ..k_acc });
        assert_eq!(entries[1].1.route, c_acc.route);
        // Another device's tag sees nothing.
        assert!(load_file(&path, &other, 0).0.is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn thresholds_are_ordered() {
        for d in DType::ALL {
            assert!(winograd_error_floor(d) < check_tolerance(d));
        }
        assert_eq!(CudnnSearch::parse("FIND"), Some(CudnnSearch::Find));
        assert_eq!(CudnnSearch::parse("x"), None);
    }
}
