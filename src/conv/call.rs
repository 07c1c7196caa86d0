//! What a path's run function receives: the problem a route runs on ([`Target`]), the
//! completed route ([`Exec`]) and the operands, in one [`PathCall`]. Every registered path's
//! `raw_run` takes a `&PathCall` (the signature `route.rs` dispatches through); the operands
//! were checked by the dispatcher before. Also the per-problem memory of the graph route's
//! plans ([`GraphPlans`]), which the dispatcher's target carries to that route.

use std::sync::{Arc, Mutex, MutexGuard};

use super::cudnn::CudnnConv;
use super::plan::{Direction, Route};
use super::problem::{
    BwdDataPtrs, BwdFilterPtrs, ConvShape, CudnnPtrs, FwdPtrs, GraphEngine, WinogradGeometry,
};
use crate::context::Context;
use crate::cudnn_graph::graph_conv::GraphConv;
use crate::dtype::DType;
use crate::error::{CallExt, Error, Result};

/// A route ready to run: with the workspace its cuDNN algorithm needs, and a Winograd route's
/// geometry (computed once, when the route is completed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Exec {
    /// What runs.
    pub route: Route,
    /// Bytes of the Context's library workspace the cuDNN algorithm needs (0 otherwise).
    pub cudnn_ws: usize,
    /// A Winograd route's tile, equivalent forward problem and sizes (`None` otherwise).
    pub winograd: Option<WinogradGeometry>,
}

/// The problem a route runs on.
pub(crate) struct Target<'a> {
    /// The Context (stream, handles, scratch).
    pub ctx: &'a Context,
    /// The problem.
    pub shape: &'a ConvShape,
    /// Element type.
    pub dtype: DType,
    /// cuDNN's descriptors of the problem, when cuDNN is available to it.
    pub cudnn: Option<&'a CudnnConv>,
    /// The graph plans this problem ran, per direction (the dispatcher's calls); `None` where
    /// every call looks its plan up in the Context's plan cache (the measurement).
    pub graph_plans: Option<&'a [GraphPlans; 3]>,
}

/// What, beyond the problem and the direction, selects a graph plan in the Context's plan
/// cache: the Context (its cuDNN handle and engine policy), the engine config, the pointers'
/// alignment class, and whether the gradient accumulates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GraphPlanTag {
    /// The Context's identity (see [`GraphPlanTag::context_id`]).
    pub ctx: usize,
    /// The route's engine config (`None`: the first admitted one).
    pub engine: Option<GraphEngine>,
    /// Bytes every pointer is aligned to, at least the element size (the key's alignment).
    pub alignment: u8,
    /// The gradient adds to dx or dw.
    pub accumulate: bool,
}

impl GraphPlanTag {
    /// A Context's identity while it lives: the address of its configuration, which lives in the
    /// Context's shared state (clones share it; a `with_config_override` Context, with its own
    /// handles and policy, has another). A problem's state is reachable only through objects that
    /// keep their Context alive, so the address is not reused under it.
    pub fn context_id(ctx: &Context) -> usize {
        std::ptr::from_ref(ctx.config()) as usize
    }
}

/// Most plans one problem keeps per direction (alignment classes x engine configs x
/// accumulation seen by its calls; one in the usual case). Past it the oldest is let go (the
/// Context's plan cache may still hold it).
const MAX_PLANS_PER_DIRECTION: usize = 8;

/// The graph plans one problem's calls of one direction ran, each with its [`GraphPlanTag`]: a
/// call whose tag is here runs that plan without the Context's plan-cache lookup (a global lock,
/// a type-map lookup and a hash of the whole key). Holding them also keeps them alive as long as
/// the problem's state, whatever the plan cache evicts (a captured CUDA graph may use them).
/// (Generic over the plan type only so that the bookkeeping is tested on the CPU.)
#[derive(Debug)]
pub(crate) struct GraphPlans<P = GraphConv>(Mutex<Vec<(GraphPlanTag, Arc<P>)>>);

impl<P> Default for GraphPlans<P> {
    fn default() -> Self {
        GraphPlans(Mutex::new(Vec::new()))
    }
}

impl<P> GraphPlans<P> {
    fn lock(&self) -> MutexGuard<'_, Vec<(GraphPlanTag, Arc<P>)>> {
        match self.0.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// The plan kept for `tag`, if any.
    pub fn get(&self, tag: &GraphPlanTag) -> Option<Arc<P>> {
        self.lock()
            .iter()
            .find(|(t, _)| t == tag)
            .map(|(_, p)| p.clone())
    }

    /// Keeps `plan` for `tag` (replacing one kept for it); the oldest goes past the bound.
    pub fn keep(&self, tag: GraphPlanTag, plan: Arc<P>) {
        let released = {
            let mut v = self.lock();
            let old = match v.iter().position(|(t, _)| *t == tag) {
                Some(i) => Some(v.remove(i)),
                None if v.len() >= MAX_PLANS_PER_DIRECTION => Some(v.remove(0)),
                None => None,
            };
            v.push((tag, plan));
            old
        };
        // A plan's descriptors are destroyed outside the lock.
        drop(released);
    }
}

/// One call of a path: the problem, the direction, the completed route and the operands.
pub(crate) struct PathCall<'a> {
    /// The problem a route runs on.
    pub target: &'a Target<'a>,
    /// Which computation.
    pub direction: Direction,
    /// The completed route.
    pub exec: Exec,
    /// The operands by cuDNN's roles: `x` is x or dx, `w` is w or dw, `y` is y or dy.
    pub ptrs: CudnnPtrs,
    /// Add to dx or dw instead of overwriting it (the gradients only; false for the forward).
    pub accumulate: bool,
}

/// A registered path's run function.
///
/// # Safety
/// As [`super::route::run`].
pub(crate) type RunFn = unsafe fn(&PathCall<'_>) -> Result<()>;

impl PathCall<'_> {
    /// The operands of a forward convolution.
    pub fn fwd(&self) -> FwdPtrs {
        let p = self.ptrs;
        FwdPtrs {
            x: p.x,
            w: p.w,
            y: p.y,
        }
    }

    /// The operands of a data gradient.
    pub fn bwd_data(&self) -> BwdDataPtrs {
        let p = self.ptrs;
        BwdDataPtrs {
            dy: p.y,
            w: p.w,
            dx: p.x,
        }
    }

    /// The operands of a filter gradient.
    pub fn bwd_filter(&self) -> BwdFilterPtrs {
        let p = self.ptrs;
        BwdFilterPtrs {
            x: p.x,
            dy: p.y,
            dw: p.w,
        }
    }

    /// Under compute-sanitizer (`NNFUSE_UNDER_SANITIZER=1`) zeroes the output the route is
    /// about to overwrite, whichever path it is: initcheck does not see cuDNN's and cuBLASLt's
    /// stores on the H100 (cuDNN routes, im2col's and Winograd's GEMMs), so every later read of
    /// the result (nnfuse's statistics, checks and BatchNorm kernels, cuDNN's own kernels) is an
    /// "uninitialized" report — floods that ran initcheck runs past their timeouts
    /// (docs/RELIABILITY.md). Nothing otherwise; nothing for an accumulating call, whose output
    /// is an input.
    pub fn zero_output_under_sanitizer(&self) -> Result<()> {
        if self.accumulate || !crate::config::under_sanitizer() {
            return Ok(());
        }
        let s = self.target.shape;
        let (ptr, len) = match self.direction {
            Direction::Forward => (self.ptrs.y, s.y_len()?),
            Direction::BackwardData => (self.ptrs.x, s.x_len()?),
            Direction::BackwardFilter => (self.ptrs.w, s.w_len()?),
        };
        let bytes = len
            .checked_mul(self.target.dtype.size())
            .ok_or_else(|| Error::invalid("shape", "output bytes overflow"))?;
        let stream = self.target.ctx.stream().cu_stream();
        // SAFETY: the caller's contract: the output holds `len` elements of the problem's type
        // on the Context's device.
        unsafe { cudarc::driver::result::memset_d8_async(ptr, 0, bytes, stream) }
            .call("cuMemsetD8Async")
    }

    /// The error of a path that has no kernel for this direction.
    pub fn no_direction(&self, what: &str) -> Error {
        Error::NotSupported(format!("{what} has no {}", self.direction.describe()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag(alignment: u8, accumulate: bool) -> GraphPlanTag {
        GraphPlanTag {
            ctx: 1,
            engine: None,
            alignment,
            accumulate,
        }
    }

    /// A kept plan serves only its exact tag (another alignment class, accumulation, engine or
    /// Context takes the lookup); keeping a tag again replaces its plan; the bound lets the
    /// oldest go.
    #[test]
    fn kept_plans_serve_only_their_own_tag() {
        let kept = GraphPlans::<u32>::default();
        assert!(kept.get(&tag(16, false)).is_none());
        kept.keep(tag(16, false), Arc::new(1));
        assert_eq!(kept.get(&tag(16, false)).as_deref(), Some(&1));
        assert!(kept.get(&tag(8, false)).is_none());
        assert!(kept.get(&tag(16, true)).is_none());
        let other_ctx = GraphPlanTag {
            ctx: 2,
            ..tag(16, false)
        };
        assert!(kept.get(&other_ctx).is_none());
        let engine = crate::conv::problem::GraphEngine::new(3, &[]);
        assert!(engine.is_some());
        assert!(kept
            .get(&GraphPlanTag {
                engine,
                ..tag(16, false)
            })
            .is_none());
        kept.keep(tag(8, false), Arc::new(2));
        kept.keep(tag(16, false), Arc::new(3));
        assert_eq!(kept.get(&tag(16, false)).as_deref(), Some(&3));
        assert_eq!(kept.get(&tag(8, false)).as_deref(), Some(&2));
        assert_eq!(kept.lock().len(), 2);
        for (i, a) in (0..MAX_PLANS_PER_DIRECTION as u8).enumerate() {
            kept.keep(tag(100 + a, false), Arc::new(10 + i as u32));
        }
        assert_eq!(kept.lock().len(), MAX_PLANS_PER_DIRECTION);
        // The two oldest went; the newest stay.
        assert!(kept.get(&tag(8, false)).is_none());
        assert!(kept.get(&tag(16, false)).is_none());
        assert_eq!(kept.get(&tag(100, false)).as_deref(), Some(&10));
    }
}
