//! The BatchNorm's graph route: runs a planned training forward, backward or inference through
//! cuDNN's graph API ([`GraphBn`], cached per Context) when the plan chose it
//! ([`crate::batchnorm::BnPlan::cudnn_graph`]), with the ReLU / Add+ReLU epilogue inside the
//! graph where the plan says so. When cuDNN cannot build a plan (no engine config finalizes),
//! that part of the route is switched off for this BatchNorm and the caller runs the next one
//! down — every later call goes straight there:
//! - epilogue graph refused (forward or backward) → graph BatchNorm + nnfuse's bitmask kernels;
//! - graph BatchNorm refused → the legacy calls.
//!
//! A forward that ran the epilogue graph also wrote cuDNN's ReLU mask (`CMP_GT(y, 0)`, a
//! `BOOLEAN` tensor; nnfuse keeps 1 byte per element in the saved state); its backward graph
//! reads it (`dy · mask → NORM_BACKWARD`). If that backward graph cannot be built later
//! (another pointer alignment), the y-based ReLU backward kernel masks dy (y > 0 exactly where
//! the mask is set) and the plain backward follows. Buffers are validated by the caller.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::batchnorm::cudnn_calls::{BwdPtrs, FwdPtrs};
use crate::batchnorm::plan::BnPlan;
use crate::batchnorm::types::{BnPath, Fuse};
use crate::config::Config;
use crate::context::Context;
use crate::cudnn_graph::bn_key::{BnDirection, BnEpilogue, GraphBnKey};
use crate::cudnn_graph::graph_bn::{BnBwdAddrs, BnFwdAddrs, BnInferAddrs, GraphBn};
use crate::cudnn_graph::layout::alignment_of;
use crate::cudnn_graph::notes::GraphPolicy;
use crate::cudnn_graph::plans::is_unsupported;
use crate::error::Result;
use crate::layout::ChannelLayout;

/// The graph epilogue of `fuse`.
pub(crate) fn epilogue_of(fuse: Fuse) -> BnEpilogue {
    match fuse {
        Fuse::None => BnEpilogue::None,
        Fuse::Relu => BnEpilogue::Relu,
        Fuse::AddRelu => BnEpilogue::AddRelu,
    }
}

/// The device addresses of one inference (validated by the caller).
#[derive(Debug, Clone, Copy)]
pub(crate) struct InferPtrs {
    pub(crate) x: u64,
    /// The addend (Add+ReLU), else 0.
    pub(crate) z: u64,
    pub(crate) y: u64,
    pub(crate) gamma: u64,
    pub(crate) beta: u64,
    pub(crate) running_mean: u64,
    pub(crate) running_var: u64,
}

/// What a graph inference did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InferRan {
    /// Nothing queued: the caller runs the legacy call.
    NotRun,
    /// BatchNorm ran; the activation is still to do.
    Bn,
    /// BatchNorm and its epilogue ran.
    WithEpilogue,
}

/// One switch of the route: on by the plan, off for good once cuDNN refused it.
#[derive(Debug, Default)]
struct Switch {
    on: bool,
    refused: AtomicBool,
}

impl Switch {
    fn new(on: bool) -> Switch {
        Switch {
            on,
            refused: AtomicBool::new(false),
        }
    }

    fn active(&self) -> bool {
        self.on && !self.refused.load(Ordering::Relaxed)
    }

    fn refuse(&self) {
        self.refused.store(true, Ordering::Relaxed);
    }
}

/// One BatchNorm's graph route: which parts the plans take, and which cuDNN refused.
#[derive(Debug)]
pub(crate) struct GraphRoute {
    layout: ChannelLayout,
    dtype: crate::dtype::DType,
    policy: GraphPolicy,
    epilogue: BnEpilogue,
    /// Training BatchNorm (forward and backward) through the graph.
    train: Switch,
    /// The training epilogue inside the graph (forward and backward graphs both built).
    train_epilogue: Switch,
    /// Inference through the graph.
    infer: Switch,
    /// The inference epilogue inside the graph.
    infer_epilogue: Switch,
}

/// The engine policy of a BatchNorm graph: as strict as the convolution's, except that run-time
/// compilation is allowed — cuDNN's BatchNorm engines are runtime-compiled ones, so a policy
/// refusing them leaves no engine (the route is only taken when asked for: `graph_rule`).
pub(crate) fn bn_policy(config: &Config) -> GraphPolicy {
    GraphPolicy {
        deterministic: config.deterministic,
        allow_runtime_compilation: true,
        ..GraphPolicy::default()
    }
}

impl GraphRoute {
    /// The route of the training plan `train` and the inference plan `infer` (each on only when
    /// its plan runs the BatchNorm on cuDNN through the graph API; the epilogues when the plan's
    /// path puts the activation into the graph).
    pub(crate) fn new(train: &BnPlan, infer: &BnPlan, config: &Config) -> GraphRoute {
        let train_on = train.cudnn_api_used() == Some("graph");
        let infer_on = infer.cudnn_api_used() == Some("graph");
        GraphRoute {
            layout: train.layout,
            dtype: train.dtype,
            policy: bn_policy(config),
            epilogue: epilogue_of(train.fuse),
            train: Switch::new(train_on),
            train_epilogue: Switch::new(
                train_on && train.fuse != Fuse::None && train.path == BnPath::CudnnFused,
            ),
            infer: Switch::new(infer_on),
            // As the plan's `epilogue:` line (`graph_rule::graph_epilogue`).
            infer_epilogue: Switch::new(
                infer_on && infer.fuse != Fuse::None && !config.disable_cudnn_fusion,
            ),
        }
    }

    /// Whether the next training call tries the graph.
    pub(crate) fn active(&self) -> bool {
        self.train.active()
    }

    /// Whether the plan put the training epilogue into the graph (even if cuDNN refused it
    /// since: the caller then runs the fallback path).
    pub(crate) fn planned_epilogue(&self) -> bool {
        self.train_epilogue.on
    }

    /// Whether the next inference tries the graph.
    pub(crate) fn infer_active(&self) -> bool {
        self.infer.active()
    }

    /// The cached plan for `direction` with `epilogue` and pointers `ptrs`; `None` (and
    /// `switch` off from now on) when cuDNN cannot build it.
    fn plan(
        &self,
        ctx: &Context,
        direction: BnDirection,
        epilogue: BnEpilogue,
        ptrs: &[u64],
        switch: &Switch,
    ) -> Result<Option<Arc<GraphBn>>> {
        let align = alignment_of(ptrs).max(self.dtype.size() as u8);
        let key = GraphBnKey::new(self.layout, self.dtype, direction)
            .with_epilogue(epilogue)
            .with_alignment(align)
            .with_policy(self.policy);
        match GraphBn::cached(ctx, key) {
            Ok(p) => Ok(Some(p)),
            Err(e) if is_unsupported(&e) => {
                switch.refuse();
                tracing::warn!(
                    layout = %self.layout, dtype = %self.dtype, direction = direction.name(),
                    epilogue = epilogue.name(), error = %e,
                    "cuDNN cannot run this BatchNorm graph; {} from now on",
                    if epilogue == BnEpilogue::None {
                        "the legacy calls run it"
                    } else {
                        "graph BatchNorm and nnfuse's activation kernels run it"
                    }
                );
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// The training forward through the graph, BatchNorm alone (the fallback's first half when
    /// an activation follows); `false` when the caller must run the legacy calls instead
    /// (cuDNN refused the graph; nothing was queued).
    pub(crate) fn forward(
        &self,
        ctx: &Context,
        p: &FwdPtrs,
        momentum: f64,
        eps: f64,
    ) -> Result<bool> {
        self.forward_with(ctx, p, 0, momentum, eps, BnEpilogue::None)
    }

    /// The training forward with its epilogue inside the graph, writing the ReLU mask to
    /// `mask` (x's element count in bytes, nnfuse's own buffer); `false` (nothing queued) when
    /// either the forward or the backward epilogue graph does not finalize — both are built
    /// here, so that a forward whose mask only cuDNN can read has a backward that reads it. The
    /// caller then runs the fallback path (graph BatchNorm, bitmask kernels).
    pub(crate) fn forward_fused(
        &self,
        ctx: &Context,
        p: &FwdPtrs,
        mask: u64,
        momentum: f64,
        eps: f64,
    ) -> Result<bool> {
        if !self.epilogue_active() {
            return Ok(false);
        }
        // The backward's pointers are not known yet: its plan is built for the forward's
        // alignment (a backward with other pointers builds its own, or masks dy from y).
        let bwd_probe = [p.x, p.y, p.gamma, p.saved_mean, p.saved_inv_var, mask];
        let sw = &self.train_epilogue;
        if self
            .plan(ctx, BnDirection::Backward, self.epilogue, &bwd_probe, sw)?
            .is_none()
        {
            return Ok(false);
        }
        self.forward_with(ctx, p, mask, momentum, eps, self.epilogue)
    }

    /// Whether the next training forward tries the epilogue graph (planned, not refused).
    pub(crate) fn epilogue_active(&self) -> bool {
        self.train_epilogue.active() && self.train.active()
    }

    fn forward_with(
        &self,
        ctx: &Context,
        p: &FwdPtrs,
        mask: u64,
        momentum: f64,
        eps: f64,
        epilogue: BnEpilogue,
    ) -> Result<bool> {
        let a = BnFwdAddrs {
            x: p.x,
            scale: p.gamma,
            bias: p.beta,
            running_mean: p.running_mean,
            running_var: p.running_var,
            saved_mean: p.saved_mean,
            saved_inv_var: p.saved_inv_var,
            y: p.y,
            addend: if epilogue == BnEpilogue::AddRelu {
                p.z
            } else {
                0
            },
            mask,
        };
        let ptrs = [
            a.x,
            a.scale,
            a.bias,
            a.running_mean,
            a.running_var,
            a.saved_mean,
            a.saved_inv_var,
            a.y,
            a.addend,
            a.mask,
        ];
        let sw = if epilogue == BnEpilogue::None {
            &self.train
        } else {
            &self.train_epilogue
        };
        let Some(plan) = self.plan(ctx, BnDirection::Forward, epilogue, &ptrs, sw)? else {
            return Ok(false);
        };
        // SAFETY: the dispatcher validated every buffer against the plan's layout (lengths,
        // device, no output overlapping an input); the key's alignment is the pointers' own.
        unsafe { plan.forward(ctx, &a, eps, momentum) }?;
        Ok(true)
    }

    /// The backward through the graph, BatchNorm alone (`p.dy` is the gradient entering
    /// BatchNorm); `false` when the caller must run the legacy calls instead.
    pub(crate) fn backward(&self, ctx: &Context, p: &BwdPtrs) -> Result<bool> {
        self.backward_with(ctx, p, 0, BnEpilogue::None, &self.train)
    }

    /// The backward of a forward that ran the epilogue graph: dy times the forward's ReLU
    /// `mask` (and the addend's gradient) inside the graph (`p.dy` is the caller's dy). `false`
    /// when that graph cannot be built for these pointers: the caller masks dy from y itself
    /// and runs [`GraphRoute::backward`].
    pub(crate) fn backward_fused(&self, ctx: &Context, p: &BwdPtrs, mask: u64) -> Result<bool> {
        // A separate switch: refusing this one must not stop the forward's epilogue graphs
        // already known to build for the forward's pointers.
        let sw = Switch::new(true);
        self.backward_with(ctx, p, mask, self.epilogue, &sw)
    }

    fn backward_with(
        &self,
        ctx: &Context,
        p: &BwdPtrs,
        mask: u64,
        epilogue: BnEpilogue,
        sw: &Switch,
    ) -> Result<bool> {
        let a = BnBwdAddrs {
            x: p.x,
            dy: p.dy,
            scale: p.gamma,
            saved_mean: p.saved_mean,
            saved_inv_var: p.saved_inv_var,
            dscale: p.dgamma,
            dbias: p.dbeta,
            dx: p.dx,
            // The mask form reads the mask, not y (`GraphBnKey::relu_grad`'s default).
            y: 0,
            mask: if epilogue == BnEpilogue::None {
                0
            } else {
                mask
            },
            daddend: if epilogue == BnEpilogue::AddRelu {
                p.dz
            } else {
                0
            },
        };
        let ptrs = [
            a.x,
            a.dy,
            a.scale,
            a.saved_mean,
            a.saved_inv_var,
            a.dscale,
            a.dbias,
            a.dx,
            a.mask,
            a.daddend,
        ];
        let Some(plan) = self.plan(ctx, BnDirection::Backward, epilogue, &ptrs, sw)? else {
            return Ok(false);
        };
        // SAFETY: as in `forward_with`.
        unsafe { plan.backward(ctx, &a) }?;
        Ok(true)
    }

    /// The inference through the graph: the epilogue inside it where the plan asks for one
    /// and cuDNN builds it, else BatchNorm alone. `inv_std` is a scratch of one f32 per channel
    /// (the caller's, overlapping nothing) that receives `1 / sqrt(running_var + eps)` — what
    /// NORM_FORWARD's inference phase reads in place of the variance — right before the plan
    /// runs. Nothing is queued when no graph can be built ([`InferRan::NotRun`]).
    pub(crate) fn inference(
        &self,
        ctx: &Context,
        p: &InferPtrs,
        eps: f64,
        inv_std: u64,
    ) -> Result<InferRan> {
        let mut a = BnInferAddrs {
            x: p.x,
            scale: p.gamma,
            bias: p.beta,
            mean: p.running_mean,
            inv_std,
            y: p.y,
            addend: 0,
        };
        let mut ran = InferRan::Bn;
        let mut plan = None;
        if self.infer_epilogue.active() {
            a.addend = if self.epilogue == BnEpilogue::AddRelu {
                p.z
            } else {
                0
            };
            let ptrs = [a.x, a.scale, a.bias, a.mean, a.inv_std, a.y, a.addend];
            plan = self.plan(
                ctx,
                BnDirection::Inference,
                self.epilogue,
                &ptrs,
                &self.infer_epilogue,
            )?;
            ran = InferRan::WithEpilogue;
        }
        if plan.is_none() {
            a.addend = 0;
            ran = InferRan::Bn;
            let ptrs = [a.x, a.scale, a.bias, a.mean, a.inv_std, a.y];
            plan = self.plan(
                ctx,
                BnDirection::Inference,
                BnEpilogue::None,
                &ptrs,
                &self.infer,
            )?;
        }
        let Some(plan) = plan else {
            return Ok(InferRan::NotRun);
        };
        let c = self.layout.c as usize;
        // SAFETY: running_var holds C f32 (validated by the caller), inv_std is the caller's
        // scratch of C f32 overlapping nothing; stream order puts the kernel before the plan.
        unsafe { crate::util::inv_std_raw(ctx, p.running_var, inv_std, eps as f32, c) }?;
        // SAFETY: as in `forward_with`; inv_std is written above, on the same stream.
        unsafe { plan.inference(ctx, &a) }?;
        Ok(ran)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_switch_stays_off_once_refused() {
        let s = Switch::new(true);
        assert!(s.active());
        s.refuse();
        assert!(!s.active());
        assert!(!Switch::new(false).active());
    }

    #[test]
    fn every_fusion_has_its_epilogue() {
        assert_eq!(epilogue_of(Fuse::None), BnEpilogue::None);
        assert_eq!(epilogue_of(Fuse::Relu), BnEpilogue::Relu);
        assert_eq!(epilogue_of(Fuse::AddRelu), BnEpilogue::AddRelu);
    }

    #[test]
    fn the_policy_admits_runtime_compiled_engines_and_keeps_determinism() {
        let p = bn_policy(&Config::default());
        assert!(p.allow_runtime_compilation);
        assert!(!p.allow_tf32 && !p.deterministic && !p.allow_reduced_precision_reduction);
        assert!(bn_policy(&Config::default().with_deterministic(true)).deterministic);
    }
}
