//! nnfuse's direct convolution kernel (`kernels/conv_direct.cu`): any shape and format, f32
//! accumulation, no workspace. The fallback when nothing else runs, and the reference that the
//! dispatcher's numerical check compares candidates with (its f32-output variant).

#![allow(dead_code, unused_variables)] // skeleton: filled in by the im2col work

use super::{ConvShape, FwdPtrs};
use crate::context::Context;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// Forward convolution, output in `dtype`.
///
/// # Safety
/// `p` holds device addresses on `ctx`'s device with the shape's extents of `dtype` elements, `y`
/// disjoint from `x` and `w`, all valid until the queued work completes.
pub(crate) unsafe fn forward(ctx: &Context, s: &ConvShape, dtype: DType, p: FwdPtrs) -> Result<()> {
    Err(Error::NotSupported(
        "direct forward: not implemented yet".into(),
    ))
}

/// Forward convolution of `dtype` inputs with the output in f32 (not rounded to `dtype`): the
/// reference of the dispatcher's numerical check.
///
/// # Safety
/// As [`forward`]; `y_f32` holds `s.y_len()` f32 elements.
pub(crate) unsafe fn forward_f32_out(
    ctx: &Context,
    s: &ConvShape,
    dtype: DType,
    x: u64,
    w: u64,
    y_f32: u64,
) -> Result<()> {
    Err(Error::NotSupported(
        "direct forward (f32 output): not implemented yet".into(),
    ))
}
