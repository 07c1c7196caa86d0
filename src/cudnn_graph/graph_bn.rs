//! [`GraphBn`]: one BatchNorm problem (layout, element type, direction, epilogue,
//! running-statistics update, pointer alignment, engine policy) as a cuDNN execution plan — graph built, engine
//! configs listed (heuristics INSTANT then FALLBACK, de-duplicated), the first config the
//! policy admits that finalizes chosen — with its pinned variant pack and the per-Context plan
//! cache ([`GraphBn::cached`]).
//!
//! A cached call costs the cache lookup, the Context's lock, writing the two scalars, and
//! `cudnnBackendExecute`; the variant pack is rebuilt only when a pointer or the workspace
//! changed since the previous call. The caller (the BatchNorm dispatcher) has validated every
//! buffer; this layer takes raw addresses.

use std::sync::{Arc, Mutex};

use cudarc::cudnn::sys;
use cudarc::driver::CudaContext;

use crate::context::{Context, CudnnHandle};
use crate::error::{Error, Result};

use super::bn_build::{BnGraphParts, BnVariantPack};
use super::bn_key::{BnDirection, BnRole, GraphBnKey, MAX_PACK_ROLES};
use super::build::{self, ExecutionPlan};
use super::descriptor::{check, Descriptor};
use super::graph_conv::Skipped;
use super::notes::{admit, EngineInfo};
use super::plans::{self, handle_and_workspace, lock};
use super::replay::{self, Replayed, Replays};
use super::replay_rule::ReplayKey;

/// The by-value scalars of a forward, at a fixed host address for the variant pack (cuDNN reads
/// them when the plan is executed).
#[derive(Debug, Default)]
#[repr(C, align(16))]
struct Scalars {
    eps: f32,
    momentum: f32,
    /// The ReLU mask's comparand (`CMP_GT(y, 0)`), always 0.
    zero: f32,
}

/// The pack and the scalars it points to, changed together under one lock.
#[derive(Debug)]
struct PackState {
    pack: Option<BnVariantPack>,
    scalars: Box<Scalars>,
    /// Executions captured for replay (`replay.rs`).
    replays: Replays,
}

/// Device addresses of a training forward (the running statistics are updated in place: the
/// same buffer is the update's input and output).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BnFwdAddrs {
    /// x.
    pub x: u64,
    /// gamma.
    pub scale: u64,
    /// beta.
    pub bias: u64,
    /// Running mean (read and written).
    pub running_mean: u64,
    /// Running variance (read and written).
    pub running_var: u64,
    /// Saved batch mean (written).
    pub saved_mean: u64,
    /// Saved inverse standard deviation (written).
    pub saved_inv_var: u64,
    /// y (written).
    pub y: u64,
    /// The addend of an Add+ReLU epilogue (0 without one).
    pub addend: u64,
    /// The ReLU mask the epilogue writes (`BOOLEAN`, x's element count; 0 without one).
    pub mask: u64,
}

/// Device addresses of an inference forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BnInferAddrs {
    /// x.
    pub x: u64,
    /// gamma.
    pub scale: u64,
    /// beta.
    pub bias: u64,
    /// Running mean.
    pub mean: u64,
    /// `1 / sqrt(running_var + eps)`, one f32 per channel.
    pub inv_std: u64,
    /// y (written).
    pub y: u64,
    /// The addend of an Add+ReLU epilogue (0 without one).
    pub addend: u64,
}

/// Device addresses of a backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BnBwdAddrs {
    /// x.
    pub x: u64,
    /// The gradient entering BatchNorm.
    pub dy: u64,
    /// gamma.
    pub scale: u64,
    /// Saved batch mean.
    pub saved_mean: u64,
    /// Saved inverse standard deviation.
    pub saved_inv_var: u64,
    /// dgamma (written).
    pub dscale: u64,
    /// dbeta (written).
    pub dbias: u64,
    /// dx (written).
    pub dx: u64,
    /// The forward's y (read by the `RELU_BWD`-from-y form's backward; 0 otherwise).
    pub y: u64,
    /// The forward's ReLU mask (read by the mask form's backward; 0 otherwise).
    pub mask: u64,
    /// The addend's gradient (written by an Add+ReLU epilogue's backward; 0 without one).
    pub daddend: u64,
}

/// One BatchNorm problem's execution plan through cuDNN's graph API (see the module docs).
#[derive(Debug)]
pub struct GraphBn {
    key: GraphBnKey,
    uids: Vec<i64>,
    listed: Vec<EngineInfo>,
    skipped: Vec<Skipped>,
    chosen: EngineInfo,
    /// Before `plan`: its captured graphs go before the plan whose kernels they launch.
    state: Mutex<PackState>,
    plan: ExecutionPlan,
    /// The handle the plan was built on (executions must use the same one).
    handle: usize,
    /// The chosen config and the graph, kept alive with the plan made from them.
    _config: Descriptor,
    _parts: BnGraphParts,
    /// The handle, destroyed after the plan (fields drop in order).
    _handle: Arc<CudnnHandle>,
    /// Keeps the CUDA context alive until the plan is destroyed.
    _cuda: Arc<CudaContext>,
}

impl GraphBn {
    /// Builds the plan of `key` on `ctx`: the graph, the heuristics' engine configs, and the
    /// first config the key's policy admits whose plan finalizes (cuDNN's BatchNorm engines
    /// compile at run time: a policy that refuses run-time compilation typically finds none).
    ///
    /// Errors: [`Error::LibraryMissing`] without cuDNN; [`Error::NotSupported`] for a cuDNN
    /// older than 9 or when no config runs the problem (each config and why listed);
    /// [`Error::Cudnn`] when a descriptor cannot be built (naming the descriptor or attribute).
    pub fn new(ctx: &Context, key: GraphBnKey) -> Result<GraphBn> {
        ctx.refuse_under_capture("building a cuDNN BatchNorm graph plan", "finalize a plan")?;
        let version = build::available()?;
        key.validate()?;
        let mut g = ctx.lock()?;
        let owner = g.cudnn_owner()?;
        let handle = owner.raw();
        let parts = BnGraphParts::build(handle, &key)?;
        let configs = build::engine_configs(&parts.graph)?;
        let listed: Vec<EngineInfo> = configs.iter().map(|c| c.info.clone()).collect();
        let mut skipped = Vec::new();
        let mut found = None;
        for cfg in configs {
            tracing::debug!(key = ?key, engine = %cfg.info, "cuDNN BatchNorm engine config listed");
            if let Err(r) = admit(&cfg.info, key.dtype, &key.policy) {
                skipped.push(Skipped {
                    engine: cfg.info,
                    reason: r.to_string(),
                });
                continue;
            }
            match ExecutionPlan::new(handle, &cfg.desc) {
                Ok(plan) => {
                    found = Some((cfg, plan));
                    break;
                }
                Err(e) => skipped.push(Skipped {
                    engine: cfg.info,
                    reason: format!("{e} ({})", build::last_message()),
                }),
            }
        }
        let Some((cfg, plan)) = found else {
            let why: Vec<String> = skipped
                .iter()
                .map(|s| format!("{}: {}", s.engine, s.reason))
                .collect();
            return Err(Error::NotSupported(format!(
                "cuDNN {version} graph API: none of the {} engine configs listed for BatchNorm \
                 {} (epilogue {}{}) {} {} under {:?} runs: [{}]",
                listed.len(),
                key.direction.name(),
                key.epilogue.name(),
                if key.has_relu_grad() {
                    format!(", relu backward {}", key.relu_grad.name())
                } else {
                    String::new()
                },
                key.layout,
                key.dtype,
                key.policy,
                why.join("; ")
            )));
        };
        tracing::info!(
            direction = key.direction.name(),
            epilogue = key.epilogue.name(),
            dtype = %key.dtype,
            layout = %key.layout,
            engine = %cfg.info,
            workspace = plan.workspace(),
            listed = listed.len(),
            skipped = skipped.len(),
            "cuDNN BatchNorm graph plan built"
        );
        drop(g);
        Ok(GraphBn {
            uids: key.uids(),
            key,
            listed,
            skipped,
            chosen: cfg.info,
            plan,
            state: Mutex::new(PackState {
                pack: None,
                scalars: Box::default(),
                replays: Replays::default(),
            }),
            handle: handle as usize,
            _config: cfg.desc,
            _parts: parts,
            _handle: owner,
            _cuda: ctx.cuda().clone(),
        })
    }

    /// The plan of `key` from the Context's plan cache (bounded LRU,
    /// `NNFUSE_PLAN_CACHE_CAPACITY`), built on first use. A key cuDNN cannot run is remembered
    /// too: later lookups return the same [`Error::NotSupported`] at once.
    ///
    /// Must not be called while the caller holds the Context's memo (lock order: memo, then
    /// the handle).
    pub fn cached(ctx: &Context, key: GraphBnKey) -> Result<Arc<GraphBn>> {
        plans::cached(
            ctx,
            key,
            || GraphBn::new(ctx, key),
            |e| {
                tracing::info!(key = ?key, error = %e,
                    "cuDNN BatchNorm graph plan cannot be built; remembered");
            },
            || {
                tracing::trace!(
                    direction = key.direction.name(),
                    epilogue = key.epilogue.name(),
                    "cuDNN BatchNorm graph plan cache hit"
                );
            },
        )
    }

    /// The problem.
    pub fn key(&self) -> &GraphBnKey {
        &self.key
    }

    /// Every engine config the heuristics listed.
    pub fn listed(&self) -> &[EngineInfo] {
        &self.listed
    }

    /// The configs passed over before the chosen one, and why.
    pub fn skipped(&self) -> &[Skipped] {
        &self.skipped
    }

    /// The engine config that runs.
    pub fn chosen(&self) -> &EngineInfo {
        &self.chosen
    }

    /// Workspace bytes per execution.
    pub fn workspace_bytes(&self) -> usize {
        self.plan.workspace()
    }

    /// Runs the forward plan.
    ///
    /// # Safety
    /// Every address is on the Context's device, holds its tensor's extent for the key (x and y:
    /// the layout's elements of the key's type; the rest one f32 per channel), is aligned to the
    /// key's alignment; outputs do not overlap inputs (the running statistics excepted: updated
    /// in place); all stay valid until the queued work completes.
    pub unsafe fn forward(
        &self,
        ctx: &Context,
        a: &BnFwdAddrs,
        eps: f64,
        momentum: f64,
    ) -> Result<()> {
        if self.key.direction != BnDirection::Forward {
            return Err(Error::invalid("plan", "is not a training forward plan"));
        }
        let addr = |r: BnRole| match r {
            BnRole::X => a.x,
            BnRole::Scale => a.scale,
            BnRole::Bias => a.bias,
            BnRole::RunningMeanIn | BnRole::RunningMeanOut => a.running_mean,
            BnRole::RunningVarIn | BnRole::RunningVarOut => a.running_var,
            BnRole::SavedMean => a.saved_mean,
            BnRole::SavedInvVar => a.saved_inv_var,
            BnRole::Y => a.y,
            BnRole::Addend => a.addend,
            BnRole::Mask => a.mask,
            _ => 0,
        };
        self.execute(ctx, addr, Some((eps as f32, momentum as f32)))
    }

    /// Runs the inference plan (no scalars: the inverse standard deviation already holds eps).
    ///
    /// # Safety
    /// As [`GraphBn::forward`], for the inference's tensors.
    pub unsafe fn inference(&self, ctx: &Context, a: &BnInferAddrs) -> Result<()> {
        if self.key.direction != BnDirection::Inference {
            return Err(Error::invalid("plan", "is not an inference plan"));
        }
        let addr = |r: BnRole| match r {
            BnRole::X => a.x,
            BnRole::Scale => a.scale,
            BnRole::Bias => a.bias,
            BnRole::Mean => a.mean,
            BnRole::InvStd => a.inv_std,
            BnRole::Y => a.y,
            BnRole::Addend => a.addend,
            _ => 0,
        };
        self.execute(ctx, addr, None)
    }

    /// Runs the backward plan.
    ///
    /// # Safety
    /// As [`GraphBn::forward`], for the backward's tensors.
    pub unsafe fn backward(&self, ctx: &Context, a: &BnBwdAddrs) -> Result<()> {
        if self.key.direction != BnDirection::Backward {
            return Err(Error::invalid("plan", "is not a backward plan"));
        }
        let addr = |r: BnRole| match r {
            BnRole::X => a.x,
            BnRole::Dy => a.dy,
            BnRole::Scale => a.scale,
            BnRole::SavedMean => a.saved_mean,
            BnRole::SavedInvVar => a.saved_inv_var,
            BnRole::Dscale => a.dscale,
            BnRole::Dbias => a.dbias,
            BnRole::Dx => a.dx,
            BnRole::Y => a.y,
            BnRole::Mask => a.mask,
            BnRole::DAddend => a.daddend,
            _ => 0,
        };
        self.execute(ctx, addr, None)
    }

    /// Fills the pack's pointers in role order (by-value scalars: the addresses of the plan's
    /// own scalar cells, written first), then replays the execution when it repeats one
    /// (`replay.rs`), else rebuilds the pack if any pointer changed and executes (capturing it
    /// at its second call with the same key).
    unsafe fn execute(
        &self,
        ctx: &Context,
        addr: impl Fn(BnRole) -> u64,
        scalars: Option<(f32, f32)>,
    ) -> Result<()> {
        let ws_stage = crate::profile::enter(crate::profile::Stage::Workspace);
        let mut g = ctx.lock()?;
        let (handle, ws) = handle_and_workspace(&mut g, self.handle, self.plan.workspace())?;
        drop(ws_stage);
        let pack_stage = crate::profile::enter(crate::profile::Stage::Pack);
        let mut guard = lock(&self.state);
        let PackState {
            pack,
            scalars: cells,
            replays,
        } = &mut *guard;
        if let Some((eps, momentum)) = scalars {
            cells.eps = eps;
            cells.momentum = momentum;
        }
        cells.zero = 0.0;
        let eps_at = &cells.eps as *const f32 as u64;
        let momentum_at = &cells.momentum as *const f32 as u64;
        let zero_at = &cells.zero as *const f32 as u64;
        // At most MAX_PACK_ROLES tensors: a fixed array, no allocation per call.
        let mut ptrs = [0u64; MAX_PACK_ROLES];
        let roles = self.key.roles();
        for (p, &r) in ptrs.iter_mut().zip(roles) {
            *p = match r {
                BnRole::Epsilon => eps_at,
                BnRole::Momentum => momentum_at,
                BnRole::Zero => zero_at,
                _ => addr(r),
            };
        }
        let ptrs = &ptrs[..roles.len()];
        let key = ReplayKey::new(ptrs, ws, [f64::from(cells.eps), f64::from(cells.momentum)]);
        let next = replay::before_execute(&g, replays, key.as_ref(), "BatchNorm")?;
        if let Replayed::Done = next {
            return Ok(());
        }
        if pack.as_ref().is_none_or(|p| !p.matches(ptrs, ws)) {
            *pack = None;
            *pack = Some(BnVariantPack::new(&self.uids, ptrs, ws)?);
        }
        let Some(pack) = pack.as_ref() else {
            return Err(Error::NotSupported("variant pack vanished".into()));
        };
        drop(pack_stage);
        // SAFETY: the caller's contract for the data pointers; the scalars live in the plan's
        // state, locked until the call returns (cuDNN reads by-value data during the call); the
        // handle is the plan's, held under the Context's lock, and the only one the call uses.
        replay::finish(
            next,
            &mut g,
            handle,
            replays,
            key.as_ref(),
            "BatchNorm",
            || {
                check(
                    sys::cudnnBackendExecute(handle, self.plan.raw(), pack.raw()),
                    "cudnnBackendExecute(BatchNorm)",
                )
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalars_sit_at_an_aligned_host_address() {
        let s: Box<Scalars> = Box::default();
        assert_eq!(&*s as *const Scalars as usize % 16, 0);
        assert!(super::super::bn_key::FORWARD_ROLES.len() <= MAX_PACK_ROLES);
        assert!(super::super::bn_key::FORWARD_ADD_MASK_ROLES.len() <= MAX_PACK_ROLES);
        assert_eq!(s.zero, 0.0);
    }
}
