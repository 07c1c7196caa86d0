//! The `cudnn_dual` path's run function: a stride-1 forward convolution as the data gradient of
//! its dual problem (`problem::dual`: dy = x, the filter rotated by 180 degrees with its channel
//! axes swapped, dx = y), through cuDNN's graph API. The dual filter is written into the
//! Context's scratch (`kernels/conv_dual.cu`) at every call, so a filter that changes between
//! steps is always current; the data gradient runs the first engine config the graph policy
//! admits for the dual problem, through the Context's plan cache.

use cudarc::driver::DeviceRepr;

use super::call::PathCall;
use super::cudnn_graph_run::execute_derived;
use super::plan::Direction;
use super::problem::{dual_shape, ConvShape};
use crate::context::Context;
use crate::error::{Error, Result};
use crate::kernels;
use crate::launch;
use crate::layout::TensorFormat;

/// `struct DualFilterArgs` of `kernels/conv_dual.cu`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct DualFilterArgs {
    w: u64,
    out: u64,
    n: u64,
    k: u32,
    c: u32,
    kh: u32,
    kw: u32,
    nhwc: u32,
    pad: u32,
}

// SAFETY: plain-old-data, laid out as the kernel's struct (`#[repr(C)]`, checked in the tests).
unsafe impl DeviceRepr for DualFilterArgs {}

/// Threads per block of the filter kernel.
const THREADS: u32 = 256;

/// Bytes of the dual filter (f32): the scratch the path takes.
pub(crate) fn dual_filter_bytes(s: &ConvShape) -> usize {
    s.c_out * s.c_in * s.kh * s.kw * std::mem::size_of::<f32>()
}

/// Queues the dual filter of `s`'s filter `w` into `out`.
///
/// # Safety
/// `w` and `out` hold `c_out*c_in*kh*kw` f32 on the Context's device, disjoint.
unsafe fn dual_filter(ctx: &Context, s: &ConvShape, w: u64, out: u64) -> Result<()> {
    let dim = launch::u32_arg;
    let n = s.c_out * s.c_in * s.kh * s.kw;
    let args = DualFilterArgs {
        w,
        out,
        n: n as u64,
        k: dim(s.c_out, "c_out")?,
        c: dim(s.c_in, "c_in")?,
        kh: dim(s.kh, "kh")?,
        kw: dim(s.kw, "kw")?,
        nhwc: u32::from(s.format == TensorFormat::Nhwc),
        pad: 0,
    };
    let f = ctx.function(&kernels::CONV_DUAL, "conv_dual_filter_f32")?;
    let cfg = launch::grid_stride_config(ctx, n, THREADS);
    // SAFETY: the kernel takes one DualFilterArgs; the caller guarantees the extents.
    unsafe {
        launch::launch_kernel(
            ctx,
            &f,
            cfg,
            &mut [launch::arg(&args)],
            "cuLaunchKernel(conv_dual_filter)",
        )
    }
}

/// Runs a `cudnn_dual` route (registered in `paths.rs`; the plan admits it for stride-1 f32
/// forwards only, `problem::dual_refusal`).
///
/// # Safety
/// As [`super::route::run`].
pub(crate) unsafe fn raw_run(c: &PathCall<'_>) -> Result<()> {
    let t = c.target;
    if c.direction != Direction::Forward {
        return Err(Error::NotSupported(format!(
            "cudnn_dual computes the forward only, not the {}",
            c.direction.describe()
        )));
    }
    let dual = dual_shape(t.shape, t.shape.out_hw()?);
    let p = c.fwd();
    let scratch = t.ctx.scratch(dual_filter_bytes(t.shape))?;
    let wd = scratch.ptr();
    // SAFETY: the caller's contract for w; the scratch holds the dual filter's bytes.
    unsafe { dual_filter(t.ctx, t.shape, p.w, wd)? };
    // The dual problem's data gradient: dx = y, its filter the dual one, dy = x.
    // SAFETY: the dual problem's extents are the forward's (x is its dy, y its dx, the dual
    // filter as many elements as w), checked by the caller. The scratch guard is held until the
    // execution is queued.
    let r = unsafe {
        execute_derived(
            t.ctx,
            (&dual, t.dtype),
            Direction::BackwardData,
            None,
            [p.y, wd, p.x],
            false,
        )
    };
    drop(scratch);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argument_struct_matches_the_kernel() {
        // u64 w, out, n; u32 k, c, kh, kw, nhwc, pad.
        assert_eq!(std::mem::size_of::<DualFilterArgs>(), 48);
    }
}
