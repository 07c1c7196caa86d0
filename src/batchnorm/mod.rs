//! BatchNorm (+ReLU, +Add+ReLU): one dispatcher in the manner of OneFlow's normalization kernels.
//!
//! - [`plan`]: the pure decision (mode, layout, path, reasons), tested without a GPU.

pub mod plan;

pub use plan::{plan, BnApi, BnMode, BnPath, BnPlan, Fuse, FusedRefusal, Phase, PlanRequest};
