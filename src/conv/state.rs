//! The per-problem state of a [`Conv2d`]: its plans, its cuDNN descriptors, the decision per
//! direction once made, and the caches that keep cuDNN's queries off the cached path (workspace
//! sizes, the first usable algorithm of a forced `cudnn` route, the graph plans its calls ran).
//! A direction's decisions are per mode: its overwriting calls and its accumulating calls each
//! have their own (measured in that mode).
//! Also how a route is completed into an [`Exec`] (its cuDNN workspace checked against the cap).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::call::GraphPlans;
use super::choice::{AutoReport, ConvChoice, CudnnSearch};
use super::cudnn::CudnnConv;
use super::plan::{ConvPath, DirectionPlans, Route};
use super::problem::{ConvShape, CudnnAlgo, Direction, GraphEngine, WinogradGeometry};
use super::route::{self, Exec};
use crate::context::{cudnn_present, Context};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels::KernelFile;

pub(super) static HIDE_CUDNN: AtomicBool = AtomicBool::new(false);

/// For tests: convolutions planned from now on behave as if cuDNN could not be loaded (every
/// plan without cuDNN, nnfuse's own paths only); `false` restores the truth. A `Conv2d` already
/// made keeps its plans.
#[doc(hidden)]
pub fn simulate_missing_cudnn(on: bool) {
    HIDE_CUDNN.store(on, Ordering::Relaxed);
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct CoreKey {
    pub(super) shape: ConvShape,
    pub(super) dtype: DType,
    pub(super) search: CudnnSearch,
    pub(super) hide_cudnn: bool,
}

/// A decision and what it came with.
#[derive(Debug, Clone)]
pub(super) struct Decided {
    pub(super) exec: Exec,
    pub(super) choice: ConvChoice,
    pub(super) report: Option<Arc<AutoReport>>,
    /// Candidates a first call left out (their kernels still compiling, or the decision budget
    /// spent before they were checked): measured against the decided route at the first call
    /// after their kernels are ready (`settle`).
    pub(super) pending: Option<Pending>,
}

/// What a provisional decision waits for: the candidates it could not run and their kernel
/// files.
#[derive(Debug, Clone)]
pub(super) struct Pending {
    pub(super) execs: Vec<Exec>,
    pub(super) files: Vec<&'static KernelFile>,
    /// The first call's graph candidates filled its admission limit: the settle also lists,
    /// finalizes and measures the graph API's further engine configs
    /// (`cudnn_graph_run::more_engine_execs`).
    pub(super) more_graph: bool,
    /// [`crate::kernels::compile_epoch`] when the files' states were last looked at: a call
    /// looks again only after some compile finished (one atomic load per call meanwhile).
    pub(super) epoch: u64,
    /// Later measurements already made for this decision ([`crate::tune::budget::MAX_SETTLES`]).
    pub(super) settles: u8,
}

#[derive(Debug)]
pub(super) struct Core {
    pub(super) id: u64,
    pub(super) shape: ConvShape,
    pub(super) dtype: DType,
    pub(super) search: CudnnSearch,
    pub(super) plans: DirectionPlans,
    /// Elements of x, w, y.
    pub(super) lens: [usize; 3],
    pub(super) cudnn: Option<Arc<CudnnConv>>,
    /// Per direction and mode (`[d][0]` overwriting calls, `[d][1]` accumulating ones: a
    /// gradient added to its output): the decision, once made. Use [`Core::decision`].
    pub(super) state: [[Mutex<Option<Decided>>; 2]; 3],
    /// cuDNN workspace sizes already asked for.
    pub(super) ws_sizes: Mutex<HashMap<CudnnAlgo, usize>>,
    /// Per direction: cuDNN's first usable algorithm, once asked for by a forced `cudnn` route
    /// (cuDNN 9's heuristic query costs milliseconds of host time: never per call).
    pub(super) cudnn_first: [Mutex<Option<CudnnAlgo>>; 3],
    /// Per direction (f32 only): the engine config a forced `cudnn_graph` route without one
    /// runs, once it passed the check against a true-f32 route.
    pub(super) graph_first: [Mutex<Option<GraphEngine>>; 3],
    /// Whether a forced `cudnn_dual` forward passed its check against a true-f32 route (its
    /// data-gradient engine config is a graph one: never run unchecked).
    pub(super) dual_checked: AtomicBool,
    /// The engine config of the tiled problem a forced f32 `cudnn_tiled` filter gradient runs,
    /// once it passed the check against a true-f32 route.
    pub(super) tiled_first: Mutex<Option<GraphEngine>>,
    /// Per direction: the graph plans its calls ran (the cached call's plan without the
    /// Context's plan-cache lookup; alive as long as this state).
    pub(super) graph_plans: [GraphPlans; 3],
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl Core {
    pub(super) fn new(ctx: &Context, key: &CoreKey) -> Result<Core> {
        let s = key.shape;
        let present = cudnn_present() && !key.hide_cudnn;
        let graph = present && crate::cudnn_graph::build::available().is_ok();
        let mut plans = DirectionPlans::new(s, key.dtype, ctx.config(), present, graph)?;
        let mut cudnn = None;
        if plans.get(Direction::Forward).eligible(ConvPath::Cudnn) {
            match CudnnConv::new(&s, key.dtype) {
                Ok(c) => cudnn = Some(Arc::new(c)),
                Err(e) => {
                    tracing::warn!(
                        shape = ?s, dtype = %key.dtype, error = %e,
                        "cuDNN's convolution descriptors could not be made; planning without cuDNN"
                    );
                    plans = DirectionPlans::new(s, key.dtype, ctx.config(), false, false)?;
                    for p in plans.0.iter_mut() {
                        p.reasons
                            .push(format!("cuDNN is loaded, but its descriptors failed: {e}"));
                    }
                }
            }
        }
        let (oh, ow) = plans.get(Direction::Forward).out_hw;
        let lens = [
            s.n * s.c_in * s.h * s.w,
            s.c_out * s.c_in * s.kh * s.kw,
            s.n * s.c_out * oh * ow,
        ];
        let f = plans.get(Direction::Forward);
        tracing::info!(
            shape = ?s, dtype = %key.dtype, path = %f.path, measured = f.measured,
            candidates = ?f.candidates.iter().map(Route::label).collect::<Vec<_>>(),
            cudnn_search = %key.search,
            "convolution planned"
        );
        Ok(Core {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            shape: s,
            dtype: key.dtype,
            search: key.search,
            plans,
            lens,
            cudnn,
            state: Default::default(),
            ws_sizes: Mutex::new(HashMap::new()),
            cudnn_first: Default::default(),
            graph_first: Default::default(),
            dual_checked: AtomicBool::new(false),
            tiled_first: Mutex::new(None),
            graph_plans: Default::default(),
        })
    }
}

impl Core {
    /// The decision slot of `d`'s calls that overwrite (`accumulate = false`) or add to
    /// (`true`) their output; the forward never accumulates (its one slot is the overwriting
    /// one).
    pub(super) fn decision(&self, d: Direction, accumulate: bool) -> &Mutex<Option<Decided>> {
        let mode = usize::from(accumulate && d != Direction::Forward);
        &self.state[d.index()][mode]
    }

    /// The route a decision of `d` (either mode, the overwriting one first) runs, when made.
    pub(super) fn any_decided_route(&self, d: Direction) -> Option<Route> {
        [false, true]
            .into_iter()
            .find_map(|acc| lock(self.decision(d, acc)).as_ref().map(|s| s.exec.route))
    }

    pub(super) fn target<'a>(&'a self, ctx: &'a Context) -> route::Target<'a> {
        route::Target {
            ctx,
            shape: &self.shape,
            dtype: self.dtype,
            cudnn: self.cudnn.as_deref(),
            graph_plans: Some(&self.graph_plans),
        }
    }

    pub(super) fn cudnn_conv(&self) -> Result<&Arc<CudnnConv>> {
        self.cudnn.as_ref().ok_or_else(|| {
            Error::NotSupported(
                "cuDNN is not available to this convolution (see its plan's reasons)".into(),
            )
        })
    }

    pub(super) fn cudnn_ws(&self, ctx: &Context, a: CudnnAlgo) -> Result<usize> {
        if let Some(&b) = lock(&self.ws_sizes).get(&a) {
            return Ok(b);
        }
        let conv = self.cudnn_conv()?;
        let bytes = {
            let mut g = ctx.lock()?;
            let h = g.cudnn()?;
            // SAFETY: live handle under the lock.
            unsafe { conv.workspace_size(h, a) }?
        };
        lock(&self.ws_sizes).insert(a, bytes);
        Ok(bytes)
    }

    /// The [`Exec`] of a route of `d` with its cuDNN algorithm fixed (and, for Winograd, its
    /// geometry: the one place it is computed for a run).
    pub(super) fn exec_of(&self, ctx: &Context, d: Direction, r: Route) -> Result<Exec> {
        let cudnn_ws = match (r.path, r.cudnn_algo) {
            (ConvPath::Cudnn, Some(a)) => {
                let ws = self.cudnn_ws(ctx, a)?;
                let cap = ctx.config().cudnn_workspace_bytes();
                if ws > cap {
                    return Err(Error::NotSupported(format!(
                        "cuDNN algorithm {} needs {ws} B of workspace, over the cap of {cap} B",
                        a.label()
                    )));
                }
                ws
            }
            (ConvPath::Cudnn, None) => {
                return Err(Error::NotSupported(
                    "a cuDNN route needs its algorithm".into(),
                ))
            }
            _ => 0,
        };
        let winograd = match r.path.winograd_tile() {
            Some(tile) => WinogradGeometry::new(&self.shape, d, tile)?,
            None => None,
        };
        Ok(Exec {
            route: r,
            cudnn_ws,
            winograd,
        })
    }
}
