//! The Winograd path, NHWC, 3x3, stride 1, dilation 1: input and filter tiles are transformed
//! (`kernels/winograd.cu`: Bᵀ d B with the zero padding fused in, G g Gᵀ), the whole layer is one
//! batched multiply (one `tiles x C_in` by `C_in x C_out` product per transform position, by the
//! tensor-core GEMM or the Direct batched multiply), and the inverse transform Aᵀ M A writes y.
//! F(2x2, 3x3) and F(4x4, 3x3). The data gradient reuses the forward with the filter rotated by
//! 180 degrees and its channel axes swapped.

#![allow(dead_code, unused_variables)] // skeleton: filled in by the Winograd work

use super::{BwdDataPtrs, ConvShape, FwdPtrs, WinogradEngine, WinogradTile};
use crate::context::Context;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// Forward convolution: transforms the filter, then runs [`forward_prepared`].
///
/// # Safety
/// `p` holds device addresses on `ctx`'s device with the shape's extents of `dtype` elements, `y`
/// disjoint from `x` and `w`, all valid until the queued work completes; the shape is eligible
/// ([`super::sizes::winograd_forward_eligible`]).
pub(crate) unsafe fn forward(
    ctx: &Context,
    s: &ConvShape,
    dtype: DType,
    tile: WinogradTile,
    engine: WinogradEngine,
    p: FwdPtrs,
) -> Result<()> {
    Err(Error::NotSupported(
        "Winograd forward: not implemented yet".into(),
    ))
}

/// Writes the transformed filter G g Gᵀ (`winograd_dims(s, tile).v` elements of `dtype`) to `v`.
///
/// # Safety
/// `w` holds `s.w_len()` elements, `v` the transformed filter's, on `ctx`'s device.
pub(crate) unsafe fn transform_filter(
    ctx: &Context,
    s: &ConvShape,
    dtype: DType,
    tile: WinogradTile,
    w: u64,
    v: u64,
) -> Result<()> {
    Err(Error::NotSupported(
        "Winograd filter transform: not implemented yet".into(),
    ))
}

/// Forward convolution with a filter already transformed by [`transform_filter`]: `p.w` is the
/// transformed filter.
///
/// # Safety
/// As [`forward`], with `p.w` holding the transformed filter.
pub(crate) unsafe fn forward_prepared(
    ctx: &Context,
    s: &ConvShape,
    dtype: DType,
    tile: WinogradTile,
    engine: WinogradEngine,
    p: FwdPtrs,
) -> Result<()> {
    Err(Error::NotSupported(
        "Winograd forward: not implemented yet".into(),
    ))
}

/// Data gradient as a forward Winograd convolution of dy with the rotated, channel-swapped
/// filter (padding `2 - pad`).
///
/// # Safety
/// As [`forward`], for `p`'s operands; the shape passes
/// [`super::sizes::winograd_backward_data_eligible`].
pub(crate) unsafe fn backward_data(
    ctx: &Context,
    s: &ConvShape,
    dtype: DType,
    tile: WinogradTile,
    engine: WinogradEngine,
    p: BwdDataPtrs,
) -> Result<()> {
    Err(Error::NotSupported(
        "Winograd backward data: not implemented yet".into(),
    ))
}
