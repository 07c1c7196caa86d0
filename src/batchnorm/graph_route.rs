//! The BatchNorm's graph route: runs a planned training forward or backward through cuDNN's
//! graph API ([`GraphBn`], cached per Context) when the plan chose it
//! ([`crate::batchnorm::BnPlan::cudnn_graph`]). When cuDNN cannot build the plan (no engine
//! config finalizes), the route is switched off for this BatchNorm and the caller runs the
//! legacy calls — every later call goes straight there. Buffers are validated by the caller.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::batchnorm::cudnn_calls::{BwdPtrs, FwdPtrs};
use crate::batchnorm::plan::BnPlan;
use crate::config::Config;
use crate::context::Context;
use crate::cudnn_graph::bn_key::{BnDirection, GraphBnKey};
use crate::cudnn_graph::graph_bn::{BnBwdAddrs, BnFwdAddrs, GraphBn};
use crate::cudnn_graph::layout::alignment_of;
use crate::cudnn_graph::notes::GraphPolicy;
use crate::cudnn_graph::plans::is_unsupported;
use crate::error::Result;
use crate::layout::ChannelLayout;

/// One BatchNorm's graph route: whether the plan takes it, and whether cuDNN refused it.
#[derive(Debug)]
pub(crate) struct GraphRoute {
    on: bool,
    layout: ChannelLayout,
    dtype: crate::dtype::DType,
    policy: GraphPolicy,
    refused: AtomicBool,
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
    /// The route of the training plan `train` (on only when the plan runs the BatchNorm on cuDNN
    /// through the graph API).
    pub(crate) fn new(train: &BnPlan, config: &Config) -> GraphRoute {
        GraphRoute {
            on: train.cudnn_api_used() == Some("graph"),
            layout: train.layout,
            dtype: train.dtype,
            policy: bn_policy(config),
            refused: AtomicBool::new(false),
        }
    }

    /// Whether the next call tries the graph.
    pub(crate) fn active(&self) -> bool {
        self.on && !self.refused.load(Ordering::Relaxed)
    }

    /// The cached plan for `direction` and pointers `ptrs`; `None` (and the route off from now
    /// on) when cuDNN cannot build it.
    fn plan(
        &self,
        ctx: &Context,
        direction: BnDirection,
        ptrs: &[u64],
    ) -> Result<Option<Arc<GraphBn>>> {
        let align = alignment_of(ptrs).max(self.dtype.size() as u8);
        let key = GraphBnKey::new(self.layout, self.dtype, direction)
            .with_alignment(align)
            .with_policy(self.policy);
        match GraphBn::cached(ctx, key) {
            Ok(p) => Ok(Some(p)),
            Err(e) if is_unsupported(&e) => {
                self.refused.store(true, Ordering::Relaxed);
                tracing::warn!(
                    layout = %self.layout, dtype = %self.dtype, direction = direction.name(),
                    error = %e,
                    "cuDNN cannot run this BatchNorm through its graph API; the legacy calls \
                     run it from now on"
                );
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// The training forward through the graph; `false` when the caller must run the legacy
    /// calls instead (cuDNN refused the graph; nothing was queued).
    pub(crate) fn forward(
        &self,
        ctx: &Context,
        p: &FwdPtrs,
        momentum: f64,
        eps: f64,
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
        ];
        let Some(plan) = self.plan(ctx, BnDirection::Forward, &ptrs)? else {
            return Ok(false);
        };
        // SAFETY: the dispatcher validated every buffer against the plan's layout (lengths,
        // device, no output overlapping an input); the key's alignment is the pointers' own.
        unsafe { plan.forward(ctx, &a, eps, momentum) }?;
        Ok(true)
    }

    /// The backward through the graph (`p.dy` is the gradient entering BatchNorm); `false` when
    /// the caller must run the legacy calls instead.
    pub(crate) fn backward(&self, ctx: &Context, p: &BwdPtrs) -> Result<bool> {
        let a = BnBwdAddrs {
            x: p.x,
            dy: p.dy,
            scale: p.gamma,
            saved_mean: p.saved_mean,
            saved_inv_var: p.saved_inv_var,
            dscale: p.dgamma,
            dbias: p.dbeta,
            dx: p.dx,
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
        ];
        let Some(plan) = self.plan(ctx, BnDirection::Backward, &ptrs)? else {
            return Ok(false);
        };
        // SAFETY: as in `forward`.
        unsafe { plan.backward(ctx, &a) }?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_admits_runtime_compiled_engines_and_keeps_determinism() {
        let p = bn_policy(&Config::default());
        assert!(p.allow_runtime_compilation);
        assert!(!p.allow_tf32 && !p.deterministic && !p.allow_reduced_precision_reduction);
        assert!(bn_policy(&Config::default().with_deterministic(true)).deterministic);
    }
}
