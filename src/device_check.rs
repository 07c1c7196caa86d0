//! Comparing a result with a reference on the device (`kernels/conv_check.cu`): the reference
//! widened to f32 once, then per candidate Σ(got − want)², Σwant² and the count of non-finite
//! positions, summed in f64 into three doubles per slot and read back together. A first call's
//! check then copies a few doubles to the host instead of whole tensors (a conv+stats check of
//! a 25.7 M-element output read back and compared on the host took about 0.4 s per candidate).

use cudarc::driver::{CudaSlice, DevicePtr, PushKernelArg};

use crate::context::Context;
use crate::dtype::DType;
use crate::error::{CallExt, Result};
use crate::kernels;
use crate::tune::rule::judge;

/// The comparison kernel for a candidate of type `d` against the f32 reference.
pub(crate) const fn diff_kernel(d: DType) -> &'static str {
    match d {
        DType::F32 => "conv_check_diff_f32",
        DType::F16 => "conv_check_diff_f16",
        DType::BF16 => "conv_check_diff_bf16",
    }
}

/// The kernel that widens a result of type `d` to f32.
pub(crate) const fn widen_kernel(d: DType) -> &'static str {
    match d {
        DType::F32 => "conv_check_widen_f32",
        DType::F16 => "conv_check_widen_f16",
        DType::BF16 => "conv_check_widen_bf16",
    }
}

/// Launches `name(a, b, n, c)`-style kernels of `conv_check.cu` on raw addresses.
pub(crate) fn launch3(
    ctx: &Context,
    name: &'static str,
    a: u64,
    b: u64,
    n: usize,
    c: Option<u64>,
) -> Result<()> {
    let f = ctx.function(&kernels::CONV_CHECK, name)?;
    let cfg = crate::util::grid_stride_config(ctx, n, 256);
    let stream = ctx.stream();
    let n64 = n as u64;
    let mut l = stream.launch_builder(&f);
    l.arg(&a).arg(&b).arg(&n64);
    if let Some(c) = &c {
        l.arg(c);
    }
    // SAFETY: the conv_check kernels take (in, in-or-out, u64 n[, double* acc]) with n elements
    // behind each pointer; the callers pass buffers of those extents.
    unsafe { l.launch(cfg) }.call("cuLaunchKernel(conv_check)")?;
    Ok(())
}

/// Adds the non-finite count, the nonzero count and Σr² of the f32 buffer `r` (n elements) to
/// the three doubles at `acc`.
pub(crate) fn stats(ctx: &Context, r: u64, n: usize, acc: u64) -> Result<()> {
    let f = ctx.function(&kernels::CONV_CHECK, "conv_check_stats")?;
    let cfg = crate::util::grid_stride_config(ctx, n, 256);
    let n64 = n as u64;
    let mut l = ctx.stream().launch_builder(&f);
    l.arg(&r).arg(&n64).arg(&acc);
    // SAFETY: conv_check_stats(const float*, u64, double*): n floats, 3 doubles.
    unsafe { l.launch(cfg) }.call("cuLaunchKernel(conv_check_stats)")?;
    Ok(())
}

/// Copies the accumulators to the host (synchronises the stream).
pub(crate) fn read_acc(ctx: &Context, acc: &CudaSlice<f64>) -> Result<Vec<f64>> {
    ctx.stream().clone_dtoh(acc).call("cuMemcpyDtoH")
}

/// A reference of `n` elements of one type, widened to f32 on the device once, against which
/// candidates are compared one at a time (three doubles read back per candidate).
pub(crate) struct DeviceCompare {
    ctx: Context,
    dtype: DType,
    n: usize,
    reference: CudaSlice<f32>,
    acc: CudaSlice<f64>,
    reference_nonfinite: f64,
}

impl DeviceCompare {
    /// Widens the reference at `reference` (`n` elements of `dtype`) and counts its non-finite
    /// elements (synchronises).
    ///
    /// # Safety
    /// `reference` must address `n` elements of `dtype` on `ctx`'s device, written (or queued to
    /// be) on `ctx`'s stream.
    pub(crate) unsafe fn new(
        ctx: &Context,
        dtype: DType,
        reference: u64,
        n: usize,
    ) -> Result<DeviceCompare> {
        let s = ctx.stream();
        // SAFETY: widened into below before any read.
        let buf = unsafe { s.alloc::<f32>(n.max(1)) }.call("cuMemAllocAsync")?;
        let acc = s.alloc_zeros::<f64>(3).call("cuMemAllocAsync")?;
        let refp = buf.device_ptr(s).0;
        launch3(ctx, widen_kernel(dtype), reference, refp, n, None)?;
        stats(ctx, refp, n, acc.device_ptr(s).0)?;
        let reference_nonfinite = read_acc(ctx, &acc)?.first().copied().unwrap_or(f64::NAN);
        Ok(DeviceCompare {
            ctx: ctx.clone(),
            dtype,
            n,
            reference: buf,
            acc,
            reference_nonfinite,
        })
    }

    /// The reference's non-finite elements (a candidate cannot be judged against those).
    pub(crate) fn reference_nonfinite(&self) -> f64 {
        self.reference_nonfinite
    }

    /// Compares the candidate at `got` with the reference: `(relative L2, non-finite
    /// positions)` as [`judge`] gives them (synchronises).
    ///
    /// # Safety
    /// `got` must address `n` elements of the reference's type on the Context's device, written
    /// (or queued to be) on the Context's stream.
    pub(crate) unsafe fn check(&mut self, got: u64) -> Result<(f64, f64)> {
        let s = self.ctx.stream();
        s.memset_zeros(&mut self.acc).call("cuMemsetD8Async")?;
        let acc = self.acc.device_ptr(s).0;
        let refp = self.reference.device_ptr(s).0;
        launch3(
            &self.ctx,
            diff_kernel(self.dtype),
            got,
            refp,
            self.n,
            Some(acc),
        )?;
        Ok(judge(&read_acc(&self.ctx, &self.acc)?))
    }
}

/// `got` against `want` (the same extent of one element type, on the Context's stream): the
/// relative L2 difference and the non-finite positions, compared on the device. An error where
/// the extents differ, or where `want` itself holds non-finite elements (no reference to judge
/// against: `reference` names it in the message).
pub(crate) fn compare_on_device<T, W, G>(
    ctx: &Context,
    want: &W,
    got: &G,
    reference: &str,
) -> Result<(f64, f64)>
where
    T: crate::dtype::Element,
    W: DevicePtr<T>,
    G: DevicePtr<T>,
{
    let s = ctx.stream();
    if want.len() != got.len() {
        return Err(crate::error::Error::invalid(
            "got",
            "extent differs from the reference",
        ));
    }
    let wp = want.device_ptr(s).0;
    let gp = got.device_ptr(s).0;
    // SAFETY: both hold `len` elements of T on the Context's device (device slices of T),
    // written on its stream.
    let mut cmp = unsafe { DeviceCompare::new(ctx, T::DTYPE, wp, want.len()) }?;
    let bad_ref = cmp.reference_nonfinite();
    if bad_ref != 0.0 {
        return Err(crate::error::Error::NotSupported(format!(
            "{reference} has {bad_ref} non-finite elements on this call's data: no reference to \
             check against"
        )));
    }
    // SAFETY: as above.
    unsafe { cmp.check(gp) }
}
