//! The cuDNN route: one `cudnnConvolutionBiasActivationForward`,
//! `y = act(alpha1 · conv(x, w') + alpha2 · z + bias)` with the folded filter `w'` and bias,
//! `z` the shortcut (alpha2 = 1) or unused (alpha2 = 0, `z` = `y`), act ReLU or identity. The
//! algorithm is `IMPLICIT_PRECOMP_GEMM`: cuDNN documents it as the one this call accepts with
//! ReLU. Math type FMA for f32 (no TF32), tensor ops for f16/bf16; compute type f32; the bias
//! of the data type, `1 x c_out x 1 x 1`.

use std::ffi::c_void;
use std::mem::MaybeUninit;

use cudarc::cudnn::sys as cudnn;

use crate::conv::cudnn::{Conv, Filter, Tensor4d};
use crate::conv::{ConvShape, CudnnMath};
use crate::dtype::DType;
use crate::error::{cudnn_check, Result};
use crate::layout::TensorFormat;

const ALGO: cudnn::cudnnConvolutionFwdAlgo_t =
    cudnn::cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM;

struct Act(cudnn::cudnnActivationDescriptor_t);
impl Drop for Act {
    fn drop(&mut self) {
        // SAFETY: as Tensor.
        let _ = unsafe { cudnn::cudnnDestroyActivationDescriptor(self.0) };
    }
}

/// Every descriptor of one problem, data type and activation.
pub(crate) struct CudnnFused {
    x: Tensor4d,
    y: Tensor4d,
    bias: Tensor4d,
    w: Filter,
    conv: Conv,
    act: Act,
    /// The algorithm's workspace bytes, asked once.
    workspace: std::sync::OnceLock<usize>,
}

// SAFETY: opaque host objects written only in `new`, then read-only inputs of cuDNN calls made
// under the Context's lock; destroyed once in Drop.
unsafe impl Send for CudnnFused {}
// SAFETY: see Send.
unsafe impl Sync for CudnnFused {}

impl CudnnFused {
    /// Builds the descriptors of `s` in `dtype` with ReLU when `relu` (no GPU work).
    pub(crate) fn new(s: &ConvShape, dtype: DType, relu: bool) -> Result<CudnnFused> {
        let (oh, ow) = s.out_hw()?;
        let x = Tensor4d::new(s.format, dtype, [s.n, s.c_in, s.h, s.w])?;
        let y = Tensor4d::new(s.format, dtype, [s.n, s.c_out, oh, ow])?;
        let bias = Tensor4d::new(TensorFormat::Nchw, dtype, [1, s.c_out, 1, 1])?;
        let w = Filter::new(s, dtype)?;
        // FMA for f32 (true f32, no TF32), tensor ops for f16/bf16.
        let math = match dtype {
            DType::F32 => CudnnMath::Fma,
            DType::F16 | DType::BF16 => CudnnMath::TensorOp,
        };
        let conv = Conv::new(s, math)?;
        let mut d = MaybeUninit::uninit();
        // SAFETY: valid out-pointer.
        cudnn_check(
            unsafe { cudnn::cudnnCreateActivationDescriptor(d.as_mut_ptr()) },
            "cudnnCreateActivationDescriptor",
        )?;
        // SAFETY: initialised by the successful call.
        let act = Act(unsafe { d.assume_init() });
        let mode = if relu {
            cudnn::cudnnActivationMode_t::CUDNN_ACTIVATION_RELU
        } else {
            cudnn::cudnnActivationMode_t::CUDNN_ACTIVATION_IDENTITY
        };
        // SAFETY: valid descriptor.
        cudnn_check(
            unsafe {
                cudnn::cudnnSetActivationDescriptor(
                    act.0,
                    mode,
                    cudnn::cudnnNanPropagation_t::CUDNN_NOT_PROPAGATE_NAN,
                    0.0,
                )
            },
            "cudnnSetActivationDescriptor",
        )?;
        Ok(CudnnFused {
            x,
            y,
            bias,
            w,
            conv,
            act,
            workspace: std::sync::OnceLock::new(),
        })
    }

    /// Bytes of workspace the algorithm needs (asked of cuDNN once).
    ///
    /// # Safety
    /// `h` a live cuDNN handle used by no other thread meanwhile.
    pub(crate) unsafe fn workspace(&self, h: cudnn::cudnnHandle_t) -> Result<usize> {
        if let Some(b) = self.workspace.get() {
            return Ok(*b);
        }
        let mut bytes = 0usize;
        cudnn_check(
            cudnn::cudnnGetConvolutionForwardWorkspaceSize(
                h,
                self.x.0,
                self.w.0,
                self.conv.0,
                self.y.0,
                ALGO,
                &mut bytes,
            ),
            "cudnnGetConvolutionForwardWorkspaceSize",
        )?;
        Ok(*self.workspace.get_or_init(|| bytes))
    }

    /// Queues the fused call; `z` is read when `shortcut`.
    ///
    /// # Safety
    /// `h` live, bound to the operands' stream, used by no other thread meanwhile; the
    /// addresses hold the problem's extents (bias `c_out` elements), `y` disjoint from the
    /// inputs; `ws` holds `ws_bytes >=` [`CudnnFused::workspace`] bytes.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn run(
        &self,
        h: cudnn::cudnnHandle_t,
        x: u64,
        w: u64,
        bias: u64,
        z: Option<u64>,
        y: u64,
        ws: u64,
        ws_bytes: usize,
    ) -> Result<()> {
        let one = 1.0f32;
        let alpha2 = if z.is_some() { 1.0f32 } else { 0.0f32 };
        let vp = |p: u64| p as *mut c_void;
        cudnn_check(
            cudnn::cudnnConvolutionBiasActivationForward(
                h,
                &one as *const f32 as *const c_void,
                self.x.0,
                vp(x),
                self.w.0,
                vp(w),
                self.conv.0,
                ALGO,
                vp(ws),
                ws_bytes,
                &alpha2 as *const f32 as *const c_void,
                self.y.0,
                vp(z.unwrap_or(y)),
                self.bias.0,
                vp(bias),
                self.act.0,
                self.y.0,
                vp(y),
            ),
            "cudnnConvolutionBiasActivationForward",
        )
    }
}
