//! Which cuDNN API runs a BatchNorm planned on cuDNN: the graph (backend) API's execution plans
//! (`NORM_FORWARD` training / inference, `NORM_BACKWARD`, with the ReLU / Add+ReLU epilogue
//! inside the graph: `src/cudnn_graph/graph_bn.rs`) or the legacy entry points
//! (`cudnnBatchNormalization*`, deprecated in cuDNN 9), with the reason. Pure: no GPU calls.
//!
//! `NNFUSE_CUDNN_API` / [`Config::cudnn_api`]: `legacy` keeps the legacy calls; `graph` takes the
//! graph wherever it can be expressed (per-channel statistics, cuDNN 9 or newer; training and
//! inference) and falls back at the first call when no engine config finalizes (an epilogue
//! graph to graph BatchNorm + nnfuse's activation kernels, graph BatchNorm to the legacy calls:
//! [`graph_epilogue`]); `auto`
//! takes the graph only where [`GRAPH_FOR_AUTO`] is on and the layout and type are ones cuDNN
//! documents for its BatchNorm engines ([`graph_supported`]). [`GRAPH_FOR_AUTO`] is off: on the
//! H100 the graph's backward is up to 1.6x slower on the GPU than the legacy call (on the host
//! both, replayed, cost under half the executed legacy pair): `docs/CUDNN-GRAPH.md`, "BatchNorm".

use crate::batchnorm::types::{BnMode, Fuse, Phase};
use crate::config::{Config, CudnnApi};
use crate::dtype::DType;
use crate::layout::{ChannelLayout, TensorFormat};

/// The first cuDNN with the graph API in `libcudnn_graph` (9.0), as the graph layer requires
/// (`cudnn_graph::build::MIN_CUDNN_VERSION`; kept here so that the plan stays free of FFI).
pub const GRAPH_MIN_CUDNN_VERSION: usize = 90000;

/// Whether `NNFUSE_CUDNN_API=auto` takes the graph route for BatchNorm where it applies. Off: the
/// route matches the f64 reference and the legacy calls (`tests/gpu_batchnorm_graph.rs`) and,
/// replayed, costs under half the executed legacy pair's host time (so do the legacy calls
/// replayed), but on the H100 (cuDNN 9.19) its backward
/// takes up to 1.6x the legacy call's GPU time and BN+ReLU in halves has no backward epilogue
/// engine (`benches/batchnorm.rs`, `NNFUSE_BENCH_BN=api`); `graph` forces it.
pub const GRAPH_FOR_AUTO: bool = false;

/// Whether cuDNN documents its BatchNorm engines for `layout` and `dtype` activations: its batch
/// norm engines are specialized runtime-compiled ones for channels-last (NHWC) half and bfloat16
/// activations with f32 statistics (cuDNN 9 "Graph API engines"; not yet confirmed on the H100).
/// `Err` says why not. Used by `auto` only: `graph` tries any layout and type and falls back when
/// no engine config finalizes.
pub fn graph_supported(layout: &ChannelLayout, dtype: DType) -> Result<(), String> {
    if layout.format != TensorFormat::Nhwc {
        return Err(format!(
            "the input infers {}, and cuDNN documents its graph BatchNorm engines for \
             channels-last (NHWC) activations",
            layout.format.name().to_ascii_uppercase()
        ));
    }
    match dtype {
        DType::F16 | DType::BF16 => Ok(()),
        DType::F32 => Err(
            "f32 activations: cuDNN documents its graph BatchNorm engines for half and bfloat16 \
             activations"
                .into(),
        ),
    }
}

/// Whether the BatchNorm itself runs through the graph API, with the plan's `cuDNN API:` line.
pub fn infer_cudnn_api(
    layout: &ChannelLayout,
    mode: BnMode,
    phase: Phase,
    dtype: DType,
    config: &Config,
    cudnn_version: usize,
    cudnn_available: bool,
) -> (bool, String) {
    let api = config.cudnn_api;
    let legacy = |why: String| (false, format!("cuDNN API: legacy ({api}) — {why}"));
    if !cudnn_available {
        return (false, "cuDNN API: none — cuDNN cannot be loaded".into());
    }
    if api == CudnnApi::Legacy {
        return legacy(
            "NNFUSE_CUDNN_API / Config::cudnn_api is legacy: cudnnBatchNormalization* as \
             before the graph route existed"
                .into(),
        );
    }
    if cudnn_version < GRAPH_MIN_CUDNN_VERSION {
        return legacy(format!(
            "cuDNN {cudnn_version} predates the graph API of cuDNN 9 (libcudnn_graph)"
        ));
    }
    if mode == BnMode::PerActivation {
        return legacy(
            "CUDNN_BATCHNORM_PER_ACTIVATION keeps statistics per (c, h, w); the graph's \
             NORM_FORWARD batch norm normalises per channel only"
                .into(),
        );
    }
    let ops = match phase {
        Phase::Training => "NORM_FORWARD (training) / NORM_BACKWARD",
        Phase::Inference => {
            "NORM_FORWARD (inference; nnfuse's inv_std kernel turns the running variance into \
             the inverse standard deviation it reads)"
        }
    };
    let graph = |why: &str| {
        (
            true,
            format!(
                "cuDNN API: graph ({api}) — {why}: {ops} execution plans built once per shape \
                 and cached, a cached call sets only the variant pack's pointers and scalars; \
                 cuDNN's BatchNorm engines compile at run time (the first call of a shape waits \
                 for it); if no engine config finalizes, the legacy calls run instead (logged)"
            ),
        )
    };
    match api {
        CudnnApi::Graph => graph("forced by NNFUSE_CUDNN_API / Config::cudnn_api"),
        _ if !GRAPH_FOR_AUTO => legacy(
            "the graph route's backward is up to 1.6x slower on the GPU than the legacy call \
             on the H100 (GRAPH_FOR_AUTO is off; on the host both APIs' repeated calls are \
             replayed); NNFUSE_CUDNN_API=graph forces it (docs/CUDNN-GRAPH.md)"
                .into(),
        ),
        _ => match graph_supported(layout, dtype) {
            Ok(()) => {
                graph("auto: cuDNN documents its graph BatchNorm engines for this layout and type")
            }
            Err(why) => legacy(why),
        },
    }
}

/// Whether the activation of a graph-route BatchNorm (`graph`: [`infer_cudnn_api`] said graph,
/// on cuDNN, not the own path) goes into the graph, with the plan's `epilogue:` line; `None`
/// without an activation or off the graph route. `numel` is the tensor's element count (the
/// mask's memory cost).
///
/// Training: `NORM_FORWARD → (ADD addend →) RELU_FWD → y`, and `CMP_GT(y, 0)` written as a real
/// `BOOLEAN` mask, as one graph; the backward `dy · mask (MUL) → NORM_BACKWARD` (cudnn-frontend's
/// "SGBN Add Relu" / "DBN Add Relu" samples; for Add+ReLU the masked dy is also written as
/// d_addend). The saved state keeps the mask between the two: 1 byte per element allocated
/// (cuDNN's `BOOLEAN` layout is cuDNN's own; 1 byte per element holds it packed or not), where
/// the fallback keeps 1 bit per element. The backward form that reads y instead (`RELU_BWD`)
/// lists 0 engine configs on cuDNN 9.19 (H100, measured). Both graphs are built at the first
/// forward; if either does not finalize, the fallback path runs: graph BatchNorm, then
/// nnfuse's bitmask kernels. Inference: the epilogue after `NORM_FORWARD (inference)`, no mask,
/// else nnfuse's activation kernel.
pub fn graph_epilogue(graph: bool, phase: Phase, fuse: Fuse, numel: usize) -> Option<String> {
    if !graph || fuse == Fuse::None {
        return None;
    }
    let chain = match fuse {
        Fuse::AddRelu => "ADD (addend) → RELU_FWD",
        _ => "RELU_FWD",
    };
    Some(match phase {
        Phase::Training => format!(
            "epilogue: graph — NORM_FORWARD → {chain} → y, CMP_GT(y, 0) → BOOLEAN mask, as one \
             graph; backward dy · mask → NORM_BACKWARD{} (the mask costs 1 byte per element, \
             {numel} bytes per saved state, against the fallback's 1 bit); if either graph does \
             not finalize, graph BatchNorm + nnfuse's bitmask kernels (the fallback path)",
            if fuse == Fuse::AddRelu {
                ", writing d_addend"
            } else {
                ""
            }
        ),
        Phase::Inference => format!(
            "epilogue: graph — NORM_FORWARD (inference) → {chain} as one graph; if it does not \
             finalize, graph BatchNorm + nnfuse's activation kernel"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_version_matches_the_graph_layer() {
        assert_eq!(
            GRAPH_MIN_CUDNN_VERSION,
            crate::cudnn_graph::build::MIN_CUDNN_VERSION
        );
    }

    #[test]
    fn graph_is_taken_only_where_it_applies() {
        let nhwc = ChannelLayout::example(TensorFormat::Nhwc);
        let sp = BnMode::SpatialPersistent;
        let t = Phase::Training;
        let v = 91900;
        let graph = Config::default().with_cudnn_api(CudnnApi::Graph);
        let (on, why) = infer_cudnn_api(&nhwc, sp, t, DType::F16, &graph, v, true);
        assert!(
            on && why.starts_with("cuDNN API: graph (graph) — forced"),
            "{why}"
        );
        // Forced graph is tried on any layout and type.
        let nchw = ChannelLayout::example(TensorFormat::Nchw);
        assert!(infer_cudnn_api(&nchw, BnMode::Spatial, t, DType::F32, &graph, v, true).0);
        // Inference through the graph too (the inverse standard deviation computed first).
        let (on, why) = infer_cudnn_api(&nhwc, sp, Phase::Inference, DType::F16, &graph, v, true);
        assert!(on && why.contains("NORM_FORWARD (inference"), "{why}");
        for (mode, phase, version, what) in [
            (BnMode::PerActivation, Phase::Inference, v, "PER_ACTIVATION"),
            (BnMode::PerActivation, t, v, "PER_ACTIVATION"),
            (sp, t, 8907, "predates"),
        ] {
            let (on, why) = infer_cudnn_api(&nhwc, mode, phase, DType::F16, &graph, version, true);
            assert!(!on && why.starts_with("cuDNN API: legacy (graph)"), "{why}");
            assert!(why.contains(what), "{why}");
        }
        let legacy = Config::default().with_cudnn_api(CudnnApi::Legacy);
        let (on, why) = infer_cudnn_api(&nhwc, sp, t, DType::F16, &legacy, v, true);
        assert!(!on && why.contains("is legacy"), "{why}");
        let (on, why) = infer_cudnn_api(&nhwc, sp, t, DType::F16, &graph, v, false);
        assert!(
            !on && why == "cuDNN API: none — cuDNN cannot be loaded",
            "{why}"
        );
        let auto = Config::default();
        let (on, why) = infer_cudnn_api(&nhwc, sp, t, DType::F16, &auto, v, true);
        assert_eq!(on, GRAPH_FOR_AUTO, "{why}");
        if !GRAPH_FOR_AUTO {
            assert!(why.contains("GRAPH_FOR_AUTO is off"), "{why}");
        }
    }

    #[test]
    fn documented_support_is_nhwc_halves() {
        let nhwc = ChannelLayout::example(TensorFormat::Nhwc);
        assert!(graph_supported(&nhwc, DType::F16).is_ok());
        assert!(graph_supported(&nhwc, DType::BF16).is_ok());
        assert!(graph_supported(&nhwc, DType::F32)
            .unwrap_err()
            .contains("f32"));
        let nchw = ChannelLayout::example(TensorFormat::Nchw);
        assert!(graph_supported(&nchw, DType::F16)
            .unwrap_err()
            .contains("NCHW"));
    }

    #[test]
    fn epilogues_go_into_the_graph_with_a_reason() {
        for phase in [Phase::Training, Phase::Inference] {
            assert_eq!(graph_epilogue(true, phase, Fuse::None, 64), None);
            assert_eq!(graph_epilogue(false, phase, Fuse::Relu, 64), None);
            let relu = graph_epilogue(true, phase, Fuse::Relu, 64).unwrap();
            assert!(relu.starts_with("epilogue: graph — NORM_FORWARD"), "{relu}");
            assert!(relu.contains("RELU_FWD") && !relu.contains("ADD"), "{relu}");
            let add = graph_epilogue(true, phase, Fuse::AddRelu, 64).unwrap();
            assert!(add.contains("ADD (addend) → RELU_FWD"), "{add}");
        }
        // The backward reads the forward's BOOLEAN mask (RELU_BWD from y: 0 engines on
        // cuDNN 9.19, measured), and the line names the mask's memory.
        let t = graph_epilogue(true, Phase::Training, Fuse::AddRelu, 64).unwrap();
        assert!(
            t.contains("dy · mask → NORM_BACKWARD") && t.contains("d_addend"),
            "{t}"
        );
        assert!(t.contains("BOOLEAN mask") && t.contains("64 bytes"), "{t}");
        assert!(t.contains("bitmask kernels"), "{t}");
        let i = graph_epilogue(true, Phase::Inference, Fuse::Relu, 64).unwrap();
        assert!(
            i.contains("(inference)") && i.contains("activation kernel"),
            "{i}"
        );
    }
}
