//! Launchers of the search's kernels (`kernels/gemm_search.cu`): the pseudo-random fill, the
//! comparison of a candidate's result with the reference, and the statistics of the default's
//! result.

use cudarc::driver::{CudaFunction, DevicePtrMut, PushKernelArg};

use crate::context::Context;
use crate::dtype::{DType, Element};
use crate::error::{CallExt, Result};
use crate::gemm::problem::Problem;
use crate::util::grid_stride_config;
use crate::validate::{Binder, Need};

/// The search's kernels (`kernels/gemm_search.cu`), NVRTC-compiled at first use.
pub use crate::kernels::GEMM_SEARCH as KERNELS;

pub(crate) fn uniform_kernel(dt: DType) -> &'static str {
    match dt {
        DType::F32 => "gemm_uniform_f32",
        DType::F16 => "gemm_uniform_f16",
        DType::BF16 => "gemm_uniform_bf16",
    }
}

pub(crate) fn stats_kernel(dt: DType) -> &'static str {
    match dt {
        DType::F32 => "gemm_stats_f32",
        DType::F16 => "gemm_stats_f16",
        DType::BF16 => "gemm_stats_bf16",
    }
}

pub(crate) fn diff_kernel(dt: DType) -> &'static str {
    match dt {
        DType::F32 => "gemm_diff_f32",
        DType::F16 => "gemm_diff_f16",
        DType::BF16 => "gemm_diff_bf16",
    }
}

/// Fills `n` elements at device pointer `ptr` with the uniform pattern of `seed`.
pub(crate) fn uniform_raw(
    ctx: &Context,
    f: &CudaFunction,
    ptr: u64,
    n: usize,
    seed: u64,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let cfg = grid_stride_config(ctx, n, 256);
    let n64 = n as u64;
    let mut b = ctx.stream().launch_builder(f);
    b.arg(&ptr).arg(&n64).arg(&seed);
    // SAFETY: gemm_uniform_<t>(T*, u64, u64) matches; `ptr` holds n elements of the type.
    unsafe { b.launch(cfg) }.call("cuLaunchKernel(gemm_uniform)")?;
    Ok(())
}

/// Fills a buffer with deterministic pseudo-random values uniform in [-1, 1) (a function of the
/// index and `seed`). `out` must live on the Context's device (else an
/// [`crate::Error::InvalidArgument`] naming `out`, and nothing is launched).
pub fn fill_uniform<T: Element, D: DevicePtrMut<T>>(
    ctx: &Context,
    out: &mut D,
    seed: u64,
) -> Result<()> {
    let n = out.len();
    let mut ops = Binder::new(ctx);
    let ptr = ops.output("out", out, Need::Exactly(n, "its length"))?;
    let f = ctx.function(&KERNELS, uniform_kernel(T::DTYPE))?;
    uniform_raw(ctx, &f, ptr, n, seed)
}

/// Queues the comparison of `n` elements at `got` with `want`: adds (sum of squared
/// differences, sum of squares of `want`, non-finite mismatches) to the three doubles at `acc`.
pub(crate) fn queue_compare(
    ctx: &Context,
    f: &CudaFunction,
    got: u64,
    want: u64,
    n: usize,
    acc: u64,
) -> Result<()> {
    let cfg = grid_stride_config(ctx, n, 256);
    let n64 = n as u64;
    let mut b = ctx.stream().launch_builder(f);
    b.arg(&got).arg(&want).arg(&n64).arg(&acc);
    // SAFETY: gemm_diff_<t>(const T*, const T*, u64, double*) matches; both inputs hold n
    // elements; acc holds 3 doubles; block size 256 as the kernel requires.
    unsafe { b.launch(cfg) }.call("cuLaunchKernel(gemm_diff)")?;
    Ok(())
}

/// Queues the statistics ([`super::caller_data::ResultStats`]) of the GEMM result at `r` over `p`'s C matrices:
/// adds them to the four doubles at `acc`. `old_c` (0: none) is the old C that `beta` scaled.
pub(crate) fn queue_stats(
    ctx: &Context,
    f: &CudaFunction,
    p: &Problem,
    r: u64,
    old_c: u64,
    beta: f32,
    acc: u64,
) -> Result<()> {
    let cols = p.batch * p.n;
    // One block per column, capped (grid-stride over columns).
    let cfg = grid_stride_config(ctx, cols.saturating_mul(256), 256);
    let (m, n, ld, stride, batch) = (
        p.m as u64,
        p.n as u64,
        p.ldc as u64,
        p.stride_c as u64,
        p.batch as u64,
    );
    let mut b = ctx.stream().launch_builder(f);
    b.arg(&r)
        .arg(&old_c)
        .arg(&beta)
        .arg(&m)
        .arg(&n)
        .arg(&ld)
        .arg(&stride)
        .arg(&batch)
        .arg(&acc);
    // SAFETY: gemm_stats_<t>(const T*, const T*, float, u64 x5, double*) matches; `r` (and
    // `old_c` when not 0) hold C's span of the checked problem, whose matrix elements are all
    // the kernel reads; acc holds 4 doubles; block size 256 as the kernel requires.
    unsafe { b.launch(cfg) }.call("cuLaunchKernel(gemm_stats)")?;
    Ok(())
}
