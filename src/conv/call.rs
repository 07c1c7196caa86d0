//! What a path's run function receives: the problem a route runs on ([`Target`]), the
//! completed route ([`Exec`]) and the operands, in one [`PathCall`]. Every registered path's
//! `raw_run` takes a `&PathCall` (the signature `route.rs` dispatches through); the operands
//! were checked by the dispatcher before.

use super::cudnn::CudnnConv;
use super::plan::{Direction, Route};
use super::problem::{BwdDataPtrs, BwdFilterPtrs, ConvShape, CudnnPtrs, FwdPtrs, WinogradGeometry};
use crate::context::Context;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// A route ready to run: with the workspace its cuDNN algorithm needs, and a Winograd route's
/// geometry (computed once, when the route is completed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Exec {
    /// What runs.
    pub route: Route,
    /// Bytes of the Context's library workspace the cuDNN algorithm needs (0 otherwise).
    pub cudnn_ws: usize,
    /// A Winograd route's tile, equivalent forward problem and sizes (`None` otherwise).
    pub winograd: Option<WinogradGeometry>,
}

/// The problem a route runs on.
pub(crate) struct Target<'a> {
    /// The Context (stream, handles, scratch).
    pub ctx: &'a Context,
    /// The problem.
    pub shape: &'a ConvShape,
    /// Element type.
    pub dtype: DType,
    /// cuDNN's descriptors of the problem, when cuDNN is available to it.
    pub cudnn: Option<&'a CudnnConv>,
}

/// One call of a path: the problem, the direction, the completed route and the operands.
pub(crate) struct PathCall<'a> {
    /// The problem a route runs on.
    pub target: &'a Target<'a>,
    /// Which computation.
    pub direction: Direction,
    /// The completed route.
    pub exec: Exec,
    /// The operands by cuDNN's roles: `x` is x or dx, `w` is w or dw, `y` is y or dy.
    pub ptrs: CudnnPtrs,
    /// Add to dw instead of overwriting it (filter gradient only; false otherwise).
    pub accumulate: bool,
}

/// A registered path's run function.
///
/// # Safety
/// As [`super::route::run`].
pub(crate) type RunFn = unsafe fn(&PathCall<'_>) -> Result<()>;

impl PathCall<'_> {
    /// The operands of a forward convolution.
    pub fn fwd(&self) -> FwdPtrs {
        let p = self.ptrs;
        FwdPtrs {
            x: p.x,
            w: p.w,
            y: p.y,
        }
    }

    /// The operands of a data gradient.
    pub fn bwd_data(&self) -> BwdDataPtrs {
        let p = self.ptrs;
        BwdDataPtrs {
            dy: p.y,
            w: p.w,
            dx: p.x,
        }
    }

    /// The operands of a filter gradient.
    pub fn bwd_filter(&self) -> BwdFilterPtrs {
        let p = self.ptrs;
        BwdFilterPtrs {
            x: p.x,
            dy: p.y,
            dw: p.w,
        }
    }

    /// The error of a path that has no kernel for this direction.
    pub fn no_direction(&self, what: &str) -> Error {
        Error::NotSupported(format!("{what} has no {}", self.direction.describe()))
    }
}
