//! The argument structs of the BatchNorm operations. Buffers are cudarc views (`as_view()`,
//! `as_view_mut()` or `slice(..)` of a `CudaSlice`), owned by the caller; activations are `T`
//! (`f32`, `f16`, `bf16`), scale, bias and statistics are `f32`.

use cudarc::driver::{CudaView, CudaViewMut};

use crate::batchnorm::state::BnSaved;

/// Training forward: `y = act(gamma * (x - mean) / sqrt(var + eps) + beta [+ addend])` with the
/// batch statistics, which also update the running statistics.
///
/// Running statistics follow PyTorch's momentum convention (cuDNN's
/// `exponentialAverageFactor`): `running = (1 - momentum) * running + momentum * batch`, where
/// the variance that enters `running_var` is the unbiased one (`M / (M - 1)` times the biased
/// variance used for normalising; `M` elements per channel).
pub struct TrainArgs<'a, T> {
    /// Input.
    pub x: CudaView<'a, T>,
    /// The tensor added before the ReLU: required for `Fuse::AddRelu`, absent otherwise.
    pub addend: Option<CudaView<'a, T>>,
    /// Scale, one per channel.
    pub gamma: CudaView<'a, f32>,
    /// Bias, one per channel.
    pub beta: CudaView<'a, f32>,
    /// Running mean, updated in place.
    pub running_mean: CudaViewMut<'a, f32>,
    /// Running (unbiased) variance, updated in place.
    pub running_var: CudaViewMut<'a, f32>,
    /// Output; must not overlap any input.
    pub y: CudaViewMut<'a, T>,
    /// Weight of the new batch statistics, in `[0, 1]` (PyTorch's default is 0.1).
    pub momentum: f64,
    /// Added to the variance; finite and `> 0` (PyTorch's default is 1e-5).
    pub eps: f64,
}

/// Training backward. Takes the [`BnSaved`] that the matching forward returned.
pub struct BackwardArgs<'a, T> {
    /// The forward's input (the same buffer).
    pub x: CudaView<'a, T>,
    /// The forward's output. Read only by cuDNN's fused path (its activation backward works
    /// from y); the fallback path reads the bitmask instead.
    pub y: CudaView<'a, T>,
    /// Gradient of the loss with respect to `y`.
    pub dy: CudaView<'a, T>,
    /// Scale, as in the forward.
    pub gamma: CudaView<'a, f32>,
    /// Bias, as in the forward (cuDNN's fused backward recomputes the pre-activation from it).
    pub beta: CudaView<'a, f32>,
    /// What the forward saved.
    pub saved: &'a BnSaved,
    /// Gradient with respect to `x`.
    pub dx: CudaViewMut<'a, T>,
    /// Gradient with respect to the addend: required for `Fuse::AddRelu`, absent otherwise.
    pub d_addend: Option<CudaViewMut<'a, T>>,
    /// Gradient with respect to `gamma` (overwritten, not accumulated).
    pub dgamma: CudaViewMut<'a, f32>,
    /// Gradient with respect to `beta` (overwritten, not accumulated).
    pub dbeta: CudaViewMut<'a, f32>,
}

/// Inference forward with the running statistics.
pub struct InferenceArgs<'a, T> {
    /// Input.
    pub x: CudaView<'a, T>,
    /// Required for `Fuse::AddRelu`, absent otherwise.
    pub addend: Option<CudaView<'a, T>>,
    /// Scale.
    pub gamma: CudaView<'a, f32>,
    /// Bias.
    pub beta: CudaView<'a, f32>,
    /// Running mean.
    pub running_mean: CudaView<'a, f32>,
    /// Running variance.
    pub running_var: CudaView<'a, f32>,
    /// Output; must not overlap any input.
    pub y: CudaViewMut<'a, T>,
    /// Added to the variance; finite and `> 0`.
    pub eps: f64,
}
