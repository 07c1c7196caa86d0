//! [`GraphGenStats`]: one forward convolution whose output's per-channel sum and sum of squares
//! come out of the same cuDNN graph (`conv_fprop → y → GEN_STATS(SUM_SQSUM) → sum, sqsum`, the
//! [`ConvGenStats`] pattern without prologue) as execution plans: the heuristics' configs that
//! the engine policy admits, finalized up to a limit, so that the caller can measure them; cached
//! per problem in the Context (as [`super::graph_conv::GraphConv`]), with a pinned variant pack
//! rebuilt only when a pointer or the workspace changes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::driver::CudaContext;

use crate::context::Context;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::reference::conv::Conv2d as ConvShape;

use super::bn_build::BnVariantPack;
use super::build::{self, ExecutionPlan};
use super::descriptor::Descriptor;
use super::fusion::{self, FusionGraph};
use super::fusion_patterns::ConvGenStats;
use super::notes::{admit, EngineInfo, GraphPolicy};
use super::plans::{self, handle_and_workspace, lock};

/// The tensors of a ConvStats execution, in the order [`GraphGenStats::execute`] takes their
/// addresses.
pub const GENSTATS_TENSORS: [&str; 5] = ["x", "w", "y", "sum", "sqsum"];

/// The plan-cache key: problem, element type, engine policy, most plans finalized.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GenStatsKey {
    /// The convolution (NHWC).
    pub shape: ConvShape,
    /// Element type of x, w, y.
    pub dtype: DType,
    /// Which engines may run.
    pub policy: GraphPolicy,
    /// Most engine configs finalized (the first call measures them).
    pub limit: usize,
}

/// One finalized engine config.
#[derive(Debug)]
pub struct GenStatsPlan {
    /// The engine, its knobs and notes.
    pub info: EngineInfo,
    plan: ExecutionPlan,
    /// Host ms of the finalize.
    pub finalize_ms: f64,
    _config: Descriptor,
}

impl GenStatsPlan {
    /// Workspace bytes per execution.
    pub fn workspace(&self) -> usize {
        self.plan.workspace()
    }
}

/// The graph of one problem and its finalized plans (see the module docs).
#[derive(Debug)]
pub struct GraphGenStats {
    /// Kept alive with the plans made from it.
    _graph: FusionGraph,
    /// Variant-pack order: for each real tensor of the graph, its unique id and its index in
    /// [`GENSTATS_TENSORS`].
    order: Vec<(i64, usize)>,
    plans: Vec<GenStatsPlan>,
    /// Configs listed but not finalized, and why.
    skipped: Vec<String>,
    listed: usize,
    /// The plan [`GraphGenStats::execute`] runs by default (the caller's measurement sets it).
    chosen: AtomicUsize,
    pack: Mutex<Option<BnVariantPack>>,
    handle: usize,
    _cuda: Arc<CudaContext>,
}

/// Why cuDNN offers no plan for `key`: every listed config and the reason it was passed over.
fn none_runs(key: &GenStatsKey, listed: usize, skipped: &[String]) -> Error {
    Error::NotSupported(format!(
        "cuDNN graph conv+GEN_STATS {} {:?}: none of the {listed} engine configs listed \
         finalized under {:?}: [{}]",
        key.dtype,
        key.shape,
        key.policy,
        skipped.join("; ")
    ))
}

impl GraphGenStats {
    /// Builds the graph of `key` on the Context's cuDNN handle, lists its engine configs
    /// (heuristics INSTANT, then FALLBACK), and finalizes those the policy admits, within the
    /// workspace cap, until `key.limit` have finalized. Errors: the graph cannot be built, or no
    /// config finalized ([`Error::NotSupported`] with every reason).
    pub fn new(ctx: &Context, key: GenStatsKey) -> Result<GraphGenStats> {
        ctx.refuse_under_capture("building a conv+GEN_STATS graph", "finalize plans")?;
        build::available()?;
        let cap = ctx.config().cudnn_workspace_bytes();
        let mut g = ctx.lock()?;
        let handle = g.cudnn()?;
        let started = Instant::now();
        let graph = ConvGenStats {
            shape: key.shape,
            dtype: key.dtype,
            prologue: None,
            genstats_prec: DType::F32,
        }
        .build(handle)?;
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
                Ok(plan) => plans.push(GenStatsPlan {
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
        for (uid, spec) in graph.pack_tensors() {
            let i = GENSTATS_TENSORS
                .iter()
                .position(|n| *n == spec.name)
                .ok_or_else(|| Error::invalid(spec.name, "not a ConvStats tensor"))?;
            order.push((uid, i));
        }
        tracing::info!(
            dtype = %key.dtype,
            shape = ?key.shape,
            listed,
            finalized = plans.len(),
            engines = ?plans.iter().map(|p| p.info.label()).collect::<Vec<_>>(),
            finalize_ms = ?plans.iter().map(|p| p.finalize_ms).collect::<Vec<_>>(),
            passed_over = ?skipped,
            build_ms = started.elapsed().as_secs_f64() * 1e3,
            "cuDNN conv+GEN_STATS plans built"
        );
        Ok(GraphGenStats {
            _graph: graph,
            order,
            plans,
            skipped,
            listed,
            chosen: AtomicUsize::new(0),
            pack: Mutex::new(None),
            handle: handle as usize,
            _cuda: ctx.cuda().clone(),
        })
    }

    /// The plans of `key` from the Context's plan cache, built on first use; a key cuDNN cannot
    /// run is remembered (later lookups return the same [`Error::NotSupported`] at once).
    pub fn cached(ctx: &Context, key: GenStatsKey) -> Result<Arc<GraphGenStats>> {
        plans::cached(
            ctx,
            key,
            || GraphGenStats::new(ctx, key),
            |e| {
                tracing::info!(shape = ?key.shape, dtype = %key.dtype, error = %e,
                    "cuDNN conv+GEN_STATS graph cannot run this problem; remembered");
            },
            || {},
        )
    }

    /// The finalized plans, in the heuristics' order.
    pub fn plans(&self) -> &[GenStatsPlan] {
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

    /// Runs plan `plan` (None: the chosen one) on the addresses of [`GENSTATS_TENSORS`].
    ///
    /// # Safety
    /// The addresses are on the Context's device, 16-byte aligned, hold the problem's x, w, y
    /// (element type of the key) and `c_out` f32s for sum and sqsum, the outputs disjoint from
    /// each other and from the inputs, valid until the queued work completes.
    pub unsafe fn execute(&self, ctx: &Context, plan: Option<usize>, ptrs: [u64; 5]) -> Result<()> {
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
