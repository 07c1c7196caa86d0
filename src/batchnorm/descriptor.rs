//! Owned cuDNN descriptors for BatchNorm: the x/y tensor descriptor built from the inferred
//! layout, the parameter descriptor derived from it with `cudnnDeriveBNTensorDescriptor` (per
//! mode), and the ReLU activation descriptor of the fused path. Destroyed on drop; a failure to
//! destroy is logged, never a panic.

use std::mem::MaybeUninit;

use cudarc::cudnn::sys as cudnn;

use crate::batchnorm::types::BnMode;
use crate::dtype::DType;
use crate::error::{cudnn_check, Error, Result};
use crate::layout::ChannelLayout;

/// cuDNN's enum for `mode`.
pub(crate) fn cudnn_mode(mode: BnMode) -> cudnn::cudnnBatchNormMode_t {
    use cudnn::cudnnBatchNormMode_t as M;
    match mode {
        BnMode::PerActivation => M::CUDNN_BATCHNORM_PER_ACTIVATION,
        BnMode::Spatial => M::CUDNN_BATCHNORM_SPATIAL,
        BnMode::SpatialPersistent => M::CUDNN_BATCHNORM_SPATIAL_PERSISTENT,
    }
}

/// An owned `cudnnTensorDescriptor_t`.
#[derive(Debug)]
pub(crate) struct TensorDesc(pub(crate) cudnn::cudnnTensorDescriptor_t);

// SAFETY: the descriptor is written once at creation and only read afterwards; cuDNN allows
// reading a descriptor from several threads.
unsafe impl Send for TensorDesc {}
unsafe impl Sync for TensorDesc {}

impl TensorDesc {
    fn create() -> Result<TensorDesc> {
        let mut d = MaybeUninit::uninit();
        // SAFETY: valid out-pointer.
        cudnn_check(
            unsafe { cudnn::cudnnCreateTensorDescriptor(d.as_mut_ptr()) },
            "cudnnCreateTensorDescriptor",
        )?;
        // SAFETY: initialised by the successful call.
        Ok(TensorDesc(unsafe { d.assume_init() }))
    }

    /// The 4-D descriptor of `layout` for elements of `dtype`.
    pub(crate) fn activation(layout: &ChannelLayout, dtype: DType) -> Result<TensorDesc> {
        let d = Self::create()?;
        // SAFETY: fresh descriptor; the layout's dims are positive i32 (checked by inference).
        cudnn_check(
            unsafe {
                cudnn::cudnnSetTensor4dDescriptor(
                    d.0,
                    layout.format.cudnn(),
                    dtype.cudnn(),
                    layout.n,
                    layout.c,
                    layout.h,
                    layout.w,
                )
            },
            "cudnnSetTensor4dDescriptor",
        )?;
        Ok(d)
    }

    /// The parameter descriptor cuDNN derives from `x` for `mode`.
    pub(crate) fn derive_bn(x: &TensorDesc, mode: BnMode) -> Result<TensorDesc> {
        let d = Self::create()?;
        // SAFETY: both descriptors are valid.
        cudnn_check(
            unsafe { cudnn::cudnnDeriveBNTensorDescriptor(d.0, x.0, cudnn_mode(mode)) },
            "cudnnDeriveBNTensorDescriptor",
        )?;
        Ok(d)
    }

    /// The data type and element count of a (fully packed) 4-D descriptor.
    pub(crate) fn type_and_count(&self) -> Result<(cudnn::cudnnDataType_t, usize)> {
        let mut dt = MaybeUninit::uninit();
        let (mut n, mut c, mut h, mut w) = (0, 0, 0, 0);
        let (mut sn, mut sc, mut sh, mut sw) = (0, 0, 0, 0);
        // SAFETY: valid descriptor and out-pointers.
        cudnn_check(
            unsafe {
                cudnn::cudnnGetTensor4dDescriptor(
                    self.0,
                    dt.as_mut_ptr(),
                    &mut n,
                    &mut c,
                    &mut h,
                    &mut w,
                    &mut sn,
                    &mut sc,
                    &mut sh,
                    &mut sw,
                )
            },
            "cudnnGetTensor4dDescriptor",
        )?;
        // SAFETY: written by the successful call.
        let dt = unsafe { dt.assume_init() };
        let count = [n, c, h, w].iter().map(|&v| v.max(0) as usize).product();
        Ok((dt, count))
    }
}

impl Drop for TensorDesc {
    fn drop(&mut self) {
        // SAFETY: created once by create(), destroyed once here.
        let s = unsafe { cudnn::cudnnDestroyTensorDescriptor(self.0) };
        if s != cudnn::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
            tracing::warn!(?s, "cudnnDestroyTensorDescriptor failed");
        }
    }
}

/// An owned ReLU `cudnnActivationDescriptor_t` (the fused path's activation).
#[derive(Debug)]
pub(crate) struct ReluDesc(pub(crate) cudnn::cudnnActivationDescriptor_t);

// SAFETY: as TensorDesc: written at creation, read-only afterwards.
unsafe impl Send for ReluDesc {}
unsafe impl Sync for ReluDesc {}

impl ReluDesc {
    pub(crate) fn new() -> Result<ReluDesc> {
        let mut d = MaybeUninit::uninit();
        // SAFETY: valid out-pointer.
        cudnn_check(
            unsafe { cudnn::cudnnCreateActivationDescriptor(d.as_mut_ptr()) },
            "cudnnCreateActivationDescriptor",
        )?;
        // SAFETY: initialised by the successful call.
        let d = ReluDesc(unsafe { d.assume_init() });
        // SAFETY: fresh descriptor. NaN propagates, as in nnfuse's own kernels and PyTorch.
        cudnn_check(
            unsafe {
                cudnn::cudnnSetActivationDescriptor(
                    d.0,
                    cudnn::cudnnActivationMode_t::CUDNN_ACTIVATION_RELU,
                    cudnn::cudnnNanPropagation_t::CUDNN_PROPAGATE_NAN,
                    0.0,
                )
            },
            "cudnnSetActivationDescriptor",
        )?;
        Ok(d)
    }
}

impl Drop for ReluDesc {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once.
        let s = unsafe { cudnn::cudnnDestroyActivationDescriptor(self.0) };
        if s != cudnn::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
            tracing::warn!(?s, "cudnnDestroyActivationDescriptor failed");
        }
    }
}

/// The parameter descriptor of one mode and what it says parameters must look like.
#[derive(Debug)]
pub(crate) struct ParamDesc {
    pub(crate) desc: TensorDesc,
    /// Elements every parameter tensor must hold (C, or C·H·W for PER_ACTIVATION).
    pub(crate) len: usize,
}

impl ParamDesc {
    /// Derives the descriptor and checks that cuDNN wants f32 parameters (the only type nnfuse
    /// accepts for scale, bias and statistics of f32, f16 and bf16 activations).
    pub(crate) fn derive(x: &TensorDesc, mode: BnMode) -> Result<ParamDesc> {
        let desc = TensorDesc::derive_bn(x, mode)?;
        let (dt, len) = desc.type_and_count()?;
        if dt != cudnn::cudnnDataType_t::CUDNN_DATA_FLOAT {
            return Err(Error::NotSupported(format!(
                "cuDNN derived parameter type {dt:?}; nnfuse passes f32 parameters only"
            )));
        }
        Ok(ParamDesc { desc, len })
    }
}
