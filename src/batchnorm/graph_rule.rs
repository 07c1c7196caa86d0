//! Which cuDNN API runs a BatchNorm planned on cuDNN: the graph (backend) API's execution plans
//! (`NORM_FORWARD` / `NORM_BACKWARD`, `src/cudnn_graph/graph_bn.rs`) or the legacy entry points
//! (`cudnnBatchNormalization*`, deprecated in cuDNN 9), with the reason. Pure: no GPU calls.
//!
//! `NNFUSE_CUDNN_API` / [`Config::cudnn_api`]: `legacy` keeps the legacy calls; `graph` takes the
//! graph wherever it can be expressed (training, per-channel statistics, cuDNN 9 or newer) and
//! falls back to the legacy calls at the first call when no engine config finalizes; `auto`
//! takes the graph only where [`GRAPH_FOR_AUTO`] is on and the layout and type are ones cuDNN
//! documents for its BatchNorm engines ([`graph_supported`]). [`GRAPH_FOR_AUTO`] is off until
//! the graph route is measured on the GPU (accuracy against the f64 reference and the legacy
//! route, host and GPU time): `docs/CUDNN-GRAPH.md`, "BatchNorm".

use crate::batchnorm::types::{BnMode, Phase};
use crate::config::{Config, CudnnApi};
use crate::dtype::DType;
use crate::layout::{ChannelLayout, TensorFormat};

/// The first cuDNN with the graph API in `libcudnn_graph` (9.0), as the graph layer requires
/// (`cudnn_graph::build::MIN_CUDNN_VERSION`; kept here so that the plan stays free of FFI).
pub const GRAPH_MIN_CUDNN_VERSION: usize = 90000;

/// Whether `NNFUSE_CUDNN_API=auto` takes the graph route for BatchNorm where it applies. Off: the
/// route is built and tested against the f64 reference (`tests/gpu_batchnorm_graph.rs`) but not
/// yet measured on the H100 against the legacy calls; `graph` forces it. Flip it when the GPU
/// tests pass and `benches/batchnorm.rs` / `benches/host_overhead.rs` show it at least as fast.
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
    if phase == Phase::Inference {
        return legacy(
            "inference: cuDNN's graph BatchNorm inference (NORM_FORWARD, phase INFERENCE) takes \
             the mean and the inverse standard deviation, not the running variance; not built \
             (docs/CUDNN-GRAPH.md)"
                .into(),
        );
    }
    if mode == BnMode::PerActivation {
        return legacy(
            "CUDNN_BATCHNORM_PER_ACTIVATION keeps statistics per (c, h, w); the graph's \
             NORM_FORWARD batch norm normalises per channel only"
                .into(),
        );
    }
    let graph = |why: &str| {
        (
            true,
            format!(
                "cuDNN API: graph ({api}) — {why}: NORM_FORWARD (training) / NORM_BACKWARD \
                 execution plans built once per shape and cached, a cached call sets only the \
                 variant pack's pointers and scalars; cuDNN's BatchNorm engines compile at run \
                 time (the first call of a shape waits for it); if no engine config finalizes, \
                 the legacy calls run instead (logged)"
            ),
        )
    };
    match api {
        CudnnApi::Graph => graph("forced by NNFUSE_CUDNN_API / Config::cudnn_api"),
        _ if !GRAPH_FOR_AUTO => legacy(
            "the graph route is not yet measured on the GPU against the legacy calls \
             (GRAPH_FOR_AUTO is off); NNFUSE_CUDNN_API=graph forces it (docs/CUDNN-GRAPH.md)"
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
        for (mode, phase, version, what) in [
            (sp, Phase::Inference, v, "inference"),
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
}
