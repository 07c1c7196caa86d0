//! BatchNorm (+ReLU, +Add+ReLU): one dispatcher in the manner of OneFlow's normalization kernels.
//!
//! - [`plan()`]: the pure decision (mode, layout, path, reasons), tested without a GPU.

pub mod plan;

pub use plan::{
    fused_dtype_supported, fused_refusals, infer_api, infer_mode, infer_path, oneflow_mode, plan,
    BnApi, BnMode, BnPath, BnPlan, Fuse, FusedRefusal, Phase, PlanRequest, ASSUMED_CUDNN_VERSION,
    CUDNN_EX_API_MIN_VERSION, DEPARTS_FROM_ONEFLOW,
};
