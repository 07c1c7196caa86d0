//! 2-D convolution: cuDNN, im2col + GEMM, NHWC Winograd through one batched GEMM, and a direct
//! kernel, behind one explainable dispatcher.
//!
//! The problem is a [`ConvShape`] (the same struct as [`crate::reference::conv::Conv2d`], whose
//! documentation gives the operation, the output size and the layouts: NCHW with a KCRS filter,
//! NHWC with a KRSC filter).
//!
//! The user's entry is [`Conv2d`]: planned once per (problem, element type) and cached by the
//! Context, with `forward`, `backward_data` and `backward_filter`; [`plan()`] is the pure
//! decision behind it (also `nnfuse plan --conv`). `docs/CONV.md` describes the rules, the
//! measurement of `auto` and the tuning-cache format.
//!
//! Files and what they may touch:
//! - [`plan`](mod@plan): the pure decision — every path's eligibility, the policy, the
//!   candidates `auto` measures, Winograd's engine, reasons;
//! - [`sizes`]: pure arithmetic — eligibility of each path, intermediate sizes, batch chunks
//!   under the workspace cap, the seed's tensor-core rule;
//! - [`cudnn`]: owned cuDNN descriptors and thin wrappers of its convolution calls;
//! - `choice`: the first call's measurement, the choice caches and the tuning-cache file;
//! - `route`: runs one route (the one place a route becomes a path call);
//! - `ops`: [`Conv2d`], validation and dispatch;
//! - `im2col` / `direct`: launchers of `kernels/im2col.cu` and `kernels/conv_direct.cu`;
//! - `winograd` / `winograd_gemm`: launchers of `kernels/winograd.cu` (transforms) and
//!   `kernels/winograd_gemm.cu` (the Direct batched multiply).
//!
//! The path functions take device addresses that the dispatcher has already checked (lengths,
//! device, aliasing, overflow); they are `unsafe` for that reason and never seen by users.

pub mod cudnn;
pub mod plan;
pub mod sizes;

mod choice;
mod direct;
pub mod im2col;
mod ops;
mod route;
mod winograd;
mod winograd_gemm;

pub use crate::reference::conv::Conv2d as ConvShape;
pub use choice::{
    clear as clear_choices, cudnn_search, set_cudnn_search, AutoReport, CandidateReport,
    ChoiceOrigin, ConvChoice, CudnnSearch, Outcome, ENV_CONV_CUDNN_SEARCH,
};
/// The measurement's thresholds, keys and tuning-file entries, for nnfuse's own tests, benches
/// and CLI (not a stable API).
#[doc(hidden)]
pub mod choice_internals {
    pub use super::choice::{
        cached_len as cached_choices, check_tolerance, entry_from_json, entry_to_json,
        lookup as lookup_choice, measure_timing, winograd_error_floor, ChoiceKey, ConvDeviceTag,
        PolicyKey, SearchKey, ShapeKey, WinogradKey, MAX_CUDNN_CANDIDATES, MIN_NONZERO_FRACTION,
        WINOGRAD_ERROR_FACTOR,
    };
}
pub use cudnn::{CudnnAlgo, CudnnMath, CudnnPerf};
pub use ops::{simulate_missing_cudnn, Conv2d, Epilogue, FilterLayout, PreparedFilter};
pub use plan::{
    plan, ConvPath, ConvPlan, ConvPlanRequest, Direction, DirectionPlans, EngineDecision, PathInfo,
    Route, WinogradInfo, DIRECT_CANDIDATE_MAX_FLOPS,
};
pub use sizes::{WinogradEngine, WinogradTile};
pub use winograd::stages as winograd_stages;

/// Device addresses of a forward convolution's operands (checked by the dispatcher).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(dead_code)] // filled in by the convolution paths
pub(crate) struct FwdPtrs {
    /// Input, `shape.x_len()` elements.
    pub x: u64,
    /// Filter, `shape.w_len()` elements.
    pub w: u64,
    /// Output, `shape.y_len()` elements.
    pub y: u64,
}

/// Device addresses of a data-gradient convolution's operands (checked by the dispatcher).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(dead_code)] // filled in by the convolution paths
pub(crate) struct BwdDataPtrs {
    /// Output gradient, `shape.y_len()` elements.
    pub dy: u64,
    /// Filter, `shape.w_len()` elements.
    pub w: u64,
    /// Input gradient (overwritten), `shape.x_len()` elements.
    pub dx: u64,
}

/// Device addresses of a filter-gradient convolution's operands (checked by the dispatcher).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(dead_code)] // filled in by the convolution paths
pub(crate) struct BwdFilterPtrs {
    /// Input, `shape.x_len()` elements.
    pub x: u64,
    /// Output gradient, `shape.y_len()` elements.
    pub dy: u64,
    /// Filter gradient, `shape.w_len()` elements (overwritten, or added to with `accumulate`).
    pub dw: u64,
}
