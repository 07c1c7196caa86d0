//! The BatchNorm plan: from (shape, axis, dtype, fusion, phase, config, cuDNN version) to the
//! cuDNN mode, the 4-D layout, the cuDNN API entry and the path — with the reason for every
//! choice. Pure: no GPU calls; runs and is tested on the CPU.

use std::fmt;

use crate::config::Config;
use crate::dtype::DType;
use crate::error::Result;
use crate::layout::ChannelLayout;

/// The activation fused after BatchNorm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fuse {
    /// `y = bn(x)`.
    None,
    /// `y = relu(bn(x))`.
    Relu,
    /// `y = relu(bn(x) + z)`.
    AddRelu,
}

/// Training (batch statistics) or inference (running statistics).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Batch statistics; updates the running statistics; has a backward.
    Training,
    /// Running statistics; no backward.
    Inference,
}

/// cuDNN's BatchNorm mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BnMode {
    /// `CUDNN_BATCHNORM_PER_ACTIVATION`: statistics per (c, h, w).
    PerActivation,
    /// `CUDNN_BATCHNORM_SPATIAL`: statistics per channel.
    Spatial,
    /// `CUDNN_BATCHNORM_SPATIAL_PERSISTENT`: per channel, cuDNN's fast kernels.
    SpatialPersistent,
}

/// Which cuDNN entry point runs the BatchNorm itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BnApi {
    /// `cudnnBatchNormalizationForwardTraining` / `Backward` / `ForwardInference`.
    Legacy,
    /// `cudnnBatchNormalizationForwardTrainingEx` / `BackwardEx` (with workspace).
    Ex,
}

/// How the whole operation runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BnPath {
    /// cuDNN's fused BN+ReLU / BN+Add+ReLU (`...Ex` with `BN_ACTIVATION` / `BN_ADD_ACTIVATION`).
    CudnnFused,
    /// cuDNN BatchNorm, then nnfuse's bitmask ReLU / Add+ReLU kernels.
    Fallback,
    /// cuDNN BatchNorm alone (no activation asked for).
    Plain,
}

/// Why the fused path was refused (every reason that applies is listed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FusedRefusal {
    /// No activation was asked for.
    NoActivation,
    /// Inference: cuDNN has no fused inference entry.
    Inference,
    /// `NNFUSE_DISABLE_CUDNN_FUSION` / [`Config::disable_cudnn_fusion`].
    DisabledByConfig,
    /// cuDNN fuses only NHWC.
    NotNhwc,
    /// cuDNN fuses only in `SPATIAL_PERSISTENT` mode.
    NotPersistent(BnMode),
    /// BN+Add+ReLU needs `C % 4 == 0`.
    ChannelsNotMultipleOf4(i32),
    /// The data type is not fused by cuDNN.
    DTypeUnsupported(DType),
    /// cuDNN older than the Ex API (7.4.1).
    CudnnTooOld(usize),
}

/// What to plan for.
#[derive(Debug, Clone, Copy)]
pub struct PlanRequest<'a> {
    /// Tensor shape (row-major).
    pub shape: &'a [usize],
    /// Channel axis.
    pub axis: usize,
    /// Activation type.
    pub dtype: DType,
    /// Activation fused after BN.
    pub fuse: Fuse,
    /// Training or inference.
    pub phase: Phase,
    /// NHWC flag, mode policy, fusion switch.
    pub config: &'a Config,
    /// cuDNN version number (e.g. 91900).
    pub cudnn_version: usize,
}

/// The decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BnPlan {
    /// 4-D view and memory format (OneFlow's inference rule).
    pub layout: ChannelLayout,
    /// cuDNN mode.
    pub mode: BnMode,
    /// cuDNN entry point for the BatchNorm.
    pub api: BnApi,
    /// How the whole operation runs.
    pub path: BnPath,
    /// Requested fusion.
    pub fuse: Fuse,
    /// Requested phase.
    pub phase: Phase,
    /// Activation type.
    pub dtype: DType,
    /// Why the fused path was not taken (empty when it was).
    pub refusals: Vec<FusedRefusal>,
    /// Every reason, in words: layout inference, mode (and each departure from OneFlow's rule),
    /// API, path and each refusal.
    pub reasons: Vec<String>,
}

/// Plans one BatchNorm. Errors only on invalid shape/axis (from layout inference).
pub fn plan(req: &PlanRequest<'_>) -> Result<BnPlan> {
    let _ = req;
    todo!("issue 3: the plan helper fills this in")
}

impl fmt::Display for BnPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self)
    }
}
