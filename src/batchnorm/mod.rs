//! BatchNorm (+ReLU, +Add+ReLU): one dispatcher in the manner of OneFlow's normalization kernels.
//!
//! - [`plan()`]: the pure decision (mode, layout, path, reasons), tested without a GPU;
//! - `descriptor`: owned cuDNN descriptors (x/y, derived parameters, ReLU);
//! - `cudnn_calls`: thin wrappers of cuDNN's BatchNorm entry points;
//! - [`BatchNorm`]: the dispatcher that follows the plan — nnfuse's own kernels (the only path
//!   without cuDNN; see `docs/BATCHNORM.md`), cuDNN's fused BN+ReLU / BN+Add+ReLU where cuDNN
//!   allows it, otherwise cuDNN BN followed by nnfuse's bitmask kernels;
//! - [`BnSaved`]: the state a forward hands to its backward;
//! - `from_sums`: the own training forward from per-channel sums computed elsewhere
//!   ([`BatchNorm::forward_train_from_sums`]);
//! - `probe`: asks the installed cuDNN whether it runs a fused combination (internals);
//! - `graph_rule`: the pure choice of cuDNN API (graph or legacy) for the BatchNorm;
//! - `graph_route`: runs the BatchNorm through cuDNN's graph API (`cudnn_graph::graph_bn`)
//!   where the plan says so, with the legacy calls as the fallback.

mod args;
mod cudnn_calls;
mod descriptor;
mod from_sums;
mod graph_route;
mod graph_rule;
mod ops;
mod own;
mod own_launch;
mod own_units;
mod plan;
mod probe;
mod state;
mod types;

pub use args::{BackwardArgs, InferenceArgs, TrainArgs};
#[cfg(test)] // the chain's finalize is checked against this one
pub(crate) use from_sums::{finalize as finalize_from_sums, FromSumsArgs};
pub(crate) use ops::check_scalars;
pub use ops::BatchNorm;
pub use plan::{
    fused_dtype_supported, fused_refusals, infer_api, infer_mode, infer_path, oneflow_mode,
    own_variants, plan, BnPlan, PlanRequest, ASSUMED_CUDNN_VERSION, DEPARTS_FROM_ONEFLOW,
};
pub use state::BnSaved;
pub(crate) use state::OwnParts;
pub use types::{
    BnApi, BnMode, BnOptions, BnPath, Fuse, FusedRefusal, OwnVariant, OwnVariantChoice, Phase,
    CUDNN_EX_API_MIN_VERSION,
};

/// What only nnfuse's own tests, benchmarks and CLI use: the `auto` implementation table and its
/// measured thresholds, and the cuDNN fusion probe. Not a stable API.
#[doc(hidden)]
pub mod internals {
    pub use super::graph_rule::{graph_supported, GRAPH_FOR_AUTO};
    pub use super::plan::{
        auto_case, choose_impl, AutoCase, OWN_FOR_CHANNELS_FIRST,
        OWN_FOR_CHANNELS_FIRST_SHORT_RUNS, OWN_FOR_CHANNELS_LAST_FUSED,
        OWN_FOR_CHANNELS_LAST_ON_CHIP, OWN_FOR_CHANNELS_LAST_PLAIN, OWN_FOR_CHANNELS_LAST_UNFUSED,
        OWN_FOR_INFERENCE, OWN_FOR_TWO_D, OWN_PERSISTENT_MAX_BYTES, OWN_PER_CHANNEL_MAX_M,
        PREFER_PERSISTENT, PREFER_PERSISTENT_CHANNELS_FIRST,
    };
    pub use super::probe::{probe_fused, Support};
}
