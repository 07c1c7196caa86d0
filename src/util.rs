//! Small device helpers built on `kernels/util.cu`: fill a buffer (tests poison outputs with
//! it before a run, so that an unwritten element shows) and a scaled copy.

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use crate::context::Context;
use crate::dtype::{DType, Element};
use crate::error::{CallExt, Error, Result};
use crate::kernels;

/// A grid-stride launch over `n` items: 256 threads a block, at most 32 blocks per SM.
pub(crate) fn grid_stride_config(ctx: &Context, n: usize, threads: u32) -> LaunchConfig {
    let blocks_needed = n.div_ceil(threads as usize).max(1);
    let cap = (ctx.info().sm_count.max(1) as usize) * 32;
    LaunchConfig {
        grid_dim: (blocks_needed.min(cap) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn name(base: &'static str, dt: DType) -> &'static str {
    match (base, dt) {
        ("fill", DType::F32) => "fill_f32",
        ("fill", DType::F16) => "fill_f16",
        ("fill", DType::BF16) => "fill_bf16",
        ("scale", DType::F32) => "scale_f32",
        ("scale", DType::F16) => "scale_f16",
        ("scale", DType::BF16) => "scale_bf16",
        _ => "unknown",
    }
}

/// Sets every element of `out` to `value`.
pub fn fill<T: Element, D: DevicePtrMut<T>>(ctx: &Context, out: &mut D, value: T) -> Result<()> {
    let n = out.len();
    if n == 0 {
        return Ok(());
    }
    let f = ctx.function(&kernels::UTIL, name("fill", T::DTYPE))?;
    let cfg = grid_stride_config(ctx, n, 256);
    let stream = ctx.stream();
    let (ptr, _sync) = out.device_ptr_mut(stream);
    let n64 = n as u64;
    let mut b = stream.launch_builder(&f);
    b.arg(&ptr).arg(&value).arg(&n64);
    // SAFETY: fill_<t>(T* out, T v, u64 n) matches the arguments; `ptr` holds n elements.
    unsafe { b.launch(cfg) }.call("cuLaunchKernel(fill)")?;
    Ok(())
}

/// Sets every word of a `u32` buffer (bitmasks) to `value`.
pub fn fill_u32<D: DevicePtrMut<u32>>(ctx: &Context, out: &mut D, value: u32) -> Result<()> {
    let n = out.len();
    if n == 0 {
        return Ok(());
    }
    let f = ctx.function(&kernels::UTIL, "fill_u32")?;
    let cfg = grid_stride_config(ctx, n, 256);
    let stream = ctx.stream();
    let (ptr, _sync) = out.device_ptr_mut(stream);
    let n64 = n as u64;
    let mut b = stream.launch_builder(&f);
    b.arg(&ptr).arg(&value).arg(&n64);
    // SAFETY: fill_u32(u32* out, u32 v, u64 n) matches; `ptr` holds n words.
    unsafe { b.launch(cfg) }.call("cuLaunchKernel(fill_u32)")?;
    Ok(())
}

/// `y = alpha * x`, elementwise, computed in f32.
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
    if n == 0 {
        return Ok(());
    }
    let f = ctx.function(&kernels::UTIL, name("scale", T::DTYPE))?;
    let cfg = grid_stride_config(ctx, n, 256);
    let stream = ctx.stream();
    let (xp, _sx) = x.device_ptr(stream);
    let (yp, _sy) = y.device_ptr_mut(stream);
    let n64 = n as u64;
    let mut b = stream.launch_builder(&f);
    b.arg(&xp).arg(&yp).arg(&alpha).arg(&n64);
    // SAFETY: scale_<t>(const T*, T*, float, u64) matches; both hold n elements.
    unsafe { b.launch(cfg) }.call("cuLaunchKernel(scale)")?;
    Ok(())
}
