//! The cuDNN path's run function: a completed cuDNN route onto [`CudnnConv::run`] with the
//! Context's library workspace (the descriptors and the FFI stay in `cudnn.rs`).

use super::call::PathCall;
use super::cudnn::CudnnConv;
use crate::error::{Error, Result};

/// Runs a cuDNN route (registered in `paths.rs`).
///
/// # Safety
/// As [`super::route::run`].
pub(crate) unsafe fn raw_run(c: &PathCall<'_>) -> Result<()> {
    let (r, d) = (c.exec.route, c.direction);
    let conv: &CudnnConv = c
        .target
        .cudnn
        .ok_or_else(|| Error::NotSupported("the cuDNN route has no cuDNN descriptors".into()))?;
    let algo = r
        .cudnn_algo
        .ok_or_else(|| Error::NotSupported("the cuDNN route has no algorithm chosen".into()))?;
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
    // The guard holds the Context's lock across the call.
    let (_lock, h, ws) = {
        crate::profile::stage!(Workspace);
        let mut g = c.target.ctx.lock()?;
        let h = g.cudnn()?;
        let ws = g.workspace(c.exec.cudnn_ws)?;
        (g, h, ws)
    };
    crate::profile::stage!(Vendor);
    // SAFETY: the caller's contract (operands checked, on the Context's device).
    unsafe { conv.run(h, algo, c.ptrs, ws, c.exec.cudnn_ws, c.accumulate) }
}
