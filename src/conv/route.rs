//! Runs one [`Route`] on device addresses the dispatcher has checked: the single place where a
//! route becomes a call of a path function (cuDNN, im2col + GEMM, Winograd, direct). Used by the
//! dispatcher's calls and by `auto`'s measurement alike, so both run exactly the same code.

use super::cudnn::{CudnnConv, CudnnPtrs};
use super::plan::{ConvPath, Direction, Route};
use super::{direct, im2col, winograd, BwdDataPtrs, BwdFilterPtrs, ConvShape, FwdPtrs};
use crate::context::Context;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// A route ready to run: with the workspace its cuDNN algorithm needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Exec {
    /// What runs.
    pub route: Route,
    /// Bytes of the Context's library workspace the cuDNN algorithm needs (0 otherwise).
    pub cudnn_ws: usize,
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

/// Queues `e` for direction `d` on the Context's stream. `p` holds the operands by cuDNN's
/// roles: `p.x` is x (forward, filter gradient) or dx (data gradient), `p.w` is w or dw, `p.y`
/// is y or dy. `accumulate` (filter gradient only) adds to dw instead of overwriting it.
///
/// # Safety
/// The addresses are on the Context's device and hold the problem's extents of `dtype`
/// elements; the output is disjoint from the inputs; all stay valid until the queued work
/// completes.
pub(crate) unsafe fn run(
    t: &Target<'_>,
    d: Direction,
    e: Exec,
    p: CudnnPtrs,
    accumulate: bool,
) -> Result<()> {
    let (ctx, s, dtype, cudnn) = (t.ctx, t.shape, t.dtype, t.cudnn);
    let r = e.route;
    let accumulate = accumulate && d == Direction::BackwardFilter;
    match r.path {
        ConvPath::Cudnn => {
            let conv = cudnn.ok_or_else(|| {
                Error::NotSupported("the cuDNN route has no cuDNN descriptors".into())
            })?;
            let algo = r.cudnn_algo.ok_or_else(|| {
                Error::NotSupported("the cuDNN route has no algorithm chosen".into())
            })?;
            if algo.direction != d {
                return Err(Error::invalid(
                    "route",
                    format!(
                        "cuDNN algorithm {} is a {} algorithm, the call is {}",
                        algo.label(),
                        algo.direction,
                        d
                    ),
                ));
            }
            let mut g = ctx.lock()?;
            let h = g.cudnn()?;
            let ws = g.workspace(e.cudnn_ws)?;
            conv.run(h, algo, p, ws, e.cudnn_ws, accumulate)
        }
        ConvPath::Im2colGemm => match d {
            Direction::Forward => im2col::forward(
                ctx,
                s,
                dtype,
                FwdPtrs {
                    x: p.x,
                    w: p.w,
                    y: p.y,
                },
            ),
            Direction::BackwardData => im2col::backward_data(
                ctx,
                s,
                dtype,
                BwdDataPtrs {
                    dy: p.y,
                    w: p.w,
                    dx: p.x,
                },
            ),
            Direction::BackwardFilter => im2col::backward_filter(
                ctx,
                s,
                dtype,
                BwdFilterPtrs {
                    x: p.x,
                    dy: p.y,
                    dw: p.w,
                },
                accumulate,
            ),
        },
        ConvPath::WinogradF2x3 | ConvPath::WinogradF4x3 => {
            let tile = r
                .path
                .winograd_tile()
                .ok_or_else(|| Error::NotSupported(format!("{} is not a Winograd path", r.path)))?;
            let engine = r.engine.ok_or_else(|| {
                Error::NotSupported("the Winograd route has no engine chosen".into())
            })?;
            match d {
                Direction::Forward => winograd::forward(
                    ctx,
                    s,
                    dtype,
                    tile,
                    engine,
                    FwdPtrs {
                        x: p.x,
                        w: p.w,
                        y: p.y,
                    },
                ),
                Direction::BackwardData => winograd::backward_data(
                    ctx,
                    s,
                    dtype,
                    tile,
                    engine,
                    BwdDataPtrs {
                        dy: p.y,
                        w: p.w,
                        dx: p.x,
                    },
                ),
                Direction::BackwardFilter => Err(Error::NotSupported(
                    "Winograd has no filter gradient".into(),
                )),
            }
        }
        ConvPath::Direct => match d {
            Direction::Forward => direct::forward(
                ctx,
                s,
                dtype,
                FwdPtrs {
                    x: p.x,
                    w: p.w,
                    y: p.y,
                },
            ),
            _ => Err(Error::NotSupported(format!(
                "the direct kernel has no {}",
                d.describe()
            ))),
        },
    }
}
