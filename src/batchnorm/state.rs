//! What a training forward hands to its backward. Only the matching backward accepts it: the
//! state records which BatchNorm made it, from which `x`, and by which path.

use cudarc::driver::CudaSlice;

use crate::batchnorm::types::{BnPath, OwnVariant};

/// State saved by `BatchNorm::forward_train` for the backward.
#[derive(Debug)]
pub struct BnSaved {
    pub(crate) owner: u64,
    pub(crate) path: BnPath,
    pub(crate) eps: f64,
    pub(crate) x_ptr: u64,
    pub(crate) mean: CudaSlice<f32>,
    /// Own path: the mean's remainder (`mean + mean_lo` is the mean to about 2^-48 relative),
    /// so that the backward's `x - mean` keeps its precision under a large common offset.
    pub(crate) mean_lo: Option<CudaSlice<f32>>,
    pub(crate) inv_var: CudaSlice<f32>,
    /// cuDNN's opaque reserve space, when the Ex forward asked for one.
    pub(crate) reserve: Option<CudaSlice<u8>>,
    /// nnfuse's bitmask of the positive outputs (fallback and own paths with an activation).
    pub(crate) mask: Option<CudaSlice<u32>>,
    /// Own path: the variant the forward ran.
    pub(crate) own_variant: Option<OwnVariant>,
}

impl BnSaved {
    /// The path the forward actually took (a fused plan that cuDNN refused at run time shows
    /// `Fallback` here).
    pub fn path(&self) -> BnPath {
        self.path
    }

    /// Batch mean per channel.
    pub fn saved_mean(&self) -> &CudaSlice<f32> {
        &self.mean
    }

    /// `1 / sqrt(var + eps)` per channel (biased batch variance).
    pub fn saved_inv_std(&self) -> &CudaSlice<f32> {
        &self.inv_var
    }

    /// The bitmask of the fallback and own paths with an activation (`None` otherwise). Layout
    /// as [`crate::reference::activation`].
    pub fn mask(&self) -> Option<&CudaSlice<u32>> {
        self.mask.as_ref()
    }

    /// On the own path, the variant the forward ran (persistent, or two-pass when the plan or the
    /// device said so); `None` on cuDNN paths.
    pub fn own_variant(&self) -> Option<OwnVariant> {
        self.own_variant
    }

    /// Bytes of cuDNN reserve space this state holds.
    pub fn reserve_bytes(&self) -> usize {
        self.reserve.as_ref().map_or(0, |r| r.len())
    }

    /// The epsilon the forward used (the backward reuses it).
    pub fn eps(&self) -> f64 {
        self.eps
    }
}
