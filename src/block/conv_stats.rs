//! [`ConvStats`]: a forward convolution that also produces the per-channel sum and sum of
//! squares of its output (the first piece of the fused training block, docs/BLOCK-TRAINING.md
//! fusion (a')), its two routes on validated operands, and the run-time fallback.

use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaView, CudaViewMut};

use super::api::lock;
use super::pointwise;
use super::stats_kernel::{channel_sums, SumsOut};
use super::stats_plan::{stats_plan, StatsPlan, StatsRoute};
use crate::context::{cudnn_present, cudnn_version, Context};
use crate::conv::{Conv2d, ConvShape};
use crate::cudnn_graph::graph_fused::{FusedKey, FusedPattern, GraphFused};
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::layout::TensorFormat;
use crate::validate::{Aliasing, Binder, Need};

/// Engine configs of the graph route the first call finalizes, checks and times at most.
pub(super) const GRAPH_CANDIDATES: usize = 4;

/// How the first call decided, or a forced fallback.
#[derive(Debug, Clone, PartialEq)]
pub struct StatsChoice {
    /// The route later calls take.
    pub route: StatsRoute,
    /// With the graph route: the engine config that runs (its label).
    pub engine: Option<String>,
    /// GPU time per call (median, µs) of everything timed: `unfused` first, then each graph
    /// engine config that passed the check.
    pub times_us: Vec<(String, f64)>,
    /// One line per candidate: its check and timing, or why it was dropped.
    pub notes: Vec<String>,
}

/// The graph route's plans: not built yet, built, or why not.
pub(super) type GraphSlot = Option<std::result::Result<Arc<GraphFused>, String>>;

/// `y = conv(x, w)` for one problem and element type `T` (`f32`, `half::f16`, `half::bf16`),
/// which also writes the per-channel `sum` and `sqsum` (f32, over N, H, W) of y: what a training
/// BatchNorm after the convolution needs, so that
/// [`BatchNorm::forward_train_from_sums`](crate::batchnorm::BatchNorm::forward_train_from_sums)
/// can normalise y in one pass.
///
/// Routes ([`StatsRoute`], eligibility in [`ConvStats::plan`]): one cuDNN graph with
/// `GEN_STATS` in the convolution's epilogue (NHWC); nnfuse's own tensor-core kernel for 1x1
/// stride-1 convolutions (NHWC f16/bf16), the sums in its epilogue; or nnfuse's `Conv2d`
/// followed by nnfuse's own reduction. The first call runs the unfused route into the caller's
/// buffers, then the own kernel and the graph's first engine configs each into NaN-poisoned
/// buffers, checks y (relative L2: f32 1e-5, halves 1e-2) and the statistics
/// (8·u/sqrt(M) relative, at least 1e-5 for f32 and 1e-4 for halves) against it, times those that pass
/// against the unfused route (GPU time, interleaved) and keeps the fastest by the incumbent
/// rule (unfused is the incumbent). That call synchronises, allocates and copies to the host:
/// make it outside CUDA graph capture. A decided fused route that fails at run time falls back
/// to the unfused route for good, with a warning; operands not 16-byte aligned take the unfused
/// route for that call.
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use half::f16;
/// use nnfuse::block::ConvStats;
/// use nnfuse::conv::ConvShape;
/// use nnfuse::TensorFormat;
/// let ctx = nnfuse::Context::new(0)?;
/// let shape = ConvShape::square(32, 256, 56, 64, 1, TensorFormat::Nhwc);
/// let unit = ConvStats::<f16>::new(&ctx, &shape)?;
/// println!("{}", unit.plan());
/// let s = ctx.stream();
/// let x = s.clone_htod(&vec![f16::from_f32(0.5); shape.x_len()?])?;
/// let w = s.clone_htod(&vec![f16::from_f32(0.01); shape.w_len()?])?;
/// let mut y = s.alloc_zeros::<f16>(shape.y_len()?)?;
/// let (mut sum, mut sqsum) = (s.alloc_zeros::<f32>(64)?, s.alloc_zeros::<f32>(64)?);
/// unit.forward(&x.as_view(), &w.as_view(), &mut y.as_view_mut(),
///              &mut sum.as_view_mut(), &mut sqsum.as_view_mut())?;
/// println!("{:?}", unit.choice());
/// # Ok(()) }
/// ```
pub struct ConvStats<T: Element> {
    pub(super) ctx: Context,
    pub(super) plan: StatsPlan,
    pub(super) conv: Conv2d<T>,
    pub(super) graph: Mutex<GraphSlot>,
    pub(super) decision: Mutex<Option<StatsChoice>>,
    /// The sums take 2·c_out f32s each, the low words in the second half (the fused training
    /// unit's f32 statistics; only the unfused route writes them).
    pub(super) low_words: bool,
    pub(super) _t: PhantomData<fn() -> T>,
}

impl<T: Element> std::fmt::Debug for ConvStats<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConvStats")
            .field("shape", &self.plan.shape)
            .field("dtype", &self.plan.dtype)
            .field("decision", &*lock(&self.decision))
            .finish()
    }
}

/// The operands of one call, as device addresses in `GENSTATS_TENSORS` order.
pub(super) type Ptrs = [u64; 5];

impl<T: Element> ConvStats<T> {
    /// Plans `shape` for `T` (no GPU work; the graph is built on the first call). Starts
    /// compiling `kernels/block_stats.cu` in the background: the first call's unfused route
    /// needs its reduction, and NVRTC compiled it on that call's critical path — and, where the
    /// plan lists the own route, that dtype's unit of `kernels/conv_pointwise.cu`.
    pub fn new(ctx: &Context, shape: &ConvShape) -> Result<Self> {
        Self::build(ctx, shape, false)
    }

    /// [`ConvStats::new`] whose sums carry low words (`low_words`: buffers of 2·c_out, see
    /// [`StatsPlan::with_low_words`]).
    pub(crate) fn build(ctx: &Context, shape: &ConvShape, low_words: bool) -> Result<Self> {
        ctx.prepare_kernels(&[&crate::kernels::BLOCK_STATS]);
        let cudnn = if cudnn_present() {
            Some(cudnn_version()?)
        } else {
            None
        };
        let mut plan = stats_plan(shape, T::DTYPE, cudnn, ctx.config().deterministic)?
            .for_device(ctx.info().compute_capability);
        if low_words {
            plan = plan.with_low_words();
        }
        // Compiled only where the plan can take it (not for the 3x3 or strided problems).
        if plan.eligible(StatsRoute::OwnPointwise) {
            if let Some(own) = pointwise::unit(T::DTYPE) {
                ctx.prepare_kernels(&[own]);
            }
        }
        let unit = ConvStats {
            ctx: ctx.clone(),
            conv: Conv2d::<T>::new(ctx, shape)?,
            graph: Mutex::new(None),
            decision: Mutex::new(None),
            low_words,
            plan,
            _t: PhantomData,
        };
        tracing::info!(plan = %unit.plan, "conv+stats planned");
        Ok(unit)
    }

    /// Every route's eligibility and why.
    pub fn plan(&self) -> &StatsPlan {
        &self.plan
    }

    /// The decision, once the first call made it.
    pub fn choice(&self) -> Option<StatsChoice> {
        lock(&self.decision).clone()
    }

    /// `y = conv(x, w)` and `sum[k] = Σ y[.., k]`, `sqsum[k] = Σ y[.., k]²` over N, H, W (f32,
    /// length `c_out`): validates every operand (lengths, device, an output overlapping another
    /// buffer) before anything runs, then runs the decided route (deciding on the first call;
    /// see the type's documentation).
    pub fn forward(
        &self,
        x: &CudaView<'_, T>,
        w: &CudaView<'_, T>,
        y: &mut CudaViewMut<'_, T>,
        sum: &mut CudaViewMut<'_, f32>,
        sqsum: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let decided = lock(&self.decision).as_ref().map(|c| c.route);
        if let Some(r @ (StatsRoute::GraphGenstats | StatsRoute::OwnPointwise)) = decided {
            if self.run_decided_fused(r, x, w, y, sum, sqsum)? {
                return Ok(());
            }
        }
        // The unfused route writes y before it binds the sums: every operand is checked first.
        self.validate(x, w, y, sum, sqsum)?;
        match decided {
            None => crate::cudnn_graph::replay::suspended(|| self.decide(x, w, y, sum, sqsum)),
            Some(_) => self.run_unfused(x, w, y, sum, sqsum),
        }
    }

    /// The decided fused route (`graph_genstats` or `own_pointwise`), its operands checked once
    /// (by its own binding, before the launch): `Ok(true)` when it ran; `Ok(false)` when they are
    /// not aligned for it (16 bytes), or when the route failed here and fell back for good — the
    /// caller then runs the unfused route.
    fn run_decided_fused(
        &self,
        route: StatsRoute,
        x: &CudaView<'_, T>,
        w: &CudaView<'_, T>,
        y: &CudaViewMut<'_, T>,
        sum: &CudaViewMut<'_, f32>,
        sqsum: &CudaViewMut<'_, f32>,
    ) -> Result<bool> {
        let failed = |e: Error| match e {
            Error::InvalidArgument { .. } | Error::Capture { .. } => Err(e),
            e => {
                self.fall_back(route, &e);
                Ok(false)
            }
        };
        let graph = match route {
            StatsRoute::GraphGenstats => match self.graph() {
                Ok(g) => Some(g),
                Err(e) => return failed(e),
            },
            _ => None,
        };
        let (_bound, p) = self.bind(x, w, y, sum, sqsum)?;
        // The graph's tensors are all built 16-byte aligned; the own kernel moves x, w and y in
        // 16-byte pieces.
        let ok = match graph {
            Some(_) => aligned(&p),
            None => pointwise::aligned(p[0], p[1], p[2]),
        };
        if !ok {
            return Ok(false);
        }
        // SAFETY: checked by `bind` (lengths, device, outputs disjoint) and aligned above.
        let ran = match &graph {
            Some(g) => unsafe { g.execute(&self.ctx, None, &p) },
            None => unsafe { self.own_raw(&p) },
        };
        match ran {
            Ok(()) => Ok(true),
            Err(e) => failed(e),
        }
    }

    /// The own route on bound operands.
    ///
    /// # Safety
    /// `p` came from [`ConvStats::bind`] of live operands.
    pub(super) unsafe fn own_raw(&self, p: &Ptrs) -> Result<()> {
        let s = &self.plan.shape;
        // SAFETY: the caller's contract; the launcher checks the alignment itself.
        unsafe { pointwise::run(&self.ctx, s, T::DTYPE, p[0], p[1], p[2], p[3], p[4]) }
    }

    /// The own route, its operands checked.
    pub(super) fn run_own(
        &self,
        x: &CudaView<'_, T>,
        w: &CudaView<'_, T>,
        y: &mut CudaViewMut<'_, T>,
        sum: &mut CudaViewMut<'_, f32>,
        sqsum: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let (_bound, p) = self.bind(x, w, y, sum, sqsum)?;
        // SAFETY: bound and checked just above.
        unsafe { self.own_raw(&p) }
    }

    /// [`ConvStats::forward`] on a given route (tests, benchmarks): no measurement, no
    /// fallback; the graph route runs its chosen engine config (the first that finalized until
    /// a first call measured them). A route the plan refuses is an [`Error::NotSupported`]
    /// carrying the plan's reason, as is the graph route on operands not 16-byte aligned.
    pub fn forward_with(
        &self,
        route: StatsRoute,
        x: &CudaView<'_, T>,
        w: &CudaView<'_, T>,
        y: &mut CudaViewMut<'_, T>,
        sum: &mut CudaViewMut<'_, f32>,
        sqsum: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        if !self.plan.eligible(route) {
            return Err(Error::NotSupported(format!(
                "route {route} cannot run this problem: {}",
                self.plan.reason(route)
            )));
        }
        let ptrs = self.validate(x, w, y, sum, sqsum)?;
        match route {
            StatsRoute::Unfused => self.run_unfused(x, w, y, sum, sqsum),
            StatsRoute::GraphGenstats if !aligned(&ptrs) => Err(Error::NotSupported(
                "graph_genstats: an operand is not 16-byte aligned (the graph's tensors are \
                 built for 16-byte alignment)"
                    .into(),
            )),
            StatsRoute::GraphGenstats => self.run_graph(None, x, w, y, sum, sqsum),
            StatsRoute::OwnPointwise => self.run_own(x, w, y, sum, sqsum),
        }
    }

    /// Binds and checks every operand: the addresses (x, w, y, sum, sqsum), the binder holding
    /// their stream events.
    pub(super) fn bind<'b>(
        &'b self,
        x: &'b CudaView<'_, T>,
        w: &'b CudaView<'_, T>,
        y: &'b CudaViewMut<'_, T>,
        sum: &'b CudaViewMut<'_, f32>,
        sqsum: &'b CudaViewMut<'_, f32>,
    ) -> Result<(Binder<'b>, Ptrs)> {
        crate::profile::stage!(Call);
        let s = &self.plan.shape;
        let (x_len, w_len, y_len) = (s.x_len()?, s.w_len()?, s.y_len()?);
        let mut bind = Binder::new(&self.ctx);
        let xp = bind.input("x", x, Need::Exactly(x_len, "n*c_in*h*w"))?;
        let wp = bind.input("w", w, Need::Exactly(w_len, "c_out*c_in*kh*kw"))?;
        let yp = bind.output_ref("y", y, Need::Exactly(y_len, "n*c_out*oh*ow"))?;
        let sums = match self.low_words {
            true => Need::Exactly(2 * s.c_out, "2*c_out (high and low words)"),
            false => Need::Exactly(s.c_out, "c_out"),
        };
        let sp = bind.output_ref("sum", sum, sums)?;
        let qp = bind.output_ref("sqsum", sqsum, sums)?;
        bind.check(Aliasing::Distinct)?;
        Ok((bind, [xp, wp, yp, sp, qp]))
    }

    fn validate(
        &self,
        x: &CudaView<'_, T>,
        w: &CudaView<'_, T>,
        y: &CudaViewMut<'_, T>,
        sum: &CudaViewMut<'_, f32>,
        sqsum: &CudaViewMut<'_, f32>,
    ) -> Result<Ptrs> {
        self.bind(x, w, y, sum, sqsum).map(|(_, p)| p)
    }

    /// Values per channel (N·OH·OW).
    pub(super) fn rows(&self) -> Result<usize> {
        let s = &self.plan.shape;
        let (oh, ow) = s.out_hw()?;
        Ok(s.n * oh * ow)
    }

    /// The unfused route: `Conv2d` forward into y, then the per-channel reduction of y.
    pub(super) fn run_unfused(
        &self,
        x: &CudaView<'_, T>,
        w: &CudaView<'_, T>,
        y: &mut CudaViewMut<'_, T>,
        sum: &mut CudaViewMut<'_, f32>,
        sqsum: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        self.conv.forward(x, w, y)?;
        let (_bound, p) = self.bind(x, w, y, sum, sqsum)?;
        let s = &self.plan.shape;
        let rows = self.rows()? as u64;
        let hw = match s.format {
            TensorFormat::Nhwc => 0,
            TensorFormat::Nchw => (rows / s.n.max(1) as u64).max(1),
        };
        let c = s.c_out as u64;
        let out = match self.low_words {
            // The low words follow the c_out high words.
            true => SumsOut {
                sum: p[3],
                sqsum: p[4],
                sum_lo: p[3] + 4 * c,
                sqsum_lo: p[4] + 4 * c,
            },
            false => SumsOut::rounded(p[3], p[4]),
        };
        // SAFETY: y holds rows*c_out elements of T, sum and sqsum c_out (low words: 2·c_out)
        // f32s, on the Context's device, the outputs disjoint (checked by `bind`).
        unsafe { channel_sums(&self.ctx, T::DTYPE, p[2], rows, hw, c, out) }
    }

    /// The graph route's plans, built on first use (a failure is kept, with its reason). The
    /// engine policy is the convolutions' (`conv::graph_policy`): engines that
    /// compile at run time (bf16's only ConvGenStats engine on cuDNN 9.19, ~0.5 s to finalize)
    /// only for an exhaustive decision (`NNFUSE_CONV_TUNE_BUDGET_MS=0`).
    pub(super) fn graph(&self) -> Result<Arc<GraphFused>> {
        let mut slot = lock(&self.graph);
        if slot.is_none() {
            let key = FusedKey {
                pattern: FusedPattern::ConvGenStats,
                shape: self.plan.shape,
                dtype: T::DTYPE,
                policy: crate::conv::graph_policy(self.ctx.config()),
                limit: GRAPH_CANDIDATES,
            };
            *slot = Some(match GraphFused::cached(&self.ctx, key) {
                Ok(g) => Ok(g),
                Err(e) if crate::cudnn_graph::plans::is_unsupported(&e) => Err(e.to_string()),
                Err(e) => return Err(e),
            });
        }
        match slot.as_ref() {
            Some(Ok(g)) => Ok(g.clone()),
            Some(Err(why)) => Err(Error::NotSupported(why.clone())),
            None => Err(Error::NotSupported("graph plans missing".into())),
        }
    }

    /// The graph route with engine config `plan` (None: the chosen one).
    pub(super) fn run_graph(
        &self,
        plan: Option<usize>,
        x: &CudaView<'_, T>,
        w: &CudaView<'_, T>,
        y: &mut CudaViewMut<'_, T>,
        sum: &mut CudaViewMut<'_, f32>,
        sqsum: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let g = self.graph()?;
        let (_bound, p) = self.bind(x, w, y, sum, sqsum)?;
        if !aligned(&p) {
            return Err(Error::NotSupported(
                "graph_genstats: an operand is not 16-byte aligned".into(),
            ));
        }
        // SAFETY: checked by `bind` (lengths, device, outputs disjoint) and aligned above.
        unsafe { g.execute(&self.ctx, plan, &p) }
    }

    /// Makes the unfused route the decision after `route` failed with `e`.
    fn fall_back(&self, route: StatsRoute, e: &Error) {
        tracing::warn!(error = %e, %route,
            "conv+stats route failed; the unfused route takes over");
        let mut d = lock(&self.decision);
        let mut notes = d.as_ref().map(|c| c.notes.clone()).unwrap_or_default();
        notes.push(format!(
            "{route} failed at run time ({e}); fell back to unfused"
        ));
        let times_us = d.as_ref().map(|c| c.times_us.clone()).unwrap_or_default();
        *d = Some(StatsChoice {
            route: StatsRoute::Unfused,
            engine: None,
            times_us,
            notes,
        });
    }
}

/// Whether every address is 16-byte aligned (the graph's tensors are built for it).
fn aligned(p: &Ptrs) -> bool {
    p.iter().all(|a| a % 16 == 0)
}
