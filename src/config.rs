//! Settings that steer nnfuse's choices: read once from the environment, overridable in code.
//!
//! | variable | values | default | effect |
//! |---|---|---|---|
//! | `NNFUSE_ENABLE_NHWC` (alias `ONEFLOW_ENABLE_NHWC`) | boolean | false | BatchNorm uses `SPATIAL_PERSISTENT` for inputs of rank > 2, as OneFlow does with its flag |
//! | `NNFUSE_BN_MODE_POLICY` | `oneflow`, `auto`, `fast` | `auto` | how the cuDNN BatchNorm mode is chosen (see [`BnModePolicy`]) |
//! | `NNFUSE_DISABLE_CUDNN_FUSION` | boolean | false | never use cuDNN's fused BN+ReLU / BN+Add+ReLU |
//! | `NNFUSE_GEMM_SEARCH` | boolean | true | time GEMM algorithm candidates; off = cuBLAS default |
//! | `NNFUSE_TUNING_CACHE` | a file path | unset | where GEMM and convolution search results persist |
//! | `NNFUSE_KERNEL_CACHE` | a directory | `$XDG_CACHE_HOME/nnfuse` when a tuning cache is set | where NVRTC-compiled kernel images persist |
//! | `NNFUSE_PLAN_CACHE_CAPACITY` | integer, 1 to 1048576 | 4096 | most entries of each plan/choice cache (LRU) |
//! | `NNFUSE_BN_IMPL` | `auto`, `cudnn`, `own` | `auto` | which BatchNorm implementation runs (see [`BnImpl`]) |
//! | `NNFUSE_CONV_ALGO` | `auto`, `cudnn`, `im2col`, `winograd`, `winograd_f2x3`, `winograd_f4x3`, `direct` | `auto` | how convolutions are computed (see [`ConvAlgoPolicy`]) |
//! | `NNFUSE_WINOGRAD_GEMM` | `auto`, `seed`, `tensor_core`, `direct`, `fused` | `auto` | how Winograd's batched multiply runs (see [`WinogradGemmPolicy`]) |
//! | `NNFUSE_CONV_WORKSPACE_MB` | integer, 1 to 1048576 (1 TiB) | 256 | cap on the scratch memory of nnfuse's own convolution paths |
//! | `NNFUSE_CUDNN_WORKSPACE_MB` | integer, 1 to 1048576 (1 TiB) | 2048 | cap on the workspace of one cuDNN convolution algorithm or graph engine config |
//! | `NNFUSE_DETERMINISTIC` | boolean | false | only deterministic algorithms (cuDNN convolution backward) |
//! | `NNFUSE_CUDNN_API` | `auto`, `graph`, `legacy` | `auto` | which cuDNN API runs convolutions and BatchNorm (see [`CudnnApi`]) |
//! | `NNFUSE_CUDNN_REPLAY` | boolean | false | replay a cuDNN call (graph-API execution, legacy convolution or BatchNorm call) repeated with the same buffers from a CUDA graph captured at its second call (see [`Config::cudnn_replay`]) |
//! | `NNFUSE_CONV_TUNE_BUDGET_MS` | integer, 0 to 600000 | 70 | host milliseconds the first call of a convolution direction may spend deciding; 0 = exhaustive (see [`Config::conv_tune_budget_ms`]) |
//!
//! Booleans parse like OneFlow's `ParseBooleanFromEnv`: `1/0`, `true/false`, `yes/no`, `on/off`
//! (any case, surrounding blanks ignored); an empty value counts as unset; anything else is
//! an [`Error::Config`] naming the variable. When both `NNFUSE_ENABLE_NHWC` and
//! `ONEFLOW_ENABLE_NHWC` are set, the `NNFUSE_` one wins. An integer outside its range is an
//! [`Error::Config`] too (a huge workspace cap once overflowed the size computations). A set
//! `NNFUSE_*` variable that nnfuse does not know (a typo) gets a warning naming the closest
//! known one.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use once_cell::sync::OnceCell;

use crate::error::{Error, Result};

/// How the cuDNN BatchNorm mode is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum BnModePolicy {
    /// Exactly OneFlow's rule: 2-D input → `PER_ACTIVATION`; NHWC flag → `SPATIAL_PERSISTENT`;
    /// otherwise `SPATIAL`.
    OneFlow,
    /// OneFlow's rule minus the traps measured on the H100: 2-D input and channels-last
    /// training inputs use `SPATIAL_PERSISTENT`.
    #[default]
    Auto,
    /// `SPATIAL_PERSISTENT` wherever cuDNN accepts it.
    Fast,
}

impl BnModePolicy {
    /// The spelling used by the environment variable and the CLI.
    pub const fn name(self) -> &'static str {
        match self {
            BnModePolicy::OneFlow => "oneflow",
            BnModePolicy::Auto => "auto",
            BnModePolicy::Fast => "fast",
        }
    }
}

impl fmt::Display for BnModePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for BnModePolicy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "oneflow" => Ok(BnModePolicy::OneFlow),
            "auto" => Ok(BnModePolicy::Auto),
            "fast" => Ok(BnModePolicy::Fast),
            _ => Err(Error::Config {
                var: ENV_BN_MODE_POLICY.into(),
                value: s.into(),
                reason: "expected one of oneflow, auto, fast".into(),
            }),
        }
    }
}

/// Parses one of `names` (case-insensitive, `-` read as `_`) into the matching value.
fn parse_choice<T: Copy>(var: &str, s: &str, table: &[(&str, T)]) -> Result<T> {
    let v = s.trim().to_ascii_lowercase().replace('-', "_");
    table
        .iter()
        .find(|(n, _)| *n == v)
        .map(|(_, t)| *t)
        .ok_or_else(|| Error::Config {
            var: var.into(),
            value: s.into(),
            reason: format!(
                "expected one of {}",
                table.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
            ),
        })
}

/// Which BatchNorm implementation runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum BnImpl {
    /// The plan chooses per shape between cuDNN and nnfuse's own kernels (by measurement).
    #[default]
    Auto,
    /// Always cuDNN (fused where allowed, else cuDNN BN plus the bitmask kernels).
    Cudnn,
    /// Always nnfuse's own BatchNorm kernels (no cuDNN needed).
    Own,
}

impl BnImpl {
    const TABLE: [(&'static str, BnImpl); 3] = [
        ("auto", BnImpl::Auto),
        ("cudnn", BnImpl::Cudnn),
        ("own", BnImpl::Own),
    ];

    /// The spelling used by the environment variable and the CLI.
    pub const fn name(self) -> &'static str {
        match self {
            BnImpl::Auto => "auto",
            BnImpl::Cudnn => "cudnn",
            BnImpl::Own => "own",
        }
    }
}

impl fmt::Display for BnImpl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for BnImpl {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        parse_choice(ENV_BN_IMPL, s, &Self::TABLE)
    }
}

/// How a convolution is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ConvAlgoPolicy {
    /// Measure the eligible paths on a problem's first call and keep the fastest that passed its
    /// numerical check (cuDNN unless clearly beaten).
    #[default]
    Auto,
    /// cuDNN's convolution (algorithm from cuDNN's own search).
    Cudnn,
    /// nnfuse's im2col kernel followed by a strided batched GEMM.
    Im2col,
    /// Winograd (3x3, stride 1, dilation 1, NHWC), the tile size measured.
    Winograd,
    /// Winograd F(2x2, 3x3).
    WinogradF2x3,
    /// Winograd F(4x4, 3x3).
    WinogradF4x3,
    /// nnfuse's direct convolution kernel (any shape; slow on large layers).
    Direct,
    /// The forward as the data gradient of its dual problem through cuDNN's graph API (f32,
    /// stride 1; `cudnn_dual`).
    CudnnDual,
    /// nnfuse's filter-gradient kernel (f32, 3x3, stride 1; `direct_filter`): the filter
    /// gradient only; other directions fall back as the plan says.
    DirectFilter,
    /// The filter gradient over 2x2 spatial tiles stacked as the batch, through cuDNN's graph
    /// API (f32, stride 1; `cudnn_tiled`).
    CudnnTiled,
    /// nnfuse's tensor-core filter gradient for layers with few input channels (f16 / bf16
    /// channels-last, at most 16 input channels and `kh*kw*c_in` ≤ 160, such as a 7x7 stem;
    /// `stem_filter`): the filter gradient only; other directions fall back as the plan says.
    StemFilter,
    /// nnfuse's tensor-core forward for layers with few input channels (f16 / bf16
    /// channels-last, at most 16 input channels and `kh*kw*c_in` ≤ 160; `stem_forward`): the
    /// forward only; the gradients fall back as the plan says.
    StemForward,
}

impl ConvAlgoPolicy {
    const TABLE: [(&'static str, ConvAlgoPolicy); 12] = [
        ("auto", ConvAlgoPolicy::Auto),
        ("cudnn", ConvAlgoPolicy::Cudnn),
        ("im2col", ConvAlgoPolicy::Im2col),
        ("winograd", ConvAlgoPolicy::Winograd),
        ("winograd_f2x3", ConvAlgoPolicy::WinogradF2x3),
        ("winograd_f4x3", ConvAlgoPolicy::WinogradF4x3),
        ("direct", ConvAlgoPolicy::Direct),
        ("cudnn_dual", ConvAlgoPolicy::CudnnDual),
        ("direct_filter", ConvAlgoPolicy::DirectFilter),
        ("cudnn_tiled", ConvAlgoPolicy::CudnnTiled),
        ("stem_filter", ConvAlgoPolicy::StemFilter),
        ("stem_forward", ConvAlgoPolicy::StemForward),
    ];

    /// The spelling used by the environment variable and the CLI.
    pub const fn name(self) -> &'static str {
        match self {
            ConvAlgoPolicy::Auto => "auto",
            ConvAlgoPolicy::Cudnn => "cudnn",
            ConvAlgoPolicy::Im2col => "im2col",
            ConvAlgoPolicy::Winograd => "winograd",
            ConvAlgoPolicy::WinogradF2x3 => "winograd_f2x3",
            ConvAlgoPolicy::WinogradF4x3 => "winograd_f4x3",
            ConvAlgoPolicy::Direct => "direct",
            ConvAlgoPolicy::CudnnDual => "cudnn_dual",
            ConvAlgoPolicy::DirectFilter => "direct_filter",
            ConvAlgoPolicy::CudnnTiled => "cudnn_tiled",
            ConvAlgoPolicy::StemFilter => "stem_filter",
            ConvAlgoPolicy::StemForward => "stem_forward",
        }
    }
}

impl fmt::Display for ConvAlgoPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ConvAlgoPolicy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        parse_choice(ENV_CONV_ALGO, s, &Self::TABLE)
    }
}

/// How Winograd's batched multiply (one GEMM per transform position) runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum WinogradGemmPolicy {
    /// Measured per problem: the tensor-core GEMM (nnfuse's strided batched GEMM), nnfuse's
    /// Direct batched multiply, and (f16/bf16, channels multiples of 8) the fused kernel,
    /// whichever is fastest.
    #[default]
    Auto,
    /// The seed's rule as written: tensor cores when (tiles, C_in, C_out) are divisible by
    /// (16, 16, 16), (8, 16, 32) or (32, 16, 8), otherwise the Direct batched multiply.
    Seed,
    /// Always the tensor-core GEMM.
    TensorCore,
    /// Always the Direct batched multiply.
    Direct,
    /// The fused kernel (transforms and tensor-core products in one kernel) where it can run
    /// (f16/bf16, channel counts multiples of 8), else the seed's rule.
    Fused,
}

impl WinogradGemmPolicy {
    const TABLE: [(&'static str, WinogradGemmPolicy); 5] = [
        ("auto", WinogradGemmPolicy::Auto),
        ("seed", WinogradGemmPolicy::Seed),
        ("tensor_core", WinogradGemmPolicy::TensorCore),
        ("direct", WinogradGemmPolicy::Direct),
        ("fused", WinogradGemmPolicy::Fused),
    ];

    /// The spelling used by the environment variable and the CLI.
    pub const fn name(self) -> &'static str {
        match self {
            WinogradGemmPolicy::Auto => "auto",
            WinogradGemmPolicy::Seed => "seed",
            WinogradGemmPolicy::TensorCore => "tensor_core",
            WinogradGemmPolicy::Direct => "direct",
            WinogradGemmPolicy::Fused => "fused",
        }
    }
}

impl fmt::Display for WinogradGemmPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for WinogradGemmPolicy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        parse_choice(ENV_WINOGRAD_GEMM, s, &Self::TABLE)
    }
}

/// Which cuDNN API runs convolutions: the graph (backend) API's execution plans, built once per
/// problem and engine configuration (~12–17 µs of host time per call on the H100), or the
/// legacy `cudnnConvolution*` calls (deprecated in cuDNN 9; 58–97 µs per call).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum CudnnApi {
    /// The graph API where the loaded cuDNN has it (9 or newer) and can run the problem; the
    /// legacy algorithms are measured only when no engine configuration finalizes.
    #[default]
    Auto,
    /// The graph API instead of the legacy calls; the legacy calls only as the fallback when no
    /// engine configuration finalizes for the problem (or the graph API is missing, with a
    /// warning).
    Graph,
    /// The legacy calls only (the behaviour before the graph route existed).
    Legacy,
}

impl CudnnApi {
    const TABLE: [(&'static str, CudnnApi); 3] = [
        ("auto", CudnnApi::Auto),
        ("graph", CudnnApi::Graph),
        ("legacy", CudnnApi::Legacy),
    ];

    /// The spelling used by the environment variable and the CLI.
    pub const fn name(self) -> &'static str {
        match self {
            CudnnApi::Auto => "auto",
            CudnnApi::Graph => "graph",
            CudnnApi::Legacy => "legacy",
        }
    }
}

impl fmt::Display for CudnnApi {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CudnnApi {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        parse_choice(ENV_CUDNN_API, s, &Self::TABLE)
    }
}

/// How cuDNN's convolution algorithm is chosen (`NNFUSE_CONV_CUDNN_SEARCH`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum CudnnSearch {
    /// cuDNN's heuristic list (`cudnnGetConvolution*Algorithm_v7`): its first few usable
    /// algorithms (`MAX_CUDNN_CANDIDATES`) are timed by nnfuse, interleaved with the other
    /// routes (cheap to ask; the timing is shared with `auto`'s).
    #[default]
    Heuristic,
    /// cuDNN's Find (`cudnnFindConvolution*AlgorithmEx`): cuDNN runs and times every algorithm
    /// that fits the workspace (on the caller's inputs, into a scratch output) and its fastest
    /// usable one is the cuDNN candidate.
    Find,
}

impl CudnnSearch {
    const TABLE: [(&'static str, CudnnSearch); 4] = [
        ("heuristic", CudnnSearch::Heuristic),
        ("heuristics", CudnnSearch::Heuristic),
        ("get", CudnnSearch::Heuristic),
        ("find", CudnnSearch::Find),
    ];

    /// `heuristic` or `find`.
    pub const fn name(self) -> &'static str {
        match self {
            CudnnSearch::Heuristic => "heuristic",
            CudnnSearch::Find => "find",
        }
    }

    /// Parses [`CudnnSearch::name`] (any case; `heuristics` and `get` read as `heuristic`).
    pub fn parse(s: &str) -> Option<CudnnSearch> {
        s.parse().ok()
    }
}

impl fmt::Display for CudnnSearch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CudnnSearch {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        parse_choice(ENV_CONV_CUDNN_SEARCH, s, &Self::TABLE)
    }
}

/// `NNFUSE_ENABLE_NHWC`.
pub const ENV_ENABLE_NHWC: &str = "NNFUSE_ENABLE_NHWC";
/// OneFlow's name for the same flag, honoured as an alias.
pub const ENV_ONEFLOW_ENABLE_NHWC: &str = "ONEFLOW_ENABLE_NHWC";
/// `NNFUSE_BN_MODE_POLICY`.
pub const ENV_BN_MODE_POLICY: &str = "NNFUSE_BN_MODE_POLICY";
/// `NNFUSE_DISABLE_CUDNN_FUSION`.
pub const ENV_DISABLE_CUDNN_FUSION: &str = "NNFUSE_DISABLE_CUDNN_FUSION";
/// `NNFUSE_GEMM_SEARCH`.
pub const ENV_GEMM_SEARCH: &str = "NNFUSE_GEMM_SEARCH";
/// `NNFUSE_TUNING_CACHE`.
pub const ENV_TUNING_CACHE: &str = "NNFUSE_TUNING_CACHE";

/// `NNFUSE_KERNEL_CACHE`.
pub const ENV_KERNEL_CACHE: &str = "NNFUSE_KERNEL_CACHE";
/// `NNFUSE_PLAN_CACHE_CAPACITY`.
pub const ENV_PLAN_CACHE_CAPACITY: &str = "NNFUSE_PLAN_CACHE_CAPACITY";
/// `NNFUSE_BN_IMPL`.
pub const ENV_BN_IMPL: &str = "NNFUSE_BN_IMPL";
/// `NNFUSE_CONV_ALGO`.
pub const ENV_CONV_ALGO: &str = "NNFUSE_CONV_ALGO";
/// `NNFUSE_WINOGRAD_GEMM`.
pub const ENV_WINOGRAD_GEMM: &str = "NNFUSE_WINOGRAD_GEMM";
/// `NNFUSE_CONV_WORKSPACE_MB`.
pub const ENV_CONV_WORKSPACE_MB: &str = "NNFUSE_CONV_WORKSPACE_MB";
/// `NNFUSE_CUDNN_WORKSPACE_MB`.
pub const ENV_CUDNN_WORKSPACE_MB: &str = "NNFUSE_CUDNN_WORKSPACE_MB";
/// `NNFUSE_DETERMINISTIC`.
pub const ENV_DETERMINISTIC: &str = "NNFUSE_DETERMINISTIC";
/// `NNFUSE_CUDNN_API`.
pub const ENV_CUDNN_API: &str = "NNFUSE_CUDNN_API";
/// `NNFUSE_CONV_CUDNN_SEARCH`: `heuristic` (default) or `find` ([`CudnnSearch`]).
pub const ENV_CONV_CUDNN_SEARCH: &str = "NNFUSE_CONV_CUDNN_SEARCH";
/// `NNFUSE_CUDNN_REPLAY` ([`Config::cudnn_replay`]).
pub(crate) const ENV_CUDNN_REPLAY: &str = "NNFUSE_CUDNN_REPLAY";
/// `NNFUSE_CONV_TUNE_BUDGET_MS` ([`Config::conv_tune_budget_ms`]).
pub(crate) const ENV_CONV_TUNE_BUDGET_MS: &str = "NNFUSE_CONV_TUNE_BUDGET_MS";
/// Default of [`Config::conv_tune_budget_ms`]: three directions of a new problem within the
/// 300 ms first-call target with room for planning and cuDNN's queries.
pub(crate) const DEFAULT_CONV_TUNE_BUDGET_MS: usize = 70;
/// Most milliseconds `NNFUSE_CONV_TUNE_BUDGET_MS` accepts (10 minutes).
pub(crate) const MAX_CONV_TUNE_BUDGET_MS: usize = 600_000;

/// Default of [`Config::plan_cache_capacity`].
pub const DEFAULT_PLAN_CACHE_CAPACITY: usize = 4096;
/// Default of [`Config::conv_workspace_mb`].
pub const DEFAULT_CONV_WORKSPACE_MB: usize = 256;
/// Default of [`Config::cudnn_workspace_mb`]: cuDNN's FFT engines, the only ones faster than
/// true-f32 FMA engines on some large f32 layers, need 0.4–2.3 GB there (measured on the H100:
/// a VGG 3x3 256-channel data gradient at batch 16 runs in 1.00 ms with 1.28 GB, 1.48 ms at
/// most without); PyTorch's `cudnn.benchmark` admits any workspace that fits.
pub const DEFAULT_CUDNN_WORKSPACE_MB: usize = 2048;

/// Most entries `NNFUSE_PLAN_CACHE_CAPACITY` accepts.
pub(crate) const MAX_PLAN_CACHE_CAPACITY: usize = 1 << 20;
/// Most MiB `NNFUSE_CONV_WORKSPACE_MB` accepts (1 TiB: more than any GPU holds).
pub(crate) const MAX_CONV_WORKSPACE_MB: usize = 1 << 20;

/// Whether nnfuse runs under `scripts/sanitize` (`NNFUSE_UNDER_SANITIZER=1`): vendor-written
/// outputs are zeroed first, because initcheck does not see cuDNN's and cuBLASLt's stores on
/// the H100 (docs/RELIABILITY.md). Read once.
pub(crate) fn under_sanitizer() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("NNFUSE_UNDER_SANITIZER").is_ok_and(|v| v == "1"))
}

/// `NNFUSE_*` variables read elsewhere than [`Config`]: the CLI's log filter, and those of
/// nnfuse's own tests and benches. Known, so that setting them draws no "unknown variable"
/// warning.
const OTHER_VARS: [&str; 11] = [
    "NNFUSE_LOG",
    "NNFUSE_REQUIRE_NVRTC",
    "NNFUSE_TEST_SEED",
    "NNFUSE_GPU_RUN",
    "NNFUSE_UNDER_SANITIZER",
    "NNFUSE_BENCH_FILTER",
    "NNFUSE_BENCH_QUICK",
    "NNFUSE_BENCH_BN",
    "NNFUSE_SUITE_REPORTS",
    "NNFUSE_STARTUP_CHILD",
    "NNFUSE_STARTUP_RUNS",
];

/// Every variable nnfuse reads.
pub const ALL_VARS: [&str; 18] = [
    ENV_ENABLE_NHWC,
    ENV_ONEFLOW_ENABLE_NHWC,
    ENV_BN_MODE_POLICY,
    ENV_DISABLE_CUDNN_FUSION,
    ENV_GEMM_SEARCH,
    ENV_TUNING_CACHE,
    ENV_KERNEL_CACHE,
    ENV_PLAN_CACHE_CAPACITY,
    ENV_BN_IMPL,
    ENV_CONV_ALGO,
    ENV_WINOGRAD_GEMM,
    ENV_CONV_WORKSPACE_MB,
    ENV_CUDNN_WORKSPACE_MB,
    ENV_DETERMINISTIC,
    ENV_CUDNN_API,
    ENV_CONV_CUDNN_SEARCH,
    ENV_CONV_TUNE_BUDGET_MS,
    ENV_CUDNN_REPLAY,
];

/// The folder in the user's cache directory that holds kernel images when
/// [`Config::kernel_cache`] is unset.
pub(crate) const KERNEL_CACHE_FOLDER: &str = "nnfuse";

/// The settings one [`crate::Context`] works with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// OneFlow's NHWC flag: BatchNorm of rank > 2 uses `SPATIAL_PERSISTENT`.
    pub enable_nhwc: bool,
    /// How the BatchNorm mode is chosen.
    pub bn_mode_policy: BnModePolicy,
    /// Never use cuDNN's fused BN+activation paths (forces the fallback; useful to compare).
    pub disable_cudnn_fusion: bool,
    /// Search GEMM algorithms (true) or take the cuBLAS default (false).
    pub gemm_search: bool,
    /// File in which GEMM and convolution search results persist between processes.
    pub tuning_cache: Option<PathBuf>,
    /// Directory in which NVRTC-compiled kernel images persist between processes (`None`: the
    /// user's cache directory's `nnfuse` folder when [`Config::tuning_cache`] is set, else no
    /// disk cache; see [`Config::kernel_cache_dir`]).
    pub kernel_cache: Option<PathBuf>,
    /// Most entries each plan or choice cache keeps (least recently used evicted first).
    pub plan_cache_capacity: usize,
    /// Which BatchNorm implementation runs.
    pub bn_impl: BnImpl,
    /// How convolutions are computed.
    pub conv_algo: ConvAlgoPolicy,
    /// How Winograd's batched multiply runs.
    pub winograd_gemm: WinogradGemmPolicy,
    /// Cap, in MiB, on the scratch memory of nnfuse's own convolution paths (im2col columns,
    /// Winograd's transformed tensors): the batch is processed in chunks that fit.
    pub conv_workspace_mb: usize,
    /// Cap, in MiB, on the workspace of one cuDNN convolution algorithm or graph engine
    /// config: those that need more are not run.
    pub cudnn_workspace_mb: usize,
    /// Only deterministic algorithms (cuDNN's convolution backward may otherwise pick
    /// algorithms that use atomics).
    pub deterministic: bool,
    /// Which cuDNN API runs convolutions (graph or legacy).
    pub cudnn_api: CudnnApi,
    /// How cuDNN's convolution algorithm is chosen (a process-wide
    /// [`set_cudnn_search`](crate::conv::set_cudnn_search) overrides it).
    pub cudnn_search: CudnnSearch,
    /// Host milliseconds the first call of a convolution direction may spend deciding
    /// (finalizing cuDNN engine configs, checking and timing candidates): candidates are taken
    /// in the plan's order until it is spent, the rest skipped (said in the choice's notes and
    /// report). `0`: exhaustive — no budget, every admitted engine config up to the limit,
    /// engines that compile at run time included (as an explicit tuning run wants).
    pub conv_tune_budget_ms: usize,
    /// Replay cuDNN calls repeated with the same buffers — graph-API executions (convolutions,
    /// BatchNorm) and the legacy convolution and BatchNorm calls: the second call with the same
    /// addresses, workspace and scalars is captured into a CUDA graph, later ones launch it (one
    /// `cuGraphLaunch`, about 2 µs of host time, instead of `cudnnBackendExecute`'s 5–8 µs or a
    /// legacy call's 10–30). The same kernels run; `false` (the default) executes every call.
    ///
    /// Off by default: a capture is refused by CUDA — and fails the other thread's call — when
    /// another thread synchronizes the whole device meanwhile (`cuCtxSynchronize`,
    /// `cudaDeviceSynchronize`, a first stream in a new cudarc context): measured on the H100 as
    /// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` in the other thread and, in 1 of 3 such runs, a
    /// segmentation fault. Turn it on where no other thread synchronizes the device while
    /// nnfuse's calls run (a training loop on one thread).
    pub cudnn_replay: bool,
}

impl Default for Config {
    /// The defaults with no environment variable set.
    fn default() -> Self {
        Config {
            enable_nhwc: false,
            bn_mode_policy: BnModePolicy::Auto,
            disable_cudnn_fusion: false,
            gemm_search: true,
            tuning_cache: None,
            kernel_cache: None,
            plan_cache_capacity: DEFAULT_PLAN_CACHE_CAPACITY,
            bn_impl: BnImpl::Auto,
            conv_algo: ConvAlgoPolicy::Auto,
            winograd_gemm: WinogradGemmPolicy::Auto,
            conv_workspace_mb: DEFAULT_CONV_WORKSPACE_MB,
            cudnn_workspace_mb: DEFAULT_CUDNN_WORKSPACE_MB,
            deterministic: false,
            cudnn_api: CudnnApi::Auto,
            cudnn_search: CudnnSearch::Heuristic,
            conv_tune_budget_ms: DEFAULT_CONV_TUNE_BUDGET_MS,
            cudnn_replay: false,
        }
    }
}

/// Parses an integer >= 1; `var` names the variable in the error.
pub fn parse_count(var: &str, value: &str) -> Result<usize> {
    parse_count_at_most(var, value, usize::MAX)
}

/// Parses an integer from 1 to `max`; `var` names the variable in the error.
fn parse_count_at_most(var: &str, value: &str, max: usize) -> Result<usize> {
    match value.trim().parse::<usize>() {
        Ok(v) if (1..=max).contains(&v) => Ok(v),
        _ => Err(Error::Config {
            var: var.into(),
            value: value.into(),
            reason: if max == usize::MAX {
                "expected an integer >= 1".into()
            } else {
                format!("expected an integer from 1 to {max}")
            },
        }),
    }
}

/// Parses `NNFUSE_CONV_TUNE_BUDGET_MS`: an integer from 0 (exhaustive) to
/// [`MAX_CONV_TUNE_BUDGET_MS`].
fn parse_budget(value: &str) -> Result<usize> {
    match value.trim().parse::<usize>() {
        Ok(v) if v <= MAX_CONV_TUNE_BUDGET_MS => Ok(v),
        _ => Err(Error::Config {
            var: ENV_CONV_TUNE_BUDGET_MS.into(),
            value: value.into(),
            reason: format!(
                "expected an integer from 0 (no budget: exhaustive) to {MAX_CONV_TUNE_BUDGET_MS}"
            ),
        }),
    }
}

/// Edit distance (Levenshtein, in characters) between `a` and `b`.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diag = row[0];
        row[0] = i.saturating_add(1);
        for (j, &cb) in b.iter().enumerate() {
            let sub = diag.saturating_add(usize::from(ca != cb));
            let del = row[j + 1].saturating_add(1);
            let ins = row[j].saturating_add(1);
            diag = row[j + 1];
            row[j + 1] = sub.min(del).min(ins);
        }
    }
    row[b.len()]
}

/// For a set variable named `NNFUSE_*` that nnfuse does not read: the known name closest to it
/// (by edit distance). `None` for a known name or one outside the `NNFUSE_` prefix.
pub(crate) fn unknown_var_suggestion(name: &str) -> Option<&'static str> {
    if !name.starts_with("NNFUSE_") {
        return None;
    }
    let known = ALL_VARS.iter().chain(OTHER_VARS.iter()).copied();
    if known.clone().any(|k| k == name) {
        return None;
    }
    known.min_by_key(|k| edit_distance(name, k))
}

/// Warns about each `NNFUSE_*` variable in `names` that nnfuse does not read (a typo is
/// otherwise silently ignored), naming the closest known variable.
fn warn_unknown_vars(names: impl Iterator<Item = String>) {
    for name in names {
        if let Some(near) = unknown_var_suggestion(&name) {
            tracing::warn!("unknown environment variable {name} is ignored; did you mean {near}?");
        }
    }
}

/// Parses a boolean the way OneFlow's `ParseBooleanFromEnv` does; `var` names the variable in
/// the error.
pub fn parse_bool(var: &str, value: &str) -> Result<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(Error::Config {
            var: var.into(),
            value: value.into(),
            reason: "expected a boolean: 1/0, true/false, yes/no, on/off".into(),
        }),
    }
}

impl Config {
    /// Where compiled kernel images persist: [`Config::kernel_cache`]; else, when
    /// [`Config::tuning_cache`] is set, an `nnfuse` folder in the user's cache directory
    /// (`$XDG_CACHE_HOME/nnfuse`, else `~/.cache/nnfuse` on Linux: never beside the tuning file,
    /// which may sit in a folder other users can write); else `None` (no disk cache).
    pub fn kernel_cache_dir(&self) -> Option<PathBuf> {
        if let Some(d) = &self.kernel_cache {
            return Some(d.clone());
        }
        self.tuning_cache.as_ref()?;
        Some(dirs::cache_dir()?.join(KERNEL_CACHE_FOLDER))
    }

    /// Reads the variables from the process environment now (not cached).
    /// A set `NNFUSE_*` variable that nnfuse does not know draws a warning naming the closest
    /// known one.
    pub fn from_env() -> Result<Config> {
        warn_unknown_vars(std::env::vars_os().filter_map(|(k, _)| k.into_string().ok()));
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// The configuration from the environment, read once per process; later changes to the
    /// environment are not seen (use [`Config::from_env`] or set fields in code for that).
    pub fn from_env_once() -> Result<Config> {
        static ONCE: OnceCell<std::result::Result<Config, (String, String, String)>> =
            OnceCell::new();
        let cached = ONCE.get_or_init(|| {
            Config::from_env().map_err(|e| match e {
                Error::Config { var, value, reason } => (var, value, reason),
                other => (String::new(), String::new(), other.to_string()),
            })
        });
        match cached {
            Ok(c) => Ok(c.clone()),
            Err((var, value, reason)) => Err(Error::Config {
                var: var.clone(),
                value: value.clone(),
                reason: reason.clone(),
            }),
        }
    }

    /// Builds a configuration from any variable lookup (tests, embedding applications).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Config> {
        let get = |k: &str| lookup(k).filter(|v| !v.trim().is_empty());
        let mut c = Config::default();
        if let Some(v) = get(ENV_ENABLE_NHWC) {
            c.enable_nhwc = parse_bool(ENV_ENABLE_NHWC, &v)?;
            // The alias must still parse: a typo in it is an error, not silently ignored.
            if let Some(alias) = get(ENV_ONEFLOW_ENABLE_NHWC) {
                parse_bool(ENV_ONEFLOW_ENABLE_NHWC, &alias)?;
            }
        } else if let Some(v) = get(ENV_ONEFLOW_ENABLE_NHWC) {
            c.enable_nhwc = parse_bool(ENV_ONEFLOW_ENABLE_NHWC, &v)?;
        }
        if let Some(v) = get(ENV_BN_MODE_POLICY) {
            c.bn_mode_policy = v.parse()?;
        }
        if let Some(v) = get(ENV_DISABLE_CUDNN_FUSION) {
            c.disable_cudnn_fusion = parse_bool(ENV_DISABLE_CUDNN_FUSION, &v)?;
        }
        if let Some(v) = get(ENV_GEMM_SEARCH) {
            c.gemm_search = parse_bool(ENV_GEMM_SEARCH, &v)?;
        }
        if let Some(v) = get(ENV_TUNING_CACHE) {
            c.tuning_cache = Some(PathBuf::from(v.trim()));
        }
        if let Some(v) = get(ENV_KERNEL_CACHE) {
            c.kernel_cache = Some(PathBuf::from(v.trim()));
        }
        if let Some(v) = get(ENV_PLAN_CACHE_CAPACITY) {
            c.plan_cache_capacity =
                parse_count_at_most(ENV_PLAN_CACHE_CAPACITY, &v, MAX_PLAN_CACHE_CAPACITY)?;
        }
        if let Some(v) = get(ENV_BN_IMPL) {
            c.bn_impl = v.parse()?;
        }
        if let Some(v) = get(ENV_CONV_ALGO) {
            c.conv_algo = v.parse()?;
        }
        if let Some(v) = get(ENV_WINOGRAD_GEMM) {
            c.winograd_gemm = v.parse()?;
        }
        if let Some(v) = get(ENV_CONV_WORKSPACE_MB) {
            c.conv_workspace_mb =
                parse_count_at_most(ENV_CONV_WORKSPACE_MB, &v, MAX_CONV_WORKSPACE_MB)?;
        }
        if let Some(v) = get(ENV_CUDNN_WORKSPACE_MB) {
            c.cudnn_workspace_mb =
                parse_count_at_most(ENV_CUDNN_WORKSPACE_MB, &v, MAX_CONV_WORKSPACE_MB)?;
        }
        if let Some(v) = get(ENV_DETERMINISTIC) {
            c.deterministic = parse_bool(ENV_DETERMINISTIC, &v)?;
        }
        if let Some(v) = get(ENV_CUDNN_API) {
            c.cudnn_api = v.parse()?;
        }
        if let Some(v) = get(ENV_CONV_CUDNN_SEARCH) {
            c.cudnn_search = v.parse()?;
        }
        if let Some(v) = get(ENV_CONV_TUNE_BUDGET_MS) {
            c.conv_tune_budget_ms = parse_budget(&v)?;
        }
        if let Some(v) = get(ENV_CUDNN_REPLAY) {
            c.cudnn_replay = parse_bool(ENV_CUDNN_REPLAY, &v)?;
        }
        Ok(c)
    }

    /// Sets [`Config::enable_nhwc`].
    pub fn with_nhwc(mut self, on: bool) -> Self {
        self.enable_nhwc = on;
        self
    }

    /// Sets [`Config::bn_mode_policy`].
    pub fn with_bn_mode_policy(mut self, p: BnModePolicy) -> Self {
        self.bn_mode_policy = p;
        self
    }

    /// Sets [`Config::disable_cudnn_fusion`].
    pub fn with_cudnn_fusion_disabled(mut self, off: bool) -> Self {
        self.disable_cudnn_fusion = off;
        self
    }

    /// Sets [`Config::gemm_search`].
    pub fn with_gemm_search(mut self, on: bool) -> Self {
        self.gemm_search = on;
        self
    }

    /// Sets [`Config::tuning_cache`].
    pub fn with_tuning_cache(mut self, path: Option<PathBuf>) -> Self {
        self.tuning_cache = path;
        self
    }

    /// Sets [`Config::kernel_cache`].
    pub fn with_kernel_cache(mut self, dir: Option<PathBuf>) -> Self {
        self.kernel_cache = dir;
        self
    }

    /// Sets [`Config::plan_cache_capacity`] (1 to 1048576, clamped).
    pub fn with_plan_cache_capacity(mut self, entries: usize) -> Self {
        self.plan_cache_capacity = entries.clamp(1, MAX_PLAN_CACHE_CAPACITY);
        self
    }

    /// Sets [`Config::bn_impl`].
    pub fn with_bn_impl(mut self, i: BnImpl) -> Self {
        self.bn_impl = i;
        self
    }

    /// Sets [`Config::conv_algo`].
    pub fn with_conv_algo(mut self, p: ConvAlgoPolicy) -> Self {
        self.conv_algo = p;
        self
    }

    /// Sets [`Config::winograd_gemm`].
    pub fn with_winograd_gemm(mut self, p: WinogradGemmPolicy) -> Self {
        self.winograd_gemm = p;
        self
    }

    /// Sets [`Config::conv_tune_budget_ms`] (0: exhaustive; at most 600000, clamped).
    pub fn with_conv_tune_budget_ms(mut self, ms: usize) -> Self {
        self.conv_tune_budget_ms = ms.min(MAX_CONV_TUNE_BUDGET_MS);
        self
    }

    /// Sets [`Config::conv_workspace_mb`] (1 to 1048576, clamped).
    pub fn with_conv_workspace_mb(mut self, mib: usize) -> Self {
        self.conv_workspace_mb = mib.clamp(1, MAX_CONV_WORKSPACE_MB);
        self
    }

    /// Sets [`Config::cudnn_workspace_mb`] (1 to 1048576, clamped).
    pub fn with_cudnn_workspace_mb(mut self, mib: usize) -> Self {
        self.cudnn_workspace_mb = mib.clamp(1, MAX_CONV_WORKSPACE_MB);
        self
    }

    /// Sets [`Config::cudnn_replay`].
    pub fn with_cudnn_replay(mut self, on: bool) -> Self {
        self.cudnn_replay = on;
        self
    }

    /// Sets [`Config::deterministic`].
    pub fn with_deterministic(mut self, on: bool) -> Self {
        self.deterministic = on;
        self
    }

    /// Sets [`Config::cudnn_api`].
    pub fn with_cudnn_api(mut self, api: CudnnApi) -> Self {
        self.cudnn_api = api;
        self
    }

    /// [`Config::conv_workspace_mb`] in bytes (the field clamped to 1 MiB to 1 TiB: it is
    /// public, so it may hold what the variable would refuse).
    pub fn conv_workspace_bytes(&self) -> usize {
        self.conv_workspace_mb
            .clamp(1, MAX_CONV_WORKSPACE_MB)
            .saturating_mul(1 << 20)
    }

    /// [`Config::cudnn_workspace_mb`] in bytes (clamped as [`Config::conv_workspace_bytes`]).
    pub fn cudnn_workspace_bytes(&self) -> usize {
        self.cudnn_workspace_mb
            .clamp(1, MAX_CONV_WORKSPACE_MB)
            .saturating_mul(1 << 20)
    }
}

impl fmt::Display for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "enable_nhwc          = {}", self.enable_nhwc)?;
        writeln!(f, "bn_mode_policy       = {}", self.bn_mode_policy)?;
        writeln!(f, "disable_cudnn_fusion = {}", self.disable_cudnn_fusion)?;
        writeln!(f, "gemm_search          = {}", self.gemm_search)?;
        match &self.tuning_cache {
            Some(p) => writeln!(f, "tuning_cache         = {}", p.display())?,
            None => writeln!(f, "tuning_cache         = (none)")?,
        }
        match &self.kernel_cache {
            Some(p) => writeln!(f, "kernel_cache         = {}", p.display())?,
            None => writeln!(
                f,
                "kernel_cache         = (the user cache folder's nnfuse/, if a tuning cache is set)"
            )?,
        }
        writeln!(f, "plan_cache_capacity  = {}", self.plan_cache_capacity)?;
        writeln!(f, "bn_impl              = {}", self.bn_impl)?;
        writeln!(f, "conv_algo            = {}", self.conv_algo)?;
        writeln!(f, "winograd_gemm        = {}", self.winograd_gemm)?;
        writeln!(f, "conv_workspace_mb    = {}", self.conv_workspace_mb)?;
        writeln!(f, "cudnn_workspace_mb   = {}", self.cudnn_workspace_mb)?;
        writeln!(f, "deterministic        = {}", self.deterministic)?;
        writeln!(f, "cudnn_api            = {}", self.cudnn_api)?;
        writeln!(f, "cudnn_search         = {}", self.cudnn_search)?;
        writeln!(f, "conv_tune_budget_ms  = {}", self.conv_tune_budget_ms)?;
        write!(f, "cudnn_replay         = {}", self.cudnn_replay)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(vars: &[(&str, &str)]) -> Result<Config> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn booleans_parse_like_oneflow() {
        for t in ["1", "true", "TRUE", "yes", "On", " on "] {
            assert!(parse_bool("X", t).unwrap(), "{t}");
        }
        for f in ["0", "false", "No", "off", "OFF"] {
            assert!(!parse_bool("X", f).unwrap(), "{f}");
        }
        for bad in ["2", "y", "enable", "truee", "-1"] {
            let e = parse_bool("NNFUSE_X", bad).unwrap_err();
            assert!(e.to_string().contains("NNFUSE_X"), "{e}");
        }
    }

    #[test]
    fn defaults_without_environment() {
        assert_eq!(cfg(&[]).unwrap(), Config::default());
        assert!(Config::default().gemm_search);
        assert_eq!(Config::default().bn_mode_policy, BnModePolicy::Auto);
    }

    #[test]
    fn oneflow_alias_and_precedence() {
        assert!(cfg(&[(ENV_ONEFLOW_ENABLE_NHWC, "1")]).unwrap().enable_nhwc);
        assert!(cfg(&[(ENV_ENABLE_NHWC, "yes")]).unwrap().enable_nhwc);
        let c = cfg(&[(ENV_ENABLE_NHWC, "0"), (ENV_ONEFLOW_ENABLE_NHWC, "1")]).unwrap();
        assert!(!c.enable_nhwc, "NNFUSE_ wins over the alias");
        let e = cfg(&[(ENV_ENABLE_NHWC, "0"), (ENV_ONEFLOW_ENABLE_NHWC, "maybe")]).unwrap_err();
        assert!(e.to_string().contains(ENV_ONEFLOW_ENABLE_NHWC));
        assert!(!cfg(&[(ENV_ENABLE_NHWC, "")]).unwrap().enable_nhwc);
    }

    #[test]
    fn every_variable_is_read() {
        let c = cfg(&[
            (ENV_BN_MODE_POLICY, "Fast"),
            (ENV_DISABLE_CUDNN_FUSION, "on"),
            (ENV_GEMM_SEARCH, "off"),
            (ENV_TUNING_CACHE, "/tmp/t.json"),
        ])
        .unwrap();
        assert_eq!(c.bn_mode_policy, BnModePolicy::Fast);
        assert!(c.disable_cudnn_fusion);
        assert!(!c.gemm_search);
        assert_eq!(c.tuning_cache, Some(PathBuf::from("/tmp/t.json")));
        let e = cfg(&[(ENV_BN_MODE_POLICY, "fastest")]).unwrap_err();
        assert!(e.to_string().contains(ENV_BN_MODE_POLICY));
        let e = cfg(&[(ENV_GEMM_SEARCH, "sometimes")]).unwrap_err();
        assert!(e.to_string().contains(ENV_GEMM_SEARCH));
    }

    #[test]
    fn new_variables_are_read_and_checked() {
        let c = cfg(&[
            (ENV_KERNEL_CACHE, "/tmp/k"),
            (ENV_PLAN_CACHE_CAPACITY, "17"),
            (ENV_BN_IMPL, "Own"),
            (ENV_CONV_ALGO, "winograd-f4x3"),
            (ENV_WINOGRAD_GEMM, "seed"),
            (ENV_CONV_WORKSPACE_MB, " 64 "),
            (ENV_DETERMINISTIC, "yes"),
        ])
        .unwrap();
        assert_eq!(c.kernel_cache, Some(PathBuf::from("/tmp/k")));
        assert_eq!(c.plan_cache_capacity, 17);
        assert_eq!(c.bn_impl, BnImpl::Own);
        assert_eq!(c.conv_algo, ConvAlgoPolicy::WinogradF4x3);
        assert_eq!(c.winograd_gemm, WinogradGemmPolicy::Seed);
        assert_eq!(c.conv_workspace_mb, 64);
        assert_eq!(c.conv_workspace_bytes(), 64 << 20);
        assert!(c.deterministic);
        for (var, bad) in [
            (ENV_PLAN_CACHE_CAPACITY, "0"),
            (ENV_PLAN_CACHE_CAPACITY, "-3"),
            (ENV_CONV_WORKSPACE_MB, "lots"),
            (ENV_CUDNN_WORKSPACE_MB, "0"),
            (ENV_BN_IMPL, "cudnn9"),
            (ENV_CONV_ALGO, "fft"),
            (ENV_WINOGRAD_GEMM, "wgmma"),
            (ENV_DETERMINISTIC, "perhaps"),
        ] {
            let e = cfg(&[(var, bad)]).unwrap_err();
            assert!(e.to_string().contains(var), "{e}");
        }
        for p in ConvAlgoPolicy::TABLE {
            assert_eq!(p.0.parse::<ConvAlgoPolicy>().unwrap(), p.1);
            assert_eq!(p.1.name(), p.0);
        }
        for p in WinogradGemmPolicy::TABLE {
            assert_eq!(p.0.parse::<WinogradGemmPolicy>().unwrap(), p.1);
            assert_eq!(p.1.name(), p.0);
        }
        for p in BnImpl::TABLE {
            assert_eq!(p.0.parse::<BnImpl>().unwrap(), p.1);
            assert_eq!(p.1.name(), p.0);
        }
        assert_eq!(ALL_VARS.len(), 18);
    }

    #[test]
    fn cudnn_replay_is_off_unless_turned_on() {
        assert!(!Config::default().cudnn_replay);
        assert!(!cfg(&[]).unwrap().cudnn_replay);
        assert!(!cfg(&[(ENV_CUDNN_REPLAY, "0")]).unwrap().cudnn_replay);
        assert!(cfg(&[(ENV_CUDNN_REPLAY, " on ")]).unwrap().cudnn_replay);
        assert!(cfg(&[(ENV_CUDNN_REPLAY, "1")]).unwrap().cudnn_replay);
        let e = cfg(&[(ENV_CUDNN_REPLAY, "sometimes")]).unwrap_err();
        assert!(e.to_string().contains(ENV_CUDNN_REPLAY), "{e}");
        assert!(Config::default().with_cudnn_replay(true).cudnn_replay);
        assert!(Config::default()
            .to_string()
            .contains("cudnn_replay         = false"));
    }

    #[test]
    fn cudnn_api_is_read_and_checked() {
        assert_eq!(Config::default().cudnn_api, CudnnApi::Auto);
        assert_eq!(cfg(&[]).unwrap().cudnn_api, CudnnApi::Auto);
        for (v, api) in [
            ("graph", CudnnApi::Graph),
            (" Legacy ", CudnnApi::Legacy),
            ("AUTO", CudnnApi::Auto),
        ] {
            assert_eq!(cfg(&[(ENV_CUDNN_API, v)]).unwrap().cudnn_api, api, "{v}");
        }
        let e = cfg(&[(ENV_CUDNN_API, "backend")]).unwrap_err();
        assert!(e.to_string().contains(ENV_CUDNN_API), "{e}");
        for p in CudnnApi::TABLE {
            assert_eq!(p.0.parse::<CudnnApi>().unwrap(), p.1);
            assert_eq!(p.1.name(), p.0);
        }
        assert!(ALL_VARS.contains(&ENV_CUDNN_API));
        let c = Config::default().with_cudnn_api(CudnnApi::Legacy);
        assert!(c.to_string().contains("cudnn_api            = legacy"));
    }

    /// `NNFUSE_CONV_CUDNN_SEARCH=maybe` was once a warning, then read as `heuristic`: like every
    /// other variable, an unknown value is an error naming it.
    #[test]
    fn cudnn_search_is_read_and_checked() {
        assert_eq!(Config::default().cudnn_search, CudnnSearch::Heuristic);
        assert_eq!(cfg(&[]).unwrap().cudnn_search, CudnnSearch::Heuristic);
        for (v, mode) in [
            ("find", CudnnSearch::Find),
            (" FIND ", CudnnSearch::Find),
            ("heuristic", CudnnSearch::Heuristic),
            ("heuristics", CudnnSearch::Heuristic),
            ("get", CudnnSearch::Heuristic),
            ("  ", CudnnSearch::Heuristic),
        ] {
            let c = cfg(&[(ENV_CONV_CUDNN_SEARCH, v)]).unwrap();
            assert_eq!(c.cudnn_search, mode, "{v:?}");
        }
        let e = cfg(&[(ENV_CONV_CUDNN_SEARCH, "maybe")]).unwrap_err();
        assert!(
            matches!(&e, Error::Config { var, value, .. }
                if var == ENV_CONV_CUDNN_SEARCH && value == "maybe"),
            "{e}"
        );
        assert!(e.to_string().contains("heuristic"), "{e}");
        assert!(ALL_VARS.contains(&ENV_CONV_CUDNN_SEARCH));
        assert_eq!(unknown_var_suggestion(ENV_CONV_CUDNN_SEARCH), None);
        assert_eq!(CudnnSearch::parse("maybe"), None);
        assert_eq!(CudnnSearch::parse("Find"), Some(CudnnSearch::Find));
        let c = Config {
            cudnn_search: CudnnSearch::Find,
            ..Config::default()
        };
        assert!(c.to_string().contains("cudnn_search         = find"));
    }

    /// `NNFUSE_CONV_WORKSPACE_MB=18446744073709551615` once reached the workspace rounding,
    /// which wrapped to a 1 MiB buffer in release builds.
    #[test]
    fn counts_out_of_their_documented_range_are_errors_naming_the_variable() {
        for (var, max) in [
            (ENV_CONV_WORKSPACE_MB, MAX_CONV_WORKSPACE_MB),
            (ENV_CUDNN_WORKSPACE_MB, MAX_CONV_WORKSPACE_MB),
            (ENV_PLAN_CACHE_CAPACITY, MAX_PLAN_CACHE_CAPACITY),
        ] {
            let top = max.to_string();
            assert!(cfg(&[(var, &top)]).is_ok(), "{var}={top}");
            for bad in [
                (max + 1).to_string(),
                usize::MAX.to_string(),
                "18446744073709551616".to_string(),
            ] {
                let e = cfg(&[(var, &bad)]).unwrap_err();
                let msg = e.to_string();
                assert!(msg.contains(var) && msg.contains(&top), "{msg}");
            }
        }
        let c = Config {
            conv_workspace_mb: usize::MAX,
            ..Config::default()
        };
        assert_eq!(c.conv_workspace_bytes(), MAX_CONV_WORKSPACE_MB << 20);
        let c = Config {
            cudnn_workspace_mb: 0,
            ..Config::default()
        };
        assert_eq!(c.cudnn_workspace_bytes(), 1 << 20);
        let c = Config::default()
            .with_conv_workspace_mb(usize::MAX)
            .with_plan_cache_capacity(usize::MAX);
        assert_eq!(c.conv_workspace_mb, MAX_CONV_WORKSPACE_MB);
        assert_eq!(c.plan_cache_capacity, MAX_PLAN_CACHE_CAPACITY);
        // The documentation states the limits.
        assert!(include_str!("config.rs").contains("1 to 1048576"));
        assert_eq!(MAX_CONV_WORKSPACE_MB, 1_048_576);
        assert_eq!(MAX_PLAN_CACHE_CAPACITY, 1_048_576);
    }

    #[test]
    fn unknown_variables_get_the_closest_known_name() {
        assert_eq!(
            unknown_var_suggestion("NNFUSE_CONV_ALG"),
            Some(ENV_CONV_ALGO)
        );
        assert_eq!(
            unknown_var_suggestion("NNFUSE_CONV_WORKSPACE"),
            Some(ENV_CONV_WORKSPACE_MB)
        );
        assert_eq!(unknown_var_suggestion("NNFUSE_LGO"), Some("NNFUSE_LOG"));
        assert_eq!(unknown_var_suggestion("NNFUSE_BNIMPL"), Some(ENV_BN_IMPL));
        for known in ALL_VARS.iter().chain(OTHER_VARS.iter()) {
            assert_eq!(unknown_var_suggestion(known), None, "{known}");
        }
        assert_eq!(unknown_var_suggestion("PATH"), None);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "abc"), 3);
    }

    #[test]
    fn builders_override() {
        let c = Config::default()
            .with_nhwc(true)
            .with_bn_mode_policy(BnModePolicy::OneFlow)
            .with_cudnn_fusion_disabled(true)
            .with_gemm_search(false);
        assert!(c.enable_nhwc && c.disable_cudnn_fusion && !c.gemm_search);
        assert_eq!(c.bn_mode_policy, BnModePolicy::OneFlow);
        assert!(c.to_string().contains("bn_mode_policy       = oneflow"));
    }

    #[test]
    fn the_tune_budget_parses_zero_as_exhaustive_and_names_the_variable() {
        assert_eq!(
            cfg(&[]).unwrap().conv_tune_budget_ms,
            DEFAULT_CONV_TUNE_BUDGET_MS
        );
        assert_eq!(
            cfg(&[(ENV_CONV_TUNE_BUDGET_MS, " 250 ")])
                .unwrap()
                .conv_tune_budget_ms,
            250
        );
        assert_eq!(
            cfg(&[(ENV_CONV_TUNE_BUDGET_MS, "0")])
                .unwrap()
                .conv_tune_budget_ms,
            0
        );
        for bad in ["-1", "ten", "600001", "1.5"] {
            let e = cfg(&[(ENV_CONV_TUNE_BUDGET_MS, bad)]).unwrap_err();
            assert!(e.to_string().contains(ENV_CONV_TUNE_BUDGET_MS), "{e}");
        }
        assert_eq!(
            Config::default()
                .with_conv_tune_budget_ms(usize::MAX)
                .conv_tune_budget_ms,
            MAX_CONV_TUNE_BUDGET_MS
        );
    }
}
