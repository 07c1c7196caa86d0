//! The Winograd path, NHWC, 3x3, stride 1, dilation 1: input and filter tiles are transformed
//! (`kernels/winograd.cu`: Bᵀ d B with the zero padding fused in, G g Gᵀ), the whole layer is one
//! batched multiply (one `tiles x C_in` by `C_in x C_out` product per transform position, by the
//! tensor-core GEMM or the Direct batched multiply), and the inverse transform Aᵀ M A writes y.
//! F(2x2, 3x3) and F(4x4, 3x3). The data gradient reuses the forward with the filter rotated by
//! 180 degrees and its channel axes swapped.
//!
//! The algorithm, its layouts and its f64 reference are in [`crate::reference::winograd`]. The
//! batch is processed in chunks of images whose transformed input `U` and product `M` (and the
//! transformed filter `V`, unless the caller prepared it) fit under
//! [`crate::Config::conv_workspace_bytes`], all in the Context's scratch arena
//! ([`Context::scratch`]). Per chunk: input transform (x → U), batched multiply (V, U → M),
//! output transform (M → y); each chunk's batched GEMM covers that chunk's own tiles (chunks
//! differ by at most one image, so a run has at most two GEMM shapes: two tuning keys).
//!
//! Accuracy: every stage rounds its output to the data type once, so F(4x4, 3x3) in 16-bit types
//! loses about an order of magnitude more than a direct convolution
//! ([`crate::reference::winograd::error_bound`] has the numbers).

pub(crate) mod fused;
pub(crate) mod launch;
pub mod stages;

use cudarc::driver::LaunchConfig;

use super::call::PathCall;
use super::problem::{
    winograd_backward_data_eligible, winograd_forward_eligible, WinogradDims, WinogradGeometry,
};
use super::{BwdDataPtrs, ConvShape, Direction, FwdPtrs, WinogradEngine, WinogradTile};
use crate::context::Context;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gemm::{Compute, Problem};
pub use launch::Chunking;
use launch::Stage;

/// Where the batched multiply's transformed filter comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Filter {
    /// Transform this KRSC filter into the scratch first (`rotated`: the data gradient's
    /// rotated, channel-swapped transform of the original problem's filter).
    Raw { w: u64, rotated: bool },
    /// Already transformed (`V[pos][c_in][c_out]` of the problem being run).
    Prepared(u64),
}

fn not_eligible(why: String) -> Error {
    Error::invalid("shape", format!("not a Winograd convolution: {why}"))
}

fn aligned(name: &'static str, ptr: u64, dtype: DType) -> Result<()> {
    if ptr == 0 {
        return Err(Error::invalid(name, "null device pointer"));
    }
    if ptr % dtype.size() as u64 != 0 {
        return Err(Error::invalid(
            name,
            format!("device pointer {ptr:#x} is not aligned to its element size"),
        ));
    }
    Ok(())
}

fn cfg(blocks: (u32, u32), threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks.0, blocks.1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Queues the input transform of `images` images of `g`'s problem starting at `x` into `u`
/// (`U[pos][t][c_in]` for those images' tiles). `vec`: channels per thread, `None` for the
/// measured preference ([`launch::preferred_widths`]) that `c_in` and the pointers allow.
/// Returns the width used.
///
/// # Safety
/// `x` holds `images * h * w * c_in` elements and `u` `images * u_per_image` elements of `dtype`
/// on `ctx`'s device, disjoint.
#[allow(clippy::too_many_arguments)] // a launcher: the problem, its operands, its options
pub(crate) unsafe fn input_transform(
    ctx: &Context,
    g: &WinogradGeometry,
    dtype: DType,
    x: u64,
    u: u64,
    images: usize,
    vec: Option<usize>,
) -> Result<usize> {
    let (s, tile, d) = (&g.problem, g.tile, &g.dims);
    aligned("x", x, dtype)?;
    aligned("u", u, dtype)?;
    let vec = vec.unwrap_or_else(|| launch::choose_vec(Stage::Input, tile, dtype, s.c_in, &[x, u]));
    let name = launch::transform_kernel(Stage::Input, dtype, tile, vec)
        .filter(|_| s.c_in % vec == 0)
        .ok_or_else(|| Error::invalid("vec", format!("no {vec}-channel input kernel here")))?;
    if (x | u) % (vec * dtype.size()) as u64 != 0 {
        return Err(Error::invalid(
            "vec",
            format!("{vec} channels per thread need x and u aligned to that many elements"),
        ));
    }
    let tiles = images
        .checked_mul(d.tiles_per_image)
        .ok_or_else(|| Error::invalid("n", "tiles overflow"))?;
    if tiles == 0 {
        return Ok(vec);
    }
    // The kernel forms tile origins and tap coordinates as i32.
    for extent in [s.h + 2 * s.pad.0, s.w + 2 * s.pad.1] {
        if extent > (i32::MAX as usize) / 2 {
            return Err(Error::invalid(
                "shape",
                "the padded image exceeds the kernels' limits",
            ));
        }
    }
    let blocks = launch::transform_blocks(Stage::Input, tile, vec, tiles, s.c_in)?;
    let args = [
        launch::arg_u32(s.h, "h")?,
        launch::arg_u32(s.w, "w")?,
        launch::arg_u32(s.c_in, "c_in")?,
        launch::arg_u32(s.pad.0, "pad")?,
        launch::arg_u32(s.pad.1, "pad")?,
        launch::arg_u32(d.tiles_h, "tiles_h")?,
        launch::arg_u32(d.tiles_w, "tiles_w")?,
    ];
    launch::arg_u32(d.tiles_per_image, "tiles per image")?;
    let tiles64 = tiles as u64;
    let unit = launch::transform_unit(Stage::Input, dtype, tile, vec)
        .ok_or_else(|| Error::NotSupported(format!("no compilation unit holds {name}")))?;
    let f = ctx.function(unit, name)?;
    tracing::debug!(
        kernel = name,
        images,
        tiles,
        vec,
        blocks,
        "Winograd input transform"
    );
    use crate::launch::arg;
    let [a0, a1, a2, a3, a4, a5, a6] = &args;
    let mut params = [
        arg(&x),
        arg(&u),
        arg(a0),
        arg(a1),
        arg(a2),
        arg(a3),
        arg(a4),
        arg(a5),
        arg(a6),
        arg(&tiles64),
    ];
    let (lc, call) = (
        cfg((blocks, 1), launch::THREADS),
        "cuLaunchKernel(winograd_input)",
    );
    // SAFETY: the arguments match winograd_input_* (x, u, h, w, c, pad_h, pad_w, tiles_h,
    // tiles_w, tiles); the caller guarantees the extents; c_in % vec == 0 and both pointers are
    // aligned to vec elements (checked above).
    unsafe { crate::launch::launch_kernel(ctx, &f, lc, &mut params, call) }?;
    Ok(vec)
}

/// Queues the output transform of `images` images' tiles from `m` (`M[pos][t][c_out]`) into y
/// starting at `y`, clipped at the image edge. `vec` as [`input_transform`]. Returns the width.
///
/// # Safety
/// `m` holds `images * m_per_image` and `y` `images * oh * ow * c_out` elements of `dtype` on
/// `ctx`'s device, disjoint.
#[allow(clippy::too_many_arguments)] // a launcher: the problem, its operands, its options
pub(crate) unsafe fn output_transform(
    ctx: &Context,
    g: &WinogradGeometry,
    dtype: DType,
    m: u64,
    y: u64,
    images: usize,
    vec: Option<usize>,
) -> Result<usize> {
    let (s, tile, d) = (&g.problem, g.tile, &g.dims);
    let (oh, ow) = s.out_hw()?;
    aligned("m", m, dtype)?;
    aligned("y", y, dtype)?;
    let vec =
        vec.unwrap_or_else(|| launch::choose_vec(Stage::Output, tile, dtype, s.c_out, &[m, y]));
    let name = launch::transform_kernel(Stage::Output, dtype, tile, vec)
        .filter(|_| s.c_out % vec == 0)
        .ok_or_else(|| Error::invalid("vec", format!("no {vec}-channel output kernel here")))?;
    if (m | y) % (vec * dtype.size()) as u64 != 0 {
        return Err(Error::invalid(
            "vec",
            format!("{vec} channels per thread need m and y aligned to that many elements"),
        ));
    }
    let tiles = images
        .checked_mul(d.tiles_per_image)
        .ok_or_else(|| Error::invalid("n", "tiles overflow"))?;
    if tiles == 0 {
        return Ok(vec);
    }
    let blocks = launch::transform_blocks(Stage::Output, tile, vec, tiles, s.c_out)?;
    let args = [
        launch::arg_u32(oh, "oh")?,
        launch::arg_u32(ow, "ow")?,
        launch::arg_u32(s.c_out, "c_out")?,
        launch::arg_u32(d.tiles_h, "tiles_h")?,
        launch::arg_u32(d.tiles_w, "tiles_w")?,
    ];
    launch::arg_u32(d.tiles_per_image, "tiles per image")?;
    // The kernel adds up to m - 1 to tile origins in u32.
    launch::arg_u32(oh.max(ow) + tile.m(), "oh")?;
    let tiles64 = tiles as u64;
    let unit = launch::transform_unit(Stage::Output, dtype, tile, vec)
        .ok_or_else(|| Error::NotSupported(format!("no compilation unit holds {name}")))?;
    let f = ctx.function(unit, name)?;
    tracing::debug!(
        kernel = name,
        images,
        tiles,
        vec,
        blocks,
        "Winograd output transform"
    );
    use crate::launch::arg;
    let [a0, a1, a2, a3, a4] = &args;
    let mut params = [
        arg(&m),
        arg(&y),
        arg(a0),
        arg(a1),
        arg(a2),
        arg(a3),
        arg(a4),
        arg(&tiles64),
    ];
    let (lc, call) = (
        cfg((blocks, 1), launch::THREADS),
        "cuLaunchKernel(winograd_output)",
    );
    // SAFETY: the arguments match winograd_output_* (m, y, oh, ow, k, tiles_h, tiles_w, tiles);
    // the caller guarantees the extents; c_out % vec == 0 and both pointers are aligned to vec
    // elements (checked above).
    unsafe { crate::launch::launch_kernel(ctx, &f, lc, &mut params, call) }?;
    Ok(vec)
}

/// Queues the filter transform of the KRSC filter `w` (`kout x 3 x 3 x cin`) into `v`:
/// `V[pos][cin][kout]`, or with `rotated` `V'[pos][kout][cin]` of the filter rotated by 180
/// degrees (the data gradient's).
///
/// # Safety
/// `w` holds `kout * 9 * cin` and `v` `positions * kout * cin` elements of `dtype` on `ctx`'s
/// device, disjoint.
#[allow(clippy::too_many_arguments)] // a launcher: the problem, its operands, its options
unsafe fn filter_transform(
    ctx: &Context,
    dtype: DType,
    tile: WinogradTile,
    w: u64,
    v: u64,
    kout: usize,
    cin: usize,
    rotated: bool,
) -> Result<()> {
    aligned("w", w, dtype)?;
    aligned("v", v, dtype)?;
    let grid = launch::filter_grid(cin, kout, tile, rotated)?;
    let (k32, c32) = (
        launch::arg_u32(kout, "c_out")?,
        launch::arg_u32(cin, "c_in")?,
    );
    let name = launch::filter_kernel(dtype, tile, rotated);
    let f = ctx.function(launch::filter_unit(dtype, tile), name)?;
    tracing::debug!(kernel = name, kout, cin, ?grid, "Winograd filter transform");
    use crate::launch::arg;
    let mut params = [arg(&w), arg(&v), arg(&k32), arg(&c32)];
    let cfg = LaunchConfig {
        grid_dim: grid,
        block_dim: (launch::THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let call = "cuLaunchKernel(winograd_filter)";
    // SAFETY: the arguments match winograd_filter_* (w, v, kout, cin); the caller guarantees the
    // extents; the grid covers every (k, c) pair and every row (filter_grid).
    unsafe { crate::launch::launch_kernel(ctx, &f, cfg, &mut params, call) }
}

/// The batched multiply of one chunk of `tiles` tiles: `M_pos = U_pos · V_pos` for every
/// position, as the column-major GEMM of [`crate::reference::winograd::batched_gemm_problem`].
///
/// # Safety
/// `v`, `u`, `m` hold the transformed filter, input and product of `tiles` tiles of `g` on
/// `ctx`'s device; `m` disjoint from `u` and `v`.
#[allow(clippy::too_many_arguments)] // a launcher: the problem, its operands, its options
pub(crate) unsafe fn multiply(
    ctx: &Context,
    g: &WinogradGeometry,
    dtype: DType,
    engine: WinogradEngine,
    v: u64,
    u: u64,
    m: u64,
    tiles: usize,
) -> Result<()> {
    let (s, tile) = (&g.problem, g.tile);
    let big = || Error::invalid("n", "the batched multiply's strides overflow");
    let p = Problem {
        trans_a: false,
        trans_b: false,
        m: s.c_out,
        n: tiles,
        k: s.c_in,
        lda: s.c_out,
        ldb: s.c_in,
        ldc: s.c_out,
        stride_a: s.c_in.checked_mul(s.c_out).ok_or_else(big)?,
        stride_b: tiles.checked_mul(s.c_in).ok_or_else(big)?,
        stride_c: tiles.checked_mul(s.c_out).ok_or_else(big)?,
        batch: tile.positions(),
        alpha: 1.0,
        beta: 0.0,
        compute: Compute::F32,
    };
    tracing::debug!(
        engine = engine.name(),
        m = p.m,
        n = p.n,
        k = p.k,
        batch = p.batch,
        "Winograd batched multiply"
    );
    match engine {
        // SAFETY: as this function's contract.
        WinogradEngine::TensorCore => unsafe {
            crate::gemm::strided_batched_raw(ctx, &p, dtype, v, u, m)
        },
        // SAFETY: as this function's contract.
        WinogradEngine::Direct => unsafe {
            super::winograd_gemm::batched_direct(ctx, &p, dtype, v, u, m)
        },
        WinogradEngine::Fused => Err(Error::invalid(
            "engine",
            "the fused engine has no separate batched multiply (its kernel transforms, \
             multiplies and inverse-transforms at once)",
        )),
    }
}

/// The path's chunking: one chunk as large as the workspace cap allows. Measured on the H100
/// (`benches/winograd.rs`, f16, batch 32): the L2-resident chunks were 1.15x (F(2x2)) and 1.22x
/// (F(4x4)) slower at 56² and 1.20x / 1.22x slower at 28², and equal at 14² and 7² (where they
/// are one chunk anyway): the batched GEMM of a wide chunk runs faster than the L2 saves, and
/// each extra chunk costs three launches. So no shape gains from them; they stay selectable
/// ([`forward_chunked`]) for other devices.
pub(crate) fn default_chunking(_ctx: &Context) -> Chunking {
    Chunking::WorkspaceCap
}

/// Runs the whole path on `g`'s problem `s` (a Winograd problem): x → y with the filter from
/// `filter`.
///
/// # Safety
/// `x` holds `s.x_len()` and `y` `s.y_len()` elements of `dtype`, the filter its extent, all on
/// `ctx`'s device, `y` disjoint from the others.
#[allow(clippy::too_many_arguments)] // a launcher: the problem, its operands, its options
unsafe fn run(
    ctx: &Context,
    g: &WinogradGeometry,
    dtype: DType,
    engine: WinogradEngine,
    x: u64,
    y: u64,
    filter: Filter,
    chunking: Option<Chunking>,
) -> Result<()> {
    let (s, tile) = (&g.problem, g.tile);
    winograd_forward_eligible(s).map_err(not_eligible)?;
    if engine == WinogradEngine::Fused {
        // SAFETY: the caller's contract.
        return unsafe { run_fused(ctx, g, dtype, x, y, filter) };
    }
    let elem = dtype.size();
    let cap = ctx.config().conv_workspace_bytes();
    let with_v = matches!(filter, Filter::Raw { .. });
    let chunking = chunking.unwrap_or_else(|| default_chunking(ctx));
    let plan = launch::chunk_plan(g, elem, cap, with_v, chunking)?;
    let (oh, ow) = s.out_hw()?;
    let WinogradDims {
        tiles_per_image, ..
    } = plan.dims;
    tracing::debug!(
        tile = tile.name(),
        engine = engine.name(),
        dtype = dtype.name(),
        n = s.n,
        chunk = plan.chunk,
        chunks = plan.chunks.len(),
        l2_limited = plan.l2_limited,
        scratch_bytes = plan.layout.bytes,
        cap,
        prepared = !with_v,
        "Winograd convolution"
    );
    let scratch = ctx.scratch(plan.layout.bytes)?;
    let base = scratch.ptr();
    let v = match filter {
        Filter::Raw { w, rotated } => {
            let v = base + plan.layout.v as u64;
            // The data gradient's filter is the original problem's: kout = this problem's c_in.
            let (kout, cin) = if rotated {
                (s.c_in, s.c_out)
            } else {
                (s.c_out, s.c_in)
            };
            // SAFETY: w holds kout*9*cin elements (the caller's filter), v the scratch's V
            // region (plan.dims.v elements).
            unsafe { filter_transform(ctx, dtype, tile, w, v, kout, cin, rotated)? };
            v
        }
        Filter::Prepared(v) => v,
    };
    let u = base + plan.layout.u as u64;
    let m = base + plan.layout.m as u64;
    let x_image = (s.h * s.w * s.c_in * elem) as u64;
    let y_image = (oh * ow * s.c_out * elem) as u64;
    // Each chunk multiplies its own tiles: the transforms lay U and M out with the chunk's own
    // tile count as the stride between transform positions, so the GEMM must use the same.
    // Balanced chunks differ by at most one image: at most two GEMM shapes (tuning keys) a run.
    debug_assert_eq!(plan.chunks.first().copied(), Some(plan.chunk));
    let mut first = 0u64;
    for &images in &plan.chunks {
        let (xc, yc) = (x + first * x_image, y + first * y_image);
        let gemm_tiles = images * tiles_per_image;
        // SAFETY: the chunk's images lie inside x and y; U and M hold `chunk >= images` images.
        unsafe {
            input_transform(ctx, g, dtype, xc, u, images, None)?;
            multiply(ctx, g, dtype, engine, v, u, m, gemm_tiles)?;
            output_transform(ctx, g, dtype, m, yc, images, None)?;
        }
        first += images as u64;
    }
    // The scratch guard is held until every launch that uses it is queued.
    drop(scratch);
    Ok(())
}

/// [`run`] by the fused engine: the filter transform (unless prepared) into the scratch, then
/// the fused kernel; no transformed input or product is stored, so nothing is chunked.
///
/// # Safety
/// As [`run`].
#[allow(clippy::too_many_arguments)] // a launcher: the problem, its operands, its options
unsafe fn run_fused(
    ctx: &Context,
    g: &WinogradGeometry,
    dtype: DType,
    x: u64,
    y: u64,
    filter: Filter,
) -> Result<()> {
    let (s, tile, dims) = (&g.problem, g.tile, g.dims);
    // Refuse before the filter transform runs, so a refusal launches nothing.
    fused::check(ctx, g, dtype, x, y)?;
    let cap = ctx.config().conv_workspace_bytes();
    tracing::debug!(
        tile = tile.name(),
        dtype = dtype.name(),
        n = s.n,
        prepared = matches!(filter, Filter::Prepared(_)),
        "Winograd convolution, fused engine"
    );
    match filter {
        Filter::Prepared(v) => {
            // SAFETY: the caller's contract; v is the prepared transformed filter.
            unsafe { fused::forward(ctx, g, dtype, x, v, y) }
        }
        Filter::Raw { w, rotated } => {
            let bytes = dims
                .v
                .checked_mul(dtype.size())
                .ok_or_else(|| Error::invalid("shape", "the transformed filter overflows"))?;
            if bytes > cap {
                return Err(Error::NotSupported(format!(
                    "Winograd {} fused: the transformed filter ({bytes} bytes) exceeds the \
                     convolution workspace cap of {cap} bytes (NNFUSE_CONV_WORKSPACE_MB)",
                    tile.name()
                )));
            }
            let scratch = ctx.scratch(bytes.max(1))?;
            let v = scratch.ptr();
            let (kout, cin) = if rotated {
                (s.c_in, s.c_out)
            } else {
                (s.c_out, s.c_in)
            };
            // SAFETY: w holds kout*9*cin elements (the caller's filter), v the scratch's
            // dims.v elements; the fused kernel reads v after the transform on the same stream.
            unsafe {
                filter_transform(ctx, dtype, tile, w, v, kout, cin, rotated)?;
                fused::forward(ctx, g, dtype, x, v, y)?;
            }
            // The scratch guard is held until every launch that uses it is queued.
            drop(scratch);
            Ok(())
        }
    }
}

/// Runs a Winograd route (registered in `paths.rs`): the geometry its route was completed
/// with (tile, equivalent forward problem, sizes), its engine, the forward or the data gradient.
///
/// # Safety
/// As [`super::route::run`].
pub(crate) unsafe fn raw_run(c: &PathCall<'_>) -> Result<()> {
    let (t, r) = (c.target, c.exec.route);
    let g = c
        .exec
        .winograd
        .as_ref()
        .filter(|g| r.path.winograd_tile() == Some(g.tile))
        .ok_or_else(|| Error::NotSupported(format!("{} has no Winograd geometry", r.path)))?;
    let engine = r
        .engine
        .ok_or_else(|| Error::NotSupported("the Winograd route has no engine chosen".into()))?;
    // SAFETY: the caller's contract.
    unsafe {
        match c.direction {
            Direction::Forward => forward(t.ctx, g, t.dtype, engine, c.fwd()),
            Direction::BackwardData => {
                backward_data(t.ctx, t.shape, g, t.dtype, engine, c.bwd_data())
            }
            Direction::BackwardFilter => Err(Error::NotSupported(
                "Winograd has no filter gradient".into(),
            )),
        }
    }
}

/// Forward convolution: transforms the filter, then runs [`forward_prepared`].
///
/// # Safety
/// `p` holds device addresses on `ctx`'s device with the shape's extents of `dtype` elements, `y`
/// disjoint from `x` and `w`, all valid until the queued work completes; the shape is eligible
/// ([`super::problem::winograd_forward_eligible`]).
pub(crate) unsafe fn forward(
    ctx: &Context,
    g: &WinogradGeometry,
    dtype: DType,
    engine: WinogradEngine,
    p: FwdPtrs,
) -> Result<()> {
    aligned("w", p.w, dtype)?;
    let filter = Filter::Raw {
        w: p.w,
        rotated: false,
    };
    // SAFETY: the caller's contract.
    unsafe { run(ctx, g, dtype, engine, p.x, p.y, filter, None) }
}

/// [`forward`] with an explicit [`Chunking`] (benchmarks compare the strategies).
///
/// # Safety
/// As [`forward`].
pub(crate) unsafe fn forward_chunked(
    ctx: &Context,
    g: &WinogradGeometry,
    dtype: DType,
    engine: WinogradEngine,
    p: FwdPtrs,
    chunking: Chunking,
) -> Result<()> {
    aligned("w", p.w, dtype)?;
    let filter = Filter::Raw {
        w: p.w,
        rotated: false,
    };
    // SAFETY: the caller's contract.
    unsafe { run(ctx, g, dtype, engine, p.x, p.y, filter, Some(chunking)) }
}

/// Writes the transformed filter G g Gᵀ of forward geometry `g` (`g.dims.v` elements of
/// `dtype`) to `v`.
///
/// # Safety
/// `w` holds the filter of `g`'s problem `s` (`s.w_len()` elements), `v` the transformed
/// filter's, on `ctx`'s device.
pub(crate) unsafe fn transform_filter(
    ctx: &Context,
    g: &WinogradGeometry,
    dtype: DType,
    w: u64,
    v: u64,
) -> Result<()> {
    let s = &g.problem;
    winograd_forward_eligible(s).map_err(not_eligible)?;
    // SAFETY: the caller's contract.
    unsafe { filter_transform(ctx, dtype, g.tile, w, v, s.c_out, s.c_in, false) }
}

/// Forward convolution with a filter already transformed by [`transform_filter`]: `p.w` is the
/// transformed filter.
///
/// # Safety
/// As [`forward`], with `p.w` holding the transformed filter.
pub(crate) unsafe fn forward_prepared(
    ctx: &Context,
    g: &WinogradGeometry,
    dtype: DType,
    engine: WinogradEngine,
    p: FwdPtrs,
) -> Result<()> {
    aligned("w", p.w, dtype)?;
    let filter = Filter::Prepared(p.w);
    // SAFETY: the caller's contract.
    unsafe { run(ctx, g, dtype, engine, p.x, p.y, filter, None) }
}

/// Checks that `s` has a Winograd data gradient and that `g` is its geometry (the forward
/// problem whose output is `s`'s data gradient, as
/// [`crate::reference::winograd::backward_data_problem`] states it).
fn backward_geometry(s: &ConvShape, g: &WinogradGeometry) -> Result<()> {
    winograd_backward_data_eligible(s).map_err(not_eligible)?;
    if (g.problem.n, g.problem.c_in, g.problem.c_out) != (s.n, s.c_out, s.c_in) {
        return Err(Error::NotSupported(
            "the Winograd geometry is not this problem's data gradient".into(),
        ));
    }
    Ok(())
}

/// Data gradient of `s` as a forward Winograd convolution of dy with the rotated,
/// channel-swapped filter (padding `2 - pad`): `g` is `s`'s data-gradient geometry.
///
/// # Safety
/// As [`forward`], for `p`'s operands; the shape passes
/// [`super::problem::winograd_backward_data_eligible`].
pub(crate) unsafe fn backward_data(
    ctx: &Context,
    s: &ConvShape,
    g: &WinogradGeometry,
    dtype: DType,
    engine: WinogradEngine,
    p: BwdDataPtrs,
) -> Result<()> {
    backward_geometry(s, g)?;
    aligned("w", p.w, dtype)?;
    let filter = Filter::Raw {
        w: p.w,
        rotated: true,
    };
    // SAFETY: dy has g's input extent (s's output), dx g's output extent (s's input); the
    // caller's contract covers the rest.
    unsafe { run(ctx, g, dtype, engine, p.dy, p.dx, filter, None) }
}

/// Writes the data gradient's transformed filter (rotated by 180 degrees, channels swapped;
/// `g.dims.v` elements of `dtype`) to `v`, for [`backward_data_prepared`]; `g` is `s`'s
/// data-gradient geometry.
///
/// # Safety
/// `w` holds `s.w_len()` elements, `v` the transformed filter's, on `ctx`'s device.
#[allow(dead_code)] // for the dispatcher's prepared filters
pub(crate) unsafe fn transform_filter_backward_data(
    ctx: &Context,
    s: &ConvShape,
    g: &WinogradGeometry,
    dtype: DType,
    w: u64,
    v: u64,
) -> Result<()> {
    backward_geometry(s, g)?;
    // SAFETY: the caller's contract.
    unsafe { filter_transform(ctx, dtype, g.tile, w, v, s.c_out, s.c_in, true) }
}

/// [`backward_data`] with the filter already transformed by [`transform_filter_backward_data`]
/// (`p.w`).
///
/// # Safety
/// As [`backward_data`], with `p.w` holding the transformed filter.
#[allow(dead_code)] // for the dispatcher's prepared filters
pub(crate) unsafe fn backward_data_prepared(
    ctx: &Context,
    s: &ConvShape,
    g: &WinogradGeometry,
    dtype: DType,
    engine: WinogradEngine,
    p: BwdDataPtrs,
) -> Result<()> {
    backward_geometry(s, g)?;
    aligned("w", p.w, dtype)?;
    let filter = Filter::Prepared(p.w);
    // SAFETY: as backward_data.
    unsafe { run(ctx, g, dtype, engine, p.dy, p.dx, filter, None) }
}

#[cfg(test)]
mod emulate;
#[cfg(test)]
mod emulate_fused;
#[cfg(test)]
mod gpu_tests;
