//! The plain BatchNorm types every other BatchNorm file speaks: the fusion, the phase, cuDNN's
//! mode and entry point, the path, the own kernels' variants, why a fusion was refused, and the
//! options of one BatchNorm. No decisions and no GPU calls live here.

use std::fmt;
use std::str::FromStr;

use crate::dtype::DType;
use crate::error::{Error, Result};

/// The first cuDNN version with `cudnnBatchNormalizationForwardTrainingEx` / `BackwardEx`
/// (7.4.1), below which neither the Ex API nor the fused path exists.
pub const CUDNN_EX_API_MIN_VERSION: usize = 7401;

/// Options of one `BatchNorm` beyond the Context's [`crate::Config`] (tests and benchmarks
/// compare variants with them). BatchNorms of the same shape with different options are planned
/// and cached separately.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct BnOptions {
    /// Which variant of nnfuse's own training kernels to plan (when the plan takes the own
    /// path): by size (default), always two-pass, or persistent wherever the shape allows it.
    pub own_variant: OwnVariantChoice,
}

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

impl Fuse {
    /// Every variant.
    pub const ALL: [Fuse; 3] = [Fuse::None, Fuse::Relu, Fuse::AddRelu];

    /// `none` / `relu` / `add_relu`.
    pub const fn name(self) -> &'static str {
        match self {
            Fuse::None => "none",
            Fuse::Relu => "relu",
            Fuse::AddRelu => "add_relu",
        }
    }

    /// How the fused operation reads in sentences (`BN`, `BN+ReLU`, `BN+Add+ReLU`).
    pub const fn describe(self) -> &'static str {
        match self {
            Fuse::None => "BN",
            Fuse::Relu => "BN+ReLU",
            Fuse::AddRelu => "BN+Add+ReLU",
        }
    }
}

impl fmt::Display for Fuse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Fuse {
    type Err = Error;
    /// Accepts `none`, `relu`, `add-relu` / `add_relu` (any case, blanks around ignored).
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "none" => Ok(Fuse::None),
            "relu" => Ok(Fuse::Relu),
            "add-relu" | "add_relu" => Ok(Fuse::AddRelu),
            _ => Err(Error::invalid(
                "fuse",
                format!("{s:?} is not one of none, relu, add-relu"),
            )),
        }
    }
}

/// Training (batch statistics) or inference (running statistics).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Batch statistics; updates the running statistics; has a backward.
    Training,
    /// Running statistics; no backward.
    Inference,
}

impl Phase {
    /// Both phases.
    pub const ALL: [Phase; 2] = [Phase::Training, Phase::Inference];

    /// `training` / `inference`.
    pub const fn name(self) -> &'static str {
        match self {
            Phase::Training => "training",
            Phase::Inference => "inference",
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
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

impl BnMode {
    /// `per_activation` / `spatial` / `spatial_persistent` (JSON, CLI).
    pub const fn name(self) -> &'static str {
        match self {
            BnMode::PerActivation => "per_activation",
            BnMode::Spatial => "spatial",
            BnMode::SpatialPersistent => "spatial_persistent",
        }
    }

    /// cuDNN's spelling (`CUDNN_BATCHNORM_SPATIAL`, ...), for sentences.
    pub const fn cudnn_name(self) -> &'static str {
        match self {
            BnMode::PerActivation => "CUDNN_BATCHNORM_PER_ACTIVATION",
            BnMode::Spatial => "CUDNN_BATCHNORM_SPATIAL",
            BnMode::SpatialPersistent => "CUDNN_BATCHNORM_SPATIAL_PERSISTENT",
        }
    }
}

impl fmt::Display for BnMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which cuDNN entry point runs the BatchNorm itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BnApi {
    /// `cudnnBatchNormalizationForwardTraining` / `Backward` / `ForwardInference`.
    Legacy,
    /// `cudnnBatchNormalizationForwardTrainingEx` / `BackwardEx` (with workspace).
    Ex,
    /// No cuDNN entry point: cuDNN cannot be loaded, so nnfuse's own kernels run.
    None,
}

impl BnApi {
    /// `legacy` / `ex` / `none`.
    pub const fn name(self) -> &'static str {
        match self {
            BnApi::Legacy => "legacy",
            BnApi::Ex => "ex",
            BnApi::None => "none",
        }
    }
}

impl fmt::Display for BnApi {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
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
    /// nnfuse's own BatchNorm kernels for everything: statistics, the affine transform, the
    /// activation and its mask, the backward (`kernels/batchnorm*.cu`; no cuDNN needed).
    Own,
}

impl BnPath {
    /// `cudnn_fused` / `fallback` / `plain` / `own`.
    pub const fn name(self) -> &'static str {
        match self {
            BnPath::CudnnFused => "cudnn_fused",
            BnPath::Fallback => "fallback",
            BnPath::Plain => "plain",
            BnPath::Own => "own",
        }
    }

    /// Whether this path runs on nnfuse's own kernels.
    pub const fn is_own(self) -> bool {
        matches!(self, BnPath::Own)
    }
}

impl fmt::Display for BnPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why the fused path was refused (every reason that applies is listed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FusedRefusal {
    /// No activation was asked for.
    NoActivation,
    /// Inference: cuDNN has no fused inference entry.
    Inference,
    /// `NNFUSE_DISABLE_CUDNN_FUSION` / [`crate::Config::disable_cudnn_fusion`].
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
    /// cuDNN cannot be loaded.
    CudnnMissing,
    /// The BatchNorm runs through cuDNN's graph API without its epilogue graphs: graph
    /// BatchNorm, then nnfuse's bitmask kernels. No longer produced by the planner (the graph
    /// route fuses the activation in its own graph and falls back at run time, logged); kept so
    /// that matching code keeps compiling.
    GraphApi,
}

impl FusedRefusal {
    /// A short stable code (`not_nhwc`, `cudnn_too_old`, ...) for JSON and tests.
    pub const fn code(&self) -> &'static str {
        match self {
            FusedRefusal::NoActivation => "no_activation",
            FusedRefusal::Inference => "inference",
            FusedRefusal::DisabledByConfig => "disabled_by_config",
            FusedRefusal::NotNhwc => "not_nhwc",
            FusedRefusal::NotPersistent(_) => "not_persistent",
            FusedRefusal::ChannelsNotMultipleOf4(_) => "channels_not_multiple_of_4",
            FusedRefusal::DTypeUnsupported(_) => "dtype_unsupported",
            FusedRefusal::CudnnTooOld(_) => "cudnn_too_old",
            FusedRefusal::CudnnMissing => "cudnn_missing",
            FusedRefusal::GraphApi => "graph_api",
        }
    }
}

impl fmt::Display for FusedRefusal {
    /// The refusal and the measured fact behind it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FusedRefusal::NoActivation => {
                f.write_str("no activation was asked for (fuse none): there is nothing to fuse")
            }
            FusedRefusal::Inference => f.write_str(
                "inference: cuDNN's fused BN+activation exists only for training \
                 (cudnnBatchNormalizationForwardTrainingEx / BackwardEx); inference runs \
                 cudnnBatchNormalizationForwardInference and then the activation",
            ),
            FusedRefusal::DisabledByConfig => f.write_str(
                "fusion is disabled by NNFUSE_DISABLE_CUDNN_FUSION / \
                 Config::disable_cudnn_fusion",
            ),
            FusedRefusal::NotNhwc => f.write_str(
                "cuDNN fuses BN+activation only for NHWC and this input infers NCHW (NCHW \
                 BN+ReLU / BN+Add+ReLU returns NOT_SUPPORTED in every mode; docs/CUDNN-FACTS.md)",
            ),
            FusedRefusal::NotPersistent(mode) => write!(
                f,
                "cuDNN's fused BN+activation needs CUDNN_BATCHNORM_SPATIAL_PERSISTENT and the \
                 mode is {} (NHWC SPATIAL returns NOT_SUPPORTED from the forward; docs/CUDNN-FACTS.md)",
                mode.cudnn_name()
            ),
            FusedRefusal::ChannelsNotMultipleOf4(c) => write!(
                f,
                "cuDNN's fused BN+Add+ReLU needs C % 4 == 0 and C = {c} (at C = 30 its \
                 workspace query returns NOT_SUPPORTED, while BN+ReLU works; docs/CUDNN-FACTS.md)"
            ),
            FusedRefusal::DTypeUnsupported(d) => write!(
                f,
                "cuDNN's fused BN+activation does not take {d} activations"
            ),
            FusedRefusal::CudnnTooOld(v) => write!(
                f,
                "cuDNN {v} is older than 7.4.1 ({CUDNN_EX_API_MIN_VERSION}), the first with \
                 cudnnBatchNormalizationForwardTrainingEx / BackwardEx"
            ),
            FusedRefusal::CudnnMissing => f.write_str("cuDNN cannot be loaded on this machine"),
            FusedRefusal::GraphApi => f.write_str(
                "the BatchNorm runs through cuDNN's graph API without its BN + (add +) ReLU \
                 epilogue graph (docs/CUDNN-GRAPH.md)",
            ),
        }
    }
}

/// How nnfuse's own kernels run one phase (see `docs/BATCHNORM.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OwnVariant {
    /// Training: a reduction kernel (statistics, or the backward's two sums with the mask read
    /// inside), then the elementwise kernel (y and the mask, or dx): x is read twice.
    TwoPass,
    /// Training: one cooperative kernel that keeps its tiles of x (and dy') in shared memory
    /// across two grid-wide barriers: x is read from memory once.
    Persistent,
    /// Inference: one elementwise pass with scale and shift folded from the running statistics.
    Elementwise,
    /// Training backward with at most `plan::OWN_PER_CHANNEL_MAX_M` values per channel: one block
    /// per channel sums and writes dx in f64 in one kernel (dx cancels there; see
    /// `docs/BATCHNORM.md`, "Accuracy").
    PerChannel,
}

impl OwnVariant {
    /// `two_pass` / `persistent` / `elementwise` / `per_channel`.
    pub const fn name(self) -> &'static str {
        match self {
            OwnVariant::TwoPass => "two_pass",
            OwnVariant::Persistent => "persistent",
            OwnVariant::Elementwise => "elementwise",
            OwnVariant::PerChannel => "per_channel",
        }
    }
}

impl fmt::Display for OwnVariant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which variant of the own training kernels to plan ([`BnOptions`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum OwnVariantChoice {
    /// By the shape's structure and size (`plan::own_variants`).
    #[default]
    Auto,
    /// Always two-pass.
    TwoPass,
    /// Persistent wherever the shape's structure allows it (the device must still hold the
    /// tensor at run time, else the two-pass kernels run).
    Persistent,
}

impl OwnVariantChoice {
    /// `auto` / `two_pass` / `persistent`.
    pub const fn name(self) -> &'static str {
        match self {
            OwnVariantChoice::Auto => "auto",
            OwnVariantChoice::TwoPass => "two_pass",
            OwnVariantChoice::Persistent => "persistent",
        }
    }
}

impl FromStr for OwnVariantChoice {
    type Err = Error;
    /// Accepts `auto`, `two-pass` / `two_pass`, `persistent` (any case).
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(OwnVariantChoice::Auto),
            "two-pass" | "two_pass" | "twopass" => Ok(OwnVariantChoice::TwoPass),
            "persistent" => Ok(OwnVariantChoice::Persistent),
            _ => Err(Error::invalid(
                "own_variant",
                format!("{s:?} is not one of auto, two-pass, persistent"),
            )),
        }
    }
}
