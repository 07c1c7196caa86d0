//! The plain data of a BatchNorm graph: the tensors' roles (with fixed unique ids, so that a
//! variant pack's id array is a constant per direction), their dimensions and strides, and the
//! key of the BatchNorm plan cache (shape, layout, element type, direction, running-statistics
//! update, pointer alignment, engine policy). Pure; tested on the CPU.
//!
//! cuDNN's `NORM_FORWARD` / `NORM_BACKWARD` take the activations as logical `[n, c, h, w]`
//! (the format lives in the strides, as for convolutions) and every per-channel tensor (scale,
//! bias, statistics, their gradients) as `[1, c, 1, 1]` f32; epsilon and the exponential-average
//! factor (momentum) are f32 scalars passed by value.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::{ChannelLayout, TensorFormat};

use super::layout::{packed_strides, MAX_ALIGNMENT};
use super::notes::GraphPolicy;

/// Which BatchNorm graph: the training forward (batch statistics, saved mean and inverse
/// standard deviation, running statistics) or the backward (dx, dscale, dbias).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BnDirection {
    /// `NORM_FORWARD`, phase `TRAINING`.
    Forward,
    /// `NORM_BACKWARD`.
    Backward,
}

impl BnDirection {
    /// `forward` / `backward`.
    pub const fn name(self) -> &'static str {
        match self {
            BnDirection::Forward => "forward",
            BnDirection::Backward => "backward",
        }
    }
}

/// One tensor of a BatchNorm graph, by its role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BnRole {
    /// The input activations.
    X,
    /// gamma.
    Scale,
    /// beta.
    Bias,
    /// Epsilon (by value).
    Epsilon,
    /// The exponential-average factor, PyTorch's momentum (by value).
    Momentum,
    /// Running mean read by the update.
    RunningMeanIn,
    /// Running variance read by the update.
    RunningVarIn,
    /// Running mean written by the update (nnfuse passes the same buffer: in place).
    RunningMeanOut,
    /// Running variance written by the update (the same buffer as `RunningVarIn`).
    RunningVarOut,
    /// The batch mean the forward saves for the backward.
    SavedMean,
    /// `1 / sqrt(var + eps)` the forward saves for the backward.
    SavedInvVar,
    /// The output activations.
    Y,
    /// The gradient of the output.
    Dy,
    /// The gradient of gamma.
    Dscale,
    /// The gradient of beta.
    Dbias,
    /// The gradient of x.
    Dx,
}

impl BnRole {
    /// The tensor's unique id in its graph (fixed per role).
    pub const fn uid(self) -> i64 {
        match self {
            BnRole::X => 101,
            BnRole::Scale => 102,
            BnRole::Bias => 103,
            BnRole::Epsilon => 104,
            BnRole::Momentum => 105,
            BnRole::RunningMeanIn => 106,
            BnRole::RunningVarIn => 107,
            BnRole::RunningMeanOut => 108,
            BnRole::RunningVarOut => 109,
            BnRole::SavedMean => 110,
            BnRole::SavedInvVar => 111,
            BnRole::Y => 112,
            BnRole::Dy => 113,
            BnRole::Dscale => 114,
            BnRole::Dbias => 115,
            BnRole::Dx => 116,
        }
    }

    /// The name of the caller's argument (errors, logs).
    pub const fn name(self) -> &'static str {
        match self {
            BnRole::X => "x",
            BnRole::Scale => "gamma",
            BnRole::Bias => "beta",
            BnRole::Epsilon => "eps",
            BnRole::Momentum => "momentum",
            BnRole::RunningMeanIn => "running_mean (in)",
            BnRole::RunningVarIn => "running_var (in)",
            BnRole::RunningMeanOut => "running_mean",
            BnRole::RunningVarOut => "running_var",
            BnRole::SavedMean => "saved_mean",
            BnRole::SavedInvVar => "saved_inv_std",
            BnRole::Y => "y",
            BnRole::Dy => "dy",
            BnRole::Dscale => "dgamma",
            BnRole::Dbias => "dbeta",
            BnRole::Dx => "dx",
        }
    }

    /// Whether the tensor has the activations' shape (otherwise one value per channel, or a
    /// scalar).
    pub const fn is_activation(self) -> bool {
        matches!(self, BnRole::X | BnRole::Y | BnRole::Dy | BnRole::Dx)
    }

    /// Whether the tensor is a scalar passed by value (a host address in the variant pack).
    pub const fn by_value(self) -> bool {
        matches!(self, BnRole::Epsilon | BnRole::Momentum)
    }
}

/// The forward's tensors with the running-statistics update, in variant-pack order.
pub const FORWARD_ROLES: [BnRole; 12] = [
    BnRole::X,
    BnRole::Scale,
    BnRole::Bias,
    BnRole::Epsilon,
    BnRole::Momentum,
    BnRole::RunningMeanIn,
    BnRole::RunningVarIn,
    BnRole::RunningMeanOut,
    BnRole::RunningVarOut,
    BnRole::SavedMean,
    BnRole::SavedInvVar,
    BnRole::Y,
];

/// The forward's tensors without the running-statistics update.
pub const FORWARD_ROLES_NO_RUNNING: [BnRole; 7] = [
    BnRole::X,
    BnRole::Scale,
    BnRole::Bias,
    BnRole::Epsilon,
    BnRole::SavedMean,
    BnRole::SavedInvVar,
    BnRole::Y,
];

/// The backward's tensors, in variant-pack order.
pub const BACKWARD_ROLES: [BnRole; 8] = [
    BnRole::X,
    BnRole::Dy,
    BnRole::Scale,
    BnRole::SavedMean,
    BnRole::SavedInvVar,
    BnRole::Dscale,
    BnRole::Dbias,
    BnRole::Dx,
];

/// Everything one BatchNorm tensor descriptor is built from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BnTensorSpec {
    /// The role.
    pub role: BnRole,
    /// `CUDNN_ATTR_TENSOR_UNIQUE_ID`.
    pub uid: i64,
    /// Logical `[n, c, h, w]`; `[1, c, 1, 1]` per channel; `[1, 1, 1, 1]` scalars.
    pub dims: [i64; 4],
    /// Element strides.
    pub strides: [i64; 4],
    /// Element type (activations: the key's; everything else f32).
    pub dtype: DType,
    /// Guaranteed byte alignment of the data pointer.
    pub alignment: i64,
    /// A scalar passed by value.
    pub by_value: bool,
}

/// One cached BatchNorm execution plan's identity (per Context).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GraphBnKey {
    /// The 4-D view (OneFlow's inference rule) and its memory format.
    pub layout: ChannelLayout,
    /// Element type of x, y, dy, dx.
    pub dtype: DType,
    /// Training forward or backward.
    pub direction: BnDirection,
    /// The forward updates the running statistics (exponential-average factor given).
    pub running: bool,
    /// Byte alignment every data pointer is guaranteed to have (a power of two up to 16).
    pub alignment: u8,
    /// Which engines may run.
    pub policy: GraphPolicy,
}

impl GraphBnKey {
    /// The key of `layout` for `dtype` and `direction`, updating the running statistics, with
    /// 16-byte pointers and the strict policy.
    pub fn new(layout: ChannelLayout, dtype: DType, direction: BnDirection) -> GraphBnKey {
        GraphBnKey {
            layout,
            dtype,
            direction,
            running: true,
            alignment: MAX_ALIGNMENT,
            policy: GraphPolicy::default(),
        }
    }

    /// The same key for pointers of alignment class `alignment`.
    pub fn with_alignment(self, alignment: u8) -> GraphBnKey {
        GraphBnKey { alignment, ..self }
    }

    /// The same key under `policy`.
    pub fn with_policy(self, policy: GraphPolicy) -> GraphBnKey {
        GraphBnKey { policy, ..self }
    }

    /// The same key with or without the running-statistics update.
    pub fn with_running(self, running: bool) -> GraphBnKey {
        GraphBnKey { running, ..self }
    }

    /// The graph's tensors in variant-pack order.
    pub fn roles(&self) -> &'static [BnRole] {
        match (self.direction, self.running) {
            (BnDirection::Forward, true) => &FORWARD_ROLES,
            (BnDirection::Forward, false) => &FORWARD_ROLES_NO_RUNNING,
            (BnDirection::Backward, _) => &BACKWARD_ROLES,
        }
    }

    /// The unique ids in variant-pack order.
    pub fn uids(&self) -> Vec<i64> {
        self.roles().iter().map(|r| r.uid()).collect()
    }

    /// Checks the key before anything is built: positive extents whose element count fits
    /// cuDNN's int64, and an alignment that is a power of two from the element size to 16.
    pub fn validate(&self) -> Result<()> {
        let l = &self.layout;
        for (name, v) in [("n", l.n), ("c", l.c), ("h", l.h), ("w", l.w)] {
            if v <= 0 {
                return Err(Error::invalid(
                    "shape",
                    format!("{name} = {v}: every extent must be positive"),
                ));
            }
        }
        let a = self.alignment;
        if !a.is_power_of_two() || a > MAX_ALIGNMENT || usize::from(a) < self.dtype.size() {
            return Err(Error::invalid(
                "alignment",
                format!(
                    "{a} bytes: must be a power of two from the element size ({}) to {MAX_ALIGNMENT}",
                    self.dtype.size()
                ),
            ));
        }
        Ok(())
    }

    /// The descriptor spec of `role`.
    pub fn spec(&self, role: BnRole) -> BnTensorSpec {
        let l = &self.layout;
        let (n, c, h, w) = (
            i64::from(l.n),
            i64::from(l.c),
            i64::from(l.h),
            i64::from(l.w),
        );
        let (dims, strides, dtype) = if role.is_activation() {
            let dims = [n, c, h, w];
            (dims, packed_strides(l.format, dims), self.dtype)
        } else if role.by_value() {
            ([1; 4], [1; 4], DType::F32)
        } else {
            let dims = [1, c, 1, 1];
            (dims, packed_strides(TensorFormat::Nhwc, dims), DType::F32)
        };
        BnTensorSpec {
            role,
            uid: role.uid(),
            dims,
            strides,
            dtype,
            alignment: i64::from(self.alignment),
            by_value: role.by_value(),
        }
    }

    /// Every tensor's spec in variant-pack order.
    pub fn specs(&self) -> Vec<BnTensorSpec> {
        self.roles().iter().map(|&r| self.spec(r)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn layout(format: TensorFormat) -> ChannelLayout {
        ChannelLayout::example(format)
    }

    #[test]
    fn unique_ids_are_unique_and_fixed() {
        let all = [FORWARD_ROLES.as_slice(), &BACKWARD_ROLES].concat();
        let uids: HashSet<i64> = all.iter().map(|r| r.uid()).collect();
        let roles: HashSet<BnRole> = all.iter().copied().collect();
        assert_eq!(uids.len(), roles.len());
        // They never collide with the convolution's (1, 2, 3).
        assert!(uids.iter().all(|&u| u > 3));
        for r in FORWARD_ROLES_NO_RUNNING {
            assert!(FORWARD_ROLES.contains(&r));
        }
    }

    #[test]
    fn specs_follow_the_layout() {
        let k = GraphBnKey::new(layout(TensorFormat::Nhwc), DType::F16, BnDirection::Forward);
        let x = k.spec(BnRole::X);
        assert_eq!(x.dims, [8, 64, 196, 1]);
        assert_eq!(x.strides, [196 * 64, 1, 64, 64]);
        assert_eq!(x.dtype, DType::F16);
        let s = k.spec(BnRole::Scale);
        assert_eq!((s.dims, s.dtype), ([1, 64, 1, 1], DType::F32));
        assert_eq!(s.strides, [64, 1, 64, 64]);
        let e = k.spec(BnRole::Epsilon);
        assert!(e.by_value && e.dims == [1; 4] && e.dtype == DType::F32);
        let k = GraphBnKey::new(
            layout(TensorFormat::Nchw),
            DType::F32,
            BnDirection::Backward,
        );
        assert_eq!(k.spec(BnRole::Dx).strides, [64 * 196, 196, 1, 1]);
        assert_eq!(k.roles(), &BACKWARD_ROLES);
        assert_eq!(k.specs().len(), 8);
        assert_eq!(k.uids()[0], BnRole::X.uid());
    }

    #[test]
    fn every_field_separates_keys() {
        let base = GraphBnKey::new(layout(TensorFormat::Nhwc), DType::F16, BnDirection::Forward);
        let variants = [
            base,
            GraphBnKey {
                layout: layout(TensorFormat::Nchw),
                ..base
            },
            GraphBnKey {
                dtype: DType::BF16,
                ..base
            },
            GraphBnKey {
                direction: BnDirection::Backward,
                ..base
            },
            base.with_running(false),
            base.with_alignment(8),
            base.with_policy(GraphPolicy {
                deterministic: true,
                ..GraphPolicy::default()
            }),
        ];
        let set: HashSet<GraphBnKey> = variants.iter().copied().collect();
        assert_eq!(set.len(), variants.len());
        assert_eq!(base.with_running(false).roles(), &FORWARD_ROLES_NO_RUNNING);
    }

    #[test]
    fn validation_names_the_field() {
        let k = GraphBnKey::new(layout(TensorFormat::Nhwc), DType::F32, BnDirection::Forward);
        assert!(k.validate().is_ok());
        assert_eq!(
            k.with_alignment(2).validate().unwrap_err().argument(),
            Some("alignment")
        );
        assert_eq!(
            k.with_alignment(32).validate().unwrap_err().argument(),
            Some("alignment")
        );
        let mut bad = k;
        bad.layout.c = 0;
        assert_eq!(bad.validate().unwrap_err().argument(), Some("shape"));
    }
}
