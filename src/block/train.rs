//! [`ConvBnTrain`]: `conv → BatchNorm(+ReLU | +Add+ReLU)` trained as one planned unit (the
//! fused training block, docs/BLOCK-TRAINING.md): its arguments, its two routes on validated
//! operands, the stages a caller may run apart, and the backward.

use std::sync::Mutex;

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};

use super::api::lock;
use super::conv_stats::{ConvStats, StatsChoice};
use super::fold_backward::FoldBackward;
use super::stats_plan::{unit_low_words, unit_sums_len, StatsRoute};
use super::train_plan::{
    bn_shape, fold_refusal, plan_train, FoldChoice, TrainPlan, TrainPlanRequest, TrainRoute,
};
use crate::batchnorm::{BackwardArgs, BatchNorm, BnPath, BnSaved, Fuse, TrainArgs};
use crate::config::BnImpl;
use crate::context::{cudnn_present, cudnn_version, Context};
use crate::conv::{Conv2d, ConvShape};
use crate::dtype::Element;
use crate::error::{CallExt, Error, Result};

/// The forward's operands: the convolution's (`x`, `w`, its output `z`) and the BatchNorm's
/// (as [`TrainArgs`], whose input is `z`).
pub struct ConvBnArgs<'a, T> {
    /// The convolution's input.
    pub x: CudaView<'a, T>,
    /// The filter.
    pub w: CudaView<'a, T>,
    /// The convolution's output, the BatchNorm's input: written here, read by the backward.
    pub z: CudaViewMut<'a, T>,
    /// The tensor added before the ReLU: required for `Fuse::AddRelu`, absent otherwise.
    pub addend: Option<CudaView<'a, T>>,
    /// Scale, one per output channel.
    pub gamma: CudaView<'a, f32>,
    /// Bias, one per output channel.
    pub beta: CudaView<'a, f32>,
    /// Running mean, updated in place.
    pub running_mean: CudaViewMut<'a, f32>,
    /// Running (unbiased) variance, updated in place.
    pub running_var: CudaViewMut<'a, f32>,
    /// The unit's output; must not overlap any input.
    pub y: CudaViewMut<'a, T>,
    /// Weight of the new batch statistics, in `[0, 1]`.
    pub momentum: f64,
    /// Added to the variance; finite and `> 0`.
    pub eps: f64,
}

/// The backward's operands. Gradients of `w`, `gamma` and `beta` are overwritten; the gradient
/// of `x` is overwritten or added to (`accumulate_dx`).
pub struct ConvBnBackwardArgs<'a, T> {
    /// The forward's `x`.
    pub x: CudaView<'a, T>,
    /// The filter.
    pub w: CudaView<'a, T>,
    /// The forward's `z` (the same buffer).
    pub z: CudaView<'a, T>,
    /// The forward's `y`.
    pub y: CudaView<'a, T>,
    /// Gradient of the loss with respect to `y`.
    pub dy: CudaView<'a, T>,
    /// Scale, as in the forward.
    pub gamma: CudaView<'a, f32>,
    /// Bias, as in the forward.
    pub beta: CudaView<'a, f32>,
    /// What the forward returned.
    pub saved: &'a TrainSaved,
    /// Scratch of z's extent: the gradient with respect to z.
    pub dz: CudaViewMut<'a, T>,
    /// Gradient with respect to `x`; `None` skips the data gradient (a first layer).
    pub dx: Option<CudaViewMut<'a, T>>,
    /// Add the data gradient into `dx` (a shortcut's gradient already there) instead of
    /// overwriting it.
    pub accumulate_dx: bool,
    /// Gradient with respect to `w`.
    pub dw: CudaViewMut<'a, T>,
    /// Gradient with respect to `gamma`.
    pub dgamma: CudaViewMut<'a, f32>,
    /// Gradient with respect to `beta`.
    pub dbeta: CudaViewMut<'a, f32>,
    /// Gradient with respect to the addend: required for `Fuse::AddRelu`, absent otherwise.
    pub d_addend: Option<CudaViewMut<'a, T>>,
}

/// What a forward saved for its backward: the BatchNorm's state and the route that made it.
#[derive(Debug)]
pub struct TrainSaved {
    pub(super) route: TrainRoute,
    pub(super) bn: BnSaved,
}

impl TrainSaved {
    /// The route the forward ran.
    pub fn route(&self) -> TrainRoute {
        self.route
    }

    /// The BatchNorm's state (for [`ConvBnTrain::backward_bn`]'s [`BackwardArgs`]).
    pub fn bn(&self) -> &BnSaved {
        &self.bn
    }
}

/// [`ConvBnTrain::forward_conv`]'s receipt: which route wrote z (and, fused, the sums), for
/// [`ConvBnTrain::forward_bn`].
#[derive(Debug)]
#[must_use = "forward_bn takes it"]
pub struct ConvDone {
    route: TrainRoute,
    unit: usize,
}

/// How the first call decided, or a forced route.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainChoice {
    /// The route later calls take.
    pub route: TrainRoute,
    /// GPU time (median, µs) of the forward plus the BatchNorm's backward per route timed
    /// (the convolution's gradients are the same on both routes and are not timed).
    pub times_us: Vec<(TrainRoute, f64)>,
    /// The fused route's ConvStats decision, when it ran.
    pub stats: Option<StatsChoice>,
    /// One line per step of the decision: the check, the timing, or why the fused route was
    /// not measured.
    pub notes: Vec<String>,
    /// Decided without measuring the fused route because its kernels were still compiling in
    /// the background (a first call under the tuning budget does not wait for them): the first
    /// `forward_train` after they are ready measures again ([`ConvBnTrain::pending`]).
    pub provisional: bool,
}

impl TrainChoice {
    /// One sentence: the route and both times, or why.
    pub fn describe(&self) -> String {
        let times: Vec<String> = self
            .times_us
            .iter()
            .map(|(r, t)| format!("{r} {t:.1} us"))
            .collect();
        let mut s = format!("{} route", self.route);
        if times.is_empty() {
            s.push_str(" (nothing timed)");
        } else {
            s.push_str(&format!(
                " ({}: forward + BatchNorm backward, GPU time, median)",
                times.join(", ")
            ));
        }
        if let Some(c) = &self.stats {
            s.push_str(&format!("; ConvStats route {}", c.route));
            if let Some(e) = &c.engine {
                s.push_str(&format!(" ({e})"));
            }
        }
        if self.times_us.is_empty() {
            if let Some(n) = self.notes.last() {
                s.push_str(&format!(": {n}"));
            }
        }
        if self.provisional {
            s.push_str(" (provisional)");
        }
        s
    }
}

/// The fused route's parts: the convolution with statistics, a BatchNorm on the own path and
/// the per-channel sums between them.
pub(super) struct Fused<T: Element> {
    pub(super) stats: ConvStats<T>,
    pub(super) bn: BatchNorm<T>,
    pub(super) sums: Mutex<(CudaSlice<f32>, CudaSlice<f32>)>,
}

/// `y = BatchNorm(conv(x, w)) (+ addend) → ReLU` trained as one unit, for one problem and
/// element type `T` (`f32`, `half::f16`, `half::bf16`): planned once, forward and backward.
///
/// Routes ([`TrainRoute`], eligibility in [`ConvBnTrain::plan`]): **fused** — [`ConvStats`]
/// (the convolution writes its output's per-channel sums, in one cuDNN graph where it can)
/// then [`BatchNorm::forward_train_from_sums`] on nnfuse's own kernels, so no pass reads the
/// convolution's output just for statistics; or **unfused** — [`Conv2d`] then
/// [`BatchNorm::forward_train`] as its plan decides (cuDNN's fused BN+ReLU / BN+Add+ReLU where
/// cuDNN allows it). The first [`ConvBnTrain::forward_train`] runs the unfused route into the
/// caller's buffers, runs the fused one into NaN-poisoned buffers of its own and checks its
/// output and running statistics against it (relative L2: f32 1e-5, halves 1e-2), then times
/// both (GPU time, interleaved rounds behind a head start) **forward plus the BatchNorm's
/// backward** — the own backward the fused route needs is not cuDNN's — and keeps the fused
/// route only where it wins by the incumbent rule. That call synchronises, allocates and runs
/// each route several times on its own buffers (the caller's running statistics move once):
/// make it outside CUDA-graph capture. The convolution's gradients are [`Conv2d`]'s, decided
/// by it.
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use half::f16;
/// use nnfuse::batchnorm::Fuse;
/// use nnfuse::block::{ConvBnArgs, ConvBnBackwardArgs, ConvBnTrain};
/// use nnfuse::conv::ConvShape;
/// use nnfuse::TensorFormat;
/// let ctx = nnfuse::Context::new(0)?;
/// let shape = ConvShape::square(32, 64, 56, 64, 3, TensorFormat::Nhwc);
/// let unit = ConvBnTrain::<f16>::new(&ctx, &shape, Fuse::Relu)?;
/// println!("{}", unit.plan());
/// let s = ctx.stream();
/// let (xn, wn, yn) = (shape.x_len()?, shape.w_len()?, shape.y_len()?);
/// let x = s.clone_htod(&vec![f16::from_f32(0.5); xn])?;
/// let w = s.clone_htod(&vec![f16::from_f32(0.01); wn])?;
/// let (mut z, mut y) = (s.alloc_zeros::<f16>(yn)?, s.alloc_zeros::<f16>(yn)?);
/// let (g, b) = (s.clone_htod(&[1.0f32; 64])?, s.alloc_zeros::<f32>(64)?);
/// let (mut rm, mut rv) = (s.alloc_zeros::<f32>(64)?, s.clone_htod(&[1.0f32; 64])?);
/// let saved = unit.forward_train(ConvBnArgs {
///     x: x.as_view(), w: w.as_view(), z: z.as_view_mut(), addend: None,
///     gamma: g.as_view(), beta: b.as_view(),
///     running_mean: rm.as_view_mut(), running_var: rv.as_view_mut(),
///     y: y.as_view_mut(), momentum: 0.1, eps: 1e-5,
/// })?;
/// println!("{}", unit.choice().map(|c| c.describe()).unwrap_or_default());
/// let dy = s.clone_htod(&vec![f16::from_f32(0.1); yn])?;
/// let (mut dz, mut dx, mut dw) =
///     (s.alloc_zeros::<f16>(yn)?, s.alloc_zeros::<f16>(xn)?, s.alloc_zeros::<f16>(wn)?);
/// let (mut dg, mut db) = (s.alloc_zeros::<f32>(64)?, s.alloc_zeros::<f32>(64)?);
/// unit.backward(ConvBnBackwardArgs {
///     x: x.as_view(), w: w.as_view(), z: z.as_view(), y: y.as_view(), dy: dy.as_view(),
///     gamma: g.as_view(), beta: b.as_view(), saved: &saved, dz: dz.as_view_mut(),
///     dx: Some(dx.as_view_mut()), accumulate_dx: false, dw: dw.as_view_mut(),
///     dgamma: dg.as_view_mut(), dbeta: db.as_view_mut(), d_addend: None,
/// })?;
/// # Ok(()) }
/// ```
pub struct ConvBnTrain<T: Element> {
    pub(super) ctx: Context,
    pub(super) plan: TrainPlan,
    pub(super) conv: Conv2d<T>,
    pub(super) bn: BatchNorm<T>,
    pub(super) fused: Option<Fused<T>>,
    pub(super) decision: Mutex<Option<TrainChoice>>,
    /// The folded backward (`fold_backward.rs`), where the plan admits it.
    pub(super) fold: Option<FoldBackward<T>>,
    /// Why the fold cannot run this unit (None: it can).
    pub(super) fold_why: Option<String>,
    /// The backward's decision between composed and folded.
    pub(super) fold_choice: Mutex<Option<FoldChoice>>,
    /// This unit's identity (a [`ConvDone`] belongs to one unit).
    id: usize,
}

impl<T: Element> std::fmt::Debug for ConvBnTrain<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConvBnTrain")
            .field("shape", &self.plan.shape)
            .field("dtype", &self.plan.dtype)
            .field("fuse", &self.plan.fuse)
            .field("decision", &*lock(&self.decision))
            .finish()
    }
}

impl<T: Element> ConvBnTrain<T> {
    /// Plans the unit for `shape` with the BatchNorm's activation `fuse` (no GPU work beyond
    /// the parts' background kernel compiles and allocations: the fused route's sums, and for a
    /// unit the backward can fold its buffers — 0.5 MB, plus where the sums pass makes G and H
    /// on tensor cores its blocks' partials, 12 MB for the demo's last unit and about 20 MB at
    /// most). The fused route is refused, with the reason in the plan, where its parts cannot
    /// be planned.
    pub fn new(ctx: &Context, shape: &ConvShape, fuse: Fuse) -> Result<Self> {
        let cudnn = if cudnn_present() {
            Some(cudnn_version()?)
        } else {
            None
        };
        let mut plan = plan_train(&TrainPlanRequest {
            shape,
            dtype: T::DTYPE,
            fuse,
            config: ctx.config(),
            cudnn,
        })?;
        let (bn_dims, axis) = bn_shape(shape)?;
        let conv = Conv2d::<T>::new(ctx, shape)?;
        let bn = BatchNorm::<T>::new(ctx, &bn_dims, axis, fuse)?;
        let fused = if plan.eligible(TrainRoute::Fused) {
            match Self::fused_parts(ctx, shape, &bn_dims, axis, fuse) {
                Ok(f) => Some(f),
                Err(why) => {
                    plan.refuse(TrainRoute::Fused, why);
                    None
                }
            }
        } else {
            None
        };
        let mut fold_why = fold_refusal(&plan);
        let fold = match fold_why {
            None => match FoldBackward::new(ctx, shape) {
                Ok(f) => Some(f),
                Err(e) => {
                    fold_why = Some(format!("its buffers: {e}"));
                    None
                }
            },
            Some(_) => None,
        };
        tracing::info!(plan = %plan, fold = ?fold_why, "conv+BN training unit planned");
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);
        Ok(ConvBnTrain {
            ctx: ctx.clone(),
            plan,
            conv,
            bn,
            fused,
            decision: Mutex::new(None),
            fold,
            fold_why,
            fold_choice: Mutex::new(None),
            id: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        })
    }

    /// The fused route's parts, or why they cannot be planned.
    fn fused_parts(
        ctx: &Context,
        shape: &ConvShape,
        bn_dims: &[usize],
        axis: usize,
        fuse: Fuse,
    ) -> std::result::Result<Fused<T>, String> {
        let stats = ConvStats::<T>::build(ctx, shape, unit_low_words(T::DTYPE))
            .map_err(|e| format!("ConvStats: {e}"))?;
        let own = ctx.with_config_override(ctx.config().clone().with_bn_impl(BnImpl::Own));
        let bn = BatchNorm::<T>::new(&own, bn_dims, axis, fuse)
            .map_err(|e| format!("BatchNorm on the own path: {e}"))?;
        if bn.training_path() != BnPath::Own {
            return Err(format!(
                "a BatchNorm planned with BnImpl::Own takes the {} path here: {}",
                bn.training_path(),
                bn.plan().reasons.join("; ")
            ));
        }
        let s = ctx.stream();
        let c = unit_sums_len(T::DTYPE, shape.c_out.max(1));
        let sums = (
            s.alloc_zeros::<f32>(c)
                .call("cuMemAllocAsync")
                .map_err(|e| e.to_string())?,
            s.alloc_zeros::<f32>(c)
                .call("cuMemAllocAsync")
                .map_err(|e| e.to_string())?,
        );
        Ok(Fused {
            stats,
            bn,
            sums: Mutex::new(sums),
        })
    }

    /// Every route's eligibility and why.
    pub fn plan(&self) -> &TrainPlan {
        &self.plan
    }

    /// The first call's decision (None before it).
    pub fn choice(&self) -> Option<TrainChoice> {
        lock(&self.decision).clone()
    }

    /// The convolution (its plans, decisions and gradients).
    pub fn conv(&self) -> &Conv2d<T> {
        &self.conv
    }

    /// The BatchNorm `route` runs (its plan): the own-path one of the fused route (None where
    /// the plan refuses that route), or the unfused route's.
    pub fn batchnorm(&self, route: TrainRoute) -> Option<&BatchNorm<T>> {
        match route {
            TrainRoute::Fused => self.fused.as_ref().map(|f| &f.bn),
            TrainRoute::Unfused => Some(&self.bn),
        }
    }

    /// The fused route's ConvStats decision as it stands now (a decided graph route that
    /// failed at run time has fallen back since [`TrainChoice::stats`] was taken).
    pub fn stats_choice(&self) -> Option<StatsChoice> {
        self.fused.as_ref().and_then(|f| f.stats.choice())
    }

    /// The training forward: z = conv(x, w), y = BatchNorm(z) (+ addend, ReLU) on the decided
    /// route (deciding on the first call, and again on the first call after a provisional
    /// decision's kernels are ready; see the type's documentation). Returns the state
    /// [`ConvBnTrain::backward`] needs.
    pub fn forward_train(&self, mut a: ConvBnArgs<'_, T>) -> Result<TrainSaved> {
        let decided = lock(&self.decision)
            .as_ref()
            .map(|c| (c.route, c.provisional));
        match decided {
            None => crate::cudnn_graph::replay::suspended(|| self.decide(&mut a)),
            Some((_, true)) if self.fused_kernels_ready() && !self.ctx.is_capturing()? => {
                crate::cudnn_graph::replay::suspended(|| self.decide(&mut a))
            }
            Some((r, _)) => self.run(r, &mut a),
        }
    }

    /// Whether the next [`ConvBnTrain::forward_train`] measures the routes: no decision yet,
    /// or a provisional one whose fused kernels have compiled since.
    pub fn pending(&self) -> bool {
        match lock(&self.decision).as_ref() {
            None => true,
            Some(c) => c.provisional && self.fused_kernels_ready(),
        }
    }

    /// Waits for (or compiles) the fused route's kernels, so that the next first call, or the
    /// next call after a provisional decision, measures the fused route: for a caller that
    /// wants every decision made before it times or captures its steps. Nothing to do where
    /// the plan refuses the fused route.
    pub fn load_fused_kernels(&self) -> Result<()> {
        match &self.fused {
            Some(f) => self.ctx.load_kernels(&fused_kernel_files(f)),
            None => Ok(()),
        }
    }

    /// Whether the fused route can run without waiting for a compile (true where the plan
    /// refuses it: nothing to wait for).
    pub(super) fn fused_kernels_ready(&self) -> bool {
        self.fused.as_ref().is_none_or(|f| {
            fused_kernel_files(f)
                .iter()
                .all(|k| self.ctx.kernel_ready(k))
        })
    }

    /// [`ConvBnTrain::forward_train`] on a given route (tests, benchmarks, a caller that
    /// decided): no measurement. The fused route where the plan refuses it is an
    /// [`Error::NotSupported`] carrying the plan's reason.
    pub fn forward_train_with(
        &self,
        route: TrainRoute,
        mut a: ConvBnArgs<'_, T>,
    ) -> Result<TrainSaved> {
        self.refuse_ineligible(route)?;
        self.run(route, &mut a)
    }

    /// [`ConvBnTrain::forward_train`]'s first stage: z = conv(x, w) on the decided route (the
    /// fused route also writes the unit's per-channel sums of z). Before the first
    /// `forward_train` has decided, the unfused route runs: the stages never measure, so a
    /// caller that runs only them decides with one `forward_train` first (and again while
    /// [`ConvBnTrain::pending`] says so). Pass the receipt to [`ConvBnTrain::forward_bn`], with
    /// z, before the next `forward_conv` of this unit.
    pub fn forward_conv(
        &self,
        x: &CudaView<'_, T>,
        w: &CudaView<'_, T>,
        z: &mut CudaViewMut<'_, T>,
    ) -> Result<ConvDone> {
        let route = lock(&self.decision)
            .as_ref()
            .map_or(TrainRoute::Unfused, |c| c.route);
        self.conv_stage(route, None, x, w, z)?;
        Ok(ConvDone {
            route,
            unit: self.id,
        })
    }

    /// [`ConvBnTrain::forward_conv`] on a given route and, fused, a given ConvStats route
    /// (None: ConvStats decides).
    pub fn forward_conv_with(
        &self,
        route: TrainRoute,
        stats_route: Option<StatsRoute>,
        x: &CudaView<'_, T>,
        w: &CudaView<'_, T>,
        z: &mut CudaViewMut<'_, T>,
    ) -> Result<ConvDone> {
        self.refuse_ineligible(route)?;
        self.conv_stage(route, stats_route, x, w, z)?;
        Ok(ConvDone {
            route,
            unit: self.id,
        })
    }

    /// [`ConvBnTrain::forward_train`]'s second stage: the BatchNorm of z (`a.x`, the z that
    /// [`ConvBnTrain::forward_conv`] wrote) on the route `done` says.
    pub fn forward_bn(&self, done: ConvDone, a: TrainArgs<'_, T>) -> Result<TrainSaved> {
        if done.unit != self.id {
            return Err(Error::invalid(
                "done",
                "the receipt comes from another ConvBnTrain's forward_conv",
            ));
        }
        self.bn_stage(done.route, a)
    }

    /// The backward. Composed: the BatchNorm's (into `dz`, and the addend's gradient), then the
    /// convolution's data gradient (into or onto `dx`) and filter gradient. Folded, where the
    /// unit's plan admits it (a 1x1 NHWC BN + add + ReLU unit whose forward ran the fused route):
    /// the same outputs without writing dz (`dz` then holds nothing useful;
    /// docs/BLOCK-TRAINING.md, "Built: the folded backward of a pointwise unit"). The first
    /// backward the fold could run decides between the two by a check and a race, as the first
    /// forward decides its route ([`ConvBnTrain::backward_decision`]); it synchronises and
    /// allocates.
    pub fn backward(&self, a: ConvBnBackwardArgs<'_, T>) -> Result<()> {
        let decided = lock(&self.fold_choice).as_ref().map(|c| c.folded);
        // A unit decided composed skips the fold's checks (operand addresses: events).
        if decided == Some(false) || self.fold_blocked(&a).is_some() {
            return self.backward_composed(a);
        }
        match decided {
            None => self.decide_backward(a),
            _ => self.backward_folded(a),
        }
    }

    /// The composed backward (see [`ConvBnTrain::backward`]).
    pub(super) fn backward_composed(&self, a: ConvBnBackwardArgs<'_, T>) -> Result<()> {
        let ConvBnBackwardArgs {
            x,
            w,
            z,
            y,
            dy,
            gamma,
            beta,
            saved,
            mut dz,
            dx,
            accumulate_dx,
            mut dw,
            dgamma,
            dbeta,
            d_addend,
        } = a;
        self.backward_bn(BackwardArgs {
            x: z,
            y,
            dy,
            gamma,
            beta,
            saved: &saved.bn,
            dx: dz.slice_mut(..),
            d_addend,
            dgamma,
            dbeta,
        })?;
        if let Some(mut dx) = dx {
            self.conv
                .backward_data_into(&dz.slice(..), &w, &mut dx, accumulate_dx)?;
        }
        self.conv.backward_filter(&x, &dz.slice(..), &mut dw, false)
    }

    /// The backward's first stage: the BatchNorm's, by the BatchNorm that made `a.saved`
    /// ([`TrainSaved::bn`]); `a.x` is z and `a.dx` receives dz. Then the convolution's
    /// gradients through [`ConvBnTrain::conv`].
    pub fn backward_bn(&self, a: BackwardArgs<'_, T>) -> Result<()> {
        match &self.fused {
            Some(f) if f.bn.owns(a.saved) => f.bn.backward(a),
            _ => self.bn.backward(a),
        }
    }

    fn refuse_ineligible(&self, route: TrainRoute) -> Result<()> {
        if self.plan.eligible(route) {
            Ok(())
        } else {
            Err(self.refusal(route))
        }
    }

    /// The error for running `route` where the plan refuses it, with the plan's reason.
    fn refusal(&self, route: TrainRoute) -> Error {
        Error::NotSupported(format!(
            "route {route} cannot run this unit: {}",
            self.plan.reason(route)
        ))
    }

    /// Both stages of `route` on `a`, the addend checked against the fusion before anything
    /// runs (the BatchNorm checks the rest of its operands before its own launches).
    pub(super) fn run(&self, route: TrainRoute, a: &mut ConvBnArgs<'_, T>) -> Result<TrainSaved> {
        let wants = self.plan.fuse == Fuse::AddRelu;
        if wants != a.addend.is_some() {
            return Err(Error::invalid(
                "addend",
                if wants {
                    "required by Fuse::AddRelu"
                } else {
                    "given, but the unit's BatchNorm does not add (Fuse::AddRelu adds)"
                },
            ));
        }
        self.conv_stage(route, None, &a.x, &a.w, &mut a.z)?;
        self.bn_stage(route, bn_args(a))
    }

    fn conv_stage(
        &self,
        route: TrainRoute,
        stats_route: Option<StatsRoute>,
        x: &CudaView<'_, T>,
        w: &CudaView<'_, T>,
        z: &mut CudaViewMut<'_, T>,
    ) -> Result<()> {
        match (route, &self.fused) {
            (TrainRoute::Unfused, _) => self.conv.forward(x, w, z),
            (TrainRoute::Fused, Some(f)) => {
                let mut g = lock(&f.sums);
                let (sum, sqsum) = &mut *g;
                let (mut sv, mut qv) = (sum.as_view_mut(), sqsum.as_view_mut());
                match stats_route {
                    Some(r) => f.stats.forward_with(r, x, w, z, &mut sv, &mut qv),
                    None => f.stats.forward(x, w, z, &mut sv, &mut qv),
                }
            }
            (TrainRoute::Fused, None) => Err(self.refusal(route)),
        }
    }

    fn bn_stage(&self, route: TrainRoute, a: TrainArgs<'_, T>) -> Result<TrainSaved> {
        let bn = match (route, &self.fused) {
            (TrainRoute::Unfused, _) => self.bn.forward_train(a)?,
            (TrainRoute::Fused, Some(f)) => {
                let g = lock(&f.sums);
                f.bn.forward_train_from_sums(a, &g.0.as_view(), &g.1.as_view())?
            }
            (TrainRoute::Fused, None) => return Err(self.refusal(route)),
        };
        Ok(TrainSaved { route, bn })
    }
}

/// The kernel files the fused route launches: ConvStats' reduction and the own BatchNorm's
/// training units.
fn fused_kernel_files<T: Element>(f: &Fused<T>) -> Vec<&'static crate::kernels::KernelFile> {
    let mut v = vec![&crate::kernels::BLOCK_STATS];
    v.extend(f.bn.own_training_units());
    v
}

/// The BatchNorm's arguments of a unit's forward: its input is z.
pub(super) fn bn_args<'s, T>(a: &'s mut ConvBnArgs<'_, T>) -> TrainArgs<'s, T> {
    TrainArgs {
        x: a.z.slice(..),
        addend: a.addend.as_ref().map(|v| v.slice(..)),
        gamma: a.gamma.slice(..),
        beta: a.beta.slice(..),
        running_mean: a.running_mean.slice_mut(..),
        running_var: a.running_var.slice_mut(..),
        y: a.y.slice_mut(..),
        momentum: a.momentum,
        eps: a.eps,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn choice(route: TrainRoute, times: &[(TrainRoute, f64)], provisional: bool) -> TrainChoice {
        TrainChoice {
            route,
            times_us: times.to_vec(),
            stats: None,
            notes: vec!["fused: refused by the plan: NCHW".into()],
            provisional,
        }
    }

    #[test]
    fn a_choice_reads_as_its_route_and_times_or_its_reason() {
        let t = choice(
            TrainRoute::Fused,
            &[(TrainRoute::Unfused, 249.5), (TrainRoute::Fused, 229.0)],
            false,
        )
        .describe();
        assert_eq!(
            t,
            "fused route (unfused 249.5 us, fused 229.0 us: forward + BatchNorm backward, GPU \
             time, median)"
        );
        let t = choice(TrainRoute::Unfused, &[], true).describe();
        assert_eq!(
            t,
            "unfused route (nothing timed): fused: refused by the plan: NCHW (provisional)"
        );
    }
}
