//! The BatchNorm dispatcher: one object per (shape, axis, type, fusion, options), holding its
//! plans and cuDNN descriptors (cached by the Context), and the three operations — training
//! forward, backward, inference forward — that follow the plan's path: nnfuse's own kernels
//! ([`super::own`]) or cuDNN. Without cuDNN no descriptor is made and every plan is own.

use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaSlice;

use crate::activation;
use crate::batchnorm::args::{BackwardArgs, InferenceArgs, TrainArgs};
use crate::batchnorm::cudnn_calls::{self as calls, BwdPtrs, Call, ExSizes, FwdPtrs, Ops};
use crate::batchnorm::descriptor::{ParamDesc, ReluDesc, TensorDesc};
use crate::batchnorm::graph_route::{GraphRoute, InferPtrs, InferRan};
use crate::batchnorm::own::{self, BwdBufs, Counters, FwdBufs, InferBufs};
use crate::batchnorm::own_launch::OwnShape;
use crate::batchnorm::plan::{plan, BnPlan, PlanRequest, ASSUMED_CUDNN_VERSION};
use crate::batchnorm::state::{BnSaved, Owned, Spares};
use crate::batchnorm::types::{BnApi, BnOptions, BnPath, Fuse, OwnVariant, Phase};
use crate::context::{cudnn_present, cudnn_version, Context};
use crate::cudnn_graph::replay::{self, Replays};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::validate::{Aliasing, Binder, Need};

/// Everything derived once per (shape, axis, dtype, fusion, options) on one Context.
#[derive(Debug)]
pub(super) struct Core {
    pub(super) id: u64,
    pub(super) fuse: Fuse,
    pub(super) train: BnPlan,
    infer: BnPlan,
    /// cuDNN's descriptors and sizes, when cuDNN runs one of the phases.
    cudnn: Option<CudnnParts>,
    /// The tensor as the own kernels see it.
    pub(super) own_shape: OwnShape,
    /// The own kernels' arrival counters.
    counters: Counters,
    /// The own variant the last backward ran (0 none, 1 two-pass, 2 persistent): diagnostics.
    last_backward: AtomicU8,
    /// Set once cuDNN refused the fused path at run time: later calls go straight to fallback.
    fused_refused: AtomicBool,
    /// The BatchNorm through cuDNN's graph API, where the training plan says so.
    graph: GraphRoute,
    /// Buffers of dropped training states, for the next forward (a cached step allocates
    /// nothing).
    spares: Arc<Spares>,
}

/// How replay events name the legacy calls.
const FWD: &str = "legacy BatchNorm forward";
const BWD: &str = "legacy BatchNorm backward";

/// The cuDNN half of a Core.
#[derive(Debug)]
struct CudnnParts {
    x_desc: TensorDesc,
    train_param: ParamDesc,
    infer_param: ParamDesc,
    relu: Option<ReluDesc>,
    /// Ex-API sizes for the fused ops (fused plans only).
    fused_sizes: Option<ExSizes>,
    /// Ex-API sizes for plain BN (plans whose BN runs through the Ex API, and fused plans, which
    /// fall back to it).
    bn_sizes: Option<ExSizes>,
    /// The legacy calls captured for replay (`cudnn_graph/replay.rs`).
    replays: Mutex<Replays>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct CoreKey {
    shape: Vec<usize>,
    axis: usize,
    dtype: DType,
    fuse: Fuse,
    options: BnOptions,
}

/// The caller's buffers of one backward, bound once (by `check_backward`, whose binder holds
/// their stream events until the work is queued): device addresses.
#[derive(Debug, Clone, Copy)]
struct Bound {
    x: u64,
    y: u64,
    dy: u64,
    gamma: u64,
    beta: u64,
    dx: u64,
    dgamma: u64,
    dbeta: u64,
    /// The addend's gradient (Add+ReLU only).
    dz: Option<u64>,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn variant_code(v: Option<OwnVariant>) -> u8 {
    match v {
        None => 0,
        Some(OwnVariant::TwoPass) => 1,
        Some(OwnVariant::Persistent) => 2,
        Some(OwnVariant::Elementwise) => 3,
        Some(OwnVariant::PerChannel) => 4,
    }
}

impl Core {
    fn new(ctx: &Context, key: &CoreKey) -> Result<Core> {
        let cudnn_available = cudnn_present();
        let cudnn_version = if cudnn_available {
            cudnn_version()?
        } else {
            ASSUMED_CUDNN_VERSION
        };
        let req = |phase| PlanRequest {
            shape: &key.shape,
            axis: key.axis,
            dtype: key.dtype,
            fuse: key.fuse,
            phase,
            config: ctx.config(),
            cudnn_version,
            cudnn_available,
            own_variant: key.options.own_variant,
        };
        let train = plan(&req(Phase::Training))?;
        let infer = plan(&req(Phase::Inference))?;
        let cudnn = if cudnn_available && !(train.path.is_own() && infer.path.is_own()) {
            Some(CudnnParts::new(ctx, key, &train, &infer)?)
        } else {
            None
        };
        let graph = GraphRoute::new(&train, &infer, ctx.config());
        let core = Core {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            fuse: key.fuse,
            own_shape: OwnShape::from_layout(&train.layout),
            train,
            infer,
            cudnn,
            counters: Counters::default(),
            last_backward: AtomicU8::new(0),
            fused_refused: AtomicBool::new(false),
            graph,
            spares: Arc::default(),
        };
        // The own kernels the plans launch start compiling now, in the background.
        let own_train = core.train.path.is_own().then(|| {
            (
                core.train.own_forward.unwrap_or(OwnVariant::TwoPass),
                core.train.own_backward.unwrap_or(OwnVariant::TwoPass),
            )
        });
        let own_infer = core.infer.path.is_own();
        own::prepare(
            ctx,
            &core.own_shape,
            key.dtype,
            key.fuse,
            own_train,
            own_infer,
        );
        if let Some(c) = &core.cudnn {
            // The graph route's fused path has no legacy sizes (it falls back at run time).
            if core.train.path == BnPath::CudnnFused
                && !core.train.cudnn_graph
                && c.fused_sizes.is_none()
            {
                core.fused_refused.store(true, Ordering::Relaxed);
            }
        }
        tracing::info!(
            shape = ?key.shape, axis = key.axis, dtype = %key.dtype, fuse = ?key.fuse,
            mode = ?core.train.mode, path = ?core.train.path, api = ?core.train.api,
            cudnn_api = ?core.train.cudnn_api_used(),
            inference_path = ?core.infer.path, own_forward = ?core.train.own_forward,
            own_backward = ?core.train.own_backward, layout = %core.train.layout,
            reasons = ?core.train.reasons,
            "BatchNorm planned"
        );
        Ok(core)
    }

    /// The path a training forward takes now.
    fn train_path(&self) -> BnPath {
        if self.train.path == BnPath::CudnnFused && self.fused_refused.load(Ordering::Relaxed) {
            BnPath::Fallback
        } else {
            self.train.path
        }
    }

    /// cuDNN's half; an internal error if a cuDNN path runs without it (cannot happen: the
    /// descriptors are made whenever a plan takes cuDNN).
    fn cudnn(&self) -> Result<&CudnnParts> {
        self.cudnn.as_ref().ok_or_else(|| {
            Error::NotSupported("internal: a cuDNN path without cuDNN descriptors".into())
        })
    }

    /// Elements every parameter tensor holds for `phase`: C, or what cuDNN derived (C·H·W under
    /// PER_ACTIVATION, which only keeps per-channel statistics when H·W = 1).
    pub(super) fn param_len(&self, phase: Phase) -> usize {
        let (p, own) = match phase {
            Phase::Training => (&self.train, self.train.path.is_own()),
            Phase::Inference => (&self.infer, self.infer.path.is_own()),
        };
        match (&self.cudnn, own) {
            (Some(c), false) => match phase {
                Phase::Training => c.train_param.len,
                Phase::Inference => c.infer_param.len,
            },
            _ => p.layout.c as usize,
        }
    }

    pub(super) fn own_op<'a>(&'a self, ctx: &'a Context, dtype: DType) -> own::Op<'a> {
        own::Op {
            ctx,
            shape: self.own_shape,
            dtype,
            fuse: self.fuse,
            counters: &self.counters,
        }
    }
}

impl CudnnParts {
    fn new(ctx: &Context, key: &CoreKey, train: &BnPlan, infer: &BnPlan) -> Result<CudnnParts> {
        let x_desc = TensorDesc::activation(&train.layout, key.dtype)?;
        let train_param = ParamDesc::derive(&x_desc, train.mode)?;
        let infer_param = ParamDesc::derive(&x_desc, infer.mode)?;
        // The legacy fused Ex path's descriptors; the graph route fuses in its own graph.
        let legacy_fused = train.path == BnPath::CudnnFused && !train.cudnn_graph;
        let relu = if legacy_fused {
            Some(ReluDesc::new()?)
        } else {
            None
        };
        let mut parts = CudnnParts {
            x_desc,
            train_param,
            infer_param,
            relu,
            fused_sizes: None,
            bn_sizes: None,
            replays: Mutex::new(Replays::default()),
        };
        if train.api == BnApi::Ex || train.path == BnPath::CudnnFused {
            let mut guard = ctx.lock()?;
            let h = guard.cudnn()?;
            let mode = train.mode;
            // SAFETY: valid handle and descriptors.
            parts.bn_sizes = Some(unsafe {
                calls::ex_sizes(
                    h,
                    mode,
                    Ops::Bn,
                    &parts.x_desc,
                    &parts.train_param.desc,
                    None,
                )
            }?);
            if legacy_fused {
                let ops = fused_ops(key.fuse);
                // SAFETY: as above.
                let sizes = unsafe {
                    calls::ex_sizes(
                        h,
                        mode,
                        ops,
                        &parts.x_desc,
                        &parts.train_param.desc,
                        parts.relu.as_ref(),
                    )
                };
                match sizes {
                    Ok(s) => parts.fused_sizes = Some(s),
                    Err(e) if e.is_cudnn_not_supported() => {
                        // Core::new marks the fused path refused (fused_sizes stays None).
                        tracing::warn!(
                            shape = ?key.shape, axis = key.axis, dtype = %key.dtype,
                            fuse = ?key.fuse, error = %e,
                            "cuDNN refused the fused path's size query; using the fallback path"
                        );
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(parts)
    }
}

fn fused_ops(fuse: Fuse) -> Ops {
    match fuse {
        Fuse::None => Ops::Bn,
        Fuse::Relu => Ops::BnRelu,
        Fuse::AddRelu => Ops::BnAddRelu,
    }
}

/// `eps` finite and > 0 (cuDNN's `CUDNN_BN_MIN_EPSILON` is 0 since cuDNN 8; 0 itself divides
/// by zero on a constant channel); `momentum` finite in `[0, 1]`.
pub(crate) fn check_scalars(eps: f64, momentum: Option<f64>) -> Result<()> {
    if !(eps.is_finite() && eps > 0.0) {
        return Err(Error::invalid(
            "eps",
            format!("{eps} must be finite and > 0 (cuDNN's minimum epsilon is 0, exclusive here)"),
        ));
    }
    if let Some(m) = momentum {
        if !(m.is_finite() && (0.0..=1.0).contains(&m)) {
            return Err(Error::invalid(
                "momentum",
                format!("{m} must lie in [0, 1] (weight of the new batch statistics)"),
            ));
        }
    }
    Ok(())
}

/// The addend is given exactly when the fusion is Add+ReLU.
pub(crate) fn check_addend(fuse: Fuse, given: bool, name: &'static str) -> Result<()> {
    match (fuse == Fuse::AddRelu, given) {
        (true, false) => Err(Error::invalid(name, "is required by Fuse::AddRelu")),
        (false, true) => Err(Error::invalid(
            name,
            format!("is given, but the fusion is {fuse:?}, not AddRelu"),
        )),
        _ => Ok(()),
    }
}

/// BatchNorm (+ReLU, +Add+ReLU) over one shape and channel axis, for activations of type `T`.
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use nnfuse::batchnorm::{BatchNorm, Fuse, TrainArgs};
/// let ctx = nnfuse::Context::new(0)?;
/// let shape = [8, 14, 14, 64]; // channels-last, channel axis 3
/// let bn = BatchNorm::<half::f16>::new(&ctx, &shape, 3, Fuse::Relu)?;
/// println!("{}", bn.plan());
/// let s = ctx.stream();
/// let n: usize = shape.iter().product();
/// let x = s.clone_htod(&vec![half::f16::from_f32(0.5); n])?;
/// let mut y = s.alloc_zeros::<half::f16>(n)?;
/// let (g, b) = (s.clone_htod(&[1.0f32; 64])?, s.alloc_zeros::<f32>(64)?);
/// let (mut rm, mut rv) = (s.alloc_zeros::<f32>(64)?, s.clone_htod(&[1.0f32; 64])?);
/// let saved = bn.forward_train(TrainArgs {
///     x: x.as_view(), addend: None, gamma: g.as_view(), beta: b.as_view(),
///     running_mean: rm.as_view_mut(), running_var: rv.as_view_mut(),
///     y: y.as_view_mut(), momentum: 0.1, eps: 1e-5,
/// })?;
/// println!("took the {:?} path", saved.path());
/// # Ok(()) }
/// ```
pub struct BatchNorm<T: Element> {
    pub(super) ctx: Context,
    pub(super) core: Arc<Core>,
    _t: PhantomData<fn() -> T>,
}

impl<T: Element> std::fmt::Debug for BatchNorm<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchNorm")
            .field("plan", &self.core.train)
            .finish()
    }
}

impl<T: Element> BatchNorm<T> {
    /// Plans BatchNorm for `shape` with channels on `axis` (any rank, any axis). Plans and
    /// descriptors are cached by the Context: a repeated shape costs a hash lookup.
    pub fn new(ctx: &Context, shape: &[usize], axis: usize, fuse: Fuse) -> Result<Self> {
        Self::with_options(ctx, shape, axis, fuse, BnOptions::default())
    }

    /// [`BatchNorm::new`] with options (the own kernels' variant, for comparisons).
    pub fn with_options(
        ctx: &Context,
        shape: &[usize],
        axis: usize,
        fuse: Fuse,
        options: BnOptions,
    ) -> Result<Self> {
        let key = CoreKey {
            shape: shape.to_vec(),
            axis,
            dtype: T::DTYPE,
            fuse,
            options,
        };
        let core = ctx.memo(key.clone(), || Core::new(ctx, &key).map(Arc::new))?;
        Ok(BatchNorm {
            ctx: ctx.clone(),
            core,
            _t: PhantomData,
        })
    }

    /// The own kernel units this plan's training launches (none off the own path).
    pub(crate) fn own_training_units(&self) -> Vec<&'static crate::kernels::KernelFile> {
        let core = &*self.core;
        if !core.train.path.is_own() {
            return Vec::new();
        }
        let train = Some((
            core.train.own_forward.unwrap_or(OwnVariant::TwoPass),
            core.train.own_backward.unwrap_or(OwnVariant::TwoPass),
        ));
        let ks = super::own_units::planned_kernels(core.own_shape.arr, core.fuse, train, false);
        super::own_units::units_of(&ks, T::DTYPE)
    }

    /// Whether `saved` came from a forward of this BatchNorm's plan (its backward takes it).
    pub(crate) fn owns(&self, saved: &BnSaved) -> bool {
        saved.owner == self.core.id
    }

    /// The training plan (mode, layout, path and why).
    pub fn plan(&self) -> &BnPlan {
        &self.core.train
    }

    /// The inference plan.
    pub fn inference_plan(&self) -> &BnPlan {
        &self.core.infer
    }

    /// The path the next training forward will take (the plan's, unless cuDNN refused the fused
    /// path at run time).
    pub fn training_path(&self) -> BnPath {
        self.core.train_path()
    }

    /// On the own path, the variant the last backward of this BatchNorm's plan ran (on this
    /// Context, from any thread); `None` before the first own backward. Diagnostics for tests
    /// and benchmarks; [`BnSaved::own_variant`] says the same of a forward.
    pub fn last_own_backward(&self) -> Option<OwnVariant> {
        match self.core.last_backward.load(Ordering::Relaxed) {
            1 => Some(OwnVariant::TwoPass),
            2 => Some(OwnVariant::Persistent),
            4 => Some(OwnVariant::PerChannel),
            _ => None,
        }
    }

    pub(super) fn numel(&self) -> usize {
        self.core.train.layout.numel()
    }

    /// Training forward. Returns the state that [`BatchNorm::backward`] needs.
    pub fn forward_train(&self, mut a: TrainArgs<'_, T>) -> Result<BnSaved> {
        crate::profile::stage!(Call);
        let core = &*self.core;
        // 1. Scalars, the addend, the shape.
        check_scalars(a.eps, Some(a.momentum))?;
        check_addend(core.fuse, a.addend.is_some(), "addend")?;
        if core.train.layout.per_channel() < 2 {
            // The unbiased running variance divides by M - 1; PyTorch refuses this too.
            return Err(Error::invalid(
                "shape",
                "training needs more than one value per channel (n*h*w = 1)",
            ));
        }
        // 2. The statistics (and, on the own path, the mask) the backward will read.
        let path = core.train_path();
        let mut st = self.alloc_train_state(path)?;
        // 3. Every buffer validated, then BatchNorm itself (own kernels or cuDNN).
        let (ran, x_ptr) = self.run_train(&mut a, path, &mut st)?;
        // 4. The fallback's activation and mask; the saved state.
        self.finish_train(&mut a, ran, st, x_ptr)
    }

    /// The buffers a training forward saves for its backward, for `path`: recycled from dropped
    /// states, allocated only when none is spare.
    pub(super) fn alloc_train_state(&self, path: BnPath) -> Result<TrainState> {
        crate::profile::stage!(Alloc);
        let stream = self.ctx.stream();
        let spares = &self.core.spares;
        let c = self.core.param_len(Phase::Training);
        let mean = spares.f32s(stream, c)?;
        let inv_var = spares.f32s(stream, c)?;
        let mean_lo = if path.is_own() {
            Some(spares.f32s(stream, c)?)
        } else {
            None
        };
        let own_mask = if path.is_own() && self.core.fuse != Fuse::None {
            Some(spares.u32s(stream, activation::mask_words(self.numel()))?)
        } else {
            None
        };
        Ok(TrainState {
            mean,
            inv_var,
            mean_lo,
            own_mask,
        })
    }

    /// Validates every buffer of a training forward, then runs BatchNorm on `path`; returns what
    /// ran and x's address (the backward checks it gets the same x).
    fn run_train(
        &self,
        a: &mut TrainArgs<'_, T>,
        path: BnPath,
        st: &mut TrainState,
    ) -> Result<(Ran, u64)> {
        let core = &*self.core;
        let ctx = &self.ctx;
        let numel = Need::Exactly(self.numel(), "the shape's element count");
        let c = core.param_len(Phase::Training);
        let param = Need::Exactly(
            c,
            if path.is_own() {
                "the channel count"
            } else {
                "cuDNN's derived parameter descriptor"
            },
        );
        let mut ops = Binder::new(ctx);
        let x = ops.input("x", &a.x, numel)?;
        let gamma = ops.input("gamma", &a.gamma, param)?;
        let beta = ops.input("beta", &a.beta, param)?;
        let z = match &a.addend {
            Some(v) => ops.input("addend", v, numel)?,
            None => 0,
        };
        let y = ops.output("y", &mut a.y, numel)?;
        let running_mean = ops.output("running_mean", &mut a.running_mean, param)?;
        let running_var = ops.output("running_var", &mut a.running_var, param)?;
        ops.check(Aliasing::Distinct)?;

        // nnfuse's own buffers: their addresses, no stream events (see `state.rs`).
        let (saved_mean, saved_invstd) = (st.mean.ptr, st.inv_var.ptr);
        let bufs = FwdBufs {
            x,
            z,
            y,
            mask: st.own_mask.as_ref().map_or(0, |m| m.ptr),
            gamma,
            beta,
            running_mean,
            running_var,
            saved_mean,
            saved_mean_lo: st.mean_lo.as_ref().map_or(0, |m| m.ptr),
            saved_invstd,
        };
        if path.is_own() {
            let want = core.train.own_forward.unwrap_or(OwnVariant::TwoPass);
            let op = core.own_op(ctx, T::DTYPE);
            let v = {
                crate::profile::stage!(Launch);
                own::forward_train(&op, &bufs, want, a.momentum, a.eps)?
            };
            tracing::debug!(path = "own", variant = %v, "BatchNorm forward");
            return Ok((Ran::Own(v), x));
        }
        let ptrs = FwdPtrs {
            x,
            z,
            y,
            gamma,
            beta,
            running_mean,
            running_var,
            saved_mean,
            saved_inv_var: saved_invstd,
        };
        Ok((self.run_forward(path, &ptrs, a.momentum, a.eps)?, x))
    }

    /// After BatchNorm ran: the fallback's activation (writing the mask), and the saved state.
    pub(super) fn finish_train(
        &self,
        a: &mut TrainArgs<'_, T>,
        ran: Ran,
        st: TrainState,
        x_ptr: u64,
    ) -> Result<BnSaved> {
        let ctx = &self.ctx;
        let mut own_variant = None;
        // Graph BatchNorm leaves no reserve; its activation (if any) follows as the fallback's.
        let graph = matches!(ran, Ran::Graph(_) | Ran::GraphFused(_));
        let mut graph_mask = None;
        let ran = match ran {
            Ran::Graph(None) => Ran::Plain(None),
            Ran::Graph(Some(mask)) => Ran::BnOnlyForFallback(None, mask),
            r => r,
        };
        let (path, reserve, mask) = match ran {
            Ran::Own(v) => {
                own_variant = Some(v);
                (BnPath::Own, None, st.own_mask)
            }
            Ran::Fused(reserve) => (BnPath::CudnnFused, reserve, None),
            // The epilogue graph wrote cuDNN's mask: its backward graph reads it.
            Ran::GraphFused(m) => {
                graph_mask = Some(m);
                (BnPath::CudnnFused, None, None)
            }
            Ran::Plain(reserve) => (BnPath::Plain, reserve, None),
            Ran::Graph(_) => {
                return Err(Error::NotSupported(
                    "internal: graph forward not mapped".into(),
                ))
            }
            Ran::BnOnlyForFallback(reserve, mut mask) => {
                let m = &mut mask.buf;
                match &a.addend {
                    Some(z) => activation::add_relu_mask_fwd_inplace(ctx, &mut a.y, z, Some(m))?,
                    None => activation::relu_mask_fwd_inplace(ctx, &mut a.y, Some(m))?,
                }
                (BnPath::Fallback, reserve, Some(mask))
            }
        };
        Ok(BnSaved {
            owner: self.core.id,
            path,
            eps: a.eps,
            x_ptr,
            mean: ManuallyDrop::new(st.mean),
            mean_lo: st.mean_lo,
            inv_var: ManuallyDrop::new(st.inv_var),
            reserve,
            mask,
            graph_mask,
            own_variant,
            graph,
            spares: self.core.spares.clone(),
        })
    }

    /// Runs the BN part of the forward: fused (retrying as fallback when cuDNN refuses) or plain
    /// BN through the plan's API.
    fn run_forward(&self, path: BnPath, p: &FwdPtrs, momentum: f64, eps: f64) -> Result<Ran> {
        let core = &*self.core;
        if path == BnPath::CudnnFused && core.graph.planned_epilogue() {
            // cuDNN's mask, ready before cuDNN moves the running statistics (as below).
            let mask = self.graph_mask()?;
            if core
                .graph
                .forward_fused(&self.ctx, p, mask.ptr, momentum, eps)?
            {
                tracing::debug!(api = "graph", fuse = ?core.fuse, "BatchNorm forward (epilogue graph)");
                return Ok(Ran::GraphFused(mask));
            }
            core.spares.give_bytes(mask);
            // Refused (logged by the route): graph BatchNorm + bitmask kernels from now on.
            core.fused_refused.store(true, Ordering::Relaxed);
        } else if path == BnPath::CudnnFused {
            if let Some(ran) = self.run_fused_forward(p, momentum, eps)? {
                return Ok(ran);
            }
        }
        // cuDNN moves the running statistics: whatever the fallback's activation needs must be
        // ready before that, so that an error leaves them as they were (a retry would
        // otherwise apply the momentum twice).
        let mask = if self.core.fuse == Fuse::None {
            None
        } else {
            Some(self.prepare_fallback_activation()?)
        };
        self.run_plain_forward(p, momentum, eps, mask)
    }

    /// A reserve space of `bytes` (none for 0), recycled or allocated.
    fn reserve(&self, bytes: usize) -> Result<Option<Owned<u8>>> {
        crate::profile::stage!(Alloc);
        (bytes > 0)
            .then(|| self.core.spares.bytes(self.ctx.stream(), bytes))
            .transpose()
    }

    /// The buffer of cuDNN's ReLU mask for the epilogue graph: 1 byte per element (cuDNN's
    /// `BOOLEAN`; enough whether cuDNN packs it in bits or not), recycled or allocated. The
    /// forward graph writes all of it that the backward graph reads.
    fn graph_mask(&self) -> Result<Owned<u8>> {
        crate::profile::stage!(Alloc);
        self.core.spares.bytes(self.ctx.stream(), self.numel())
    }

    /// The fallback's activation made ready: its kernel loaded and its mask allocated.
    fn prepare_fallback_activation(&self) -> Result<Owned<u32>> {
        let ctx = &self.ctx;
        activation::prepare_forward(ctx, T::DTYPE, self.core.fuse == Fuse::AddRelu)?;
        crate::profile::stage!(Alloc);
        // The kernel writes every mask word (tail bits zero) before any read.
        let words = activation::mask_words(self.numel());
        self.core.spares.u32s(ctx.stream(), words)
    }

    /// cuDNN's fused forward; `None` when cuDNN refuses it (this shape then takes the fallback
    /// path from now on).
    fn run_fused_forward(&self, p: &FwdPtrs, momentum: f64, eps: f64) -> Result<Option<Ran>> {
        let core = &*self.core;
        let cu = core.cudnn()?;
        let ctx = &self.ctx;
        let mode = core.train.mode;
        let sizes = cu.fused_sizes.unwrap_or_default();
        // cuDNN writes the reserve in the forward before the backward reads it.
        let reserve = self.reserve(sizes.reserve)?;
        let result = {
            let rptr = reserve.as_ref().map_or(0, |r| r.ptr);
            crate::profile::stage!(Workspace);
            let mut guard = ctx.lock()?;
            let h = guard.cudnn()?;
            let ws = guard.workspace(sizes.forward_workspace)?;
            let ops = fused_ops(core.fuse);
            let (wsp, rsv) = ((ws, sizes.forward_workspace), (rptr, sizes.reserve));
            let key = p.replay_key(Call::ForwardEx(ops), wsp, rsv, momentum, eps);
            // SAFETY: pointers validated against the descriptors by the caller; workspace
            // and reserve sized by cuDNN's queries; the call goes through the guard's handle.
            unsafe {
                replay::run(&mut guard, h, &cu.replays, key, FWD, || {
                    calls::forward_training_ex(
                        h,
                        mode,
                        ops,
                        &cu.x_desc,
                        &cu.train_param.desc,
                        cu.relu.as_ref(),
                        p,
                        momentum,
                        eps,
                        wsp,
                        rsv,
                    )
                })
            }
        };
        match result {
            Ok(()) => {
                tracing::debug!(path = "cudnn_fused", "BatchNorm forward");
                return Ok(Some(Ran::Fused(reserve)));
            }
            Err(e) if e.is_cudnn_not_supported() => {
                core.fused_refused.store(true, Ordering::Relaxed);
                tracing::warn!(
                    layout = %core.train.layout, dtype = %core.train.dtype, fuse = ?core.fuse,
                    error = %e,
                    "cuDNN refused the fused BatchNorm forward; this shape uses the fallback path from now on"
                );
            }
            Err(e) => return Err(e),
        }
        Ok(None)
    }

    /// Plain BN through the plan's API (also the first half of the fallback, whose prepared
    /// `mask` it passes on).
    fn run_plain_forward(
        &self,
        p: &FwdPtrs,
        momentum: f64,
        eps: f64,
        mask: Option<Owned<u32>>,
    ) -> Result<Ran> {
        let core = &*self.core;
        let cu = core.cudnn()?;
        let ctx = &self.ctx;
        if core.graph.active() && core.graph.forward(ctx, p, momentum, eps)? {
            tracing::debug!(api = "graph", fuse = ?core.fuse, "BatchNorm forward (cuDNN BN)");
            return Ok(Ran::Graph(mask));
        }
        let api = if core.train.path == BnPath::CudnnFused {
            BnApi::Ex
        } else {
            core.train.api
        };
        let mut bn_reserve = None;
        {
            let ws_stage = crate::profile::enter(crate::profile::Stage::Workspace);
            let mut guard = ctx.lock()?;
            let h = guard.cudnn()?;
            match api {
                BnApi::Ex => {
                    let sizes = cu.bn_sizes.unwrap_or_default();
                    let ws = guard.workspace(sizes.forward_workspace)?;
                    // Written by this forward, read by the matching backward.
                    bn_reserve = self.reserve(sizes.reserve)?;
                    let rptr = bn_reserve.as_ref().map_or(0, |r| r.ptr);
                    drop(ws_stage);
                    let (wsp, rsv) = ((ws, sizes.forward_workspace), (rptr, sizes.reserve));
                    let key = p.replay_key(Call::ForwardEx(Ops::Bn), wsp, rsv, momentum, eps);
                    // SAFETY: as above.
                    unsafe {
                        replay::run(&mut guard, h, &cu.replays, key, FWD, || {
                            calls::forward_training_ex(
                                h,
                                core.train.mode,
                                Ops::Bn,
                                &cu.x_desc,
                                &cu.train_param.desc,
                                None,
                                p,
                                momentum,
                                eps,
                                wsp,
                                rsv,
                            )
                        })
                    }?
                }
                BnApi::Legacy => {
                    drop(ws_stage);
                    let key = p.replay_key(Call::Forward, (0, 0), (0, 0), momentum, eps);
                    // SAFETY: as above.
                    unsafe {
                        replay::run(&mut guard, h, &cu.replays, key, FWD, || {
                            calls::forward_training(
                                h,
                                core.train.mode,
                                &cu.x_desc,
                                &cu.train_param.desc,
                                p,
                                momentum,
                                eps,
                            )
                        })
                    }?
                }
                // A plan without cuDNN runs nnfuse's own kernels and never gets here.
                BnApi::None => {
                    return Err(Error::NotSupported(
                        "BatchNorm through cuDNN, but the plan found cuDNN missing".into(),
                    ))
                }
            }
        }
        tracing::debug!(?api, fuse = ?core.fuse, "BatchNorm forward (cuDNN BN)");
        Ok(match mask {
            None => Ran::Plain(bn_reserve),
            Some(mask) => Ran::BnOnlyForFallback(bn_reserve, mask),
        })
    }

    /// Training backward: writes `dx`, `dgamma`, `dbeta` and, for Add+ReLU, `d_addend`.
    pub fn backward(&self, mut a: BackwardArgs<'_, T>) -> Result<()> {
        crate::profile::stage!(Call);
        let core = &*self.core;
        let saved = a.saved;
        // 1. The state is this BatchNorm's; the addend gradient matches the fusion.
        if saved.owner != core.id {
            return Err(Error::invalid(
                "saved",
                "comes from the forward of a different BatchNorm (shape, axis, type, fusion or \
                 Context differ)",
            ));
        }
        check_addend(core.fuse, a.d_addend.is_some(), "d_addend")?;
        // 2. Every buffer validated before any launch, and bound once: the binder's guards
        //    record the buffers' use (cudarc's events) when it drops, after the work below.
        let (_bound, b) = self.check_backward(&mut a)?;
        // 3. The path the forward took.
        let reserve = saved.reserve.as_ref();
        match (saved.path, &saved.mask) {
            (BnPath::Own, mask) => self.run_backward_own(saved, &b, mask.as_ref()),
            (BnPath::CudnnFused, _) if saved.graph => {
                let mask = match &saved.graph_mask {
                    Some(m) if m.buf.len() >= self.numel() => m.ptr,
                    _ => {
                        return Err(Error::invalid(
                            "saved",
                            "is an epilogue-graph state without cuDNN's ReLU mask of one byte \
                             per element (corrupted state)",
                        ))
                    }
                };
                self.run_backward_graph_fused(saved, &b, mask)
            }
            (BnPath::CudnnFused, _) => {
                self.run_backward(saved, &b, BnPath::CudnnFused, None, reserve)
            }
            (BnPath::Plain, _) => self.run_backward(saved, &b, BnPath::Plain, None, reserve),
            (BnPath::Fallback, Some(mask)) => {
                if mask.buf.len() < activation::mask_words(self.numel()) {
                    return Err(Error::invalid(
                        "saved",
                        "holds a bitmask shorter than the tensor needs (corrupted state)",
                    ));
                }
                self.run_backward_fallback(saved, &b, MaskOf::Bits(mask.ptr))
            }
            (BnPath::Fallback, _) => Err(Error::invalid(
                "saved",
                "is a fallback-path state without its bitmask (corrupted state)",
            )),
        }
    }

    /// The backward's buffers: `x` is the forward's, and every buffer has the plan's length,
    /// lives on the Context's device, and no output overlaps another buffer. Returns the binder
    /// (keep it until the work is queued) and the addresses.
    fn check_backward<'b>(&'b self, a: &'b mut BackwardArgs<'_, T>) -> Result<(Binder<'b>, Bound)> {
        let numel = Need::Exactly(self.numel(), "the plan's shape");
        let param = Need::Exactly(self.core.param_len(Phase::Training), "the plan's shape");
        let mut ops = Binder::new(&self.ctx);
        let x = ops.input("x", &a.x, numel)?;
        if x != a.saved.x_ptr {
            return Err(Error::invalid(
                "x",
                "is not the buffer the forward that produced `saved` read",
            ));
        }
        let b = Bound {
            x,
            y: ops.input("y", &a.y, numel)?,
            dy: ops.input("dy", &a.dy, numel)?,
            gamma: ops.input("gamma", &a.gamma, param)?,
            beta: ops.input("beta", &a.beta, param)?,
            dx: ops.output("dx", &mut a.dx, numel)?,
            dgamma: ops.output("dgamma", &mut a.dgamma, param)?,
            dbeta: ops.output("dbeta", &mut a.dbeta, param)?,
            dz: match a.d_addend.as_mut() {
                Some(dz) => Some(ops.output("d_addend", dz, numel)?),
                None => None,
            },
        };
        ops.check(Aliasing::Distinct)?;
        Ok((ops, b))
    }

    /// The backward of a forward that ran BN and its activation as one cuDNN graph: the
    /// backward graph (dy times the forward's `mask`, d_addend, BN backward); where cuDNN cannot
    /// build it for these pointers, dy masked from y by nnfuse's kernel, then BN's backward.
    fn run_backward_graph_fused(&self, saved: &BnSaved, b: &Bound, mask: u64) -> Result<()> {
        let ptrs = BwdPtrs {
            x: b.x,
            y: b.y,
            dy: b.dy,
            dz: b.dz.unwrap_or(0),
            dx: b.dx,
            gamma: b.gamma,
            beta: b.beta,
            dgamma: b.dgamma,
            dbeta: b.dbeta,
            saved_mean: saved.mean.ptr,
            saved_inv_var: saved.inv_var.ptr,
        };
        if self.core.graph.backward_fused(&self.ctx, &ptrs, mask)? {
            tracing::debug!(api = "graph", fuse = ?self.core.fuse, "BatchNorm backward (epilogue graph)");
            return Ok(());
        }
        self.run_backward_fallback(saved, b, MaskOf::Y(b.y))
    }

    /// dy masked by the forward's ReLU into `out`: from the fallback's bitmask, or from y (the
    /// epilogue graph's mask is cuDNN's, read only by its backward graph).
    ///
    /// # Safety
    /// dy and `out` hold numel elements (checked by the caller, `out` overlapping nothing);
    /// the mask holds mask_words(numel) words, or y numel elements.
    unsafe fn mask_dy(&self, src: MaskOf, dy: u64, out: u64) -> Result<()> {
        let (ctx, n) = (&self.ctx, self.numel());
        // SAFETY: the caller's contract.
        unsafe {
            match src {
                MaskOf::Bits(m) => activation::relu_mask_bwd_raw(ctx, T::DTYPE, n, dy, m, out),
                MaskOf::Y(y) => activation::relu_bwd_from_y_raw(ctx, T::DTYPE, n, dy, y, out),
            }
        }
    }

    /// The fallback's backward: the mask backward (dy → d_addend for Add+ReLU, else into a
    /// recycled temporary), then cuDNN's BN backward from it.
    fn run_backward_fallback(&self, saved: &BnSaved, b: &Bound, mask: MaskOf) -> Result<()> {
        let core = &*self.core;
        let ctx = &self.ctx;
        let n = self.numel();
        let reserve = saved.reserve.as_ref();
        if let Some(dz) = b.dz {
            // d_addend = dy ⊙ mask is also the gradient that enters BN.
            // SAFETY: dy and d_addend hold n elements (checked, d_addend overlapping nothing);
            // the mask is the forward's own (its length checked by the caller) or y.
            unsafe { self.mask_dy(mask, b.dy, dz) }?;
            return self.run_backward(saved, b, BnPath::Fallback, None, reserve);
        }
        // Fully written by the mask backward before BN reads it; a recycled temporary, given
        // back once both are queued (stream order).
        let tmp = {
            crate::profile::stage!(Alloc);
            core.spares.bytes(ctx.stream(), n * T::DTYPE.size())?
        };
        let dpre = tmp.ptr;
        let r = if tmp.buf.len() < n * T::DTYPE.size() {
            Err(Error::NotSupported(
                "BatchNorm's temporary is smaller than the tensor".into(),
            ))
        } else {
            // SAFETY: dy holds n elements (checked); the temporary n elements of T, nnfuse's
            // own, overlapping nothing; the mask as above.
            unsafe { self.mask_dy(mask, b.dy, dpre) }
                .and_then(|()| self.run_backward(saved, b, BnPath::Fallback, Some(dpre), reserve))
        };
        core.spares.give_bytes(tmp);
        r
    }

    /// The own backward (the mask, if any, is the own forward's).
    fn run_backward_own(
        &self,
        saved: &BnSaved,
        b: &Bound,
        mask: Option<&Owned<u32>>,
    ) -> Result<()> {
        let core = &*self.core;
        let ctx = &self.ctx;
        if core.fuse != Fuse::None && mask.is_none() {
            return Err(Error::invalid(
                "saved",
                "is an own-path state of an activation without its bitmask (corrupted state)",
            ));
        }
        let Some(mean_lo) = saved.mean_lo.as_ref() else {
            return Err(Error::invalid(
                "saved",
                "is an own-path state without its mean remainder (corrupted state)",
            ));
        };
        // nnfuse's own buffers: their addresses, no stream events (see `state.rs`).
        let bufs = BwdBufs {
            x: b.x,
            dy: b.dy,
            mask: mask.map_or(0, |m| m.ptr),
            dx: b.dx,
            dz: b.dz.unwrap_or(0),
            gamma: b.gamma,
            saved_mean: saved.mean.ptr,
            saved_mean_lo: mean_lo.ptr,
            saved_invstd: saved.inv_var.ptr,
            dgamma: b.dgamma,
            dbeta: b.dbeta,
        };
        let want = core.train.own_backward.unwrap_or(OwnVariant::TwoPass);
        let v = {
            crate::profile::stage!(Launch);
            own::backward(&core.own_op(ctx, T::DTYPE), &bufs, want, saved.eps)?
        };
        core.last_backward
            .store(variant_code(Some(v)), Ordering::Relaxed);
        tracing::debug!(path = "own", variant = %v, "BatchNorm backward");
        Ok(())
    }

    /// The cuDNN half of the backward. For the fallback the BN input gradient is `dpre` (ReLU)
    /// or `d_addend` (Add+ReLU, already masked).
    fn run_backward(
        &self,
        saved: &BnSaved,
        b: &Bound,
        path: BnPath,
        dpre: Option<u64>,
        reserve: Option<&Owned<u8>>,
    ) -> Result<()> {
        let core = &*self.core;
        let ctx = &self.ctx;
        let dz_ptr = b.dz.unwrap_or(0);
        // The gradient entering BN: the user's dy (plain, fused), the masked copy (fallback).
        let dy = match (path, dpre) {
            (BnPath::Fallback, Some(p)) => p,
            (BnPath::Fallback, None) => dz_ptr,
            _ => b.dy,
        };
        // nnfuse's own buffers: their addresses, no stream events (see `state.rs`).
        let ptrs = BwdPtrs {
            x: b.x,
            y: b.y,
            dy,
            dz: dz_ptr,
            dx: b.dx,
            gamma: b.gamma,
            beta: b.beta,
            dgamma: b.dgamma,
            dbeta: b.dbeta,
            saved_mean: saved.mean.ptr,
            saved_inv_var: saved.inv_var.ptr,
        };
        if saved.graph && core.graph.backward(ctx, &ptrs)? {
            tracing::debug!(?path, api = "graph", "BatchNorm backward");
            return Ok(());
        }
        let cu = core.cudnn()?;
        let ws_stage = crate::profile::enter(crate::profile::Stage::Workspace);
        let mut guard = ctx.lock()?;
        let h = guard.cudnn()?;
        let mode = core.train.mode;
        // After a graph forward (no reserve space) the legacy fallback is the call without one.
        let api = if saved.graph {
            BnApi::Legacy
        } else if core.train.path == BnPath::CudnnFused {
            BnApi::Ex
        } else {
            core.train.api
        };
        if path == BnPath::CudnnFused || api == BnApi::Ex {
            // The fused ops, or plain BN through the Ex API (with the forward's reserve, if any).
            let (ops, relu, sizes) = if path == BnPath::CudnnFused {
                (fused_ops(core.fuse), cu.relu.as_ref(), cu.fused_sizes)
            } else {
                (Ops::Bn, None, cu.bn_sizes)
            };
            let sizes = sizes.unwrap_or_default();
            let ws = guard.workspace(sizes.backward_workspace)?;
            let rptr = reserve.map_or(0, |r| r.ptr);
            let rlen = reserve.map_or(0, |r| r.buf.len());
            drop(ws_stage);
            let (wsp, rsv) = ((ws, sizes.backward_workspace), (rptr, rlen));
            let key = ptrs.replay_key(Call::BackwardEx(ops), wsp, rsv, saved.eps);
            // SAFETY: validated buffers, cuDNN-sized workspace, the forward's reserve; the call
            // goes through the guard's handle.
            unsafe {
                replay::run(&mut guard, h, &cu.replays, key, BWD, || {
                    calls::backward_ex(
                        h,
                        mode,
                        ops,
                        &cu.x_desc,
                        &cu.train_param.desc,
                        relu,
                        &ptrs,
                        saved.eps,
                        wsp,
                        rsv,
                    )
                })
            }?;
        } else {
            drop(ws_stage);
            let key = ptrs.replay_key(Call::Backward, (0, 0), (0, 0), saved.eps);
            // SAFETY: as above.
            unsafe {
                replay::run(&mut guard, h, &cu.replays, key, BWD, || {
                    calls::backward(h, mode, &cu.x_desc, &cu.train_param.desc, &ptrs, saved.eps)
                })
            }?;
        }
        tracing::debug!(?path, ?api, "BatchNorm backward");
        Ok(())
    }

    /// Inference forward with the running statistics, then the activation (no mask: there is
    /// no backward).
    pub fn forward_inference(&self, mut a: InferenceArgs<'_, T>) -> Result<()> {
        let core = &*self.core;
        let ctx = &self.ctx;
        // 1. Scalars and the addend.
        check_scalars(a.eps, None)?;
        check_addend(core.fuse, a.addend.is_some(), "addend")?;
        // 2. Every buffer validated, then BatchNorm (the own kernels and the graph's epilogue
        //    do the activation too).
        let (path, activated) = self.run_inference(&mut a)?;
        if path == BnPath::Own || activated {
            return Ok(());
        }
        // 3. cuDNN's BatchNorm ran: the activation, in place.
        match (core.fuse, &a.addend) {
            (Fuse::None, _) => {}
            (Fuse::Relu, _) => {
                activation::relu_mask_fwd_inplace(ctx, &mut a.y, None::<&mut CudaSlice<u32>>)?
            }
            (Fuse::AddRelu, Some(z)) => activation::add_relu_mask_fwd_inplace(
                ctx,
                &mut a.y,
                z,
                None::<&mut CudaSlice<u32>>,
            )?,
            (Fuse::AddRelu, None) => return Err(Error::invalid("addend", "is required")),
        }
        tracing::debug!(mode = ?core.infer.mode, fuse = ?core.fuse, "BatchNorm inference");
        Ok(())
    }

    /// Validates the inference buffers and runs the BatchNorm part: the own kernels (whole
    /// operation), cuDNN's graph (with the activation where it fused it) or cuDNN's legacy
    /// inference forward. Returns the path that ran and whether the activation ran too.
    fn run_inference(&self, a: &mut InferenceArgs<'_, T>) -> Result<(BnPath, bool)> {
        let core = &*self.core;
        let ctx = &self.ctx;
        let numel = Need::Exactly(self.numel(), "the plan's shape");
        let param = Need::Exactly(core.param_len(Phase::Inference), "the plan's shape");
        let mut ops = Binder::new(ctx);
        let x = ops.input("x", &a.x, numel)?;
        let g = ops.input("gamma", &a.gamma, param)?;
        let b = ops.input("beta", &a.beta, param)?;
        let m = ops.input("running_mean", &a.running_mean, param)?;
        let v = ops.input("running_var", &a.running_var, param)?;
        let z = match &a.addend {
            Some(zv) => ops.input("addend", zv, numel)?,
            None => 0,
        };
        let y = ops.output("y", &mut a.y, numel)?;
        ops.check(Aliasing::Distinct)?;
        if core.infer.path.is_own() {
            let bufs = InferBufs {
                x,
                z,
                y,
                gamma: g,
                beta: b,
                running_mean: m,
                running_var: v,
            };
            own::forward_inference(&core.own_op(ctx, T::DTYPE), &bufs, a.eps)?;
            tracing::debug!(path = "own", fuse = ?core.fuse, "BatchNorm inference");
            return Ok((BnPath::Own, true));
        }
        if core.graph.infer_active() {
            let p = InferPtrs {
                x,
                z,
                y,
                gamma: g,
                beta: b,
                running_mean: m,
                running_var: v,
            };
            // The inverse standard deviation's scratch: recycled, given back once the plan that
            // reads it is queued (stream order).
            let scratch = {
                crate::profile::stage!(Alloc);
                core.spares
                    .f32s(ctx.stream(), core.param_len(Phase::Inference))?
            };
            let ran = core.graph.inference(ctx, &p, a.eps, scratch.ptr);
            core.spares.give_f32s(scratch);
            match ran? {
                InferRan::NotRun => {}
                r => {
                    let fused = r == InferRan::WithEpilogue;
                    tracing::debug!(api = "graph", fuse = ?core.fuse, epilogue = fused, "BatchNorm inference");
                    return Ok((core.infer.path, fused));
                }
            }
        }
        let cu = core.cudnn()?;
        let mut guard = ctx.lock()?;
        let h = guard.cudnn()?;
        // SAFETY: validated above.
        unsafe {
            calls::forward_inference(
                h,
                core.infer.mode,
                &cu.x_desc,
                &cu.infer_param.desc,
                x,
                y,
                g,
                b,
                m,
                v,
                a.eps,
            )
        }?;
        Ok((core.infer.path, false))
    }
}

/// Where the fallback's backward reads the forward's ReLU from.
#[derive(Clone, Copy)]
enum MaskOf {
    /// The fallback's bitmask (its address).
    Bits(u64),
    /// The forward's y (after the epilogue graph, whose mask only cuDNN reads).
    Y(u64),
}

/// The buffers a training forward saves for its backward.
pub(super) struct TrainState {
    pub(super) mean: Owned<f32>,
    pub(super) inv_var: Owned<f32>,
    /// Own path: the mean's remainder.
    pub(super) mean_lo: Option<Owned<f32>>,
    /// Own path with an activation: the mask the own forward writes.
    pub(super) own_mask: Option<Owned<u32>>,
}

/// What the forward's cuDNN half did, with the reserve space cuDNN asked to keep (or which own
/// variant ran).
pub(super) enum Ran {
    /// nnfuse's own kernels ran everything.
    Own(OwnVariant),
    /// cuDNN's fused op ran.
    Fused(Option<Owned<u8>>),
    /// Plain BN, no activation asked for.
    Plain(Option<Owned<u8>>),
    /// Plain BN; the activation is still to do, into the mask prepared before BN ran.
    BnOnlyForFallback(Option<Owned<u8>>, Owned<u32>),
    /// BN through cuDNN's graph API (no reserve space), with the fallback's prepared mask when
    /// an activation is still to do.
    Graph(Option<Owned<u32>>),
    /// BN and its activation as one cuDNN graph (no reserve space), with cuDNN's ReLU mask.
    GraphFused(Owned<u8>),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fallback's bitmask kernel failing to load (a failed NVRTC compile, say) must fail
    /// the call before cuDNN moves the running statistics: a retry would otherwise apply the
    /// momentum twice. Before the fix the kernel was loaded after cuDNN's forward.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn a_fallback_whose_activation_cannot_load_leaves_the_running_statistics() {
        use crate::config::{BnImpl, Config};
        let cfg = Config::default()
            .with_bn_impl(BnImpl::Cudnn)
            .with_cudnn_fusion_disabled(true);
        let ctx = crate::testutil::gpu_with(cfg);
        let s = ctx.stream();
        let (shape, c) = ([8usize, 4, 4, 16], 16);
        let n: usize = shape.iter().product();
        for fuse in [Fuse::Relu, Fuse::AddRelu] {
            let bn = BatchNorm::<f32>::new(&ctx, &shape, 3, fuse).unwrap();
            assert_eq!(bn.training_path(), BnPath::Fallback, "{}", bn.plan());
            let x = s
                .clone_htod(&(0..n).map(|i| (i % 7) as f32).collect::<Vec<_>>())
                .unwrap();
            let z = s.clone_htod(&vec![0.5f32; n]).unwrap();
            let g = s.clone_htod(&vec![1.0f32; c]).unwrap();
            let b = s.clone_htod(&vec![0.0f32; c]).unwrap();
            let mut rm = s.clone_htod(&vec![0.25f32; c]).unwrap();
            let mut rv = s.clone_htod(&vec![2.0f32; c]).unwrap();
            let mut y = s.alloc_zeros::<f32>(n).unwrap();
            let mut args = |rm: &mut CudaSlice<f32>, rv: &mut CudaSlice<f32>| {
                let a = TrainArgs {
                    x: x.as_view(),
                    addend: (fuse == Fuse::AddRelu).then(|| z.as_view()),
                    gamma: g.as_view(),
                    beta: b.as_view(),
                    running_mean: rm.as_view_mut(),
                    running_var: rv.as_view_mut(),
                    y: y.as_view_mut(),
                    momentum: 0.5,
                    eps: 1e-5,
                };
                bn.forward_train(a).map(drop)
            };
            activation::fail_load::set(true);
            let r = args(&mut rm, &mut rv);
            activation::fail_load::set(false);
            assert!(
                r.is_err(),
                "{fuse:?}: the injected load failure must fail the call"
            );
            ctx.synchronize().unwrap();
            assert_eq!(s.clone_dtoh(&rm).unwrap(), vec![0.25f32; c], "{fuse:?}");
            assert_eq!(s.clone_dtoh(&rv).unwrap(), vec![2.0f32; c], "{fuse:?}");
            // The retry applies the momentum once.
            args(&mut rm, &mut rv).unwrap();
            let once = s.clone_dtoh(&rm).unwrap();
            assert!(once.iter().all(|&v| v != 0.25), "{fuse:?}: {once:?}");
        }
    }

    #[test]
    fn scalars_are_checked() {
        assert!(check_scalars(1e-5, Some(0.1)).is_ok());
        assert!(check_scalars(1e-12, Some(1.0)).is_ok());
        for eps in [0.0, -1e-5, f64::NAN, f64::INFINITY] {
            assert_eq!(
                check_scalars(eps, None).unwrap_err().argument(),
                Some("eps")
            );
        }
        for m in [-0.1, 1.5, f64::NAN] {
            assert_eq!(
                check_scalars(1e-5, Some(m)).unwrap_err().argument(),
                Some("momentum")
            );
        }
    }

    #[test]
    fn addend_matches_fusion() {
        assert!(check_addend(Fuse::AddRelu, true, "addend").is_ok());
        assert!(check_addend(Fuse::Relu, false, "addend").is_ok());
        assert_eq!(
            check_addend(Fuse::AddRelu, false, "addend")
                .unwrap_err()
                .argument(),
            Some("addend")
        );
        assert_eq!(
            check_addend(Fuse::None, true, "d_addend")
                .unwrap_err()
                .argument(),
            Some("d_addend")
        );
    }
}
