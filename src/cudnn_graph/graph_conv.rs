//! [`GraphConv`]: one convolution problem (shape, layout, element type, direction, engine
//! policy, pointer alignment) as a cuDNN execution plan — graph built, engine configs listed
//! (heuristics INSTANT then FALLBACK, de-duplicated, with notes), the first admitted config that
//! finalizes chosen — plus its pinned variant pack, checked execution on the Context's stream,
//! and the per-Context plan cache ([`GraphConv::cached`], [`run_cached`]).
//!
//! A cached call costs: the cache lookup, the argument checks, the Context's lock, and
//! `cudnnBackendExecute`; the variant pack is rebuilt only when a data pointer or the workspace
//! changed since the previous call.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, DevicePtr, DevicePtrMut};

use crate::context::{Context, CudnnHandle};
use crate::conv::Direction;
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::reference::conv::Conv2d as ConvShape;
use crate::validate::{expect_device, expect_len, expect_outputs_disjoint, BufInfo};

use super::build::{self, ExecutionPlan, GraphParts, VariantPack};
use super::descriptor::Descriptor;
use super::key::GraphConvKey;
use super::layout::{alignment_of, Operand};
use super::notes::{admit_conv, pass_over, EngineInfo, GraphLimits, GraphPolicy, HeurSource};
use super::plans::{self, handle_and_workspace, lock, Slot};
use super::replay::{self, Replayed, Replays};
use super::replay_rule::ReplayKey;

/// One engine config that was listed but not chosen, and why.
#[derive(Debug, Clone)]
pub struct Skipped {
    /// The config.
    pub engine: EngineInfo,
    /// The policy's reason, or the finalization error (with cuDNN's message).
    pub reason: String,
}

/// The pinned variant pack and the executions captured for replay (`replay.rs`).
#[derive(Debug, Default)]
struct PackState {
    pack: Option<VariantPack>,
    replays: Replays,
}

/// One convolution problem's execution plan through cuDNN's graph API (see the module docs).
#[derive(Debug)]
pub struct GraphConv {
    key: GraphConvKey,
    listed: Vec<EngineInfo>,
    skipped: Vec<Skipped>,
    chosen: EngineInfo,
    /// Before `plan`: its captured graphs go before the plan whose kernels they launch.
    pack: Mutex<PackState>,
    plan: ExecutionPlan,
    /// The handle the plan was built on (executions must use the same one).
    handle: usize,
    /// The chosen config and the graph, kept alive with the plan made from them.
    _config: Descriptor,
    _parts: Arc<GraphParts>,
    /// The handle, destroyed after the plan (fields drop in order).
    _handle: Arc<CudnnHandle>,
    /// Keeps the CUDA context alive until the plan is destroyed.
    _cuda: Arc<CudaContext>,
}

/// The operand names of `direction`'s two inputs and output, as the caller passes them.
pub const fn argument_names(direction: Direction) -> [&'static str; 3] {
    match direction {
        Direction::Forward => ["x", "w", "y"],
        Direction::BackwardData => ["dy", "w", "dx"],
        Direction::BackwardFilter => ["x", "dy", "dw"],
    }
}

/// Which [`Operand`] each caller argument (inputs `a`, `b`, output) is.
pub const fn argument_operands(direction: Direction) -> [Operand; 3] {
    match direction {
        Direction::Forward => [Operand::X, Operand::W, Operand::Y],
        Direction::BackwardData => [Operand::Y, Operand::W, Operand::X],
        Direction::BackwardFilter => [Operand::X, Operand::Y, Operand::W],
    }
}

/// Caller arguments `[a, b, out]` reordered into the variant pack's order `[x, w, y]`.
pub fn pack_order(direction: Direction, args: [u64; 3]) -> [u64; 3] {
    let mut out = [0u64; 3];
    for (arg, op) in args.iter().zip(argument_operands(direction)) {
        out[op as usize] = *arg;
    }
    out
}

/// Elements of each operand of `shape` (x, w, y).
fn operand_len(shape: &ConvShape, op: Operand) -> Result<usize> {
    Ok(match op {
        Operand::X => shape.x_len()?,
        Operand::W => shape.w_len()?,
        Operand::Y => shape.y_len()?,
    })
}

/// The error of a problem none of whose `listed` engine configs runs.
fn none_runs(version: usize, key: &GraphConvKey, listed: usize, skipped: &[Skipped]) -> Error {
    let why: Vec<String> = skipped
        .iter()
        .map(|s| format!("{}: {}", s.engine, s.reason))
        .collect();
    Error::NotSupported(format!(
        "cuDNN {version} graph API: none of the {listed} engine configs listed for {:?} {} {} \
         {:?} runs under {:?}: [{}]",
        key.shape,
        key.dtype,
        key.direction,
        key.alignment,
        key.policy,
        why.join("; ")
    ))
}

/// What [`GraphConv::admitted`] found: a plan per admitted engine config that finalized within
/// the workspace cap, every config passed over and why, and how many were listed.
#[derive(Debug)]
pub struct Admitted {
    /// The plans, in list order (heuristics INSTANT, then FALLBACK's new ones).
    pub plans: Vec<Arc<GraphConv>>,
    /// The configs passed over (policy, finalization, workspace, the limit).
    pub skipped: Vec<Skipped>,
    /// Configs the heuristics listed.
    pub listed: usize,
    /// Host ms of building the graph and listing its engine configs.
    pub listing_ms: f64,
    /// Host ms of each finalization tried (configs the policy refused cost none), in list
    /// order: the config's label and whether it became a plan.
    pub finalize_ms: Vec<(String, f64, bool)>,
}

/// Why a plan of `cfg` cannot serve: the policy's reason, the workspace cap, or the
/// finalization error (with cuDNN's message); the plan when it can.
fn try_plan(
    handle: cudarc::cudnn::sys::cudnnHandle_t,
    cfg: &build::EngineConfig,
    key: &GraphConvKey,
    cap: usize,
) -> std::result::Result<ExecutionPlan, String> {
    if let Err(r) = admit_conv(&cfg.info, key.dtype, key.direction, &key.policy) {
        return Err(r.to_string());
    }
    match ExecutionPlan::new(handle, &cfg.desc) {
        Ok(plan) if plan.workspace() > cap => Err(format!(
            "workspace {} bytes above the cap of {cap} (cudnn_workspace_mb)",
            plan.workspace()
        )),
        Ok(plan) => Ok(plan),
        Err(e) => Err(format!("{e} ({})", build::last_message())),
    }
}

/// [`try_plan`], with the host time of a finalization it tried added to `times` (a config the
/// policy refuses is not finalized and adds nothing).
fn timed_plan(
    handle: cudarc::cudnn::sys::cudnnHandle_t,
    cfg: &build::EngineConfig,
    key: &GraphConvKey,
    cap: usize,
    times: &mut Vec<(String, f64, bool)>,
) -> std::result::Result<ExecutionPlan, String> {
    if let Err(r) = admit_conv(&cfg.info, key.dtype, key.direction, &key.policy) {
        return Err(r.to_string());
    }
    let started = Instant::now();
    let plan = try_plan(handle, cfg, key, cap);
    times.push((
        cfg.info.label(),
        started.elapsed().as_secs_f64() * 1e3,
        plan.is_ok(),
    ));
    plan
}

impl GraphConv {
    /// Builds the plan of `key` on `ctx`: the graph, then, when `key.engine` is `None`, the
    /// engine list and the first admitted config that finalizes within the workspace cap
    /// ([`crate::Config::conv_workspace_mb`]); when it names a config, that config rebuilt from
    /// its index and knobs (admitted by the policy, finalized, within the cap).
    ///
    /// Errors: [`Error::LibraryMissing`] without cuDNN; [`Error::NotSupported`] when the loaded
    /// cuDNN is older than 9 or no listed engine config (or not the named one) can run the
    /// problem under the policy (the message lists each config and why); [`Error::Cudnn`] when
    /// a descriptor cannot be built (`NOT_SUPPORTED` statuses:
    /// [`Error::is_cudnn_not_supported`]).
    pub fn new(ctx: &Context, key: GraphConvKey) -> Result<GraphConv> {
        ctx.refuse_under_capture("building a cuDNN graph plan", "finalize a plan")?;
        let version = build::available()?;
        key.validate()?;
        let mut g = ctx.lock()?;
        let owner = g.cudnn_owner()?;
        let handle = owner.raw();
        let parts = Arc::new(GraphParts::build(handle, &key)?);
        let cap = ctx.config().cudnn_workspace_bytes();
        let (listed, skipped, cfg, plan) = match key.engine {
            Some(e) => {
                let desc = build::engine_config_of(&parts.graph, &e)?;
                let info = build::engine_info(&desc, HeurSource::Given, 0)?;
                let cfg = build::EngineConfig { desc, info };
                match try_plan(handle, &cfg, &key, cap) {
                    Ok(plan) => (vec![cfg.info.clone()], Vec::new(), cfg, plan),
                    Err(why) => {
                        return Err(Error::NotSupported(format!(
                            "cuDNN {version} graph API: engine config {} cannot run {:?} {} {}                              under {:?}: {why}",
                            cfg.info, key.shape, key.dtype, key.direction, key.policy
                        )))
                    }
                }
            }
            None => {
                let configs = build::engine_configs(&parts.graph)?;
                let listed: Vec<EngineInfo> = configs.iter().map(|c| c.info.clone()).collect();
                for e in &listed {
                    tracing::debug!(key = ?key, engine = %e, "cuDNN graph engine config listed");
                }
                let mut skipped = Vec::new();
                let mut found = None;
                for cfg in configs {
                    match try_plan(handle, &cfg, &key, cap) {
                        Ok(plan) => {
                            found = Some((cfg, plan));
                            break;
                        }
                        Err(reason) => skipped.push(Skipped {
                            engine: cfg.info,
                            reason,
                        }),
                    }
                }
                let Some((cfg, plan)) = found else {
                    return Err(none_runs(version, &key, listed.len(), &skipped));
                };
                (listed, skipped, cfg, plan)
            }
        };
        tracing::info!(
            direction = %key.direction,
            dtype = %key.dtype,
            shape = ?key.shape,
            engine = %cfg.info,
            workspace = plan.workspace(),
            listed = listed.len(),
            skipped = skipped.len(),
            "cuDNN graph plan built"
        );
        drop(g);
        Ok(GraphConv {
            key,
            listed,
            skipped,
            chosen: cfg.info,
            plan,
            pack: Mutex::new(PackState::default()),
            handle: handle as usize,
            _config: cfg.desc,
            _parts: parts,
            _handle: owner,
            _cuda: ctx.cuda().clone(),
        })
    }

    /// Every engine config of `key`'s problem that `auto` may measure: the heuristics' list
    /// (INSTANT, then FALLBACK's new ones), each config the policy admits finalized into a plan
    /// within the workspace cap, at most `limit` of them, on one graph. Each plan is also kept
    /// in the Context's plan cache under `key.with_engine(Some(config))`, so that the
    /// measurement and the calls after it run the same plan. `key.engine` is ignored.
    ///
    /// Errors: as [`GraphConv::new`]; none of the configs finalizing is not an error (empty
    /// `plans`, the reasons in `skipped`).
    pub fn admitted(ctx: &Context, key: GraphConvKey, limit: usize) -> Result<Admitted> {
        GraphConv::admitted_within(ctx, key, GraphLimits::at_most(limit), &|_| None)
    }

    /// [`GraphConv::admitted`] under a first call's limits: at most `limits` plans per list,
    /// and no config finalized once the deadline has passed (after the first plan); the configs
    /// passed over say why (the limit, the budget). The deadline is `deadline(listing)`, asked
    /// once the listing is done, so that the caller can leave out what the listing cost: a
    /// process's first listing creates the handle and loads cuDNN's engines (150–960 ms on the
    /// H100, more than a first call's whole budget), which once left it one config to measure.
    pub fn admitted_within(
        ctx: &Context,
        key: GraphConvKey,
        limits: GraphLimits,
        deadline: &dyn Fn(Duration) -> Option<Instant>,
    ) -> Result<Admitted> {
        // The listing's time counts from here: a process's first cuDNN call also creates the
        // handle (loading cuDNN), which once took a first call's whole budget before the list.
        let started = Instant::now();
        ctx.refuse_under_capture("building cuDNN graph plans", "finalize plans")?;
        build::available()?;
        let key = key.with_engine(None);
        key.validate()?;
        let cap = ctx.config().cudnn_workspace_bytes();
        let mut built = Vec::new();
        let mut skipped = Vec::new();
        let mut finalize_ms = Vec::new();
        let listed;
        let listing_ms;
        {
            let mut g = ctx.lock()?;
            let owner = g.cudnn_owner()?;
            let handle = owner.raw();
            let parts = Arc::new(GraphParts::build(handle, &key)?);
            let configs = build::engine_configs(&parts.graph)?;
            let listing = started.elapsed();
            listing_ms = listing.as_secs_f64() * 1e3;
            let deadline = deadline(listing);
            listed = configs.len();
            let all: Vec<EngineInfo> = configs.iter().map(|c| c.info.clone()).collect();
            let mut per_list = (0usize, 0usize);
            for cfg in configs {
                let out_of_time = deadline.is_some_and(|d| Instant::now() >= d);
                let passed = pass_over(&cfg.info, per_list, limits, out_of_time);
                let reason = match (cfg.info.engine(), passed) {
                    (None, _) => Some(format!(
                        "more than {} knob choices",
                        crate::conv::problem::MAX_GRAPH_KNOBS
                    )),
                    (Some(_), Some(why)) => Some(why),
                    (Some(e), None) => {
                        match timed_plan(handle, &cfg, &key, cap, &mut finalize_ms) {
                            Ok(plan) => {
                                match cfg.info.source {
                                    HeurSource::Fallback => per_list.1 += 1,
                                    _ => per_list.0 += 1,
                                }
                                built.push(GraphConv {
                                    key: key.with_engine(Some(e)),
                                    listed: all.clone(),
                                    skipped: Vec::new(),
                                    chosen: cfg.info.clone(),
                                    plan,
                                    pack: Mutex::new(PackState::default()),
                                    handle: handle as usize,
                                    _config: cfg.desc,
                                    _parts: parts.clone(),
                                    _handle: owner.clone(),
                                    _cuda: ctx.cuda().clone(),
                                });
                                continue;
                            }
                            Err(why) => Some(why),
                        }
                    }
                };
                if let Some(reason) = reason {
                    skipped.push(Skipped {
                        engine: cfg.info,
                        reason,
                    });
                }
            }
        }
        // The plan cache after the handle's lock (lock order: memo, then handle).
        let mut plans = Vec::with_capacity(built.len());
        for g in built {
            let k = g.key;
            let arc = Arc::new(g);
            let fresh = arc.clone();
            let slot = ctx.memo(k, move || Ok(Arc::new(Slot(Ok(fresh)))))?;
            plans.push(match &slot.0 {
                Ok(p) => p.clone(),
                Err(_) => arc,
            });
        }
        tracing::info!(
            direction = %key.direction,
            dtype = %key.dtype,
            shape = ?key.shape,
            listed,
            admitted = plans.len(),
            engines = ?plans.iter().map(|p| p.chosen.label()).collect::<Vec<_>>(),
            passed_over = ?skipped.iter().map(|s| format!("{}: {}", s.engine.label(), s.reason)).collect::<Vec<_>>(),
            listing_ms,
            finalize_ms = ?finalize_ms,
            "cuDNN graph engine configs prepared for measurement"
        );
        Ok(Admitted {
            plans,
            skipped,
            listed,
            listing_ms,
            finalize_ms,
        })
    }

    /// The plan of `key` from the Context's plan cache, built on first use. A key cuDNN cannot
    /// run is remembered too: later lookups return the same [`Error::NotSupported`] at once.
    pub fn cached(ctx: &Context, key: GraphConvKey) -> Result<Arc<GraphConv>> {
        plans::cached(
            ctx,
            key,
            || GraphConv::new(ctx, key),
            |e| {
                tracing::debug!(key = ?key, error = %e,
                    "cuDNN graph plan cannot be built; remembered");
            },
            || {
                tracing::trace!(engine = ?key.engine.map(|e| e.label()), direction = %key.direction,
                    "cuDNN graph plan cache hit");
            },
        )
    }

    /// The problem.
    pub fn key(&self) -> &GraphConvKey {
        &self.key
    }

    /// Every engine config the heuristics listed, in the order tried.
    pub fn listed(&self) -> &[EngineInfo] {
        &self.listed
    }

    /// The listed configs tried before the chosen one, and why each was passed over.
    pub fn skipped(&self) -> &[Skipped] {
        &self.skipped
    }

    /// The engine config that runs.
    pub fn chosen(&self) -> &EngineInfo {
        &self.chosen
    }

    /// The execution plan (benches: a bare `cudnnBackendExecute`).
    pub fn plan(&self) -> &ExecutionPlan {
        &self.plan
    }

    /// Workspace bytes per execution.
    pub fn workspace_bytes(&self) -> usize {
        self.plan.workspace()
    }

    /// Runs the plan on device addresses in the variant pack's order (x or dx, w or dw, y or
    /// dy), rebuilding the pack only when an address or the workspace changed.
    ///
    /// # Safety
    /// The addresses are on the Context's device, hold the problem's extents of the key's
    /// element type, are aligned to the key's alignment, the output is disjoint from the
    /// inputs, and all stay valid until the queued work completes.
    pub unsafe fn execute_raw(&self, ctx: &Context, ptrs: [u64; 3]) -> Result<()> {
        let ws_stage = crate::profile::enter(crate::profile::Stage::Workspace);
        let mut g = ctx.lock()?;
        let (handle, ws) = handle_and_workspace(&mut g, self.handle, self.plan.workspace())?;
        drop(ws_stage);
        let pack_stage = crate::profile::enter(crate::profile::Stage::Pack);
        let mut guard = lock(&self.pack);
        let PackState { pack, replays } = &mut *guard;
        let key = ReplayKey::new(&ptrs, ws, [0.0; 2]);
        let next = replay::before_execute(&g, replays, key.as_ref(), "convolution")?;
        if let Replayed::Done = next {
            return Ok(());
        }
        if pack.as_ref().is_none_or(|p| !p.matches(ptrs, ws)) {
            *pack = None;
            *pack = Some(VariantPack::new(ptrs, ws)?);
        }
        let Some(p) = pack.as_ref() else {
            return Err(Error::NotSupported("variant pack vanished".into()));
        };
        drop(pack_stage);
        // SAFETY: the caller's contract; the handle is the plan's, under the Context's lock, and
        // the only one the call uses.
        replay::finish(
            next,
            &mut g,
            handle,
            replays,
            key.as_ref(),
            "convolution",
            || build::execute(handle, &self.plan, p),
        )
    }

    /// Runs the plan on the caller's buffers: inputs `a`, `b` and output `out` are (x, w, y)
    /// forward, (dy, w, dx) for the data gradient, (x, dy, dw) for the filter gradient. Checks
    /// the element type, every length and device, the output's overlap with the inputs and the
    /// pointers' alignment before anything is queued; the output is overwritten.
    pub fn run<T, A, B, C>(&self, ctx: &Context, a: &A, b: &B, out: &mut C) -> Result<()>
    where
        T: Element,
        A: DevicePtr<T>,
        B: DevicePtr<T>,
        C: DevicePtrMut<T>,
    {
        let (shape, direction, dtype) = (&self.key.shape, self.key.direction, self.key.dtype);
        with_checked_ptrs(ctx, shape, direction, dtype, a, b, out, |ptrs| {
            let align = alignment_of(&ptrs);
            if align < self.key.alignment {
                return Err(Error::invalid(
                    argument_names(direction)[0],
                    format!(
                        "the operands are {align}-byte aligned; this plan was built for {}",
                        self.key.alignment
                    ),
                ));
            }
            // SAFETY: checked: device, lengths, disjoint output, alignment.
            unsafe { self.execute_raw(ctx, pack_order(direction, ptrs)) }
        })
    }
}

/// Checks `a`, `b`, `out` for `direction` of `shape` and calls `then` with their addresses
/// `[a, b, out]` while their stream guards live (so that cudarc records their use after the
/// work `then` queues).
#[allow(clippy::too_many_arguments)]
fn with_checked_ptrs<T, A, B, C, R>(
    ctx: &Context,
    shape: &ConvShape,
    direction: Direction,
    dtype: crate::dtype::DType,
    a: &A,
    b: &B,
    out: &mut C,
    then: impl FnOnce([u64; 3]) -> Result<R>,
) -> Result<R>
where
    T: Element,
    A: DevicePtr<T>,
    B: DevicePtr<T>,
    C: DevicePtrMut<T>,
{
    let names = argument_names(direction);
    if T::DTYPE != dtype {
        return Err(Error::invalid(
            names[0],
            format!("elements are {}, the plan is for {dtype}", T::DTYPE),
        ));
    }
    let ordinal = ctx.info().ordinal;
    let ops = argument_operands(direction);
    let lens = [a.len(), b.len(), out.len()];
    let devices = [
        a.stream().context().ordinal(),
        b.stream().context().ordinal(),
        out.stream().context().ordinal(),
    ];
    let mut infos = [BufInfo {
        name: "",
        ptr: 0,
        len: 0,
        elem: T::DTYPE.size(),
        ordinal,
    }; 3];
    for i in 0..3 {
        infos[i].name = names[i];
        infos[i].len = lens[i];
        infos[i].ordinal = devices[i];
        expect_device(&infos[i], ordinal)?;
        expect_len(
            &infos[i],
            operand_len(shape, ops[i])?,
            "the problem's extent",
        )?;
    }
    // Device pointers only after the device check (a foreign buffer's events would make the
    // Context's stream wait on another device).
    let stream = ctx.stream();
    let (pa, _ga) = a.device_ptr(stream);
    let (pb, _gb) = b.device_ptr(stream);
    let (po, _go) = out.device_ptr_mut(stream);
    infos[0].ptr = pa;
    infos[1].ptr = pb;
    infos[2].ptr = po;
    expect_outputs_disjoint(&[infos[2]], &infos[..2])?;
    then([pa, pb, po])
}

/// One cached call: checks the buffers, looks up (or builds) the plan of `shape`, `T`,
/// `direction` and `policy` for the buffers' pointer alignment, and runs it. Arguments as
/// [`GraphConv::run`].
pub fn run_cached<T, A, B, C>(
    ctx: &Context,
    shape: &ConvShape,
    direction: Direction,
    policy: GraphPolicy,
    a: &A,
    b: &B,
    out: &mut C,
) -> Result<()>
where
    T: Element,
    A: DevicePtr<T>,
    B: DevicePtr<T>,
    C: DevicePtrMut<T>,
{
    with_checked_ptrs(ctx, shape, direction, T::DTYPE, a, b, out, |ptrs| {
        let key = GraphConvKey::new(*shape, T::DTYPE, direction)
            .with_policy(policy)
            .with_alignment(alignment_of(&ptrs).max(T::DTYPE.size() as u8));
        let plan = GraphConv::cached(ctx, key)?;
        // SAFETY: checked; the key's alignment is the pointers' own.
        unsafe { plan.execute_raw(ctx, pack_order(direction, ptrs)) }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_map_to_the_pack_order() {
        assert_eq!(pack_order(Direction::Forward, [10, 20, 30]), [10, 20, 30]);
        // Data gradient: (dy, w, dx) -> (x = dx, w, y = dy).
        assert_eq!(
            pack_order(Direction::BackwardData, [10, 20, 30]),
            [30, 20, 10]
        );
        // Filter gradient: (x, dy, dw) -> (x, w = dw, y = dy).
        assert_eq!(
            pack_order(Direction::BackwardFilter, [10, 20, 30]),
            [10, 30, 20]
        );
        for d in Direction::ALL {
            let ops = argument_operands(d);
            // The output is the operand the direction writes.
            let written = match d {
                Direction::Forward => Operand::Y,
                Direction::BackwardData => Operand::X,
                Direction::BackwardFilter => Operand::W,
            };
            assert_eq!(ops[2], written);
            let mut seen = [false; 3];
            for o in ops {
                seen[o as usize] = true;
            }
            assert_eq!(seen, [true; 3]);
        }
    }
}
