//! Runs one [`Route`](super::plan::Route) on device addresses the dispatcher has checked: the single place where a
//! route becomes a call of a path's run function, through the table that the registered list
//! (`paths.rs`'s `conv_paths!`) expands into here — a new path needs no edit of this file. Used
//! by the dispatcher's calls and by `auto`'s measurement alike, so both run exactly the same
//! code.

pub(crate) use super::call::{Exec, Target};
use super::call::{PathCall, RunFn};
use super::cudnn::CudnnPtrs;
use super::paths::conv_paths;
use super::plan::{ConvPath, Direction};
use crate::error::Result;

/// The GPU side of the list: each path's run function.
macro_rules! run_fns {
    ($(
        $(#[$doc:meta])*
        $variant:ident = $name:literal $(| $alias:literal)*, auto $rank:literal,
            $(mod $module:ident,)? run $($run:ident)::+, rule $rule:expr;
    )*) => {
        /// The run function of `path`.
        fn run_fn(path: ConvPath) -> RunFn {
            match path {
                $(ConvPath::$variant => super::$($run)::+,)*
            }
        }
    };
}
conv_paths!(run_fns);

/// Queues `e` for direction `d` on the Context's stream. `p` holds the operands by cuDNN's
/// roles: `p.x` is x (forward, filter gradient) or dx (data gradient), `p.w` is w or dw, `p.y`
/// is y or dy. `accumulate` (the gradients only) adds to dx or dw instead of overwriting it; the
/// caller checked that the route can ([`super::plan::ConvPlan::accumulate_refusal`]).
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
    let call = PathCall {
        target: t,
        direction: d,
        exec: e,
        ptrs: p,
        accumulate: accumulate && d != Direction::Forward,
    };
    call.zero_output_under_sanitizer()?;
    // nnfuse's own paths: scratch, grids, launches (a vendor path times its own stages inside).
    crate::profile::stage!(Launch);
    // SAFETY: the caller's contract.
    unsafe { run_fn(e.route.path)(&call) }
}
