//! The convolution plan: from (problem, data type, direction, [`Config`], whether cuDNN is
//! loaded) to the path that runs it, every path's eligibility with the reason when it is not
//! eligible, the candidates that `auto` measures on the first call, Winograd's engine and the
//! seed's tensor-core rule, scratch bytes and batch chunks — with a reason for every choice.
//! Pure: no GPU calls; runs and is tested on the CPU (`tests/conv_plan.rs`, `nnfuse plan --conv`).
//!
//! # The rules
//! - **Eligibility** ([`PathInfo`]; each path's rule in `paths.rs`), per direction:
//!   - `cudnn`: cuDNN loads, and every dimension and every tensor's element count fits cuDNN's
//!     `int` (its legacy descriptors take `int` sizes and strides).
//!   - `im2col_gemm`: one image's column matrix fits the workspace cap
//!     ([`Config::conv_workspace_mb`]; pointwise convolutions need no columns) and the GEMM's
//!     sizes fit cuBLAS's `int`. Every direction.
//!   - `winograd_f2x3` / `winograd_f4x3`: NHWC, 3x3, stride 1, dilation 1 (forward; the data
//!     gradient also needs padding <= 2), one image's transformed tensors and the transformed
//!     filter fit the cap. Not for the filter gradient (it takes im2col + GEMM or cuDNN).
//!   - `direct`: any forward problem; no gradient kernel.
//!   - `cudnn_graph`: as `cudnn`, and the loaded cuDNN has the graph API (9 or newer) and
//!     [`Config::cudnn_api`] is not `legacy`. It is not a candidate of its own: when it is
//!     eligible, the `cudnn` candidate goes through it ([`ConvPlan::cudnn_graph`]): its engine
//!     configs are `auto`'s cuDNN routes, the legacy algorithms only the fallback.
//! - **Policy** ([`ConvAlgoPolicy`]): `auto` measures every eligible path on the first call
//!   (the direct kernel only for problems under [`DIRECT_CANDIDATE_MAX_FLOPS`] or when nothing
//!   else runs); a forced policy takes its path, or, where that path is not eligible, falls back
//!   to cuDNN, else to the direct kernel (forward) or im2col + GEMM (gradients), and says why.
//!   `winograd` measures both tile sizes.
//! - **Winograd's engine** ([`WinogradGemmPolicy`]): `seed` follows the seed's tensor-core rule
//!   ([`tensor_core_rule`](crate::conv::internals::tensor_core_rule)) on the batched multiply of
//!   the largest batch chunk; `tensor_core` and `direct` force an engine; `fused` forces the
//!   fused kernel where it can run ([`fused_eligible`](crate::conv::internals::fused_eligible):
//!   f16/bf16, channel counts multiples of 8), else follows the rule; `auto` measures both
//!   batched-multiply engines (the rule's first) and then the fused one where it can run.
//! - **Candidates** are measured in order; the first is the incumbent that a later one must
//!   clearly beat: cuDNN, then im2col + GEMM, Winograd F(4x4,3x3), F(2x2,3x3), direct — except
//!   the f32 NCHW pointwise filter gradient that im2col + GEMM computes in pieces read in place
//!   (it searches no GEMM at its first call), which leads.

use std::fmt;

use serde_json::{json, Value};

pub use super::paths::{
    cudnn_int_limits, ConvPath, ConvPlanRequest, EngineDecision, PathInfo, WinogradInfo, INT_MAX,
};
use super::paths::{graph_refusal, info_ineligible};
pub use super::problem::Direction;
use super::problem::{ConvShape, CudnnAlgo, GraphEngine, WinogradEngine, WinogradTile};
use crate::config::{Config, ConvAlgoPolicy, CudnnApi, WinogradGemmPolicy};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::TensorFormat;

/// Problems with at most this many FLOPs (`2·N·K·C·R·S·OH·OW`) include the direct kernel among
/// `auto`'s candidates: it has no tensor cores and on large layers would only cost measurement
/// time.
pub const DIRECT_CANDIDATE_MAX_FLOPS: f64 = 1e9;

/// One concrete way to run a convolution: a path, Winograd's engine for a Winograd path,
/// cuDNN's algorithm for the cuDNN path and cuDNN's engine config for the graph path (`None` in
/// a plan: cuDNN's choice is made on the GPU at the first call).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Route {
    /// The path.
    pub path: ConvPath,
    /// Winograd's batched-multiply engine (Winograd paths only).
    pub engine: Option<WinogradEngine>,
    /// cuDNN's algorithm (cuDNN path only; `None`: the one cuDNN's search picks).
    pub cudnn_algo: Option<CudnnAlgo>,
    /// cuDNN's graph engine config (graph path only; `None`: the first one the policy admits
    /// that finalizes).
    pub graph_engine: Option<GraphEngine>,
}

impl Route {
    /// A route of `path` with no engine or algorithm fixed.
    pub const fn path(path: ConvPath) -> Route {
        Route {
            path,
            engine: None,
            cudnn_algo: None,
            graph_engine: None,
        }
    }

    /// A Winograd route.
    pub const fn winograd(tile: WinogradTile, engine: WinogradEngine) -> Route {
        Route {
            path: ConvPath::winograd(tile),
            engine: Some(engine),
            cudnn_algo: None,
            graph_engine: None,
        }
    }

    /// A cuDNN route with one algorithm.
    pub const fn cudnn(algo: CudnnAlgo) -> Route {
        Route {
            path: ConvPath::Cudnn,
            engine: None,
            cudnn_algo: Some(algo),
            graph_engine: None,
        }
    }

    /// A cuDNN graph route with one engine config.
    pub const fn graph(engine: GraphEngine) -> Route {
        Route {
            path: ConvPath::CudnnGraph,
            engine: None,
            cudnn_algo: None,
            graph_engine: Some(engine),
        }
    }

    /// `cudnn:IMPLICIT_PRECOMP_GEMM/tensor_op`, `cudnn_graph:eng45{}`,
    /// `winograd_f4x3/tensor_core`, `im2col_gemm`.
    pub fn label(&self) -> String {
        match (self.engine, self.cudnn_algo, self.graph_engine) {
            (Some(e), _, _) => format!("{}/{}", self.path, e.name()),
            (None, Some(a), _) => format!("{}:{}", self.path, a.label()),
            (None, None, Some(g)) => format!("{}:{}", self.path, g.label()),
            (None, None, None) => self.path.name().to_string(),
        }
    }
}

impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label())
    }
}

/// The decision for one (problem, dtype, direction) under one configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ConvPlan {
    /// The problem.
    pub shape: ConvShape,
    /// Output size `(oh, ow)`.
    pub out_hw: (usize, usize),
    /// Element type.
    pub dtype: DType,
    /// Which computation.
    pub direction: Direction,
    /// The path that runs: the planned one, or, when [`ConvPlan::measured`], the incumbent
    /// (first candidate) until the first call's measurement decides.
    pub path: ConvPath,
    /// Winograd's engine of [`ConvPlan::path`] (the incumbent's, when measured).
    pub engine: Option<WinogradEngine>,
    /// Whether the first call measures [`ConvPlan::candidates`] against each other.
    pub measured: bool,
    /// What the first call measures, in order (the first is the incumbent); one entry when
    /// nothing is measured. A cuDNN entry stands for cuDNN's engine configs (graph API, when
    /// [`ConvPlan::cudnn_graph`]) or algorithms (legacy API), chosen on the GPU.
    pub candidates: Vec<Route>,
    /// Every path's eligibility that the plan lists as a candidate of its own, in
    /// [`ConvPath::ALL`] order.
    pub paths: Vec<PathInfo>,
    /// The eligibility of the paths that are an API of another path's candidate rather than
    /// candidates of their own: `cudnn_graph`, which the `cudnn` candidate goes through when
    /// [`ConvPlan::cudnn_graph`].
    pub api_paths: Vec<PathInfo>,
    /// Why the policy's path could not be taken, when the plan fell back.
    pub fallback: Option<String>,
    /// False when no path can run the problem (a gradient without cuDNN whose columns exceed
    /// the cap): the operation then returns [`Error::NotSupported`] with the reasons.
    pub runnable: bool,
    /// Direct-convolution FLOPs, `2·N·K·C·R·S·OH·OW` (the same for every direction).
    pub flops: f64,
    /// The convolution policy the plan was made under.
    pub policy: ConvAlgoPolicy,
    /// Winograd's engine policy.
    pub winograd_gemm: WinogradGemmPolicy,
    /// Only deterministic algorithms.
    pub deterministic: bool,
    /// The workspace cap in bytes ([`Config::conv_workspace_bytes`]).
    pub workspace_cap_bytes: usize,
    /// Whether cuDNN was taken to be present.
    pub cudnn_present: bool,
    /// The cuDNN API policy the plan was made under.
    pub cudnn_api: CudnnApi,
    /// Whether the `cudnn` candidate runs through the graph API (its engine configs measured at
    /// the first call; the legacy algorithms only if none finalizes) rather than the legacy
    /// calls; why, in [`ConvPlan::reasons`].
    pub cudnn_graph: bool,
    /// Every reason, in words.
    pub reasons: Vec<String>,
}

impl ConvPlan {
    /// The eligibility of `path`.
    pub fn info(&self, path: ConvPath) -> &PathInfo {
        // `paths` and `api_paths` together hold every path (built by `plan`).
        info_in(&self.paths, &self.api_paths, path)
    }

    /// Whether `path` can run the problem.
    pub fn eligible(&self, path: ConvPath) -> bool {
        self.info(path).eligible
    }

    /// Why `path` cannot run an accumulating call of this plan's direction (a gradient added
    /// to its output, as [`crate::conv::Conv2d::backward_data_into`] and
    /// [`crate::conv::Conv2d::backward_filter`] with `accumulate`), or `None` when it can.
    /// Winograd's data gradient cannot (its output transform has no beta); cuDNN (legacy
    /// `beta = 1`, the graph API's beta attribute) and im2col + GEMM (col2im or the GEMM's
    /// beta adds) can. The forward never accumulates.
    pub fn accumulate_refusal(&self, path: ConvPath) -> Option<&'static str> {
        match self.direction {
            Direction::Forward => Some("the forward never accumulates"),
            d => path.rule().accumulate_refusal(d),
        }
    }

    /// The route the plan starts with (the incumbent when measured).
    pub fn route(&self) -> Route {
        self.candidates
            .first()
            .copied()
            .unwrap_or(Route::path(self.path))
    }

    /// Bytes of scratch the planned path uses (see [`PathInfo::scratch_bytes`]).
    pub fn scratch_bytes(&self) -> usize {
        self.info(self.path).scratch_bytes
    }

    /// `graph` or `legacy`: the API the `cudnn` candidate runs through; `None` when cuDNN is
    /// not among the candidates.
    pub fn cudnn_api_used(&self) -> Option<&'static str> {
        if !self.candidates.iter().any(|r| r.path.is_cudnn()) {
            return None;
        }
        Some(if self.cudnn_graph { "graph" } else { "legacy" })
    }

    /// The route to take when the chosen one fails at run time: cuDNN if eligible, else the
    /// direct kernel (forward) or im2col + GEMM (gradients); `None` when that is the failing
    /// path itself or not eligible.
    pub fn fallback_route(&self, failed: ConvPath) -> Option<Route> {
        let own = own_fallback(self.direction);
        [ConvPath::Cudnn, own]
            .into_iter()
            .find(|&p| p != failed && self.eligible(p))
            .map(Route::path)
    }

    /// The plan as one JSON object (the fields of this struct; `nnfuse plan --conv --json`).
    pub fn to_json(&self) -> Value {
        let s = &self.shape;
        let paths: Vec<Value> = self
            .paths
            .iter()
            .map(|p| {
                let mut v = json!({
                    "path": p.path.name(),
                    "eligible": p.eligible,
                    "why_not": p.why_not,
                    "scratch_bytes": p.scratch_bytes,
                    "chunk": p.chunk,
                    "chunks": p.chunks,
                });
                if let (Some(w), Some(obj)) = (&p.winograd, v.as_object_mut()) {
                    obj.insert(
                        "winograd".into(),
                        json!({
                            "tile": w.tile.name(),
                            "tiles": w.tiles,
                            "c_in": w.c_in,
                            "c_out": w.c_out,
                            "seed_rule": w.seed_rule.map(|(a, b, c)| vec![a, b, c]),
                            "seed_engine": w.seed_engine.name(),
                            "engines": w.engines.iter().map(|e| e.name()).collect::<Vec<_>>(),
                            "decided_by": w.decided_by.name(),
                            "fused_why_not": w.fused_why_not,
                        }),
                    );
                }
                v
            })
            .collect();
        json!({
            "direction": self.direction.name(),
            "dtype": self.dtype.name(),
            "format": s.format.name(),
            "n": s.n, "c_in": s.c_in, "h": s.h, "w": s.w, "c_out": s.c_out,
            "kh": s.kh, "kw": s.kw,
            "stride": [s.stride.0, s.stride.1],
            "pad": [s.pad.0, s.pad.1],
            "dilation": [s.dilation.0, s.dilation.1],
            "out_hw": [self.out_hw.0, self.out_hw.1],
            "path": self.path.name(),
            "engine": self.engine.map(|e| e.name()),
            "measured": self.measured,
            "candidates": self.candidates.iter().map(Route::label).collect::<Vec<_>>(),
            "paths": paths,
            "api_paths": self.api_paths.iter().map(|p| json!({
                "path": p.path.name(),
                "eligible": p.eligible,
                "why_not": p.why_not,
            })).collect::<Vec<_>>(),
            "fallback": self.fallback,
            "runnable": self.runnable,
            "flops": self.flops,
            "scratch_bytes": self.scratch_bytes(),
            "policy": self.policy.name(),
            "winograd_gemm": self.winograd_gemm.name(),
            "deterministic": self.deterministic,
            "workspace_cap_bytes": self.workspace_cap_bytes,
            "cudnn_present": self.cudnn_present,
            "cudnn_api": self.cudnn_api.name(),
            "cudnn_api_used": self.cudnn_api_used(),
            "reasons": self.reasons,
        })
    }
}

impl fmt::Display for ConvPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.shape;
        writeln!(
            f,
            "conv {}: {} {}x{}x{}x{} -> {} filters {}x{}, stride {:?}, pad {:?}, dilation {:?}, \
             output {}x{}, {}",
            self.direction,
            s.format,
            s.n,
            s.c_in,
            s.h,
            s.w,
            s.c_out,
            s.kh,
            s.kw,
            s.stride,
            s.pad,
            s.dilation,
            self.out_hw.0,
            self.out_hw.1,
            self.dtype
        )?;
        match (self.measured, self.engine) {
            (true, _) => writeln!(
                f,
                "path: measured at the first call among {} candidates (incumbent {})",
                self.candidates.len(),
                self.route()
            )?,
            (false, Some(e)) => writeln!(f, "path: {} ({} engine)", self.path, e.name())?,
            (false, None) => writeln!(f, "path: {}", self.path)?,
        }
        if !self.runnable {
            writeln!(f, "NOT RUNNABLE: no path can compute this problem here")?;
        }
        writeln!(
            f,
            "candidates: {}",
            self.candidates
                .iter()
                .map(Route::label)
                .collect::<Vec<_>>()
                .join(", ")
        )?;
        writeln!(
            f,
            "policy {} | winograd_gemm {} | deterministic {} | workspace cap {} MiB | cuDNN {} \
             | cuDNN API {} ({})",
            self.policy,
            self.winograd_gemm,
            self.deterministic,
            self.workspace_cap_bytes >> 20,
            if self.cudnn_present {
                "present"
            } else {
                "absent"
            },
            self.cudnn_api_used().unwrap_or("none"),
            self.cudnn_api
        )?;
        writeln!(f, "paths:")?;
        for p in &self.paths {
            match &p.why_not {
                None => {
                    write!(
                        f,
                        "  {:<14} eligible, scratch {} B",
                        p.path.name(),
                        p.scratch_bytes
                    )?;
                    if let Some(c) = p.chunk {
                        write!(f, ", {} chunk(s) of <= {c} image(s)", p.chunks)?;
                    }
                    if let Some(w) = &p.winograd {
                        write!(
                            f,
                            ", batched multiply {}x{}x{} per position, seed rule {}, fused \
                             engine: {}",
                            w.tiles,
                            w.c_in,
                            w.c_out,
                            match w.seed_rule {
                                Some((a, b, c)) => format!("({a},{b},{c}) -> tensor_core"),
                                None => "none -> direct".into(),
                            },
                            match &w.fused_why_not {
                                None => "yes".to_string(),
                                Some(why) => format!("no ({why})"),
                            }
                        )?;
                    }
                    writeln!(f)?;
                }
                Some(why) => writeln!(f, "  {:<14} not eligible: {why}", p.path.name())?,
            }
        }
        for p in &self.api_paths {
            match &p.why_not {
                None => writeln!(
                    f,
                    "  {:<14} eligible (the API of the cudnn candidate{})",
                    p.path.name(),
                    if self.cudnn_graph { "" } else { "; not used" }
                )?,
                Some(why) => writeln!(f, "  {:<14} not eligible: {why}", p.path.name())?,
            }
        }
        writeln!(f, "reasons:")?;
        for r in &self.reasons {
            writeln!(f, "  - {r}")?;
        }
        Ok(())
    }
}

/// The own-kernel path a failed or ineligible choice falls back to when cuDNN cannot: the
/// direct kernel for the forward, im2col + GEMM for gradients (the direct kernel has none).
pub const fn own_fallback(direction: Direction) -> ConvPath {
    match direction {
        Direction::Forward => ConvPath::Direct,
        _ => ConvPath::Im2colGemm,
    }
}

fn checked(dims: &[usize], what: &str) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |p, &d| p.checked_mul(d))
        .ok_or_else(|| Error::invalid("shape", format!("{what} overflows usize")))
}

/// Validates the problem: every [`ConvShape::out_hw`] rule (zero dims, zero stride or
/// dilation, a filter larger than the padded input) and every element and byte count of x, w
/// and y fitting `usize`. Returns `(oh, ow)`.
pub fn check_shape(s: &ConvShape, dtype: DType) -> Result<(usize, usize)> {
    let (oh, ow) = s.out_hw()?;
    for (dims, what) in [
        (vec![s.n, s.c_in, s.h, s.w], "n*c_in*h*w (x's elements)"),
        (
            vec![s.c_out, s.c_in, s.kh, s.kw],
            "c_out*c_in*kh*kw (w's elements)",
        ),
        (vec![s.n, s.c_out, oh, ow], "n*c_out*oh*ow (y's elements)"),
    ] {
        let elems = checked(&dims, what)?;
        elems.checked_mul(dtype.size()).ok_or_else(|| {
            Error::invalid("shape", format!("the byte count of {what} overflows"))
        })?;
    }
    Ok((oh, ow))
}

/// The routes of one eligible path (a Winograd path has one per engine).
fn routes_of(info: &PathInfo) -> Vec<Route> {
    match &info.winograd {
        Some(w) => w
            .engines
            .iter()
            .map(|&e| Route::winograd(w.tile, e))
            .collect(),
        None => vec![Route::path(info.path)],
    }
}

/// Under `auto`, moves im2col + GEMM to the front of the filter gradient's candidates where its
/// plan is the f32 NCHW pointwise one in pieces (`im2col::steps`): that route reads x and dy in
/// place, searches no GEMM at its first call (so its check costs the budget little), and
/// measured 97 µs against cuDNN's best 205 µs (ResNet-50's 1x1 64→256 at 56x56, batch 32, H100),
/// a cuDNN that the first call's budget, spent on cuDNN's configs first, checked before it.
/// Says so in `reasons` when it moved.
fn pieces_lead(req: &ConvPlanRequest, candidates: &mut Vec<Route>, reasons: &mut Vec<String>) {
    let cap = req.config.conv_workspace_bytes();
    if req.config.conv_algo != ConvAlgoPolicy::Auto
        || req.direction != Direction::BackwardFilter
        || !super::im2col::steps::filter_takes_pieces(&req.shape, req.dtype, cap)
    {
        return;
    }
    let at = candidates
        .iter()
        .position(|r| r.path == ConvPath::Im2colGemm);
    if let Some(i) = at.filter(|&i| i > 0) {
        let r = candidates.remove(i);
        candidates.insert(0, r);
        reasons.push(
            "im2col_gemm: measured first (the incumbent): an f32 NCHW pointwise filter gradient \
             in pieces read in place, no GEMM search at its first call; on the H100 it took half \
             of cuDNN's best at 56x56, which came after a first call's budget was spent"
                .into(),
        );
    }
}

/// What the policy asks for, as paths in `auto`'s measuring order.
fn policy_paths(policy: ConvAlgoPolicy) -> Vec<ConvPath> {
    let mut paths: Vec<ConvPath> = ConvPath::ALL
        .into_iter()
        .filter(|p| p.rule().standalone())
        .filter(|p| policy == ConvAlgoPolicy::Auto || p.rule().forced_by(policy))
        .collect();
    paths.sort_by_key(|p| p.auto_rank());
    paths
}

/// Plans one convolution (see the module documentation for the rules).
///
/// Errors: an invalid problem, as [`check_shape`] (naming the field: `n`, `c_in`, ..., `kh`,
/// `stride`, `dilation`, or `shape` for an overflowing product).
pub fn plan(req: &ConvPlanRequest) -> Result<ConvPlan> {
    let s = &req.shape;
    let out_hw = check_shape(s, req.dtype)?;
    let (oh, ow) = out_hw;
    let flops = 2.0
        * [s.n, s.c_out, s.c_in, s.kh, s.kw, oh, ow]
            .iter()
            .map(|&v| v as f64)
            .product::<f64>();
    let cfg = req.config;
    let (paths, api_paths) = path_infos(req, out_hw)?;
    let get = |p: ConvPath| info_in(&paths, &api_paths, p);

    let mut reasons = vec![format!(
        "{} of an {} problem: x {}x{}x{}x{}, {} filters {}x{}, stride {:?}, pad {:?}, dilation \
         {:?} -> output {}x{}; {} data, f32 accumulation; {:.3} GFLOP",
        req.direction.describe(),
        s.format.name().to_uppercase(),
        s.n,
        s.c_in,
        s.h,
        s.w,
        s.c_out,
        s.kh,
        s.kw,
        s.stride,
        s.pad,
        s.dilation,
        oh,
        ow,
        req.dtype,
        flops / 1e9
    )];

    // The policy's paths that can run, expanded into routes.
    let wanted = policy_paths(cfg.conv_algo);
    let wanted = wanted.as_slice();
    let mut candidates: Vec<Route> = Vec::new();
    let mut skipped_direct = false;
    for &p in wanted {
        let info = get(p);
        if !info.eligible {
            continue;
        }
        if cfg.conv_algo == ConvAlgoPolicy::Auto
            && p == ConvPath::Direct
            && flops > DIRECT_CANDIDATE_MAX_FLOPS
        {
            skipped_direct = true;
            continue;
        }
        candidates.extend(routes_of(info));
    }
    if candidates.is_empty() && skipped_direct {
        // Nothing else runs: the direct kernel, however slow.
        candidates.extend(routes_of(get(ConvPath::Direct)));
        skipped_direct = false;
        reasons.push(
            "auto: no other path can run this problem, so the direct kernel runs despite its \
             size"
                .into(),
        );
    }

    pieces_lead(req, &mut candidates, &mut reasons);

    let mut fallback = None;
    let mut runnable = true;
    if candidates.is_empty() {
        // A forced policy on an ineligible problem (auto always has a candidate unless nothing
        // runs at all).
        let (msg, ok) = fall_back(req, &paths, wanted, &mut candidates, &mut reasons);
        fallback = Some(msg);
        runnable = ok;
    }

    let measured = candidates.len() > 1;
    let first = candidates[0];
    let path = first.path;
    let engine = first.engine;

    // Policy and choice.
    reasons.push(policy_line(
        cfg.conv_algo,
        &candidates,
        measured,
        fallback.is_some(),
    ));
    if skipped_direct {
        reasons.push(format!(
            "direct: eligible but not measured by auto: {:.2} GFLOP exceeds {:.1} GFLOP \
             (DIRECT_CANDIDATE_MAX_FLOPS), and its kernel has no tensor cores",
            flops / 1e9,
            DIRECT_CANDIDATE_MAX_FLOPS / 1e9
        ));
    }
    for p in &paths {
        if let Some(why) = &p.why_not {
            if wanted.contains(&p.path) {
                reasons.push(format!("{}: not eligible: {why}", p.path));
            }
        }
    }
    let cudnn_graph = cudnn_api(req, out_hw, &candidates, &mut reasons);
    for p in paths.iter().chain(&api_paths) {
        let through_cudnn = p.path == ConvPath::CudnnGraph && cudnn_graph;
        if !candidates.iter().any(|r| r.path == p.path) && !through_cudnn {
            continue;
        }
        p.path.rule().reasons(req, p, &mut reasons);
    }
    if !req.cudnn_present {
        reasons.push(
            "cuDNN is absent: everything runs on nnfuse's own paths (im2col + GEMM, Winograd, \
             direct)"
                .into(),
        );
    }

    Ok(ConvPlan {
        shape: *s,
        out_hw,
        dtype: req.dtype,
        direction: req.direction,
        path,
        engine,
        measured,
        candidates,
        paths,
        api_paths,
        fallback,
        runnable,
        flops,
        policy: cfg.conv_algo,
        winograd_gemm: cfg.winograd_gemm,
        deterministic: cfg.deterministic,
        workspace_cap_bytes: cfg.conv_workspace_bytes(),
        cudnn_present: req.cudnn_present,
        cudnn_api: cfg.cudnn_api,
        cudnn_graph,
        reasons,
    })
}

/// Every path's eligibility: the candidates' own paths, then the paths that are an API of
/// another's candidate ([`PathRule::standalone`](super::paths) false).
fn path_infos(
    req: &ConvPlanRequest,
    out_hw: (usize, usize),
) -> Result<(Vec<PathInfo>, Vec<PathInfo>)> {
    let mut paths = Vec::with_capacity(ConvPath::ALL.len());
    let mut api_paths = Vec::new();
    for p in ConvPath::ALL {
        // A size that overflows in one path's arithmetic makes that path ineligible, not the
        // plan an error: the plan fails only where the problem itself is invalid.
        let info = p
            .rule()
            .info(p, req, out_hw)
            .unwrap_or_else(|e| info_ineligible(p, e.to_string()));
        if p.rule().standalone() {
            paths.push(info);
        } else {
            api_paths.push(info);
        }
    }
    Ok((paths, api_paths))
}

/// Whether the `cudnn` candidate (if `candidates` has it) goes through the graph API; pushes
/// the line saying which API and why.
fn cudnn_api(
    req: &ConvPlanRequest,
    out_hw: (usize, usize),
    candidates: &[Route],
    reasons: &mut Vec<String>,
) -> bool {
    if !candidates.iter().any(|r| r.path == ConvPath::Cudnn) {
        return false;
    }
    let (graph, line) = cudnn_api_line(req, out_hw);
    reasons.push(line);
    graph
}

/// Whether the `cudnn` candidate goes through the graph API, and the plan's line saying which
/// API and why.
fn cudnn_api_line(req: &ConvPlanRequest, out_hw: (usize, usize)) -> (bool, String) {
    let api = req.config.cudnn_api;
    let find = "cuDNN's Find (NNFUSE_CONV_CUDNN_SEARCH=find) exists only in the legacy API and \
                takes it";
    match (graph_refusal(req, out_hw), api) {
        (None, _) => (
            true,
            format!(
                "cuDNN API graph (NNFUSE_CUDNN_API / Config::cudnn_api {api}): the loaded cuDNN \
                 has the graph API, so the cudnn candidate stands for its engine configs \
                 (path cudnn_graph); the legacy algorithms are measured only if no engine \
                 config finalizes at the first call, and are the fallback when a graph route \
                 fails at run time; {find}"
            ),
        ),
        (Some(why), CudnnApi::Graph) => (
            false,
            format!(
                "cuDNN API legacy: NNFUSE_CUDNN_API / Config::cudnn_api graph is not honoured: \
                 {why}"
            ),
        ),
        (Some(why), _) => (false, format!("cuDNN API legacy ({api}): {why}")),
    }
}

/// The plan's line on its policy and how the route is chosen.
fn policy_line(
    policy: ConvAlgoPolicy,
    candidates: &[Route],
    measured: bool,
    fell_back: bool,
) -> String {
    let (first, path) = (candidates[0], candidates[0].path);
    match policy {
        ConvAlgoPolicy::Auto if measured => format!(
            "policy auto (NNFUSE_CONV_ALGO / Config::conv_algo): the first call measures {} \
             candidates on the caller's inputs (each checked against a reference, timed \
             interleaved) and keeps the incumbent {} unless a candidate is clearly faster \
             (>= 2% in the median round, faster in ~90% of rounds); Winograd is refused where \
             its error exceeds twice cuDNN's (without cuDNN: the first other candidate's), \
             with a floor per data type (docs/CONV.md)",
            candidates.len(),
            first
        ),
        ConvAlgoPolicy::Auto => {
            format!("policy auto: {path} is the only eligible candidate, nothing to measure")
        }
        p if !fell_back && measured => format!(
            "policy {p}: forced; the first call measures its {} variants",
            candidates.len()
        ),
        p if !fell_back => format!("policy {p}: forced"),
        p => format!("policy {p}: not honoured (see the fallback)"),
    }
}

/// The eligibility of `path` in `paths` or `api_paths` (the first entry if neither has it,
/// which `plan` never lets happen).
fn info_in<'a>(paths: &'a [PathInfo], api_paths: &'a [PathInfo], path: ConvPath) -> &'a PathInfo {
    paths
        .iter()
        .chain(api_paths)
        .find(|p| p.path == path)
        .unwrap_or(&paths[0])
}

/// When the policy's paths cannot run the problem: cuDNN if it can, else the own fallback of
/// the direction ([`own_fallback`]). Pushes the route(s) to `candidates` and returns the
/// message (also a reason) and whether anything can run.
fn fall_back(
    req: &ConvPlanRequest,
    paths: &[PathInfo],
    wanted: &[ConvPath],
    candidates: &mut Vec<Route>,
    reasons: &mut Vec<String>,
) -> (String, bool) {
    let cfg = req.config;
    let get = |p: ConvPath| info_in(paths, &[], p);
    let mut runnable = true;
    // A forced policy on an ineligible problem (auto always has a candidate unless nothing
    // runs at all).
    let why: Vec<String> = wanted
        .iter()
        .filter_map(|&p| get(p).why_not.as_ref().map(|w| format!("{p}: {w}")))
        .collect();
    let own = own_fallback(req.direction);
    let to = [ConvPath::Cudnn, own]
        .into_iter()
        .find(|&p| get(p).eligible);
    let msg = match to {
        Some(p) => format!(
            "policy {} cannot run this problem ({}); falling back to {p} (cuDNN when it \
             can, else {own})",
            cfg.conv_algo,
            why.join("; ")
        ),
        None => {
            runnable = false;
            format!(
                "policy {} cannot run this problem ({}), and neither can the fallbacks \
                 (cudnn: {}; {own}: {})",
                cfg.conv_algo,
                why.join("; "),
                get(ConvPath::Cudnn).why_not.clone().unwrap_or_default(),
                get(own).why_not.clone().unwrap_or_default()
            )
        }
    };
    reasons.push(msg.clone());
    match to {
        Some(p) => candidates.extend(routes_of(get(p))),
        None => candidates.push(Route::path(own)),
    }
    (msg, runnable)
}

/// Plans of all three directions (indexable by [`Direction`]).
#[derive(Debug, Clone, PartialEq)]
pub struct DirectionPlans(pub [ConvPlan; 3]);

impl DirectionPlans {
    /// Plans every direction of `shape`.
    pub fn new(
        shape: ConvShape,
        dtype: DType,
        config: &Config,
        cudnn_present: bool,
        cudnn_graph: bool,
    ) -> Result<Self> {
        let p = |direction| {
            plan(&ConvPlanRequest {
                shape,
                dtype,
                direction,
                config,
                cudnn_present,
                cudnn_graph,
            })
        };
        Ok(DirectionPlans([
            p(Direction::Forward)?,
            p(Direction::BackwardData)?,
            p(Direction::BackwardFilter)?,
        ]))
    }

    /// The plan of `d`.
    pub fn get(&self, d: Direction) -> &ConvPlan {
        &self.0[d.index()]
    }
}

/// Whether `format` is one nnfuse's Winograd runs (NHWC).
pub fn winograd_format(format: TensorFormat) -> bool {
    format == TensorFormat::Nhwc
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(n: usize, c: usize, h: usize, k: usize, r: usize, fmt: TensorFormat) -> ConvShape {
        crate::testutil::square_conv(n, c, h, k, r, fmt)
    }

    #[test]
    fn int_limits_name_what_is_too_big() {
        let mut s = shape(1, 3, 5, 8, 3, TensorFormat::Nchw);
        assert!(cudnn_int_limits(&s, s.out_hw().unwrap()).is_none());
        s.n = 1 << 31;
        let why = cudnn_int_limits(&s, s.out_hw().unwrap()).unwrap();
        assert!(
            why.contains("n = 2147483648") && why.contains("x has"),
            "{why}"
        );
    }
}
