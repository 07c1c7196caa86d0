//! The BatchNorm plan: from (shape, axis, dtype, fusion, phase, config, cuDNN version) to the
//! cuDNN mode, the 4-D layout, the cuDNN API entry and the path — with the reason for every
//! choice. Pure: no GPU calls; runs and is tested on the CPU.
//!
//! The rules (measurements: `docs/CUDNN-FACTS.md`, H100, cuDNN 9.14 and 9.19):
//! - **Layout**: OneFlow's inference ([`infer_channel_layout`]).
//! - **Mode** ([`infer_mode`]), by [`BnModePolicy`]:
//!   - `oneflow`: OneFlow's rule ([`oneflow_mode`]): rank 2 → `PER_ACTIVATION`; NHWC flag →
//!     `SPATIAL_PERSISTENT`; otherwise `SPATIAL`. One guard: a rank-2 input whose channel axis
//!     is 0 and whose other dim is not 1 (`h > 1`) does not take `PER_ACTIVATION`, which would
//!     normalise every position on its own (not BatchNorm); it takes the rest of the rule.
//!   - `auto` (default): OneFlow's rule except its measured traps: rank-2 input and
//!     channels-last (NHWC-inferred) training input → `SPATIAL_PERSISTENT`.
//!   - `fast`: `SPATIAL_PERSISTENT` always (cuDNN accepts it for every layout).
//!
//!   Every departure from OneFlow's rule is one reason starting with "departs from OneFlow".
//! - **API** ([`infer_api`]): training in `SPATIAL_PERSISTENT` → the Ex API (the legacy API
//!   gets cuDNN's slow kernels for that mode); everything else, and every cuDNN older than
//!   7.4.1, → the legacy API; inference → `cudnnBatchNormalizationForwardInference`.
//! - **Implementation** ([`choose_impl`]): nnfuse's own kernels ([`BnPath::Own`]) or cuDNN.
//!   Without cuDNN, or with `NNFUSE_BN_IMPL=own`, always own; `NNFUSE_BN_IMPL=cudnn`, or the
//!   `oneflow` mode policy (OneFlow's choice, bit for bit), always cuDNN; `auto` decides per kind
//!   of input by a table of measured preferences ([`AutoCase`], one constant per row).
//! - **Path** ([`fused_refusals`], [`infer_path`]): own; or, with cuDNN: no activation → plain;
//!   otherwise cuDNN's fused BN+ReLU / BN+Add+ReLU when no refusal applies, else the fallback
//!   (cuDNN BN, then nnfuse's bitmask kernels). Every refusal that applies is listed, in a fixed
//!   order.
//! - **Own variant** ([`own_variants`]): training forward and backward each run persistent (one
//!   cooperative kernel keeps the tensor on chip: x is read from memory once) when the shape
//!   allows it and the bytes fit [`OWN_PERSISTENT_MAX_BYTES`], else two-pass (statistics or
//!   sums, then the elementwise pass); inference is one elementwise pass.

use std::fmt;

use serde_json::{json, Value};

use crate::batchnorm::graph_rule::{graph_epilogue, infer_cudnn_api};
use crate::batchnorm::own_launch::{persistent_structure, OwnShape, VECTOR_BYTES};
use crate::batchnorm::types::{
    BnApi, BnMode, BnPath, Fuse, FusedRefusal, OwnVariant, OwnVariantChoice, Phase,
    CUDNN_EX_API_MIN_VERSION,
};
use crate::config::{BnImpl, BnModePolicy, Config, CudnnApi};
use crate::dtype::DType;
use crate::error::Result;
use crate::layout::{infer_channel_layout, ChannelLayout, TensorFormat};

/// The cuDNN version assumed where none is given or found (`nnfuse plan` on a machine without
/// cuDNN): 9.19.0, the newest one measured (`docs/CUDNN-FACTS.md`).
pub const ASSUMED_CUDNN_VERSION: usize = 91900;

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
    /// cuDNN version number (e.g. 91900); ignored when `cudnn_available` is false.
    pub cudnn_version: usize,
    /// Whether cuDNN can be loaded ([`crate::context::cudnn_present`]); without it every plan
    /// takes nnfuse's own kernels.
    pub cudnn_available: bool,
    /// The own training variant asked for (normally [`OwnVariantChoice::Auto`]).
    pub own_variant: OwnVariantChoice,
}

/// The decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BnPlan {
    /// 4-D view and memory format (OneFlow's inference rule).
    pub layout: ChannelLayout,
    /// cuDNN mode.
    pub mode: BnMode,
    /// cuDNN entry point for the BatchNorm through the legacy API (also what runs when the graph
    /// route cannot be built at the first call).
    pub api: BnApi,
    /// The BatchNorm itself runs through cuDNN's graph API (`NORM_FORWARD` / `NORM_BACKWARD`
    /// execution plans; training and inference on cuDNN, the activation inside the graph where
    /// an `epilogue:` reason says so) instead of [`BnPlan::api`]'s legacy entry point.
    pub cudnn_graph: bool,
    /// The cuDNN API setting the plan was made under ([`Config::cudnn_api`]).
    pub cudnn_api: CudnnApi,
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
    /// The mode policy the plan was made under (from [`Config::bn_mode_policy`]).
    pub policy: BnModePolicy,
    /// The NHWC flag the plan was made under (from [`Config::enable_nhwc`]).
    pub enable_nhwc: bool,
    /// The cuDNN version the plan was made for.
    pub cudnn_version: usize,
    /// The implementation setting the plan was made under (from [`Config::bn_impl`]).
    pub bn_impl: BnImpl,
    /// Whether cuDNN was available to the plan.
    pub cudnn_available: bool,
    /// Own path: how the forward (training or inference) runs; `None` on cuDNN paths.
    pub own_forward: Option<OwnVariant>,
    /// Own path, training: how the backward runs; `None` otherwise.
    pub own_backward: Option<OwnVariant>,
}

/// The wording that marks a reason as a departure from OneFlow's mode rule.
pub const DEPARTS_FROM_ONEFLOW: &str = "departs from OneFlow";

/// OneFlow's mode rule, literally: rank-2 input → `PER_ACTIVATION`; otherwise the NHWC flag
/// → `SPATIAL_PERSISTENT`; otherwise `SPATIAL`. Every departure of a plan from this is
/// explained in its reasons.
pub fn oneflow_mode(rank: usize, enable_nhwc: bool) -> BnMode {
    if rank == 2 {
        BnMode::PerActivation
    } else {
        nhwc_flag_mode(enable_nhwc)
    }
}

/// The part of OneFlow's rule for inputs of rank other than 2.
fn nhwc_flag_mode(enable_nhwc: bool) -> BnMode {
    if enable_nhwc {
        BnMode::SpatialPersistent
    } else {
        BnMode::Spatial
    }
}

/// Whether `PER_ACTIVATION` computes BatchNorm's per-channel statistics for `layout`: only when
/// each channel has one position per sample (`h * w == 1`). Otherwise it keeps statistics (and
/// wants parameters) per (c, h, w) — which for OneFlow's rank-2 rule happens with the channel on
/// axis 0 of a `(C, M)` input, `M > 1`.
fn per_activation_is_per_channel(layout: &ChannelLayout) -> bool {
    layout.h == 1 && layout.w == 1
}

/// Whether cuDNN's fused BN+activation takes `dtype` activations. docs/CUDNN-FACTS.md: f32 and f16 work,
/// and bf16 support equals f16's in every combination — so none of today's types is refused.
/// Kept as a function of the type so that a future type gets a decision of its own.
pub fn fused_dtype_supported(dtype: DType) -> bool {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => true,
    }
}

/// The cuDNN mode under `config.bn_mode_policy`, with its reasons: the mode line, then one
/// "departs from OneFlow" line when the mode is not [`oneflow_mode`]'s.
pub fn infer_mode(layout: &ChannelLayout, phase: Phase, config: &Config) -> (BnMode, Vec<String>) {
    use BnMode::*;
    let rank2 = layout.rank == 2;
    let nhwc_training = layout.format == TensorFormat::Nhwc && phase == Phase::Training;
    let flag = if config.enable_nhwc {
        "the NHWC flag is set (NNFUSE_ENABLE_NHWC / ONEFLOW_ENABLE_NHWC)"
    } else {
        "the NHWC flag is not set"
    };
    let (mode, why): (BnMode, String) = match config.bn_mode_policy {
        BnModePolicy::OneFlow => {
            if rank2 && per_activation_is_per_channel(layout) {
                (PerActivation, "OneFlow's rule: rank-2 input".into())
            } else if rank2 {
                (
                    nhwc_flag_mode(config.enable_nhwc),
                    format!(
                        "OneFlow's rule for rank > 2 ({flag}), because its rank-2 rule does \
                         not give BatchNorm here (see below)"
                    ),
                )
            } else {
                (
                    nhwc_flag_mode(config.enable_nhwc),
                    format!("OneFlow's rule: {flag}"),
                )
            }
        }
        BnModePolicy::Auto => {
            if rank2 {
                (SpatialPersistent, "rank-2 input".into())
            } else if nhwc_training {
                (
                    SpatialPersistent,
                    "channels-last (NHWC-inferred) training input".into(),
                )
            } else if config.enable_nhwc {
                (SpatialPersistent, format!("OneFlow's rule: {flag}"))
            } else if layout.format == TensorFormat::Nhwc {
                (
                    Spatial,
                    "OneFlow's rule: the NHWC flag is not set; for channels-last inference \
                     cuDNN runs the same kernel in both modes"
                        .into(),
                )
            } else {
                (
                    Spatial,
                    "OneFlow's rule: the NHWC flag is not set. CUDNN_BATCHNORM_SPATIAL_PERSISTENT \
                     would be 2–7x faster on channels-first input (docs/CUDNN-FACTS.md) but carries \
                     cuDNN's accuracy caveat (f32 statistics ~1e-6 relative instead of 6e-8): \
                     opt in with NNFUSE_ENABLE_NHWC=1 or NNFUSE_BN_MODE_POLICY=fast"
                        .into(),
                )
            }
        }
        BnModePolicy::Fast => (
            SpatialPersistent,
            "CUDNN_BATCHNORM_SPATIAL_PERSISTENT wherever cuDNN accepts it (every layout, \
             2-D included)"
                .into(),
        ),
    };
    let mut reasons = vec![format!(
        "mode: {} (policy {}: {why})",
        mode.cudnn_name(),
        config.bn_mode_policy
    )];
    let oneflow = oneflow_mode(layout.rank, config.enable_nhwc);
    if mode != oneflow {
        reasons.push(departure(layout, phase, oneflow, mode));
    }
    (mode, reasons)
}

/// The "departs from OneFlow" sentence: what OneFlow's rule picks, what the plan picks, and the
/// measured fact that justifies the difference.
fn departure(layout: &ChannelLayout, phase: Phase, oneflow: BnMode, mode: BnMode) -> String {
    let why = if oneflow == BnMode::PerActivation && !per_activation_is_per_channel(layout) {
        format!(
            "with the channel on axis 0 of a rank-2 input the descriptor is NCHW \
             {}x{}x{}x1, and PER_ACTIVATION would keep statistics and parameters per (c, h) — \
             normalising each of the {} positions of a channel on its own, which is not \
             BatchNorm",
            layout.n, layout.c, layout.h, layout.h
        )
    } else if oneflow == BnMode::PerActivation {
        "for (N, C) input PER_ACTIVATION took 7.0 ms forward at 65536x256 f32 against 95 µs for \
         SPATIAL_PERSISTENT through the Ex API on the H100 (docs/CUDNN-FACTS.md), and PyTorch's own 2-D \
         kernels match the persistent path; with one position per channel both modes compute \
         the same statistics"
            .to_string()
    } else if mode == BnMode::SpatialPersistent && phase == Phase::Inference {
        "cuDNN accepts SPATIAL_PERSISTENT for inference and runs the same kernel as SPATIAL \
         (docs/CUDNN-FACTS.md)"
            .to_string()
    } else if mode == BnMode::SpatialPersistent && layout.format == TensorFormat::Nhwc {
        "SPATIAL on NHWC takes 1.6–7.9 ms forward where the persistent Ex path takes 0.1–0.2 ms \
         on the H100 (docs/CUDNN-FACTS.md); PyTorch does the same for channels-last training"
            .to_string()
    } else if mode == BnMode::SpatialPersistent {
        "SPATIAL_PERSISTENT is 2–7x faster than SPATIAL for channels-first training on the H100 \
         (docs/CUDNN-FACTS.md), at the price of cuDNN's accuracy caveat (f32 statistics ~1e-6 relative \
         instead of 6e-8)"
            .to_string()
    } else {
        "by the policy's rule".to_string()
    };
    format!(
        "{DEPARTS_FROM_ONEFLOW}: its rule picks {} here, this plan {}: {why}",
        oneflow.cudnn_name(),
        mode.cudnn_name()
    )
}

/// The cuDNN entry point for the BatchNorm, with its reason.
///
/// Training in `SPATIAL_PERSISTENT` (which the fused path always is) → Ex: through the legacy
/// API cuDNN picks slower kernels for that mode (NHWC 0.48–6.3 ms against 0.1–0.2 ms; 2-D
/// 65536x256 f32 499 µs against 95 µs; docs/CUDNN-FACTS.md). Any other training mode, inference, and
/// cuDNN older than 7.4.1 → legacy.
pub fn infer_api(mode: BnMode, phase: Phase, cudnn_version: usize) -> (BnApi, String) {
    match phase {
        Phase::Inference => (
            BnApi::Legacy,
            "api: legacy cudnnBatchNormalizationForwardInference (inference has no Ex entry \
             point)"
                .into(),
        ),
        Phase::Training if mode != BnMode::SpatialPersistent => (
            BnApi::Legacy,
            format!(
                "api: legacy cudnnBatchNormalizationForwardTraining / Backward (the Ex API's \
                 fast kernels belong to SPATIAL_PERSISTENT, not {})",
                mode.cudnn_name()
            ),
        ),
        Phase::Training if cudnn_version < CUDNN_EX_API_MIN_VERSION => (
            BnApi::Legacy,
            format!(
                "api: legacy cudnnBatchNormalizationForwardTraining / Backward: cuDNN \
                 {cudnn_version} predates the Ex API (7.4.1), so SPATIAL_PERSISTENT gets the \
                 legacy API's slower kernels"
            ),
        ),
        Phase::Training => (
            BnApi::Ex,
            "api: Ex cudnnBatchNormalizationForwardTrainingEx / BackwardEx with cuDNN's \
             workspace: through the legacy API SPATIAL_PERSISTENT gets slower kernels (NHWC \
             0.48–6.3 ms against 0.1–0.2 ms, 2-D 65536x256 f32 499 µs against 95 µs; docs/CUDNN-FACTS.md)"
                .into(),
        ),
    }
}

/// Every reason that keeps the request off cuDNN's fused BN+activation, in a fixed order:
/// no activation (alone), inference, fusion disabled by config, not NHWC, not persistent,
/// C % 4 (BN+Add+ReLU only), data type, cuDNN older than 7.4.1. Empty: the fused path applies.
pub fn fused_refusals(
    layout: &ChannelLayout,
    mode: BnMode,
    fuse: Fuse,
    phase: Phase,
    dtype: DType,
    config: &Config,
    cudnn_version: usize,
) -> Vec<FusedRefusal> {
    if fuse == Fuse::None {
        return vec![FusedRefusal::NoActivation];
    }
    let mut refusals = Vec::new();
    if phase == Phase::Inference {
        refusals.push(FusedRefusal::Inference);
    }
    if config.disable_cudnn_fusion {
        refusals.push(FusedRefusal::DisabledByConfig);
    }
    if layout.format != TensorFormat::Nhwc {
        refusals.push(FusedRefusal::NotNhwc);
    }
    if mode != BnMode::SpatialPersistent {
        refusals.push(FusedRefusal::NotPersistent(mode));
    }
    if fuse == Fuse::AddRelu && layout.c % 4 != 0 {
        refusals.push(FusedRefusal::ChannelsNotMultipleOf4(layout.c));
    }
    if !fused_dtype_supported(dtype) {
        refusals.push(FusedRefusal::DTypeUnsupported(dtype));
    }
    if cudnn_version < CUDNN_EX_API_MIN_VERSION {
        refusals.push(FusedRefusal::CudnnTooOld(cudnn_version));
    }
    refusals
}

/// The kinds of input on which `NNFUSE_BN_IMPL=auto` chooses between cuDNN and nnfuse's own
/// kernels. Each has one constant holding the expected winner on the H100
/// ([`AutoCase::prefers_own`]): flip the constant when a measurement says otherwise
/// (`benches/batchnorm.rs`, `docs/PERFORMANCE.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AutoCase {
    /// Inference (running statistics), any layout.
    Inference,
    /// Training on `(N, C)`-like input: one position per channel and sample.
    TwoD,
    /// Training on channels-first (NCHW-inferred) input whose runs (H·W elements) hold at least
    /// one 16-byte vector: the own apply kernels' vector path.
    ChannelsFirst,
    /// Training on channels-first input with runs shorter than a 16-byte vector (H·W < 8 in
    /// 16-bit types, < 4 in f32): the own apply kernels' element path.
    ChannelsFirstShortRuns,
    /// Training on channels-last input whose backward fits the persistent kernels.
    ChannelsLastOnChip,
    /// Training on channels-last input where cuDNN's fused BN+activation applies.
    ChannelsLastFused,
    /// Training on channels-last input with an activation that cuDNN refuses to fuse.
    ChannelsLastUnfused,
    /// Plain BatchNorm (no activation) training on channels-last input.
    ChannelsLastPlain,
}

/// `auto` takes the own kernels for inference.
pub const OWN_FOR_INFERENCE: bool = true;
/// `auto` takes the own kernels for `(N, C)` training.
pub const OWN_FOR_TWO_D: bool = false;
/// `auto` takes the own kernels for channels-first training (runs of a 16-byte vector or more).
pub const OWN_FOR_CHANNELS_FIRST: bool = true;
/// `auto` takes the own kernels for channels-first training with runs shorter than a vector.
pub const OWN_FOR_CHANNELS_FIRST_SHORT_RUNS: bool = false;
/// `auto` takes the own kernels for channels-last training that fits on chip.
pub const OWN_FOR_CHANNELS_LAST_ON_CHIP: bool = false;
/// `auto` takes the own kernels for channels-last training that cuDNN fuses.
pub const OWN_FOR_CHANNELS_LAST_FUSED: bool = false;
/// `auto` takes the own kernels for channels-last training that cuDNN cannot fuse.
pub const OWN_FOR_CHANNELS_LAST_UNFUSED: bool = true;
/// `auto` takes the own kernels for channels-last plain BatchNorm training.
pub const OWN_FOR_CHANNELS_LAST_PLAIN: bool = false;
/// Under [`OwnVariantChoice::Auto`], the persistent variant is taken on channels-last input
/// wherever it applies; `false` keeps the two-pass kernels there. On: on the H100, with each
/// block staging the coefficients once and the sums' tree in warp shuffles, the persistent
/// backward at f16 32x56x56x64 BN+ReLU runs 24.0 µs against the two-pass kernels' 32.0 (ncu);
/// before those two changes it ran 42.5 (`docs/PERFORMANCE.md`).
pub const PREFER_PERSISTENT: bool = true;
/// The same for channels-first input. Off: the persistent kernels ran 0.73x–1.11x the two-pass
/// kernels' speed there (slower on channels-first f16; `docs/PERFORMANCE.md`).
pub const PREFER_PERSISTENT_CHANNELS_FIRST: bool = false;

/// Whether `layout` takes the channels-first preference ([`PREFER_PERSISTENT_CHANNELS_FIRST`]):
/// channels-first runs of more than one element; (N, C) input takes the channels-last one.
fn channels_first_runs(layout: &ChannelLayout) -> bool {
    layout.format == TensorFormat::Nchw && layout.h * layout.w > 1
}

/// Whether [`OwnVariantChoice::Auto`] prefers the persistent variant for `layout`.
fn prefers_persistent(layout: &ChannelLayout) -> bool {
    if channels_first_runs(layout) {
        PREFER_PERSISTENT_CHANNELS_FIRST
    } else {
        PREFER_PERSISTENT
    }
}
/// Most values per channel (`M = N·H·W`) for which the own backward runs per channel in f64
/// ([`OwnVariant::PerChannel`]) whatever variant was asked for. With few values per channel, dx
/// is a small remainder of its terms (at M = 2 always a fraction eps/var of them), so f32
/// rounding in the terms shows up amplified by var/eps; from a few dozen values on, random data
/// leaves dx of the size of its terms and the f32 kernels stay within 1e-6 (the CPU emulation in
/// `src/batchnorm/own_launch.rs` measures both). Tensors this small per channel are cheap either
/// way.
pub const OWN_PER_CHANNEL_MAX_M: u64 = 64;
/// Bytes the persistent variant may keep on chip (x forward; x and dy' backward): the H100's
/// 132 SMs with about 209 KiB of their 227 KiB of shared memory each for the tiles (the rest
/// covers the tiling's rounding and the kernels' static shared memory). The launcher still checks
/// the device it runs on and takes the two-pass kernels when the tensor does not fit there.
pub const OWN_PERSISTENT_MAX_BYTES: u64 = 27 << 20;

impl AutoCase {
    /// The training cases in the table's order, then inference.
    pub const ALL: [AutoCase; 8] = [
        AutoCase::Inference,
        AutoCase::TwoD,
        AutoCase::ChannelsFirst,
        AutoCase::ChannelsFirstShortRuns,
        AutoCase::ChannelsLastOnChip,
        AutoCase::ChannelsLastFused,
        AutoCase::ChannelsLastUnfused,
        AutoCase::ChannelsLastPlain,
    ];

    /// Whether `auto` takes nnfuse's own kernels for this case (the constant of its row).
    pub const fn prefers_own(self) -> bool {
        match self {
            AutoCase::Inference => OWN_FOR_INFERENCE,
            AutoCase::TwoD => OWN_FOR_TWO_D,
            AutoCase::ChannelsFirst => OWN_FOR_CHANNELS_FIRST,
            AutoCase::ChannelsFirstShortRuns => OWN_FOR_CHANNELS_FIRST_SHORT_RUNS,
            AutoCase::ChannelsLastOnChip => OWN_FOR_CHANNELS_LAST_ON_CHIP,
            AutoCase::ChannelsLastFused => OWN_FOR_CHANNELS_LAST_FUSED,
            AutoCase::ChannelsLastUnfused => OWN_FOR_CHANNELS_LAST_UNFUSED,
            AutoCase::ChannelsLastPlain => OWN_FOR_CHANNELS_LAST_PLAIN,
        }
    }

    /// Snake-case name (JSON, tests).
    pub const fn name(self) -> &'static str {
        match self {
            AutoCase::Inference => "inference",
            AutoCase::TwoD => "two_d",
            AutoCase::ChannelsFirst => "channels_first",
            AutoCase::ChannelsFirstShortRuns => "channels_first_short_runs",
            AutoCase::ChannelsLastOnChip => "channels_last_on_chip",
            AutoCase::ChannelsLastFused => "channels_last_fused",
            AutoCase::ChannelsLastUnfused => "channels_last_unfused",
            AutoCase::ChannelsLastPlain => "channels_last_plain",
        }
    }

    /// The case and the measurement behind its row (H100 measurements in
    /// `docs/PERFORMANCE.md`, section "nnfuse's own BatchNorm kernels").
    pub const fn evidence(self) -> &'static str {
        match self {
            AutoCase::Inference => {
                "inference: the own kernel makes one pass (x, the addend, y) with scale and \
                 shift folded from the running statistics, where cuDNN runs its BatchNorm and \
                 then the activation as a second pass: own 1.7–2.3x faster at 64x256x56x56 \
                 (77–91% of copy; docs/PERFORMANCE.md)"
            }
            AutoCase::TwoD => {
                "(N, C) training: cuDNN's Ex SPATIAL_PERSISTENT path took 94 + 120 µs at \
                 65536x256 f32 against the own two-pass kernels' 100 + 143 µs, which read x \
                 (and dy) twice (docs/PERFORMANCE.md)"
            }
            AutoCase::ChannelsFirst => {
                "channels-first training: cuDNN's SPATIAL kernels run at 9–17% of the memory \
                 floor at large H·W and SPATIAL_PERSISTENT carries cuDNN's accuracy caveat; the \
                 own kernels stream each pass with 16-byte vectors and read the ReLU mask inside \
                 the backward reduction: 4.3–5.7x faster at H·W = 12544, 1.1–1.7x at 3136 to \
                 196 in f32 (docs/PERFORMANCE.md)"
            }
            AutoCase::ChannelsFirstShortRuns => {
                "channels-first training with runs shorter than a 16-byte vector: the own \
                 elementwise kernels take their element path there (15–26% of copy measured on \
                 that path), where cuDNN's SPATIAL kernels keep whole channels per block \
                 (docs/PERFORMANCE.md)"
            }
            AutoCase::ChannelsLastOnChip => {
                "channels-last training small enough to stay on chip: cuDNN's fused Ex path took \
                 31.6 + 34.4 µs at f16 16x112x112x32, the own persistent kernels 33.2 + 40.7 µs \
                 and the own two-pass kernels 39.1 + 47.4 µs (docs/PERFORMANCE.md)"
            }
            AutoCase::ChannelsLastFused => {
                "channels-last training that cuDNN fuses: its semi-persistent NHWC kernels read \
                 x once; the own two-pass kernels, which read x twice, ran at 0.63–0.84x of its \
                 speed (f16 64x112x112x64 BN+ReLU cuDNN 116 + 178 µs; docs/PERFORMANCE.md)"
            }
            AutoCase::ChannelsLastUnfused => {
                "channels-last training that cuDNN cannot fuse: cuDNN BatchNorm plus the \
                 bitmask pass moves one pass more than the own kernels, whose channels-last \
                 vector path takes any channel count (docs/PERFORMANCE.md)"
            }
            AutoCase::ChannelsLastPlain => {
                "channels-last plain BatchNorm training: cuDNN's Ex SPATIAL_PERSISTENT NHWC \
                 kernels read x once, the own two-pass kernels twice (docs/PERFORMANCE.md)"
            }
        }
    }
}

/// Bytes the persistent kernels would keep on chip: x (forward), x and dy' (backward).
fn on_chip_bytes(layout: &ChannelLayout, dtype: DType, tiles: u64) -> u64 {
    layout.numel() as u64 * dtype.size() as u64 * tiles
}

/// Whether the persistent variant applies to one direction under [`OwnVariantChoice::Auto`]:
/// the shape's structure allows it and the tiles fit [`OWN_PERSISTENT_MAX_BYTES`]. `Err` says why
/// not.
fn persistent_applies(
    layout: &ChannelLayout,
    dtype: DType,
    tiles: u64,
) -> std::result::Result<u64, String> {
    persistent_structure(&OwnShape::from_layout(layout), dtype.size() as u64)?;
    let bytes = on_chip_bytes(layout, dtype, tiles);
    if bytes > OWN_PERSISTENT_MAX_BYTES {
        return Err(format!(
            "{:.1} MB of {} exceed the on-chip budget of {:.1} MB (OWN_PERSISTENT_MAX_BYTES: 132 \
             SMs x ~209 KiB of shared memory on the H100)",
            bytes as f64 / 1e6,
            if tiles == 1 { "x" } else { "x and dy" },
            OWN_PERSISTENT_MAX_BYTES as f64 / 1e6
        ));
    }
    Ok(bytes)
}

/// The row of `auto`'s table that a request falls in.
pub fn auto_case(
    layout: &ChannelLayout,
    phase: Phase,
    fuse: Fuse,
    dtype: DType,
    refusals: &[FusedRefusal],
) -> AutoCase {
    if phase == Phase::Inference {
        AutoCase::Inference
    } else if layout.format == TensorFormat::Nchw {
        if (layout.h as u64) * (layout.w as u64) * (dtype.size() as u64) < VECTOR_BYTES {
            AutoCase::ChannelsFirstShortRuns
        } else {
            AutoCase::ChannelsFirst
        }
    } else if layout.h * layout.w == 1 {
        AutoCase::TwoD
    } else if persistent_applies(layout, dtype, 2).is_ok() {
        AutoCase::ChannelsLastOnChip
    } else if fuse == Fuse::None {
        AutoCase::ChannelsLastPlain
    } else if refusals.is_empty() {
        AutoCase::ChannelsLastFused
    } else {
        AutoCase::ChannelsLastUnfused
    }
}

/// cuDNN or nnfuse's own kernels (`true`), with the reason. Order: no cuDNN → own;
/// `NNFUSE_BN_IMPL=own` / `cudnn` → as forced; the `oneflow` policy → cuDNN (OneFlow's choice);
/// otherwise `auto`'s table ([`AutoCase`]).
pub fn choose_impl(
    layout: &ChannelLayout,
    phase: Phase,
    fuse: Fuse,
    dtype: DType,
    refusals: &[FusedRefusal],
    config: &Config,
    cudnn_available: bool,
) -> (bool, String) {
    if !cudnn_available {
        return (
            true,
            "impl: own — cuDNN cannot be loaded; nnfuse's own kernels run every shape".into(),
        );
    }
    match config.bn_impl {
        BnImpl::Own => (
            true,
            "impl: own — forced by NNFUSE_BN_IMPL=own / Config::bn_impl".into(),
        ),
        BnImpl::Cudnn => (
            false,
            "impl: cuDNN — forced by NNFUSE_BN_IMPL=cudnn / Config::bn_impl".into(),
        ),
        BnImpl::Auto if config.bn_mode_policy == BnModePolicy::OneFlow => (
            false,
            "impl: cuDNN — the oneflow policy keeps OneFlow's choice bit for bit \
             (NNFUSE_BN_IMPL=own opts in to nnfuse's own kernels)"
                .into(),
        ),
        BnImpl::Auto => {
            let case = auto_case(layout, phase, fuse, dtype, refusals);
            let own = case.prefers_own();
            (
                own,
                format!(
                    "impl: {} — auto, case {}: {}",
                    if own { "own" } else { "cuDNN" },
                    case.name(),
                    case.evidence()
                ),
            )
        }
    }
}

/// The own variant of one training direction (`tiles`: 1 forward, 2 backward) with its reason.
fn own_variant_for(
    layout: &ChannelLayout,
    dtype: DType,
    tiles: u64,
    choice: OwnVariantChoice,
) -> (OwnVariant, String) {
    let dir = if tiles == 1 { "forward" } else { "backward" };
    let m = layout.per_channel() as u64;
    if tiles == 2 && m <= OWN_PER_CHANNEL_MAX_M {
        return (
            OwnVariant::PerChannel,
            format!(
                "own backward: per-channel f64 — {m} values per channel (at most \
                 OWN_PER_CHANNEL_MAX_M = {OWN_PER_CHANNEL_MAX_M}): dx is a small remainder of \
                 its terms there (at M = 2 a fraction eps/var of them), so one block per channel \
                 sums and writes dx in f64 in one kernel (docs/BATCHNORM.md)"
            ),
        );
    }
    let structure = persistent_structure(&OwnShape::from_layout(layout), dtype.size() as u64);
    match choice {
        OwnVariantChoice::TwoPass => (
            OwnVariant::TwoPass,
            format!("own {dir}: two-pass, as asked (BnOptions::own_variant)"),
        ),
        OwnVariantChoice::Persistent => match structure {
            Ok(()) => (
                OwnVariant::Persistent,
                format!(
                    "own {dir}: persistent, as asked (BnOptions::own_variant); the two-pass \
                     kernels run instead if the device cannot hold {:.1} MB on chip",
                    on_chip_bytes(layout, dtype, tiles) as f64 / 1e6
                ),
            ),
            Err(why) => (
                OwnVariant::TwoPass,
                format!("own {dir}: two-pass, although persistent was asked for: {why}"),
            ),
        },
        OwnVariantChoice::Auto if !prefers_persistent(layout) => (
            OwnVariant::TwoPass,
            if channels_first_runs(layout) {
                format!(
                    "own {dir}: two-pass — PREFER_PERSISTENT_CHANNELS_FIRST is off: on \
                     channels-first input the persistent kernels ran 0.73x–1.11x the two-pass \
                     kernels' speed on the H100 (docs/PERFORMANCE.md)"
                )
            } else {
                format!("own {dir}: two-pass — PREFER_PERSISTENT is off")
            },
        ),
        OwnVariantChoice::Auto => match persistent_applies(layout, dtype, tiles) {
            Ok(bytes) => (
                OwnVariant::Persistent,
                format!(
                    "own {dir}: persistent — {:.1} MB of {} fit the on-chip budget \
                     (OWN_PERSISTENT_MAX_BYTES): one cooperative kernel reads them from memory \
                     once and keeps them in shared memory across two grid-wide barriers",
                    bytes as f64 / 1e6,
                    if tiles == 1 { "x" } else { "x and dy" }
                ),
            ),
            Err(why) => (
                OwnVariant::TwoPass,
                format!(
                    "own {dir}: two-pass ({} then the elementwise pass) — {why}",
                    if tiles == 1 {
                        "Welford statistics"
                    } else {
                        "the sums with the mask read inside"
                    }
                ),
            ),
        },
    }
}

/// How the own kernels run a plan's phase: training forward and backward variants, or the one
/// elementwise inference pass; with one reason per direction.
pub fn own_variants(
    layout: &ChannelLayout,
    dtype: DType,
    phase: Phase,
    choice: OwnVariantChoice,
) -> (OwnVariant, Option<OwnVariant>, Vec<String>) {
    match phase {
        Phase::Inference => (
            OwnVariant::Elementwise,
            None,
            vec![
                "own forward: elementwise — one pass, y = act((x - mean) * scale + shift [+ z]) \
                  with scale and shift folded once per call from the running statistics"
                    .into(),
            ],
        ),
        Phase::Training => {
            let (f, fr) = own_variant_for(layout, dtype, 1, choice);
            let (b, br) = own_variant_for(layout, dtype, 2, choice);
            (f, Some(b), vec![fr, br])
        }
    }
}

/// The cuDNN path: plain without activation; cuDNN fused when nothing refuses it; else fallback.
/// (The own path is [`choose_impl`]'s decision.)
pub fn infer_path(fuse: Fuse, refusals: &[FusedRefusal]) -> BnPath {
    if fuse == Fuse::None {
        BnPath::Plain
    } else if refusals.is_empty() {
        BnPath::CudnnFused
    } else {
        BnPath::Fallback
    }
}

/// The layout sentence: what the dims after the axis are, and the descriptor that follows.
fn layout_reason(shape: &[usize], axis: usize, layout: &ChannelLayout) -> String {
    let after = &shape[axis + 1..];
    let why = if after.is_empty() {
        format!("axis {axis} is the last dim")
    } else if layout.format == TensorFormat::Nhwc {
        format!("dims after axis {axis} are all 1")
    } else {
        format!("dims after axis {axis} are {after:?}, not all 1")
    };
    format!(
        "layout: shape {shape:?}, {why} → {} n={} c={} h={} w={}",
        layout.format.name().to_ascii_uppercase(),
        layout.n,
        layout.c,
        layout.h,
        layout.w
    )
}

/// The path sentence.
fn path_reason(path: BnPath, fuse: Fuse, refusals: usize) -> String {
    match path {
        BnPath::Own => format!(
            "path: own — nnfuse's own {} kernels (kernels/batchnorm*.cu): Welford statistics \
             combined in a fixed order, the affine transform, activation and bitmask in one \
             pass, the mask read inside the backward reduction",
            fuse.describe()
        ),
        BnPath::Plain => "path: plain — cuDNN BatchNorm alone (no activation asked for)".into(),
        BnPath::CudnnFused => format!(
            "path: cuDNN fused {} (cudnnBatchNormalizationForwardTrainingEx / BackwardEx with \
             {}); a NOT_SUPPORTED from it at run time still falls back",
            fuse.describe(),
            if fuse == Fuse::AddRelu {
                "CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION"
            } else {
                "CUDNN_BATCHNORM_OPS_BN_ACTIVATION"
            }
        ),
        BnPath::Fallback => format!(
            "path: fallback — cuDNN BatchNorm, then nnfuse's bitmask {} kernel; cuDNN's fused \
             {} is refused for {refusals} reason{}:",
            if fuse == Fuse::AddRelu {
                "Add+ReLU"
            } else {
                "ReLU"
            },
            fuse.describe(),
            if refusals == 1 { "" } else { "s" }
        ),
    }
}

/// Plans one BatchNorm. Errors only on invalid shape/axis (from layout inference).
pub fn plan(req: &PlanRequest<'_>) -> Result<BnPlan> {
    let layout = infer_channel_layout(req.shape, req.axis)?;
    let (mode, mode_reasons) = infer_mode(&layout, req.phase, req.config);
    let mut refusals = fused_refusals(
        &layout,
        mode,
        req.fuse,
        req.phase,
        req.dtype,
        req.config,
        req.cudnn_version,
    );
    if !req.cudnn_available && req.fuse != Fuse::None {
        refusals.retain(|r| !matches!(r, FusedRefusal::CudnnTooOld(_)));
        refusals.push(FusedRefusal::CudnnMissing);
    }
    let (own, impl_reason) = choose_impl(
        &layout,
        req.phase,
        req.fuse,
        req.dtype,
        &refusals,
        req.config,
        req.cudnn_available,
    );
    let (cudnn_graph, graph_reason) = infer_cudnn_api(
        &layout,
        mode,
        req.phase,
        req.dtype,
        req.config,
        req.cudnn_version,
        req.cudnn_available,
    );
    // The graph route fuses the activation in its own graph unless fusion is switched off
    // (training: the path is cuDNN's fused one, and the legacy Ex call's refusals do not apply
    // to it).
    let graph_epilogue_on = cudnn_graph && !own && !req.config.disable_cudnn_fusion;
    let epilogue_reason = graph_epilogue(graph_epilogue_on, req.phase, req.fuse, layout.numel());
    let graph_fused = epilogue_reason.is_some() && req.phase == Phase::Training;
    if graph_fused {
        refusals.clear();
    }
    let path = if own {
        BnPath::Own
    } else {
        infer_path(req.fuse, &refusals)
    };
    let (api, api_reason) = if req.cudnn_available {
        infer_api(mode, req.phase, req.cudnn_version)
    } else {
        (
            BnApi::None,
            "api: none — cuDNN cannot be loaded (mode says what cuDNN would run)".into(),
        )
    };
    let (own_forward, own_backward, own_reasons) = if own {
        let (f, b, r) = own_variants(&layout, req.dtype, req.phase, req.own_variant);
        (Some(f), b, r)
    } else {
        (None, None, Vec::new())
    };

    let mut reasons = Vec::with_capacity(8 + mode_reasons.len() + refusals.len());
    reasons.push(layout_reason(req.shape, req.axis, &layout));
    reasons.extend(mode_reasons);
    reasons.push(api_reason);
    reasons.push(graph_reason);
    reasons.extend(epilogue_reason);
    reasons.push(impl_reason);
    reasons.push(path_reason(path, req.fuse, refusals.len()));
    if own {
        reasons.extend(own_reasons);
    } else {
        reasons.extend(refusals.iter().map(|r| format!("not fused: {r}")));
    }
    Ok(BnPlan {
        layout,
        mode,
        api,
        cudnn_graph,
        cudnn_api: req.config.cudnn_api,
        path,
        fuse: req.fuse,
        phase: req.phase,
        dtype: req.dtype,
        refusals,
        reasons,
        policy: req.config.bn_mode_policy,
        enable_nhwc: req.config.enable_nhwc,
        cudnn_version: req.cudnn_version,
        bn_impl: req.config.bn_impl,
        cudnn_available: req.cudnn_available,
        own_forward,
        own_backward,
    })
}

impl BnPlan {
    /// The plan as one JSON object: `mode`, `format`, `n`, `c`, `h`, `w`, `rank`, `path`,
    /// `api`, `fuse`, `phase`, `dtype`, `refusals` (short codes, see
    /// [`FusedRefusal::code`]), `reasons`, `policy`, `enable_nhwc`, `cudnn_version`, `impl`
    /// (`own` | `cudnn`), `bn_impl` (the setting), `cudnn_available`, `own_forward` and
    /// `own_backward` ([`OwnVariant::name`] or null), `cudnn_api` (the setting) and
    /// `cudnn_api_used` (`graph` | `legacy`, null when cuDNN does not run).
    pub fn to_json(&self) -> Value {
        json!({
            "mode": self.mode.name(),
            "format": self.layout.format.name(),
            "n": self.layout.n,
            "c": self.layout.c,
            "h": self.layout.h,
            "w": self.layout.w,
            "rank": self.layout.rank,
            "path": self.path.name(),
            "api": self.api.name(),
            "fuse": self.fuse.name(),
            "phase": self.phase.name(),
            "dtype": self.dtype.name(),
            "refusals": self.refusals.iter().map(FusedRefusal::code).collect::<Vec<_>>(),
            "reasons": self.reasons,
            "policy": self.policy.name(),
            "enable_nhwc": self.enable_nhwc,
            "cudnn_version": self.cudnn_version,
            "impl": if self.path.is_own() { "own" } else { "cudnn" },
            "bn_impl": self.bn_impl.name(),
            "cudnn_available": self.cudnn_available,
            "own_forward": self.own_forward.map(OwnVariant::name),
            "own_backward": self.own_backward.map(OwnVariant::name),
            "cudnn_api": self.cudnn_api.name(),
            "cudnn_api_used": self.cudnn_api_used(),
        })
    }

    /// `graph` or `legacy`: the cuDNN API the BatchNorm runs through; `None` when cuDNN does not
    /// run it (own path, or cuDNN missing).
    pub fn cudnn_api_used(&self) -> Option<&'static str> {
        if self.path.is_own() || !self.cudnn_available {
            return None;
        }
        Some(if self.cudnn_graph { "graph" } else { "legacy" })
    }

    /// Whether the plan's mode departs from OneFlow's rule (then one of its reasons says so).
    pub fn departs_from_oneflow(&self) -> bool {
        self.mode != oneflow_mode(self.layout.rank, self.enable_nhwc)
    }
}

impl fmt::Display for BnPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "BatchNorm plan: {} {} {}, policy {}, impl {}, NHWC flag {}, cuDNN {}",
            self.phase,
            self.dtype,
            self.fuse.describe(),
            self.policy,
            self.bn_impl,
            if self.enable_nhwc { "on" } else { "off" },
            if self.cudnn_available {
                self.cudnn_version.to_string()
            } else {
                "missing".to_string()
            }
        )?;
        writeln!(f, "  layout : {}", self.layout)?;
        writeln!(f, "  mode   : {}", self.mode.cudnn_name())?;
        writeln!(f, "  api    : {}", self.api)?;
        writeln!(
            f,
            "  cuDNN  : {} API (NNFUSE_CUDNN_API {})",
            self.cudnn_api_used().unwrap_or("no"),
            self.cudnn_api
        )?;
        writeln!(f, "  path   : {}", self.path)?;
        if let Some(fwd) = self.own_forward {
            match self.own_backward {
                Some(bwd) => writeln!(f, "  own    : forward {fwd}, backward {bwd}")?,
                None => writeln!(f, "  own    : {fwd}")?,
            }
        }
        if !self.refusals.is_empty() {
            let codes: Vec<&str> = self.refusals.iter().map(FusedRefusal::code).collect();
            writeln!(f, "  refused: {}", codes.join(", "))?;
        }
        write!(f, "  reasons:")?;
        for r in &self.reasons {
            write!(f, "\n    - {r}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req<'a>(shape: &'a [usize], axis: usize, config: &'a Config) -> PlanRequest<'a> {
        PlanRequest {
            shape,
            axis,
            dtype: DType::F16,
            fuse: Fuse::AddRelu,
            phase: Phase::Training,
            config,
            cudnn_version: ASSUMED_CUDNN_VERSION,
            cudnn_available: true,
            own_variant: OwnVariantChoice::Auto,
        }
    }

    #[test]
    fn fuse_parses() {
        assert_eq!("none".parse::<Fuse>().unwrap(), Fuse::None);
        assert_eq!("ReLU".parse::<Fuse>().unwrap(), Fuse::Relu);
        assert_eq!("add-relu".parse::<Fuse>().unwrap(), Fuse::AddRelu);
        assert_eq!(" add_relu ".parse::<Fuse>().unwrap(), Fuse::AddRelu);
        for f in Fuse::ALL {
            assert_eq!(f.name().parse::<Fuse>().unwrap(), f);
        }
        let e = "addrelu".parse::<Fuse>().unwrap_err();
        assert_eq!(e.argument(), Some("fuse"));
        assert!(e.to_string().contains("addrelu"), "{e}");
    }

    #[test]
    fn mode_maps_to_cudnn() {
        use crate::batchnorm::descriptor::cudnn_mode;
        use cudarc::cudnn::sys::cudnnBatchNormMode_t as M;
        assert_eq!(
            cudnn_mode(BnMode::PerActivation),
            M::CUDNN_BATCHNORM_PER_ACTIVATION
        );
        assert_eq!(cudnn_mode(BnMode::Spatial), M::CUDNN_BATCHNORM_SPATIAL);
        assert_eq!(
            cudnn_mode(BnMode::SpatialPersistent),
            M::CUDNN_BATCHNORM_SPATIAL_PERSISTENT
        );
    }

    #[test]
    fn layout_line_reads_as_specified() {
        let c = Config::default();
        let p = plan(&req(&[64, 56, 56, 256], 3, &c)).unwrap();
        assert_eq!(
            p.reasons[0],
            "layout: shape [64, 56, 56, 256], axis 3 is the last dim → NHWC n=64 c=256 h=3136 w=1"
        );
        let p = plan(&req(&[64, 256, 1, 1], 1, &c)).unwrap();
        assert!(p.reasons[0].contains("dims after axis 1 are all 1 → NHWC n=64 c=256 h=1 w=1"));
        let p = plan(&req(&[16, 32, 112, 112], 1, &c)).unwrap();
        assert!(p.reasons[0].contains("dims after axis 1 are [112, 112], not all 1 → NCHW"));
    }

    #[test]
    fn display_is_a_readable_summary() {
        let c = Config::default().with_bn_impl(BnImpl::Own);
        let s = plan(&req(&[16, 32, 112, 112], 1, &c)).unwrap().to_string();
        assert!(s.starts_with("BatchNorm plan: training f16 BN+Add+ReLU, policy auto, impl own"));
        assert!(s.contains("mode   : CUDNN_BATCHNORM_SPATIAL\n"), "{s}");
        assert!(s.contains("path   : own"), "{s}");
        let v = if PREFER_PERSISTENT_CHANNELS_FIRST {
            "persistent"
        } else {
            "two_pass"
        };
        assert!(
            s.contains(&format!("own    : forward {v}, backward {v}")),
            "{s}"
        );
        assert!(s.contains("refused: not_nhwc, not_persistent"), "{s}");
        let c = Config::default().with_bn_impl(BnImpl::Cudnn);
        let s = plan(&req(&[16, 32, 112, 112], 1, &c)).unwrap().to_string();
        assert!(s.contains("path   : fallback"), "{s}");
        assert!(s.contains("    - not fused: cuDNN fuses BN+activation only for NHWC"));
    }
}
