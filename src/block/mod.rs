//! Fused blocks of convolutional networks: the inference unit
//! `conv → BatchNorm (running statistics) → (+ shortcut) → ReLU` with the BatchNorm folded into
//! the convolution ([`ConvBnInference`], `docs/BLOCK.md`), and the training unit
//! `conv → BatchNorm(+ReLU | +Add+ReLU)` ([`ConvBnTrain`], `docs/BLOCK-TRAINING.md`).
//!
//! Files and what they may touch (lowest first):
//! - `fold`: the folding math in f64 ([`fold()`]), pure;
//! - `check`: a fused route's verdict against the unfused composition, pure;
//! - `plan`: every route's eligibility and reason ([`plan()`]), pure;
//! - `reference`: the f64 CPU reference of the whole unit ([`reference_forward`]), pure;
//! - `lt_epilogue`: the cuBLASLt matmul with a bias/ReLU epilogue (owned descriptors);
//! - `cudnn_fused`: `cudnnConvolutionBiasActivationForward` (owned descriptors);
//! - `api`: [`ConvBnInference`], its parameters and validation;
//! - `routes`: the three routes on validated operands;
//! - `decide`: the first call's check and race.
//!
//! The training block's first piece, [`ConvStats`] (a convolution that also writes its output's
//! per-channel sum and sum of squares, docs/BLOCK-TRAINING.md):
//! - `stats_plan`: its routes' eligibility and the check's tolerances, pure;
//! - `stats_kernel`: the launchers of `kernels/block_stats.cu` (per-channel sums, and the
//!   BatchNorm finalize from them), with their pure grid arithmetic;
//! - `conv_stats`: [`ConvStats`], validation, the two routes and the run-time fallback;
//! - `conv_stats_decide`: its first call's check and race.
//!
//! The training unit, [`ConvBnTrain`] (`conv → BatchNorm(+ReLU | +Add+ReLU)` forward and
//! backward, fused through ConvStats and the BatchNorm from its sums, or unfused):
//! - `train_plan`: its routes' eligibility and reasons, pure;
//! - `train`: [`ConvBnTrain`], its arguments, the routes, the stages and the backward;
//! - `train_decide`: its first call's check and race (forward plus the BatchNorm's backward);
//! - `fold_backward`: the folded backward of a pointwise BN + add + ReLU unit (dz never
//!   written), launchers on validated operands;
//! - `train_fold`: the composed and folded backward routes and the first backward's decision.
//!
//! The training chain, [`ConvBnChain`] (`conv → BN → ReLU → … → BN (+ add) → ReLU`, each inner
//! BatchNorm and ReLU folded into the next convolution through cuDNN's fused graphs, or as
//! `ConvBnTrain` units):
//! - `chain_plan`: which units connect and whether the prologue route may run, pure;
//! - `chain_graphs`: the prologue route's cuDNN graphs per link, from the plan cache;
//! - `chain_kernel`: the launchers of the finalize-into-scale-and-bias and apply kernels;
//! - `chain`: [`ConvBnChain`], its arguments and saved state, and the units route;
//! - `chain_fused`: the prologue route on validated operands;
//! - `chain_decide`: its first call's checks, engine race and route race.

mod api;
mod chain;
mod chain_decide;
mod chain_fused;
mod chain_graphs;
mod chain_kernel;
mod chain_plan;
mod check;
mod conv_stats;
mod conv_stats_decide;
mod cudnn_fused;
mod decide;
mod fold;
mod fold_backward;
mod lt_epilogue;
mod plan;
mod pointwise;
mod reference;
mod routes;
mod stats_kernel;
mod stats_plan;
mod train;
mod train_decide;
mod train_fold;
mod train_plan;

pub use api::{BlockChoice, ConvBnInference, ConvBnParams};
pub use chain::{
    AddendGrad, ChainArgs, ChainBackwardArgs, ChainBn, ChainChoice, ChainSaved, ConvBnChain,
};
pub use chain_plan::{ChainPlan, ChainRoute};
pub use conv_stats::{ConvStats, StatsChoice};
pub use fold::{fold, BnHost, Folded};
pub use plan::{plan, BlockPlan, BlockRoute, RouteInfo};
pub use reference::reference_forward;
pub use stats_plan::{StatsPlan, StatsRoute};
pub use train::{ConvBnArgs, ConvBnBackwardArgs, ConvBnTrain, ConvDone, TrainChoice, TrainSaved};
pub use train_plan::{plan_train, TrainPlan, TrainPlanRequest, TrainRoute};

/// What only nnfuse's own tests, benches and CLI use: the check's tolerance per data type, the
/// GEMM route's column cap, and ConvStats' pure plan and statistics check. Not a stable API.
#[doc(hidden)]
pub mod internals {
    pub use super::chain_plan::{plan_chain, ChainPlanRequest};
    pub use super::check::tolerance;
    pub use super::plan::MAX_COLUMN_BYTES;
    pub use super::stats_plan::{stats_error, stats_plan, stats_tolerance};
}
