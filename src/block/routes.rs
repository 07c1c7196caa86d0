//! The three routes of [`ConvBnInference`] on validated operands: the cuBLASLt epilogue GEMM
//! (after im2col where the kernel is not pointwise), cuDNN's fused call, and the unfused
//! composition of nnfuse's `Conv2d` and `BatchNorm`.

use std::sync::Arc;

use cudarc::cublaslt::sys as lt_sys;
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};

use super::api::{lock, ConvBnInference};
use super::cudnn_fused::CudnnFused;
use super::lt_epilogue::{EpilogueGemm, GemmPtrs, OPERAND_ALIGNMENT};
use super::plan::BlockRoute;
use crate::batchnorm::InferenceArgs;
use crate::context::Context;
use crate::dtype::Element;
use crate::error::{CallExt, Error, Result};
use crate::gemm::WORKSPACE_BYTES;

/// A buffer of `len` elements in `slot`, allocated (outside capture only) when missing or of
/// another length.
pub(super) fn ensure<T: Element>(
    ctx: &Context,
    slot: &mut Option<CudaSlice<T>>,
    len: usize,
    what: &'static str,
) -> Result<()> {
    if slot.as_ref().is_some_and(|b| b.len() == len) {
        return Ok(());
    }
    ctx.refuse_under_capture(what, "allocate it (run the first call outside capture)")?;
    // SAFETY: every user writes the buffer before reading it.
    *slot = Some(unsafe { ctx.stream().alloc::<T>(len.max(1)) }.call("cuMemAllocAsync")?);
    Ok(())
}

impl<T: Element> ConvBnInference<T> {
    /// The unfused composition: `Conv2d` forward with the original filter into an own buffer,
    /// then `BatchNorm` inference into `y` with ReLU / Add+ReLU (a shortcut without ReLU: plain
    /// BatchNorm, then an add in place).
    pub(super) fn run_unfused(
        &self,
        x: &CudaView<'_, T>,
        shortcut: Option<&CudaView<'_, T>>,
        relu: bool,
        y: &mut CudaViewMut<'_, T>,
    ) -> Result<()> {
        let y_len = self.plan.shape.y_len()?;
        let mut bufs = lock(&self.buffers);
        ensure(
            &self.ctx,
            &mut bufs.conv_out,
            y_len,
            "the unfused route's convolution output",
        )?;
        let Some(conv_out) = bufs.conv_out.as_mut() else {
            return Err(Error::NotSupported(
                "convolution output buffer missing".into(),
            ));
        };
        self.conv.forward(x, &self.w, conv_out)?;
        let bn = match (shortcut.is_some(), relu) {
            (true, true) => &self.bn[2],
            (false, true) => &self.bn[1],
            (_, false) => &self.bn[0],
        };
        bn.forward_inference(InferenceArgs {
            x: conv_out.as_view(),
            addend: shortcut.filter(|_| relu).map(|z| z.slice(..)),
            gamma: self.gamma.as_view(),
            beta: self.beta.as_view(),
            running_mean: self.mean.as_view(),
            running_var: self.var.as_view(),
            y: y.slice_mut(..),
            eps: self.eps,
        })?;
        if let (Some(z), false) = (shortcut, relu) {
            crate::util::add_assign(&self.ctx, y, z)?;
        }
        Ok(())
    }

    /// Whether the operands have the alignment the GEMM route's algorithm assumes.
    pub(super) fn gemm_aligned(
        &self,
        x: &CudaView<'_, T>,
        shortcut: Option<&CudaView<'_, T>>,
        y: &CudaViewMut<'_, T>,
    ) -> bool {
        let stream = self.ctx.stream();
        let ok = |p: u64| p % OPERAND_ALIGNMENT == 0;
        ok(x.device_ptr(stream).0)
            && ok(y.device_ptr(stream).0)
            && shortcut.is_none_or(|z| ok(z.device_ptr(stream).0))
    }

    /// A fused route (GEMM epilogue or cuDNN) into `y`.
    pub(super) fn run_fused(
        &self,
        route: BlockRoute,
        x: &CudaView<'_, T>,
        shortcut: Option<&CudaView<'_, T>>,
        relu: bool,
        y: &mut CudaViewMut<'_, T>,
    ) -> Result<()> {
        crate::util::zero_under_sanitizer(&self.ctx, y)?;
        match route {
            BlockRoute::GemmEpilogue => self.run_gemm(x, shortcut, relu, y, None),
            BlockRoute::CudnnFused => self.run_cudnn(x, shortcut, relu, y),
            BlockRoute::Unfused => self.run_unfused(x, shortcut, relu, y),
        }
    }

    /// The GEMM route's descriptors for `relu`, made on first use (a failure is kept).
    pub(super) fn gemm_for(
        &self,
        relu: bool,
        h: lt_sys::cublasLtHandle_t,
    ) -> Result<Arc<EpilogueGemm>> {
        let mut slots = lock(&self.gemm);
        let slot = &mut slots[relu as usize];
        if slot.is_none() {
            let g = self
                .plan
                .gemm
                .ok_or_else(|| Error::NotSupported("no GEMM geometry".into()))?;
            let bias = self.bias.device_ptr(self.ctx.stream()).0;
            *slot = Some(
                EpilogueGemm::new(h, &g, T::DTYPE, relu, bias)
                    .map(Arc::new)
                    .map_err(|e| e.to_string()),
            );
        }
        match slot {
            Some(Ok(g)) => Ok(g.clone()),
            Some(Err(why)) => Err(Error::NotSupported(why.clone())),
            None => Err(Error::NotSupported("GEMM descriptors missing".into())),
        }
    }

    /// The GEMM route with cuBLASLt candidate `algo` (None: the chosen one).
    pub(super) fn run_gemm(
        &self,
        x: &CudaView<'_, T>,
        shortcut: Option<&CudaView<'_, T>>,
        relu: bool,
        y: &mut CudaViewMut<'_, T>,
        algo: Option<usize>,
    ) -> Result<()> {
        let geometry = self.plan.gemm.ok_or_else(|| {
            Error::NotSupported(self.plan.info(BlockRoute::GemmEpilogue).reason.clone())
        })?;
        let stream = self.ctx.stream();
        let mut bufs = lock(&self.buffers);
        if !geometry.pointwise {
            ensure(
                &self.ctx,
                &mut bufs.columns,
                geometry.columns,
                "the im2col columns",
            )?;
            if let Some(cols) = bufs.columns.as_mut() {
                crate::conv::im2col::im2col(&self.ctx, &self.plan.shape, x, cols)?;
            }
        }
        let (xp, _gx) = x.device_ptr(stream);
        let b = match (&bufs.columns, geometry.pointwise) {
            (_, true) => xp,
            (Some(c), false) => c.device_ptr(stream).0,
            (None, false) => return Err(Error::NotSupported("im2col columns missing".into())),
        };
        let (yp, _gy) = y.device_ptr_mut(stream);
        let (zp, _gz) = match shortcut {
            Some(z) => {
                let (p, g) = z.device_ptr(stream);
                (Some(p), Some(g))
            }
            None => (None, None),
        };
        let a = self.w_folded.device_ptr(stream).0;
        let p = GemmPtrs {
            a,
            b,
            c: zp.unwrap_or(yp),
            d: yp,
        };
        if [p.a, p.b, p.c, p.d]
            .iter()
            .any(|v| v % OPERAND_ALIGNMENT != 0)
        {
            return Err(Error::NotSupported(format!(
                "an operand is not {OPERAND_ALIGNMENT}-byte aligned (the GEMM route's algorithm assumes it)"
            )));
        }
        let mut g = self.ctx.lock()?;
        let h = g.cublaslt()?;
        let gemm = self.gemm_for(relu, h)?;
        let ws = g.workspace(WORKSPACE_BYTES)?;
        let beta = if zp.is_some() { 1.0 } else { 0.0 };
        let cu = stream.cu_stream() as lt_sys::cudaStream_t;
        // SAFETY: operands validated (lengths, device, y disjoint from x and the shortcut),
        // aligned as checked; the filter, bias and columns are this object's and live; the
        // workspace holds WORKSPACE_BYTES while the guard lives.
        unsafe { gemm.run(algo, h, p, beta, ws, WORKSPACE_BYTES, cu) }
    }

    /// The cuDNN route's descriptors for `relu`, made on first use (a failure is kept).
    fn cudnn_for(&self, relu: bool) -> Result<Arc<CudnnFused>> {
        let mut slots = lock(&self.cudnn);
        let slot = &mut slots[relu as usize];
        if slot.is_none() {
            *slot = Some(
                CudnnFused::new(&self.plan.shape, T::DTYPE, relu)
                    .map(Arc::new)
                    .map_err(|e| e.to_string()),
            );
        }
        match slot {
            Some(Ok(c)) => Ok(c.clone()),
            Some(Err(why)) => Err(Error::NotSupported(why.clone())),
            None => Err(Error::NotSupported("cuDNN descriptors missing".into())),
        }
    }

    fn run_cudnn(
        &self,
        x: &CudaView<'_, T>,
        shortcut: Option<&CudaView<'_, T>>,
        relu: bool,
        y: &mut CudaViewMut<'_, T>,
    ) -> Result<()> {
        let fused = self.cudnn_for(relu)?;
        let stream = self.ctx.stream();
        let (xp, _gx) = x.device_ptr(stream);
        let (yp, _gy) = y.device_ptr_mut(stream);
        let (zp, _gz) = match shortcut {
            Some(z) => {
                let (p, g) = z.device_ptr(stream);
                (Some(p), Some(g))
            }
            None => (None, None),
        };
        let w = self.w_folded.device_ptr(stream).0;
        let bias = self.bias.device_ptr(stream).0;
        let mut g = self.ctx.lock()?;
        let h = g.cudnn()?;
        // SAFETY: live handle under the Context's lock.
        let bytes = unsafe { fused.workspace(h) }?;
        let ws = g.workspace(bytes)?;
        // SAFETY: operands validated (lengths, device, y disjoint from the inputs); the folded
        // filter and bias are this object's; the workspace holds `bytes` while the guard lives.
        unsafe { fused.run(h, xp, w, bias, zp, yp, ws, bytes) }
    }
}
