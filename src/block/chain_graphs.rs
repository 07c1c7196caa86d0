//! The prologue route's cuDNN graphs of a [`super::ConvBnChain`]: per inner link (unit i →
//! unit i + 1, keyed by unit i + 1's convolution) the scale·bias·ReLU + conv + `GEN_STATS`
//! forward, the dgrad + dReLU + BatchNorm backward-weights graph and the wgrad graph with the
//! prologue, from the Context's plan cache, with the few engine configs the first call races.

use std::sync::Arc;

use crate::context::Context;
use crate::conv::ConvShape;
use crate::cudnn_graph::graph_fused::{FusedKey, FusedPattern, GraphFused};
use crate::cudnn_graph::notes::GraphPolicy;
use crate::dtype::DType;
use crate::error::Result;

/// The cuDNN graphs of one inner link (unit i → unit i + 1), keyed by unit i + 1's convolution.
#[derive(Debug)]
pub(crate) struct LinkGraphs {
    pub(super) fprop: Arc<GraphFused>,
    pub(super) dgrad: Arc<GraphFused>,
    pub(super) wgrad: Arc<GraphFused>,
}

/// Engine configs finalized per link graph (the first call times them: the heuristics' first
/// is not always the fastest).
const LINK_CANDIDATES: usize = 4;

/// Which of a link's graphs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LinkPart {
    /// The forward with the prologue and GEN_STATS.
    Fprop,
    /// The data gradient with dReLU and the BatchNorm's backward weights.
    Dgrad,
    /// The filter gradient with the prologue.
    Wgrad,
}

impl LinkGraphs {
    /// The graph of `part`.
    pub(super) fn graph(&self, part: LinkPart) -> &GraphFused {
        match part {
            LinkPart::Fprop => &self.fprop,
            LinkPart::Dgrad => &self.dgrad,
            LinkPart::Wgrad => &self.wgrad,
        }
    }
}

/// The graphs of every inner link of the chain of `shapes` in `dtype` (finalizing up to
/// [`LINK_CANDIDATES`] engine configs each, the policy's), from the Context's plan cache.
pub(super) fn build(ctx: &Context, shapes: &[ConvShape], dtype: DType) -> Result<Vec<LinkGraphs>> {
    let policy = GraphPolicy {
        deterministic: ctx.config().deterministic,
        ..GraphPolicy::default()
    };
    let key = |pattern, i: usize| FusedKey {
        pattern,
        shape: shapes[i],
        dtype,
        policy,
        limit: LINK_CANDIDATES,
    };
    (1..shapes.len())
        .map(|i| {
            Ok(LinkGraphs {
                fprop: GraphFused::cached(ctx, key(FusedPattern::ConvBnFprop, i))?,
                dgrad: GraphFused::cached(ctx, key(FusedPattern::DgradDreluDbnWeight, i))?,
                wgrad: GraphFused::cached(ctx, key(FusedPattern::WgradPrologue, i))?,
            })
        })
        .collect()
}
