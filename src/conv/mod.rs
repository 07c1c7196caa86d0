//! 2-D convolution: cuDNN, im2col + GEMM, NHWC Winograd through one batched GEMM, and a direct
//! kernel, behind one explainable dispatcher.
//!
//! The problem is a [`ConvShape`] (the same struct as [`crate::reference::conv::Conv2d`], whose
//! documentation gives the operation, the output size and the layouts: NCHW with a KCRS filter,
//! NHWC with a KRSC filter).
//!
//! Files and what they may touch:
//! - [`sizes`]: pure arithmetic — eligibility of each path, intermediate sizes, batch chunks
//!   under the workspace cap, the seed's tensor-core rule;
//! - `im2col` / `direct`: launchers of `kernels/im2col.cu` and `kernels/conv_direct.cu`;
//! - `winograd` / `winograd_gemm`: launchers of `kernels/winograd.cu` (transforms) and
//!   `kernels/winograd_gemm.cu` (the Direct batched multiply).
//!
//! The path functions take device addresses that the dispatcher has already checked (lengths,
//! device, aliasing, overflow); they are `unsafe` for that reason and never seen by users.

pub mod sizes;

mod direct;
pub mod im2col;
mod winograd;
mod winograd_gemm;

pub use crate::reference::conv::Conv2d as ConvShape;
pub use sizes::{WinogradEngine, WinogradTile};

/// Device addresses of a forward convolution's operands (checked by the dispatcher).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(dead_code)] // filled in by the convolution paths
pub(crate) struct FwdPtrs {
    /// Input, `shape.x_len()` elements.
    pub x: u64,
    /// Filter, `shape.w_len()` elements.
    pub w: u64,
    /// Output, `shape.y_len()` elements.
    pub y: u64,
}

/// Device addresses of a data-gradient convolution's operands (checked by the dispatcher).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(dead_code)] // filled in by the convolution paths
pub(crate) struct BwdDataPtrs {
    /// Output gradient, `shape.y_len()` elements.
    pub dy: u64,
    /// Filter, `shape.w_len()` elements.
    pub w: u64,
    /// Input gradient (overwritten), `shape.x_len()` elements.
    pub dx: u64,
}

/// Device addresses of a filter-gradient convolution's operands (checked by the dispatcher).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(dead_code)] // filled in by the convolution paths
pub(crate) struct BwdFilterPtrs {
    /// Input, `shape.x_len()` elements.
    pub x: u64,
    /// Output gradient, `shape.y_len()` elements.
    pub dy: u64,
    /// Filter gradient, `shape.w_len()` elements (overwritten, or added to with `accumulate`).
    pub dw: u64,
}
