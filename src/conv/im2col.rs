//! The im2col + GEMM convolution path, and nnfuse's im2col / col2im kernels
//! (`kernels/im2col.cu`) as safe functions.
//!
//! The forward writes the column matrices of a chunk of images into the Context's scratch arena
//! and multiplies them with the filter in one strided batched GEMM per chunk
//! ([`crate::gemm`], with its algorithm search); the data gradient multiplies the filter with dy
//! into column matrices and gathers them back with col2im (each input element sums its own taps
//! in a fixed order: deterministic, no atomics); the filter gradient multiplies dy with the
//! columns, chunk by chunk, accumulating across chunks in f32. Pointwise convolutions (1x1,
//! stride 1, no padding) skip im2col: x already is the column matrix.
//!
//! The batch is processed in chunks so that the column matrices never exceed
//! [`crate::Config::conv_workspace_bytes`] (`NNFUSE_CONV_WORKSPACE_MB`, default 256 MiB); a
//! problem whose single image needs more is refused with [`Error::NotSupported`] naming the cap.
//!
//! **Precision**: products accumulate in f32 (cuBLAS's f32 compute; col2im and the chunk
//! accumulation in f32). Intermediates are stored in the data type: the data gradient's column
//! matrices, and in the filter gradient each chunk's partial sum (rounded to f16/bf16 once per
//! chunk before the f32 accumulation across chunks; f32 data and single-chunk problems
//! accumulate inside the GEMM). Layouts and formulations: [`crate::reference::conv`],
//! `docs/CONV-IM2COL.md` and the plan module (`src/conv/im2col/steps.rs`).
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use nnfuse::conv::ConvShape;
//! use nnfuse::internals::conv::im2col;
//! use nnfuse::TensorFormat;
//! let ctx = nnfuse::Context::new(0)?;
//! let s = ConvShape {
//!     n: 2, c_in: 64, h: 56, w: 56, c_out: 64, kh: 3, kw: 3,
//!     stride: (1, 1), pad: (1, 1), dilation: (1, 1), format: TensorFormat::Nhwc,
//! };
//! let x = ctx.stream().alloc_zeros::<half::f16>(s.x_len()?)?;
//! let mut cols = ctx.stream().alloc_zeros::<half::f16>(im2col::columns_len(&s)?)?;
//! im2col::im2col(&ctx, &s, &x, &mut cols)?; // [n][P][K]: each pixel's patch contiguous
//! # Ok(()) }
//! ```

#[cfg(test)]
pub(crate) mod gpu_tests;
pub(crate) mod launch;
pub(crate) mod steps;

use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::call::PathCall;
use super::{BwdDataPtrs, BwdFilterPtrs, ConvShape, Direction, FwdPtrs};
use crate::context::Context;
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::kernels;
use crate::validate::{Aliasing, Binder, Need};
use steps::{At, Buf, Plan, Step};

/// Device addresses of the operands a plan may name (0 for those it does not use).
#[derive(Debug, Clone, Copy, Default)]
struct Operands {
    x: u64,
    w: u64,
    y: u64,
    dy: u64,
    dx: u64,
    dw: u64,
}

/// Launches one im2col/col2im kernel.
///
/// # Safety
/// `src` and `dst` hold what `l` reads and writes (the launch was planned for them).
unsafe fn launch_cols(ctx: &Context, l: &launch::Launch, src: u64, dst: u64) -> Result<()> {
    let f = ctx.function(&kernels::IM2COL, l.kernel)?;
    use crate::launch::arg;
    let mut params = [arg(&src), arg(&dst), arg(&l.geom), arg(&l.images)];
    let call = "cuLaunchKernel(im2col.cu)";
    // SAFETY: (const E*, E*, ColGeom, u32) is every im2col/col2im kernel's signature; ColGeom is
    // laid out as the kernel's; the caller guarantees the extents.
    unsafe { crate::launch::launch_kernel(ctx, &f, l.config(), &mut params, call) }
}

/// Runs `plan` on the Context's stream.
///
/// # Safety
/// The operands hold the extents the plan's steps address (those of the problem the plan was
/// made for), in `dtype`; outputs are disjoint from inputs.
unsafe fn execute(ctx: &Context, dtype: DType, plan: &Plan, ops: Operands) -> Result<()> {
    // Lock order: the scratch before Context::lock (taken inside the GEMM).
    let scratch = if plan.scratch.bytes > 0 {
        Some(ctx.scratch(plan.scratch.bytes)?)
    } else {
        None
    };
    let base = scratch.as_ref().map_or(0, |s| s.ptr());
    let addr = |a: At| -> Result<u64> {
        let start = match a.buf {
            Buf::X => ops.x,
            Buf::W => ops.w,
            Buf::Y => ops.y,
            Buf::Dy => ops.dy,
            Buf::Dx => ops.dx,
            Buf::Dw => ops.dw,
            Buf::Cols | Buf::DyT | Buf::Partial | Buf::Acc | Buf::Ptrs => plan
                .scratch
                .region(a.buf)
                .map_or(0, |(off, _)| base + off as u64),
        };
        if start == 0 {
            return Err(Error::NotSupported(format!(
                "im2col path: a step addresses {:?}, which this call did not provide",
                a.buf
            )));
        }
        Ok(start + (a.offset * a.buf.elem_bytes(dtype.size())) as u64)
    };
    let elem = dtype.size();
    for step in &plan.steps {
        match step {
            Step::Im2col {
                src,
                dst,
                shape,
                layout,
                images,
            } => {
                let (s, d) = (addr(*src)?, addr(*dst)?);
                let l = launch::im2col(shape, *layout, elem, *images, s, d)?;
                tracing::trace!(kernel = l.kernel, grid = ?l.grid, images = l.images, "im2col step");
                // SAFETY: the plan sized the scratch for these columns; x holds the chunk.
                unsafe { launch_cols(ctx, &l, s, d)? };
            }
            Step::Col2im {
                src,
                dst,
                shape,
                images,
                add,
            } => {
                let (s, d) = (addr(*src)?, addr(*dst)?);
                let l = launch::col2im(shape, dtype, *images, s, d, *add)?;
                tracing::trace!(kernel = l.kernel, grid = ?l.grid, images = l.images, "col2im step");
                // SAFETY: as above, for the columns and dx.
                unsafe { launch_cols(ctx, &l, s, d)? };
            }
            Step::Gemm { problem, a, b, c } => {
                // SAFETY: the plan's problems address only the operands' extents (checked on the
                // CPU by the plan tests) and never write an input.
                unsafe {
                    crate::gemm::strided_batched_raw(
                        ctx,
                        problem,
                        dtype,
                        addr(*a)?,
                        addr(*b)?,
                        addr(*c)?,
                    )?
                };
            }
            Step::Accumulate {
                part,
                acc,
                out,
                len,
                mode,
            } => {
                let f = ctx.function(&kernels::IM2COL, launch::accumulate_kernel(dtype))?;
                let cfg = crate::launch::grid_stride_config(ctx, *len, launch::THREADS);
                let (p, a, o) = (addr(*part)?, addr(*acc)?, addr(*out)?);
                let (n, bits) = (*len as u64, mode.bits());
                use crate::launch::arg;
                let mut params = [arg(&p), arg(&a), arg(&o), arg(&n), arg(&bits)];
                let call = "cuLaunchKernel(conv_accumulate)";
                // SAFETY: conv_accumulate_<t>(const T*, float*, T*, u64, u32); each buffer holds
                // `len` elements.
                unsafe { crate::launch::launch_kernel(ctx, &f, cfg, &mut params, call) }?;
            }
            Step::PieceGemm {
                problem,
                a,
                b,
                c,
                ptrs,
                a_img,
                b_img,
                split,
            } => {
                let arrays = addr(*ptrs)?;
                let f = ctx.function(&kernels::IM2COL, "conv_piece_ptrs")?;
                let count = problem.batch as u64;
                let cfg = crate::launch::grid_stride_config(ctx, problem.batch, launch::THREADS);
                let e = elem as u64;
                let (a0, b0, c0) = (addr(*a)?, addr(*b)?, addr(*c)?);
                let (a_img, a_step) = (*a_img as u64 * e, problem.stride_a as u64 * e);
                let (b_img, b_step) = (*b_img as u64 * e, problem.stride_b as u64 * e);
                let (c_step, split) = (problem.stride_c as u64 * e, *split as u64);
                use crate::launch::arg;
                let mut params = [
                    arg(&a0),
                    arg(&a_img),
                    arg(&a_step),
                    arg(&b0),
                    arg(&b_img),
                    arg(&b_step),
                    arg(&c0),
                    arg(&c_step),
                    arg(&split),
                    arg(&count),
                    arg(&arrays),
                ];
                let call = "cuLaunchKernel(conv_piece_ptrs)";
                // SAFETY: conv_piece_ptrs(u64 x 10, u64*) writes 3 * count addresses into the
                // plan's pointer region, sized for them.
                unsafe { crate::launch::launch_kernel(ctx, &f, cfg, &mut params, call) }?;
                // SAFETY: the plan's pieces address only x's, dy's and the partials' extents
                // (checked on the CPU by the plan tests); the arrays were written just before on
                // the same stream.
                unsafe { crate::gemm::pointer_arrays_raw(ctx, problem, dtype, arrays)? };
            }
            Step::SumParts {
                part,
                out,
                len,
                count,
                add,
            } => {
                if dtype != DType::F32 {
                    return Err(Error::NotSupported(format!(
                        "im2col path: the pieces' sum is f32 only, got {dtype}"
                    )));
                }
                let f = ctx.function(&kernels::IM2COL, "conv_sum_parts_f32")?;
                let cfg = crate::launch::grid_stride_config(ctx, *len, launch::THREADS);
                let (p, o) = (addr(*part)?, addr(*out)?);
                let n = *len as u64;
                let count = u32::try_from(*count)
                    .map_err(|_| Error::invalid("count", format!("{count} exceeds u32")))?;
                let add = u32::from(*add);
                use crate::launch::arg;
                let mut params = [arg(&p), arg(&o), arg(&n), arg(&count), arg(&add)];
                let call = "cuLaunchKernel(conv_sum_parts_f32)";
                // SAFETY: conv_sum_parts_f32(const float*, float*, u64, u32, u32); the partials
                // hold count * len elements and out len.
                unsafe { crate::launch::launch_kernel(ctx, &f, cfg, &mut params, call) }?;
            }
        }
    }
    drop(scratch);
    Ok(())
}

fn log(what: &str, s: &ConvShape, dtype: DType, plan: &Plan) {
    tracing::debug!(
        op = what,
        shape = ?s,
        %dtype,
        chunks = plan.chunks.len(),
        chunk = plan.chunks.first().copied().unwrap_or(0),
        pointwise = plan.pointwise,
        scratch_bytes = plan.scratch.bytes,
        steps = plan.steps.len(),
        "im2col + GEMM convolution"
    );
}

/// Runs an im2col + GEMM route (registered in `paths.rs`): the direction's function below.
///
/// # Safety
/// As [`super::route::run`].
pub(crate) unsafe fn raw_run(c: &PathCall<'_>) -> Result<()> {
    let t = c.target;
    let (ctx, s, dtype) = (t.ctx, t.shape, t.dtype);
    // SAFETY: the caller's contract.
    unsafe {
        match c.direction {
            Direction::Forward => forward(ctx, s, dtype, c.fwd()),
            Direction::BackwardData => backward_data(ctx, s, dtype, c.bwd_data(), c.accumulate),
            Direction::BackwardFilter => {
                backward_filter(ctx, s, dtype, c.bwd_filter(), c.accumulate)
            }
        }
    }
}

/// Forward convolution by im2col + GEMM, chunked under the Context's workspace cap.
///
/// Takes the Context's scratch arena (the caller must not hold it).
///
/// # Safety
/// `p` holds device addresses on `ctx`'s device with the shape's extents of `dtype` elements, `y`
/// disjoint from `x` and `w`, all valid until the queued work completes.
#[allow(dead_code)] // called by the convolution dispatcher
pub(crate) unsafe fn forward(ctx: &Context, s: &ConvShape, dtype: DType, p: FwdPtrs) -> Result<()> {
    let plan = steps::forward(s, dtype, ctx.config().conv_workspace_bytes())?;
    log("forward", s, dtype, &plan);
    let ops = Operands {
        x: p.x,
        w: p.w,
        y: p.y,
        ..Operands::default()
    };
    // SAFETY: the caller's guarantee covers the plan's operands.
    unsafe { execute(ctx, dtype, &plan, ops) }
}

/// Data gradient: GEMM of the filter with dy into column matrices, then col2im (gather);
/// written to `dx` or (with `accumulate`) added to it.
///
/// Takes the Context's scratch arena (the caller must not hold it).
///
/// # Safety
/// As [`forward`], for `p`'s operands.
#[allow(dead_code)] // called by the convolution dispatcher
pub(crate) unsafe fn backward_data(
    ctx: &Context,
    s: &ConvShape,
    dtype: DType,
    p: BwdDataPtrs,
    accumulate: bool,
) -> Result<()> {
    let plan = steps::backward_data(s, dtype, ctx.config().conv_workspace_bytes(), accumulate)?;
    log("backward_data", s, dtype, &plan);
    let ops = Operands {
        dy: p.dy,
        w: p.w,
        dx: p.dx,
        ..Operands::default()
    };
    // SAFETY: the caller's guarantee covers the plan's operands.
    unsafe { execute(ctx, dtype, &plan, ops) }
}

/// Filter gradient: GEMM of dy with the column matrices, chunked, accumulated in f32; written to
/// `dw` (or added to it with `accumulate`).
///
/// Takes the Context's scratch arena (the caller must not hold it).
///
/// # Safety
/// As [`forward`], for `p`'s operands.
#[allow(dead_code)] // called by the convolution dispatcher
pub(crate) unsafe fn backward_filter(
    ctx: &Context,
    s: &ConvShape,
    dtype: DType,
    p: BwdFilterPtrs,
    accumulate: bool,
) -> Result<()> {
    let plan = steps::backward_filter(s, dtype, ctx.config().conv_workspace_bytes(), accumulate)?;
    log("backward_filter", s, dtype, &plan);
    let ops = Operands {
        x: p.x,
        dy: p.dy,
        dw: p.dw,
        ..Operands::default()
    };
    // SAFETY: the caller's guarantee covers the plan's operands.
    unsafe { execute(ctx, dtype, &plan, ops) }
}

/// Elements of the column matrices of every image of `s` (`n * oh*ow * c_in*kh*kw`), in the
/// layout of [`crate::reference::conv::im2col`].
///
/// Errors: an invalid shape or an overflow (as [`crate::Error::InvalidArgument`]).
pub fn columns_len(s: &ConvShape) -> Result<usize> {
    let d = super::sizes::im2col_dims(s)?;
    d.per_image
        .checked_mul(s.n)
        .ok_or_else(|| Error::invalid("n", "the column matrices' element count overflows usize"))
}

/// The kernels of `kernels/im2col.cu` that [`im2col`] and [`col2im`] launch for `s` in `dtype`
/// when both buffers are 16-byte aligned (fresh allocations are), e.g.
/// `("im2col_nhwc_rows_b2", "col2im_nhwc_f16")` for the f16 NHWC stem with c_in = 3, or
/// `("im2col_nhwc_b16", "col2im_nhwc_v16_f16")` for 64 channels. For benchmarks and logs; the
/// work mappings are described in `docs/CONV-IM2COL.md`.
///
/// Errors: as [`im2col`] for the shape.
///
/// ```
/// use nnfuse::conv::ConvShape;
/// use nnfuse::internals::conv::im2col;
/// use nnfuse::{DType, TensorFormat};
/// let stem = ConvShape {
///     n: 32, c_in: 3, h: 224, w: 224, c_out: 64, kh: 7, kw: 7,
///     stride: (2, 2), pad: (3, 3), dilation: (1, 1), format: TensorFormat::Nhwc,
/// };
/// assert_eq!(im2col::kernel_names(&stem, DType::F16)?.0, "im2col_nhwc_rows_b2");
/// # Ok::<(), nnfuse::Error>(())
/// ```
pub fn kernel_names(s: &ConvShape, dtype: DType) -> Result<(&'static str, &'static str)> {
    let d = super::sizes::im2col_dims(s)?;
    let layout = launch::ColLayout::standard(d.pixels, d.taps);
    let a = launch::im2col(s, layout, dtype.size(), s.n, 0, 0)?;
    let b = launch::col2im(s, dtype, s.n, 0, 0, false)?;
    Ok((a.kernel, b.kernel))
}

/// The lengths `x` and `cols` must have for `s`, as the validator states them.
fn pair_needs(s: &ConvShape) -> Result<(Need, Need)> {
    let want_cols = columns_len(s)?;
    Ok((
        Need::Formula(s.x_len()?, "n*c_in*h*w"),
        Need::Formula(want_cols, "n*oh*ow*c_in*kh*kw"),
    ))
}

/// The column matrices of every image of `s` (nnfuse's im2col kernel): `cols` receives exactly
/// [`crate::reference::conv::im2col`]'s layout — NCHW `[n][K][P]` (Caffe's), NHWC `[n][P][K]`
/// (each pixel's patch contiguous) — with zeros in the padding. A pure copy: bitwise equal to the
/// reference on the same data.
///
/// Errors (nothing is launched): an invalid shape, a buffer length that differs from the
/// problem's (`x`: `n*c_in*h*w`, `cols`: [`columns_len`]), a buffer on another device, `cols`
/// overlapping `x` (all [`crate::Error::InvalidArgument`] naming the argument); a problem
/// beyond the kernels' 32-bit per-image indices ([`crate::Error::NotSupported`]).
pub fn im2col<T, X, C>(ctx: &Context, s: &ConvShape, x: &X, cols: &mut C) -> Result<()>
where
    T: Element,
    X: DevicePtr<T>,
    C: DevicePtrMut<T>,
{
    let (x_need, cols_need) = pair_needs(s)?;
    let mut bind = Binder::new(ctx);
    let xp = bind.input("x", x, x_need)?;
    let cp = bind.output("cols", cols, cols_need)?;
    bind.check(Aliasing::Distinct)?;
    let (oh, ow) = s.out_hw()?;
    let layout = launch::ColLayout::standard(oh * ow, s.c_in * s.kh * s.kw);
    let l = launch::im2col(s, layout, T::DTYPE.size(), s.n, xp, cp)?;
    tracing::debug!(kernel = l.kernel, shape = ?s, grid = ?l.grid, "im2col");
    // SAFETY: both buffers were checked to hold the problem's extents and not to overlap.
    unsafe { launch_cols(ctx, &l, xp, cp) }
}

/// The adjoint of [`im2col`] (nnfuse's col2im kernel, a gather): every element of `x` becomes
/// the sum, in f32 and in a fixed tap order, of the entries of `cols` that read it
/// ([`crate::reference::conv::col2im`]), rounded once to `T`. Deterministic: no atomics.
///
/// Errors: as [`im2col`] (`x` is the output here and must not overlap `cols`).
pub fn col2im<T, C, X>(ctx: &Context, s: &ConvShape, cols: &C, x: &mut X) -> Result<()>
where
    T: Element,
    C: DevicePtr<T>,
    X: DevicePtrMut<T>,
{
    let (x_need, cols_need) = pair_needs(s)?;
    let mut bind = Binder::new(ctx);
    let cp = bind.input("cols", cols, cols_need)?;
    let xp = bind.output("x", x, x_need)?;
    bind.check(Aliasing::Distinct)?;
    let l = launch::col2im(s, T::DTYPE, s.n, cp, xp, false)?;
    tracing::debug!(kernel = l.kernel, shape = ?s, grid = ?l.grid, "col2im");
    // SAFETY: both buffers were checked to hold the problem's extents and not to overlap.
    unsafe { launch_cols(ctx, &l, cp, xp) }
}
