//! The `cudnn_tiled` path's run function: a stride-1 f32 filter gradient over 2x2 spatial tiles
//! stacked as the batch (`problem::tiled`), through cuDNN's graph API. x's windows and dy's
//! quarters are written into the Context's scratch (`kernels/conv_tiled.cu`) at every call; the
//! tiled problem's filter gradient, which is the original's, runs the first engine config the
//! graph policy admits for it, through the Context's plan cache, and writes (or adds into) dw.

use cudarc::driver::{DeviceRepr, LaunchConfig};

use super::call::{Exec, PathCall, Target};
use super::cudnn_graph_run::{self, execute_derived};
use super::plan::{Direction, Route};
use super::problem::{
    quarter, tiled_bytes, tiled_refusal, tiled_shape, tiled_x_bytes, ConvShape,
};
use crate::context::Context;
use crate::error::{Error, Result};
use crate::kernels;
use crate::launch;
use crate::layout::TensorFormat;
use crate::tune::budget::Budget;

/// `struct TileArgs` of `kernels/conv_tiled.cu`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct TileArgs {
    src: u64,
    out: u64,
    planes: u64,
    ch: u32,
    sh: u32,
    sw: u32,
    th: u32,
    tw: u32,
    qh: u32,
    qw: u32,
    ph: i32,
    pw: i32,
    nhwc: u32,
    plane: u32,
}

// SAFETY: plain-old-data, laid out as the kernel's struct (`#[repr(C)]`, checked in the tests).
unsafe impl DeviceRepr for TileArgs {}

/// Threads per block of the tiling kernel.
const THREADS: u32 = 256;
/// Elements per thread and pass of the tiling kernel (`PER`).
const PER: usize = 4;
/// Most blocks along y (the kernel strides over more planes).
const MAX_GRID_Y: usize = 65_535;

/// Queues one tiled tensor: `src` (`ch` channels of `sh x sw`) cut into 4n tiles of `th x tw`
/// at a stride of the quarter `(qh, qw)`, shifted by the padding `pad`, into `out`.
///
/// # Safety
/// `src` holds `n * ch * sh * sw` f32 and `out` `4n * ch * th * tw` f32 on the Context's
/// device, disjoint.
#[allow(clippy::too_many_arguments)]
unsafe fn tile(
    ctx: &Context,
    s: &ConvShape,
    (src, out): (u64, u64),
    ch: usize,
    (sh, sw): (usize, usize),
    (th, tw): (usize, usize),
    (qh, qw): (usize, usize),
    pad: (usize, usize),
) -> Result<()> {
    let nhwc = s.format == TensorFormat::Nhwc;
    // A plane: one channel of a tile (NCHW) or one row of a tile (NHWC).
    let (planes, plane) = if nhwc {
        (4 * s.n * th, tw * ch)
    } else {
        (4 * s.n * ch, th * tw)
    };
    let plane32 = u32::try_from(plane)
        .ok()
        .filter(|&p| p <= i32::MAX as u32)
        .ok_or_else(|| Error::NotSupported(format!("a tile plane of {plane} elements")))?;
    let args = TileArgs {
        src,
        out,
        planes: planes as u64,
        ch: launch::u32_arg(ch, "channels")?,
        sh: launch::u32_arg(sh, "h")?,
        sw: launch::u32_arg(sw, "w")?,
        th: launch::u32_arg(th, "tile h")?,
        tw: launch::u32_arg(tw, "tile w")?,
        qh: launch::u32_arg(qh, "quarter h")?,
        qw: launch::u32_arg(qw, "quarter w")?,
        ph: i32::try_from(pad.0).map_err(|_| Error::invalid("pad", "over i32::MAX"))?,
        pw: i32::try_from(pad.1).map_err(|_| Error::invalid("pad", "over i32::MAX"))?,
        nhwc: u32::from(nhwc),
        plane: plane32,
    };
    let f = ctx.function(&kernels::CONV_TILED, "conv_tile_f32")?;
    let cfg = LaunchConfig {
        grid_dim: (
            plane.div_ceil(THREADS as usize * PER).clamp(1, 1 << 16) as u32,
            planes.clamp(1, MAX_GRID_Y) as u32,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the kernel takes one TileArgs; the caller guarantees the extents.
    unsafe {
        launch::launch_kernel(
            ctx,
            &f,
            cfg,
            &mut [launch::arg(&args)],
            "cuLaunchKernel(conv_tile)",
        )
    }
}

/// The tiled routes of `t`'s filter gradient: one per engine config the graph API admits for
/// the tiled problem (each plan finalized and cached now, within `budget`), the route naming
/// its config — cuDNN offers other engines for the smaller images (H100, 3x3 64@56 f32: an FFT
/// config at 165 µs that the original problem's list lacks). Empty when the problem is not
/// tiled or no config finalizes (the route then runs the first admitted one). Notes on the
/// configs passed over go to `notes`.
pub(super) fn engine_execs(t: &Target<'_>, budget: &Budget, notes: &mut Vec<String>) -> Vec<Exec> {
    let Ok(out_hw) = t.shape.out_hw() else {
        return Vec::new();
    };
    if tiled_refusal(t.shape, t.dtype, out_hw).is_some() {
        return Vec::new();
    }
    let tiled = tiled_shape(t.shape, out_hw);
    let tiled_target = Target {
        ctx: t.ctx,
        shape: &tiled,
        dtype: t.dtype,
        cudnn: None,
        graph_plans: None,
    };
    let mut own = Vec::new();
    let execs =
        cudnn_graph_run::engine_execs(&tiled_target, Direction::BackwardFilter, budget, &mut own);
    notes.extend(own.into_iter().map(|n| {
        format!("cudnn_tiled (the tiled problem's configs): {}", n.trim_start_matches("cudnn_graph: "))
    }));
    execs
        .into_iter()
        .map(|e| Exec {
            route: Route {
                graph_engine: e.route.graph_engine,
                ..Route::path(super::plan::ConvPath::CudnnTiled)
            },
            ..e
        })
        .collect()
}

/// Runs a `cudnn_tiled` route (registered in `paths.rs`; the plan admits it for f32 stride-1
/// filter gradients only, `problem::tiled_refusal`).
///
/// # Safety
/// As [`super::route::run`].
pub(crate) unsafe fn raw_run(c: &PathCall<'_>) -> Result<()> {
    let t = c.target;
    if c.direction != Direction::BackwardFilter {
        return Err(c.no_direction("cudnn_tiled"));
    }
    let s = t.shape;
    let out_hw = s.out_hw()?;
    if let Some(why) = tiled_refusal(s, t.dtype, out_hw) {
        return Err(Error::NotSupported(why));
    }
    let tiled = tiled_shape(s, out_hw);
    let q = quarter(out_hw);
    let p = c.bwd_filter();
    let scratch = t.ctx.scratch(tiled_bytes(s, out_hw))?;
    let xt = scratch.ptr();
    let dyt = xt + tiled_x_bytes(s, out_hw) as u64;
    // SAFETY: the caller's contract for x and dy; the scratch holds both tiled tensors
    // (`tiled_bytes`), x's windows first.
    unsafe {
        tile(
            t.ctx,
            s,
            (p.x, xt),
            s.c_in,
            (s.h, s.w),
            (tiled.h, tiled.w),
            q,
            s.pad,
        )?;
        tile(t.ctx, s, (p.dy, dyt), s.c_out, out_hw, q, q, (0, 0))?;
    }
    // The tiled problem's filter gradient: x its windows, dy its quarters, dw the original's.
    // SAFETY: the tiled problem's dw is the original's (same extents), x and dy its tiled
    // tensors in the scratch, which is held until the execution is queued.
    let r = unsafe {
        execute_derived(
            t.ctx,
            (&tiled, t.dtype),
            Direction::BackwardFilter,
            c.exec.route.graph_engine,
            [xt, p.dw, dyt],
            c.accumulate,
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
        // u64 src, out, planes; u32 ch, sh, sw, th, tw, qh, qw; i32 ph, pw; u32 nhwc, plane.
        assert_eq!(std::mem::size_of::<TileArgs>(), 72);
    }
}
