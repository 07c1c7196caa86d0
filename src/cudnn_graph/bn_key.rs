//! The plain data of a BatchNorm graph: the tensors' roles (with fixed unique ids, so that a
//! variant pack's id array is a constant per graph shape), their dimensions and strides, and the
//! key of the BatchNorm plan cache (shape, layout, element type, direction, epilogue,
//! running-statistics update, pointer alignment, engine policy). Pure; tested on the CPU.
//!
//! cuDNN's `NORM_FORWARD` / `NORM_BACKWARD` take the activations as logical `[n, c, h, w]`
//! (the format lives in the strides, as for convolutions) and every per-channel tensor (scale,
//! bias, statistics, their gradients) as `[1, c, 1, 1]` f32; epsilon and the exponential-average
//! factor (momentum) are f32 scalars passed by value.
//!
//! Epilogues (cudnn-frontend's "SGBN Add Relu" / "DBN Add Relu" samples): the forward's
//! normalised output becomes a virtual f32 tensor fed to a pointwise `ADD` (the addend) and
//! `RELU_FWD` whose output is y. How the backward learns where the ReLU passed is the key's
//! [`ReluGrad`]: by default ([`ReluGrad::Mask`]) the forward also writes `CMP_GT(y, 0)` as a
//! real `BOOLEAN` tensor (the mask, by-value f32 zero as the comparand) and the backward computes
//! `dy · mask` (`MUL`) into `NORM_BACKWARD`'s dy; with [`ReluGrad::FromY`] the backward's
//! `RELU_BWD` reads dy and the forward's y instead (no mask; cuDNN 9.19 lists 0 engine configs
//! for that backward on the H100, measured). The masked dy is virtual for ReLU, the written
//! `d_addend` for Add+ReLU (the same gradient reaches the addend).

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::{ChannelLayout, TensorFormat};

use super::layout::{packed_strides, MAX_ALIGNMENT};
use super::notes::GraphPolicy;

/// Which BatchNorm graph: the training forward (batch statistics, saved mean and inverse
/// standard deviation, running statistics), the backward (dx, dscale, dbias), or the inference
/// forward (running mean and an inverse standard deviation computed from the running variance).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BnDirection {
    /// `NORM_FORWARD`, phase `TRAINING`.
    Forward,
    /// `NORM_BACKWARD`.
    Backward,
    /// `NORM_FORWARD`, phase `INFERENCE`: mean and inverse standard deviation are inputs.
    Inference,
}

impl BnDirection {
    /// `forward` / `backward` / `inference`.
    pub const fn name(self) -> &'static str {
        match self {
            BnDirection::Forward => "forward",
            BnDirection::Backward => "backward",
            BnDirection::Inference => "inference",
        }
    }
}

/// The pointwise operations fused after (forward) or before (backward) the normalisation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum BnEpilogue {
    /// The normalisation alone.
    #[default]
    None,
    /// `RELU_FWD` after it; `RELU_BWD` (from y) before the backward.
    Relu,
    /// `ADD` (the addend) then `RELU_FWD`; the backward also writes the addend's gradient.
    AddRelu,
}

impl BnEpilogue {
    /// `none` / `relu` / `add_relu`.
    pub const fn name(self) -> &'static str {
        match self {
            BnEpilogue::None => "none",
            BnEpilogue::Relu => "relu",
            BnEpilogue::AddRelu => "add_relu",
        }
    }
}

/// How a training epilogue's backward finds where the forward's ReLU passed dy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ReluGrad {
    /// The forward writes `CMP_GT(y, 0)` as a real `BOOLEAN` tensor (the saved state keeps it:
    /// nnfuse allocates 1 byte per element); the backward computes `dy · mask` (cudnn-frontend's
    /// "DBN Add Relu" form).
    #[default]
    Mask,
    /// No mask: the backward's `RELU_BWD` reads the forward's y (0 engine configs on cuDNN 9.19,
    /// H100, measured; kept to re-measure).
    FromY,
}

impl ReluGrad {
    /// `mask` / `from_y`.
    pub const fn name(self) -> &'static str {
        match self {
            ReluGrad::Mask => "mask",
            ReluGrad::FromY => "from_y",
        }
    }
}

/// The element type of a BatchNorm graph's tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BnElem {
    /// f32, f16 or bf16.
    Data(DType),
    /// cuDNN's `BOOLEAN` (the ReLU mask).
    Boolean,
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
    /// The tensor added before the ReLU (Add+ReLU).
    Addend,
    /// The addend's gradient (Add+ReLU backward: dy where y > 0, also NORM_BACKWARD's dy).
    DAddend,
    /// The running mean an inference reads.
    Mean,
    /// `1 / sqrt(running_var + eps)`, computed per call into a scratch buffer (inference).
    InvStd,
    /// Virtual: the normalised output before the epilogue (f32).
    BnOut,
    /// Virtual: the normalised output plus the addend (f32).
    AddOut,
    /// Virtual: dy masked by the ReLU, entering NORM_BACKWARD (ReLU backward, f32).
    DRelu,
    /// The ReLU mask `y > 0` (`BOOLEAN`): written by the forward, read by the backward
    /// ([`ReluGrad::Mask`]).
    Mask,
    /// The mask's comparand: f32 zero, by value.
    Zero,
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
            BnRole::Addend => 117,
            BnRole::DAddend => 118,
            BnRole::Mean => 119,
            BnRole::InvStd => 120,
            BnRole::BnOut => 121,
            BnRole::AddOut => 122,
            BnRole::DRelu => 123,
            BnRole::Mask => 124,
            BnRole::Zero => 125,
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
            BnRole::Addend => "addend",
            BnRole::DAddend => "d_addend",
            BnRole::Mean => "running_mean",
            BnRole::InvStd => "inv_std (from running_var)",
            BnRole::BnOut => "normalised (virtual)",
            BnRole::AddOut => "normalised + addend (virtual)",
            BnRole::DRelu => "dy after the ReLU (virtual)",
            BnRole::Mask => "relu mask",
            BnRole::Zero => "zero (relu mask comparand)",
        }
    }

    /// Whether the tensor has the activations' shape (otherwise one value per channel, or a
    /// scalar).
    pub const fn is_activation(self) -> bool {
        matches!(
            self,
            BnRole::X
                | BnRole::Y
                | BnRole::Dy
                | BnRole::Dx
                | BnRole::Addend
                | BnRole::DAddend
                | BnRole::BnOut
                | BnRole::AddOut
                | BnRole::DRelu
                | BnRole::Mask
        )
    }

    /// Whether the tensor is an intermediate of the graph (never in a variant pack).
    pub const fn is_virtual(self) -> bool {
        matches!(self, BnRole::BnOut | BnRole::AddOut | BnRole::DRelu)
    }

    /// Whether the tensor is a scalar passed by value (a host address in the variant pack).
    pub const fn by_value(self) -> bool {
        matches!(self, BnRole::Epsilon | BnRole::Momentum | BnRole::Zero)
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

/// The forward with an addend (Add+ReLU epilogue) and the running-statistics update.
pub const FORWARD_ADD_ROLES: [BnRole; 13] = [
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
    BnRole::Addend,
];

/// The forward with an addend, without the running-statistics update.
pub const FORWARD_ADD_ROLES_NO_RUNNING: [BnRole; 8] = [
    BnRole::X,
    BnRole::Scale,
    BnRole::Bias,
    BnRole::Epsilon,
    BnRole::SavedMean,
    BnRole::SavedInvVar,
    BnRole::Y,
    BnRole::Addend,
];

/// The backward behind a ReLU: y (the forward's output) tells where the ReLU passed dy.
pub const BACKWARD_RELU_ROLES: [BnRole; 9] = [
    BnRole::X,
    BnRole::Dy,
    BnRole::Scale,
    BnRole::SavedMean,
    BnRole::SavedInvVar,
    BnRole::Dscale,
    BnRole::Dbias,
    BnRole::Dx,
    BnRole::Y,
];

/// The backward behind an Add+ReLU: also writes the addend's gradient.
pub const BACKWARD_ADD_RELU_ROLES: [BnRole; 10] = [
    BnRole::X,
    BnRole::Dy,
    BnRole::Scale,
    BnRole::SavedMean,
    BnRole::SavedInvVar,
    BnRole::Dscale,
    BnRole::Dbias,
    BnRole::Dx,
    BnRole::Y,
    BnRole::DAddend,
];

/// The forward behind a ReLU writing its mask ([`ReluGrad::Mask`]), with the update.
pub const FORWARD_MASK_ROLES: [BnRole; 14] = [
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
    BnRole::Mask,
    BnRole::Zero,
];

/// The forward behind a ReLU writing its mask, without the update.
pub const FORWARD_MASK_ROLES_NO_RUNNING: [BnRole; 9] = [
    BnRole::X,
    BnRole::Scale,
    BnRole::Bias,
    BnRole::Epsilon,
    BnRole::SavedMean,
    BnRole::SavedInvVar,
    BnRole::Y,
    BnRole::Mask,
    BnRole::Zero,
];

/// The forward behind an Add+ReLU writing its mask, with the update.
pub const FORWARD_ADD_MASK_ROLES: [BnRole; 15] = [
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
    BnRole::Addend,
    BnRole::Mask,
    BnRole::Zero,
];

/// The forward behind an Add+ReLU writing its mask, without the update.
pub const FORWARD_ADD_MASK_ROLES_NO_RUNNING: [BnRole; 10] = [
    BnRole::X,
    BnRole::Scale,
    BnRole::Bias,
    BnRole::Epsilon,
    BnRole::SavedMean,
    BnRole::SavedInvVar,
    BnRole::Y,
    BnRole::Addend,
    BnRole::Mask,
    BnRole::Zero,
];

/// The backward behind a ReLU reading the forward's mask ([`ReluGrad::Mask`]).
pub const BACKWARD_MASK_ROLES: [BnRole; 9] = [
    BnRole::X,
    BnRole::Dy,
    BnRole::Scale,
    BnRole::SavedMean,
    BnRole::SavedInvVar,
    BnRole::Dscale,
    BnRole::Dbias,
    BnRole::Dx,
    BnRole::Mask,
];

/// The backward behind an Add+ReLU reading the mask, also writing the addend's gradient.
pub const BACKWARD_ADD_MASK_ROLES: [BnRole; 10] = [
    BnRole::X,
    BnRole::Dy,
    BnRole::Scale,
    BnRole::SavedMean,
    BnRole::SavedInvVar,
    BnRole::Dscale,
    BnRole::Dbias,
    BnRole::Dx,
    BnRole::Mask,
    BnRole::DAddend,
];

/// The inference forward's tensors.
pub const INFERENCE_ROLES: [BnRole; 6] = [
    BnRole::X,
    BnRole::Scale,
    BnRole::Bias,
    BnRole::Mean,
    BnRole::InvStd,
    BnRole::Y,
];

/// The inference forward with an addend (Add+ReLU epilogue).
pub const INFERENCE_ADD_ROLES: [BnRole; 7] = [
    BnRole::X,
    BnRole::Scale,
    BnRole::Bias,
    BnRole::Mean,
    BnRole::InvStd,
    BnRole::Y,
    BnRole::Addend,
];

/// The most tensors one variant pack holds.
pub const MAX_PACK_ROLES: usize = FORWARD_ADD_MASK_ROLES.len();

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
    /// Element type (activations: the key's; the mask `BOOLEAN`; everything else f32).
    pub elem: BnElem,
    /// Guaranteed byte alignment of the data pointer.
    pub alignment: i64,
    /// A scalar passed by value.
    pub by_value: bool,
    /// An intermediate of the graph (no memory of its own).
    pub is_virtual: bool,
}

/// One cached BatchNorm execution plan's identity (per Context).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GraphBnKey {
    /// The 4-D view (OneFlow's inference rule) and its memory format.
    pub layout: ChannelLayout,
    /// Element type of x, y, dy, dx.
    pub dtype: DType,
    /// Training forward, backward, or inference.
    pub direction: BnDirection,
    /// The pointwise epilogue fused into the graph.
    pub epilogue: BnEpilogue,
    /// How a training epilogue's backward finds where the ReLU passed (a training forward with
    /// [`ReluGrad::Mask`] writes the mask; ignored without an epilogue and for inference).
    pub relu_grad: ReluGrad,
    /// The forward updates the running statistics (exponential-average factor given).
    pub running: bool,
    /// Byte alignment every data pointer is guaranteed to have (a power of two up to 16).
    pub alignment: u8,
    /// Which engines may run.
    pub policy: GraphPolicy,
}

impl GraphBnKey {
    /// The key of `layout` for `dtype` and `direction`, without an epilogue, updating the
    /// running statistics, with 16-byte pointers and the strict policy.
    pub fn new(layout: ChannelLayout, dtype: DType, direction: BnDirection) -> GraphBnKey {
        GraphBnKey {
            layout,
            dtype,
            direction,
            epilogue: BnEpilogue::None,
            relu_grad: ReluGrad::default(),
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

    /// The same key with `epilogue` fused.
    pub fn with_epilogue(self, epilogue: BnEpilogue) -> GraphBnKey {
        GraphBnKey { epilogue, ..self }
    }

    /// The same key with the ReLU backward's form `relu_grad`.
    pub fn with_relu_grad(self, relu_grad: ReluGrad) -> GraphBnKey {
        GraphBnKey { relu_grad, ..self }
    }

    /// Whether the graph has the ReLU mask: a training epilogue in the [`ReluGrad::Mask`] form
    /// (the forward writes it, the backward reads it).
    pub fn has_mask(&self) -> bool {
        self.has_relu_grad() && self.relu_grad == ReluGrad::Mask
    }

    /// Whether [`GraphBnKey::relu_grad`] shapes the graph: a training epilogue.
    pub fn has_relu_grad(&self) -> bool {
        self.epilogue != BnEpilogue::None && self.direction != BnDirection::Inference
    }

    /// The same key with or without the running-statistics update.
    pub fn with_running(self, running: bool) -> GraphBnKey {
        GraphBnKey { running, ..self }
    }

    /// The graph's tensors in variant-pack order (the virtual ones excluded).
    pub fn roles(&self) -> &'static [BnRole] {
        use BnDirection as D;
        use BnEpilogue as E;
        let mask = self.has_mask();
        match (self.direction, self.epilogue, mask, self.running) {
            (D::Forward, E::AddRelu, true, true) => &FORWARD_ADD_MASK_ROLES,
            (D::Forward, E::AddRelu, true, false) => &FORWARD_ADD_MASK_ROLES_NO_RUNNING,
            (D::Forward, E::AddRelu, false, true) => &FORWARD_ADD_ROLES,
            (D::Forward, E::AddRelu, false, false) => &FORWARD_ADD_ROLES_NO_RUNNING,
            (D::Forward, _, true, true) => &FORWARD_MASK_ROLES,
            (D::Forward, _, true, false) => &FORWARD_MASK_ROLES_NO_RUNNING,
            (D::Forward, _, false, true) => &FORWARD_ROLES,
            (D::Forward, _, false, false) => &FORWARD_ROLES_NO_RUNNING,
            (D::Backward, E::None, _, _) => &BACKWARD_ROLES,
            (D::Backward, E::Relu, true, _) => &BACKWARD_MASK_ROLES,
            (D::Backward, E::Relu, false, _) => &BACKWARD_RELU_ROLES,
            (D::Backward, E::AddRelu, true, _) => &BACKWARD_ADD_MASK_ROLES,
            (D::Backward, E::AddRelu, false, _) => &BACKWARD_ADD_RELU_ROLES,
            (D::Inference, E::AddRelu, _, _) => &INFERENCE_ADD_ROLES,
            (D::Inference, _, _, _) => &INFERENCE_ROLES,
        }
    }

    /// The graph's virtual intermediates (between the normalisation and its epilogue).
    pub fn virtuals(&self) -> &'static [BnRole] {
        match (self.direction, self.epilogue) {
            (_, BnEpilogue::None) => &[],
            (BnDirection::Backward, BnEpilogue::Relu) => &[BnRole::DRelu],
            // The Add+ReLU backward's masked dy is the written d_addend.
            (BnDirection::Backward, BnEpilogue::AddRelu) => &[],
            (_, BnEpilogue::Relu) => &[BnRole::BnOut],
            (_, BnEpilogue::AddRelu) => &[BnRole::BnOut, BnRole::AddOut],
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
        let f32 = BnElem::Data(DType::F32);
        let (dims, strides, elem) = if role.is_activation() {
            let dims = [n, c, h, w];
            // Intermediates stay f32 (cudnn-frontend's intermediate type for these patterns).
            let elem = match role {
                BnRole::Mask => BnElem::Boolean,
                r if r.is_virtual() => f32,
                _ => BnElem::Data(self.dtype),
            };
            (dims, packed_strides(l.format, dims), elem)
        } else if role.by_value() {
            ([1; 4], [1; 4], f32)
        } else {
            let dims = [1, c, 1, 1];
            (dims, packed_strides(TensorFormat::Nhwc, dims), f32)
        };
        BnTensorSpec {
            role,
            uid: role.uid(),
            dims,
            strides,
            elem,
            alignment: i64::from(self.alignment),
            by_value: role.by_value(),
            is_virtual: role.is_virtual(),
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
        assert_eq!(x.elem, BnElem::Data(DType::F16));
        let s = k.spec(BnRole::Scale);
        assert_eq!((s.dims, s.elem), ([1, 64, 1, 1], BnElem::Data(DType::F32)));
        assert_eq!(s.strides, [64, 1, 64, 64]);
        let e = k.spec(BnRole::Epsilon);
        assert!(e.by_value && e.dims == [1; 4] && e.elem == BnElem::Data(DType::F32));
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
            base.with_epilogue(BnEpilogue::Relu),
            base.with_epilogue(BnEpilogue::AddRelu),
            base.with_epilogue(BnEpilogue::Relu)
                .with_relu_grad(ReluGrad::FromY),
            GraphBnKey {
                direction: BnDirection::Inference,
                ..base
            },
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

    /// Every epilogue, ReLU backward form and update.
    fn combinations() -> Vec<(BnEpilogue, ReluGrad, bool)> {
        let mut v = Vec::new();
        for e in [BnEpilogue::None, BnEpilogue::Relu, BnEpilogue::AddRelu] {
            for g in [ReluGrad::Mask, ReluGrad::FromY] {
                for running in [true, false] {
                    v.push((e, g, running));
                }
            }
        }
        v
    }

    /// Every combination of direction, epilogue, ReLU backward form and update: the pack holds
    /// only real tensors,
    /// each once, the virtual ones are exactly the epilogue's intermediates, and every graph
    /// reads what its operations need.
    #[test]
    fn roles_follow_direction_and_epilogue() {
        let base = GraphBnKey::new(layout(TensorFormat::Nhwc), DType::F16, BnDirection::Forward);
        let all = [
            FORWARD_ROLES.as_slice(),
            &FORWARD_ADD_ROLES,
            &BACKWARD_ADD_RELU_ROLES,
            &INFERENCE_ADD_ROLES,
            &FORWARD_ADD_MASK_ROLES,
            &[BnRole::BnOut, BnRole::AddOut, BnRole::DRelu, BnRole::Dx],
        ]
        .concat();
        let uids: HashSet<i64> = all.iter().map(|r| r.uid()).collect();
        let roles: HashSet<BnRole> = all.iter().copied().collect();
        assert_eq!(uids.len(), roles.len(), "one uid per role");
        for d in [
            BnDirection::Forward,
            BnDirection::Backward,
            BnDirection::Inference,
        ] {
            for (e, g, running) in combinations() {
                let k = GraphBnKey {
                    direction: d,
                    running,
                    ..base.with_epilogue(e).with_relu_grad(g)
                };
                let r = k.roles();
                let set: HashSet<BnRole> = r.iter().copied().collect();
                assert_eq!(set.len(), r.len(), "{d:?} {e:?}: a role twice");
                assert!(r.len() <= MAX_PACK_ROLES);
                assert!(r.iter().all(|x| !x.is_virtual()), "{d:?} {e:?}");
                assert!(k.virtuals().iter().all(|x| x.is_virtual()));
                assert_eq!(
                    r.contains(&BnRole::Addend),
                    e == BnEpilogue::AddRelu && d != BnDirection::Backward,
                    "{d:?} {e:?}"
                );
                assert_eq!(
                    r.contains(&BnRole::DAddend),
                    e == BnEpilogue::AddRelu && d == BnDirection::Backward
                );
                // The mask form: the training forward writes the mask (comparing with a
                // by-value zero) and the backward reads it; the other form's backward
                // reads y; inference keeps no mask.
                let mask =
                    e != BnEpilogue::None && g == ReluGrad::Mask && d != BnDirection::Inference;
                assert_eq!(k.has_mask(), mask, "{d:?} {e:?} {g:?}");
                assert_eq!(r.contains(&BnRole::Mask), mask, "{d:?} {e:?} {g:?}");
                assert_eq!(
                    r.contains(&BnRole::Zero),
                    mask && d == BnDirection::Forward,
                    "{d:?} {e:?} {g:?}"
                );
                if d == BnDirection::Backward {
                    let from_y = e != BnEpilogue::None && g == ReluGrad::FromY;
                    assert_eq!(r.contains(&BnRole::Y), from_y, "{e:?} {g:?}");
                }
                if d == BnDirection::Inference {
                    assert!(r.contains(&BnRole::Mean) && r.contains(&BnRole::InvStd));
                    assert!(!r.contains(&BnRole::Epsilon) && !r.contains(&BnRole::SavedMean));
                }
                let v = k.virtuals();
                match (d, e) {
                    (_, BnEpilogue::None) => assert!(v.is_empty()),
                    (BnDirection::Backward, BnEpilogue::Relu) => {
                        assert_eq!(v, &[BnRole::DRelu])
                    }
                    (BnDirection::Backward, BnEpilogue::AddRelu) => assert!(v.is_empty()),
                    (_, BnEpilogue::Relu) => assert_eq!(v, &[BnRole::BnOut]),
                    (_, BnEpilogue::AddRelu) => {
                        assert_eq!(v, &[BnRole::BnOut, BnRole::AddOut])
                    }
                }
            }
        }
    }

    #[test]
    fn intermediates_are_f32_activations_and_inference_stats_per_channel() {
        let k = GraphBnKey::new(
            layout(TensorFormat::Nhwc),
            DType::BF16,
            BnDirection::Forward,
        )
        .with_epilogue(BnEpilogue::AddRelu);
        for r in [BnRole::BnOut, BnRole::AddOut, BnRole::DRelu] {
            let s = k.spec(r);
            assert!(s.is_virtual && s.elem == BnElem::Data(DType::F32), "{r:?}");
            assert_eq!(s.dims, [8, 64, 196, 1]);
            assert_eq!(s.strides, [196 * 64, 1, 64, 64]);
        }
        for r in [BnRole::Addend, BnRole::DAddend, BnRole::Y] {
            let s = k.spec(r);
            assert!(
                !s.is_virtual && s.elem == BnElem::Data(DType::BF16),
                "{r:?}"
            );
        }
        // The mask: a real BOOLEAN activation in x's layout; its comparand an f32 by value.
        let m = k.spec(BnRole::Mask);
        assert_eq!(
            (m.elem, m.is_virtual, m.by_value),
            (BnElem::Boolean, false, false)
        );
        assert_eq!(
            (m.dims, m.strides),
            ([8, 64, 196, 1], [196 * 64, 1, 64, 64])
        );
        let z = k.spec(BnRole::Zero);
        assert!(z.by_value && z.elem == BnElem::Data(DType::F32) && z.dims == [1; 4]);
        assert_eq!(ReluGrad::default(), ReluGrad::Mask);
        assert_eq!(
            (ReluGrad::Mask.name(), ReluGrad::FromY.name()),
            ("mask", "from_y")
        );
        for r in [BnRole::Mean, BnRole::InvStd] {
            let s = k.spec(r);
            assert_eq!(
                (s.dims, s.elem, s.is_virtual),
                ([1, 64, 1, 1], BnElem::Data(DType::F32), false)
            );
        }
        assert_eq!(BnDirection::Inference.name(), "inference");
        assert_eq!(BnEpilogue::AddRelu.name(), "add_relu");
    }
}
