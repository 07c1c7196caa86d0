//! [`ConvBnChain`]: `conv → BN → ReLU → conv → … → BN (+ add) → ReLU` trained as one planned
//! chain (a ResNet block's main path), on the prologue route (each inner BatchNorm's apply and
//! ReLU folded into the next convolution, `chain_fused.rs`) or as [`ConvBnTrain`] units: its
//! arguments, the state a forward leaves for the backward, and the units route.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};

use super::api::lock;
use super::chain_graphs::{self, LinkGraphs};
use super::chain_plan::{plan_chain, ChainPlan, ChainPlanRequest, ChainRoute};
use super::stats_plan::unit_sums_len;
use super::train::{ConvBnArgs, ConvBnBackwardArgs, ConvBnTrain, TrainSaved};
use crate::batchnorm::{BnSaved, Fuse};
use crate::context::{cudnn_present, cudnn_version, Context};
use crate::conv::ConvShape;
use crate::dtype::Element;
use crate::error::{CallExt, Error, Result};

/// Most units in a chain (a ResNet bottleneck has three).
pub(crate) const MAX_CHAIN_UNITS: usize = 8;

/// One unit's BatchNorm parameters and running statistics.
pub struct ChainBn<'a> {
    /// Scale, one per output channel of the unit's convolution.
    pub gamma: CudaView<'a, f32>,
    /// Bias, one per output channel.
    pub beta: CudaView<'a, f32>,
    /// Running mean, updated in place.
    pub running_mean: CudaViewMut<'a, f32>,
    /// Running (unbiased) variance, updated in place.
    pub running_var: CudaViewMut<'a, f32>,
}

/// The forward's operands. Everything between the input and the output (the convolutions'
/// outputs, the inner activations where a route writes them, the statistics) lives in the
/// [`ChainSaved`] the call fills.
pub struct ChainArgs<'a, T> {
    /// The first convolution's input.
    pub x: CudaView<'a, T>,
    /// The filters, one per unit.
    pub w: Vec<CudaView<'a, T>>,
    /// The BatchNorms, one per unit.
    pub bn: Vec<ChainBn<'a>>,
    /// Added before the last ReLU: required when the last BatchNorm is `Fuse::AddRelu`.
    pub addend: Option<CudaView<'a, T>>,
    /// The chain's output; must not overlap any input.
    pub y: CudaViewMut<'a, T>,
    /// Weight of the new batch statistics, in `[0, 1]`.
    pub momentum: f64,
    /// Added to the variance; finite and `> 0`.
    pub eps: f64,
}

/// Where the addend's gradient goes.
pub enum AddendGrad<'a, T> {
    /// The last BatchNorm adds nothing.
    None,
    /// Into this buffer (the addend's extent).
    Into(CudaViewMut<'a, T>),
    /// The addend is the chain's input `x` (an identity shortcut): its gradient is written into
    /// `dx` and the first convolution's data gradient is added onto it (no separate add pass).
    IntoDx,
}

/// The backward's operands. Gradients of the filters, `gamma` and `beta` are overwritten;
/// `dx` is overwritten or added to (`accumulate_dx`).
pub struct ChainBackwardArgs<'a, T> {
    /// The forward's `x`.
    pub x: CudaView<'a, T>,
    /// The filters.
    pub w: Vec<CudaView<'a, T>>,
    /// Scales, as in the forward.
    pub gamma: Vec<CudaView<'a, f32>>,
    /// Biases, as in the forward.
    pub beta: Vec<CudaView<'a, f32>>,
    /// The forward's `y`.
    pub y: CudaView<'a, T>,
    /// Gradient of the loss with respect to `y`.
    pub dy: CudaView<'a, T>,
    /// Gradient with respect to `x`; `None` skips the first data gradient (a first layer).
    pub dx: Option<CudaViewMut<'a, T>>,
    /// Add the first data gradient into `dx` instead of overwriting it.
    pub accumulate_dx: bool,
    /// Filter gradients, one per unit.
    pub dw: Vec<CudaViewMut<'a, T>>,
    /// Gradients of `gamma`, one per unit.
    pub dgamma: Vec<CudaViewMut<'a, f32>>,
    /// Gradients of `beta`, one per unit.
    pub dbeta: Vec<CudaViewMut<'a, f32>>,
    /// The addend's gradient.
    pub d_addend: AddendGrad<'a, T>,
}

/// The per-call state: what a forward leaves for its backward, and the backward's scratch.
/// Made once by [`ConvBnChain::new_saved`] and reused by every step (a forward, then its
/// backward, which also writes the scratch here).
pub struct ChainSaved<T> {
    pub(super) chain: usize,
    pub(super) route: Option<ChainRoute>,
    /// Each unit's convolution output (its BatchNorm's input).
    pub(super) z: Vec<CudaSlice<T>>,
    /// Units route: the inner BatchNorm + ReLU outputs, and their gradients.
    pub(super) act: Vec<CudaSlice<T>>,
    pub(super) dact: Vec<CudaSlice<T>>,
    pub(super) units: Vec<Option<TrainSaved>>,
    /// The gradient with respect to each z.
    pub(super) dz: Vec<CudaSlice<T>>,
    /// Prologue route: per unit sum and sum of squares of z.
    pub(super) sums: Vec<(CudaSlice<f32>, CudaSlice<f32>)>,
    /// Prologue route, inner units: saved mean (hi, lo), inverse std, and the equivalent
    /// scale and bias of BatchNorm (the next convolution's prologue).
    pub(super) mean: Vec<(CudaSlice<f32>, CudaSlice<f32>)>,
    pub(super) inv_std: Vec<CudaSlice<f32>>,
    pub(super) eq: Vec<(CudaSlice<T>, CudaSlice<T>)>,
    /// Prologue route: the last BatchNorm's state.
    pub(super) last: Option<BnSaved>,
    /// Prologue backward: the gradient after the inner ReLU (the largest inner extent), and
    /// the BatchNorm data gradient's coefficients (3 x the most channels).
    pub(super) drelu: CudaSlice<T>,
    pub(super) coef: CudaSlice<f32>,
}

impl<T> ChainSaved<T> {
    /// The route the last forward ran (None before one ran).
    pub fn route(&self) -> Option<ChainRoute> {
        self.route
    }

    /// Unit `i`'s convolution output as the last forward wrote it.
    pub fn z(&self, i: usize) -> Option<CudaView<'_, T>> {
        self.z.get(i).map(|z| z.as_view())
    }

    /// The gradient with respect to unit `i`'s convolution output, as the last backward wrote
    /// it.
    pub fn dz(&self, i: usize) -> Option<CudaView<'_, T>> {
        self.dz.get(i).map(|z| z.as_view())
    }
}

impl<T> std::fmt::Debug for ChainSaved<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChainSaved")
            .field("route", &self.route)
            .field("units", &self.z.len())
            .finish()
    }
}

/// How the first call decided, or a forced route.
#[derive(Debug, Clone, PartialEq)]
pub struct ChainChoice {
    /// The route later calls take.
    pub route: ChainRoute,
    /// GPU time (median, µs) of a forward plus backward per route timed.
    pub times_us: Vec<(ChainRoute, f64)>,
    /// One line per step: the checks, the timing, or why the prologue route was not measured.
    pub notes: Vec<String>,
}

impl ChainChoice {
    /// One line: the route and the times, or why nothing was timed.
    pub fn describe(&self) -> String {
        if self.times_us.is_empty() {
            return format!(
                "{} route (nothing timed): {}",
                self.route,
                self.notes.join("; ")
            );
        }
        let times: Vec<String> = self
            .times_us
            .iter()
            .map(|(r, t)| format!("{r} {t:.1} us"))
            .collect();
        format!(
            "{} route ({}: forward + backward, GPU time, median)",
            self.route,
            times.join(", ")
        )
    }
}

/// `conv → BN → ReLU → … → conv → BN (+ addend) → ReLU` trained as one chain, for element
/// type `T`: planned once ([`ConvBnChain::plan`]), the route decided by the first
/// [`ConvBnChain::forward_train`] (the prologue route checked against the units route on the
/// device, forward and backward, then both timed), forward and backward.
///
/// ```no_run
/// # use nnfuse::{Context, TensorFormat};
/// # use nnfuse::conv::ConvShape;
/// # use nnfuse::batchnorm::Fuse;
/// # use nnfuse::block::{ChainArgs, ChainBn, ConvBnChain};
/// # fn main() -> nnfuse::Result<()> {
/// let ctx = Context::new(0)?;
/// // A ResNet-50 bottleneck's main path, batch 32, f16 NHWC; the shortcut is x itself.
/// let s = |c_in, c_out, k| ConvShape::square(32, c_in, 56, c_out, k, TensorFormat::Nhwc);
/// let shapes = [s(256, 64, 1), s(64, 64, 3), s(64, 256, 1)];
/// let chain = ConvBnChain::<half::f16>::new(&ctx, &shapes, Fuse::AddRelu)?;
/// println!("{}", chain.plan());
/// let st = ctx.stream();
/// let x = st.alloc_zeros::<half::f16>(shapes[0].x_len()?)?;
/// let (mut w, mut rm, mut rv) = (Vec::new(), Vec::new(), Vec::new());
/// for sh in &shapes {
///     w.push(st.alloc_zeros::<half::f16>(sh.w_len()?)?);
///     rm.push(st.alloc_zeros::<f32>(sh.c_out)?);
///     rv.push(st.clone_htod(&vec![1.0f32; sh.c_out])?);
/// }
/// let ones = st.clone_htod(&[1.0f32; 256])?;
/// let zeros = st.alloc_zeros::<f32>(256)?;
/// let mut y = st.alloc_zeros::<half::f16>(shapes[2].y_len()?)?;
/// let mut saved = chain.new_saved()?;
/// let bn = rm.iter_mut().zip(rv.iter_mut()).zip(&shapes).map(|((m, v), sh)| ChainBn {
///     gamma: ones.slice(..sh.c_out), beta: zeros.slice(..sh.c_out),
///     running_mean: m.as_view_mut(), running_var: v.as_view_mut(),
/// }).collect();
/// chain.forward_train(ChainArgs {
///     x: x.as_view(), w: w.iter().map(|w| w.as_view()).collect(), bn,
///     addend: Some(x.as_view()), y: y.as_view_mut(), momentum: 0.1, eps: 1e-5,
/// }, &mut saved)?;
/// if let Some(c) = chain.choice() {
///     println!("{}", c.describe());
/// }
/// # Ok(()) }
/// ```
pub struct ConvBnChain<T: Element> {
    pub(super) ctx: Context,
    pub(super) plan: ChainPlan,
    pub(super) shapes: Vec<ConvShape>,
    pub(super) units: Vec<ConvBnTrain<T>>,
    /// The prologue route's cuDNN graphs per inner link, built at the first call that needs
    /// them (or why they cannot be).
    pub(super) graphs: Mutex<Option<std::result::Result<Arc<Vec<LinkGraphs>>, String>>>,
    pub(super) decision: Mutex<Option<ChainChoice>>,
    pub(super) id: usize,
}

impl<T: Element> std::fmt::Debug for ConvBnChain<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConvBnChain")
            .field("shapes", &self.shapes)
            .field("dtype", &self.plan.dtype)
            .field("last", &self.plan.last)
            .field("decision", &*lock(&self.decision))
            .finish()
    }
}

impl<T: Element> ConvBnChain<T> {
    /// Plans the chain of `shapes` (unit i + 1 takes unit i's BatchNorm + ReLU output) whose
    /// last BatchNorm has the activation `last`; no GPU work beyond the units' constructors.
    /// Errors: fewer than two or more than eight units, units that do not connect, a unit
    /// that cannot be planned — each naming `shapes`.
    pub fn new(ctx: &Context, shapes: &[ConvShape], last: Fuse) -> Result<Self> {
        if shapes.len() > MAX_CHAIN_UNITS {
            return Err(Error::invalid(
                "shapes",
                format!("{} units, at most {MAX_CHAIN_UNITS}", shapes.len()),
            ));
        }
        let cudnn = if cudnn_present() {
            Some(cudnn_version()?)
        } else {
            None
        };
        let mut plan = plan_chain(&ChainPlanRequest {
            shapes,
            dtype: T::DTYPE,
            last,
            config: ctx.config(),
            cudnn,
        })?;
        let units = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| ConvBnTrain::<T>::new(ctx, s, plan.fuse_of(i)))
            .collect::<Result<Vec<_>>>()?;
        if plan.eligible(ChainRoute::Prologue) {
            if let Some((i, u)) = units.iter().enumerate().find(|(_, u)| u.fused.is_none()) {
                plan.refuse(
                    ChainRoute::Prologue,
                    format!(
                        "unit {i}: its fused parts could not be built: {}",
                        u.plan().reason(super::TrainRoute::Fused)
                    ),
                );
            }
        }
        tracing::info!(plan = %plan, "conv+BN training chain planned");
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);
        Ok(ConvBnChain {
            ctx: ctx.clone(),
            plan,
            shapes: shapes.to_vec(),
            units,
            graphs: Mutex::new(None),
            decision: Mutex::new(None),
            id: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        })
    }

    /// The prologue route's graphs, built on first use, or the remembered reason they cannot
    /// be.
    pub(super) fn link_graphs(&self) -> Result<Arc<Vec<LinkGraphs>>> {
        let mut g = lock(&self.graphs);
        if g.is_none() {
            *g = Some(
                chain_graphs::build(&self.ctx, &self.shapes, T::DTYPE)
                    .map(Arc::new)
                    .map_err(|e| e.to_string()),
            );
        }
        match g.as_ref() {
            Some(Ok(v)) => Ok(v.clone()),
            Some(Err(why)) => Err(Error::NotSupported(format!(
                "the prologue route's cuDNN graphs: {why}"
            ))),
            None => Err(Error::NotSupported("graphs vanished".into())),
        }
    }

    /// Every route's eligibility and why, and the units' plans.
    pub fn plan(&self) -> &ChainPlan {
        &self.plan
    }

    /// The first call's decision (None before it).
    pub fn choice(&self) -> Option<ChainChoice> {
        lock(&self.decision).clone()
    }

    /// Unit `i` (the units route; its convolution, BatchNorm and decision).
    pub fn unit(&self, i: usize) -> Option<&ConvBnTrain<T>> {
        self.units.get(i)
    }

    /// A state for [`ConvBnChain::forward_train`] and [`ConvBnChain::backward`]: the
    /// convolutions' outputs, the inner activations and every gradient in between (device
    /// memory of about four times the chain's activations).
    pub fn new_saved(&self) -> Result<ChainSaved<T>> {
        let s = self.ctx.stream();
        let alloc = |len: usize| -> Result<CudaSlice<T>> {
            // SAFETY: every route writes these before it reads them.
            unsafe { s.alloc::<T>(len.max(1)) }.call("cuMemAllocAsync")
        };
        let f32s = |len: usize| s.alloc_zeros::<f32>(len.max(1)).call("cuMemAllocAsync");
        let n = self.shapes.len();
        let z_len = |i: usize| self.shapes[i].y_len();
        let inner = (0..n - 1).map(z_len).collect::<Result<Vec<_>>>()?;
        let most_c = self.shapes.iter().map(|s| s.c_out).max().unwrap_or(1);
        Ok(ChainSaved {
            chain: self.id,
            route: None,
            z: (0..n).map(|i| alloc(z_len(i)?)).collect::<Result<_>>()?,
            act: inner.iter().map(|&l| alloc(l)).collect::<Result<_>>()?,
            dact: inner.iter().map(|&l| alloc(l)).collect::<Result<_>>()?,
            units: (0..n).map(|_| None).collect(),
            dz: (0..n).map(|i| alloc(z_len(i)?)).collect::<Result<_>>()?,
            sums: self
                .shapes
                .iter()
                .map(|s| {
                    let len = unit_sums_len(T::DTYPE, s.c_out);
                    Ok((f32s(len)?, f32s(len)?))
                })
                .collect::<Result<_>>()?,
            mean: self.shapes[..n - 1]
                .iter()
                .map(|s| Ok((f32s(s.c_out)?, f32s(s.c_out)?)))
                .collect::<Result<_>>()?,
            inv_std: self.shapes[..n - 1]
                .iter()
                .map(|s| f32s(s.c_out))
                .collect::<Result<_>>()?,
            eq: self.shapes[..n - 1]
                .iter()
                .map(|s| Ok((alloc(s.c_out)?, alloc(s.c_out)?)))
                .collect::<Result<_>>()?,
            last: None,
            drelu: alloc(inner.iter().copied().max().unwrap_or(1))?,
            coef: f32s(3 * most_c)?,
        })
    }

    /// The training forward on the decided route (deciding on the first call). `saved`
    /// receives what the backward needs.
    pub fn forward_train(&self, mut a: ChainArgs<'_, T>, saved: &mut ChainSaved<T>) -> Result<()> {
        self.check_args(&a, saved)?;
        let decided = lock(&self.decision).as_ref().map(|c| c.route);
        match decided {
            None => crate::cudnn_graph::replay::suspended(|| self.decide(&mut a, saved)),
            Some(r) => self.run(r, &mut a, saved),
        }
    }

    /// [`ConvBnChain::forward_train`] on a given route (tests, benchmarks, a caller that
    /// decided): no measurement. The prologue route where the plan refuses it is an
    /// [`Error::NotSupported`] carrying the plan's reason.
    pub fn forward_train_with(
        &self,
        route: ChainRoute,
        mut a: ChainArgs<'_, T>,
        saved: &mut ChainSaved<T>,
    ) -> Result<()> {
        self.check_args(&a, saved)?;
        if !self.plan.eligible(route) {
            return Err(Error::NotSupported(format!(
                "route {route} cannot run this chain: {}",
                self.plan.reason(route)
            )));
        }
        self.run(route, &mut a, saved)
    }

    /// The backward of the forward that filled `saved`, on that forward's route.
    /// `saved` also holds the backward's scratch (the gradients between the units).
    pub fn backward(&self, a: ChainBackwardArgs<'_, T>, saved: &mut ChainSaved<T>) -> Result<()> {
        self.check_backward_args(&a, saved)?;
        match saved.route {
            Some(ChainRoute::Prologue) => self.backward_prologue(a, saved),
            Some(ChainRoute::Units) => self.backward_units(a, saved),
            None => Err(Error::invalid(
                "saved",
                "no forward has filled it (call forward_train first)",
            )),
        }
    }

    pub(super) fn run(
        &self,
        route: ChainRoute,
        a: &mut ChainArgs<'_, T>,
        saved: &mut ChainSaved<T>,
    ) -> Result<()> {
        saved.route = None;
        // The prologue's graphs are built for 16-byte aligned tensors: a caller's filter or
        // BatchNorm parameter that is not takes the units route for this call, before anything
        // has run (its backward follows the route the state records).
        let misaligned = match route {
            ChainRoute::Prologue => self.forward_misaligned(a),
            ChainRoute::Units => None,
        };
        let route = match (route, misaligned) {
            (ChainRoute::Prologue, Some(what)) => {
                tracing::info!(
                    operand = what,
                    "chain: prologue route refused for this call \
                    (not 16-byte aligned); the units route runs"
                );
                ChainRoute::Units
            }
            (r, _) => r,
        };
        match route {
            ChainRoute::Prologue => self.forward_prologue(a, saved)?,
            ChainRoute::Units => self.forward_units(a, saved)?,
        }
        saved.route = Some(route);
        Ok(())
    }

    /// The counts the chain needs, before anything runs (each part checks lengths, devices
    /// and overlaps of what it launches on).
    fn check_args(&self, a: &ChainArgs<'_, T>, saved: &ChainSaved<T>) -> Result<()> {
        let n = self.shapes.len();
        self.check_saved(saved)?;
        if a.w.len() != n {
            return Err(Error::invalid(
                "w",
                format!("{} filters for {n} units", a.w.len()),
            ));
        }
        if a.bn.len() != n {
            return Err(Error::invalid(
                "bn",
                format!("{} BatchNorms for {n} units", a.bn.len()),
            ));
        }
        let wants = self.plan.last == Fuse::AddRelu;
        if wants != a.addend.is_some() {
            return Err(Error::invalid(
                "addend",
                if wants {
                    "required by the last BatchNorm's Fuse::AddRelu"
                } else {
                    "given, but the last BatchNorm does not add (Fuse::AddRelu adds)"
                },
            ));
        }
        Ok(())
    }

    fn check_saved(&self, saved: &ChainSaved<T>) -> Result<()> {
        if saved.chain != self.id {
            return Err(Error::invalid(
                "saved",
                "made by another ConvBnChain's new_saved",
            ));
        }
        Ok(())
    }

    fn check_backward_args(
        &self,
        a: &ChainBackwardArgs<'_, T>,
        saved: &ChainSaved<T>,
    ) -> Result<()> {
        let n = self.shapes.len();
        self.check_saved(saved)?;
        for (name, len) in [
            ("w", a.w.len()),
            ("gamma", a.gamma.len()),
            ("beta", a.beta.len()),
            ("dw", a.dw.len()),
            ("dgamma", a.dgamma.len()),
            ("dbeta", a.dbeta.len()),
        ] {
            if len != n {
                return Err(Error::invalid(name, format!("{len} entries for {n} units")));
            }
        }
        let adds = self.plan.last == Fuse::AddRelu;
        match (&a.d_addend, adds) {
            (AddendGrad::None, true) => Err(Error::invalid(
                "d_addend",
                "required by the last BatchNorm's Fuse::AddRelu (Into a buffer, or IntoDx)",
            )),
            (AddendGrad::Into(_) | AddendGrad::IntoDx, false) => Err(Error::invalid(
                "d_addend",
                "given, but the last BatchNorm does not add",
            )),
            (AddendGrad::IntoDx, true) if a.dx.is_none() => {
                Err(Error::invalid("d_addend", "IntoDx needs dx"))
            }
            (AddendGrad::IntoDx, true) if a.accumulate_dx => Err(Error::invalid(
                "accumulate_dx",
                "with AddendGrad::IntoDx the addend's gradient is written into dx first and \
                 the data gradient added onto it; a dx to add both onto is not supported",
            )),
            _ => Ok(()),
        }
    }

    /// Each unit a [`ConvBnTrain`] forward; the inner outputs into `saved.act`.
    fn forward_units(&self, a: &mut ChainArgs<'_, T>, saved: &mut ChainSaved<T>) -> Result<()> {
        let n = self.units.len();
        let ChainSaved { z, act, units, .. } = saved;
        for (i, unit) in self.units.iter().enumerate() {
            units[i] = None;
            let last = i + 1 == n;
            let (before, rest) = act.split_at_mut(i);
            let x = if i == 0 {
                a.x.slice(..)
            } else {
                before[i - 1].as_view()
            };
            let y = if last {
                a.y.slice_mut(..)
            } else {
                rest[0].as_view_mut()
            };
            let bn = &mut a.bn[i];
            units[i] = Some(unit.forward_train(ConvBnArgs {
                x,
                w: a.w[i].slice(..),
                z: z[i].as_view_mut(),
                addend: if last {
                    a.addend.as_ref().map(|v| v.slice(..))
                } else {
                    None
                },
                gamma: bn.gamma.slice(..),
                beta: bn.beta.slice(..),
                running_mean: bn.running_mean.slice_mut(..),
                running_var: bn.running_var.slice_mut(..),
                y,
                momentum: a.momentum,
                eps: a.eps,
            })?);
        }
        Ok(())
    }

    /// Each unit's [`ConvBnTrain::backward`], last first; the inner gradients through
    /// `saved.dact`.
    fn backward_units(
        &self,
        mut a: ChainBackwardArgs<'_, T>,
        saved: &mut ChainSaved<T>,
    ) -> Result<()> {
        let n = self.units.len();
        let ChainSaved {
            z,
            act,
            dact,
            units,
            dz,
            ..
        } = saved;
        let mut dx = a.dx.take();
        let into_dx = matches!(a.d_addend, AddendGrad::IntoDx);
        for i in (0..n).rev() {
            let last = i + 1 == n;
            let tsaved = units[i]
                .as_ref()
                .ok_or_else(|| Error::invalid("saved", "the forward did not finish"))?;
            let x = if i == 0 {
                a.x.slice(..)
            } else {
                act[i - 1].as_view()
            };
            let y = if last {
                a.y.slice(..)
            } else {
                act[i].as_view()
            };
            let (before, rest) = dact.split_at_mut(i);
            let dy = if last {
                a.dy.slice(..)
            } else {
                rest[0].as_view()
            };
            // With IntoDx the last unit writes the addend's gradient into dx; unit 0 (another
            // unit: a chain has at least two) then adds its data gradient onto it.
            let (d_addend, dx_i, acc) = if last {
                let d = match &mut a.d_addend {
                    AddendGrad::Into(v) => Some(v.slice_mut(..)),
                    AddendGrad::IntoDx => dx.as_mut().map(|d| d.slice_mut(..)),
                    AddendGrad::None => None,
                };
                (d, Some(before[i - 1].as_view_mut()), false)
            } else if i == 0 {
                (
                    None,
                    dx.as_mut().map(|d| d.slice_mut(..)),
                    a.accumulate_dx || into_dx,
                )
            } else {
                (None, Some(before[i - 1].as_view_mut()), false)
            };
            // Composed: the chain's state exposes every unit's dz (`ChainSaved::dz`), which the
            // folded backward does not write.
            self.units[i].backward_with(
                false,
                ConvBnBackwardArgs {
                    x,
                    w: a.w[i].slice(..),
                    z: z[i].as_view(),
                    y,
                    dy,
                    gamma: a.gamma[i].slice(..),
                    beta: a.beta[i].slice(..),
                    saved: tsaved,
                    dz: dz[i].as_view_mut(),
                    dx: dx_i,
                    accumulate_dx: acc,
                    dw: a.dw[i].slice_mut(..),
                    dgamma: a.dgamma[i].slice_mut(..),
                    dbeta: a.dbeta[i].slice_mut(..),
                    d_addend,
                },
            )?;
        }
        Ok(())
    }
}
