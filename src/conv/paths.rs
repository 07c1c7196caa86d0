//! The convolution paths: what a path is ([`ConvPath`], generated from one list), the plan's
//! per-path records ([`PathInfo`], [`WinogradInfo`]), and each path's pure rule — eligibility
//! with its reason, scratch and chunks, its reason lines, the policies that force it and its
//! place in `auto`'s order. [`conv_paths!`] is the one list that registers a path: the pure side
//! (this file, `plan.rs`) expands it into the enum and the rule lookup, the GPU side (`route.rs`)
//! into the table of run functions. The run functions are named there as tokens only, resolved
//! where `route.rs` expands the list: this file imports nothing of the GPU.
//! Pure: no GPU calls (`tests/conv_plan.rs`).

use std::fmt;
use std::str::FromStr;

use super::problem::{
    direct_filter_refusal, dual_refusal, filter_grad_grid, fused_eligible, stem_filter_refusal,
    stem_forward_refusal, stem_grid, tiled_bytes, tiled_refusal, tiled_shape,
    winograd_backward_data_eligible, winograd_dims, winograd_equivalent, winograd_forward_eligible,
    ConvShape, Direction, WinogradEngine, WinogradTile,
};
use super::sizes::{
    im2col_chunk, im2col_dims, is_pointwise, reduction_len, tensor_core_rule, true_f32_bound,
    winograd_chunk,
};
use crate::config::{Config, ConvAlgoPolicy, CudnnApi, WinogradGemmPolicy};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// `i32::MAX`: the largest size cuDNN's legacy descriptors and cuBLAS's GEMM dimensions take.
pub const INT_MAX: usize = i32::MAX as usize;

/// The registered convolution paths, one entry each, in the order plans list them (the order of
/// [`ConvPath`]'s variants): the variant and its documentation, its name and parse aliases, its
/// rank in `auto`'s measuring order (lower first; the first is the incumbent), optionally its
/// launcher module (`mod m`: `src/conv/m.rs`, declared by `conv/mod.rs`'s expansion of this
/// list; a module several entries share is declared there by hand instead), its run function
/// (`raw_run` of its launcher module, relative to `conv`, `unsafe fn(&PathCall) -> Result<()>`)
/// and its pure rule (a [`PathRule`] value of this file). Adding a path is one entry here.
///
/// Expanded by a callback macro: `conv_paths!(m)` calls `m! { entries }` (here: the enum and
/// rules; `conv/mod.rs`: the launcher modules; `route.rs`: the run functions).
macro_rules! conv_paths {
    ($then:ident) => {
        $then! {
            /// cuDNN (`cudnnConvolutionForward` / `BackwardData` / `BackwardFilter`).
            Cudnn = "cudnn", auto 10, mod cudnn_run, run cudnn_run::raw_run, rule CudnnRule;
            /// nnfuse's im2col (col2im for the data gradient) and a strided batched GEMM.
            Im2colGemm = "im2col_gemm" | "im2col", auto 20, run im2col::raw_run, rule Im2colRule;
            /// Winograd F(2x2, 3x3) through one batched multiply.
            WinogradF2x3 = "winograd_f2x3" | "winograd_f2", auto 40, run winograd::raw_run,
                rule WinogradRule(WinogradTile::F2x3);
            /// Winograd F(4x4, 3x3) through one batched multiply.
            WinogradF4x3 = "winograd_f4x3" | "winograd_f4", auto 30, run winograd::raw_run,
                rule WinogradRule(WinogradTile::F4x3);
            /// nnfuse's direct convolution kernel (forward only).
            Direct = "direct", auto 90, mod direct, run direct::raw_run, rule DirectRule;
            /// cuDNN through its graph (backend) API: an execution plan per problem and engine
            /// config, built once and cached. Measured through the `cudnn` candidate (which API
            /// that candidate uses is the plan's `cudnn_api`), so listed last.
            CudnnGraph = "cudnn_graph" | "graph", auto 10, mod cudnn_graph_run,
                run cudnn_graph_run::raw_run, rule CudnnGraphRule;
            /// The forward as the data gradient of its dual problem (the filter rotated, its
            /// channel axes swapped) through cuDNN's graph API: f32, stride 1.
            CudnnDual = "cudnn_dual" | "dual", auto 15, mod conv_dual, run conv_dual::raw_run,
                rule DualRule;
            /// nnfuse's filter-gradient kernel: f32, 3x3, stride 1 (the filter gradient only).
            DirectFilter = "direct_filter" | "direct_wgrad", auto 16, mod direct_filter,
                run direct_filter::raw_run, rule DirectFilterRule;
            /// The filter gradient over 2x2 spatial tiles stacked as the batch, through cuDNN's
            /// graph API: f32, stride 1.
            CudnnTiled = "cudnn_tiled" | "tiled", auto 17, mod conv_tiled,
                run conv_tiled::raw_run, rule TiledRule;
            /// nnfuse's tensor-core filter gradient for layers with few input channels (a 7x7
            /// stem over 3): f16 / bf16 channels-last, `c_in` ≤ 16, `kh*kw*c_in` ≤ 160.
            StemFilter = "stem_filter" | "stem_wgrad", auto 18, run stem::raw_run,
                rule StemFilterRule;
            /// nnfuse's tensor-core forward for layers with few input channels: f16 / bf16
            /// channels-last, `c_in` ≤ 16, `kh*kw*c_in` ≤ 160.
            StemForward = "stem_forward" | "stem_fwd", auto 19, run stem::raw_run_forward,
                rule StemForwardRule;
        }
    };
}
pub(crate) use conv_paths;

/// The pure side of the list: [`ConvPath`], its names, parsing and each path's rule and rank.
macro_rules! declare_paths {
    ($(
        $(#[$doc:meta])*
        $variant:ident = $name:literal $(| $alias:literal)*, auto $rank:literal,
            $(mod $module:ident,)? run $($run:ident)::+, rule $rule:expr;
    )*) => {
        /// How a convolution is computed (one variant per entry of the registered list).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum ConvPath {
            $($(#[$doc])* $variant,)*
        }

        impl ConvPath {
            /// Every path, in the order plans list them.
            pub const ALL: [ConvPath; [$(stringify!($variant)),*].len()] =
                [$(ConvPath::$variant),*];

            /// `cudnn`, `im2col_gemm`, `winograd_f2x3`, `winograd_f4x3`, `direct`, `cudnn_graph`,
            /// `cudnn_dual`, `direct_filter`, `cudnn_tiled`, `stem_filter`, `stem_forward`.
            pub const fn name(self) -> &'static str {
                match self {
                    $(ConvPath::$variant => $name,)*
                }
            }

            /// The path's pure rule.
            pub(crate) fn rule(self) -> &'static dyn PathRule {
                match self {
                    $(ConvPath::$variant => &$rule,)*
                }
            }

            /// The path's place in `auto`'s measuring order (lower first).
            pub(crate) const fn auto_rank(self) -> u32 {
                match self {
                    $(ConvPath::$variant => $rank,)*
                }
            }
        }

        impl FromStr for ConvPath {
            type Err = Error;
            /// The names of [`ConvPath::name`], `-` read as `_`, plus `im2col` and
            /// `winograd_f2` / `winograd_f4`, `graph`.
            fn from_str(s: &str) -> Result<Self> {
                match s.trim().to_ascii_lowercase().replace('-', "_").as_str() {
                    $($name $(| $alias)* => Ok(ConvPath::$variant),)*
                    _ => Err(Error::invalid(
                        "path",
                        format!(
                            "{s:?} is not one of {}",
                            [$($name),*].join(", ")
                        ),
                    )),
                }
            }
        }
    };
}
conv_paths!(declare_paths);

impl ConvPath {
    /// The Winograd tile of a Winograd path.
    pub const fn winograd_tile(self) -> Option<WinogradTile> {
        match self {
            ConvPath::WinogradF2x3 => Some(WinogradTile::F2x3),
            ConvPath::WinogradF4x3 => Some(WinogradTile::F4x3),
            _ => None,
        }
    }

    /// The path of a Winograd tile.
    pub const fn winograd(tile: WinogradTile) -> ConvPath {
        match tile {
            WinogradTile::F2x3 => ConvPath::WinogradF2x3,
            WinogradTile::F4x3 => ConvPath::WinogradF4x3,
        }
    }

    /// Whether nnfuse's own kernels run it (no cuDNN needed).
    pub const fn is_own(self) -> bool {
        !self.is_cudnn()
    }

    /// Whether cuDNN runs it (through either API).
    pub const fn is_cudnn(self) -> bool {
        matches!(
            self,
            ConvPath::Cudnn | ConvPath::CudnnGraph | ConvPath::CudnnDual | ConvPath::CudnnTiled
        )
    }
}

impl fmt::Display for ConvPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A path's pure rule: what the plan asks of each path, without naming it.
pub(crate) trait PathRule: Sync {
    /// Whether `path` (this rule's) can run the problem, why not, its scratch and chunks.
    fn info(
        &self,
        path: ConvPath,
        req: &ConvPlanRequest,
        out_hw: (usize, usize),
    ) -> Result<PathInfo>;

    /// The plan's reason lines on how the path computes the problem (when it is a candidate).
    fn reasons(&self, req: &ConvPlanRequest, info: &PathInfo, reasons: &mut Vec<String>);

    /// Whether the forced `policy` takes this path (`auto` takes every path).
    fn forced_by(&self, policy: ConvAlgoPolicy) -> bool;

    /// Whether the plan lists the path as a candidate of its own. `false` for a path that is
    /// measured through another path's candidate: the cuDNN graph API, whose engine configs the
    /// `cudnn` candidate stands for when the plan's cuDNN API is the graph
    /// ([`ConvPlanRequest::cudnn_graph`], [`crate::config::CudnnApi`]).
    fn standalone(&self) -> bool {
        true
    }

    /// Why the path cannot add its gradient of direction `d` to the output (an accumulating
    /// call, `beta = 1`), or `None` when it can. Only the gradients accumulate.
    fn accumulate_refusal(&self, _d: Direction) -> Option<&'static str> {
        None
    }
}

/// How Winograd's engine was decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EngineDecision {
    /// The seed's tensor-core rule (`winograd_gemm = seed`).
    SeedRule,
    /// Forced by `winograd_gemm = tensor_core | direct | fused`.
    Forced,
    /// Measured at the first call (`winograd_gemm = auto`); every engine that can run is a
    /// candidate.
    Measured,
}

impl EngineDecision {
    /// `seed_rule`, `forced`, `measured`.
    pub const fn name(self) -> &'static str {
        match self {
            EngineDecision::SeedRule => "seed_rule",
            EngineDecision::Forced => "forced",
            EngineDecision::Measured => "measured",
        }
    }
}

/// Winograd's batched multiply for one tile size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WinogradInfo {
    /// The tile size.
    pub tile: WinogradTile,
    /// Rows of each position's product: the tiles of the largest batch chunk.
    pub tiles: usize,
    /// Inner dimension (input channels of the equivalent forward convolution).
    pub c_in: usize,
    /// Columns (output channels of the equivalent forward convolution).
    pub c_out: usize,
    /// The first triple of the seed's rule that divides `(tiles, c_in, c_out)`.
    pub seed_rule: Option<(usize, usize, usize)>,
    /// The rule's engine: tensor cores when a triple divides, else Direct.
    pub seed_engine: WinogradEngine,
    /// The engines the route(s) of this tile use (when measured: the rule's first, the other
    /// batched-multiply engine, then the fused one where it can run).
    pub engines: Vec<WinogradEngine>,
    /// How the engine was decided.
    pub decided_by: EngineDecision,
    /// Why the fused engine cannot run this problem (`None`: it can; see
    /// [`fused_eligible`]).
    pub fused_why_not: Option<String>,
}

/// One path's eligibility and sizes for the problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathInfo {
    /// The path.
    pub path: ConvPath,
    /// Whether it can run this problem.
    pub eligible: bool,
    /// Why not, when it cannot.
    pub why_not: Option<String>,
    /// Bytes of the Context's scratch arena it uses (im2col: the column matrices of one chunk;
    /// Winograd: the transformed filter plus one chunk's transformed input and product). cuDNN's
    /// workspace is chosen with its algorithm at the first call (at most the cap); 0 here.
    pub scratch_bytes: usize,
    /// Images per chunk (the batch is split so that the scratch fits the cap).
    pub chunk: Option<usize>,
    /// Number of chunks (balanced: sizes differ by at most one).
    pub chunks: usize,
    /// Winograd's batched multiply (Winograd paths that are eligible).
    pub winograd: Option<WinogradInfo>,
}

/// What to plan.
#[derive(Debug, Clone, Copy)]
pub struct ConvPlanRequest<'a> {
    /// The problem (layouts in [`crate::reference::conv`]).
    pub shape: ConvShape,
    /// Element type of x, w and y (f32 accumulation everywhere).
    pub dtype: DType,
    /// Which computation.
    pub direction: Direction,
    /// Policies, workspace cap, determinism.
    pub config: &'a Config,
    /// Whether cuDNN can be loaded ([`crate::context::cudnn_present`]).
    pub cudnn_present: bool,
    /// Whether the loaded cuDNN has the graph (backend) API: version 9 or newer exporting its
    /// entry points (on a GPU: `cudnn_graph::build::available`; `nnfuse plan` assumes it from
    /// the version).
    pub cudnn_graph: bool,
}

pub(crate) fn mib(bytes: usize) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

/// `name = value` for each size over `int` (cuBLAS's and cuDNN's dimension type), in order.
fn sizes_over_int(sizes: &[(&str, usize)]) -> Vec<String> {
    sizes
        .iter()
        .filter(|(_, v)| *v > INT_MAX)
        .map(|(n, v)| format!("{n} = {v}"))
        .collect()
}

/// Why cuDNN's `int` sizes cannot describe the problem, if they cannot.
pub fn cudnn_int_limits(s: &ConvShape, (oh, ow): (usize, usize)) -> Option<String> {
    let mut over = sizes_over_int(&[
        ("n", s.n),
        ("c_in", s.c_in),
        ("h", s.h),
        ("w", s.w),
        ("c_out", s.c_out),
        ("kh", s.kh),
        ("kw", s.kw),
        ("stride", s.stride.0.max(s.stride.1)),
        ("pad", s.pad.0.max(s.pad.1)),
        ("dilation", s.dilation.0.max(s.dilation.1)),
    ]);
    // Element counts (they bound every stride of the packed descriptors).
    let count = |d: &[usize]| d.iter().try_fold(1usize, |p, &x| p.checked_mul(x));
    for (name, dims) in [
        ("x", [s.n, s.c_in, s.h, s.w]),
        ("w", [s.c_out, s.c_in, s.kh, s.kw]),
        ("y", [s.n, s.c_out, oh, ow]),
    ] {
        match count(&dims) {
            Some(c) if c <= INT_MAX => {}
            Some(c) => over.push(format!("{name} has {c} elements")),
            None => over.push(format!("{name}'s element count overflows")),
        }
    }
    if over.is_empty() {
        None
    } else {
        Some(format!(
            "cuDNN's descriptors take int sizes and strides (at most {INT_MAX}): {}",
            over.join(", ")
        ))
    }
}

/// The first of `(what, value)` over [`INT_MAX`], as the launchers word it: `kernels` names
/// them, their 32-bit per-image indices and `int` coordinates being the limit.
fn over_int(kernels: &str, checks: &[(&str, usize)]) -> std::result::Result<(), String> {
    match checks.iter().find(|(_, v)| *v > INT_MAX) {
        Some((what, v)) => Err(format!(
            "{kernels}: {what} = {v} exceeds {INT_MAX}, the limit of the kernel's 32-bit \
             per-image indices"
        )),
        None => Ok(()),
    }
}

/// The product of `dims`, `usize::MAX` when it overflows (over every limit).
fn product(dims: &[usize]) -> usize {
    dims.iter()
        .try_fold(1usize, |p, &d| p.checked_mul(d))
        .unwrap_or(usize::MAX)
}

/// Why the direct kernel cannot index the problem (`Err`: its 32-bit per-image indices and
/// `int` coordinates do not hold it). The launcher (`direct.rs`) refuses exactly these, so the
/// plan never calls eligible what the launcher refuses.
pub(crate) fn direct_limits(
    s: &ConvShape,
    (oh, ow): (usize, usize),
) -> std::result::Result<(), String> {
    over_int(
        "direct convolution",
        &[
            ("oh*ow", product(&[oh, ow])),
            ("c_in*kh*kw", product(&[s.c_in, s.kh, s.kw])),
            ("c_in*h*w", product(&[s.c_in, s.h, s.w])),
            ("c_out", s.c_out),
            ("h + 2*pad.0", s.h.saturating_add(s.pad.0.saturating_mul(2))),
            ("w + 2*pad.1", s.w.saturating_add(s.pad.1.saturating_mul(2))),
            ("stride.0", s.stride.0),
            ("stride.1", s.stride.1),
            ("pad.0", s.pad.0),
            ("pad.1", s.pad.1),
            ("dilation.0", s.dilation.0),
            ("dilation.1", s.dilation.1),
        ],
    )
}

/// Why the im2col kernels cannot index the problem: the per-image limits that
/// `im2col/launch.rs`'s `geometry` refuses beyond the GEMM's (checked by [`Im2colRule`]).
fn im2col_limits(s: &ConvShape, pixels: usize, taps: usize) -> std::result::Result<(), String> {
    let padded_w = s.w.saturating_add(s.pad.1.saturating_mul(2));
    let nhwc_reach = if s.format == crate::layout::TensorFormat::Nhwc {
        padded_w
            .saturating_add(s.kw.saturating_mul(s.dilation.1))
            .saturating_mul(s.c_in)
    } else {
        0
    };
    over_int(
        "im2col kernels",
        &[
            (
                "an image's column matrix (oh*ow*c_in*kh*kw)",
                product(&[pixels, taps]),
            ),
            ("an image's input (c_in*h*w)", product(&[s.c_in, s.h, s.w])),
            ("h + 2*pad.0", s.h.saturating_add(s.pad.0.saturating_mul(2))),
            ("w + 2*pad.1", padded_w),
            ("(w + 2*pad.1 + kw*dilation.1)*c_in", nhwc_reach),
            ("stride.0", s.stride.0),
            ("stride.1", s.stride.1),
            ("pad.0", s.pad.0),
            ("pad.1", s.pad.1),
            ("dilation.0", s.dilation.0),
            ("dilation.1", s.dilation.1),
        ],
    )
}

/// Why the Winograd kernels cannot address the padded image: they form tile origins and tap
/// coordinates as `int` (the input-transform launchers in `winograd.rs` and
/// `winograd/fused.rs` refuse a padded extent over `i32::MAX / 2`).
fn winograd_limits(s: &ConvShape) -> std::result::Result<(), String> {
    let limit = INT_MAX / 2;
    for (what, v) in [
        ("h + 2*pad.0", s.h.saturating_add(s.pad.0.saturating_mul(2))),
        ("w + 2*pad.1", s.w.saturating_add(s.pad.1.saturating_mul(2))),
    ] {
        if v > limit {
            return Err(format!(
                "Winograd kernels: {what} = {v} exceeds {limit}, the limit of their int tile \
                 coordinates"
            ));
        }
    }
    Ok(())
}

/// An eligible path that needs no scratch and runs the whole batch in one call.
/// An eligible path that runs `n` images in chunks of `chunk` with `scratch` bytes of scratch.
fn info_chunked(path: ConvPath, scratch: usize, chunk: usize, n: usize) -> PathInfo {
    PathInfo {
        path,
        eligible: true,
        why_not: None,
        scratch_bytes: scratch,
        chunk: Some(chunk),
        chunks: n.div_ceil(chunk.max(1)),
        winograd: None,
    }
}

fn info_whole(path: ConvPath) -> PathInfo {
    PathInfo {
        path,
        eligible: true,
        why_not: None,
        scratch_bytes: 0,
        chunk: None,
        chunks: 1,
        winograd: None,
    }
}

pub(super) fn info_ineligible(path: ConvPath, why: String) -> PathInfo {
    PathInfo {
        path,
        eligible: false,
        why_not: Some(why),
        scratch_bytes: 0,
        chunk: None,
        chunks: 0,
        winograd: None,
    }
}

/// cuDNN: loads, and every size fits its `int` descriptors.
pub(crate) struct CudnnRule;

impl PathRule for CudnnRule {
    fn info(
        &self,
        path: ConvPath,
        req: &ConvPlanRequest,
        out_hw: (usize, usize),
    ) -> Result<PathInfo> {
        if !req.cudnn_present {
            return Ok(info_ineligible(
                path,
                "cuDNN cannot be loaded (libcudnn.so.9 not found): nnfuse's own paths run \
                 instead"
                    .into(),
            ));
        }
        if let Some(why) = cudnn_int_limits(&req.shape, out_hw) {
            return Ok(info_ineligible(path, why));
        }
        Ok(info_whole(path))
    }

    fn reasons(&self, req: &ConvPlanRequest, _p: &PathInfo, reasons: &mut Vec<String>) {
        let cfg = req.config;
        let graph = req
            .shape
            .out_hw()
            .is_ok_and(|hw| graph_refusal(req, hw).is_none());
        let api = if graph {
            " (legacy API: measured only if no graph engine config finalizes, and the fallback \
             of a graph route that fails at run time)"
        } else {
            ""
        };
        reasons.push(format!(
            "cudnn{api}: the algorithm is cuDNN's, chosen at the first call (heuristic \
             candidates timed interleaved, or cuDNN's Find with \
             NNFUSE_CONV_CUDNN_SEARCH=find), with a workspace of at most the cap ({}); \
             f32 runs with CUDNN_FMA_MATH (true fp32, no TF32), f16/bf16 with \
             tensor-op math; f32 compute type",
            mib(cfg.conv_workspace_bytes())
        ));
        if req.direction != Direction::Forward {
            reasons.push(if cfg.deterministic {
                "deterministic (NNFUSE_DETERMINISTIC / Config::deterministic): only \
                 cuDNN's deterministic algorithms are candidates; the first call \
                 reports whether that excluded the fastest one"
                    .into()
            } else {
                "not deterministic: cuDNN may pick an algorithm that accumulates with \
                 atomics (set NNFUSE_DETERMINISTIC=1 to exclude those)"
                    .into()
            });
        }
    }

    fn forced_by(&self, policy: ConvAlgoPolicy) -> bool {
        policy == ConvAlgoPolicy::Cudnn
    }
}

/// im2col + GEMM: one image's columns fit the cap and the GEMM's sizes fit cuBLAS's `int`.
pub(crate) struct Im2colRule;

impl PathRule for Im2colRule {
    fn info(
        &self,
        path: ConvPath,
        req: &ConvPlanRequest,
        _out_hw: (usize, usize),
    ) -> Result<PathInfo> {
        let s = &req.shape;
        let elem = req.dtype.size();
        let cap = req.config.conv_workspace_bytes();
        let d = im2col_dims(s)?;
        let big = sizes_over_int(&[
            ("output pixels per image (oh*ow)", d.pixels),
            ("filter taps (c_in*kh*kw)", d.taps),
            ("c_out", s.c_out),
        ]);
        if !big.is_empty() {
            return Ok(info_ineligible(
                path,
                format!(
                    "cuBLAS takes int GEMM dimensions (at most {INT_MAX}): {}",
                    big.join(", ")
                ),
            ));
        }
        // A pointwise problem runs no im2col or col2im kernel (x or dx is the column matrix).
        if !is_pointwise(s) {
            if let Err(why) = im2col_limits(s, d.pixels, d.taps) {
                return Ok(info_ineligible(path, why));
            }
        }
        let Some(chunk) = im2col_chunk(s, elem, cap)? else {
            let per_image = d.per_image.saturating_mul(elem);
            return Ok(info_ineligible(
                path,
                format!(
                    "one image's column matrix ({} x {} = {}) exceeds the workspace cap of {} \
             (NNFUSE_CONV_WORKSPACE_MB / Config::conv_workspace_mb)",
                    d.pixels,
                    d.taps,
                    mib(per_image),
                    mib(cap)
                ),
            ));
        };
        let scratch = if is_pointwise(s) {
            0
        } else {
            chunk.saturating_mul(d.per_image).saturating_mul(elem)
        };
        Ok(info_chunked(path, scratch, chunk, s.n))
    }

    fn reasons(&self, req: &ConvPlanRequest, p: &PathInfo, reasons: &mut Vec<String>) {
        let (s, cfg) = (&req.shape, req.config);
        let what = match req.direction {
            Direction::Forward if is_pointwise(s) => {
                "pointwise (1x1, stride 1, no padding): x already is the column \
                 matrix, one strided batched GEMM"
                    .to_string()
            }
            Direction::Forward => "im2col, then one strided batched GEMM per chunk".into(),
            Direction::BackwardData => {
                "GEMM of the filter with dy into column matrices, then col2im (a \
                 gather: deterministic, no atomics)"
                    .into()
            }
            Direction::BackwardFilter => {
                "GEMM of dy with the column matrices per chunk, accumulated in f32".into()
            }
        };
        reasons.push(format!(
            "im2col_gemm: {what}; scratch {} in {} chunk(s) of <= {} image(s) under the \
             cap of {}",
            mib(p.scratch_bytes),
            p.chunks,
            p.chunk.unwrap_or(s.n),
            mib(cfg.conv_workspace_bytes())
        ));
    }

    fn forced_by(&self, policy: ConvAlgoPolicy) -> bool {
        policy == ConvAlgoPolicy::Im2col
    }
}

/// The engines a Winograd route takes under `policy`, the rule's result (tensor cores or
/// Direct) and whether the fused engine can run, and how that was decided.
fn engines(
    policy: WinogradGemmPolicy,
    seed_engine: WinogradEngine,
    fused_ok: bool,
) -> (Vec<WinogradEngine>, EngineDecision) {
    let other = if seed_engine == WinogradEngine::TensorCore {
        WinogradEngine::Direct
    } else {
        WinogradEngine::TensorCore
    };
    match policy {
        WinogradGemmPolicy::Seed => (vec![seed_engine], EngineDecision::SeedRule),
        WinogradGemmPolicy::TensorCore => {
            (vec![WinogradEngine::TensorCore], EngineDecision::Forced)
        }
        WinogradGemmPolicy::Direct => (vec![WinogradEngine::Direct], EngineDecision::Forced),
        WinogradGemmPolicy::Fused if fused_ok => {
            (vec![WinogradEngine::Fused], EngineDecision::Forced)
        }
        WinogradGemmPolicy::Fused => (vec![seed_engine], EngineDecision::SeedRule),
        WinogradGemmPolicy::Auto => {
            let mut e = vec![seed_engine, other];
            if fused_ok {
                e.push(WinogradEngine::Fused);
            }
            (e, EngineDecision::Measured)
        }
    }
}

/// Winograd of one tile size: NHWC 3x3 stride 1, the forward or the data gradient, the
/// transformed tensors of one image within the cap.
pub(crate) struct WinogradRule(pub WinogradTile);

impl PathRule for WinogradRule {
    fn accumulate_refusal(&self, d: Direction) -> Option<&'static str> {
        (d == Direction::BackwardData).then_some(
            "its output transform writes dx tile by tile with no beta: it cannot add to dx",
        )
    }

    fn info(
        &self,
        path: ConvPath,
        req: &ConvPlanRequest,
        _out_hw: (usize, usize),
    ) -> Result<PathInfo> {
        let tile = self.0;
        let s = &req.shape;
        let eligible = match req.direction {
            Direction::Forward => winograd_forward_eligible(s),
            Direction::BackwardData => winograd_backward_data_eligible(s),
            Direction::BackwardFilter => {
                Err("nnfuse's Winograd computes the forward and the data \
                                      gradient only; the filter gradient takes im2col + \
                                      GEMM or cuDNN"
                    .to_string())
            }
        };
        if let Err(why) = eligible {
            return Ok(info_ineligible(path, why));
        }
        if let Err(why) = winograd_limits(s) {
            return Ok(info_ineligible(path, why));
        }
        let Some(eq) = winograd_equivalent(s, req.direction) else {
            return Ok(info_ineligible(
                path,
                "no equivalent forward convolution".into(),
            ));
        };
        let elem = req.dtype.size();
        let cap = req.config.conv_workspace_bytes();
        let d = winograd_dims(&eq, tile)?;
        let Some(chunk) = winograd_chunk(&d, eq.n, elem, cap)? else {
            let need =
                d.v.saturating_add(d.u_per_image)
                    .saturating_add(d.m_per_image)
                    .saturating_mul(elem);
            return Ok(info_ineligible(
                path,
                format!(
                    "the transformed filter and one image's transformed input and product ({}) \
             exceed the workspace cap of {} (NNFUSE_CONV_WORKSPACE_MB)",
                    mib(need),
                    mib(cap)
                ),
            ));
        };
        let tiles = chunk.saturating_mul(d.tiles_per_image);
        let big = sizes_over_int(&[("tiles", tiles), ("c_in", eq.c_in), ("c_out", eq.c_out)]);
        if !big.is_empty() {
            return Ok(info_ineligible(
                path,
                format!(
                    "the batched multiply's sizes exceed int (at most {INT_MAX}): {}",
                    big.join(", ")
                ),
            ));
        }
        let seed_rule = tensor_core_rule(tiles, eq.c_in, eq.c_out);
        let seed_engine = if seed_rule.is_some() {
            WinogradEngine::TensorCore
        } else {
            WinogradEngine::Direct
        };
        let fused_why_not = fused_eligible(&eq, req.dtype).err();
        let (engines, decided_by) = engines(
            req.config.winograd_gemm,
            seed_engine,
            fused_why_not.is_none(),
        );
        let scratch =
            d.v.saturating_add(chunk.saturating_mul(d.u_per_image.saturating_add(d.m_per_image)))
                .saturating_mul(elem);
        Ok(PathInfo {
            winograd: Some(WinogradInfo {
                tile,
                tiles,
                c_in: eq.c_in,
                c_out: eq.c_out,
                seed_rule,
                seed_engine,
                engines,
                decided_by,
                fused_why_not,
            }),
            ..info_chunked(path, scratch, chunk, s.n)
        })
    }

    fn reasons(&self, req: &ConvPlanRequest, p: &PathInfo, reasons: &mut Vec<String>) {
        let cfg = req.config;
        if let Some(w) = &p.winograd {
            let rule = match w.seed_rule {
                Some((a, b, c)) => format!(
                    "({}, {}, {}) is divisible by ({a}, {b}, {c}): tensor cores",
                    w.tiles, w.c_in, w.c_out
                ),
                None => format!(
                    "({}, {}, {}) is divisible by none of (16,16,16), (8,16,32), \
                     (32,16,8): the Direct batched multiply",
                    w.tiles, w.c_in, w.c_out
                ),
            };
            let fused = match &w.fused_why_not {
                None => "the fused engine can run it (one kernel: input transform, \
                         tensor-core products, output transform; U and M stay on chip)"
                    .to_string(),
                Some(why) => format!("the fused engine cannot: {why}"),
            };
            let how = match (w.decided_by, cfg.winograd_gemm) {
                (EngineDecision::SeedRule, WinogradGemmPolicy::Fused) => {
                    format!("winograd_gemm fused: {fused}, so the seed's rule decides ({rule})")
                }
                (EngineDecision::SeedRule, _) => {
                    format!("winograd_gemm seed: the rule decides ({rule})")
                }
                (EngineDecision::Forced, _) => format!(
                    "winograd_gemm {}: forced {} (the seed's rule would say: {rule})",
                    cfg.winograd_gemm,
                    w.engines[0].name()
                ),
                (EngineDecision::Measured, _) => format!(
                    "winograd_gemm auto: the engines {} are measured, the rule's first \
                     ({rule}); {fused}",
                    w.engines
                        .iter()
                        .map(|e| e.name())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            };
            let of = if req.direction == Direction::BackwardData {
                " (the data gradient as a forward 3x3 convolution of dy with the \
                 rotated, channel-swapped filter, padding 2 - pad)"
            } else {
                ""
            };
            reasons.push(format!(
                "{}{of}: {} transform positions, one batched multiply of {} x {} by \
                 {} x {} per position; {how}; scratch {} in {} chunk(s)",
                p.path,
                w.tile.positions(),
                w.tiles,
                w.c_in,
                w.c_in,
                w.c_out,
                mib(p.scratch_bytes),
                p.chunks
            ));
        }
    }

    fn forced_by(&self, policy: ConvAlgoPolicy) -> bool {
        match self.0 {
            WinogradTile::F2x3 => matches!(
                policy,
                ConvAlgoPolicy::Winograd | ConvAlgoPolicy::WinogradF2x3
            ),
            WinogradTile::F4x3 => matches!(
                policy,
                ConvAlgoPolicy::Winograd | ConvAlgoPolicy::WinogradF4x3
            ),
        }
    }
}

/// Why the plan's cuDNN candidate cannot go through the graph API (`None`: it does, its engine
/// configs measured at the first call); shared by the graph path's rule and the plan's API line.
pub(crate) fn graph_refusal(req: &ConvPlanRequest, out_hw: (usize, usize)) -> Option<String> {
    if !req.cudnn_present {
        return Some(
            "cuDNN cannot be loaded (libcudnn.so.9 not found): nnfuse's own paths run instead"
                .into(),
        );
    }
    if req.config.cudnn_api == CudnnApi::Legacy {
        return Some(
            "NNFUSE_CUDNN_API / Config::cudnn_api is legacy: cuDNN runs through its legacy \
             cudnnConvolution* calls"
                .into(),
        );
    }
    if !req.cudnn_graph {
        return Some(
            "the loaded cuDNN has no graph API (it needs cuDNN 9 or newer exporting \
             cudnnBackendCreateDescriptor ... cudnnBackendExecute)"
                .into(),
        );
    }
    cudnn_int_limits(&req.shape, out_hw)
}

/// cuDNN's graph API: cuDNN loads, has the graph API (9 or newer), the API policy is not
/// `legacy`, and every size fits cuDNN's `int`. f32, f16 and bf16, NCHW and NHWC, every
/// direction (the filter gradient may accumulate: `beta = 1`). f32 engine configs run only
/// once checked against a true-f32 route (`choice::refuse_untrue_f32_graph`): their notes do
/// not prove true f32.
pub(crate) struct CudnnGraphRule;

impl PathRule for CudnnGraphRule {
    fn info(
        &self,
        path: ConvPath,
        req: &ConvPlanRequest,
        out_hw: (usize, usize),
    ) -> Result<PathInfo> {
        if let Some(why) = graph_refusal(req, out_hw) {
            return Ok(info_ineligible(path, why));
        }
        Ok(info_whole(path))
    }

    fn reasons(&self, req: &ConvPlanRequest, _p: &PathInfo, reasons: &mut Vec<String>) {
        let cfg = req.config;
        reasons.push(format!(
            "cudnn_graph: cuDNN's graph (backend) API: at the first call the heuristics \
             (INSTANT, then FALLBACK) list engine configs; each the policy admits (f32: no \
             TF32/tensor cores, no non-fused Winograd; no reduced-precision reduction; {}; no \
             run-time compilation) is finalized into an execution plan with a workspace of at \
             most {} and becomes one route, checked and timed with the others; a cached call \
             swaps the data pointers and runs cudnnBackendExecute (~12-17 us of host time \
             against 58-97 us for the legacy calls)",
            if cfg.deterministic {
                "nondeterministic engines excluded (NNFUSE_DETERMINISTIC)"
            } else {
                "nondeterministic engines allowed"
            },
            mib(cfg.conv_workspace_bytes())
        ));
        if req.dtype == DType::F32 {
            let bound = true_f32_bound(reduction_len(&req.shape, req.direction));
            reasons.push(format!(
                "cudnn_graph f32 means true f32: engine notes do not prove it (a config with no \
                 TF32 note measured 6.6e-4 from f64 on the H100), so besides the notes (no \
                 TF32, no Winograd filter gradient) each f32 engine config is run once against \
                 a true-f32 route (the direct kernel for the forward, else cuDNN's legacy \
                 algorithm with FMA math or im2col + GEMM, measured beside it) and refused \
                 above a relative L2 error of {bound:.1e} (true f32 ~1e-7 to 1e-6, TF32 \
                 ~3e-4); a tuning-file or forced graph route is checked the same way before it \
                 runs"
            ));
        }
    }

    fn forced_by(&self, policy: ConvAlgoPolicy) -> bool {
        policy == ConvAlgoPolicy::Cudnn
    }

    fn standalone(&self) -> bool {
        false
    }
}

/// Why a forward-only path cannot add a gradient of `d` (every gradient: it computes none).
fn forward_only_accumulate(d: Direction) -> Option<&'static str> {
    (d != Direction::Forward).then_some("it computes the forward only")
}

/// `path` (named `what` in the reason) refused for a gradient: it computes the forward only.
fn forward_only(path: ConvPath, req: &ConvPlanRequest, what: &str) -> Option<PathInfo> {
    (req.direction != Direction::Forward).then(|| {
        info_ineligible(
            path,
            format!(
                "{what} computes the forward only, not the {}",
                req.direction.describe()
            ),
        )
    })
}

/// The record of one of nnfuse's filter-gradient kernels (`what` in the reasons): refused for
/// the other directions and with the kernel's own `refusal`, else one whole-batch run whose
/// scratch (partial sums) `scratch` gives for the workspace cap.
fn filter_kernel_info(
    path: ConvPath,
    req: &ConvPlanRequest,
    what: &str,
    refusal: Option<String>,
    scratch: impl FnOnce(usize) -> usize,
) -> PathInfo {
    if let Some(info) = filter_gradient_only(path, req, what) {
        return info;
    }
    if let Some(why) = refusal {
        return info_ineligible(path, why);
    }
    PathInfo {
        scratch_bytes: scratch(req.config.conv_workspace_bytes()),
        ..info_whole(path)
    }
}

/// `path` (named `what` in the reason) refused for anything but the filter gradient.
fn filter_gradient_only(path: ConvPath, req: &ConvPlanRequest, what: &str) -> Option<PathInfo> {
    (req.direction != Direction::BackwardFilter).then(|| {
        info_ineligible(
            path,
            format!(
                "{what} computes the filter gradient only, not the {}",
                req.direction.describe()
            ),
        )
    })
}

/// The forward as the data gradient of its dual problem (`problem::dual`) through cuDNN's graph
/// API: the forward only, f32, stride 1, a padding within the dilated filter's reach, and the
/// graph API usable ([`graph_refusal`]). Its scratch is the dual filter.
pub(crate) struct DualRule;

impl PathRule for DualRule {
    fn accumulate_refusal(&self, d: Direction) -> Option<&'static str> {
        forward_only_accumulate(d)
    }

    fn info(
        &self,
        path: ConvPath,
        req: &ConvPlanRequest,
        out_hw: (usize, usize),
    ) -> Result<PathInfo> {
        if let Some(info) = forward_only(path, req, "the dual path") {
            return Ok(info);
        }
        let why = dual_refusal(&req.shape, req.dtype).or_else(|| graph_refusal(req, out_hw));
        if let Some(why) = why {
            return Ok(info_ineligible(path, why));
        }
        let s = &req.shape;
        Ok(PathInfo {
            scratch_bytes: s.c_out * s.c_in * s.kh * s.kw * req.dtype.size(),
            ..info_whole(path)
        })
    }

    fn reasons(&self, _req: &ConvPlanRequest, p: &PathInfo, reasons: &mut Vec<String>) {
        reasons.push(format!(
            "cudnn_dual: the forward as cuDNN's data gradient (graph API, the first engine \
             config the policy admits) of the dual problem — dy = x, the filter rotated by 180 \
             degrees with its channel axes swapped ({} of scratch, written at every call), \
             dx = y; on the H100 cuDNN's f32 data-gradient engines ran some 3x3 layers \
             1.4-1.6x faster than its forward engines",
            mib(p.scratch_bytes)
        ));
    }

    fn forced_by(&self, policy: ConvAlgoPolicy) -> bool {
        policy == ConvAlgoPolicy::CudnnDual
    }
}

/// The direct kernel: any forward problem, no gradient.
pub(crate) struct DirectRule;

impl PathRule for DirectRule {
    fn accumulate_refusal(&self, d: Direction) -> Option<&'static str> {
        forward_only_accumulate(d)
    }

    fn info(
        &self,
        path: ConvPath,
        req: &ConvPlanRequest,
        out_hw: (usize, usize),
    ) -> Result<PathInfo> {
        if let Some(info) = forward_only(path, req, "nnfuse's direct kernel") {
            return Ok(info);
        }
        if let Err(why) = direct_limits(&req.shape, out_hw) {
            return Ok(info_ineligible(path, why));
        }
        Ok(info_whole(path))
    }

    fn reasons(&self, _req: &ConvPlanRequest, _p: &PathInfo, reasons: &mut Vec<String>) {
        reasons.push(
            "direct: nnfuse's direct kernel, any shape, f32 accumulation, no workspace".into(),
        );
    }

    fn forced_by(&self, policy: ConvAlgoPolicy) -> bool {
        policy == ConvAlgoPolicy::Direct
    }
}

/// nnfuse's filter-gradient kernel (`kernels/conv_wgrad.cu`): the filter gradient of f32 3x3
/// stride-1 problems (`problem::direct_filter`), adding into dw or overwriting it. Its scratch
/// is the partial sums of its unit ranges.
pub(crate) struct DirectFilterRule;

impl PathRule for DirectFilterRule {
    fn info(
        &self,
        path: ConvPath,
        req: &ConvPlanRequest,
        out_hw: (usize, usize),
    ) -> Result<PathInfo> {
        Ok(filter_kernel_info(
            path,
            req,
            "nnfuse's filter-gradient kernel",
            direct_filter_refusal(
                &req.shape,
                req.dtype,
                out_hw,
                req.config.conv_workspace_bytes(),
            ),
            |cap| filter_grad_grid(&req.shape, out_hw, cap).scratch_bytes(&req.shape),
        ))
    }

    fn reasons(&self, _req: &ConvPlanRequest, p: &PathInfo, reasons: &mut Vec<String>) {
        reasons.push(format!(
            "direct_filter: nnfuse's filter-gradient kernel in true f32 (FMA): blocks of 32 \
             filters x 32 channels over ranges of output rows, each thread 4 filters x 9 taps, \
             partial sums per range ({} of scratch) added in order (deterministic); on the H100 \
             cuDNN's true-f32 filter-gradient engines ran a 3x3 64-channel layer at a third of \
             the FMA units' rate",
            mib(p.scratch_bytes)
        ));
    }

    fn forced_by(&self, policy: ConvAlgoPolicy) -> bool {
        policy == ConvAlgoPolicy::DirectFilter
    }
}

/// The filter gradient over 2x2 spatial tiles stacked as the batch (`problem::tiled`) through
/// cuDNN's graph API: the filter gradient only, f32, stride 1 and dilation 1, an output of at
/// least 32x32, the graph API usable for the tiled problem ([`graph_refusal`]) and its tiled x
/// and dy (the scratch) within the cap. It adds into dw as the graph route does.
pub(crate) struct TiledRule;

impl PathRule for TiledRule {
    fn info(
        &self,
        path: ConvPath,
        req: &ConvPlanRequest,
        out_hw: (usize, usize),
    ) -> Result<PathInfo> {
        if let Some(info) = filter_gradient_only(path, req, "the tiled path") {
            return Ok(info);
        }
        if let Some(why) = tiled_refusal(&req.shape, req.dtype, out_hw) {
            return Ok(info_ineligible(path, why));
        }
        let tiled = ConvPlanRequest {
            shape: tiled_shape(&req.shape, out_hw),
            ..*req
        };
        let tiled_out = tiled.shape.out_hw()?;
        if let Some(why) = graph_refusal(&tiled, tiled_out) {
            return Ok(info_ineligible(path, why));
        }
        let bytes = tiled_bytes(&req.shape, out_hw);
        let cap = req.config.conv_workspace_bytes();
        if bytes > cap {
            return Ok(info_ineligible(
                path,
                format!(
                    "its tiled x and dy ({}) exceed the workspace cap of {} \
                     (NNFUSE_CONV_WORKSPACE_MB / Config::conv_workspace_mb)",
                    mib(bytes),
                    mib(cap)
                ),
            ));
        }
        Ok(PathInfo {
            scratch_bytes: bytes,
            ..info_whole(path)
        })
    }

    fn reasons(&self, req: &ConvPlanRequest, p: &PathInfo, reasons: &mut Vec<String>) {
        let t = tiled_shape(&req.shape, req.shape.out_hw().unwrap_or((0, 0)));
        reasons.push(format!(
            "cudnn_tiled: the filter gradient as cuDNN's (graph API: each engine config the \
             policy admits for it is a route, checked against a true-f32 route and timed) of {} \
             images of {}x{} — each image's 2x2 quarters with their input windows, padding \
             written as zeros ({} of scratch, written at every call) — which sums the same \
             products; on the H100 cuDNN's true-f32 engines ran the 3x3 64-channel filter \
             gradient at 56x56 in 311-320 us and as quarters in 165 us (an FFT engine config \
             that the original problem's list lacks)",
            t.n,
            t.h,
            t.w,
            mib(p.scratch_bytes)
        ));
    }

    fn forced_by(&self, policy: ConvAlgoPolicy) -> bool {
        policy == ConvAlgoPolicy::CudnnTiled
    }
}

/// nnfuse's tensor-core filter gradient for layers with few input channels
/// (`problem::stem_filter`): the filter gradient only, f16 / bf16 channels-last, at most 16
/// input channels and 160 columns (`kh*kw*c_in`), adding into dw or overwriting it. Its scratch is the partial sums of
/// its unit ranges.
pub(crate) struct StemFilterRule;

impl PathRule for StemFilterRule {
    fn info(
        &self,
        path: ConvPath,
        req: &ConvPlanRequest,
        out_hw: (usize, usize),
    ) -> Result<PathInfo> {
        Ok(filter_kernel_info(
            path,
            req,
            "the stem filter-gradient kernel",
            stem_filter_refusal(
                &req.shape,
                req.dtype,
                out_hw,
                req.config.conv_workspace_bytes(),
            ),
            |cap| stem_grid(&req.shape, out_hw, cap).scratch_bytes(&req.shape),
        ))
    }

    fn reasons(&self, req: &ConvPlanRequest, p: &PathInfo, reasons: &mut Vec<String>) {
        reasons.push(format!(
            "stem_filter: nnfuse's tensor-core filter gradient for few input channels: the \
             {} columns (kh*kw*c_in) of each filter read from staged input rows (no column \
             matrix in memory), f32 accumulation, partial sums per range of output rows ({} of \
             scratch) added in a fixed order (deterministic); on the H100 it ran ResNet's 7x7/2 \
             stem at batch 32 (f16) in 82-84 us, cuDNN's f32-accumulating engines in 162-166",
            req.shape.kh * req.shape.kw * req.shape.c_in,
            mib(p.scratch_bytes)
        ));
    }

    fn forced_by(&self, policy: ConvAlgoPolicy) -> bool {
        policy == ConvAlgoPolicy::StemFilter
    }
}

/// nnfuse's tensor-core forward for layers with few input channels (`problem::stem`): the
/// forward only, f16 / bf16 channels-last, at most 16 input channels and 160 columns
/// (`kh*kw*c_in`). No scratch.
pub(crate) struct StemForwardRule;

impl PathRule for StemForwardRule {
    fn info(
        &self,
        path: ConvPath,
        req: &ConvPlanRequest,
        out_hw: (usize, usize),
    ) -> Result<PathInfo> {
        if let Some(info) = forward_only(path, req, "the stem forward kernel") {
            return Ok(info);
        }
        Ok(match stem_forward_refusal(&req.shape, req.dtype, out_hw) {
            Some(why) => info_ineligible(path, why),
            None => info_whole(path),
        })
    }

    fn reasons(&self, req: &ConvPlanRequest, _p: &PathInfo, reasons: &mut Vec<String>) {
        reasons.push(format!(
            "stem_forward: nnfuse's tensor-core forward for few input channels: the {} columns \
             (kh*kw*c_in) of each output pixel read from staged input rows (no column matrix \
             in memory), the filter tile in shared memory, f32 accumulation, each output \
             rounded once",
            req.shape.kh * req.shape.kw * req.shape.c_in
        ));
    }

    fn forced_by(&self, policy: ConvAlgoPolicy) -> bool {
        policy == ConvAlgoPolicy::StemForward
    }
}
