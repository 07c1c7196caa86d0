//! The `direct_filter` path's run function: nnfuse's filter-gradient kernel
//! (`kernels/conv_wgrad.cu`) for f32 3x3 stride-1 problems. The first kernel writes one partial
//! filter gradient per range of output rows into the Context's scratch; the second adds them in
//! order into dw (overwriting it, or adding to it for an accumulating call). Sizes and refusals
//! are `problem::direct_filter`'s, which the plan's rule applies too.

use cudarc::driver::{DeviceRepr, LaunchConfig};

use super::call::PathCall;
use super::plan::Direction;
use super::problem::{
    direct_filter_refusal, filter_grad_grid, ConvShape, FilterGradGrid, CT, KT, SEG,
};
use crate::error::{Error, Result};
use crate::kernels;
use crate::launch;
use crate::layout::TensorFormat;

/// Threads per block of both kernels.
const THREADS: u32 = 256;
/// Dynamic shared memory of the main kernel: two stages (`STAGE` in the kernel) of dy's
/// `KT x (SEG + 4)` and x's `CT x 3 x (SEG + 3)` f32 values, so that one unit's copies land
/// while the previous one is computed.
const SMEM_BYTES: u32 = (2 * (KT * (SEG + 4) + CT * 3 * (SEG + 3)) * 4) as u32;

/// `struct WgradGeom` of `kernels/conv_wgrad.cu`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct WgradGeom {
    n: u32,
    c: u32,
    h: u32,
    w: u32,
    k: u32,
    oh: u32,
    ow: u32,
    ph: i32,
    pw: i32,
    segs: u32,
    units: u32,
    splits: u32,
}

// SAFETY: plain-old-data, laid out as the kernel's struct (`#[repr(C)]`, size checked below).
unsafe impl DeviceRepr for WgradGeom {}

/// The kernel's geometry. Every extent was bounded by `direct_filter_refusal` (at most
/// `i32::MAX`), so the narrowing casts are exact.
fn geometry(s: &ConvShape, (oh, ow): (usize, usize), g: &FilterGradGrid) -> WgradGeom {
    let u = |v: usize| v as u32;
    WgradGeom {
        n: u(s.n),
        c: u(s.c_in),
        h: u(s.h),
        w: u(s.w),
        k: u(s.c_out),
        oh: u(oh),
        ow: u(ow),
        ph: s.pad.0 as i32,
        pw: s.pad.1 as i32,
        segs: u(g.segs),
        units: u(g.units),
        splits: u(g.splits),
    }
}

/// Runs a `direct_filter` route (registered in `paths.rs`).
///
/// # Safety
/// As [`super::route::run`].
pub(crate) unsafe fn raw_run(c: &PathCall<'_>) -> Result<()> {
    let t = c.target;
    if c.direction != Direction::BackwardFilter {
        return Err(c.no_direction("nnfuse's filter-gradient kernel"));
    }
    let s = t.shape;
    let out_hw = s.out_hw()?;
    let cap = t.ctx.config().conv_workspace_bytes();
    if let Some(why) = direct_filter_refusal(s, t.dtype, out_hw, cap) {
        return Err(Error::NotSupported(why));
    }
    let grid = filter_grad_grid(s, out_hw, cap);
    let geom = geometry(s, out_hw, &grid);
    let p = c.bwd_filter();
    let scratch = t.ctx.scratch(grid.scratch_bytes(s))?;
    let part = scratch.ptr();
    let nhwc = s.format == TensorFormat::Nhwc;
    let name = if nhwc {
        "conv_wgrad3x3_nhwc_f32"
    } else {
        "conv_wgrad3x3_nchw_f32"
    };
    let cfg = LaunchConfig {
        grid_dim: (geom.splits, grid.c_tiles as u32, grid.k_tiles as u32),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: SMEM_BYTES,
    };
    tracing::debug!(kernel = name, shape = ?s, grid = ?cfg.grid_dim, "filter-gradient kernel");
    let f = t.ctx.function(&kernels::CONV_WGRAD, name)?;
    launch::allow_dynamic_smem(&f, SMEM_BYTES as usize)?;
    let mut params = [
        launch::arg(&p.x),
        launch::arg(&p.dy),
        launch::arg(&part),
        launch::arg(&geom),
    ];
    // SAFETY: (const float*, const float*, float*, WgradGeom) is the kernel's signature; x and
    // dy hold the problem's extents (the caller's contract), the scratch one partial filter
    // gradient per split (`scratch_bytes`).
    unsafe {
        launch::launch_kernel(
            t.ctx,
            &f,
            cfg,
            &mut params,
            "cuLaunchKernel(conv_wgrad3x3)",
        )?
    };
    let elems = s.c_out * s.c_in * 9;
    let reduce = t.ctx.function(&kernels::CONV_WGRAD, "conv_wgrad_reduce_f32")?;
    let (k, ch, splits) = (geom.k, geom.c, geom.splits);
    let (nhwc, accumulate) = (u32::from(nhwc), u32::from(c.accumulate));
    let mut params = [
        launch::arg(&part),
        launch::arg(&p.dw),
        launch::arg(&k),
        launch::arg(&ch),
        launch::arg(&splits),
        launch::arg(&nhwc),
        launch::arg(&accumulate),
    ];
    // SAFETY: (const float*, float*, u32 x5) is the kernel's signature; dw holds the filter's
    // elements (the caller's contract), the scratch the partial sums written above, in stream
    // order. The scratch guard is held until both launches are queued.
    let r = unsafe {
        launch::launch_kernel(
            t.ctx,
            &reduce,
            launch::grid_stride_config(t.ctx, elems, THREADS),
            &mut params,
            "cuLaunchKernel(conv_wgrad_reduce)",
        )
    };
    drop(scratch);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_struct_matches_the_kernel() {
        // kernels/conv_wgrad.cu: static_assert(sizeof(WgradGeom) == 48).
        assert_eq!(std::mem::size_of::<WgradGeom>(), 48);
        // Two stages of 64 x 68 + 96 x 67 floats; two blocks fit an H100 SM (228 KiB).
        assert_eq!(SMEM_BYTES, 2 * (64 * 68 + 96 * 67) * 4);
        const { assert!(2 * SMEM_BYTES < 228 * 1024) };
    }

    #[test]
    fn every_kernel_name_is_in_the_compiled_file() {
        if !crate::kernels::nvrtc_present() {
            eprintln!("skipping: NVRTC not found");
            return;
        }
        let image = crate::kernels::compile(&crate::kernels::CONV_WGRAD, "compute_90").unwrap();
        let ptx = String::from_utf8_lossy(image.bytes()).into_owned();
        for k in [
            "conv_wgrad3x3_nchw_f32",
            "conv_wgrad3x3_nhwc_f32",
            "conv_wgrad_reduce_f32",
        ] {
            assert!(ptx.contains(&format!(".entry {k}(")), "{k} missing");
        }
    }
}
