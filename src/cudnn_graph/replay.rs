//! Replays of cuDNN calls from captured CUDA graphs — graph-API plans' executions and the legacy
//! convolution and BatchNorm calls ([`run`]) — (the decisions: `replay_rule.rs`). A capture
//! records one cuDNN call (`cudnnBackendExecute` or a legacy entry point) on the Context's capture-only
//! stream — the plan's cuDNN handle is pointed at it meanwhile, under the Context's lock — so
//! that work other threads queue on the Context's stream is never taken into it; the graph is
//! then launched on the Context's stream, in order with everything else there.
//!
//! A replay is the execution it was captured from, with the same addresses, workspace and
//! scalars (the key): the kernels and their arguments are cuDNN's own. While the Context's
//! stream is itself capturing (`Context::capture`), executions run eagerly, so that the
//! framework's graph holds them. `NNFUSE_CUDNN_REPLAY=0` turns replays off.

use std::cell::Cell;
use std::sync::Mutex;

use cudarc::cudnn::{result as cudnn_result, sys};
use cudarc::driver::{result as drv_result, sys as drv};

use crate::context::Locked;
use crate::error::{CallExt, Result};

use super::plans::lock;
use super::replay_rule::{Next, ReplayKey, ReplaySlots};

/// An instantiated CUDA graph of one execution.
#[derive(Debug)]
pub(crate) struct Exec(drv::CUgraphExec);

// SAFETY: a graph exec may be launched and destroyed from any thread; the plan's mutex makes it
// one thread at a time.
unsafe impl Send for Exec {}

impl Drop for Exec {
    fn drop(&mut self) {
        // CUDA frees an executable graph still in flight once its launches complete.
        // SAFETY: instantiated once by `capture`, destroyed once here.
        let _ = unsafe { drv_result::graph::exec_destroy(self.0) };
    }
}

thread_local! {
    /// Measurements and first-call decisions running on this thread ([`suspended`]).
    static MEASURING: Cell<u32> = const { Cell::new(0) };
}

/// Runs `f` with replays suspended on this thread: executions inside run eagerly and are not
/// remembered. A measurement's candidates (`timing.rs`) and a first-call decision's checks run a
/// few times each and most are thrown away: capturing them would cost host time inside the
/// decision's budget and keep a graph per candidate. The GPU time of an execution and of its
/// replay are the same kernels'.
pub(crate) fn suspended<R>(f: impl FnOnce() -> R) -> R {
    struct Resume;
    impl Drop for Resume {
        fn drop(&mut self) {
            MEASURING.with(|m| m.set(m.get().saturating_sub(1)));
        }
    }
    MEASURING.with(|m| m.set(m.get() + 1));
    let _resume = Resume;
    f()
}

fn is_suspended() -> bool {
    MEASURING.with(|m| m.get() > 0)
}

/// One plan's replay slots.
pub(crate) type Replays = ReplaySlots<Exec>;

/// What [`before_execute`] decided.
pub(crate) enum Replayed {
    /// Launched: the execution is queued, nothing else to do.
    Done,
    /// To execute eagerly.
    Eager,
    /// To capture (its key's second call), then launch.
    Capture,
}

/// Decides an execution of `key` (`None`: never replayed) and launches its graph when one is
/// kept ([`Replayed::Done`]). The guard's Context's `cudnn_replay` says whether at all; inside a
/// measurement or decision ([`suspended`]) every execution runs eagerly. `what` names the plan
/// in events. Whatever else it returns goes to [`finish`] with the prepared execution.
///
/// # Safety
/// The guard's stream is live; a kept graph's addresses are `key`'s (valid for the call).
pub(crate) unsafe fn before_execute(
    g: &Locked<'_>,
    replays: &mut Replays,
    key: Option<&ReplayKey>,
    what: &'static str,
) -> Result<Replayed> {
    if !g.context().config().cudnn_replay || is_suspended() {
        return Ok(Replayed::Eager);
    }
    let next = replays.next(key);
    if next == Next::Eager {
        return Ok(Replayed::Eager);
    }
    // A framework's own capture must hold the execution itself (it cannot take our launch).
    let stream = g.context().stream().cu_stream();
    let status = drv_result::stream::is_capturing(stream).call("cuStreamIsCapturing")?;
    if status != drv::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
        return Ok(Replayed::Eager);
    }
    match next {
        Next::Replay(i) => {
            let Some(exec) = replays.graph(i) else {
                return Ok(Replayed::Eager);
            };
            crate::profile::stage!(Vendor);
            tracing::trace!(plan = what, "cuDNN execution replayed");
            drv_result::graph::launch(exec.0, stream).call("cuGraphLaunch")?;
            Ok(Replayed::Done)
        }
        _ => Ok(Replayed::Capture),
    }
}

/// Queues `execute` — one cuDNN call through `handle`, the guard's — as [`before_execute`]
/// decided: captured for `key` and launched ([`Replayed::Capture`]; executed if the capture
/// fails), or executed. Nothing for [`Replayed::Done`].
///
/// # Safety
/// As [`before_execute`]; `execute` queues only through `handle` and is safe to call (its own
/// contract checked by the caller).
pub(crate) unsafe fn finish(
    next: Replayed,
    g: &mut Locked<'_>,
    handle: sys::cudnnHandle_t,
    replays: &mut Replays,
    key: Option<&ReplayKey>,
    what: &'static str,
    execute: impl Fn() -> Result<()>,
) -> Result<()> {
    let launched = match (next, key) {
        (Replayed::Done, _) => true,
        (Replayed::Capture, Some(key)) => {
            capture_and_launch(g, handle, replays, key, what, &execute)?
        }
        _ => false,
    };
    if launched {
        return Ok(());
    }
    crate::profile::stage!(Vendor);
    execute()
}

/// [`before_execute`] then [`finish`], for a call that needs nothing prepared (a legacy call)
/// and keeps its slots in `replays`.
///
/// # Safety
/// As [`finish`].
pub(crate) unsafe fn run(
    g: &mut Locked<'_>,
    handle: sys::cudnnHandle_t,
    replays: &Mutex<Replays>,
    key: Option<ReplayKey>,
    what: &'static str,
    execute: impl Fn() -> Result<()>,
) -> Result<()> {
    let mut slots = lock(replays);
    let next = before_execute(g, &mut slots, key.as_ref(), what)?;
    finish(next, g, handle, &mut slots, key.as_ref(), what, execute)
}

/// Captures `execute` (one cuDNN call through `handle`) for `key`, keeps the graph and launches
/// it. `Ok(false)`: the capture failed — replays are off for this plan from now on (a warning
/// says why) and the caller executes eagerly; nothing was queued.
///
/// # Safety
/// `handle` is the guard's cuDNN handle; `execute` queues only through it.
unsafe fn capture_and_launch(
    g: &mut Locked<'_>,
    handle: sys::cudnnHandle_t,
    replays: &mut Replays,
    key: &ReplayKey,
    what: &'static str,
    execute: impl FnOnce() -> Result<()>,
) -> Result<bool> {
    let started = std::time::Instant::now();
    let side = g.capture_stream()?;
    let main = g.context().stream().cu_stream();
    let exec = match capture_on(handle, side, main, execute)? {
        Ok(exec) => exec,
        Err(why) => {
            tracing::warn!(plan = what, error = %why,
                "cuDNN execution cannot be captured for replay; it runs eagerly from now on");
            replays.turn_off("a capture failed (see the warning)");
            return Ok(false);
        }
    };
    drv_result::graph::launch(exec.0, main).call("cuGraphLaunch")?;
    replays.keep(key, exec);
    tracing::debug!(
        plan = what,
        captured = replays.captured(),
        capture_us = started.elapsed().as_secs_f64() * 1e6,
        "cuDNN execution captured; later calls with the same buffers replay it"
    );
    Ok(true)
}

/// Points `handle` at `side`, captures `execute` there, points it back at `main`, instantiates.
/// The outer error: `handle`'s stream could not be set (nothing else may run then); the inner
/// one: the capture or the instantiation failed.
unsafe fn capture_on(
    handle: sys::cudnnHandle_t,
    side: drv::CUstream,
    main: drv::CUstream,
    execute: impl FnOnce() -> Result<()>,
) -> Result<Result<Exec>> {
    cudnn_result::set_stream(handle, side as sys::cudaStream_t).call("cudnnSetStream")?;
    let captured = record(side, execute);
    cudnn_result::set_stream(handle, main as sys::cudaStream_t).call("cudnnSetStream")?;
    Ok(captured.and_then(|graph| {
        let exec = drv_result::graph::instantiate(graph, drv::CUgraphInstantiate_flags(0))
            .call("cuGraphInstantiate");
        let _ = drv_result::graph::destroy(graph);
        exec.map(Exec)
    }))
}

/// The graph of what `execute` queues on `side` (the capture always ended).
unsafe fn record(
    side: drv::CUstream,
    execute: impl FnOnce() -> Result<()>,
) -> Result<drv::CUgraph> {
    // Thread-local: an unsafe call this thread makes inside fails the capture, not another's.
    let mode = drv::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    drv_result::stream::begin_capture(side, mode).call("cuStreamBeginCapture")?;
    let ran = execute();
    let ended = drv_result::stream::end_capture(side).call("cuStreamEndCapture");
    if let (Err(_), Ok(graph)) = (&ran, &ended) {
        if !graph.is_null() {
            let _ = drv_result::graph::destroy(*graph);
        }
    }
    ran?;
    let graph = ended?;
    if graph.is_null() {
        return Err(crate::error::Error::NotSupported(
            "cuStreamEndCapture returned no graph".into(),
        ));
    }
    Ok(graph)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measurements_suspend_replays_on_their_thread_only_and_nest() {
        assert!(!is_suspended());
        suspended(|| {
            assert!(is_suspended());
            suspended(|| assert!(is_suspended()));
            assert!(is_suspended());
            std::thread::spawn(|| assert!(!is_suspended()))
                .join()
                .unwrap();
        });
        assert!(!is_suspended());
        let _ = std::panic::catch_unwind(|| suspended(|| panic!("a failed measurement")));
        assert!(!is_suspended(), "a panic inside left replays suspended");
    }
}
