//! Each stage of nnfuse's Winograd convolution on its own, validated and safe: the input, filter
//! and output transforms, the batched multiply by either engine, the whole path, and the Direct
//! batched multiply on any GEMM problem. For benchmarks (`benches/winograd.rs` times every stage
//! against its memory or FLOP floor and compares the two engines), and for callers who want the
//! transformed tensors themselves. Framework code should call the convolution dispatcher instead.
//!
//! Shapes are [`ConvShape`]s that pass `crate::conv::problem::winograd_forward_eligible` (NHWC,
//! 3x3, stride 1, dilation 1); the stage functions work on the whole batch at once (no chunking:
//! the caller allocates `U` and `M` for all images, sized by [`crate::conv::problem::winograd_dims`]:
//! `n * u_per_image`, `n * m_per_image`, `v`). Layouts are those of
//! [`crate::reference::winograd`], whose functions are the f64 reference of each stage.
//! [`forward`] and [`backward_data`] run the path exactly as the dispatcher does (chunked under
//! [`crate::Config::conv_workspace_bytes`], intermediates in the Context's scratch).
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use nnfuse::conv::{ConvShape, WinogradEngine, WinogradTile};
//! use nnfuse::internals::conv::{winograd_dims, winograd_stages as wg};
//! use nnfuse::TensorFormat;
//! let ctx = nnfuse::Context::new(0)?;
//! let s = ConvShape { n: 32, c_in: 64, h: 56, w: 56, c_out: 64, kh: 3, kw: 3, stride: (1, 1),
//!                     pad: (1, 1), dilation: (1, 1), format: TensorFormat::Nhwc };
//! let st = ctx.stream();
//! let x = st.alloc_zeros::<half::f16>(s.x_len()?)?;
//! let w = st.alloc_zeros::<half::f16>(s.w_len()?)?;
//! let mut y = st.alloc_zeros::<half::f16>(s.y_len()?)?;
//! wg::forward(&ctx, &s, WinogradTile::F4x3, WinogradEngine::TensorCore, &x, &w, &mut y)?;
//! // Or stage by stage:
//! let d = winograd_dims(&s, WinogradTile::F4x3)?;
//! let mut v = st.alloc_zeros::<half::f16>(d.v)?;
//! let mut u = st.alloc_zeros::<half::f16>(s.n * d.u_per_image)?;
//! let mut m = st.alloc_zeros::<half::f16>(s.n * d.m_per_image)?;
//! wg::filter_transform(&ctx, &s, WinogradTile::F4x3, &w, &mut v)?;
//! wg::input_transform(&ctx, &s, WinogradTile::F4x3, &x, &mut u, None)?;
//! wg::batched_multiply(&ctx, &s, WinogradTile::F4x3, WinogradEngine::Direct, &v, &u, &mut m)?;
//! wg::output_transform(&ctx, &s, WinogradTile::F4x3, &m, &mut y, None)?;
//! # Ok(()) }
//! ```

use cudarc::driver::{DevicePtr, DevicePtrMut};

pub use super::launch::{stage_bytes, Chunking, StageBytes, L2_SHARE, MIN_CHUNK_TILES};
use super::launch::{transform_kernel, vec_widths, Stage};
use crate::context::Context;
use crate::conv::problem::{
    winograd_backward_data_eligible, winograd_forward_eligible, WinogradGeometry,
};
use crate::conv::{BwdDataPtrs, ConvShape, Direction, FwdPtrs, WinogradEngine, WinogradTile};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::gemm::{check_operands, Problem, Validated};
use crate::validate::{Aliasing, Binder, Need};

/// Channels per thread the transform kernels of `dtype` exist for, widest first (16-byte
/// accesses first). The default is not always the widest: each (stage, tile, type) has a
/// measured order of preference, and the first width that divides the channel count and the
/// pointers' alignment allows runs (`docs/WINOGRAD.md`, "Transform widths").
pub fn vector_widths(dtype: DType) -> &'static [usize] {
    vec_widths(dtype)
}

/// The transform kernel a width runs (for reports), `None` if there is none.
pub fn transform_kernel_name(
    dtype: DType,
    tile: WinogradTile,
    output: bool,
    vec: usize,
) -> Option<&'static str> {
    let stage = if output { Stage::Output } else { Stage::Input };
    transform_kernel(stage, dtype, tile, vec)
}

/// The forward geometry of `s` with `tile` (computed once per call, at the entry of each stage
/// function, and handed down), or an error naming `shape` when `s` is not a Winograd problem.
fn eligible(s: &ConvShape, tile: WinogradTile) -> Result<WinogradGeometry> {
    winograd_forward_eligible(s)
        .map_err(|why| Error::invalid("shape", format!("not a Winograd convolution: {why}")))?;
    WinogradGeometry::forward(s, tile)
}

/// The data-gradient geometry of `s` with `tile`, or an error naming `shape`.
fn eligible_backward(s: &ConvShape, tile: WinogradTile) -> Result<WinogradGeometry> {
    winograd_forward_eligible(s)
        .map_err(|why| Error::invalid("shape", format!("not a Winograd convolution: {why}")))?;
    winograd_backward_data_eligible(s).map_err(|why| Error::invalid("shape", why))?;
    WinogradGeometry::new(s, Direction::BackwardData, tile)?
        .ok_or_else(|| Error::invalid("shape", "no Winograd data gradient"))
}

/// A buffer's required length and what it means (the error's text).
fn len(want: usize, what: &'static str) -> Need {
    Need::Exactly(want, what)
}

fn n_times(n: usize, per: usize) -> Result<usize> {
    n.checked_mul(per)
        .ok_or_else(|| Error::invalid("n", "the batch's transformed tensors overflow usize"))
}

/// The input transform of the whole batch: `U[pos][t][c_in]` (`n * u_per_image` elements) from
/// x (NHWC, `s.x_len()` elements), zero padding fused. `vec`: channels per thread (one of
/// [`vector_widths`] dividing `c_in`), `None` for the default. Returns the width used.
pub fn input_transform<T, X, U>(
    ctx: &Context,
    s: &ConvShape,
    tile: WinogradTile,
    x: &X,
    u: &mut U,
    vec: Option<usize>,
) -> Result<usize>
where
    T: Element,
    X: DevicePtr<T>,
    U: DevicePtrMut<T>,
{
    let g = eligible(s, tile)?;
    let d = &g.dims;
    let want_u = n_times(s.n, d.u_per_image)?;
    let mut bind = Binder::new(ctx);
    let px = bind.input("x", x, len(s.x_len()?, "n * h * w * c_in"))?;
    let pu = bind.output("u", u, len(want_u, "n * u_per_image"))?;
    bind.check(Aliasing::Distinct)?;
    // SAFETY: lengths, device and disjointness checked above.
    unsafe { super::input_transform(ctx, &g, T::DTYPE, px, pu, s.n, vec) }
}

/// The output transform of the whole batch: y (NHWC, `s.y_len()` elements) from the product
/// `M[pos][t][c_out]` (`n * m_per_image` elements), clipped at the image edge. `vec` as
/// [`input_transform`]. Returns the width used.
pub fn output_transform<T, M, Y>(
    ctx: &Context,
    s: &ConvShape,
    tile: WinogradTile,
    m: &M,
    y: &mut Y,
    vec: Option<usize>,
) -> Result<usize>
where
    T: Element,
    M: DevicePtr<T>,
    Y: DevicePtrMut<T>,
{
    let g = eligible(s, tile)?;
    let d = &g.dims;
    let want_m = n_times(s.n, d.m_per_image)?;
    let want_y = s.y_len()?;
    let mut bind = Binder::new(ctx);
    let pm = bind.input("m", m, len(want_m, "n * m_per_image"))?;
    let py = bind.output("y", y, len(want_y, "n * oh * ow * c_out"))?;
    bind.check(Aliasing::Distinct)?;
    // SAFETY: lengths, device and disjointness checked above.
    unsafe { super::output_transform(ctx, &g, T::DTYPE, pm, py, s.n, vec) }
}

/// The filter transform: `V[pos][c_in][c_out]` (`v` elements of
/// [`crate::conv::problem::winograd_dims`]) from the KRSC filter (`s.w_len()` elements).
pub fn filter_transform<T, W, V>(
    ctx: &Context,
    s: &ConvShape,
    tile: WinogradTile,
    w: &W,
    v: &mut V,
) -> Result<()>
where
    T: Element,
    W: DevicePtr<T>,
    V: DevicePtrMut<T>,
{
    let g = eligible(s, tile)?;
    let d = &g.dims;
    let mut bind = Binder::new(ctx);
    let pw = bind.input("w", w, len(s.w_len()?, "c_out * 3 * 3 * c_in"))?;
    let pv = bind.output("v", v, len(d.v, "positions * c_in * c_out"))?;
    bind.check(Aliasing::Distinct)?;
    // SAFETY: lengths, device and disjointness checked above.
    unsafe { super::transform_filter(ctx, &g, T::DTYPE, pw, pv) }
}

/// The data gradient's filter transform: `V'[pos][c_out][c_in]` of the filter rotated by 180
/// degrees with its channel axes swapped (`v` elements), from `s`'s KRSC filter.
pub fn filter_transform_backward_data<T, W, V>(
    ctx: &Context,
    s: &ConvShape,
    tile: WinogradTile,
    w: &W,
    v: &mut V,
) -> Result<()>
where
    T: Element,
    W: DevicePtr<T>,
    V: DevicePtrMut<T>,
{
    let g = eligible_backward(s, tile)?;
    let d = &g.dims;
    let mut bind = Binder::new(ctx);
    let pw = bind.input("w", w, len(s.w_len()?, "c_out * 3 * 3 * c_in"))?;
    let pv = bind.output("v", v, len(d.v, "positions * c_in * c_out"))?;
    bind.check(Aliasing::Distinct)?;
    // SAFETY: lengths, device and disjointness checked above.
    unsafe { super::transform_filter_backward_data(ctx, s, &g, T::DTYPE, pw, pv) }
}

/// The batched multiply of the whole batch by `engine`: `M_pos = U_pos · V_pos` for every
/// position (`n * tiles_per_image` tiles). [`WinogradEngine::Fused`] has no separate multiply
/// (an `InvalidArgument` naming `engine`): its kernel is the whole forward ([`forward`]).
pub fn batched_multiply<T, V, U, M>(
    ctx: &Context,
    s: &ConvShape,
    tile: WinogradTile,
    engine: WinogradEngine,
    v: &V,
    u: &U,
    m: &mut M,
) -> Result<()>
where
    T: Element,
    V: DevicePtr<T>,
    U: DevicePtr<T>,
    M: DevicePtrMut<T>,
{
    let g = eligible(s, tile)?;
    let d = &g.dims;
    let want_m = n_times(s.n, d.m_per_image)?;
    let want_u = n_times(s.n, d.u_per_image)?;
    let mut bind = Binder::new(ctx);
    let pv = bind.input("v", v, len(d.v, "positions * c_in * c_out"))?;
    let pu = bind.input("u", u, len(want_u, "n * u_per_image"))?;
    let pm = bind.output("m", m, len(want_m, "n * m_per_image"))?;
    bind.check(Aliasing::Distinct)?;
    let tiles = n_times(s.n, d.tiles_per_image)?;
    // SAFETY: lengths, device and disjointness checked above.
    unsafe { super::multiply(ctx, &g, T::DTYPE, engine, pv, pu, pm, tiles) }
}

/// The whole Winograd forward convolution as the dispatcher runs it: x (NHWC), w (KRSC) → y,
/// chunked under the Context's convolution workspace cap (the fused engine keeps only the
/// transformed filter in the scratch and needs no chunks).
pub fn forward<T, X, W, Y>(
    ctx: &Context,
    s: &ConvShape,
    tile: WinogradTile,
    engine: WinogradEngine,
    x: &X,
    w: &W,
    y: &mut Y,
) -> Result<()>
where
    T: Element,
    X: DevicePtr<T>,
    W: DevicePtr<T>,
    Y: DevicePtrMut<T>,
{
    let g = eligible(s, tile)?;
    let want_y = s.y_len()?;
    let mut bind = Binder::new(ctx);
    let px = bind.input("x", x, len(s.x_len()?, "n * h * w * c_in"))?;
    let pw = bind.input("w", w, len(s.w_len()?, "c_out * 3 * 3 * c_in"))?;
    let py = bind.output("y", y, len(want_y, "n * oh * ow * c_out"))?;
    bind.check(Aliasing::Distinct)?;
    let p = FwdPtrs {
        x: px,
        w: pw,
        y: py,
    };
    // SAFETY: lengths, device and disjointness checked above.
    unsafe { super::forward(ctx, &g, T::DTYPE, engine, p) }
}

/// [`forward`] with an explicit batch-splitting strategy (the path's default is
/// [`Chunking::WorkspaceCap`]), for comparing strategies.
#[allow(clippy::too_many_arguments)] // forward's arguments plus the strategy
pub fn forward_chunked<T, X, W, Y>(
    ctx: &Context,
    s: &ConvShape,
    tile: WinogradTile,
    engine: WinogradEngine,
    x: &X,
    w: &W,
    y: &mut Y,
    chunking: Chunking,
) -> Result<()>
where
    T: Element,
    X: DevicePtr<T>,
    W: DevicePtr<T>,
    Y: DevicePtrMut<T>,
{
    let g = eligible(s, tile)?;
    let want_y = s.y_len()?;
    let mut bind = Binder::new(ctx);
    let px = bind.input("x", x, len(s.x_len()?, "n * h * w * c_in"))?;
    let pw = bind.input("w", w, len(s.w_len()?, "c_out * 3 * 3 * c_in"))?;
    let py = bind.output("y", y, len(want_y, "n * oh * ow * c_out"))?;
    bind.check(Aliasing::Distinct)?;
    let p = FwdPtrs {
        x: px,
        w: pw,
        y: py,
    };
    // SAFETY: lengths, device and disjointness checked above.
    unsafe { super::forward_chunked(ctx, &g, T::DTYPE, engine, p, chunking) }
}

/// The Winograd forward with a filter already transformed by [`filter_transform`] (`v`,
/// `V[pos][c_in][c_out]`): what `Conv2d::forward_prepared` runs on a Winograd route; with
/// [`WinogradEngine::Fused`] it is the fused kernel alone.
pub fn forward_prepared<T, X, V, Y>(
    ctx: &Context,
    s: &ConvShape,
    tile: WinogradTile,
    engine: WinogradEngine,
    x: &X,
    v: &V,
    y: &mut Y,
) -> Result<()>
where
    T: Element,
    X: DevicePtr<T>,
    V: DevicePtr<T>,
    Y: DevicePtrMut<T>,
{
    let g = eligible(s, tile)?;
    let d = &g.dims;
    let want_y = s.y_len()?;
    let mut bind = Binder::new(ctx);
    let px = bind.input("x", x, len(s.x_len()?, "n * h * w * c_in"))?;
    let pv = bind.input("v", v, len(d.v, "positions * c_in * c_out"))?;
    let py = bind.output("y", y, len(want_y, "n * oh * ow * c_out"))?;
    bind.check(Aliasing::Distinct)?;
    let p = FwdPtrs {
        x: px,
        w: pv,
        y: py,
    };
    // SAFETY: lengths, device and disjointness checked above.
    unsafe { super::forward_prepared(ctx, &g, T::DTYPE, engine, p) }
}

/// How the path splits a batch: what [`plan_chunks`] answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkSummary {
    /// Images of each chunk, in order (sizes differ by at most one).
    pub chunks: Vec<usize>,
    /// Scratch bytes the path takes (the transformed filter unless prepared, and the largest
    /// chunk's transformed input and product, each region 256-byte aligned).
    pub scratch_bytes: usize,
    /// Whether the L2 rule, not the workspace cap, set the chunk size.
    pub l2_limited: bool,
}

/// The chunks and scratch bytes of a Winograd run of `s` (pure; for plans and reports):
/// `cap_bytes` is the convolution workspace cap ([`crate::Config::conv_workspace_bytes`]),
/// `prepared` whether the transformed filter comes from the caller (then it is not in the
/// scratch). Errors: an ineligible shape, or one image that does not fit the cap
/// ([`Error::NotSupported`], saying so).
pub fn plan_chunks(
    s: &ConvShape,
    tile: WinogradTile,
    dtype: DType,
    cap_bytes: usize,
    chunking: Chunking,
    prepared: bool,
) -> Result<ChunkSummary> {
    let g = eligible(s, tile)?;
    let p = super::launch::chunk_plan(&g, dtype.size(), cap_bytes, !prepared, chunking)?;
    Ok(ChunkSummary {
        chunks: p.chunks,
        scratch_bytes: p.layout.bytes,
        l2_limited: p.l2_limited,
    })
}

/// The chunking the path uses on this Context by default.
pub fn default_chunking(ctx: &Context) -> Chunking {
    super::default_chunking(ctx)
}

/// The Winograd data gradient as the dispatcher runs it: dy (NHWC, `s`'s output), w (KRSC) →
/// dx (`s`'s input). Needs padding at most 2 per axis.
pub fn backward_data<T, G, W, DX>(
    ctx: &Context,
    s: &ConvShape,
    tile: WinogradTile,
    engine: WinogradEngine,
    dy: &G,
    w: &W,
    dx: &mut DX,
) -> Result<()>
where
    T: Element,
    G: DevicePtr<T>,
    W: DevicePtr<T>,
    DX: DevicePtrMut<T>,
{
    let g = eligible_backward(s, tile)?;
    let want_dy = s.y_len()?;
    let mut bind = Binder::new(ctx);
    let pg = bind.input("dy", dy, len(want_dy, "n * oh * ow * c_out"))?;
    let pw = bind.input("w", w, len(s.w_len()?, "c_out * 3 * 3 * c_in"))?;
    let px = bind.output("dx", dx, len(s.x_len()?, "n * h * w * c_in"))?;
    bind.check(Aliasing::Distinct)?;
    let p = BwdDataPtrs {
        dy: pg,
        w: pw,
        dx: px,
    };
    // SAFETY: lengths, device and disjointness checked above.
    unsafe { super::backward_data(ctx, s, &g, T::DTYPE, engine, p) }
}

/// The Direct batched multiply on any strided batched GEMM problem (column-major, transposes,
/// alpha/beta, as [`crate::gemm::strided_batched`], validated the same way), for comparing the
/// two engines on the same problem.
pub fn direct_gemm<T, A, B, C>(ctx: &Context, p: &Problem, a: &A, b: &B, c: &mut C) -> Result<()>
where
    T: Element,
    A: DevicePtr<T>,
    B: DevicePtr<T>,
    C: DevicePtrMut<T>,
{
    let spans = match p.check_buffers(T::DTYPE, a.len(), b.len(), c.len())? {
        Validated::Empty => return Ok(()),
        Validated::Spans(s) => s,
    };
    let mut bind = Binder::new(ctx);
    let pa = bind.input("a", a, Need::Span(spans.a))?;
    let pb = bind.input("b", b, Need::Span(spans.b))?;
    let pc = bind.output("c", c, Need::Span(spans.c))?;
    check_operands(bind.operands())?;
    // SAFETY: the problem fits the buffers (check_buffers), they live on the Context's device
    // and C overlaps neither A nor B.
    unsafe { crate::conv::winograd_gemm::batched_direct(ctx, p, T::DTYPE, pa, pb, pc) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::TensorFormat;

    #[test]
    fn plan_chunks_reports_what_the_path_will_do() {
        let s = crate::testutil::square_conv(32, 64, 56, 64, 3, TensorFormat::Nhwc);
        let l2 = Chunking::L2Resident { l2_bytes: 50 << 20 };
        let p = plan_chunks(&s, WinogradTile::F4x3, DType::F16, 256 << 20, l2, false).unwrap();
        assert_eq!(p.chunks, vec![11, 11, 10]);
        assert!(p.l2_limited);
        let q = plan_chunks(
            &s,
            WinogradTile::F4x3,
            DType::F16,
            256 << 20,
            Chunking::WorkspaceCap,
            false,
        )
        .unwrap();
        assert_eq!((q.chunks, q.l2_limited), (vec![32], false));
        assert!(q.scratch_bytes > p.scratch_bytes);
        // A prepared filter is not in the scratch.
        let r = plan_chunks(
            &s,
            WinogradTile::F4x3,
            DType::F16,
            256 << 20,
            Chunking::WorkspaceCap,
            true,
        )
        .unwrap();
        assert!(r.scratch_bytes < q.scratch_bytes);
        let mut bad = s;
        bad.stride = (2, 2);
        let e = plan_chunks(&bad, WinogradTile::F4x3, DType::F16, 1 << 30, l2, false).unwrap_err();
        assert_eq!(e.argument(), Some("shape"));
        let e = plan_chunks(&s, WinogradTile::F4x3, DType::F16, 1 << 10, l2, false).unwrap_err();
        assert!(e.to_string().contains("workspace cap"), "{e}");
    }
}
