//! [`Conv2d`]: the convolution dispatcher. One object per (problem, data type) on a Context,
//! holding its plans, its cuDNN descriptors and, once made, its decision per direction; the
//! operations validate every argument, then run the decided route (measuring on the first call
//! where the plan says so), falling back when a route fails at run time.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceSlice};

use super::choice::{
    self, cudnn_search, AutoReport, ChoiceKey, ChoiceOrigin, ConvChoice, CudnnSearch, MeasureInput,
    MAX_CUDNN_CANDIDATES,
};
use super::cudnn::{usable, CudnnAlgo, CudnnConv, CudnnPerf, CudnnPtrs};
use super::plan::{ConvPath, ConvPlan, Direction, DirectionPlans, Route};
use super::route::{self, Exec};
use super::{winograd, ConvShape, FwdPtrs, WinogradTile};
use crate::context::{cudnn_present, Context};
use crate::dtype::{DType, Element};
use crate::error::{CallExt, Error, Result};
use crate::layout::TensorFormat;
use crate::validate::{expect_device, expect_len, expect_outputs_disjoint, BufInfo};

/// The filter's memory layout. nnfuse takes the layout that goes with the format, as cuDNN does:
/// KCRS (`[c_out][c_in][kh][kw]`) with NCHW, KRSC (`[c_out][kh][kw][c_in]`) with NHWC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FilterLayout {
    /// `[c_out][c_in][kh][kw]`.
    Kcrs,
    /// `[c_out][kh][kw][c_in]`.
    Krsc,
}

impl FilterLayout {
    /// The layout that goes with `format`.
    pub const fn of(format: TensorFormat) -> FilterLayout {
        match format {
            TensorFormat::Nchw => FilterLayout::Kcrs,
            TensorFormat::Nhwc => FilterLayout::Krsc,
        }
    }

    /// `kcrs` / `krsc`.
    pub const fn name(self) -> &'static str {
        match self {
            FilterLayout::Kcrs => "kcrs",
            FilterLayout::Krsc => "krsc",
        }
    }
}

/// What runs after the convolution, inside the same call. Only [`Epilogue::None`] exists today;
/// bias and activation epilogues will arrive as new variants (the enum is `#[non_exhaustive]`),
/// so that callers of [`Conv2d::forward_with_epilogue`] need no new method.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Epilogue {
    /// `y = conv(x, w)`.
    #[default]
    None,
}

static HIDE_CUDNN: AtomicBool = AtomicBool::new(false);

/// For tests: convolutions planned from now on behave as if cuDNN could not be loaded (every
/// plan without cuDNN, nnfuse's own paths only); `false` restores the truth. A `Conv2d` already
/// made keeps its plans.
#[doc(hidden)]
pub fn simulate_missing_cudnn(on: bool) {
    HIDE_CUDNN.store(on, Ordering::Relaxed);
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct CoreKey {
    shape: ConvShape,
    dtype: DType,
    search: CudnnSearch,
    hide_cudnn: bool,
}

/// A decision and what it came with.
#[derive(Debug, Clone)]
struct Decided {
    exec: Exec,
    choice: ConvChoice,
    report: Option<Arc<AutoReport>>,
}

#[derive(Debug)]
struct Core {
    id: u64,
    shape: ConvShape,
    dtype: DType,
    search: CudnnSearch,
    plans: DirectionPlans,
    /// Elements of x, w, y.
    lens: [usize; 3],
    cudnn: Option<Arc<CudnnConv>>,
    /// Per direction: the decision, once made.
    state: [Mutex<Option<Decided>>; 3],
    /// cuDNN workspace sizes already asked for.
    ws_sizes: Mutex<HashMap<CudnnAlgo, usize>>,
    /// Per direction: cuDNN's first usable algorithm, once asked for by a forced `cudnn` route
    /// (cuDNN 9's heuristic query costs milliseconds of host time: never per call).
    cudnn_first: [Mutex<Option<CudnnAlgo>>; 3],
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

const fn dir_index(d: Direction) -> usize {
    match d {
        Direction::Forward => 0,
        Direction::BackwardData => 1,
        Direction::BackwardFilter => 2,
    }
}

impl Core {
    fn new(ctx: &Context, key: &CoreKey) -> Result<Core> {
        let s = key.shape;
        let present = cudnn_present() && !key.hide_cudnn;
        let mut plans = DirectionPlans::new(s, key.dtype, ctx.config(), present)?;
        let mut cudnn = None;
        if plans.get(Direction::Forward).eligible(ConvPath::Cudnn) {
            match CudnnConv::new(&s, key.dtype) {
                Ok(c) => cudnn = Some(Arc::new(c)),
                Err(e) => {
                    tracing::warn!(
                        shape = ?s, dtype = %key.dtype, error = %e,
                        "cuDNN's convolution descriptors could not be made; planning without cuDNN"
                    );
                    plans = DirectionPlans::new(s, key.dtype, ctx.config(), false)?;
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
        })
    }
}

/// One caller buffer as the checks see it.
#[derive(Debug, Clone, Copy)]
struct Arg {
    name: &'static str,
    len: usize,
    ordinal: usize,
}

fn arg<T, S: DeviceSlice<T>>(name: &'static str, s: &S) -> Arg {
    Arg {
        name,
        len: s.len(),
        ordinal: s.stream().context().ordinal(),
    }
}

/// A 2-D convolution (cross-correlation, no bias, groups = 1) for one problem and element type
/// `T` (`f32`, `half::f16`, `half::bf16`), NCHW with a KCRS filter or NHWC with a KRSC filter
/// (layouts in [`crate::reference::conv`]), f32 accumulation everywhere.
///
/// Planned once per (problem, type) and cached by the Context: a repeated [`Conv2d::new`] is
/// one hash lookup. The first call of each direction decides the route (see
/// [`crate::conv::plan()`] and `docs/CONV.md`): under `auto` it measures the eligible paths on
/// the call's own inputs; later calls run the decision.
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use nnfuse::conv::{Conv2d, ConvShape};
/// use nnfuse::TensorFormat;
/// let ctx = nnfuse::Context::new(0)?;
/// let shape = ConvShape {
///     n: 32, c_in: 64, h: 56, w: 56, c_out: 64, kh: 3, kw: 3,
///     stride: (1, 1), pad: (1, 1), dilation: (1, 1), format: TensorFormat::Nhwc,
/// };
/// let conv = Conv2d::<half::f16>::new(&ctx, &shape)?;
/// println!("{}", conv.plan());
/// let s = ctx.stream();
/// let x = s.alloc_zeros::<half::f16>(shape.x_len())?;
/// let w = s.alloc_zeros::<half::f16>(shape.w_len())?;
/// let mut y = s.alloc_zeros::<half::f16>(shape.y_len()?)?;
/// conv.forward(&x, &w, &mut y)?;
/// println!("{:?}", conv.choice(nnfuse::conv::Direction::Forward));
/// # Ok(()) }
/// ```
pub struct Conv2d<T: Element> {
    ctx: Context,
    core: Arc<Core>,
    _t: PhantomData<fn() -> T>,
}

impl<T: Element> Clone for Conv2d<T> {
    fn clone(&self) -> Self {
        Conv2d {
            ctx: self.ctx.clone(),
            core: self.core.clone(),
            _t: PhantomData,
        }
    }
}

impl<T: Element> std::fmt::Debug for Conv2d<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conv2d")
            .field("shape", &self.core.shape)
            .field("dtype", &self.core.dtype)
            .field("forward", &self.core.plans.get(Direction::Forward).path)
            .finish()
    }
}

/// A filter made ready for repeated forwards with unchanged weights (see
/// [`Conv2d::prepare_filter`]): a copy of the filter and, for the Winograd paths, its
/// transform G g Gᵀ, made once per tile size.
pub struct PreparedFilter<T: Element> {
    owner: u64,
    raw: CudaSlice<T>,
    /// Transformed filters for F(2x2,3x3) and F(4x4,3x3), made on first use.
    transformed: Mutex<[Option<CudaSlice<T>>; 2]>,
}

impl<T: Element> std::fmt::Debug for PreparedFilter<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = lock(&self.transformed);
        f.debug_struct("PreparedFilter")
            .field("elements", &self.raw.len())
            .field("f2x3", &t[0].is_some())
            .field("f4x3", &t[1].is_some())
            .finish()
    }
}

impl<T: Element> PreparedFilter<T> {
    /// Whether the transformed filter of `tile` has been made.
    pub fn has_transform(&self, tile: WinogradTile) -> bool {
        lock(&self.transformed)[tile_index(tile)].is_some()
    }
}

const fn tile_index(t: WinogradTile) -> usize {
    match t {
        WinogradTile::F2x3 => 0,
        WinogradTile::F4x3 => 1,
    }
}

impl<T: Element> Conv2d<T> {
    /// Plans `shape` for `T` on `ctx` (all three directions), or returns the Context's cached
    /// object. Errors: an invalid problem, naming the field (`n`, `c_in`, `h`, `w`, `c_out`,
    /// `kh`, `kw`, `stride`, `dilation`, or `shape` for a product that overflows).
    pub fn new(ctx: &Context, shape: &ConvShape) -> Result<Self> {
        let key = CoreKey {
            shape: *shape,
            dtype: T::DTYPE,
            search: cudnn_search(),
            hide_cudnn: HIDE_CUDNN.load(Ordering::Relaxed),
        };
        let core = ctx.memo(key, || Core::new(ctx, &key).map(Arc::new))?;
        Ok(Conv2d {
            ctx: ctx.clone(),
            core,
            _t: PhantomData,
        })
    }

    /// [`Conv2d::new`] for a caller that states its filter layout: an error naming
    /// `filter_layout` when it is not the one that goes with the format ([`FilterLayout::of`]).
    pub fn with_filter_layout(
        ctx: &Context,
        shape: &ConvShape,
        filter_layout: FilterLayout,
    ) -> Result<Self> {
        let want = FilterLayout::of(shape.format);
        if filter_layout != want {
            return Err(Error::invalid(
                "filter_layout",
                format!(
                    "{} does not go with {} data: nnfuse takes {} filters with {} (as cuDNN)",
                    filter_layout.name(),
                    shape.format,
                    want.name(),
                    shape.format
                ),
            ));
        }
        Self::new(ctx, shape)
    }

    /// The problem.
    pub fn shape(&self) -> &ConvShape {
        &self.core.shape
    }

    /// The forward plan.
    pub fn plan(&self) -> &ConvPlan {
        self.core.plans.get(Direction::Forward)
    }

    /// The plan of `d`.
    pub fn plan_for(&self, d: Direction) -> &ConvPlan {
        self.core.plans.get(d)
    }

    /// The decision for `d`, once the first call of that direction made it.
    pub fn choice(&self, d: Direction) -> Option<ConvChoice> {
        lock(&self.core.state[dir_index(d)])
            .as_ref()
            .map(|s| s.choice.clone())
    }

    /// The measurement behind the decision for `d`, when this object measured.
    pub fn report(&self, d: Direction) -> Option<Arc<AutoReport>> {
        lock(&self.core.state[dir_index(d)])
            .as_ref()
            .and_then(|s| s.report.clone())
    }

    /// The cuDNN search mode this object was planned under.
    pub fn cudnn_search(&self) -> CudnnSearch {
        self.core.search
    }

    /// cuDNN's heuristic algorithm list for `d` (`cudnnGetConvolution*Algorithm_v7`), every
    /// entry as cuDNN gives it (filter with [`crate::conv::cudnn::usable`]). Errors when cuDNN is
    /// not available to this problem.
    pub fn cudnn_heuristics(&self, d: Direction) -> Result<Vec<CudnnPerf>> {
        let conv = self.cudnn_conv()?;
        let mut g = self.ctx.lock()?;
        let h = g.cudnn()?;
        // SAFETY: live handle, held under the Context's lock.
        unsafe { conv.heuristics(h, d) }
    }

    /// Bytes of workspace `route` uses for `d`: cuDNN's for its algorithm (library workspace),
    /// the plan's scratch for nnfuse's paths.
    pub fn workspace_bytes(&self, d: Direction, route: Route) -> Result<usize> {
        match (route.path, route.cudnn_algo) {
            (ConvPath::Cudnn, Some(a)) => self.cudnn_ws(a),
            (ConvPath::Cudnn, None) => Ok(0),
            (p, _) => Ok(self.plan_for(d).info(p).scratch_bytes),
        }
    }

    fn target(&self) -> route::Target<'_> {
        route::Target {
            ctx: &self.ctx,
            shape: &self.core.shape,
            dtype: self.core.dtype,
            cudnn: self.core.cudnn.as_deref(),
        }
    }

    fn cudnn_conv(&self) -> Result<&Arc<CudnnConv>> {
        self.core.cudnn.as_ref().ok_or_else(|| {
            Error::NotSupported(
                "cuDNN is not available to this convolution (see its plan's reasons)".into(),
            )
        })
    }

    fn cudnn_ws(&self, a: CudnnAlgo) -> Result<usize> {
        if let Some(&b) = lock(&self.core.ws_sizes).get(&a) {
            return Ok(b);
        }
        let conv = self.cudnn_conv()?;
        let bytes = {
            let mut g = self.ctx.lock()?;
            let h = g.cudnn()?;
            // SAFETY: live handle under the lock.
            unsafe { conv.workspace_size(h, a) }?
        };
        lock(&self.core.ws_sizes).insert(a, bytes);
        Ok(bytes)
    }

    /// The [`Exec`] of a route with its cuDNN algorithm fixed.
    fn exec_of(&self, r: Route) -> Result<Exec> {
        match (r.path, r.cudnn_algo) {
            (ConvPath::Cudnn, Some(a)) => {
                let ws = self.cudnn_ws(a)?;
                let cap = self.ctx.config().conv_workspace_bytes();
                if ws > cap {
                    return Err(Error::NotSupported(format!(
                        "cuDNN algorithm {} needs {ws} B of workspace, over the cap of {cap} B",
                        a.label()
                    )));
                }
                Ok(Exec {
                    route: r,
                    cudnn_ws: ws,
                })
            }
            (ConvPath::Cudnn, None) => Err(Error::NotSupported(
                "a cuDNN route needs its algorithm".into(),
            )),
            _ => Ok(Exec {
                route: r,
                cudnn_ws: 0,
            }),
        }
    }

    /// cuDNN's usable algorithms for `d` as routes: the heuristic list's first
    /// [`MAX_CUDNN_CANDIDATES`] (or `limit`), or Find's fastest on `p` (scratch output).
    fn cudnn_execs(
        &self,
        d: Direction,
        p: CudnnPtrs,
        limit: usize,
    ) -> Result<(Vec<Exec>, Vec<String>, ChoiceOrigin)> {
        let conv = self.cudnn_conv()?.clone();
        let cfg = self.ctx.config();
        let cap = cfg.conv_workspace_bytes();
        let det = cfg.deterministic && d != Direction::Forward;
        let list = {
            let mut g = self.ctx.lock()?;
            let h = g.cudnn()?;
            // SAFETY: live handle under the lock.
            unsafe { conv.heuristics(h, d) }?
        };
        let (mut ok, excluded, mut notes) = usable(&list, self.core.dtype, cap, det);
        let mut origin = ChoiceOrigin::Planned;
        if self.core.search == CudnnSearch::Find && limit > 1 {
            let ws_bytes = ok.iter().map(|q| q.memory).max().unwrap_or(0);
            let out_role = choice::output_role(d);
            let elems = self.core.lens[out_role];
            // SAFETY: Find's output, written before it is read; freed after Find (which blocks).
            let out =
                unsafe { self.ctx.stream().alloc::<T>(elems.max(1)) }.call("cuMemAllocAsync")?;
            let (op, _go) = out.device_ptr(self.ctx.stream());
            let mut q = p;
            match out_role {
                0 => q.x = op,
                1 => q.w = op,
                _ => q.y = op,
            }
            let found = {
                let mut g = self.ctx.lock()?;
                let h = g.cudnn()?;
                let ws = g.workspace(ws_bytes)?;
                // SAFETY: validated caller inputs, our own output of the output's extent, a
                // workspace of ws_bytes; the handle is bound to the Context's stream.
                unsafe { conv.find(h, d, q, ws, ws_bytes) }?
            };
            let (f, ex, n) = usable(&found, self.core.dtype, cap, det);
            notes = n;
            ok = f;
            if ex {
                notes.push(
                    "determinism excluded the algorithm cuDNN's Find measured fastest".into(),
                );
            }
            origin = ChoiceOrigin::CudnnFind;
            ok.truncate(1);
        } else if excluded {
            notes.push("determinism excluded the algorithm cuDNN's heuristic ranks first".into());
        }
        let mut execs = Vec::new();
        for perf in ok.iter().take(limit.clamp(1, MAX_CUDNN_CANDIDATES)) {
            match self.exec_of(Route::cudnn(perf.algo)) {
                Ok(e) => execs.push(e),
                Err(e) => notes.push(format!("{}: {e}", perf.algo.label())),
            }
        }
        if execs.is_empty() {
            notes.push("cuDNN offered no usable algorithm".into());
        }
        Ok((execs, notes, origin))
    }

    /// Whether a cached or file route fits this object's plan for `d`.
    fn acceptable(&self, plan: &ConvPlan, r: &Route) -> bool {
        if !plan.candidates.iter().any(|c| c.path == r.path) {
            return false;
        }
        match r.path {
            ConvPath::Cudnn => r.cudnn_algo.is_some_and(|a| {
                a.direction == plan.direction
                    && a.is_known()
                    && a.math.acceptable(self.core.dtype)
                    && self.core.cudnn.is_some()
            }),
            ConvPath::WinogradF2x3 | ConvPath::WinogradF4x3 => plan
                .candidates
                .iter()
                .any(|c| c.path == r.path && c.engine == r.engine),
            _ => true,
        }
    }

    /// Decides the route of `d` (first call): the process cache or the file, else the plan's
    /// candidates, measured when there are several.
    fn decide(&self, d: Direction, p: CudnnPtrs) -> Result<Decided> {
        let ctx = &self.ctx;
        let cfg = ctx.config();
        let plan = self.plan_for(d);
        let ordinal = ctx.info().ordinal as u32;
        let key = ChoiceKey::of(ordinal, plan, self.core.search);
        let capacity = cfg.plan_cache_capacity;
        let costly = plan.measured || plan.candidates.iter().any(|r| r.path == ConvPath::Cudnn);
        if costly {
            if let Some(path) = &cfg.tuning_cache {
                match choice::device_tag(ctx) {
                    Ok(tag) => choice::ensure_loaded(path, ordinal, &tag, capacity),
                    Err(e) => tracing::warn!(error = %e, "convolution tuning cache not read"),
                }
            }
            if let Some(mut c) = choice::lookup(&key) {
                if self.acceptable(plan, &c.route) {
                    match self.exec_of(c.route) {
                        Ok(exec) => {
                            // Another Context's measurement (a file entry and a fallback say
                            // where they came from themselves).
                            if matches!(c.origin, ChoiceOrigin::Measured | ChoiceOrigin::CudnnFind)
                            {
                                c.origin = ChoiceOrigin::Memory;
                            }
                            tracing::debug!(problem = ?self.core.shape, direction = %d,
                                route = %c.route, origin = c.origin.name(), "convolution choice cached");
                            return Ok(Decided {
                                exec,
                                choice: c,
                                report: None,
                            });
                        }
                        Err(e) => tracing::warn!(route = %c.route, error = %e,
                            "cached convolution choice cannot run; deciding again"),
                    }
                } else {
                    tracing::warn!(route = %c.route, direction = %d,
                        "cached convolution choice does not fit this problem's plan; deciding again");
                }
            }
        }

        let mut execs: Vec<Exec> = Vec::new();
        let mut notes: Vec<String> = Vec::new();
        let mut origin = ChoiceOrigin::Planned;
        let several = plan.candidates.len() > 1;
        for r in &plan.candidates {
            if r.path == ConvPath::Cudnn {
                // One cuDNN algorithm when nothing else competes and the search is Find; the
                // heuristic mode times several.
                let limit = MAX_CUDNN_CANDIDATES;
                match self.cudnn_execs(d, p, limit) {
                    Ok((v, n, o)) => {
                        execs.extend(v);
                        notes.extend(n);
                        if !several {
                            origin = o;
                        }
                    }
                    Err(e) => notes.push(format!("cuDNN: {e}")),
                }
            } else {
                execs.push(self.exec_of(*r)?);
            }
        }
        if execs.is_empty() {
            let fb = plan.fallback_route(ConvPath::Cudnn).ok_or_else(|| {
                Error::NotSupported(format!(
                    "no route can run this {}: {}",
                    d.describe(),
                    notes.join("; ")
                ))
            })?;
            tracing::warn!(direction = %d, route = %fb, notes = ?notes,
                "no candidate route could be prepared; falling back");
            let mut c = ConvChoice::planned(fb, ChoiceOrigin::Fallback);
            c.notes = notes;
            return Ok(Decided {
                exec: self.exec_of(fb)?,
                choice: c,
                report: None,
            });
        }
        if execs.len() == 1 {
            let mut c = ConvChoice::planned(execs[0].route, origin);
            c.notes = notes;
            if origin == ChoiceOrigin::CudnnFind {
                self.remember(&key, &c);
            }
            tracing::info!(problem = ?self.core.shape, direction = %d, route = %c.route,
                origin = origin.name(), "convolution decided");
            return Ok(Decided {
                exec: execs[0],
                choice: c,
                report: None,
            });
        }
        let inp = MeasureInput {
            ctx,
            shape: &self.core.shape,
            dtype: self.core.dtype,
            direction: d,
            cudnn: self.core.cudnn.as_deref(),
            execs: &execs,
            operands: p,
            lens: self.core.lens,
        };
        match choice::measure(&inp) {
            Ok((w, report)) => {
                let win = &report.candidates[w];
                let inc = &report.candidates[report.incumbent];
                let c = ConvChoice {
                    route: execs[w].route,
                    origin: ChoiceOrigin::Measured,
                    median_us: win.median_ms.map_or(f64::NAN, |m| m * 1e3),
                    incumbent_us: inc.median_ms.map_or(f64::NAN, |m| m * 1e3),
                    candidates: execs.len() as u32,
                    notes,
                };
                tracing::info!(problem = ?self.core.shape, dtype = %self.core.dtype,
                    direction = %d, route = %c.route, wall_ms = report.wall_ms,
                    "convolution measured:\n{report}");
                self.remember(&key, &c);
                Ok(Decided {
                    exec: execs[w],
                    choice: c,
                    report: Some(Arc::new(report)),
                })
            }
            Err(e) => {
                // Nothing could be checked: take the incumbent unmeasured (it is what a forced
                // policy would run), remembered only here.
                tracing::warn!(direction = %d, error = %e,
                    "convolution measurement failed; running the incumbent unmeasured");
                let mut c = ConvChoice::planned(execs[0].route, ChoiceOrigin::Fallback);
                notes.push(format!("measurement failed: {e}"));
                c.notes = notes;
                Ok(Decided {
                    exec: execs[0],
                    choice: c,
                    report: None,
                })
            }
        }
    }

    /// Keeps a costly decision in the process cache and, when configured, in the file.
    fn remember(&self, key: &ChoiceKey, c: &ConvChoice) {
        let cfg = self.ctx.config();
        choice::insert(*key, c.clone(), cfg.plan_cache_capacity);
        if let Some(path) = &cfg.tuning_cache {
            let saved = choice::device_tag(&self.ctx)
                .and_then(|tag| choice::save_file(path, &tag, key.device));
            match saved {
                Ok(()) => {
                    tracing::debug!(path = %path.display(), "convolution tuning cache written")
                }
                Err(e) => tracing::warn!(path = %path.display(), error = %e,
                    "convolution tuning cache could not be written; the choice stays in memory"),
            }
        }
    }

    /// The decided route of `d`, deciding on the first call.
    fn decided(&self, d: Direction, p: CudnnPtrs) -> Result<Exec> {
        let mut st = lock(&self.core.state[dir_index(d)]);
        if let Some(s) = st.as_ref() {
            return Ok(s.exec);
        }
        let dec = self.decide(d, p)?;
        let exec = dec.exec;
        *st = Some(dec);
        Ok(exec)
    }

    /// A route forced by the caller, completed (engine, cuDNN algorithm) and checked against
    /// the plan.
    fn forced(&self, d: Direction, r: Route, p: CudnnPtrs) -> Result<Exec> {
        let plan = self.plan_for(d);
        let info = plan.info(r.path);
        if !info.eligible {
            return Err(Error::NotSupported(format!(
                "{} cannot run this {}: {}",
                r.path,
                d.describe(),
                info.why_not.clone().unwrap_or_default()
            )));
        }
        let mut r = r;
        match r.path {
            ConvPath::Cudnn if r.cudnn_algo.is_none() => {
                let decided = lock(&self.core.state[dir_index(d)])
                    .as_ref()
                    .and_then(|s| s.exec.route.cudnn_algo);
                let cached = *lock(&self.core.cudnn_first[dir_index(d)]);
                r.cudnn_algo = match decided.or(cached) {
                    Some(a) => Some(a),
                    None => {
                        let first = self
                            .cudnn_execs(d, p, 1)?
                            .0
                            .first()
                            .and_then(|e| e.route.cudnn_algo);
                        *lock(&self.core.cudnn_first[dir_index(d)]) = first;
                        first
                    }
                };
                if r.cudnn_algo.is_none() {
                    return Err(Error::NotSupported(
                        "cuDNN offered no usable algorithm".into(),
                    ));
                }
            }
            ConvPath::WinogradF2x3 | ConvPath::WinogradF4x3 if r.engine.is_none() => {
                r.engine = info
                    .winograd
                    .as_ref()
                    .and_then(|w| w.engines.first().copied());
            }
            _ => {}
        }
        if let Some(a) = r.cudnn_algo {
            if a.direction != d || !a.is_known() {
                return Err(Error::invalid(
                    "route",
                    format!("{} is not a cuDNN {} algorithm", a.label(), d),
                ));
            }
        }
        if r.path != ConvPath::Cudnn && r.cudnn_algo.is_some() {
            return Err(Error::invalid(
                "route",
                "only a cuDNN route names a cuDNN algorithm",
            ));
        }
        if r.path.winograd_tile().is_none() && r.engine.is_some() {
            return Err(Error::invalid(
                "route",
                "only a Winograd route names an engine",
            ));
        }
        self.exec_of(r)
    }

    /// Validates the operands (roles x, w, y; `out` is the output role) and returns their
    /// device addresses by role.
    fn check(&self, args: [Arg; 3], ptrs: [u64; 3], out: usize) -> Result<CudnnPtrs> {
        let ordinal = self.ctx.info().ordinal;
        let what = [
            "n*c_in*h*w (the problem's input)",
            "c_out*c_in*kh*kw (the problem's filter)",
            "n*c_out*oh*ow (the problem's output)",
        ];
        let infos: Vec<BufInfo> = (0..3)
            .map(|i| BufInfo {
                name: args[i].name,
                ptr: ptrs[i],
                len: args[i].len,
                elem: T::DTYPE.size(),
                ordinal: args[i].ordinal,
            })
            .collect();
        for (i, b) in infos.iter().enumerate() {
            expect_device(b, ordinal)?;
            expect_len(b, self.core.lens[i], what[i])?;
        }
        let inputs: Vec<BufInfo> = (0..3).filter(|&i| i != out).map(|i| infos[i]).collect();
        expect_outputs_disjoint(&[infos[out]], &inputs)?;
        Ok(CudnnPtrs {
            x: ptrs[0],
            w: ptrs[1],
            y: ptrs[2],
        })
    }

    /// Runs `d` on checked operands: the forced route, or the decided one with a fallback when
    /// it fails at run time.
    fn run(
        &self,
        d: Direction,
        p: CudnnPtrs,
        accumulate: bool,
        forced: Option<Route>,
    ) -> Result<()> {
        let plan = self.plan_for(d);
        if !plan.runnable {
            return Err(Error::NotSupported(format!(
                "no path can compute this {}: {}",
                d.describe(),
                plan.reasons.join("; ")
            )));
        }
        let core = &*self.core;
        let target = self.target();
        if let Some(r) = forced {
            let e = self.forced(d, r, p)?;
            tracing::debug!(direction = %d, route = %e.route, "convolution (forced route)");
            // SAFETY: operands checked by `check`; the route was checked against the plan.
            return unsafe { route::run(&target, d, e, p, accumulate) };
        }
        let e = self.decided(d, p)?;
        tracing::trace!(direction = %d, route = %e.route, "convolution");
        // SAFETY: as above.
        let first = unsafe { route::run(&target, d, e, p, accumulate) };
        let Err(err) = first else {
            return Ok(());
        };
        let Some(fb) = plan.fallback_route(e.route.path) else {
            return Err(err);
        };
        let fb_exec = match fb.path {
            ConvPath::Cudnn => match self.cudnn_execs(d, p, 1) {
                Ok((v, _, _)) if !v.is_empty() => v[0],
                _ => return Err(err),
            },
            _ => self.exec_of(fb)?,
        };
        tracing::warn!(
            problem = ?core.shape, dtype = %core.dtype, direction = %d, failed = %e.route,
            fallback = %fb_exec.route, error = %err,
            "convolution route failed at run time; this problem uses the fallback from now on"
        );
        let mut c = ConvChoice::planned(fb_exec.route, ChoiceOrigin::Fallback);
        c.notes
            .push(format!("{} failed at run time: {err}", e.route));
        // Other Contexts of the process take the fallback too (never written to the file).
        let key = ChoiceKey::of(self.ctx.info().ordinal as u32, plan, core.search);
        choice::insert(key, c.clone(), self.ctx.config().plan_cache_capacity);
        *lock(&core.state[dir_index(d)]) = Some(Decided {
            exec: fb_exec,
            choice: c,
            report: None,
        });
        // SAFETY: as above.
        unsafe { route::run(&target, d, fb_exec, p, accumulate) }
    }

    /// `y = conv(x, w)`: validates every argument (lengths, device, `y` overlapping `x` or `w`)
    /// before anything runs, then runs the decided route (deciding on the first call).
    pub fn forward<X, W, Y>(&self, x: &X, w: &W, y: &mut Y) -> Result<()>
    where
        X: DevicePtr<T>,
        W: DevicePtr<T>,
        Y: DevicePtrMut<T>,
    {
        self.forward_impl(x, w, y, None)
    }

    /// [`Conv2d::forward`] with an epilogue (today only [`Epilogue::None`]).
    pub fn forward_with_epilogue<X, W, Y>(
        &self,
        x: &X,
        w: &W,
        y: &mut Y,
        epilogue: Epilogue,
    ) -> Result<()>
    where
        X: DevicePtr<T>,
        W: DevicePtr<T>,
        Y: DevicePtrMut<T>,
    {
        match epilogue {
            Epilogue::None => self.forward_impl(x, w, y, None),
        }
    }

    /// [`Conv2d::forward`] on a given route (tests, benchmarks): no measurement, no fallback.
    /// A route whose path is not eligible for the problem is an [`Error::NotSupported`]; a
    /// Winograd route without an engine takes the plan's, a cuDNN route without an algorithm
    /// the decided one or cuDNN's first usable.
    pub fn forward_with<X, W, Y>(&self, route: Route, x: &X, w: &W, y: &mut Y) -> Result<()>
    where
        X: DevicePtr<T>,
        W: DevicePtr<T>,
        Y: DevicePtrMut<T>,
    {
        self.forward_impl(x, w, y, Some(route))
    }

    fn forward_impl<X, W, Y>(&self, x: &X, w: &W, y: &mut Y, route: Option<Route>) -> Result<()>
    where
        X: DevicePtr<T>,
        W: DevicePtr<T>,
        Y: DevicePtrMut<T>,
    {
        let args = [arg("x", x), arg("w", w), arg("y", y)];
        self.precheck(&args)?;
        let stream = self.ctx.stream();
        let (xp, _gx) = x.device_ptr(stream);
        let (wp, _gw) = w.device_ptr(stream);
        let (yp, _gy) = y.device_ptr_mut(stream);
        let p = self.check(args, [xp, wp, yp], 2)?;
        self.run(Direction::Forward, p, false, route)
    }

    /// Lengths and devices, before any device pointer is taken (taking one from a buffer of
    /// another device would make the Context's stream wait on a foreign event).
    fn precheck(&self, args: &[Arg; 3]) -> Result<()> {
        let ordinal = self.ctx.info().ordinal;
        for (i, a) in args.iter().enumerate() {
            let b = BufInfo {
                name: a.name,
                ptr: 0,
                len: a.len,
                elem: T::DTYPE.size(),
                ordinal: a.ordinal,
            };
            expect_device(&b, ordinal)?;
            expect_len(&b, self.core.lens[i], "the problem's extent")?;
        }
        Ok(())
    }

    /// The data gradient `dx` from `dy` (the output's gradient) and `w`, overwriting `dx`.
    pub fn backward_data<D, W, X>(&self, dy: &D, w: &W, dx: &mut X) -> Result<()>
    where
        D: DevicePtr<T>,
        W: DevicePtr<T>,
        X: DevicePtrMut<T>,
    {
        self.backward_data_impl(dy, w, dx, None)
    }

    /// [`Conv2d::backward_data`] on a given route (see [`Conv2d::forward_with`]).
    pub fn backward_data_with<D, W, X>(&self, route: Route, dy: &D, w: &W, dx: &mut X) -> Result<()>
    where
        D: DevicePtr<T>,
        W: DevicePtr<T>,
        X: DevicePtrMut<T>,
    {
        self.backward_data_impl(dy, w, dx, Some(route))
    }

    fn backward_data_impl<D, W, X>(
        &self,
        dy: &D,
        w: &W,
        dx: &mut X,
        route: Option<Route>,
    ) -> Result<()>
    where
        D: DevicePtr<T>,
        W: DevicePtr<T>,
        X: DevicePtrMut<T>,
    {
        let args = [arg("dx", dx), arg("w", w), arg("dy", dy)];
        self.precheck(&args)?;
        let stream = self.ctx.stream();
        let (dyp, _g1) = dy.device_ptr(stream);
        let (wp, _g2) = w.device_ptr(stream);
        let (dxp, _g3) = dx.device_ptr_mut(stream);
        let p = self.check(args, [dxp, wp, dyp], 0)?;
        self.run(Direction::BackwardData, p, false, route)
    }

    /// The filter gradient from `x` and `dy`: written to `dw`, or added to it with
    /// `accumulate` (a weight shared by several layers).
    pub fn backward_filter<X, D, W>(
        &self,
        x: &X,
        dy: &D,
        dw: &mut W,
        accumulate: bool,
    ) -> Result<()>
    where
        X: DevicePtr<T>,
        D: DevicePtr<T>,
        W: DevicePtrMut<T>,
    {
        self.backward_filter_impl(x, dy, dw, accumulate, None)
    }

    /// [`Conv2d::backward_filter`] on a given route (see [`Conv2d::forward_with`]).
    pub fn backward_filter_with<X, D, W>(
        &self,
        route: Route,
        x: &X,
        dy: &D,
        dw: &mut W,
        accumulate: bool,
    ) -> Result<()>
    where
        X: DevicePtr<T>,
        D: DevicePtr<T>,
        W: DevicePtrMut<T>,
    {
        self.backward_filter_impl(x, dy, dw, accumulate, Some(route))
    }

    fn backward_filter_impl<X, D, W>(
        &self,
        x: &X,
        dy: &D,
        dw: &mut W,
        accumulate: bool,
        route: Option<Route>,
    ) -> Result<()>
    where
        X: DevicePtr<T>,
        D: DevicePtr<T>,
        W: DevicePtrMut<T>,
    {
        let args = [arg("x", x), arg("dw", dw), arg("dy", dy)];
        self.precheck(&args)?;
        let stream = self.ctx.stream();
        let (xp, _g1) = x.device_ptr(stream);
        let (dyp, _g2) = dy.device_ptr(stream);
        let (dwp, _g3) = dw.device_ptr_mut(stream);
        let p = self.check(args, [xp, dwp, dyp], 1)?;
        self.run(Direction::BackwardFilter, p, accumulate, route)
    }

    /// Makes `w` ready for repeated forwards with **unchanged weights** (the caller's promise):
    /// copies it, and when the forward runs (or is planned to run) on a Winograd path,
    /// transforms it once for that tile size. [`Conv2d::forward_prepared`] then skips the
    /// filter transform. If the weights change, prepare again.
    pub fn prepare_filter<W: DevicePtr<T>>(&self, w: &W) -> Result<PreparedFilter<T>> {
        let a = arg("w", w);
        let ordinal = self.ctx.info().ordinal;
        let b = BufInfo {
            name: "w",
            ptr: 0,
            len: a.len,
            elem: T::DTYPE.size(),
            ordinal: a.ordinal,
        };
        expect_device(&b, ordinal)?;
        expect_len(
            &b,
            self.core.lens[1],
            "c_out*c_in*kh*kw (the problem's filter)",
        )?;
        let raw = self.ctx.stream().clone_dtod(w).call("cuMemcpyDtoDAsync")?;
        let pf = PreparedFilter {
            owner: self.core.id,
            raw,
            transformed: Mutex::new([None, None]),
        };
        let decided = lock(&self.core.state[0]).as_ref().map(|s| s.exec.route);
        let route = decided.unwrap_or_else(|| self.plan().route());
        if let Some(tile) = route.path.winograd_tile() {
            self.transformed(&pf, tile)?;
        }
        Ok(pf)
    }

    /// The transformed filter of `tile` (made on first use); returns its address.
    fn transformed(&self, pf: &PreparedFilter<T>, tile: WinogradTile) -> Result<u64> {
        let mut t = lock(&pf.transformed);
        let slot = &mut t[tile_index(tile)];
        if slot.is_none() {
            let eq = self.core.shape;
            let v = super::problem::winograd_dims(&eq, tile)?.v;
            // SAFETY: written by the transform before any read.
            let mut buf =
                unsafe { self.ctx.stream().alloc::<T>(v.max(1)) }.call("cuMemAllocAsync")?;
            {
                let stream = self.ctx.stream();
                let (wp, _g1) = pf.raw.device_ptr(stream);
                let (vp, _g2) = buf.device_ptr_mut(stream);
                // SAFETY: wp holds the filter (w_len elements), vp the transform's v elements.
                unsafe {
                    winograd::transform_filter(&self.ctx, &eq, self.core.dtype, tile, wp, vp)
                }?;
            }
            *slot = Some(buf);
        }
        match slot {
            Some(b) => Ok(b.device_ptr(self.ctx.stream()).0),
            None => Err(Error::NotSupported("transformed filter vanished".into())),
        }
    }

    /// `y = conv(x, w)` with a filter from [`Conv2d::prepare_filter`]: a Winograd route uses
    /// the transformed filter (made now if the route's tile has none yet); any other route the
    /// prepared copy. Errors on a filter prepared by another `Conv2d`.
    pub fn forward_prepared<X, Y>(&self, x: &X, w: &PreparedFilter<T>, y: &mut Y) -> Result<()>
    where
        X: DevicePtr<T>,
        Y: DevicePtrMut<T>,
    {
        if w.owner != self.core.id {
            return Err(Error::invalid(
                "w",
                "was prepared by a different Conv2d (problem, type or Context differ)",
            ));
        }
        let args = [arg("x", x), arg("w", &w.raw), arg("y", y)];
        self.precheck(&args)?;
        let stream = self.ctx.stream();
        let (xp, _gx) = x.device_ptr(stream);
        let (wp, _gw) = w.raw.device_ptr(stream);
        let (yp, _gy) = y.device_ptr_mut(stream);
        let p = self.check(args, [xp, wp, yp], 2)?;
        let plan = self.plan();
        if !plan.runnable {
            return self.run(Direction::Forward, p, false, None);
        }
        let e = self.decided(Direction::Forward, p)?;
        if let (Some(tile), Some(engine)) = (e.route.path.winograd_tile(), e.route.engine) {
            let v = self.transformed(w, tile)?;
            let core = &*self.core;
            // SAFETY: operands checked; v holds the transformed filter of this problem and tile.
            let r = unsafe {
                winograd::forward_prepared(
                    &self.ctx,
                    &core.shape,
                    core.dtype,
                    tile,
                    engine,
                    FwdPtrs {
                        x: p.x,
                        w: v,
                        y: p.y,
                    },
                )
            };
            match r {
                Ok(()) => return Ok(()),
                Err(err) => tracing::warn!(error = %err,
                    "Winograd forward with a prepared filter failed; running the plain forward"),
            }
        }
        self.run(Direction::Forward, p, false, None)
    }
}
