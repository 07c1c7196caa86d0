//! The cuDNN graph path: its run function (a completed graph route onto the [`GraphConv`] plan
//! of the problem, direction, engine config and alignment class — the one the problem kept, else
//! the Context's plan cache — then the pinned variant pack and `cudnnBackendExecute`), the engine configs the `cudnn` candidate
//! stands for at the first call, and the check of a cached or tuning-file graph route (its
//! engine config rebuilt and finalized). The numerical check of f32 engine configs against a
//! true-f32 route is the measurement's (`choice`, driven by `decide`). The graph layer itself
//! is `crate::cudnn_graph`.

use super::call::{GraphPlanTag, PathCall, Target};
use super::choice::CudnnSearch;
use super::plan::{ConvPath, ConvPlan, Direction, Route};
use super::problem::{ConvShape, GraphEngine};
use super::route::Exec;
use super::state::Core;
use crate::config::Config;
use crate::context::Context;
use crate::cudnn_graph::graph_conv::{Admitted, GraphConv};
use crate::cudnn_graph::key::GraphConvKey;
use crate::cudnn_graph::layout::{alignment_of, MAX_ALIGNMENT};
use crate::cudnn_graph::notes::{GraphLimits, GraphPolicy};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tune::budget::Budget;

/// Most engine configs of the graph API that an exhaustive decision
/// ([`Config::conv_tune_budget_ms`] = 0) measures per problem and direction (the heuristics
/// list 3 to 40 on the H100; those the policy refuses do not count). A budgeted first call takes
/// [`GraphLimits::FIRST_CALL`]: the first 10 of the heuristics' and the fallback list's, without
/// cuDNN's reference engine.
pub const MAX_GRAPH_CANDIDATES: usize = 16;

/// Workspace above which a first call measures a graph engine config after the others
/// (nnfuse's own scratch cap by default, 256 MiB).
const LARGE_WORKSPACE: usize = 256 << 20;

/// The engine policy of `config`: true f32 (no TF32), f32 accumulation, deterministic engines
/// only under [`Config::deterministic`], and no run-time compilation (finalizing such an engine
/// takes ~1.5 s: a first call must not stall for it) unless the decision is exhaustive
/// ([`Config::conv_tune_budget_ms`] = 0, an explicit tuning run).
pub(crate) fn policy(config: &Config) -> GraphPolicy {
    GraphPolicy {
        deterministic: config.deterministic,
        allow_runtime_compilation: config.conv_tune_budget_ms == 0,
        ..GraphPolicy::default()
    }
}

/// How many engine configs a decision under `budget` finalizes.
fn limits(budget: &Budget) -> GraphLimits {
    if budget.exhaustive() {
        GraphLimits::at_most(MAX_GRAPH_CANDIDATES)
    } else {
        GraphLimits::FIRST_CALL
    }
}

/// The plan-cache key of `t`'s problem for direction `d`, engine config `engine`, pointers
/// aligned to `alignment` bytes, writing or accumulating.
pub(crate) fn key(
    t: &Target<'_>,
    d: Direction,
    engine: Option<GraphEngine>,
    alignment: u8,
    accumulate: bool,
) -> GraphConvKey {
    GraphConvKey::new(*t.shape, t.dtype, d)
        .with_policy(policy(t.ctx.config()))
        .with_alignment(alignment.max(t.dtype.size() as u8))
        .with_engine(engine)
        .with_accumulate(accumulate)
}

/// Runs a graph route (registered in `paths.rs`): the plan of its engine config (the first
/// admitted one when the route names none) for the pointers' alignment class. A dispatcher's
/// call takes the plan its problem kept for the same Context, engine config, alignment class and
/// accumulation ([`GraphPlans`](super::call::GraphPlans)); otherwise (first call, another
/// alignment class or engine config, the measurement) it looks the plan up in the Context's plan
/// cache, building it on first use, and the problem keeps it.
///
/// # Safety
/// As [`super::route::run`].
pub(crate) unsafe fn raw_run(c: &PathCall<'_>) -> Result<()> {
    let t = c.target;
    let p = c.ptrs;
    // The variant pack's order is cuDNN's roles: x (or dx), w (or dw), y (or dy).
    let ptrs = [p.x, p.w, p.y];
    let plan = {
        crate::profile::stage!(Lookup);
        let tag = GraphPlanTag {
            ctx: GraphPlanTag::context_id(t.ctx),
            engine: c.exec.route.graph_engine,
            alignment: alignment_of(&ptrs).max(t.dtype.size() as u8),
            accumulate: c.accumulate,
        };
        let kept = t.graph_plans.map(|all| &all[c.direction.index()]);
        match kept.and_then(|k| k.get(&tag)) {
            Some(plan) => plan,
            None => {
                let k = key(t, c.direction, tag.engine, tag.alignment, tag.accumulate);
                let plan = GraphConv::cached(t.ctx, k)?;
                if let Some(kept) = kept {
                    kept.keep(tag, plan.clone());
                }
                plan
            }
        }
    };
    // SAFETY: the caller's contract (operands checked, on the Context's device, output
    // disjoint); the plan's key has the pointers' own alignment class.
    unsafe { plan.execute_raw(t.ctx, ptrs) }
}

/// Runs direction `d` of a problem derived from the caller's (the dual path's dual problem,
/// the tiled path's tiled one: `shape`, in `dtype`) on `ptrs` in cuDNN's roles (x or dx, w or
/// dw, y or dy), through the Context's plan cache: engine config `engine` (`None`: the first
/// the policy admits), adding into the output when `accumulate`. The key has the pointers'
/// alignment class.
///
/// # Safety
/// `ptrs` hold `shape`'s extents of `dtype` on the Context's device, the output disjoint from
/// the inputs, all valid until the queued work completes.
pub(super) unsafe fn execute_derived(
    ctx: &Context,
    (shape, dtype): (&ConvShape, DType),
    d: Direction,
    engine: Option<GraphEngine>,
    ptrs: [u64; 3],
    accumulate: bool,
) -> Result<()> {
    let target = Target {
        ctx,
        shape,
        dtype,
        cudnn: None,
        graph_plans: None,
    };
    let alignment = alignment_of(&ptrs).max(dtype.size() as u8);
    let plan = GraphConv::cached(ctx, key(&target, d, engine, alignment, accumulate))?;
    // SAFETY: the caller's contract; the plan's key has the pointers' alignment class.
    unsafe { plan.execute_raw(ctx, ptrs) }
}

/// The engine configs the plan's `cudnn` candidate of `core`'s problem stands for through the
/// graph API, as routes ([`engine_execs`]). `None` when the candidate goes through the legacy
/// API (the plan's [`ConvPlan::cudnn_graph`] is false, or the search is cuDNN's Find, which only
/// the legacy API has) or no config finalized: the caller then measures the legacy algorithms.
pub(super) fn candidates(
    core: &Core,
    ctx: &Context,
    plan: &ConvPlan,
    budget: &Budget,
    notes: &mut Vec<String>,
) -> Option<Vec<Exec>> {
    if !plan.cudnn_graph || core.search == CudnnSearch::Find {
        return None;
    }
    let target = core.target(ctx);
    let execs = engine_execs(&target, plan.direction, budget, notes);
    if execs.is_empty() {
        tracing::warn!(direction = %plan.direction, problem = ?target.shape,
            dtype = %target.dtype, notes = ?notes,
            "no cuDNN graph engine config finalizes; the legacy cuDNN algorithms are measured");
        notes.push(
            "no cuDNN graph engine config finalizes for this problem: the legacy algorithms \
             are measured instead"
                .into(),
        );
    }
    (!execs.is_empty()).then_some(execs)
}

/// The engine configs the graph API admits for direction `d` of `t`'s problem, as routes (each
/// plan finalized and cached now, within `budget`'s limits and deadline); notes on the configs
/// passed over, or on why none could be listed, go to `notes`.
pub(super) fn engine_execs(
    t: &Target<'_>,
    d: Direction,
    budget: &Budget,
    notes: &mut Vec<String>,
) -> Vec<Exec> {
    // Finalizing counts against the decision budget (it began with the decision); loading
    // cuDNN's engines at the process's first listing does not.
    let admitted = GraphConv::admitted_within(
        t.ctx,
        key(t, d, None, MAX_ALIGNMENT, false),
        limits(budget),
        &|listing| budget.past_library_start(listing).deadline(),
    );
    match admitted {
        Ok(a) => {
            notes.push(finalize_note(&a));
            if !a.skipped.is_empty() {
                notes.push(format!(
                    "cudnn_graph: {} of {} listed engine configs passed over: {}",
                    a.skipped.len(),
                    a.listed,
                    a.skipped
                        .iter()
                        .map(|s| format!("{}: {}", s.engine.label(), s.reason))
                        .collect::<Vec<_>>()
                        .join("; ")
                ));
            }
            routes_of(&a.plans, !budget.exhaustive())
        }
        Err(e) => {
            notes.push(format!("cudnn_graph: {e}"));
            Vec::new()
        }
    }
}

/// The admitted plans as routes, in cuDNN's order; `large_last`: a config whose workspace is
/// large (FFT engines, 0.4-2.3 GB) after the others (stable), since its first run grows the
/// Context's workspace, which cost a first call 16 ms on the H100 and left the fastest config
/// (7th, from the fallback list) unmeasured.
fn routes_of(plans: &[std::sync::Arc<GraphConv>], large_last: bool) -> Vec<Exec> {
    let mut plans: Vec<_> = plans.iter().collect();
    if large_last {
        plans.sort_by_key(|p| p.workspace_bytes() > LARGE_WORKSPACE);
    }
    plans
        .iter()
        .filter_map(|p| p.key().engine)
        .map(|e| Exec {
            route: Route::graph(e),
            cudnn_ws: 0,
            winograd: None,
        })
        .collect()
}

/// The engine configs of direction `d` that a budgeted first call passed over for its admission
/// limit ([`GraphLimits::FIRST_CALL`]), as routes: the graph API's list admitted again up to
/// [`GraphLimits::LATER_CALL`] (cuDNN's reference engine out; the first call's configs are
/// finalized again, under 0.1 ms each, and their cached plans kept) less the configs in
/// `known`. Measured by a later call against the
/// decided route (`Conv2d::settle`), so that the first call keeps its budget and the decision
/// still sees what `cudnn.benchmark` would. Empty when nothing more is admitted.
pub(super) fn more_engine_execs(
    t: &Target<'_>,
    d: Direction,
    known: &[Exec],
    budget: &Budget,
) -> Vec<Exec> {
    let admitted = GraphConv::admitted_within(
        t.ctx,
        key(t, d, None, MAX_ALIGNMENT, false),
        GraphLimits::LATER_CALL,
        &|listing| budget.past_library_start(listing).deadline(),
    );
    match admitted {
        Ok(a) => routes_of(&a.plans, true)
            .into_iter()
            .filter(|e| !known.iter().any(|k| k.route == e.route))
            .collect(),
        Err(e) => {
            tracing::debug!(direction = %d, error = %e,
                "cudnn_graph: no more engine configs listed for a later look");
            Vec::new()
        }
    }
}

/// Whether a budgeted decision's graph candidates filled the first call's admission limit:
/// the graph API may list more configs, for a later call to measure. Pure.
pub(super) fn first_call_limit_reached(execs: &[Exec], exhaustive: bool) -> bool {
    let graph = execs
        .iter()
        .filter(|e| e.route.path == ConvPath::CudnnGraph)
        .count();
    !exhaustive && graph >= GraphLimits::FIRST_CALL.total
}

/// Where a first call's host time before measuring went: the listing, then the finalizations
/// (engines differ by 100x here, and a first call's budget pays for every one).
fn finalize_note(a: &Admitted) -> String {
    let total: f64 = a.finalize_ms.iter().map(|t| t.1).sum();
    let slowest = a
        .finalize_ms
        .iter()
        .max_by(|x, y| x.1.total_cmp(&y.1))
        .map(|(label, ms, ok)| {
            let outcome = if *ok { "" } else { ", not admitted" };
            format!("; slowest {label} {ms:.1} ms{outcome}")
        })
        .unwrap_or_default();
    format!(
        "cudnn_graph: listing {:.1} ms; {} finalizations {total:.1} ms{slowest}",
        a.listing_ms,
        a.finalize_ms.len()
    )
}

/// Whether a cached or tuning-file graph route fits `plan` and still runs here: the plan's
/// `cudnn` candidate goes through the graph API, the route names an engine config, and that
/// config rebuilt for this problem finalizes under the policy and the workspace cap (its plan
/// is then cached). A config that no longer finalizes is said with a warning (the problem is
/// measured again).
pub(super) fn fits(t: &Target<'_>, plan: &ConvPlan, r: &Route, search: CudnnSearch) -> bool {
    let Some(engine) = r.graph_engine else {
        return false;
    };
    let cudnn = plan.candidates.iter().any(|c| c.path == ConvPath::Cudnn);
    if r.path != ConvPath::CudnnGraph || !plan.cudnn_graph || !cudnn || search == CudnnSearch::Find
    {
        return false;
    }
    let k = key(t, plan.direction, Some(engine), MAX_ALIGNMENT, false);
    match GraphConv::cached(t.ctx, k) {
        Ok(_) => true,
        Err(e) => {
            tracing::warn!(engine = %engine, direction = %plan.direction, problem = ?t.shape,
                error = %e,
                "the stored cuDNN graph engine config no longer finalizes; measuring again");
            false
        }
    }
}

/// The error of a route that names a graph engine config on a path that takes none (the graph
/// and tiled paths take one: `choice::names_graph_engine`).
pub(super) fn misplaced(r: &Route) -> Option<Error> {
    (r.graph_engine.is_some() && !super::choice::names_graph_engine(r.path)).then(|| {
        Error::invalid(
            "route",
            "only a cudnn_graph or cudnn_tiled route names a cuDNN graph engine config",
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exec(route: Route) -> Exec {
        Exec {
            route,
            cudnn_ws: 0,
            winograd: None,
        }
    }

    #[test]
    fn a_later_look_follows_a_full_first_call_admission_only() {
        let graph = |i| exec(Route::graph(GraphEngine::new(i, &[]).unwrap()));
        let mut execs: Vec<Exec> = (0..9).map(graph).collect();
        execs.push(exec(Route::path(ConvPath::Im2colGemm)));
        assert!(!first_call_limit_reached(&execs, false), "9 graph configs");
        execs.push(graph(9));
        assert!(first_call_limit_reached(&execs, false), "10 graph configs");
        assert!(!first_call_limit_reached(&execs, true), "an exhaustive decision saw them all");
    }
}
