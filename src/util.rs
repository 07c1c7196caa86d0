//! Small device helpers built on `kernels/util.cu`: fill a buffer (tests poison outputs with
//! it before a run, so that an unwritten element shows), a scaled copy and an in-place add.

use cudarc::driver::{DevicePtr, DevicePtrMut, PushKernelArg};

use crate::context::Context;
use crate::dtype::{DType, Element};
use crate::error::{CallExt, Error, Result};
use crate::kernels;
use crate::validate::{Aliasing, Binder, Need};

pub(crate) use crate::launch::grid_stride_config;

fn name(base: &'static str, dt: DType) -> &'static str {
    match (base, dt) {
        ("fill", DType::F32) => "fill_f32",
        ("fill", DType::F16) => "fill_f16",
        ("fill", DType::BF16) => "fill_bf16",
        ("scale", DType::F32) => "scale_f32",
        ("scale", DType::F16) => "scale_f16",
        ("scale", DType::BF16) => "scale_bf16",
        ("add_assign", DType::F32) => "add_assign_f32",
        ("add_assign", DType::F16) => "add_assign_f16",
        ("add_assign", DType::BF16) => "add_assign_bf16",
        _ => "unknown",
    }
}

/// Under compute-sanitizer (`NNFUSE_UNDER_SANITIZER=1`) zeroes `out`, which a vendor library is
/// about to overwrite (initcheck does not see cuDNN's and cuBLASLt's stores on the H100; see
/// docs/RELIABILITY.md); nothing otherwise.
pub(crate) fn zero_under_sanitizer<T, D: DevicePtrMut<T>>(
    ctx: &Context,
    out: &mut D,
) -> Result<()> {
    if !crate::config::under_sanitizer() {
        return Ok(());
    }
    let stream = ctx.stream();
    let bytes = out
        .len()
        .checked_mul(std::mem::size_of::<T>())
        .ok_or_else(|| Error::invalid("out", "byte length overflows"))?;
    let (ptr, _guard) = out.device_ptr_mut(stream);
    // SAFETY: `out` is a live buffer of `bytes` bytes; the memset is ordered on the Context's
    // stream like the work that overwrites it.
    unsafe { cudarc::driver::result::memset_d8_async(ptr, 0, bytes, stream.cu_stream()) }
        .call("cuMemsetD8Async")
}

/// Sets every element of `out` to `value`. `out` must live on the Context's device (else an
/// [`Error::InvalidArgument`] naming `out`, and nothing is launched).
pub fn fill<T: Element, D: DevicePtrMut<T>>(ctx: &Context, out: &mut D, value: T) -> Result<()> {
    let n = out.len();
    let mut ops = Binder::new(ctx);
    let ptr = ops.output("out", out, Need::Exactly(n, "its length"))?;
    if n == 0 {
        return Ok(());
    }
    let f = ctx.function(&kernels::UTIL, name("fill", T::DTYPE))?;
    let cfg = grid_stride_config(ctx, n, 256);
    let n64 = n as u64;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(&ptr).arg(&value).arg(&n64);
    // SAFETY: fill_<t>(T* out, T v, u64 n) matches the arguments; `ptr` holds n elements on the
    // Context's device (checked above).
    unsafe { b.launch(cfg) }.call("cuLaunchKernel(fill)")?;
    Ok(())
}

/// Sets every word of a `u32` buffer (bitmasks) to `value`. `out` must live on the Context's
/// device.
pub fn fill_u32<D: DevicePtrMut<u32>>(ctx: &Context, out: &mut D, value: u32) -> Result<()> {
    let n = out.len();
    let mut ops = Binder::new(ctx);
    let ptr = ops.output("out", out, Need::Exactly(n, "its length"))?;
    if n == 0 {
        return Ok(());
    }
    let f = ctx.function(&kernels::UTIL, "fill_u32")?;
    let cfg = grid_stride_config(ctx, n, 256);
    let n64 = n as u64;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(&ptr).arg(&value).arg(&n64);
    // SAFETY: fill_u32(u32* out, u32 v, u64 n) matches; `ptr` holds n words on the Context's
    // device (checked above).
    unsafe { b.launch(cfg) }.call("cuLaunchKernel(fill_u32)")?;
    Ok(())
}

/// `y = alpha * x`, elementwise, computed in f32. `x` and `y` must have the same length and
/// live on the Context's device.
pub fn scale<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(
    ctx: &Context,
    x: &S,
    y: &mut D,
    alpha: f32,
) -> Result<()> {
    if x.len() != y.len() {
        return Err(Error::invalid(
            "y",
            format!("length {} differs from x's length {}", y.len(), x.len()),
        ));
    }
    let n = x.len();
    let mut ops = Binder::new(ctx);
    let xp = ops.input("x", x, Need::Exactly(n, "x's length"))?;
    let yp = ops.output("y", y, Need::Exactly(n, "x's length"))?;
    if n == 0 {
        return Ok(());
    }
    let f = ctx.function(&kernels::UTIL, name("scale", T::DTYPE))?;
    let cfg = grid_stride_config(ctx, n, 256);
    let n64 = n as u64;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(&xp).arg(&yp).arg(&alpha).arg(&n64);
    // SAFETY: scale_<t>(const T*, T*, float, u64) matches; both hold n elements on the
    // Context's device (checked above).
    unsafe { b.launch(cfg) }.call("cuLaunchKernel(scale)")?;
    Ok(())
}

/// `y += x`, elementwise: the sum in f32, rounded once to the element type (e.g. the two
/// gradients that reach a residual block's input). `x` and `y` must have the same length, live
/// on the Context's device and not overlap; otherwise an [`Error::InvalidArgument`] naming the
/// argument, and nothing is launched.
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let ctx = nnfuse::Context::new(0)?;
/// let s = ctx.stream();
/// let x = s.clone_htod(&[1.0f32, 2.0, 3.0])?;
/// let mut y = s.clone_htod(&[0.5f32, 0.5, 0.5])?;
/// nnfuse::internals::util::add_assign(&ctx, &mut y, &x)?; // y = [1.5, 2.5, 3.5]
/// # Ok(()) }
/// ```
pub fn add_assign<T: Element, D: DevicePtrMut<T>, S: DevicePtr<T>>(
    ctx: &Context,
    y: &mut D,
    x: &S,
) -> Result<()> {
    crate::profile::stage!(Call);
    let yl = y.len();
    let mut ops = Binder::new(ctx);
    let xp = ops.input("x", x, Need::Exactly(yl, "y's length"))?;
    let yp = ops.output("y", y, Need::Exactly(yl, "y's length"))?;
    ops.check(Aliasing::Distinct)?;
    if yl == 0 {
        return Ok(());
    }
    let stream = ctx.stream();
    let f = ctx.function(&kernels::UTIL, name("add_assign", T::DTYPE))?;
    let cfg = grid_stride_config(ctx, yl, 256);
    let n64 = yl as u64;
    crate::profile::stage!(Launch);
    let mut b = stream.launch_builder(&f);
    b.arg(&yp).arg(&xp).arg(&n64);
    // SAFETY: add_assign_<t>(T* y, const T* x, u64 n) matches; both hold n elements and do not
    // overlap (checked above).
    unsafe { b.launch(cfg) }.call("cuLaunchKernel(add_assign)")?;
    Ok(())
}

/// `out[i] = 1 / sqrt(var[i] + eps)` for `n` f32 values (the inverse standard deviation of a
/// BatchNorm inference through cuDNN's graph API, from the running variance).
///
/// # Safety
/// `var` and `out` hold `n` f32 values on the Context's device, `out` overlapping nothing the
/// queued work reads, both valid until it completes.
pub(crate) unsafe fn inv_std_raw(
    ctx: &Context,
    var: u64,
    out: u64,
    eps: f32,
    n: usize,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let f = ctx.function(&kernels::UTIL, "inv_std_f32")?;
    let cfg = grid_stride_config(ctx, n, 256);
    let n64 = n as u64;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(&var).arg(&out).arg(&eps).arg(&n64);
    // SAFETY: inv_std_f32(const float*, float*, float, u64) matches; the caller's contract for
    // the addresses.
    unsafe { b.launch(cfg) }.call("cuLaunchKernel(inv_std_f32)")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{f64s, gpu, Rng};
    use half::{bf16, f16};

    fn add_case<T: Element>(ctx: &Context, n: usize, rng: &mut Rng) {
        let s = ctx.stream();
        let x: Vec<T> = rng.vec(n, -4.0, 4.0);
        let y0: Vec<T> = rng.vec(n, -4.0, 4.0);
        let xd = s.clone_htod(&x).unwrap();
        let mut yd = s.clone_htod(&y0).unwrap();
        add_assign(ctx, &mut yd, &xd).unwrap();
        let got = f64s(&s.clone_dtoh(&yd).unwrap());
        // The kernel rounds the sum to f32, then to T: the same two IEEE roundings on the CPU
        // must agree bit for bit.
        for i in 0..n {
            let sum = (y0[i].to_f64() as f32 + x[i].to_f64() as f32) as f64;
            let want = T::from_f64(sum).to_f64();
            assert_eq!(got[i], want, "{} n={n} element {i}", T::DTYPE);
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn add_assign_matches_the_rounded_f32_sum() {
        let ctx = gpu();
        let mut rng = Rng::fresh("add_assign");
        for n in [1, 33, 4097, 1 << 20] {
            add_case::<f32>(&ctx, n, &mut rng);
            add_case::<f16>(&ctx, n, &mut rng);
            add_case::<bf16>(&ctx, n, &mut rng);
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn add_assign_rejects_a_length_mismatch_and_leaves_y() {
        let ctx = gpu();
        let s = ctx.stream();
        let x = s.clone_htod(&[1.0f32; 4]).unwrap();
        let mut y = s.clone_htod(&[2.0f32; 5]).unwrap();
        let e = add_assign(&ctx, &mut y, &x).unwrap_err();
        assert_eq!(e.argument(), Some("x"), "{e}");
        assert_eq!(s.clone_dtoh(&y).unwrap(), vec![2.0f32; 5]);
    }
}
