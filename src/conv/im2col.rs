//! The im2col + GEMM path: nnfuse's im2col kernel (`kernels/im2col.cu`) writes the column
//! matrices of a chunk of images into the Context's scratch arena, then one strided batched GEMM
//! per chunk multiplies them with the filter (layouts and GEMM in [`crate::reference::conv`]).
//! Pointwise convolutions skip im2col. Backward: col2im (gather, deterministic) for the data
//! gradient, chunked GEMMs accumulated in f32 for the filter gradient.

#![allow(dead_code, unused_variables)] // skeleton: filled in by the im2col work

use super::{BwdDataPtrs, BwdFilterPtrs, ConvShape, FwdPtrs};
use crate::context::Context;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// Forward convolution by im2col + GEMM, chunked under the Context's workspace cap.
///
/// # Safety
/// `p` holds device addresses on `ctx`'s device with the shape's extents of `dtype` elements, `y`
/// disjoint from `x` and `w`, all valid until the queued work completes.
pub(crate) unsafe fn forward(ctx: &Context, s: &ConvShape, dtype: DType, p: FwdPtrs) -> Result<()> {
    Err(Error::NotSupported(
        "im2col forward: not implemented yet".into(),
    ))
}

/// Data gradient: GEMM of the filter with dy into column matrices, then col2im (gather).
///
/// # Safety
/// As [`forward`], for `p`'s operands.
pub(crate) unsafe fn backward_data(
    ctx: &Context,
    s: &ConvShape,
    dtype: DType,
    p: BwdDataPtrs,
) -> Result<()> {
    Err(Error::NotSupported(
        "im2col backward data: not implemented yet".into(),
    ))
}

/// Filter gradient: GEMM of dy with the column matrices, chunked, accumulated in f32; written to
/// `dw` (or added to it with `accumulate`).
///
/// # Safety
/// As [`forward`], for `p`'s operands.
pub(crate) unsafe fn backward_filter(
    ctx: &Context,
    s: &ConvShape,
    dtype: DType,
    p: BwdFilterPtrs,
    accumulate: bool,
) -> Result<()> {
    Err(Error::NotSupported(
        "im2col backward filter: not implemented yet".into(),
    ))
}
