//! The cuDNN path's run function: a completed cuDNN route onto [`CudnnConv::run`] with the
//! Context's library workspace (the descriptors and the FFI stay in `cudnn.rs`), replayed from a
//! captured CUDA graph when it repeats an earlier call (`cudnn_graph/replay.rs`: the legacy
//! calls cost 30–60 µs of host time each on the H100's hosts).

use super::call::PathCall;
use super::cudnn::CudnnConv;
use super::problem::CudnnAlgo;
use crate::cudnn_graph::replay;
use crate::cudnn_graph::replay_rule::ReplayKey;
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
    let (mut g, h, ws) = {
        crate::profile::stage!(Workspace);
        let mut g = c.target.ctx.lock()?;
        let h = g.cudnn()?;
        let ws = g.workspace(c.exec.cudnn_ws)?;
        (g, h, ws)
    };
    let key = replay_key(c, algo, ws);
    // SAFETY: the caller's contract (operands checked, on the Context's device); the call goes
    // through the guard's handle only.
    unsafe {
        replay::run(&mut g, h, &conv.replays, key, "legacy convolution", || {
            conv.run(h, algo, c.ptrs, ws, c.exec.cudnn_ws, c.accumulate)
        })
    }
}

/// What a legacy call bakes into a captured graph: the operands, the algorithm (direction, id,
/// math type), the workspace and its size, and whether it adds into its output.
fn replay_key(c: &PathCall<'_>, algo: CudnnAlgo, ws: u64) -> Option<ReplayKey> {
    let p = c.ptrs;
    let call = [
        p.x,
        p.w,
        p.y,
        c.direction.index() as u64,
        u64::from(algo.id),
        u64::from(algo.math.raw()),
        c.exec.cudnn_ws as u64,
    ];
    ReplayKey::new(&call, ws, [f64::from(u8::from(c.accumulate)), 0.0])
}
