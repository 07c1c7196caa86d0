//! CUDA-graph capture of nnfuse calls: [`Context::capture`] records what a closure queues on the
//! Context's stream into a [`CapturedGraph`], and [`CapturedGraph::replay`] queues all of it
//! again for one graph launch of host time. The recipe, what is capture-safe, the typed error
//! ([`crate::Error::Capture`]) and why cudarc's event tracking must be off: `docs/CAPTURE.md`.
//!
//! ```no_run
//! # fn main() -> nnfuse::Result<()> {
//! use nnfuse::conv::{Conv2d, ConvShape};
//! use nnfuse::TensorFormat;
//! let ctx = nnfuse::Context::new(0)?;
//! // One stream, ordered by the framework: no per-buffer events (they cannot be captured).
//! unsafe { ctx.cuda().disable_event_tracking() };
//! let s = ctx.stream();
//! let shape = ConvShape {
//!     n: 32, c_in: 64, h: 56, w: 56, c_out: 64, kh: 3, kw: 3,
//!     stride: (1, 1), pad: (1, 1), dilation: (1, 1), format: TensorFormat::Nhwc,
//! };
//! let conv = Conv2d::<half::f16>::new(&ctx, &shape)?;
//! let x = s.alloc_zeros::<half::f16>(shape.x_len()?)?;
//! let w = s.alloc_zeros::<half::f16>(shape.w_len()?)?;
//! let mut y = s.alloc_zeros::<half::f16>(shape.y_len()?)?;
//! conv.forward(&x, &w, &mut y)?; // decides (measures, compiles, allocates) once
//! let graph = ctx.capture(|_| conv.forward(&x, &w, &mut y))?;
//! for _ in 0..100 {
//!     // write the next input into `x` (on ctx.stream()), then:
//!     graph.replay()?;
//! }
//! ctx.synchronize()?;
//! # Ok(()) }
//! ```

use cudarc::driver::{result as drv_result, sys as drv, CudaGraph, DriverError};

use crate::context::Context;
use crate::error::{CallExt, Error, Result};

/// What [`Context::capture`] recorded: a CUDA graph of the calls it captured, replayed on the
/// Context's stream. It reads and writes the very buffers the captured calls were given (their
/// addresses are in the graph): write new inputs into them between replays, and keep them (and
/// the nnfuse objects whose calls were captured) alive while the graph lives. The workspace and
/// scratch arenas the calls used stay allocated while the graph lives, even if a later call grows
/// them. Not `Send`: CUDA graphs are not internally synchronised.
pub struct CapturedGraph {
    graph: Option<CudaGraph>,
    ctx: Context,
}

impl std::fmt::Debug for CapturedGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CapturedGraph")
            .field("device", &self.ctx.info().ordinal)
            .finish()
    }
}

impl CapturedGraph {
    /// Queues the captured work on the Context's stream (`cuGraphLaunch`); returns without
    /// waiting. Replays run in stream order with each other and with eager calls.
    pub fn replay(&self) -> Result<()> {
        match &self.graph {
            Some(g) => g.launch().call("cuGraphLaunch"),
            None => Err(Error::NotSupported("the captured graph is gone".into())),
        }
    }

    /// Uploads the graph's resources to the device (`cuGraphUpload`, on the Context's stream),
    /// so that the first [`CapturedGraph::replay`] does not pay for it.
    pub fn upload(&self) -> Result<()> {
        match &self.graph {
            Some(g) => g.upload().call("cuGraphUpload"),
            None => Err(Error::NotSupported("the captured graph is gone".into())),
        }
    }

    /// How many of the graph's nodes are kernel launches, and how many are anything else
    /// (memsets, copies, event records): what one replay launches, and what the same work queues
    /// eagerly.
    pub fn node_counts(&self) -> Result<(usize, usize)> {
        let Some(g) = &self.graph else {
            return Err(Error::NotSupported("the captured graph is gone".into()));
        };
        let mut n = 0usize;
        // SAFETY: a null node array asks for the count only; the graph is live.
        unsafe { drv::cuGraphGetNodes(g.cu_graph(), std::ptr::null_mut(), &mut n) }
            .result()
            .call("cuGraphGetNodes")?;
        let mut nodes = vec![std::ptr::null_mut(); n];
        // SAFETY: `nodes` holds `n` slots; the driver writes at most `n`.
        unsafe { drv::cuGraphGetNodes(g.cu_graph(), nodes.as_mut_ptr(), &mut n) }
            .result()
            .call("cuGraphGetNodes")?;
        let mut by_type: Vec<(drv::CUgraphNodeType, usize)> = Vec::new();
        for &node in nodes.iter().take(n) {
            let mut t = drv::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
            // SAFETY: `node` is one of the live graph's nodes.
            unsafe { drv::cuGraphNodeGetType(node, &mut t) }
                .result()
                .call("cuGraphNodeGetType")?;
            if tracing::enabled!(tracing::Level::TRACE) {
                trace_node(node, t);
            }
            match by_type.iter_mut().find(|(k, _)| *k == t) {
                Some((_, c)) => *c += 1,
                None => by_type.push((t, 1)),
            }
        }
        tracing::debug!(nodes = n, by_type = ?by_type, "captured graph's nodes by type");
        let kernels = by_type
            .iter()
            .find(|(t, _)| *t == drv::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL)
            .map_or(0, |(_, c)| *c);
        Ok((kernels, n - kernels))
    }

    /// The Context whose stream the graph was captured on and replays on.
    pub fn context(&self) -> &Context {
        &self.ctx
    }
}

/// One node of a captured graph as a trace event: a kernel's name and grid, a memset's bytes.
fn trace_node(node: drv::CUgraphNode, t: drv::CUgraphNodeType) {
    use drv::CUgraphNodeType as N;
    match t {
        N::CU_GRAPH_NODE_TYPE_KERNEL => {
            // SAFETY: plain-old-data out-parameter, filled by the driver for a kernel node.
            let mut p: drv::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
            // SAFETY: `node` is a live kernel node.
            if unsafe { drv::cuGraphKernelNodeGetParams_v2(node, &mut p) }
                .result()
                .is_err()
            {
                return;
            }
            let mut name: *const std::ffi::c_char = std::ptr::null();
            let named = if !p.func.is_null() {
                // SAFETY: a live function handle; the driver returns a static string.
                unsafe { drv::cuFuncGetName(&mut name, p.func) }
                    .result()
                    .is_ok()
            } else {
                // SAFETY: a live library kernel handle; the driver returns a static string.
                unsafe { drv::cuKernelGetName(&mut name, p.kern) }
                    .result()
                    .is_ok()
            };
            let name = if named && !name.is_null() {
                // SAFETY: a NUL-terminated string owned by the driver.
                unsafe { std::ffi::CStr::from_ptr(name) }
                    .to_string_lossy()
                    .into_owned()
            } else {
                "?".into()
            };
            let grid = (p.gridDimX, p.gridDimY, p.gridDimZ);
            let block = (p.blockDimX, p.blockDimY, p.blockDimZ);
            tracing::trace!(%name, ?grid, ?block, smem = p.sharedMemBytes, "graph node: kernel");
        }
        N::CU_GRAPH_NODE_TYPE_MEMSET => {
            // SAFETY: plain-old-data out-parameter, filled by the driver for a memset node.
            let mut p: drv::CUDA_MEMSET_NODE_PARAMS = unsafe { std::mem::zeroed() };
            // SAFETY: `node` is a live memset node.
            if unsafe { drv::cuGraphMemsetNodeGetParams(node, &mut p) }
                .result()
                .is_ok()
            {
                let bytes = p.width * p.height * p.elementSize as usize;
                tracing::trace!(bytes, value = p.value, "graph node: memset");
            }
        }
        other => tracing::trace!(node_type = ?other, "graph node"),
    }
}

impl Drop for CapturedGraph {
    fn drop(&mut self) {
        // Replays may still be queued: they finish before the graph and the arenas it pins go
        // (unless the stream is capturing again, where a synchronisation would break that capture).
        let capturing = self.ctx.is_capturing().unwrap_or(true);
        if !capturing {
            let _ = self.ctx.stream().synchronize();
        }
        drop(self.graph.take());
        self.ctx.pins().unpin(capturing);
    }
}

/// Ends a capture still open when [`Context::capture`] leaves early (a panic in the closure, or
/// cudarc's `end_capture` returning before it ended the capture), so that the stream is usable
/// again; the partial graph is destroyed.
struct OpenCapture<'a>(&'a Context);

impl Drop for OpenCapture<'_> {
    fn drop(&mut self) {
        if !self.0.is_capturing().unwrap_or(false) {
            return;
        }
        // SAFETY: the Context's stream is live; the graph ended here is ours and destroyed once.
        unsafe {
            if let Ok(g) = drv_result::stream::end_capture(self.0.stream().cu_stream()) {
                if !g.is_null() {
                    let _ = drv_result::graph::destroy(g);
                }
            }
        }
    }
}

/// Why [`Context::capture`] refuses while cudarc tracks buffers with events.
const TRACKING_ON: &str = "cudarc's event tracking is on for this CUDA context (it is on by \
     default once a second stream exists, and every nnfuse Context makes its own stream): each \
     buffer access would make the stream wait on an event recorded outside the capture, which \
     CUDA refuses (CUDA_ERROR_STREAM_CAPTURE_ISOLATION) and which invalidates the capture. A \
     framework that orders its streams itself calls `unsafe { ctx.cuda().disable_event_tracking() \
     }` once, before the capture (docs/CAPTURE.md)";

impl Context {
    /// Captures the work `record` queues on this Context's stream into a CUDA graph instead of
    /// running it, and returns the graph ready to [`CapturedGraph::replay`].
    ///
    /// Every nnfuse call inside must already be decided: made once before the capture with the
    /// same shapes (that call measures, compiles and allocates what it needs). A call that would
    /// still need one of those returns [`Error::Capture`] without queuing anything; `capture`
    /// then ends the capture, discards it and returns that error, and the stream is usable
    /// again. The same happens for any error `record` returns.
    ///
    /// The capture runs in `CU_STREAM_CAPTURE_MODE_GLOBAL`: while it runs, a potentially unsafe
    /// CUDA call (a synchronous allocation, a module load, a device synchronisation) from any
    /// thread fails instead of silently breaking the capture. Do not use this Context from other
    /// threads meanwhile: work they queue on its stream would be captured.
    ///
    /// Errors: [`Error::Capture`] when cudarc's event tracking is on
    /// (`CudaContext::is_managing_stream_synchronization`; see `docs/CAPTURE.md`), when the
    /// stream is capturing already, or when the capture was invalidated by a call nnfuse does not
    /// control; [`Error::Driver`] when CUDA cannot begin, end or instantiate it.
    pub fn capture<F>(&self, record: F) -> Result<CapturedGraph>
    where
        F: FnOnce(&Context) -> Result<()>,
    {
        if self.cuda().is_managing_stream_synchronization() {
            return Err(Error::Capture {
                what: "Context::capture",
                why: TRACKING_ON.into(),
            });
        }
        if self.is_capturing()? {
            return Err(Error::Capture {
                what: "Context::capture",
                why: "the Context's stream is capturing already (captures do not nest)".into(),
            });
        }
        let stream = self.stream();
        stream
            .begin_capture(drv::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
            .call("cuStreamBeginCapture")?;
        let open = OpenCapture(self);
        let recorded = record(self);
        // An error cudarc recorded during the capture (a failed stream-ordered free or event
        // record in a Drop) would make end_capture return before ending: take it first.
        let sticky = self.cuda().check_err();
        let ended = stream.end_capture(drv::CUgraphInstantiate_flags(0));
        drop(open);
        recorded?;
        sticky.call("a cudarc call during the capture")?;
        match ended {
            Ok(Some(graph)) => {
                self.pins().pin();
                Ok(CapturedGraph {
                    graph: Some(graph),
                    ctx: self.clone(),
                })
            }
            Ok(None) => Err(Error::NotSupported(
                "cuStreamEndCapture returned no graph".into(),
            )),
            Err(e) => Err(ended_error(e)),
        }
    }
}

/// The error of a capture that could not be ended into a graph.
fn ended_error(e: DriverError) -> Error {
    use drv::cudaError_enum as E;
    match e.0 {
        E::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED => Error::Capture {
            what: "Context::capture",
            why: "the capture was invalidated by a call a capture cannot hold, made outside \
                  nnfuse's checks (a synchronisation, a synchronous allocation or copy, a wait \
                  on an event recorded outside the capture, or such a call from another thread); \
                  nothing was recorded"
                .into(),
        },
        _ => Error::Driver {
            call: "cuStreamEndCapture / cuGraphInstantiate",
            status: format!("{e:?}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_name_the_operation_and_the_way_out() {
        let e = Error::Capture {
            what: "Context::capture",
            why: TRACKING_ON.into(),
        };
        let s = e.to_string();
        assert!(
            s.starts_with("Context::capture is not capture-safe now: "),
            "{s}"
        );
        assert!(s.contains("disable_event_tracking"), "{s}");
        assert!(e.is_capture());
        assert!(!Error::NotSupported("x".into()).is_capture());
    }
}
