//! [`Conv2d`]: the convolution dispatcher's public face. One object per (problem, data type) on a Context,
//! holding its plans, its cuDNN descriptors and, once made, its decision per direction; the
//! operations validate every argument, then run the decided route (measuring on the first call
//! where the plan says so), falling back when a route fails at run time.

use std::marker::PhantomData;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

use super::choice::{search_for, AutoReport, ConvChoice, CudnnSearch};
use super::cudnn::CudnnPerf;
use super::plan::{ConvPath, ConvPlan, Route};
use super::problem::{ConvShape, CudnnPtrs, Direction, FwdPtrs, WinogradGeometry, WinogradTile};
use super::state::{lock, Core, CoreKey, HIDE_CUDNN};
use super::winograd;
use crate::context::Context;
use crate::dtype::Element;
use crate::error::{CallExt, Error, Result};
use crate::layout::TensorFormat;
use crate::validate::{Aliasing, Binder, Need};

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

/// What a length error says the operands' lengths come from.
const EXTENT: &str = "the problem's extent";

/// Operand roles, as indices of `Core::lens`.
const X: usize = 0;
const W: usize = 1;
const Y: usize = 2;

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
/// let x = s.alloc_zeros::<half::f16>(shape.x_len()?)?;
/// let w = s.alloc_zeros::<half::f16>(shape.w_len()?)?;
/// let mut y = s.alloc_zeros::<half::f16>(shape.y_len()?)?;
/// conv.forward(&x, &w, &mut y)?;
/// println!("{:?}", conv.choice(nnfuse::conv::Direction::Forward));
/// # Ok(()) }
/// ```
pub struct Conv2d<T: Element> {
    pub(super) ctx: Context,
    pub(super) core: Arc<Core>,
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
            search: search_for(ctx.config()),
            hide_cudnn: HIDE_CUDNN.load(Ordering::Relaxed),
        };
        let mut made = false;
        let core = ctx.memo(key, || {
            made = true;
            Core::new(ctx, &key).map(Arc::new)
        })?;
        let conv = Conv2d {
            ctx: ctx.clone(),
            core,
            _t: PhantomData,
        };
        if made {
            // A new problem: its first calls' kernels start compiling in the background now.
            conv.prepare_first_calls();
        }
        Ok(conv)
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

    /// The decision for `d`'s overwriting calls once one made it, else (only accumulating calls
    /// so far) the decision for its accumulating calls ([`Conv2d::choice_for`] asks for a
    /// mode).
    pub fn choice(&self, d: Direction) -> Option<ConvChoice> {
        self.choice_for(d, self.shown_mode(d))
    }

    /// The decision for `d`'s calls that overwrite their output (`accumulate = false`) or add
    /// to it (`true`: a gradient accumulated, [`Conv2d::backward_data_into`],
    /// [`Conv2d::backward_filter`]), once a call of that mode made it. Each mode is decided on
    /// its own first call, measured in that mode; the forward's calls always overwrite.
    pub fn choice_for(&self, d: Direction, accumulate: bool) -> Option<ConvChoice> {
        lock(self.core.decision(d, accumulate))
            .as_ref()
            .map(|s| s.choice.clone())
    }

    /// The measurement behind the decision for `d` ([`Conv2d::choice`]'s), when this object
    /// measured.
    pub fn report(&self, d: Direction) -> Option<Arc<AutoReport>> {
        self.report_for(d, self.shown_mode(d))
    }

    /// The measurement behind the decision for `d`'s calls of one mode
    /// ([`Conv2d::choice_for`]), when this object measured ([`AutoReport::accumulate`] says
    /// the mode it ran in).
    pub fn report_for(&self, d: Direction, accumulate: bool) -> Option<Arc<AutoReport>> {
        lock(self.core.decision(d, accumulate))
            .as_ref()
            .and_then(|s| s.report.clone())
    }

    /// The mode [`Conv2d::choice`] shows for `d`: overwriting once decided, else accumulating.
    fn shown_mode(&self, d: Direction) -> bool {
        lock(self.core.decision(d, false)).is_none() && lock(self.core.decision(d, true)).is_some()
    }

    /// The cuDNN search mode this object was planned under.
    pub fn cudnn_search(&self) -> CudnnSearch {
        self.core.search
    }

    /// cuDNN's heuristic algorithm list for `d` (`cudnnGetConvolution*Algorithm_v7`), every
    /// entry as cuDNN gives it (filter with [`crate::conv::cudnn::usable`]). Errors when cuDNN is
    /// not available to this problem.
    pub fn cudnn_heuristics(&self, d: Direction) -> Result<Vec<CudnnPerf>> {
        let conv = self.core.cudnn_conv()?;
        let mut g = self.ctx.lock()?;
        let h = g.cudnn()?;
        // SAFETY: live handle, held under the Context's lock.
        unsafe { conv.heuristics(h, d) }
    }

    /// Bytes of workspace `route` uses for `d`: cuDNN's for its algorithm (library workspace),
    /// the plan's scratch for nnfuse's paths.
    pub fn workspace_bytes(&self, d: Direction, route: Route) -> Result<usize> {
        match (route.path, route.cudnn_algo) {
            (ConvPath::Cudnn, Some(a)) => self.core.cudnn_ws(&self.ctx, a),
            (ConvPath::Cudnn, None) => Ok(0),
            (p, _) => Ok(self.plan_for(d).info(p).scratch_bytes),
        }
    }

    /// The length the operand of `role` must have.
    fn need(&self, role: usize) -> Need {
        Need::Exactly(self.core.lens[role], EXTENT)
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
        crate::profile::stage!(Call);
        // Inputs first, then the output: an overlap names the output.
        let mut bind = Binder::new(&self.ctx);
        let p = CudnnPtrs {
            x: bind.input("x", x, self.need(X))?,
            w: bind.input("w", w, self.need(W))?,
            y: bind.output("y", y, self.need(Y))?,
        };
        bind.check(Aliasing::Distinct)?;
        self.run(Direction::Forward, p, false, route)
    }

    /// The data gradient `dx` from `dy` (the output's gradient) and `w`, overwriting `dx`
    /// ([`Conv2d::backward_data_into`] with `accumulate = false`).
    pub fn backward_data<D, W, X>(&self, dy: &D, w: &W, dx: &mut X) -> Result<()>
    where
        D: DevicePtr<T>,
        W: DevicePtr<T>,
        X: DevicePtrMut<T>,
    {
        self.backward_data_impl(dy, w, dx, false, None)
    }

    /// [`Conv2d::backward_data`] on a given route (see [`Conv2d::forward_with`]).
    pub fn backward_data_with<D, W, X>(&self, route: Route, dy: &D, w: &W, dx: &mut X) -> Result<()>
    where
        D: DevicePtr<T>,
        W: DevicePtr<T>,
        X: DevicePtrMut<T>,
    {
        self.backward_data_impl(dy, w, dx, false, Some(route))
    }

    /// The data gradient from `dy` and `w`: written to `dx`, or added to it with `accumulate`
    /// (`dx += bwd_data(dy, w)`: an input that also feeds a shortcut, whose gradient `dx`
    /// already holds). The sum is formed in f32 and rounded once. cuDNN and im2col + GEMM add
    /// in place; Winograd cannot ([`ConvPlan::accumulate_refusal`]). Accumulating calls have
    /// their own decision, made on the first of them among the routes that can add, each
    /// measured adding ([`Conv2d::choice_for`]); when none of the plan's candidates can, the
    /// plan's fallback runs them. When the route fails at run time, an accumulating call is
    /// not re-run on the fallback (the failed route may have added to `dx` already): it returns
    /// [`Error::NotSupported`] saying `dx` may be partly updated, and later calls take the
    /// fallback.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use nnfuse::conv::{Conv2d, ConvShape};
    /// use nnfuse::TensorFormat;
    /// let ctx = nnfuse::Context::new(0)?;
    /// let shape = ConvShape {
    ///     n: 32, c_in: 256, h: 56, w: 56, c_out: 64, kh: 1, kw: 1,
    ///     stride: (1, 1), pad: (0, 0), dilation: (1, 1), format: TensorFormat::Nhwc,
    /// };
    /// let conv = Conv2d::<half::f16>::new(&ctx, &shape)?;
    /// let s = ctx.stream();
    /// let dy = s.alloc_zeros::<half::f16>(shape.y_len()?)?;
    /// let w = s.alloc_zeros::<half::f16>(shape.w_len()?)?;
    /// // dx already holds the shortcut's gradient; the convolution's is added to it.
    /// let mut dx = s.alloc_zeros::<half::f16>(shape.x_len()?)?;
    /// conv.backward_data_into(&dy, &w, &mut dx, true)?;
    /// # Ok(()) }
    /// ```
    pub fn backward_data_into<D, W, X>(
        &self,
        dy: &D,
        w: &W,
        dx: &mut X,
        accumulate: bool,
    ) -> Result<()>
    where
        D: DevicePtr<T>,
        W: DevicePtr<T>,
        X: DevicePtrMut<T>,
    {
        self.backward_data_impl(dy, w, dx, accumulate, None)
    }

    /// [`Conv2d::backward_data_into`] on a given route (see [`Conv2d::forward_with`]): an
    /// accumulating call on a route that cannot add is an [`Error::NotSupported`] with the
    /// plan's reason.
    pub fn backward_data_with_into<D, W, X>(
        &self,
        route: Route,
        dy: &D,
        w: &W,
        dx: &mut X,
        accumulate: bool,
    ) -> Result<()>
    where
        D: DevicePtr<T>,
        W: DevicePtr<T>,
        X: DevicePtrMut<T>,
    {
        self.backward_data_impl(dy, w, dx, accumulate, Some(route))
    }

    fn backward_data_impl<D, W, X>(
        &self,
        dy: &D,
        w: &W,
        dx: &mut X,
        accumulate: bool,
        route: Option<Route>,
    ) -> Result<()>
    where
        D: DevicePtr<T>,
        W: DevicePtr<T>,
        X: DevicePtrMut<T>,
    {
        crate::profile::stage!(Call);
        let mut bind = Binder::new(&self.ctx);
        let wp = bind.input("w", w, self.need(W))?;
        let dyp = bind.input("dy", dy, self.need(Y))?;
        let dxp = bind.output("dx", dx, self.need(X))?;
        bind.check(Aliasing::Distinct)?;
        let p = CudnnPtrs {
            x: dxp,
            w: wp,
            y: dyp,
        };
        self.run(Direction::BackwardData, p, accumulate, route)
    }

    /// The filter gradient from `x` and `dy`: written to `dw`, or added to it with
    /// `accumulate` (a weight shared by several layers). When the decided route fails at run
    /// time, an overwriting call is re-run on the fallback; an accumulating one is not (the
    /// failed route may have added to `dw` already): it returns [`Error::NotSupported`] saying
    /// `dw` may be partly updated, and later calls take the fallback.
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
        crate::profile::stage!(Call);
        let mut bind = Binder::new(&self.ctx);
        let xp = bind.input("x", x, self.need(X))?;
        let dyp = bind.input("dy", dy, self.need(Y))?;
        let dwp = bind.output("dw", dw, self.need(W))?;
        bind.check(Aliasing::Distinct)?;
        let p = CudnnPtrs {
            x: xp,
            w: dwp,
            y: dyp,
        };
        self.run(Direction::BackwardFilter, p, accumulate, route)
    }

    /// Makes `w` ready for repeated forwards with **unchanged weights** (the caller's promise):
    /// copies it, and when the forward runs (or is planned to run) on a Winograd path,
    /// transforms it once for that tile size. [`Conv2d::forward_prepared`] then skips the
    /// filter transform. If the weights change, prepare again.
    pub fn prepare_filter<W: DevicePtr<T>>(&self, w: &W) -> Result<PreparedFilter<T>> {
        {
            let mut bind = Binder::new(&self.ctx);
            let what = "c_out*c_in*kh*kw (the problem's filter)";
            bind.input("w", w, Need::Exactly(self.core.lens[W], what))?;
            bind.check(Aliasing::Distinct)?;
        }
        let raw = self.ctx.stream().clone_dtod(w).call("cuMemcpyDtoDAsync")?;
        let pf = PreparedFilter {
            owner: self.core.id,
            raw,
            transformed: Mutex::new([None, None]),
        };
        let decided = lock(self.core.decision(Direction::Forward, false))
            .as_ref()
            .map(|s| s.exec);
        // The decided route's geometry; before the first forward, the planned route's.
        let geometry = match decided {
            Some(e) => e.winograd,
            None => match self.plan().route().path.winograd_tile() {
                Some(tile) => Some(WinogradGeometry::forward(&self.core.shape, tile)?),
                None => None,
            },
        };
        if let Some(g) = geometry {
            self.transformed(&pf, &g)?;
        }
        Ok(pf)
    }

    /// The transformed filter of forward geometry `g`'s tile (made on first use); returns its
    /// address.
    fn transformed(&self, pf: &PreparedFilter<T>, g: &WinogradGeometry) -> Result<u64> {
        let mut t = lock(&pf.transformed);
        let slot = &mut t[tile_index(g.tile)];
        if slot.is_none() {
            self.ctx
                .refuse_under_capture("a filter's first Winograd transform", "allocate it")?;
            let v = g.dims.v;
            // SAFETY: written by the transform before any read.
            let mut buf =
                unsafe { self.ctx.stream().alloc::<T>(v.max(1)) }.call("cuMemAllocAsync")?;
            {
                let stream = self.ctx.stream();
                let (wp, _g1) = pf.raw.device_ptr(stream);
                let (vp, _g2) = buf.device_ptr_mut(stream);
                // SAFETY: wp holds the filter (w_len elements), vp the transform's v elements.
                unsafe { winograd::transform_filter(&self.ctx, g, self.core.dtype, wp, vp) }?;
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
        let mut bind = Binder::new(&self.ctx);
        let p = CudnnPtrs {
            x: bind.input("x", x, self.need(X))?,
            w: bind.input("w", &w.raw, self.need(W))?,
            y: bind.output("y", y, self.need(Y))?,
        };
        bind.check(Aliasing::Distinct)?;
        let plan = self.plan();
        if !plan.runnable {
            return self.run(Direction::Forward, p, false, None);
        }
        let e = self.decided(Direction::Forward, p, false)?;
        if let (Some(g), Some(engine)) = (e.winograd.as_ref(), e.route.engine) {
            let v = self.transformed(w, g)?;
            // SAFETY: operands checked; v holds the transformed filter of this problem and tile.
            let r = unsafe {
                winograd::forward_prepared(
                    &self.ctx,
                    g,
                    self.core.dtype,
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
