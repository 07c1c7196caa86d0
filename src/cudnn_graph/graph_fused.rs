//! [`GraphFused`]: one runtime-fusion pattern of the training block ([`FusedPattern`]: a
//! convolution with its output's per-channel sums from `GEN_STATS`, optionally with the previous
//! BatchNorm's scale, bias and ReLU on its input; the data gradient with that ReLU's and
//! BatchNorm's backward weights; the filter gradient with the same input prologue) as execution
//! plans: the heuristics' configs that the engine policy admits, finalized up to a limit, so that
//! the caller can measure them; cached per problem in the Context (as
//! [`super::graph_conv::GraphConv`]), with a pinned variant pack rebuilt only when a pointer or
//! the workspace changes. `block::ConvStats` runs [`FusedPattern::ConvGenStats`].

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::driver::CudaContext;

use crate::context::{Context, CudnnHandle};
use crate::dtype::DType;
use crate::error::{CallExt, Error, Result};
use crate::reference::conv::Conv2d as ConvShape;

use super::bn_build::BnVariantPack;
use super::build::{self, ExecutionPlan};
use super::descriptor::Descriptor;
use super::fusion::{self, FusionGraph, ReluAttrs};
use super::fusion_patterns::{dgrad_drelu_dbn_weight, wgrad_prologue, ConvGenStats, Prologue};
use super::notes::{admit, EngineInfo, GraphPolicy};
use super::plans::{self, handle_and_workspace, lock};

/// The tensors of a ConvStats execution, in the order [`GraphFused::execute`] takes their
/// addresses.
pub const GENSTATS_TENSORS: [&str; 5] = ["x", "w", "y", "sum", "sqsum"];
/// [`FusedPattern::ConvBnFprop`]'s tensors: x is the previous BatchNorm's input, `scale` and
/// `bias` (element type of x) its equivalent affine.
pub const FPROP_TENSORS: [&str; 7] = ["x", "scale", "bias", "w", "y", "sum", "sqsum"];
/// [`FusedPattern::DgradDreluDbnWeight`]'s tensors: `dy` the convolution's output gradient,
/// `x` the previous BatchNorm's input, `mean`, `inv_std`, `scale` (γ), `bias` (β) its f32
/// statistics and parameters; out `drelu` (x's shape and type), f32 `dscale`, `dbias` and the
/// coefficients of its data gradient `eq_scale_dy`, `eq_scale_x`, `eq_bias`.
pub const DGRAD_TENSORS: [&str; 13] = [
    "dy",
    "w",
    "x",
    "mean",
    "inv_std",
    "scale",
    "bias",
    "drelu",
    "dscale",
    "dbias",
    "eq_scale_dy",
    "eq_scale_x",
    "eq_bias",
];
/// [`FusedPattern::WgradPrologue`]'s tensors: x, `scale`, `bias` as for the forward, `dy`, out
/// `dw`.
pub const WGRAD_TENSORS: [&str; 5] = ["x", "scale", "bias", "dy", "dw"];

/// Which runtime-fusion pattern (docs/BLOCK-TRAINING.md §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FusedPattern {
    /// `conv_fprop → y → GEN_STATS` ([`GENSTATS_TENSORS`]).
    ConvGenStats,
    /// `relu(x · scale + bias) → conv_fprop → y → GEN_STATS` ("SBRCS", [`FPROP_TENSORS`]).
    ConvBnFprop,
    /// `dgrad → ReLU backward at the recomputed BatchNorm output → BN_BWD_WEIGHTS`
    /// ([`DGRAD_TENSORS`]).
    DgradDreluDbnWeight,
    /// `wgrad(dy, relu(x · scale + bias))` ([`WGRAD_TENSORS`]).
    WgradPrologue,
}

impl FusedPattern {
    /// The real tensors, in the order [`GraphFused::execute`] takes their addresses.
    pub fn tensors(self) -> &'static [&'static str] {
        match self {
            FusedPattern::ConvGenStats => &GENSTATS_TENSORS,
            FusedPattern::ConvBnFprop => &FPROP_TENSORS,
            FusedPattern::DgradDreluDbnWeight => &DGRAD_TENSORS,
            FusedPattern::WgradPrologue => &WGRAD_TENSORS,
        }
    }

    /// The tensors the graph writes (a subset of [`FusedPattern::tensors`]).
    pub fn outputs(self) -> &'static [&'static str] {
        match self {
            FusedPattern::ConvGenStats | FusedPattern::ConvBnFprop => &["y", "sum", "sqsum"],
            FusedPattern::DgradDreluDbnWeight => &[
                "drelu",
                "dscale",
                "dbias",
                "eq_scale_dy",
                "eq_scale_x",
                "eq_bias",
            ],
            FusedPattern::WgradPrologue => &["dw"],
        }
    }

    /// The name in logs and reasons.
    pub fn name(self) -> &'static str {
        match self {
            FusedPattern::ConvGenStats => "conv+GEN_STATS",
            FusedPattern::ConvBnFprop => "scale-bias-ReLU+conv+GEN_STATS",
            FusedPattern::DgradDreluDbnWeight => "dgrad+dReLU+BN backward weights",
            FusedPattern::WgradPrologue => "scale-bias-ReLU+wgrad",
        }
    }

    /// The graph of `shape` and `dtype` on `handle`. The prologue's scale and bias have the
    /// data's type (the form cuDNN 9.19 was probed with); ReLUs carry cudnn-frontend's
    /// attributes.
    fn build(
        self,
        shape: &ConvShape,
        dtype: DType,
        handle: cudarc::cudnn::sys::cudnnHandle_t,
    ) -> Result<FusionGraph> {
        let prologue = Prologue {
            affine: dtype,
            relu: ReluAttrs::Frontend,
        };
        let genstats = |prologue| ConvGenStats {
            shape: *shape,
            dtype,
            prologue,
            genstats_prec: DType::F32,
        };
        match self {
            FusedPattern::ConvGenStats => genstats(None).build(handle),
            FusedPattern::ConvBnFprop => genstats(Some(prologue)).build(handle),
            FusedPattern::DgradDreluDbnWeight => {
                dgrad_drelu_dbn_weight(handle, shape, dtype, ReluAttrs::Frontend)
            }
            FusedPattern::WgradPrologue => wgrad_prologue(handle, shape, dtype, prologue),
        }
    }
}

/// The plan-cache key: pattern, problem, element type, engine policy, most plans finalized.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FusedKey {
    /// Which graph.
    pub pattern: FusedPattern,
    /// The convolution (NHWC).
    pub shape: ConvShape,
    /// Element type of the activations and filters.
    pub dtype: DType,
    /// Which engines may run.
    pub policy: GraphPolicy,
    /// Most engine configs finalized (the first call measures them).
    pub limit: usize,
}

/// One finalized engine config.
#[derive(Debug)]
pub struct FusedPlan {
    /// The engine, its knobs and notes.
    pub info: EngineInfo,
    plan: ExecutionPlan,
    /// Host ms of the finalize.
    pub finalize_ms: f64,
    _config: Descriptor,
}

impl FusedPlan {
    /// Workspace bytes per execution.
    pub fn workspace(&self) -> usize {
        self.plan.workspace()
    }
}

/// The graph of one pattern and problem, and its finalized plans (see the module docs).
#[derive(Debug)]
pub struct GraphFused {
    /// Variant-pack order: for each real tensor of the graph, its unique id and its index in
    /// the pattern's [`FusedPattern::tensors`].
    order: Vec<(i64, usize)>,
    /// Bytes of each output (address index in the tensor list, bytes): zeroed first under
    /// compute-sanitizer ([`crate::config::under_sanitizer`]).
    outputs: Vec<(usize, usize)>,
    pattern: FusedPattern,
    plans: Vec<FusedPlan>,
    /// Configs listed but not finalized, and why.
    skipped: Vec<String>,
    listed: usize,
    /// The plan [`GraphFused::execute`] runs by default (the caller's measurement sets it).
    chosen: AtomicUsize,
    pack: Mutex<Option<BnVariantPack>>,
    handle: usize,
    /// Kept alive with the plans made from it: after `plans` (fields drop in order; it came
    /// first until the plans were seen to go after the graph they were made from).
    _graph: FusionGraph,
    /// The handle, destroyed after the plans and the graph.
    _handle: Arc<CudnnHandle>,
    _cuda: Arc<CudaContext>,
}

/// Bytes of a real tensor of the graph (its dimensions' product times its element size).
fn spec_bytes(spec: &super::fusion::FusionTensorSpec) -> Result<usize> {
    let elems = spec
        .dims
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(usize::try_from(d).ok()?))
        .ok_or_else(|| Error::invalid(spec.name, "tensor size overflows"))?;
    let size = match spec.elem {
        super::fusion::ElemType::Data(dt) => dt.size(),
        _ => 8,
    };
    elems
        .checked_mul(size)
        .ok_or_else(|| Error::invalid(spec.name, "tensor size overflows"))
}

/// Why cuDNN offers no plan for `key`: every listed config and the reason it was passed over.
fn none_runs(key: &FusedKey, listed: usize, skipped: &[String]) -> Error {
    Error::NotSupported(format!(
        "cuDNN graph {} {} {:?}: none of the {listed} engine configs listed \
         finalized under {:?}: [{}]",
        key.pattern.name(),
        key.dtype,
        key.shape,
        key.policy,
        skipped.join("; ")
    ))
}

impl GraphFused {
    /// Builds the graph of `key` on the Context's cuDNN handle, lists its engine configs
    /// (heuristics INSTANT, then FALLBACK), and finalizes those the policy admits, within the
    /// workspace cap, until `key.limit` have finalized. Errors: the graph cannot be built, or no
    /// config finalized ([`Error::NotSupported`] with every reason).
    pub fn new(ctx: &Context, key: FusedKey) -> Result<GraphFused> {
        ctx.refuse_under_capture("building a fused cuDNN graph", "finalize plans")?;
        build::available()?;
        let cap = ctx.config().cudnn_workspace_bytes();
        let mut g = ctx.lock()?;
        let owner = g.cudnn_owner()?;
        let handle = owner.raw();
        let started = Instant::now();
        let graph = key.pattern.build(&key.shape, key.dtype, handle)?;
        let configs = build::engine_configs(&graph.graph)?;
        let listed = configs.len();
        let mut plans = Vec::new();
        let mut skipped = Vec::new();
        for cfg in configs {
            if plans.len() >= key.limit.max(1) {
                skipped.push(format!("{}: beyond the first {}", cfg.info, key.limit));
                continue;
            }
            if let Err(r) = admit(&cfg.info, key.dtype, &key.policy) {
                skipped.push(format!("{}: {r}", cfg.info));
                continue;
            }
            let t = Instant::now();
            match ExecutionPlan::new(handle, &cfg.desc) {
                Ok(p) if p.workspace() > cap => skipped.push(format!(
                    "{}: workspace {} bytes above the cap of {cap}",
                    cfg.info,
                    p.workspace()
                )),
                Ok(plan) => plans.push(FusedPlan {
                    info: cfg.info,
                    plan,
                    finalize_ms: t.elapsed().as_secs_f64() * 1e3,
                    _config: cfg.desc,
                }),
                Err(e) => skipped.push(format!("{}: {e} ({})", cfg.info, build::last_message())),
            }
        }
        drop(g);
        if plans.is_empty() {
            return Err(none_runs(&key, listed, &skipped));
        }
        let mut order = Vec::new();
        let mut outputs = Vec::new();
        let names = key.pattern.tensors();
        for (uid, spec) in graph.pack_tensors() {
            let i = names.iter().position(|n| *n == spec.name).ok_or_else(|| {
                Error::invalid(spec.name, format!("not a tensor of {}", key.pattern.name()))
            })?;
            order.push((uid, i));
            if key.pattern.outputs().contains(&spec.name) {
                outputs.push((i, spec_bytes(&spec)?));
            }
        }
        if order.len() != names.len() {
            return Err(Error::NotSupported(format!(
                "cuDNN graph {}: {} real tensors, {} expected",
                key.pattern.name(),
                order.len(),
                names.len()
            )));
        }
        tracing::info!(
            pattern = key.pattern.name(),
            dtype = %key.dtype,
            shape = ?key.shape,
            listed,
            finalized = plans.len(),
            engines = ?plans.iter().map(|p| p.info.label()).collect::<Vec<_>>(),
            finalize_ms = ?plans.iter().map(|p| p.finalize_ms).collect::<Vec<_>>(),
            passed_over = ?skipped,
            build_ms = started.elapsed().as_secs_f64() * 1e3,
            "cuDNN fused-graph plans built"
        );
        Ok(GraphFused {
            _graph: graph,
            order,
            outputs,
            pattern: key.pattern,
            plans,
            skipped,
            listed,
            chosen: AtomicUsize::new(0),
            pack: Mutex::new(None),
            handle: handle as usize,
            _handle: owner,
            _cuda: ctx.cuda().clone(),
        })
    }

    /// The plans of `key` from the Context's plan cache, built on first use; a key cuDNN cannot
    /// run is remembered (later lookups return the same [`Error::NotSupported`] at once).
    pub fn cached(ctx: &Context, key: FusedKey) -> Result<Arc<GraphFused>> {
        plans::cached(
            ctx,
            key,
            || GraphFused::new(ctx, key),
            |e| {
                tracing::info!(pattern = key.pattern.name(), shape = ?key.shape,
                    dtype = %key.dtype, error = %e,
                    "cuDNN fused graph cannot run this problem; remembered");
            },
            || {},
        )
    }

    /// The finalized plans, in the heuristics' order.
    pub fn plans(&self) -> &[FusedPlan] {
        &self.plans
    }

    /// Configs the heuristics listed.
    pub fn listed(&self) -> usize {
        self.listed
    }

    /// The configs passed over, and why.
    pub fn skipped(&self) -> &[String] {
        &self.skipped
    }

    /// The plan that runs by default.
    pub fn chosen(&self) -> usize {
        self.chosen.load(Ordering::Relaxed)
    }

    /// Makes plan `i` the default (ignored when out of range).
    pub fn choose(&self, i: usize) {
        if i < self.plans.len() {
            self.chosen.store(i, Ordering::Relaxed);
        }
    }

    /// Runs plan `plan` (None: the chosen one) on the addresses of the pattern's
    /// [`FusedPattern::tensors`], in that order.
    ///
    /// # Safety
    /// The addresses are on the Context's device, 16-byte aligned, each holds its tensor (the
    /// problem's activations and filters of the key's element type, per-channel vectors as the
    /// tensor lists say), the outputs disjoint from each other and from the inputs, valid until
    /// the queued work completes.
    pub unsafe fn execute(&self, ctx: &Context, plan: Option<usize>, ptrs: &[u64]) -> Result<()> {
        if ptrs.len() != self.pattern.tensors().len() {
            return Err(Error::invalid(
                "ptrs",
                format!(
                    "{} addresses for {}'s {} tensors",
                    ptrs.len(),
                    self.pattern.name(),
                    self.pattern.tensors().len()
                ),
            ));
        }
        if crate::config::under_sanitizer() {
            // initcheck does not see cuDNN's stores on the H100: zero what the graph writes, so
            // that later reads of it are not reported (docs/RELIABILITY.md).
            let stream = ctx.stream().cu_stream();
            for &(i, bytes) in &self.outputs {
                // SAFETY: the caller's contract: each output holds its tensor's bytes.
                unsafe { cudarc::driver::result::memset_d8_async(ptrs[i], 0, bytes, stream) }
                    .call("cuMemsetD8Async")?;
            }
        }
        let i = plan.unwrap_or_else(|| self.chosen());
        let p = self
            .plans
            .get(i)
            .ok_or_else(|| Error::invalid("plan", format!("{i} of {}", self.plans.len())))?;
        let mut g = ctx.lock()?;
        let (handle, ws) = handle_and_workspace(&mut g, self.handle, p.plan.workspace())?;
        let mut pack = lock(&self.pack);
        let (uids, addrs): (Vec<i64>, Vec<u64>) =
            self.order.iter().map(|&(u, k)| (u, ptrs[k])).unzip();
        if pack.as_ref().is_none_or(|v| !v.matches(&addrs, ws)) {
            *pack = None;
            *pack = Some(fusion::variant_pack(&uids, &addrs, ws)?);
        }
        let Some(v) = pack.as_ref() else {
            return Err(Error::NotSupported("variant pack vanished".into()));
        };
        // SAFETY: the caller's contract; the handle is the plan's, under the Context's lock.
        unsafe { fusion::execute(handle, &p.plan, v) }
    }
}
