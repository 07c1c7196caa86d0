//! The three ways the demo composes the block, as configurations: nnfuse as configured, and two
//! compositions from plain cuDNN calls to compare with. Pure: no GPU.

use nnfuse::batchnorm::Fuse;
use nnfuse::{BnImpl, BnModePolicy, Config, ConvAlgoPolicy};

use super::block::BlockDef;

/// One composition of the block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Variant {
    /// nnfuse's dispatchers under the user's configuration (environment variables): `auto`
    /// convolutions, fused BatchNorm+activation where cuDNN allows it (else cuDNN BN plus the
    /// bitmask kernels), the GEMM search; and each conv → BN unit's forward as ConvStats then
    /// BatchNorm from its sums (own kernels) where the first step measures that faster.
    Nnfuse,
    /// The baseline to beat: plain cuDNN calls, no fusion, cuDNN `SPATIAL` BatchNorm —
    /// OneFlow's rule without its NHWC flag (`NNFUSE_BN_MODE_POLICY=oneflow`).
    CudnnSpatial,
    /// The same plain composition with cuDNN's `SPATIAL_PERSISTENT` BatchNorm through the Ex API
    /// (`NNFUSE_BN_MODE_POLICY=fast`): what is left of nnfuse's gain once the mode is right.
    CudnnPersistent,
}

impl Variant {
    /// Every variant, nnfuse first.
    pub const ALL: [Variant; 3] = [
        Variant::Nnfuse,
        Variant::CudnnSpatial,
        Variant::CudnnPersistent,
    ];

    /// `nnfuse`, `cudnn_spatial`, `cudnn_persistent` (JSON keys).
    pub const fn name(self) -> &'static str {
        match self {
            Variant::Nnfuse => "nnfuse",
            Variant::CudnnSpatial => "cudnn_spatial",
            Variant::CudnnPersistent => "cudnn_persistent",
        }
    }

    /// Whether `conv1.dgrad` adds its gradient straight into dx, which `bn3.bwd` filled with
    /// the shortcut's gradient (`Conv2d::backward_data_into` with `accumulate`), so that
    /// `dx.add` has nothing left to do: nnfuse's composition. The plain cuDNN compositions
    /// keep the separate add pass (`conv1.dgrad` into a temporary, then `dx.add`).
    pub const fn adds_dx_in_place(self) -> bool {
        matches!(self, Variant::Nnfuse)
    }

    /// A column title.
    pub const fn title(self) -> &'static str {
        match self {
            Variant::Nnfuse => "nnfuse",
            Variant::CudnnSpatial => "cuDNN SPATIAL",
            Variant::CudnnPersistent => "cuDNN persistent",
        }
    }

    /// What it runs, in one sentence.
    pub const fn describe(self) -> &'static str {
        match self {
            Variant::Nnfuse => {
                "nnfuse's dispatchers as configured: conv auto (measured on the first call), \
                 BatchNorm as NNFUSE_BN_IMPL decides per layer (nnfuse's own kernels, or cuDNN \
                 fused with its activation where cuDNN allows it, else cuDNN BN + nnfuse's \
                 bitmask ReLU/Add+ReLU), GEMM algorithm search; each conv → BN unit's forward \
                 fused where the first step measures it faster: ConvStats (the convolution and \
                 its output's per-channel sums, one cuDNN graph or conv + reduction) then \
                 BatchNorm finalized from those sums on nnfuse's own kernels (whose backward \
                 then runs)"
            }
            Variant::CudnnSpatial => {
                "plain cuDNN, no fusion: conv cuDNN only (the fastest of \
                 cuDNN's heuristic top 5, as NNFUSE_CONV_ALGO=cudnn), BatchNorm \
                 CUDNN_BATCHNORM_SPATIAL (OneFlow's rule without its NHWC flag) alone, then a \
                 separate ReLU kernel, for the last BN a separate add kernel then ReLU; backward \
                 ReLU from y, then BN backward; GEMM cuBLAS default (no search)"
            }
            Variant::CudnnPersistent => {
                "as cuDNN SPATIAL, but BatchNorm CUDNN_BATCHNORM_SPATIAL_PERSISTENT through the Ex \
                 API (NNFUSE_BN_MODE_POLICY=fast): the plain composition with the right mode"
            }
        }
    }

    /// The configuration the variant's Context decides with, from the user's `base`.
    pub fn config(self, base: &Config) -> Config {
        let mut c = base.clone();
        if self == Variant::Nnfuse {
            return c;
        }
        c.conv_algo = ConvAlgoPolicy::Cudnn;
        c.bn_impl = BnImpl::Cudnn;
        c.disable_cudnn_fusion = true;
        c.gemm_search = false;
        c.enable_nhwc = false;
        c.bn_mode_policy = if self == Variant::CudnnSpatial {
            BnModePolicy::OneFlow
        } else {
            BnModePolicy::Fast
        };
        c
    }

    /// What BatchNorm `i` fuses: the block's activation for nnfuse; nothing for the plain
    /// compositions, which run the activation as separate kernels.
    pub fn fuse(self, i: usize) -> Fuse {
        match self {
            Variant::Nnfuse => BlockDef::bn_fuse(i),
            _ => Fuse::None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nnfuse::batchnorm::{plan, BnMode, BnPath, Phase, PlanRequest, ASSUMED_CUDNN_VERSION};
    use nnfuse::{DType, TensorFormat};

    fn bn_plan(v: Variant, format: TensorFormat, i: usize) -> nnfuse::batchnorm::BnPlan {
        let def = BlockDef::resnet50(32, DType::F16, format);
        let (shape, axis) = def.bn_shape(i);
        let config = v.config(&Config::default());
        plan(&PlanRequest {
            shape: &shape,
            axis,
            dtype: DType::F16,
            fuse: v.fuse(i),
            phase: Phase::Training,
            config: &config,
            cudnn_version: ASSUMED_CUDNN_VERSION,
            cudnn_available: true,
            own_variant: nnfuse::batchnorm::OwnVariantChoice::Auto,
        })
        .unwrap()
    }

    #[test]
    fn baselines_are_plain_cudnn_in_the_stated_modes() {
        for format in [TensorFormat::Nhwc, TensorFormat::Nchw] {
            for i in 0..3 {
                let s = bn_plan(Variant::CudnnSpatial, format, i);
                assert_eq!(
                    (s.mode, s.path),
                    (BnMode::Spatial, BnPath::Plain),
                    "{format} {i}"
                );
                let p = bn_plan(Variant::CudnnPersistent, format, i);
                assert_eq!(
                    (p.mode, p.path),
                    (BnMode::SpatialPersistent, BnPath::Plain),
                    "{format} {i}"
                );
            }
        }
        // nnfuse on channels-last f16: persistent and fused (the main case).
        let n = bn_plan(Variant::Nnfuse, TensorFormat::Nhwc, 2);
        assert_eq!(
            (n.mode, n.path),
            (BnMode::SpatialPersistent, BnPath::CudnnFused)
        );
        let c = Variant::CudnnSpatial.config(&Config::default());
        assert_eq!(c.conv_algo, ConvAlgoPolicy::Cudnn);
        assert!(!c.gemm_search && c.disable_cudnn_fusion);
        let user = Config {
            conv_workspace_mb: 64,
            ..Config::default()
        };
        assert_eq!(Variant::CudnnPersistent.config(&user).conv_workspace_mb, 64);
        assert_eq!(Variant::Nnfuse.config(&user), user);
    }
}
