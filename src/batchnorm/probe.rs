//! Asks the installed cuDNN whether it runs a fused BatchNorm combination, by running it once on
//! scratch buffers. Size queries are not a support test (cuDNN answers them for combinations its
//! forward then refuses), so the probe goes as far as the forward. For `nnfuse` diagnostics and
//! the GPU test that re-checks the support matrix recorded in `docs/CUDNN-FACTS.md`.

use cudarc::driver::DevicePtrMut;

use crate::batchnorm::cudnn_calls::{self as calls, FwdPtrs, Ops};
use crate::batchnorm::descriptor::{ParamDesc, ReluDesc, TensorDesc};
use crate::batchnorm::types::{BnMode, Fuse};
use crate::context::Context;
use crate::dtype::DType;
use crate::error::{CallExt, Result};
use crate::layout::{ChannelLayout, TensorFormat};

/// What cuDNN said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Support {
    /// The size queries and the forward succeeded.
    Works,
    /// A size query returned `NOT_SUPPORTED`.
    QueryRefused,
    /// The size queries succeeded, the forward returned `NOT_SUPPORTED`.
    ForwardRefused,
}

/// Runs cuDNN's training forward for `fuse` (BN, BN+ReLU, BN+Add+ReLU through the Ex API) once
/// on an `n x c x h x w` tensor in `format`, and reports whether cuDNN supports it. Errors other
/// than `NOT_SUPPORTED` are returned as errors.
#[allow(clippy::too_many_arguments)]
pub fn probe_fused(
    ctx: &Context,
    format: TensorFormat,
    (n, c, h, w): (i32, i32, i32, i32),
    dtype: DType,
    mode: BnMode,
    fuse: Fuse,
) -> Result<Support> {
    let layout = ChannelLayout {
        n,
        c,
        h,
        w,
        format,
        rank: 4,
    };
    let x_desc = TensorDesc::activation(&layout, dtype)?;
    let param = ParamDesc::derive(&x_desc, mode)?;
    let relu = if fuse == Fuse::None {
        None
    } else {
        Some(ReluDesc::new()?)
    };
    let ops = match fuse {
        Fuse::None => Ops::Bn,
        Fuse::Relu => Ops::BnRelu,
        Fuse::AddRelu => Ops::BnAddRelu,
    };
    let stream = ctx.stream();
    let mut guard = ctx.lock()?;
    let h_cudnn = guard.cudnn()?;
    // SAFETY: valid handle and descriptors.
    let sizes =
        match unsafe { calls::ex_sizes(h_cudnn, mode, ops, &x_desc, &param.desc, relu.as_ref()) } {
            Ok(s) => s,
            Err(e) if e.is_cudnn_not_supported() => return Ok(Support::QueryRefused),
            Err(e) => return Err(e),
        };
    let bytes = layout.numel() * dtype.size();
    let mut x = stream.alloc_zeros::<u8>(bytes).call("cuMemAlloc")?;
    let mut z = stream.alloc_zeros::<u8>(bytes).call("cuMemAlloc")?;
    let mut y = stream.alloc_zeros::<u8>(bytes).call("cuMemAlloc")?;
    let mut params = stream
        .alloc_zeros::<f32>(param.len * 6)
        .call("cuMemAlloc")?;
    let mut reserve = stream
        .alloc_zeros::<u8>(sizes.reserve.max(1))
        .call("cuMemAlloc")?;
    let ws = guard.workspace(sizes.forward_workspace)?;
    let (xp, _g1) = x.device_ptr_mut(stream);
    let (zp, _g2) = z.device_ptr_mut(stream);
    let (yp, _g3) = y.device_ptr_mut(stream);
    let (pp, _g4) = params.device_ptr_mut(stream);
    let (rp, _g5) = reserve.device_ptr_mut(stream);
    let at = |i: usize| pp + (i * param.len * 4) as u64;
    let ptrs = FwdPtrs {
        x: xp,
        z: zp,
        y: yp,
        gamma: at(0),
        beta: at(1),
        running_mean: at(2),
        running_var: at(3),
        saved_mean: at(4),
        saved_inv_var: at(5),
    };
    // SAFETY: every buffer is sized from the descriptors and cuDNN's queries.
    let r = unsafe {
        calls::forward_training_ex(
            h_cudnn,
            mode,
            ops,
            &x_desc,
            &param.desc,
            relu.as_ref(),
            &ptrs,
            0.1,
            1e-5,
            (ws, sizes.forward_workspace),
            (rp, sizes.reserve),
        )
    };
    match r {
        Ok(()) => {
            drop(guard);
            ctx.synchronize()?;
            Ok(Support::Works)
        }
        Err(e) if e.is_cudnn_not_supported() => Ok(Support::ForwardRefused),
        Err(e) => Err(e),
    }
}
