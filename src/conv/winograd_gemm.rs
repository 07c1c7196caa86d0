//! The Direct batched multiply (`kernels/winograd_gemm.cu`): the seed's non-tensor-core engine
//! for Winograd's batched GEMM — plain shared-memory tiles, f32 accumulation, any sizes.

#![allow(dead_code, unused_variables)] // skeleton: filled in by the Winograd work

use crate::context::Context;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gemm::Problem;

/// Runs `p` (column-major, as [`crate::gemm::strided_batched`]; alpha/beta honoured) with the
/// Direct kernel.
///
/// # Safety
/// `a`, `b`, `c` hold the problem's extents of `dtype` elements on `ctx`'s device (checked by the
/// caller), `c` disjoint from `a` and `b`.
pub(crate) unsafe fn batched_direct(
    ctx: &Context,
    p: &Problem,
    dtype: DType,
    a: u64,
    b: u64,
    c: u64,
) -> Result<()> {
    Err(Error::NotSupported(
        "Direct batched multiply: not implemented yet".into(),
    ))
}
