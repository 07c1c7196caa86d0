//! cuDNN through its graph (backend) API: convolutions as execution plans built once per
//! problem and executed with `cudnnBackendExecute`, the successor of the legacy
//! `cudnnConvolution*` calls (deprecated in cuDNN 9, and 4–5x dearer on the host per call:
//! `docs/CUDNN-GRAPH.md`, `GPU-FACTS.md`).
//!
//! Files and what they may touch:
//! - [`layout`]: pure — tensor dimensions and strides (NCHW/NHWC, KCRS/KRSC), unique ids,
//!   pointer alignment classes;
//! - [`notes`]: pure — engine numerical/behaviour notes, the policy that filters engines
//!   (no TF32 for f32, determinism, runtime compilation), de-duplication;
//! - [`key`]: pure — the plain-data key of the plan cache;
//! - [`descriptor`]: the owned backend descriptor (create/set/get/finalize/destroy) and the
//!   status mapping; cuDNN calls, no device work;
//! - [`build`]: the builders of one convolution graph (tensors, convolution, operation,
//!   operation graph, heuristics, engine configs, execution plan, variant pack);
//! - [`graph_conv`]: [`GraphConv`] — one problem's plan, chosen engine and pinned variant pack,
//!   checked execution, and the per-Context plan cache.
//! - [`bn_key`]: pure — a BatchNorm graph's tensor roles, unique ids, dims and strides, its
//!   epilogue's virtual intermediates, and the key of its plan cache;
//! - [`bn_build`]: the builders of one BatchNorm graph (`NORM_FORWARD` training / inference,
//!   `NORM_BACKWARD`, the pointwise ReLU / Add+ReLU epilogue) and its variant pack;
//! - [`graph_bn`]: [`graph_bn::GraphBn`] — one BatchNorm problem's plan, pinned variant pack
//!   (by-value epsilon and momentum) and the per-Context plan cache.
//! - [`fusion`]: a general fused operation graph — named tensors (by-value int64 / double
//!   scalars included), pointwise, convolution, `GEN_STATS`, `BN_FINALIZE_STATISTICS`,
//!   `BN_BWD_WEIGHTS` — the search over its engine configs that records every finalize status,
//!   and its variant pack;
//! - [`fusion_patterns`]: the training block's fusion patterns (docs/BLOCK-TRAINING.md §2) as
//!   such graphs, and the BatchNorm epilogue graphs rebuilt for probing;
//! - [`graph_fused`]: [`graph_fused::GraphFused`] — one fusion pattern of the training block
//!   (a convolution with its output's per-channel sums from `GEN_STATS`, optionally with the
//!   previous BatchNorm's scale·bias·ReLU on its input; the data gradient with that ReLU's and
//!   BatchNorm's backward weights; the filter gradient with the same prologue) as finalized
//!   plans of the admitted engine configs, cached per problem, with a pinned variant pack
//!   (ConvStats, ConvBnChain);
//! - [`replay_rule`]: pure — which execution of a plan runs eagerly, is captured into a CUDA
//!   graph, or replays one (the key of baked-in addresses and scalars, the slots per plan);
//! - `replay`: the capture on the Context's capture-only stream and the replay launch;
//! - [`plans`]: what both plans share — the plan cache's lookup and remembered failures, and
//!   the start of an execution (the plan's own handle, the workspace).
//!
//! The convolution dispatcher runs it as the path `cudnn_graph` (`conv/cudnn_graph_run.rs`);
//! this layer returns typed errors where the graph cannot be built so that the dispatcher can
//! fall back to the legacy calls.

pub mod bn_build;
pub mod bn_key;
pub mod build;
pub mod descriptor;
pub mod fusion;
pub mod fusion_patterns;
pub mod graph_bn;
pub mod graph_conv;
pub mod graph_fused;
pub mod key;
pub mod layout;
pub mod notes;
pub mod plans;
pub(crate) mod replay;
pub mod replay_rule;

/// Items that only nnfuse's own tests and benches use (reached as
/// `nnfuse::internals::cudnn_graph`); not part of the public API.
#[doc(hidden)]
pub mod internals {
    pub use super::bn_build::BnGraphParts;
    pub use super::bn_key::{BnDirection, BnElem, BnEpilogue, BnRole, GraphBnKey, ReluGrad};
    pub use super::build::{
        available, engine_config_by_index, engine_config_of, engine_configs, engine_count,
        engine_info, execute, EngineConfig, ExecutionPlan, GraphParts, VariantPack,
        MIN_CUDNN_VERSION,
    };
    pub use super::descriptor::{last_error_string, Attr, DescKind, Descriptor};
    pub use super::fusion::{
        execute as fusion_execute, search_plans, variant_pack as fusion_variant_pack,
        BnBwdWeightsRefs, BnFinalizeRefs, ElemType, FusionBuilder, FusionGraph, FusionTensorSpec,
        NormBwdRefs, NormFwdRefs, PlanAttempt, PlanSearch, ReluAttrs, TensorRef,
    };
    pub use super::fusion_patterns::{
        bn_epilogue, bn_finalize, bn_mask_backward, dgrad_accumulate, dgrad_drelu_dbn_weight,
        wgrad_prologue, BnEpilogueGraph, BnMaskForward, ConvGenStats, MaskComparand, MaskSource,
        Prologue,
    };
    pub use super::graph_bn::{BnBwdAddrs, BnFwdAddrs, GraphBn};
    pub use super::graph_conv::{
        argument_names, pack_order, run_cached, Admitted, GraphConv, Skipped,
    };
    pub use super::key::GraphConvKey;
    pub use super::layout::{
        alignment_of, packed_strides, tensor_specs, Operand, TensorSpec, MAX_ALIGNMENT,
    };
    pub use super::notes::{
        admit, dedup, pass_over, BehaviorNote, EngineInfo, GraphLimits, GraphPolicy, HeurSource,
        NoteSet, NumericalNote, Rejection,
    };
}
