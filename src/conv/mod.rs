//! 2-D convolution: cuDNN, im2col + GEMM, NHWC Winograd through one batched GEMM, and a direct
//! kernel, behind one explainable dispatcher.
//!
//! The problem is a [`ConvShape`] (also `nnfuse::reference::conv::Conv2d`, whose documentation
//! gives the operation, the output size and the layouts: NCHW with a KCRS filter, NHWC with a
//! KRSC filter).
//!
//! The user's entry is [`Conv2d`]: planned once per (problem, element type) and cached by the
//! Context, with `forward`, `backward_data` and `backward_filter`; [`plan()`] is the pure
//! decision behind it (also `nnfuse plan --conv`). `docs/CONV.md` describes the rules, the
//! measurement of `auto` and the tuning-cache format.
//!
//! Files and what they may touch (lowest first):
//! - `problem/`: plain problem types — the shape, the direction, cuDNN's algorithm values, the
//!   operand addresses, Winograd's geometry; imports nothing of the convolution;
//! - `sizes`: pure arithmetic — im2col sizes, batch chunks under the workspace cap, the seed's
//!   tensor-core rule;
//! - `paths`: the registered paths — the one list `conv_paths!` (a path is one entry), the
//!   `ConvPath` it generates, each path's pure rule (eligibility, scratch, reasons);
//! - [`plan`](mod@plan): the pure decision — every path's eligibility (by its rule), the
//!   policy, the candidates `auto` measures, Winograd's engine, reasons;
//! - `cudnn`: owned cuDNN descriptors and thin wrappers of its convolution calls;
//! - `im2col` / `direct`: launchers of `kernels/im2col.cu` and `kernels/conv_direct.cu`
//!   (`direct`, `cudnn_run` and `cudnn_graph_run` are declared by their entries in
//!   `conv_paths!`, see `launcher_modules!` below);
//! - `winograd` / `winograd_gemm`: launchers of `kernels/winograd.cu` (transforms) and
//!   `kernels/winograd_gemm.cu` (the Direct batched multiply);
//! - `call`: what a path's `raw_run` receives (`PathCall`: problem, completed route, operands);
//! - `cudnn_run`: the cuDNN path's run function;
//! - `cudnn_graph_run`: the cuDNN graph path's run function (on `crate::cudnn_graph`'s cached
//!   plans), the engine configs the `cudnn` candidate stands for, the check of a stored one;
//! - `route`: runs one route (the one place a route becomes a path call, through the table
//!   that `conv_paths!` expands into);
//! - `choice`: the first call's measurement, the choice caches and the tuning-cache file;
//! - `state`: the per-problem state behind a [`Conv2d`] and its caches;
//! - `decide`: the first call's decision, forced routes, the run-time fallback;
//! - `api`: [`Conv2d`] and its operand validation.
//!
//! The path functions take device addresses that the dispatcher has already checked (lengths,
//! device, aliasing, overflow); they are `unsafe` for that reason and never seen by users.

pub(crate) mod cudnn;
pub(crate) mod paths;
pub mod plan;
pub(crate) mod problem;
pub(crate) mod sizes;

mod api;
mod call;
mod choice;
mod decide;
pub(crate) mod im2col;
mod route;
mod state;
mod stem;
mod winograd;
mod winograd_gemm;

/// Declares the launcher module of every `conv_paths!` entry with a `mod` clause (`cudnn_run`,
/// `direct`, `cudnn_graph_run`: `src/conv/<module>.rs`), so that registering a path declares
/// its launcher. Modules that more than one entry or file shares (`im2col`, `winograd`) are
/// declared above.
macro_rules! launcher_modules {
    ($(
        $(#[$doc:meta])*
        $variant:ident = $name:literal $(| $alias:literal)*, auto $rank:literal,
            $(mod $module:ident,)? run $($run:ident)::+, rule $rule:expr;
    )*) => {
        $($(mod $module;)?)*
    };
}
paths::conv_paths!(launcher_modules);

pub use api::{Conv2d, Epilogue, FilterLayout, PreparedFilter};
pub use choice::{
    clear as clear_choices, cudnn_search, set_cudnn_search, AutoReport, CandidateReport,
    ChoiceOrigin, ConvChoice, CudnnSearch, Outcome, ENV_CONV_CUDNN_SEARCH,
};
pub(crate) use cudnn_graph_run::policy as graph_policy;
pub use plan::{
    plan, ConvPath, ConvPlan, ConvPlanRequest, DirectionPlans, EngineDecision, PathInfo, Route,
    WinogradInfo,
};
pub(crate) use problem::{BwdDataPtrs, BwdFilterPtrs, FwdPtrs};
pub use problem::{
    ConvShape, CudnnAlgo, CudnnMath, CudnnPerf, Direction, GraphEngine, WinogradEngine,
    WinogradTile,
};

/// Internals that nnfuse's own benches, command-line tool and tests use (not a stable API): the
/// paths' size arithmetic, Winograd's geometry and stages, the im2col launchers, cuDNN's list
/// filter and the switch that hides cuDNN.
#[doc(hidden)]
pub mod internals {
    /// The measurement's thresholds, keys and tuning-file entries.
    pub use super::choice::{
        cached_len as cached_choices, check_tolerance, entry_from_json, entry_to_json,
        lookup as lookup_choice, measure_timing, winograd_error_floor, ChoiceKey, ConvDeviceTag,
        PolicyKey, SearchKey, ShapeKey, WinogradKey, MAX_CUDNN_CANDIDATES, MIN_NONZERO_FRACTION,
        WINOGRAD_ERROR_FACTOR,
    };
    pub use super::cudnn::usable;
    pub use super::plan::DIRECT_CANDIDATE_MAX_FLOPS;
    pub use super::problem::{fused_eligible, winograd_dims, WinogradDims, WinogradGeometry};
    pub use super::sizes::{
        balanced_chunks, im2col_chunk, im2col_dims, is_pointwise, tensor_core_rule, winograd_chunk,
        Im2colDims, TENSOR_CORE_SHAPES,
    };
    pub use super::state::simulate_missing_cudnn;
    pub use super::winograd::stages as winograd_stages;

    /// The im2col and col2im launchers on their own (benchmarks).
    pub mod im2col {
        pub use crate::conv::im2col::{col2im, columns_len, im2col, kernel_names};
    }
}
